"""The verl plugins on the lowest verl of the client's range (issue 39: ``verl>=0.8,<0.11``, tested on the lowest
and highest the registry has). The suite's own environment has the highest (the ``dev`` extra's); here verl 0.8.0 is
installed on its own (no dependencies: the environment's serve it) into a directory put first on ``PYTHONPATH``, and
the verl plugin tests run against it in a pytest of their own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.docker_nodes import docker_engines

pytestmark = pytest.mark.slow  # a pip install and a subprocess pytest with sandboxes

LOWEST = "0.8.0"
ROOT = Path(__file__).resolve().parent.parent


def test_the_verl_plugins_work_on_the_lowest_verl_of_their_range(tmp_path: Path) -> None:
    assert docker_engines(), "the plugin tests run sandboxes on the test engines"
    target = tmp_path / "verl"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                    f"verl=={LOWEST}"], check=True, timeout=300)
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(target),
                                                                             os.environ.get("PYTHONPATH")]))}
    found = subprocess.run([sys.executable, "-c", "import verl; print(verl.__version__)"], env=environment,
                           capture_output=True, text=True, check=True)
    assert found.stdout.strip() == LOWEST
    plugin_tests = str(ROOT / "tests" / "test_verl_plugin.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", plugin_tests], cwd=ROOT,
                         env=environment, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " skipped" not in run.stdout and " failed" not in run.stdout, run.stdout[-2000:]
