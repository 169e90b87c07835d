"""The solution under test, seen from the test process: its code runs in a process of its own, never in pytest's.

A solution imported into the pytest process can rewrite pytest (``Function.runtest``, the reporter) and score tests
it fails. Here the module ``solution`` the tests import is a shim (``install``): it starts the solution's code in
its own interpreter (``tangram_client/solution_runner.py``; stdin /dev/null, stdout and stderr into files this
process relays into the test's captured output, none of pytest's descriptors) and stands in for its top-level names.
The process is started at the first use of the solution once pytest has collected the tests (``open_gate``, called
by ``tangram_client/reward_report.py``): a call while collecting is recorded and made at its value's first use, so
that no solution code runs before every pytest process (each xdist worker) has read its test files; using a value
while collecting raises ``CalledDuringCollection``. Each pytest process has its own solution process.

What crosses is data (``tangram_client/solution_wire.py``, never pickle) or a reference. What works as in-process:
functions and constants; the solution's classes, as local stand-ins built from its source (never run here):
instances, methods, attributes, ``isinstance``, class attributes; exceptions re-raised with their type (builtin
ones, and the solution's own classes declared at top level, so ``pytest.raises(solution.MyError)`` works) and
args; lists, dicts, sets, bytearrays passed as arguments get back what the solution did to them during that call,
and a returned argument is the caller's object; the solution's objects keep their identity across calls;
generators and iterators; ``print`` output (``capsys``); ``from solution import *``.

What does not: callables of the test passed to the solution (a ``key=lambda``, a decorated test function), and any
object of the test's own that is not data; changes the solution makes to an argument after the call returns;
exception attributes other than ``args``; ``monkeypatch``/``mock.patch`` of the solution's names (they patch the
shim); ``inspect.getsource``; using the solution while collecting (``parametrize`` values computed by it). An
object of the solution's compared with data is unequal whatever its ``__eq__`` says (the always-equal object);
truth, ``len``, iteration and comparisons between two of its objects are its own word, as they are in-process.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from tangram_client.pytest_guard import make_undumpable
from tangram_client.solution_wire import BUILTIN_EXCEPTIONS, OPERATIONS, Decoder, Encoder, WireError, receive, send

#: the module name of the solution in both processes
MODULE_NAME = "solution"
#: bytes of the solution's output (per stream) relayed after one call; the rest is left out, with a line saying so
RELAY_LIMIT = 1 << 20
#: the solution's process runs the runner and the wire from the sources the shim read while pytest collected, not
#: from files the solution (another worker's) may have rewritten by the time it starts
BOOT = """import sys, types
sys.modules["tangram_client"] = types.ModuleType("tangram_client")
for name, source in (("tangram_client.solution_wire", sys.argv[1]), ("tangram_client.solution_runner", sys.argv[2])):
    module = sys.modules[name] = types.ModuleType(name)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
module.main(sys.argv[3:])
"""
#: base classes a stand-in for an exception class of the solution may take (a KeyboardInterrupt raised in a test
#: would end the whole session: such classes become plain exceptions)
_EXCEPTION_BASES: dict[str, type[BaseException]] = {**BUILTIN_EXCEPTIONS, "Exception": Exception,
                                                     "BaseException": Exception, "KeyboardInterrupt": Exception,
                                                     "GeneratorExit": Exception}


class SolutionError(Exception):
    """An exception of the solution's whose class the test process does not know, or its process gone or out of
    protocol."""


class CalledDuringCollection(RuntimeError):
    """A value of the solution's was needed while pytest collected the tests."""


_gate_open = True


def close_gate() -> None:
    """From now until ``open_gate``, uses of the solution are recorded, not made."""
    global _gate_open
    _gate_open = False


def open_gate() -> None:
    """The solution may run: every test file this process reads is read."""
    global _gate_open
    _gate_open = True


class _Pending:
    """A value to compute in the solution's process at its first use."""

    __slots__ = ("compute",)

    def __init__(self, compute: Callable[[], Any]) -> None:
        self.compute = compute


class _Data:
    """A pending value that turned out to be data: it is used here."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class SolutionObject:
    """An object of the solution's process (a handle), or a value still to be computed there."""

    __slots__ = ("_solution_ref",)

    def __getattr__(self, name: str) -> Any:
        if _dunder(name) or name == "_solution_ref" or (not _gate_open and name.startswith("_")):
            raise AttributeError(name)  # pytest and inspect probe such names; none is the solution's business
        if not _gate_open:
            return _pending(lambda: _operate(self, "getattr", name))
        return _operate(self, "getattr", name)

    def __setattr__(self, name: str, value: Any) -> None:
        _operate(self, "setattr", name, value)

    def __delattr__(self, name: str) -> None:
        _operate(self, "delattr", name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _gate_open:
            return _pending(lambda: _operate(self, "call", *args, **kwargs))
        return _operate(self, "call", *args, **kwargs)

    def __repr__(self) -> str:
        if not _gate_open and type(object.__getattribute__(self, "_solution_ref")) is _Pending:
            return f"<{MODULE_NAME} value, computed at its first use>"
        return str(_operate(self, "repr"))

    def __str__(self) -> str:
        return str(_operate(self, "str"))

    def __format__(self, spec: str) -> str:
        return str(_operate(self, "format", spec))

    def __hash__(self) -> int:
        return int(_operate(self, "hash"))

    def __bool__(self) -> bool:
        return _operate(self, "bool") is True

    def __len__(self) -> int:
        return int(_operate(self, "len"))

    def __iter__(self) -> Any:
        return _operate(self, "iter")

    def __next__(self) -> Any:
        return _operate(self, "next")

    def __reversed__(self) -> Any:
        return _operate(self, "reversed")

    def __contains__(self, item: Any) -> bool:
        return bool(_operate(self, "contains", item))

    def __getitem__(self, key: Any) -> Any:
        return _operate(self, "getitem", key)

    def __setitem__(self, key: Any, value: Any) -> None:
        _operate(self, "setitem", key, value)

    def __delitem__(self, key: Any) -> None:
        _operate(self, "delitem", key)

    def __int__(self) -> int:
        return int(_operate(self, "int"))

    def __float__(self) -> float:
        return float(_operate(self, "float"))

    def __index__(self) -> int:
        return int(_operate(self, "index"))

    def __eq__(self, other: object) -> Any:
        return _compare(self, "eq", other)

    def __ne__(self, other: object) -> Any:
        return _compare(self, "ne", other)

    def __lt__(self, other: object) -> Any:
        return _compare(self, "lt", other)

    def __le__(self, other: object) -> Any:
        return _compare(self, "le", other)

    def __gt__(self, other: object) -> Any:
        return _compare(self, "gt", other)

    def __ge__(self, other: object) -> Any:
        return _compare(self, "ge", other)


def _unary(op: str) -> Callable[[Any], Any]:
    return lambda self: _operate(self, op)


def _binary(op: str) -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    def forward(self: Any, other: Any) -> Any:
        return _operate(self, op, other)

    def reflected(self: Any, other: Any) -> Any:
        reference = _resolve(self)
        if type(reference) is _Data:
            return OPERATIONS[op](other, reference.value)
        return _solution().request(op, other, self)

    return forward, reflected


for _name in ("neg", "pos", "abs", "invert"):
    setattr(SolutionObject, f"__{_name}__", _unary(_name))
for _name, _op in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("matmul", "matmul"), ("truediv", "truediv"),
                   ("floordiv", "floordiv"), ("mod", "mod"), ("pow", "pow"), ("lshift", "lshift"),
                   ("rshift", "rshift"), ("and", "and_"), ("or", "or_"), ("xor", "xor"), ("divmod", "divmod")):
    _forward, _reflected = _binary(_op)
    setattr(SolutionObject, f"__{_name}__", _forward)
    setattr(SolutionObject, f"__r{_name}__", _reflected)


def _dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__")


def _new(kind: type, reference: Any) -> Any:
    made: Any = object.__new__(kind)
    object.__setattr__(made, "_solution_ref", reference)
    return made


def _pending(compute: Callable[[], Any]) -> Any:
    return _new(SolutionObject, _Pending(compute))


def _resolve(value: SolutionObject) -> Any:
    """The handle (an int) of an object of the solution's, or ``_Data``; computes a pending value first."""
    reference = object.__getattribute__(value, "_solution_ref")
    if type(reference) is _Pending:
        computed = reference.compute()
        reference = _resolve(computed) if isinstance(computed, SolutionObject) else _Data(computed)
        object.__setattr__(value, "_solution_ref", reference)
    return reference


def _operate(value: SolutionObject, op: str, *args: Any, **kwargs: Any) -> Any:
    """``op`` on ``value``: here when it is data, else in the solution's process."""
    reference = _resolve(value)
    if type(reference) is _Data:
        return OPERATIONS[op](reference.value, *args, **kwargs)
    return _solution().request(op, value, *args, **kwargs)


def _compare(value: SolutionObject, op: str, other: object) -> Any:
    """Rich comparison: data compares here; two objects of the solution's compare there; an object of the
    solution's with data does not compare (NotImplemented: unequal), whatever its own ``__eq__`` would say."""
    reference = _resolve(value)
    if type(reference) is _Data:
        return OPERATIONS[op](reference.value, other)
    if isinstance(other, SolutionObject) and type(_resolve(other)) is int:
        return _solution().request(op, value, other)
    return NotImplemented


class SolutionClass(type):
    """The type of the stand-ins for the solution's classes: calling one makes an instance there."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if not _gate_open:
            return _new(cls, _Pending(lambda: _solution().request("call", cls, *args, **kwargs)))
        return _solution().request("call", cls, *args, **kwargs)

    def __getattr__(cls, name: str) -> Any:
        if _dunder(name) or (not _gate_open and name.startswith("_")):
            raise AttributeError(name)
        if not _gate_open:
            return _pending(lambda: _solution().request("getattr", cls, name))
        return _solution().request("getattr", cls, name)

    def __repr__(cls) -> str:
        return f"<class {MODULE_NAME}.{cls.__qualname__} (in the solution's process)>"

    def __iter__(cls) -> Any:
        return _solution().request("iter", cls)

    def __bool__(cls) -> bool:
        return True  # a class is true, as any: never a question for the solution's process

    def __getitem__(cls, key: Any) -> Any:
        return _solution().request("getitem", cls, key)

    def __contains__(cls, item: Any) -> bool:
        return bool(_solution().request("contains", cls, item))


#: the stand-ins of the solution's top-level classes, by name
_stand_ins: dict[str, type] = {}


def _stand_in(name: str, bases: list[str]) -> type:
    """A local class for one of the solution's: an exception class with the nearest builtin or stand-in exception
    bases, else a ``SolutionClass`` with its stand-in bases."""
    namespace: dict[str, Any] = {"__module__": MODULE_NAME, "__qualname__": name}
    known = [_stand_ins[base] if base in _stand_ins else _EXCEPTION_BASES.get(base) for base in bases]
    exception_bases = tuple(kind for kind in known if isinstance(kind, type) and issubclass(kind, BaseException))
    if exception_bases:
        with contextlib.suppress(TypeError):  # an impossible layout (KeyError with AttributeError) keeps the first
            return type(name, exception_bases, namespace)
        return type(name, exception_bases[:1], namespace)
    object_bases = tuple(kind for base in bases if isinstance(kind := _stand_ins.get(base), SolutionClass))
    with contextlib.suppress(TypeError):
        return SolutionClass(name, object_bases or (SolutionObject,), {**namespace, "__slots__": ()})
    return SolutionClass(name, (SolutionObject,), {**namespace, "__slots__": ()})


def _top_level(source: bytes) -> tuple[list[str], list[ast.ClassDef], list[str] | None]:
    """The solution's top-level names (not those it imports: a star import would shadow the test's own ``os``
    with the solution's, which is no longer the same module), classes and literal ``__all__``, read (never run)
    from its source."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return [], [], None  # its process reports the error at the first use
    names: list[str] = []
    classes: list[ast.ClassDef] = []
    declared: list[str] | None = None
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            classes.append(node)
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.append(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    names.append(target.id)
                    if target.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)) and all(
                            isinstance(item, ast.Constant) and isinstance(item.value, str)
                            for item in node.value.elts):
                        declared = [item.value for item in node.value.elts]  # type: ignore[attr-defined]
    return list(dict.fromkeys(names)), classes, declared


class SolutionProcess:
    """The solution's process for this test process, started at the first request (made, with the runner's source,
    by ``install`` while pytest collects)."""

    def __init__(self, code_path: str) -> None:
        self.code_path = code_path
        here = Path(__file__).resolve().parent
        self._sources = [(here / f"{name}.py").read_text() for name in ("solution_wire", "solution_runner")]
        self._lock = threading.RLock()  # a request's arguments may be pending values, computed by a request
        self._process: subprocess.Popen[bytes] | None = None
        self._failure: str | None = None
        self._request_fd = self._reply_fd = -1
        self._outputs: list[tuple[IO[bytes], str]] = []
        self._offsets = [0, 0]
        self._proxies: dict[int, Any] = {}

    def request(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """``op`` (``solution_wire.OPERATIONS`` or ``global``) on the arguments, in the solution's process: its
        result, or its exception raised here."""
        if not _gate_open:
            raise CalledDuringCollection(
                f"the tests used the {MODULE_NAME} while pytest collected them; it runs only once every test file is "
                f"read: call it inside test functions or fixtures")
        with self._lock:
            self._start()
            encoder = Encoder(_export)
            message = {"op": op, "args": encoder.value(args), "kwargs": encoder.value(kwargs)}
            try:
                send(self._request_fd, message)
                reply = receive(self._reply_fd)
            except (OSError, WireError) as error:
                reply, problem = None, str(error)
            else:
                problem = "its process ended"
            self._relay()
            if not isinstance(reply, dict):
                self._fail(f"the solution's process stopped answering ({problem})")
            return self._unpack(reply, encoder.containers)

    def stop(self) -> None:
        """End the solution's process and all of its process group."""
        with self._lock:
            process, self._process = self._process, None
            if process is None:
                return
            self._failure = self._failure or "the solution's process was stopped"
            for fd in (self._request_fd, self._reply_fd):
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            for stream, _ in self._outputs:
                stream.close()

    def _start(self) -> None:
        if self._failure is not None:
            raise SolutionError(self._failure)
        if self._process is not None:
            return
        make_undumpable()  # before the solution exists: it cannot read or write this process's memory or fds
        request_read, self._request_fd = os.pipe()
        self._reply_fd, reply_write = os.pipe()
        out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()  # noqa: SIM115 - closed by stop()
        self._outputs = [(out, "stdout"), (err, "stderr")]
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", BOOT, *self._sources, self.code_path, str(request_read), str(reply_write)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, pass_fds=(request_read, reply_write),
                start_new_session=True)
        finally:
            os.close(request_read)
            os.close(reply_write)
        atexit.register(self.stop)
        try:
            hello = receive(self._reply_fd)
        except (OSError, WireError):
            hello = None
        self._relay()
        if not isinstance(hello, dict) or hello.get("ready") is not True:
            error = hello.get("error") if isinstance(hello, dict) else None
            trace = error.get("traceback") if isinstance(error, dict) else None
            self._fail("the solution did not import" + (f":\n{trace}" if isinstance(trace, str) else ""))

    def _fail(self, reason: str) -> Any:
        self._failure = reason
        self.stop()
        raise SolutionError(reason)

    def _relay(self) -> None:
        """Copy what the solution printed since the last call into this process's (captured) sys.stdout/stderr."""
        for index, (stream, name) in enumerate(self._outputs):
            size = os.fstat(stream.fileno()).st_size
            offset = self._offsets[index]
            if size <= offset:
                continue
            text = os.pread(stream.fileno(), min(size - offset, RELAY_LIMIT), offset).decode(errors="replace")
            if size - offset > RELAY_LIMIT:
                text += f"\n[{size - offset - RELAY_LIMIT} more bytes of the solution's {name} left out]\n"
            self._offsets[index] = size
            target = getattr(sys, name)
            with contextlib.suppress(OSError, ValueError):
                target.write(text)
                target.flush()

    def _unpack(self, reply: dict[str, Any], containers: list[Any]) -> Any:
        decoder = Decoder(self._import, containers)
        try:
            sync = reply.get("sync", [])
            for item in sync if isinstance(sync, list) else ():
                number, state = item
                if type(number) is not int or not 0 <= number < len(containers):
                    raise WireError(f"no argument container {number!r}")
                decoder.update(containers[number], state)
            if "ok" in reply:
                return decoder.value(reply["ok"])
            error = self._rebuild(reply.get("error"), decoder)
        except (WireError, TypeError, ValueError) as problem:
            raise SolutionError(f"the solution's process answered out of protocol: {problem}") from None
        raise error

    def _import(self, reference: dict[str, Any]) -> Any:
        """A local object for a handle of the solution's: one per handle, so identity holds."""
        handle, kind = reference.get("h"), reference.get("k")
        if type(handle) is not int or handle < 0:
            raise WireError(f"not a handle: {reference!r}"[:200])
        if handle not in self._proxies:
            stand_in = _stand_ins.get(kind[1]) if isinstance(kind, list) and len(kind) == 2 and \
                kind[0] == MODULE_NAME and isinstance(kind[1], str) else None
            self._proxies[handle] = _new(stand_in if isinstance(stand_in, SolutionClass) else SolutionObject, handle)
        return self._proxies[handle]

    def _rebuild(self, error: Any, decoder: Decoder) -> BaseException:
        """The solution's exception as a local one: the nearest class of its that is builtin or a stand-in, with
        its args (else its text), and its traceback as a note; otherwise a ``SolutionError`` naming its class."""
        if not isinstance(error, dict) or not isinstance(error.get("mro"), list) or not error["mro"]:
            raise WireError("an error without its classes")
        classes = [(module, name) for module, name in error["mro"] if isinstance(module, str) and
                   isinstance(name, str)]
        text = str(error.get("str", ""))
        args: Any = None
        if error.get("args") is not None:
            with contextlib.suppress(WireError):
                args = decoder.value(error["args"])
        kind = next((found for module, name in classes if (found := _exception_class(module, name))), None)
        built = _construct(kind, args, text) if kind is not None else None
        if built is None:
            module, name = classes[0] if classes else ("?", "?")
            built = SolutionError(f"{name if module in ('builtins', MODULE_NAME) else f'{module}.{name}'}: {text}")
        trace = error.get("traceback")
        if isinstance(trace, str):
            note = f"raised in the solution's process:\n{trace}"
            if sys.version_info >= (3, 11):
                built.add_note(note)
            else:  # what add_note fills, which pytest shows
                built.__notes__ = [*getattr(built, "__notes__", ()), note]
        return built


def _construct(kind: type[BaseException], args: Any, text: str) -> BaseException | None:
    """``kind(*args)``, else ``kind(text)``, else None (a builtin constructor may refuse what came)."""
    for attempt in ((args,) if type(args) is tuple else ()) + ((text,),):
        with contextlib.suppress(Exception):
            return kind(*attempt)
    return None


def _exception_class(module: str, name: str) -> type[BaseException] | None:
    if module == MODULE_NAME:
        found = _stand_ins.get(name)
        return found if isinstance(found, type) and issubclass(found, BaseException) else None
    return BUILTIN_EXCEPTIONS.get(name) if module == "builtins" else None


def _export(encoder: Encoder, value: Any) -> Any:
    """How a value that is not data goes to the solution: its own objects and classes by reference."""
    if isinstance(value, SolutionObject):
        reference = _resolve(value)
        return encoder.value(reference.value) if type(reference) is _Data else {"h": reference}
    if isinstance(value, type) and _stand_ins.get(value.__name__) is value:
        return {"g": value.__name__}
    raise TypeError(f"a {type(value).__name__} cannot be passed to the solution: it runs in a process of its own, "
                    f"and only data and its own objects cross")


_process: SolutionProcess | None = None
_globals: dict[str, Any] = {}


def _solution() -> SolutionProcess:
    if _process is None:
        raise SolutionError(f"no solution installed: the module {MODULE_NAME!r} calls install() first")
    return _process


def _module_getattr(name: str) -> Any:
    """The module's ``__getattr__``: a top-level name of the solution's (pending while pytest collects)."""
    if _dunder(name):
        raise AttributeError(f"module {MODULE_NAME!r} has no attribute {name!r}")
    if not _gate_open:
        if name not in _globals:
            _globals[name] = _pending(lambda: _solution().request("global", name))
        return _globals[name]
    return _solution().request("global", name)


def install(module_name: str, code_path: str) -> None:
    """Make the module ``module_name`` (the shim the tests import) stand for the solution in ``code_path`` (relative
    to the shim's directory): stand-ins for its classes, its other names on demand, ``__all__`` from its source."""
    global _process
    module = sys.modules[module_name]
    path = os.path.join(os.path.dirname(os.path.abspath(str(module.__file__))), code_path)
    if _process is None:
        _process = SolutionProcess(path)
    try:
        with open(path, "rb") as source:
            names, classes, declared = _top_level(source.read())
    except OSError:
        names, classes, declared = [], [], None
    for node in classes:
        _stand_ins[node.name] = _stand_in(node.name, [base.id for base in node.bases if isinstance(base, ast.Name)])
    module.__dict__.update(_stand_ins)
    module.__getattr__ = _module_getattr  # type: ignore[method-assign]
    module.__dict__["__all__"] = declared if declared is not None else [n for n in names if not n.startswith("_")]


def shutdown() -> None:
    """End this process's solution process, if it started."""
    if _process is not None:
        _process.stop()

