"""A sandbox pins, runs and settles its own commands (``Sandbox.execute``), so a caller behind a node agent pays
one round trip per action: the cgroup follows the union of the running commands' cores, and a resize that
arrives before its command started is the one it starts on."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from sandboxes.backend import Sandbox, SandboxError
from sandboxes.core_pins import MAX_EARLY_TAGS, CorePins
from sandboxes.exec_wire import ExecRequest, ExecResult


class RecordingSandbox(Sandbox):
    """Records the cgroup and executor calls the base class makes; ``run`` waits until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.release: dict[str, asyncio.Event] = {}
        self.fail_set_cores: SandboxError | None = None

    async def set_cores(self, cores: frozenset[int]) -> None:
        if self.fail_set_cores is not None:
            raise self.fail_set_cores
        self.calls.append(("set_cores", sorted(cores)))

    async def set_action_cores(self, tag: str, cores: frozenset[int]) -> None:
        self.calls.append(("set_action_cores", tag, sorted(cores)))

    async def run(self, request: ExecRequest) -> ExecResult:
        assert request.tag is not None
        self.calls.append(("run", request.tag, list(request.cores)))
        await self.release.setdefault(request.tag, asyncio.Event()).wait()
        return ExecResult(exit_code=0)

    async def destroy(self) -> None:
        pass


def request(*cores: int) -> ExecRequest:
    return ExecRequest("true", cores=cores)


async def started(sandbox: RecordingSandbox, tag: str) -> None:
    while ("run", tag) not in [call[:2] for call in sandbox.calls]:
        await asyncio.sleep(0)


async def test_one_command_widens_then_freezes_its_sandbox() -> None:
    sandbox = RecordingSandbox()
    sandbox.release["a"] = asyncio.Event()
    sandbox.release["a"].set()
    executed = await sandbox.execute("a", request(2, 3))
    assert executed.result.exit_code == 0 and executed.unsettled is None
    assert sandbox.calls == [("set_cores", [2, 3]), ("run", "a", [2, 3]), ("set_cores", [])]


async def test_concurrent_commands_share_the_union_and_narrow_as_each_ends() -> None:
    sandbox = RecordingSandbox()
    first = asyncio.create_task(sandbox.execute("a", request(0)))
    await started(sandbox, "a")
    second = asyncio.create_task(sandbox.execute("b", request(1, 2)))
    await started(sandbox, "b")
    sandbox.release["a"].set()
    await first
    sandbox.release["b"].set()
    await second
    assert [call for call in sandbox.calls if call[0] == "set_cores"] == [
        ("set_cores", [0]), ("set_cores", [0, 1, 2]), ("set_cores", [1, 2]), ("set_cores", [])]


async def test_a_resize_moves_the_running_command_and_its_sandbox() -> None:
    sandbox = RecordingSandbox()
    running = asyncio.create_task(sandbox.execute("a", request(0)))
    await started(sandbox, "a")
    await sandbox.repin("a", frozenset({0, 1, 2}))
    sandbox.release["a"].set()
    await running
    assert sandbox.calls == [("set_cores", [0]), ("run", "a", [0]), ("set_cores", [0, 1, 2]),
                             ("set_action_cores", "a", [0, 1, 2]), ("set_cores", [])]


async def test_a_resize_that_overtakes_its_command_is_where_the_command_starts() -> None:
    sandbox = RecordingSandbox()
    await sandbox.repin("a", frozenset({4, 5}))
    assert sandbox.calls == []  # nothing runs under that tag yet: no cgroup change
    sandbox.release["a"] = asyncio.Event()
    sandbox.release["a"].set()
    await sandbox.execute("a", request(4))
    assert sandbox.calls == [("set_cores", [4, 5]), ("run", "a", [4, 5]), ("set_cores", [])]


async def test_a_failed_settle_keeps_the_result_and_says_why() -> None:
    sandbox = RecordingSandbox()
    running = asyncio.create_task(sandbox.execute("a", request(0)))
    await started(sandbox, "a")
    sandbox.fail_set_cores = SandboxError("environment_lost", "the container is gone", lost=True)
    sandbox.release["a"].set()
    executed = await running
    assert executed.result.exit_code == 0
    assert executed.unsettled == "the container is gone"


async def test_a_command_that_could_not_be_pinned_leaves_no_cores_behind() -> None:
    sandbox = RecordingSandbox()
    sandbox.fail_set_cores = SandboxError("environment_lost", "gone", lost=True)
    with pytest.raises(SandboxError, match="gone"):
        await sandbox.execute("a", request(0, 1))
    sandbox.fail_set_cores = None
    sandbox.release["b"] = asyncio.Event()
    sandbox.release["b"].set()
    await sandbox.execute("b", request(3))
    assert sandbox.calls == [("set_cores", [3]), ("run", "b", [3]), ("set_cores", [])]


def test_cores_for_tags_that_never_start_are_bounded() -> None:
    pins = CorePins()
    for n in range(MAX_EARLY_TAGS + 10):
        assert not pins.move(f"cancelled-{n}", frozenset({n}))
    assert pins.start("cancelled-0", frozenset({7})) == frozenset({7})  # the oldest were dropped
    assert pins.start(f"cancelled-{MAX_EARLY_TAGS + 9}", frozenset({7})) == frozenset({MAX_EARLY_TAGS + 9})
