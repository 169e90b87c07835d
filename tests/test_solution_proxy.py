"""The reward's test run without Docker: the files ``tangram_client/verl_reward.py`` puts in a sandbox, laid out in
a temporary directory and run by a real pytest in a subprocess, as the sandbox runs them (``TEST_COMMAND``). The
solution runs in a process of its own behind the ``solution`` shim (``tangram_client/solution_proxy.py``), and the
score is the line signed by ``tangram_client/reward_report.py``. ``tests/test_verl_plugin.py`` runs the same in real
sandboxes, with xdist, through verl's reward manager."""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tangram_client.pytest_guard import untrusted_path_entries
from tangram_client.signed_report import FIELDS, KEY_FILE, MARKER, read_signed, signed_line
from tangram_client.solution_proxy import SolutionError
from tangram_client.solution_runner import landlock_abi
from tangram_client.solution_wire import Decoder, Encoder, WireError
from tangram_client.verl_reward import TEST_COMMAND, sandbox_files

KEY = "0123456789abcdef" * 4
ROOT = Path(__file__).resolve().parent.parent


def run_tests(directory: Path, code: str, tests: str) -> tuple[dict[str, int] | None, subprocess.CompletedProcess[str]]:
    """Lay out the sandbox's files in ``directory`` and run the reward's command there (``python`` for
    ``python3``): the signed counts (None when there is no valid report), and the run."""
    for name, text in sandbox_files(code, tests, KEY).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    command = [sys.executable, *shlex.split(TEST_COMMAND)[1:]]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTEST_ADDOPTS", None)
    run = subprocess.run(command, check=False, cwd=directory, env=env, capture_output=True, text=True,
                         timeout=120)
    return read_signed(run.stderr, KEY.encode()), run


SOLUTION = '''
import collections
import os
import sys

LIMIT = 10


class InsufficientFunds(ValueError):
    pass


class Account:
    def __init__(self, balance):
        self.balance = balance

    def withdraw(self, amount):
        if amount > self.balance:
            raise InsufficientFunds(f"balance {self.balance} < {amount}")
        self.balance -= amount
        return self

    def __eq__(self, other):
        return isinstance(other, Account) and other.balance == self.balance

    def __hash__(self):
        return hash(self.balance)

    def __len__(self):
        return self.balance

    def __repr__(self):
        return f"Account({self.balance})"


class Savings(Account):
    rate = 0.5

    @classmethod
    def opened(cls, balance):
        return cls(balance)


class AlwaysEqual:
    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False


def add(a, b):
    print(f"add {a} {b}")
    return a + b


def reverse_rows(matrix):
    for row in matrix:
        row.reverse()
    matrix.reverse()


def append_to(items, value):
    items.append(value)
    return items


def roundtrip(value):
    return value


def count_up(n):
    yield from range(n)


def factorial(n):
    result = 1
    for i in range(2, n + 1):
        result *= i
    return result


def always_equal():
    return AlwaysEqual()


def process():
    return os.getpid(), os.getppid(), [os.readlink(f"/proc/self/fd/{fd}") for fd in (0, 1, 2)]


def leave(code):
    sys.exit(code)


def divide(a, b):
    return a / b


def signal_parent():
    os.kill(os.getppid(), 0)
    return "sent"


def tests_visible():
    return os.path.exists("test_solution.py")
'''

TESTS = '''
import collections
import ctypes
import math
import os
from decimal import Decimal
from fractions import Fraction

import pytest

import solution
from solution import *
from solution import Account, InsufficientFunds, Savings, add

ACCOUNT = Account(5)  # made while pytest collects: computed at its first use
TOTAL = add(2, 3)
LANDLOCK_SCOPES = {landlock_scopes}


def test_functions_constants_and_printed_output(capsys):
    assert add(1, 2) == 3
    assert solution.LIMIT == 10 and LIMIT == 10
    assert "add 1 2" in capsys.readouterr().out


def test_values_made_while_collecting():
    assert TOTAL == 5 and ACCOUNT.balance == 5 and isinstance(ACCOUNT, Account)


def test_classes_instances_and_identity():
    account = Account(10)
    assert isinstance(account, Account) and not isinstance(account, Savings)
    assert account.withdraw(3) is account
    assert account.balance == 7 and len(account) == 7 and repr(account) == "Account(7)"
    assert account == Account(7) and account != Account(8)
    account.balance = 1
    assert account.balance == 1 and len({{account, Account(1)}}) == 1
    savings = Savings.opened(4)
    assert isinstance(savings, Savings) and isinstance(savings, Account) and Savings.rate == 0.5


def test_exceptions_keep_their_type_and_args():
    with pytest.raises(InsufficientFunds, match="balance 1 < 5") as caught:
        Account(1).withdraw(5)
    assert isinstance(caught.value, ValueError) and caught.value.args == ("balance 1 < 5",)
    with pytest.raises(ZeroDivisionError):
        solution.divide(1, 0)
    with pytest.raises(SystemExit) as left:
        solution.leave(3)
    assert left.value.code == 3
    with pytest.raises(AttributeError):
        solution.no_such_function()


def test_arguments_get_back_what_the_solution_did_to_them():
    rows = [[1, 2], [3, 4]]
    first = rows[0]
    assert solution.reverse_rows(rows) is None
    assert rows == [[4, 3], [2, 1]] and rows[1] is first
    items = [1]
    assert solution.append_to(items, 2) is items and items == [1, 2]


def test_data_crosses_with_its_type():
    point = collections.namedtuple("Point", "x y")(1, 2)
    values = [None, True, 1.5, -0.0, float("inf"), 2**200, -(2**70), 1 + 2j, "\\u00e9\\udc80", b"\\x00\\xff",
              bytearray(b"ab"), (1, (2,)), frozenset({{1}}), {{1, 2}}, {{"a": [1], (1, 2): None}}, Decimal("1.10"),
              Fraction(1, 3), collections.Counter("aab"), collections.OrderedDict(a=1),
              collections.deque([1], maxlen=3)]
    for value in values:
        back = solution.roundtrip(value)
        assert back == value and type(back) is type(value), value
    assert math.isnan(solution.roundtrip(float("nan")))
    assert solution.roundtrip(point) == (1, 2) and solution.roundtrip(point).y == 2
    assert solution.roundtrip(collections.deque([1], maxlen=3)).maxlen == 3
    shared = [1]
    pair = solution.roundtrip([shared, shared])
    assert pair[0] is pair[1]
    loop = []
    loop.append(loop)
    back = solution.roundtrip(loop)
    assert back[0] is back
    assert solution.factorial(2000) == math.factorial(2000)


def test_generators():
    assert list(solution.count_up(3)) == [0, 1, 2]
    assert sum(solution.count_up(4)) == 6


def test_an_always_equal_object_is_not_equal_to_data():
    cheat = solution.always_equal()
    assert not cheat == 3 and cheat != 3 and not 3 == cheat and cheat not in [3]


def test_its_own_process_streams_and_signals():
    pid, parent, streams = solution.process()
    assert pid != os.getpid() and parent == os.getpid()
    assert streams[0] == "/dev/null"
    assert not set(streams[1:]) & {{os.readlink(f"/proc/self/fd/{{fd}}") for fd in (1, 2)}}
    assert ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 0  # PR_GET_DUMPABLE: pytest is not dumpable
    assert solution.tests_visible() is False  # deleted once collected: no expected answers to read
    if LANDLOCK_SCOPES:
        with pytest.raises(PermissionError):
            solution.signal_parent()
    else:
        assert solution.signal_parent() == "sent"


def test_a_test_callable_cannot_be_passed():
    with pytest.raises(TypeError, match="cannot be passed to the solution"):
        solution.roundtrip(lambda: 1)


def test_star_import_and_all():
    assert {{"add", "Account", "LIMIT"}} <= set(solution.__all__) and "collections" not in solution.__all__
'''


def test_the_common_cases_work_through_the_solutions_own_process(tmp_path: Path) -> None:
    report, run = run_tests(tmp_path, SOLUTION, TESTS.format(landlock_scopes=landlock_abi() >= 6))
    assert report == {"collected": 11, "passed": 11, "failed": 0, "skipped": 0}, run.stdout[-6000:]
    assert not (tmp_path / KEY_FILE).exists()  # read and deleted before the solution ran


ADD_TESTS = ("from solution import add\n\n"
             "def test_small():\n    assert add(1, 2) == 3\n\n"
             "def test_zero():\n    assert add(0, 0) == 0\n\n"
             "def test_negative():\n    assert add(-1, -1) == -2\n")
FORGED = f"{MARKER} " + json.dumps({field: 3 for field in FIELDS}, sort_keys=True, separators=(",", ":"))
#: a solution that, imported into pytest, makes every test pass and prints a pytest summary and a report
PATCHING = f'''
import sys

import _pytest.python
import _pytest.runner


def _passes(self):
    return None


_pytest.python.Function.runtest = _passes
_pytest.runner.pytest_runtest_call = lambda item: None
print("3 passed in 0.01s")
sys.stderr.write({FORGED!r} + " " + "0" * 64 + "\\n")


def add(a, b):
    return None
'''


def test_a_solution_that_patches_pytest_patches_only_its_own_process(tmp_path: Path) -> None:
    report, run = run_tests(tmp_path, PATCHING, ADD_TESTS)
    assert report == {"collected": 3, "passed": 0, "failed": 3, "skipped": 0}, run.stdout[-4000:]
    assert FORGED in run.stdout  # what it printed reached the output of the failed tests, nothing more


def test_a_wrong_solution_scores_what_it_passes(tmp_path: Path) -> None:
    report, _ = run_tests(tmp_path, "def add(a, b):\n    return a - b\n", ADD_TESTS)
    assert report == {"collected": 3, "passed": 1, "failed": 2, "skipped": 0}


def test_using_the_solution_while_collecting_is_refused(tmp_path: Path) -> None:
    tests = "import solution\n\nCASES = range(solution.add(1, 1))\n\ndef test_it():\n    assert True\n"
    report, run = run_tests(tmp_path, "def add(a, b):\n    return a + b\n", tests)
    assert report == {"collected": 0, "passed": 0, "failed": 0, "skipped": 0}
    assert "CalledDuringCollection" in run.stdout


def test_a_solution_that_does_not_import_fails_every_test(tmp_path: Path) -> None:
    report, run = run_tests(tmp_path, "raise RuntimeError('no')\n", ADD_TESTS)
    assert report is not None and report["passed"] == 0 and report["collected"] == 3
    assert "the solution did not import" in run.stdout and "RuntimeError: no" in run.stdout


def test_a_report_is_believed_only_with_the_key() -> None:
    counts = {"collected": 3, "passed": 1, "failed": 2, "skipped": 0}
    line = signed_line(KEY.encode(), counts)
    assert read_signed(f"noise\n{line}\n", KEY.encode()) == counts
    assert read_signed(line, b"another key") is None
    assert read_signed(line.replace('"passed":1', '"passed":3'), KEY.encode()) is None


def test_the_wire_builds_data_and_nothing_else() -> None:
    def resolve(reference: dict[str, Any]) -> Any:
        raise WireError(f"no reference {reference}")

    pickled = base64.b64encode(b"cos\nsystem\n(S'id'\ntR.").decode()
    for hostile in ({"pickle": pickled}, {"l": [1], "m": 5}, {"r": 0}, {"g": "os"}, {"t": 1}, [1, 2],
                    {"n": ["X", ["import os"], [1]]}, {"F": [{"i": "1"}, 0]}, {"d": [[{"l": [], "m": 0}, 1]], "m": 0},
                    {"q": [[], -1], "m": 0}, {"l": [], "m": 0, "s": []}):
        with pytest.raises(WireError):
            Decoder(resolve).value(hostile)

    def refuse(encoder: Encoder, value: Any) -> Any:
        raise TypeError(type(value).__name__)

    value = {"k": [1, (2, b"3")], 4: {5.5}}
    assert Decoder(resolve).value(json.loads(json.dumps(Encoder(refuse).value(value)))) == value


def test_the_solution_error_is_an_exception_a_test_fails_on() -> None:
    assert issubclass(SolutionError, Exception) and not issubclass(SolutionError, (AssertionError, ValueError))


PATH_PROBE = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("guard", sys.argv[1])
guard = importlib.util.module_from_spec(spec)
spec.loader.exec_module(guard)
print(json.dumps(guard.untrusted_path_entries(["", "rel", "/tmp/x/y", "/usr/lib/python3", sys.argv[2]], [sys.argv[2]])))
"""


def test_the_test_process_drops_the_paths_the_solution_could_write(tmp_path: Path) -> None:
    """As a sandbox's uid (not root): the current directory, the tests' and anything it can write go; the system's
    Python stays. As root, only the tests' directories and the current one go."""
    guard = ROOT / "clients" / "tangram_client" / "pytest_guard.py"
    probe = subprocess.run(["/usr/bin/python3", "-c", PATH_PROBE, str(guard), str(tmp_path)],
                           user=65534, group=65534, capture_output=True, text=True, check=True)
    assert json.loads(probe.stdout) == ["", "rel", "/tmp/x/y", str(tmp_path)]
    assert untrusted_path_entries(["", "/tmp/x/y", "/usr/lib/python3", str(tmp_path / "a")], [str(tmp_path)]) == \
        ["", str(tmp_path / "a")]
