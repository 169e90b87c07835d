"""The import contract: which of our packages may import which, checked on the source's import statements and their
transitive closure (an import inside a function counts too), so that a layering fault fails here, not in review."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: our top-level packages, each with the folder that holds it (the client's is in clients/, its distribution's root)
SOURCE_ROOTS = {"tangram": ROOT, "managers": ROOT, "sandboxes": ROOT, "reward_services": ROOT,
                "tangram_client": ROOT / "clients", "loadtest": ROOT}
PACKAGES = tuple(SOURCE_ROOTS)
#: what the broker's distribution holds; the client's reaches none of it
BROKER_PACKAGES = ("tangram", "managers", "sandboxes", "reward_services")

#: every module's layer, by the longest prefix of its name that is listed: a module no prefix names fails the
#: contract (deny by default), so a new folder or top-level module must be placed here
LAYER_OF = {
    "tangram.core": "core",  # the floor
    "tangram.sched": "algorithms",  # the scheduling cycle and its algorithms
    "tangram.slo.plan": "algorithms", "tangram.slo.attainment": "algorithms",
    "managers": "resources", "sandboxes": "resources", "reward_services": "resources",
    "tangram.sim": "simulator",  # the service's own cycle and managers on a virtual clock
    "tangram": "service",  # HTTP, the store, the config, the request parser, SLO admission, the CLI
    "tangram_client.retry": "core",  # the one back-off, shipped by the client and imported by the broker
    "tangram_client": "clients",
    "loadtest": "benchmarks",
}
#: the layers each layer may import (its own included); anything else is refused
MAY_IMPORT = {
    "core": {"core"},
    "algorithms": {"core", "algorithms"},
    "resources": {"core", "resources"},
    "simulator": {"core", "algorithms", "resources", "simulator"},
    "service": {"core", "algorithms", "resources", "simulator", "service"},  # the simulator: for ``tangram simulate``
    "clients": {"core", "clients"},
    "benchmarks": {"core", "algorithms", "resources", "simulator", "service", "clients", "benchmarks"},
}
#: what the algorithms never import: the web server, the database, the container engine, the metrics exporter
INFRASTRUCTURE = frozenset({"aiohttp", "sqlalchemy", "docker", "prometheus_client", "uvloop", "torch"})


def _module_name(path: Path, source_root: Path) -> str:
    parts = list(path.relative_to(source_root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path, source_root): path for package, source_root in SOURCE_ROOTS.items()
           for path in (source_root / package).rglob("*.py")}
#: the floor: it imports nothing of ours outside itself
CORE = tuple(sorted(m for m in MODULES if m.startswith("tangram.core")))


def layer(module: str) -> str | None:
    prefixes = [p for p in LAYER_OF if module == p or module.startswith(p + ".")]
    return LAYER_OF[max(prefixes, key=len)] if prefixes else None


@cache
def _imports(module: str) -> tuple[frozenset[str], frozenset[str]]:
    """(our modules, top-level outside packages) that ``module`` imports directly."""
    ours: set[str] = set()
    outside: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{module}: relative import"
            names = [node.module or ""] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            if name in MODULES:
                ours.add(name)
            elif name.split(".")[0] not in PACKAGES:
                outside.add(name.split(".")[0])
    return frozenset(ours), frozenset(outside)


def reaches(module: str) -> tuple[set[str], set[str]]:
    """Every module of ours ``module`` imports transitively, and every outside package any of them imports."""
    seen: set[str] = set()
    stack = [module]
    outside: set[str] = set()
    while stack:
        ours, theirs = _imports(stack.pop())
        outside |= theirs
        for name in ours - seen:
            seen.add(name)
            stack.append(name)
    return seen, outside


def test_the_contract_sees_the_whole_tree() -> None:
    assert len(MODULES) > 100 and "tangram.broker" in MODULES and "managers.cpu.manager" in MODULES
    assert {"tangram.core.action", "tangram.core.seam", "tangram.core.errors"} <= set(CORE)
    ours, outside = reaches("tangram.service")
    # it follows imports: a broken walk would pass anything
    assert "managers.cpu.manager" in ours and "aiohttp" in outside


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_module_has_a_layer_and_imports_only_the_layers_it_may(module: str) -> None:
    own = layer(module)
    assert own is not None, f"{module} is in no layer: add its prefix to LAYER_OF"
    ours, _ = _imports(module)
    refused = sorted(name for name in ours if layer(name) not in MAY_IMPORT[own])
    assert not refused, f"{module} ({own}) imports {refused}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("managers.remote.node")))
def test_what_runs_on_a_node_never_reaches_the_broker_side(module: str) -> None:
    """A node's agents (``managers/remote/node/``) run where only the node's own backends are: no manager, no Ray
    glue of the broker (``managers/remote/broker/``), nothing of the broker's above the core."""
    ours, outside = reaches(module)
    broker_side = {name for name in ours if name.startswith("managers.remote.broker") or name.endswith(".manager")
                   or (name.startswith("tangram.") and not name.startswith("tangram.core"))}
    assert not broker_side, f"{module} imports {sorted(broker_side)}"
    assert "ray" not in outside


@pytest.mark.parametrize("module", CORE)
def test_the_core_imports_nothing_of_ours_outside_it_and_no_infrastructure(module: str) -> None:
    ours, outside = reaches(module)
    assert all(name.startswith("tangram.core") for name in ours), f"{module} imports {sorted(ours)}"
    assert not outside & (INFRASTRUCTURE | {"scipy"}), f"{module} reaches {sorted(outside & INFRASTRUCTURE)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer(m) == "algorithms"))
def test_the_algorithms_reach_no_infrastructure(module: str) -> None:
    _, outside = reaches(module)
    assert not outside & INFRASTRUCTURE, f"{module} reaches {sorted(outside & INFRASTRUCTURE)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.split(".")[0] == "tangram_client"))
def test_the_client_reaches_nothing_of_the_brokers(module: str) -> None:
    """The client is a distribution of its own (clients/pyproject.toml, aiohttp and orjson): none of its modules
    reaches a module outside it, nor an outside package the broker's distribution alone installs."""
    ours, outside = reaches(module)
    assert all(name.split(".")[0] == "tangram_client" for name in ours), f"{module} imports {sorted(ours)}"
    assert not outside & {*BROKER_PACKAGES, *INFRASTRUCTURE, "scipy", "numpy", "pydantic", "psutil"} - {"aiohttp"}, \
        f"{module} reaches {sorted(outside)}"


def test_the_store_rebuilds_records_without_the_request_parser() -> None:
    ours, _ = reaches("tangram.store.store")
    assert "tangram.parse" not in ours and not ours & {"tangram.server.api", "tangram.broker"}


@pytest.mark.slow  # seconds: left out of the fast lane
def test_a_broker_without_agent_nodes_never_imports_ray() -> None:
    """Ray is for scale-out only (``managers/remote/broker/ray_agents.py``, imported when a node has
    ``agent = true``): the one-machine broker, its CLI and every manager load without it."""
    probe = ("import sys, tangram.cli, tangram.service, managers.cpu.manager, managers.gpu.manager, "
             "managers.cpu.sandbox_backends; print('ray' in sys.modules)")
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert answer.stdout.strip() == "False"
