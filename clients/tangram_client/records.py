"""The client's view of an action record: typed fields over the broker's JSON, which stays available as ``raw``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tangram_client.errors import ActionError

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "timed_out"})


@dataclass(frozen=True)
class ActionRecord:
    id: str
    task: str
    trajectory: str | None
    kind: str
    state: str
    result: Any
    error: dict[str, Any] | None
    allocation: dict[str, Any] | None
    timings: dict[str, float | None]
    raw: dict[str, Any]

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ActionRecord:
        return cls(id=body["id"], task=body["task"], trajectory=body.get("trajectory"), kind=body["kind"],
                   state=body["state"], result=body.get("result"), error=body.get("error"),
                   allocation=body.get("allocation"), timings=body.get("timings") or {}, raw=body)

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def succeeded(self) -> bool:
        return self.state == "succeeded"

    def raise_for_state(self) -> ActionRecord:
        """This record if the action succeeded; otherwise ``ActionError`` with the broker's code and message."""
        if not self.succeeded:
            raise ActionError(self)
        return self
