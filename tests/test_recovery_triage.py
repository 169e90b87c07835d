"""What a restarted broker does with each unfinished action (``tangram.recovery.triage``); the end-to-end kill -9
runs are in test_recovery.py."""

from __future__ import annotations

from tangram.core.action import Action, State
from tangram.core.errors import Unavailable, Unprocessable
from tangram.parse import parse_action
from tangram.recovery import triage


def unfinished(seq: int, state: State, demand: dict[str, int] | None = None) -> Action:
    action = parse_action({"task": "math", "kind": "exec", "demand": demand or {"cpu": 1}})
    action.seq, action.state = seq, state
    if state is State.RUNNING:
        action.units, action.placement = {"cpu": 1}, {"cpu": {"node": "n", "cores": [3]}}
    return action


def no_gpu_here(action: Action) -> None:
    if "gpu" in action.demands:
        raise Unprocessable("demand.gpu", "no manager owns it")


def test_running_actions_end_restarted_and_hold_nothing_queued_ones_resume_in_order() -> None:
    actions = [unfinished(1, State.QUEUED), unfinished(2, State.RUNNING), unfinished(3, State.QUEUED),
               unfinished(4, State.QUEUED, {"gpu": 1}), unfinished(5, State.RUNNING, {"gpu": 1})]
    sorted_out = triage(actions, no_gpu_here)
    assert [a.seq for a in sorted_out.resumed] == [1, 3]
    ended = {a.seq: error for a, error in sorted_out.ended}
    assert set(ended) == {2, 4, 5}
    # a running action is ended for the restart, even when the new config could not run it either
    assert ended[2]["code"] == ended[5]["code"] == "broker_restarted"
    assert ended[4] == {"code": "not_runnable", "message": "after a restart: demand.gpu: no manager owns it"}
    assert all(a.units == {} and a.placement == {} for a, _ in sorted_out.ended if a.state is State.RUNNING)


def test_an_action_nothing_serves_now_waits_rather_than_ends() -> None:
    """A broker whose nodes join from Ray restarts before they have joined: its queue waits for them."""
    def no_node_yet(action: Action) -> None:
        raise Unavailable("demand.cpu", "no cpu node is in service now")

    sorted_out = triage([unfinished(1, State.QUEUED), unfinished(2, State.RUNNING)], no_node_yet)
    assert [a.seq for a in sorted_out.resumed] == [1]
    assert [(a.seq, error["code"]) for a, error in sorted_out.ended] == [(2, "broker_restarted")]
