"""The soak's container faults: the broker's sandbox containers found by their labels, and ``docker kill`` of one
that cannot wedge a shared engine (``loadtest/soak.py`` drives them; ``labelled_containers`` also serves the verdict's
count of containers left)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import docker
import docker.errors
import requests

from sandboxes.backend import LABEL_BROKER, LABEL_MANAGED

log = logging.getLogger("loadtest.soak")

KILL_TIMEOUT_S = 20.0
# where a local engine's cgroupfs driver keeps a container's freezer (cgroup v1, then v2) and what thaws it
FREEZERS = (("/sys/fs/cgroup/freezer/docker/{id}/freezer.state", "THAWED"),
            ("/sys/fs/cgroup/docker/{id}/cgroup.freeze", "0"))


def broker_sandboxes(engine: docker.APIClient, broker_id: str, stopped_too: bool) -> list[dict[str, Any]]:
    """The broker's sandbox containers, from one listing (no inspect per container: they come and go meanwhile)."""
    return engine.containers(all=stopped_too, filters={"label": [f"{LABEL_MANAGED}=1", f"{LABEL_BROKER}={broker_id}"]})


def kill_container(engine: docker.APIClient, container_id: str) -> str | None:
    """SIGKILL the container; None when the signal went, else why not.

    A kill that races with ``docker pause`` (the broker's ``docker exec`` path freezes idle sandboxes) can leave
    the signal pending in a frozen container, and Docker 20.10 then waits for an exit that never comes, holding
    the container's lock: every later call on it hangs. Past ``KILL_TIMEOUT_S`` the container's freezer is thawed
    here, so the signal lands and the engine answers again (a shared engine must not stay wedged)."""
    try:
        engine.kill(container_id)
    except docker.errors.NotFound:
        return "gone before the kill"
    except docker.errors.APIError as error:
        if error.status_code == 409:
            return "stopped before the kill"
        return f"engine answered {error.status_code}: {error.explanation}"[:200]
    except requests.exceptions.Timeout:
        for pattern, thawed in FREEZERS:
            freezer = Path(pattern.format(id=container_id))
            if freezer.exists():
                freezer.write_text(thawed)
                log.warning("kill of %s: no answer in %.0f s; thawed its freezer", container_id[:12], KILL_TIMEOUT_S)
                return None
        return f"no answer in {KILL_TIMEOUT_S:.0f} s and no local freezer to thaw"
    except requests.exceptions.RequestException as error:
        return f"engine unreachable: {error}"[:200]
    return None


def labelled_containers(engine: str, broker_id: str) -> list[str]:
    """The broker's containers by name and status; an engine that does not answer is itself a finding."""
    client = docker.APIClient(base_url=engine, timeout=60)
    try:
        return sorted(f"{c['Names'][0].lstrip('/')} ({c['Status']})" for c in broker_sandboxes(client, broker_id, True))
    except (docker.errors.DockerException, requests.exceptions.RequestException) as error:
        return [f"the engine did not list them: {error}"[:300]]
    finally:
        client.close()
