"""The client's own distribution (``clients/pyproject.toml``, ``arl-tangram-client``): its wheel, built from
``clients/`` and installed into a fresh virtual environment (no system site-packages) with pip as this machine
configures it (``PIP_*`` variables and pip's config files reach the new environment's pip unchanged), brings the
client and what aiohttp and orjson depend on, nothing of the broker's; the client imports without the broker's
packages (which that environment cannot import at all); ``python -m tangram_client.verl_paths`` names the verl
configs it installed.

The client claims Python >= 3.10: with ``TANGRAM_TEST_PYTHON310`` naming a Python 3.10 interpreter (or a working
``python3.10`` on PATH, or one of pyenv's) the same checks run under it too, importing the client's modules there;
else that case is skipped. (``ruff`` checks clients/ against Python 3.10's syntax: clients/pyproject.toml.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # seconds: a wheel build and a pip install into a fresh environment

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "clients"
#: the packages of the broker's distribution: the client imports none of them
BROKER_PACKAGES = ("tangram", "managers", "sandboxes", "reward_services")
#: distributions the broker's install brings and the client's must not
BROKER_ONLY = {"arl-tangram", "scipy", "sqlalchemy", "docker", "numpy", "pydantic", "psutil", "prometheus-client",
               "rich", "nvidia-ml-py", "uvloop", "asyncpg", "aiosqlite", "verl", "torch"}
#: the installer's own, present in any fresh environment
INSTALLER = {"pip", "setuptools", "wheel"}
#: the client's modules that need nothing beyond the distribution's dependencies (the verl plugins need verl, the
#: reward's pytest plugin pytest, the example rich)
PLAIN_MODULES = ("tangram_client", "tangram_client.client", "tangram_client.sync_client", "tangram_client.errors",
                 "tangram_client.records", "tangram_client.output_stream", "tangram_client.retry",
                 "tangram_client.verl_paths", "tangram_client.signed_report", "tangram_client.solution_wire",
                 "tangram_client.solution_proxy", "tangram_client.solution_runner", "tangram_client.pytest_guard")

#: run in the new environment: its distributions, and the closure of what the client requires (markers evaluated
#: there, no extras), as the names pip normalises them to
CLOSURE = """
import json, re
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

installed = {norm(d.metadata["Name"]): d for d in metadata.distributions()}
needed, stack = set(), ["arl-tangram-client"]
while stack:
    name = stack.pop()
    if name in needed:
        continue
    needed.add(name)
    for line in installed[name].requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
            stack.append(norm(requirement.name))
print(json.dumps({"installed": sorted(installed), "closure": sorted(needed)}))
"""
#: run in the new environment: import the client, then say what of the broker is loaded or could be
IMPORTS = """
import importlib, importlib.util, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps({"loaded": sorted({m.split(".")[0] for m in sys.modules}),
                  "findable": [p for p in BROKER if importlib.util.find_spec(p) is not None],
                  "client": importlib.util.find_spec("tangram_client").origin}))
""".replace("BROKER", repr(BROKER_PACKAGES))


def _python310() -> str | None:
    pyenv = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    for candidate in (os.environ.get("TANGRAM_TEST_PYTHON310"), shutil.which("python3.10"),
                      *map(str, sorted(pyenv.glob("versions/3.10*/bin/python3.10")))):
        if candidate and subprocess.run([candidate, "-c", "import sys; assert sys.version_info[:2] == (3, 10)"],
                                        capture_output=True, check=False).returncode == 0:
            return candidate
    return None


def _env() -> dict[str, str]:
    """This process's environment (pip's configuration included) without what would put the checkout or this
    project's environment on the new one's path."""
    return {key: value for key, value in os.environ.items()
            if key not in {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP", "PYTHONUSERBASE"}}


def _run(command: list[str], cwd: Path, timeout: float = 300) -> str:
    done = subprocess.run(command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)
    assert done.returncode == 0, f"{command}: {done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The client's wheel, built from a copy of ``clients/`` (a build writes build/ and egg-info beside the source)."""
    work = tmp_path_factory.mktemp("client-wheel")
    source = work / "clients"
    shutil.copytree(CLIENT, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info", "dist"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(work / "dist"),
          str(source)], cwd=work)
    built = sorted((work / "dist").glob("arl_tangram_client-*.whl"))
    assert len(built) == 1, built
    return built[0]


def test_the_wheel_holds_the_client_package_alone(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert {top for top in tops if not top.endswith((".dist-info", ".data"))} == {"tangram_client"}, tops
    assert {"tangram_client/verl_tool_config.yaml", "tangram_client/verl_agent_loop.yaml",
            "tangram_client/retry.py"} <= set(names)
    metadata = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    assert "Requires-Python: >=3.10" in metadata
    requires = sorted(line.split(":", 1)[1].strip() for line in metadata.splitlines()
                      if line.startswith("Requires-Dist:") and "extra ==" not in line)
    assert [r.split(">")[0].split("=")[0].strip() for r in requires] == ["aiohttp", "orjson"], requires


@pytest.mark.timeout(600)
@pytest.mark.parametrize("interpreter", ["this", "3.10"])
def test_a_fresh_environment_gets_the_client_and_nothing_of_the_broker(
        wheel: Path, interpreter: str, tmp_path: Path) -> None:
    python = sys.executable if interpreter == "this" else _python310()
    if python is None:
        pytest.skip("no Python 3.10 interpreter (TANGRAM_TEST_PYTHON310 or python3.10 on PATH)")
    venv = tmp_path / "venv"
    _run([python, "-m", "venv", str(venv)], cwd=tmp_path)
    bin_python = str(venv / "bin" / "python")
    _run([bin_python, "-m", "pip", "install", "--quiet", str(wheel)], cwd=tmp_path)

    seen = json.loads(_run([bin_python, "-c", CLOSURE], cwd=tmp_path))
    installed = set(seen["installed"]) - INSTALLER
    assert installed == set(seen["closure"]), "distributions beyond the client and what it requires"
    assert {"arl-tangram-client", "aiohttp", "orjson"} <= installed and not installed & BROKER_ONLY, installed
    print(f"{interpreter}: {len(installed)} distributions besides {sorted(INSTALLER)}: {sorted(installed)}")

    # from tmp_path: the checkout (and its broker packages) is not the working directory
    found = json.loads(_run([bin_python, "-c", IMPORTS, *PLAIN_MODULES], cwd=tmp_path))
    assert not set(found["loaded"]) & set(BROKER_PACKAGES), found["loaded"]
    assert found["findable"] == [], "the broker's packages are importable in the client's environment"
    assert Path(found["client"]).resolve().is_relative_to(venv.resolve()), found["client"]

    lines = _run([bin_python, "-m", "tangram_client.verl_paths"], cwd=tmp_path).splitlines()
    options = dict(line.split("=", 1) for line in lines)
    assert set(options) == {"actor_rollout_ref.rollout.multi_turn.tool_config_path",
                            "actor_rollout_ref.rollout.agent.agent_loop_config_path"}, lines
    for path in map(Path, options.values()):
        assert path.is_absolute() and path.is_file() and path.is_relative_to(venv.resolve()), path
    assert "tangram_client.verl_tool.BrokerShellTool" in Path(
        options["actor_rollout_ref.rollout.multi_turn.tool_config_path"]).read_text()
    assert "tangram_client.verl_agent_loop.TangramToolAgentLoop" in Path(
        options["actor_rollout_ref.rollout.agent.agent_loop_config_path"]).read_text()
