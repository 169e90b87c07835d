"""The values that cross between a test process and the solution's own process (``tangram_client/solution_proxy.py`` and
``tangram_client/solution_runner.py``): tagged JSON over a pipe, never pickle.

Not pickle, because unpickling calls whatever the bytes name: a solution answering with pickle bytes would run its
code in the test process, the very thing its own process is there to prevent. The receiving side here builds data
only (exact builtin types and a few stdlib containers) and references it was told about; anything else is a
``WireError``. Both files are shipped into the sandbox beside the tests, so this module uses the stdlib alone.

A value is JSON: None, bool, str and float (NaN and the infinities as JSON's usual extensions) as themselves, an int
within 64 bits as itself, and everything else as an object with one tag::

    {"i": hex} a larger int     {"t": [...]} tuple      {"f": [...]} frozenset   {"b": base64} bytes
    {"c": [re, im]} complex     {"D": "1.5"} Decimal    {"F": [n, d]} Fraction
    {"n": [typename, [fields], [values]]} a namedtuple
    {"l": [...]} list   {"d": [[k, v], ...]} dict   {"s": [...]} set   {"y": base64} bytearray
    {"q": [[...], maxlen]} deque   {"C": [[k, v], ...]} Counter   {"O": [[k, v], ...]} OrderedDict
    {"r": k} the container numbered k again          {"h": n, "k": [module, qualname]} an object of the solution
    {"g": name} a top-level name of the solution

Mutable containers (the second row) carry ``"m"``, their number: numbers count up from those the receiver already
knows, so shared and cyclic structure survives, and a reply can name the caller's arguments to hand back what the
solution did to them (``Encoder.state`` / ``Decoder.update``).
"""

from __future__ import annotations

import base64
import binascii
import builtins
import collections
import decimal
import fractions
import json
import operator
import os
import struct
from collections.abc import Callable
from typing import Any

#: a frame larger than this is a broken or hostile peer, not a value of a test
MAX_FRAME_BYTES = 256 << 20
_HEADER = struct.Struct(">I")
_SMALL_INT = 1 << 63
#: mutable containers by exact type, and their tags
_MUTABLE: dict[type, str] = {list: "l", dict: "d", set: "s", bytearray: "y", collections.deque: "q",
                             collections.Counter: "C", collections.OrderedDict: "O", collections.defaultdict: "d"}
_NEW = {"l": list, "d": dict, "s": set, "C": collections.Counter, "O": collections.OrderedDict}
_PAIRS = frozenset("dCO")

#: what either side may ask of a value: the operator or builtin behind each Python protocol a proxy forwards
OPERATIONS: dict[str, Callable[..., Any]] = {
    "call": lambda function, *args, **kwargs: function(*args, **kwargs),
    "getattr": getattr, "setattr": setattr, "delattr": delattr, "repr": repr, "str": str, "format": format,
    "len": len, "iter": iter, "next": next, "hash": hash, "bool": bool, "int": int, "float": float,
    "index": operator.index, "reversed": reversed, "divmod": divmod, "contains": operator.contains,
    **{name: getattr(operator, name) for name in (
        "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "lshift", "rshift", "and_", "or_", "xor",
        "eq", "ne", "lt", "le", "gt", "ge", "getitem", "setitem", "delitem", "neg", "pos", "abs", "invert")},
}


class WireError(Exception):
    """A frame or value outside this protocol."""


Export = Callable[["Encoder", Any], Any]
Resolve = Callable[[dict[str, Any]], Any]


def _is_namedtuple(kind: type) -> bool:
    return issubclass(kind, tuple) and kind.__bases__ == (tuple,) and isinstance(getattr(kind, "_fields", None),
                                                                                  tuple)


_PLAIN = frozenset({str, float, bool, type(None)})
_PLAIN_OR_INT = _PLAIN | {int}
_JSON_CONTAINERS = frozenset({dict, list})


def _small_ints(x: Any, kinds: set[type]) -> bool:
    """Whether every int of ``x`` fits 64 bits (checked at C speed when they are all ints)."""
    if kinds == {int}:
        return -_SMALL_INT <= min(x) and max(x) < _SMALL_INT
    return all(-_SMALL_INT <= item < _SMALL_INT for item in x if type(item) is int)


class Encoder:
    """Turns values into JSON for one message. ``export`` answers for whatever is not data (or raises TypeError);
    ``containers`` continues a numbering the receiver already has (a reply naming the request's arguments)."""

    def __init__(self, export: Export, containers: list[Any] | None = None) -> None:
        self.export = export
        self.containers: list[Any] = list(containers or [])
        self._numbers = {id(container): n for n, container in enumerate(self.containers)}

    def value(self, x: Any) -> Any:
        kind = type(x)
        if x is None or kind is bool or kind is str or kind is float:
            return x
        if kind is int:
            return x if -_SMALL_INT <= x < _SMALL_INT else {"i": format(x, "x")}
        tag = _MUTABLE.get(kind)
        if tag is not None:
            number = self._numbers.get(id(x))
            if number is not None:
                return {"r": number}
            self._numbers[id(x)] = len(self.containers)
            self.containers.append(x)
            return {tag: self._contents(tag, x), "m": self._numbers[id(x)]}
        if kind is tuple:
            return {"t": self.items(x)}
        if kind is frozenset:
            return {"f": self.items(x)}
        if kind is bytes:
            return {"b": base64.b64encode(x).decode()}
        if kind is complex:
            return {"c": [x.real, x.imag]}
        if kind is decimal.Decimal:
            return {"D": str(x)}
        if kind is fractions.Fraction:
            return {"F": [self.value(x.numerator), self.value(x.denominator)]}
        if _is_namedtuple(kind):
            return {"n": [kind.__name__, list(kind._fields), [self.value(item) for item in x]]}
        return self.export(self, x)

    def state(self, container: Any) -> dict[str, Any]:
        """What a container already numbered holds now (its own number is not repeated)."""
        tag = _MUTABLE[type(container)]
        return {tag: self._contents(tag, container)}

    def _contents(self, tag: str, x: Any) -> Any:
        if tag in _PAIRS:
            return [[self.value(key), self.value(item)] for key, item in x.items()]
        if tag == "y":
            return base64.b64encode(x).decode()
        if tag == "q":
            return [self.items(x), x.maxlen]
        return self.items(x)

    def items(self, x: Any) -> list[Any]:
        """The items of a sequence or set; those that JSON carries as they are (the common list of numbers or
        strings) in one pass at C speed."""
        kinds = set(map(type, x))
        if kinds <= _PLAIN or (kinds <= _PLAIN_OR_INT and (int not in kinds or _small_ints(x, kinds))):
            return list(x)
        return [self.value(item) for item in x]


class Decoder:
    """Builds values from one message's JSON. ``resolve`` answers for ``h`` and ``g`` references (or raises
    WireError); ``containers`` are those the sender may name by number (the request's arguments, in a reply)."""

    def __init__(self, resolve: Resolve, containers: list[Any] | None = None) -> None:
        self.resolve = resolve
        self.containers: list[Any] = list(containers or [])
        #: the JSON each numbered container came as (its tag's payload), by number
        self.payloads: dict[int, Any] = {}

    def value(self, x: Any) -> Any:
        try:
            return self._value(x)
        except WireError:
            raise
        except (TypeError, ValueError, KeyError, IndexError, ArithmeticError, RecursionError, binascii.Error,
                decimal.InvalidOperation) as error:
            raise WireError(f"not a value: {type(error).__name__}: {error}") from None

    def update(self, container: Any, state: Any) -> None:
        """Make ``container`` (one the sender knows by number) hold ``state`` (``Encoder.state``), in place."""
        try:
            tag, payload = _tagged(state)
            fresh = self._build(tag, payload, None)
        except (TypeError, ValueError, KeyError, IndexError, RecursionError, binascii.Error) as error:
            raise WireError(f"not a container's state: {type(error).__name__}: {error}") from None
        _replace(container, fresh)

    def _value(self, x: Any) -> Any:
        kind = type(x)
        if x is None or kind is bool or kind is str or kind is float or kind is int:
            return x
        tag, payload = _tagged(x)
        if tag in ("h", "g"):
            return self.resolve(x)
        if tag == "r":
            if type(payload) is not int or not 0 <= payload < len(self.containers):
                raise WireError(f"no container {payload!r}")
            return self.containers[payload]
        if tag in _NEW or tag in ("y", "q"):
            if x.get("m") != len(self.containers):
                raise WireError(f"container numbered {x.get('m')!r}, expected {len(self.containers)}")
            self.payloads[len(self.containers)] = payload
            return self._build(tag, payload, len(self.containers))
        if tag == "i":
            return int(_typed(payload, str), 16)
        if tag == "t":
            return tuple(self._items(payload))
        if tag == "f":
            return frozenset(self._items(payload))
        if tag == "b":
            return base64.b64decode(_typed(payload, str), validate=True)
        if tag == "c":
            real, imag = _typed(payload, list)
            return complex(_number(real), _number(imag))
        if tag == "D":
            return decimal.Decimal(_typed(payload, str))
        if tag == "F":
            numerator, denominator = (self._value(part) for part in _typed(payload, list))
            return fractions.Fraction(_typed(numerator, int), _typed(denominator, int))
        if tag == "n":
            typename, fields, items = _typed(payload, list)
            return _namedtuple(_typed(typename, str), tuple(_typed(fields, list)))(
                *(self._value(item) for item in _typed(items, list)))
        raise WireError(f"unknown tag {tag!r}")

    def _items(self, payload: Any) -> Any:
        """The values of a JSON list of them; one without objects or lists holds plain values already."""
        if set(map(type, _typed(payload, list))).isdisjoint(_JSON_CONTAINERS):
            return payload
        return [self._value(item) for item in payload]

    def _build(self, tag: str, payload: Any, number: int | None) -> Any:
        """A new container of ``tag``; numbered (visible to references inside it) before it is filled."""
        if tag == "y":
            built: Any = bytearray(base64.b64decode(_typed(payload, str), validate=True))
            if number is not None:
                self.containers.append(built)
            return built
        if tag == "q":
            items, maxlen = _typed(payload, list)
            if maxlen is not None and (type(maxlen) is not int or maxlen < 0):
                raise WireError(f"deque maxlen {maxlen!r}")
            built = collections.deque(maxlen=maxlen)
            if number is not None:
                self.containers.append(built)
            built.extend(self._items(items))
            return built
        built = _NEW[tag]()
        if number is not None:
            self.containers.append(built)
        if tag in _PAIRS:
            for pair in _typed(payload, list):
                key, item = _typed(pair, list)
                built[self._value(key)] = self._value(item)
        elif tag == "s":
            built.update(self._items(payload))
        else:
            built.extend(self._items(payload))
        return built


def _tagged(x: Any) -> tuple[str, Any]:
    if type(x) is not dict:
        raise WireError(f"not a value: {type(x).__name__}")
    tags = [key for key in x if key not in ("m", "k")]
    if len(tags) != 1:
        raise WireError(f"a value has one tag, not {sorted(x)}")
    return tags[0], x[tags[0]]


def _typed(x: Any, kind: type) -> Any:
    if type(x) is not kind:
        raise WireError(f"expected {kind.__name__}, got {type(x).__name__}")
    return x


def _number(x: Any) -> float:
    if type(x) not in (int, float):
        raise WireError(f"expected a number, got {type(x).__name__}")
    return float(x)


_NAMEDTUPLES: dict[tuple[str, tuple[str, ...]], type] = {}


def _namedtuple(typename: str, fields: tuple[str, ...]) -> type:
    """A local namedtuple type per name and fields (``collections.namedtuple`` refuses names that are not
    identifiers, so nothing but a tuple type comes of them)."""
    if not all(type(field) is str for field in fields):
        raise WireError("namedtuple fields must be strings")
    key = (typename, fields)
    if key not in _NAMEDTUPLES:
        _NAMEDTUPLES[key] = collections.namedtuple(typename, fields)  # type: ignore[misc]
    return _NAMEDTUPLES[key]


def _replace(container: Any, fresh: Any) -> None:
    """Give ``container`` the contents of ``fresh`` (the same kind), keeping its identity."""
    if isinstance(container, bytearray) and isinstance(fresh, bytearray):
        container[:] = fresh
    elif isinstance(container, (list, collections.deque)) and isinstance(fresh, (list, collections.deque)):
        container.clear()
        container.extend(fresh)
    elif isinstance(container, dict) and isinstance(fresh, dict):
        container.clear()
        dict.update(container, fresh)
    elif isinstance(container, set) and isinstance(fresh, set):
        container.clear()
        container.update(fresh)
    else:
        raise WireError(f"a {type(container).__name__} cannot take the contents of a {type(fresh).__name__}")


def send(fd: int, message: Any) -> None:
    """Write one frame: a 4-byte length, then the message as JSON."""
    data = json.dumps(message, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME_BYTES:
        raise WireError(f"a message of {len(data)} bytes is over {MAX_FRAME_BYTES}")
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def receive(fd: int) -> Any:
    """Read one frame; None at end of stream before it. Raises WireError for a frame out of protocol."""
    header = _read_exactly(fd, _HEADER.size)
    if header is None:
        return None
    (size,) = _HEADER.unpack(header)
    if size > MAX_FRAME_BYTES:
        raise WireError(f"a frame of {size} bytes is over {MAX_FRAME_BYTES}")
    body = _read_exactly(fd, size)
    if body is None:
        raise WireError("the stream ended inside a frame")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as error:
        raise WireError(f"a frame that is not JSON: {error}") from None


def _read_exactly(fd: int, size: int) -> bytes | None:
    chunks: list[bytes] = []
    left = size
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            if chunks:
                raise WireError("the stream ended inside a frame")
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


#: exception classes a test process rebuilds by name (SystemExit too: tests check a CLI's exit with it); the rest,
#: and KeyboardInterrupt above all (it would stop the whole session), arrive as the proxy's own error type
BUILTIN_EXCEPTIONS: dict[str, type[BaseException]] = {
    name: value for name, value in vars(builtins).items()
    if isinstance(value, type) and (issubclass(value, Exception) or value is SystemExit)
    and not issubclass(value, getattr(builtins, "BaseExceptionGroup", ())) and value is not Exception}  # 3.11+
