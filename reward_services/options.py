"""Each backend's ``[gpu.services.NAME.options]``, typed: read once with the config, so a typo or a wrong type
stops the broker at start, not a service's first launch. ``torch_worker.py`` and ``sglang.py`` say what each means."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, TypeVar

from pydantic import Field, StrictStr

from tangram.core.config_tables import TABLE, Count, PositiveSeconds

T = TypeVar("T")


@dataclass(frozen=True)
class TorchOptions:
    __pydantic_config__ = TABLE

    #: texts per forward pass on one device (sentence-transformers' default)
    batch_size: Count = 32


@dataclass(frozen=True)
class SglangOptions:
    __pydantic_config__ = TABLE

    #: the argv prefix that starts a server; our flags and then ``args`` follow it
    command: Annotated[tuple[StrictStr, ...], Field(min_length=1)] = ("python3", "-m", "sglang.launch_server")
    #: extra server flags, appended
    args: tuple[StrictStr, ...] = ()
    #: extra environment for the server
    env: Mapping[str, StrictStr] = field(default_factory=dict)
    #: the server's working directory
    cwd: StrictStr | None = None
    start_timeout_s: PositiveSeconds = 900.0
    release_timeout_s: PositiveSeconds = 60.0
    #: one HTTP call to the server
    request_timeout_s: PositiveSeconds = 600.0


#: the options type of each backend
OPTIONS: dict[str, type[TorchOptions | SglangOptions]] = {"torch": TorchOptions, "sglang": SglangOptions}
ServiceOptions = TorchOptions | SglangOptions


def options_of(name: str, options: ServiceOptions | None, kind: type[T]) -> T:
    """A service's options as its backend's type; ``None`` is every default."""
    if options is None:
        return kind()
    if not isinstance(options, kind):
        raise TypeError(f"service {name!r}: {type(options).__name__} given to a backend that reads {kind.__name__}")
    return options
