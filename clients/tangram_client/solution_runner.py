"""The solution's own process: it imports the solution and answers what the test process asks of it.

Started by ``tangram_client/solution_proxy.py`` as ``python3 -c BOOT WIRE RUNNER CODE_PATH REQUEST_FD REPLY_FD`` (the
sources of ``tangram_client/solution_wire.py`` and of this file, read before any solution code ran), with stdin
from /dev/null and stdout/stderr into files of the test process (relayed into the test's captured output), never
the test process's own streams. Everything here runs beside the solution's code, which may rewrite any of it: the
test process trusts none of its answers beyond their being data (``tangram_client/solution_wire.py``). What this process
does first, before the solution's code, is confine itself where the kernel can (``confine``), so that the solution
cannot signal or ptrace processes outside it (pytest, the sandbox's executor).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import struct
import sys
import traceback
import types
from typing import Any

from tangram_client.solution_wire import OPERATIONS, Decoder, Encoder, WireError, receive, send

#: the name the solution's module has in both processes (its classes' ``__module__``)
MODULE_NAME = "solution"
TRACEBACK_CHARS = 8000

# Landlock (Linux >= 6.12 for scopes): the syscall numbers are the same on every architecture
_LANDLOCK_CREATE_RULESET, _LANDLOCK_RESTRICT_SELF = 444, 446
_LANDLOCK_CREATE_RULESET_VERSION = 1
_LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET, _LANDLOCK_SCOPE_SIGNAL = 1, 2
_LANDLOCK_SCOPES_ABI = 6
_PR_SET_NO_NEW_PRIVS = 38


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (or a seccomp filter hides it)."""
    try:
        abi = _libc().syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), None, ctypes.c_long(0),
                              ctypes.c_long(_LANDLOCK_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(abi), 0)


def confine() -> int:
    """Put this process (and all it starts) in a Landlock domain scoped for signals and abstract unix sockets, so it
    cannot signal, ptrace or connect to anything outside: a defence in depth, not what the reward's integrity rests
    on. Returns the kernel's Landlock ABI when applied, 0 where the kernel (or its seccomp filter) cannot."""
    abi = landlock_abi()
    if abi < _LANDLOCK_SCOPES_ABI:
        return 0
    libc = _libc()
    # struct landlock_ruleset_attr: handled_access_fs, handled_access_net, scoped (no file or network rules)
    attributes = ctypes.create_string_buffer(struct.pack(
        "=QQQ", 0, 0, _LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | _LANDLOCK_SCOPE_SIGNAL), 24)
    ruleset = libc.syscall(ctypes.c_long(_LANDLOCK_CREATE_RULESET), attributes, ctypes.c_long(24), ctypes.c_long(0))
    if ruleset < 0:
        return 0
    try:
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                      ctypes.c_ulong(0)) != 0:
            return 0
        if libc.syscall(ctypes.c_long(_LANDLOCK_RESTRICT_SELF), ctypes.c_long(ruleset), ctypes.c_long(0)) != 0:
            return 0
    finally:
        os.close(ruleset)
    return abi


def describe(error: BaseException, encoder: Encoder) -> dict[str, Any]:
    """An exception as the test process rebuilds it: its classes (nearest first), its args, its text and where it
    was raised."""
    try:
        args = encoder.value(error.args)
    except (TypeError, RecursionError, ValueError):
        args = None
    try:
        text = str(error)
    except Exception:  # noqa: BLE001 - a __str__ that raises still leaves the type
        text = f"<{type(error).__name__}>"
    formatted = "".join(traceback.format_exception(error))
    return {"mro": [[str(getattr(kind, "__module__", "?")), str(getattr(kind, "__qualname__", "?"))]
                    for kind in type(error).__mro__ if kind is not object],
            "args": args, "str": text, "traceback": formatted[-TRACEBACK_CHARS:]}


class Server:
    """Answers requests ``{"op", "args", "kwargs"}`` with ``{"ok": value}`` or ``{"error": ...}``, plus ``"sync"``:
    the arguments' containers the call changed, as it left them."""

    def __init__(self, module: types.ModuleType) -> None:
        self.module = module
        self.objects: list[Any] = []  # by handle; kept alive, so ids (and handles) stay unique
        self.handles: dict[int, int] = {}

    def export(self, encoder: Encoder, x: Any) -> dict[str, Any]:
        handle = self.handles.get(id(x))
        if handle is None:
            handle = self.handles[id(x)] = len(self.objects)
            self.objects.append(x)
        kind = type(x)
        return {"h": handle, "k": [str(getattr(kind, "__module__", "?")), str(getattr(kind, "__qualname__", "?"))]}

    def resolve(self, reference: dict[str, Any]) -> Any:
        if "g" in reference:
            return getattr(self.module, str(reference["g"]))
        handle = reference.get("h")
        if type(handle) is not int or not 0 <= handle < len(self.objects):
            raise WireError(f"no object {handle!r}")
        return self.objects[handle]

    def answer(self, request: Any) -> dict[str, Any]:
        decoder = Decoder(self.resolve)
        try:
            if not isinstance(request, dict):
                raise WireError("a request is an object")
            op = request.get("op")
            if op == "global":
                function: Any = functools.partial(getattr, self.module)
            elif op in OPERATIONS:
                function = OPERATIONS[op]
            else:
                raise WireError(f"unknown operation {op!r}")
            args, kwargs = decoder.value(request.get("args")), decoder.value(request.get("kwargs"))
            result = function(*args, **kwargs)
        except BaseException as error:  # noqa: BLE001 - every error of the solution's is the test's to see
            return self._reply(decoder, error=error)
        return self._reply(decoder, result=result)

    def _reply(self, decoder: Decoder, *, result: Any = None, error: BaseException | None = None) -> dict[str, Any]:
        encoder = Encoder(self.export, decoder.containers)
        try:
            states = ((n, encoder.state(container)) for n, container in enumerate(decoder.containers))
            sync = [[n, state] for n, state in states if next(iter(state.values())) != decoder.payloads.get(n)]
            if error is None:
                return {"sync": sync, "ok": encoder.value(result)}
            return {"sync": sync, "error": describe(error, encoder)}
        except (TypeError, ValueError, RecursionError) as failure:  # a value the wire cannot carry (too deep)
            return {"error": describe(failure, Encoder(self.export, decoder.containers))}


def load(code_path: str) -> types.ModuleType:
    """Import the solution's file as the module ``solution``, its directory on the path as it would be in-process."""
    spec = importlib.util.spec_from_file_location(MODULE_NAME, code_path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load the solution from {code_path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[MODULE_NAME] = module
    sys.path.insert(0, os.path.dirname(os.path.abspath(code_path)))
    sys.argv = [code_path]
    spec.loader.exec_module(module)
    return module


def _data_only(encoder: Encoder, x: Any) -> Any:
    raise TypeError(f"{type(x).__name__} is not data")


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def main(argv: list[str]) -> None:
    code_path, request_fd, reply_fd = argv[0], int(argv[1]), int(argv[2])
    for fd in (request_fd, reply_fd):
        os.set_inheritable(fd, False)
    confine()
    try:
        module = load(code_path)
    except BaseException as error:  # noqa: BLE001 - a solution that does not import is the test's to see
        _flush()
        send(reply_fd, {"error": describe(error, Encoder(_data_only))})
        return
    _flush()
    send(reply_fd, {"ready": True})
    server = Server(module)
    while (request := receive(request_fd)) is not None:
        reply = server.answer(request)
        _flush()
        try:
            send(reply_fd, reply)
        except WireError as error:  # an answer over the frame limit
            send(reply_fd, {"error": describe(error, Encoder(_data_only))})
