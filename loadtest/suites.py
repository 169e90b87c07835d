"""Real test suites of pure-Python PyPI projects, for the real-suite benches: pinned sdists, fetched once, shipped.

Each suite is a project whose sdist carries its own tests and whose tests run with only what the sandbox image has
(Debian bookworm: Python 3.11, pytest 7.2, pytest-xdist 3.1; no network, no pip). They were picked for a spread of
single-core durations, measured in the image on this 2-core machine (``python3 -m pytest``, plain and ``-n 2`` on
both cores, wall seconds: the range over two direct ``docker run``s and two profiling passes through the broker,
while other jobs shared the machine):

=========  =======  =========  =========  ===========================================================
suite      version  plain      -n 2       outcome
=========  =======  =========  =========  ===========================================================
pyflakes   3.2.0    1.0-1.1    1.0-1.4    708 passed, 22 skipped (xdist start-up eats the gain)
lark       1.2.2    4.4-4.9    3.0-3.3    984 passed, 131 skipped
pygments   2.18.0   11.6-12.7  10.3-10.8  4390 passed, 12 skipped; every xdist worker collects all 4390
                                          parametrised cases again: -n 2 costs ~65% more CPU
pyparsing  3.2.0    21.9-22.5  11.4-12.4  8 failed, 1799 passed, exit code 1 every time: the 8 need the
                                          optional ``railroad`` package (diagrams)
networkx   3.4.2    46.7-48.2  27.7-28.9  4708 passed, 302 skipped (the numpy/scipy tests skip)
chardet    5.2.0    40.0       21.6       754 passed, 10 xfailed (one test per file of its corpus)
astroid    3.3.8    60.0       34.8       1 failed, 1610 passed, 78 skipped, 15 xfailed, exit code 1: the one
                                          imports setuptools, which the image lacks
mpmath     1.3.0    65.7       41.9       339 passed, 1 skipped, 2 xfailed; one test takes ~25 s of it
=========  =======  =========  =========  ===========================================================

The last three (one ``docker run`` each, 2026-11-28) were added for the runner's parity and curves
(issue 36); the real-mode benches keep the first five (``REAL_MODE``).

The bench profiles them again itself before it runs (their single-core time is each test run's declared ``t1``).
Tests are run as ``python3 -m pytest`` from the unpacked sdist's root so that the sdist's own package is imported
(``-m`` puts the working directory first on ``sys.path``), never a copy the image may hold.
"""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

#: where fetched sdists are kept between runs
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "tangram-bench-suites"


@dataclass(frozen=True)
class Suite:
    """One project's test suite: the sdist to fetch (pinned by version and digest) and how to run its tests."""

    name: str
    version: str
    sha256: str
    #: the import package, a directory at the sdist's root (tool calls grep and import it)
    package: str
    #: pytest's arguments after the options: test paths, and ``--ignore`` for modules needing absent packages
    test_args: str

    @property
    def sdist(self) -> str:
        return f"{self.name}-{self.version}.tar.gz"


SUITES: tuple[Suite, ...] = (
    Suite("pyflakes", "3.2.0", "1c61603ff154621fb2a9172037d84dca3500def8c8b630657d1701f026f8af3f",
          "pyflakes", "pyflakes/test"),
    Suite("lark", "1.2.2", "ca807d0162cd16cef15a8feecb862d7319e7a09bdb13aef927968e45040fed80", "lark", "tests"),
    # tests/contrast needs wcag_contrast_ratio, which the image lacks
    Suite("pygments", "2.18.0", "786ff802f32e91311bff3889f6e9a86e81505fe99f2735bb6d60ae0c5004f199",
          "pygments", "tests --ignore=tests/contrast"),
    # these two modules need matplotlib and railroad at import; 8 tests elsewhere import railroad and fail
    Suite("pyparsing", "3.2.0", "cbf74e27246d595d9a74b186b810f6fbb86726dbf3b9532efb343f6d7294fe9c",
          "pyparsing", "tests --ignore=tests/test_diagram.py --ignore=tests/test_matplotlib_cases.py"),
    Suite("networkx", "3.4.2", "307c3669428c5362aab27c8a1260aa8f47c4e91d3891f48be0141738d8d053e1",
          "networkx", "networkx"),
    Suite("chardet", "5.2.0", "1b3b6ff479a8c414bc3fa2c0852995695c4a026dcd6d0633b2dd092ca39c1cf7",
          "chardet", "test.py"),
    # one test fails where setuptools is absent (the image): it imports setuptools to check for a warning
    Suite("astroid", "3.3.8", "a88c7994f914a4ea8572fac479459f4955eeccc877be3f2d959a33273b0cf40b",
          "astroid", "tests"),
    Suite("mpmath", "1.3.0", "7a28eb2a9774d00c7bc92411c19a89209d5da7c4c9a9e227be8330a23a25b91f",
          "mpmath", "mpmath/tests"),
)

#: the suites the real-mode benches (``bench_real_suites``, ``bench_real_dop``) give trajectories: a spread of
#: durations short enough for rounds of a few minutes; the three after them are for parity and the runner's curves
REAL_MODE = ("pyflakes", "lark", "pygments", "pyparsing", "networkx")


@dataclass(frozen=True)
class Fetched:
    """A suite's sdist ready to ship: the tarball's base64 text and the directory it unpacks to."""

    suite: Suite
    base64: str
    root: str
    size: int


def fetch(suite: Suite, cache_dir: Path) -> Fetched:
    """The suite's sdist from ``cache_dir``, downloaded with pip first if it is not there. Checked against the
    pinned digest, so a cache or an index that hands back other bytes stops the bench instead of skewing it."""
    path = cache_dir / suite.sdist
    if not path.exists():
        print(f"fetching {suite.name}=={suite.version} (sdist) into {cache_dir}", flush=True)
        cache_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        f"{suite.name}=={suite.version}", "--dest", str(cache_dir)], check=True)
        if not path.exists():
            raise RuntimeError(f"pip downloaded {suite.name}=={suite.version} but not as {path}")
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != suite.sha256:
        raise RuntimeError(f"{path} has sha256 {digest}, not the pinned {suite.sha256}; delete it to fetch again")
    with tarfile.open(path) as tar:
        roots = {member.name.split("/", 1)[0] for member in tar.getmembers()}
    if len(roots) != 1:
        raise RuntimeError(f"{path} unpacks to {sorted(roots)}, not one directory")
    return Fetched(suite, base64.b64encode(data).decode(), roots.pop(), len(data))
