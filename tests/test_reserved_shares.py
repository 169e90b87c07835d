"""The order that makes SLO reservations hold (``tangram/sched/reserved_shares.py``): a reserved task's actions first up
to its reservation, counting what its running actions hold, every other action in the order it had."""

from __future__ import annotations

from tangram.core.action import Action
from tangram.parse import parse_action
from tangram.sched.reserved_shares import ReservedShares


def reward(seq: int, task: str, gpus: int = 1) -> Action:
    action = parse_action({"task": task, "kind": "reward", "demand": {"gpu": gpus},
                           "spec": {"service": "rm", "input": {"pairs": [["a", "b"]]}}})
    action.seq = seq
    return action


def running(task: str, gpus: int) -> Action:
    action = reward(0, task, gpus)
    action.units = {"gpu": gpus}
    return action


def tasks(actions: list[Action]) -> list[str]:
    return [f"{a.task}{a.seq}" for a in actions]


def test_without_reservations_the_queue_is_left_as_it_is() -> None:
    queue = [reward(1, "a"), reward(2, "b")]
    shares = ReservedShares("gpu")
    assert shares.order(queue, []) is queue
    shares.reserve({"a": 0})  # a reservation of nothing is none
    assert shares.order(queue, []) is queue and shares.reserved == {}


def test_a_reserved_task_goes_first_up_to_its_reservation_less_what_it_holds() -> None:
    queue = [reward(1, "a"), reward(2, "a"), reward(3, "b"), reward(4, "b"), reward(5, "b"), reward(6, "c")]
    shares = ReservedShares("gpu")
    shares.reserve({"b": 2})
    assert tasks(list(shares.order(queue, []))) == ["b3", "b4", "a1", "a2", "b5", "c6"]
    # one GPU held by a running action of b: one more goes first
    assert tasks(list(shares.order(queue, [running("b", 1), running("a", 4)]))) == ["b3", "a1", "a2", "b4", "b5", "c6"]
    # b holds its two already: the order is FCFS's
    assert tasks(list(shares.order(queue, [running("b", 2)]))) == ["a1", "a2", "b3", "b4", "b5", "c6"]


def test_each_reserved_task_is_owed_its_own_and_an_action_wider_than_what_is_left_waits_its_turn() -> None:
    queue = [reward(1, "a"), reward(2, "b", gpus=2), reward(3, "c"), reward(4, "b"), reward(5, "c")]
    shares = ReservedShares("gpu")
    shares.reserve({"b": 1, "c": 1})
    # b's first asks for two of its one: not owed; its second is. c's first is owed, its second not
    assert tasks(list(shares.order(queue, []))) == ["c3", "b4", "a1", "b2", "c5"]


def test_actions_that_do_not_demand_the_resource_keep_their_order_behind() -> None:
    tool = parse_action({"task": "b", "kind": "exec", "demand": {"cpu": 1}, "spec": {"command": "true"}})
    tool.seq = 2
    queue = [reward(1, "a"), tool, reward(3, "b")]
    shares = ReservedShares("gpu")
    shares.reserve({"b": 1})
    assert tasks(list(shares.order(queue, []))) == ["b3", "a1", "b2"]
