"""The soak's verdict: what must hold however the faults fell, each check expecting zero, read through the API and
from the store, as a table or JSON (``loadtest/soak.py`` runs the soak and fills it in)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table
from sqlalchemy import select

from tangram.store.store import Store
from tangram.store.tables import ActionRow

if TYPE_CHECKING:
    from loadtest.soak import Soak, SoakOptions

TERMINAL = ("succeeded", "failed", "cancelled", "timed_out")
# the checks of the verdict, each expecting zero
CHECKS = ("lost", "not_exactly_one_terminal", "units_in_use", "leases_held", "actions_queued_or_running",
          "environments_left", "containers_left_broker_up", "containers_left_after_stop", "leases_not_returned",
          "wrong_results", "cancel_not_honoured", "internal_errors", "unexpected_http_errors", "broker_log_errors",
          "broker_stop_errors", "driver_errors")
EXAMPLES = 5  # ids or messages kept per failed check


async def store_problems(store_url: str, task: str, states: dict[str, str], sample: int,
                         seed: int) -> dict[str, list[str]]:
    """What the store says against the API: every action of the run stored, in the state the API gives, no action
    the driver never learned of (a second action for one submit), and for a sample of actions transitions that
    end in exactly one terminal state, the API's."""
    problems: dict[str, list[str]] = {"store_missing": [], "store_state_mismatch": [], "store_unknown_actions": [],
                                      "store_transitions_wrong": []}
    store = await Store.open(store_url)
    try:
        async with store.engine.connect() as conn:
            stored = dict((await conn.execute(select(ActionRow.id, ActionRow.state)
                                              .where(ActionRow.task == task))).all())
        for action_id, state in states.items():
            if action_id not in stored:
                problems["store_missing"].append(action_id)
            elif stored[action_id] != state:
                problems["store_state_mismatch"].append(f"{action_id}: store {stored[action_id]}, API {state}")
        problems["store_unknown_actions"] = sorted(set(stored) - set(states))
        ids = sorted(states)
        chosen = ids if sample == 0 or sample >= len(ids) else random.Random(f"{seed}-store").sample(ids, sample)
        for action_id in chosen:
            path = [state for state, _ in await store.transitions(action_id)]
            terminal = [state for state in path if state in TERMINAL]
            if len(terminal) != 1 or path[-1] != terminal[0] or terminal[0] != states[action_id]:
                problems["store_transitions_wrong"].append(f"{action_id}: {' -> '.join(path) or 'none'} "
                                                           f"(API {states[action_id]})")
    finally:
        await store.close()
    return problems


@dataclass
class Verdict:
    options: SoakOptions
    soak: Soak
    states: dict[str, str] = field(default_factory=dict)
    store: dict[str, list[str]] | None = None
    units: dict[str, int] = field(default_factory=dict)
    broker_stats: dict[str, Any] = field(default_factory=dict)
    environments_cleaned: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        ledger = self.soak.ledger
        submitted = len(ledger.actions)
        terminal = {i: s for i, s in self.states.items() if s in TERMINAL}
        not_terminal = sorted(set(ledger.actions) - set(terminal))
        changed = sorted(f"{i}: first {t.seen}, now {self.states[i]}" for i, t in ledger.actions.items()
                         if i in terminal and t.seen != self.states[i])
        breakdown: dict[str, list[str]] = {"not_terminal": not_terminal, "terminal_state_changed": changed,
                                           **(self.store or {})}
        wrong_ids = sorted({entry.split(":")[0] for entries in breakdown.values() for entry in entries})
        # check -> (value, examples); most values count the problems the ledger met
        measured = {name: (len(entries), entries) for name, entries in ledger.problems.items()}
        measured["lost"] = (len(not_terminal), not_terminal)
        measured["not_exactly_one_terminal"] = (len(wrong_ids), wrong_ids)
        measured["units_in_use"] = (sum(self.units.values()),
                                    [f"{name}: {units}" for name, units in sorted(self.units.items()) if units])
        leases = self.broker_stats.get("leases", 0)
        measured["leases_held"] = (leases, [f"{leases} leases still granted"] if leases else [])
        busy = self.broker_stats.get("queued", 0) + self.broker_stats.get("running", 0)
        measured["actions_queued_or_running"] = (busy, [f"{busy} actions"] if busy else [])
        checks = {name: {"value": measured[name][0], "ok": measured[name][0] == 0,
                         "examples": measured[name][1][:EXAMPLES]}
                  for name in CHECKS if name not in self.skipped}
        by_kind = Counter(t.request.kind for t in ledger.actions.values())
        return {
            "ok": all(check["ok"] for check in checks.values()),
            "options": {k: v for k, v in vars(self.options).items() if k != "token"},
            "elapsed_s": round(self.elapsed_s, 1),
            "submitted": submitted,
            "terminal": len(terminal),
            "by_kind": dict(sorted(by_kind.items())),
            "by_state": {state: sum(1 for s in terminal.values() if s == state) for state in TERMINAL},
            "error_codes": dict(ledger.error_codes.most_common()),
            "faults": dict(ledger.faults),
            "kill_notes": dict(ledger.kill_notes),
            "units_in_use": self.units,
            "environments_cleaned_at_end": self.environments_cleaned,
            "not_exactly_one_terminal_breakdown": {k: len(v) for k, v in breakdown.items()},
            "checks": checks,
            "skipped_checks": self.skipped,
        }


def render(verdict: dict[str, Any], console: Console) -> None:
    table = Table(title=f"soak verdict: {'PASS' if verdict['ok'] else 'FAIL'}", show_lines=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_column("")
    table.add_row("actions submitted", str(verdict["submitted"]), "")
    for kind, count in verdict["by_kind"].items():
        table.add_row(f"  {kind}", str(count), "")
    for state, count in verdict["by_state"].items():
        table.add_row(f"ended {state}", str(count), "")
    for fault, count in verdict["faults"].items():
        table.add_row(f"fault {fault}", str(count), "")
    for name, check in verdict["checks"].items():
        mark = "[green]ok[/]" if check["ok"] else "[red]FAIL[/] " + "; ".join(check["examples"])[:200]
        table.add_row(name.replace("_", " "), str(check["value"]), mark)
    for name, why in verdict["skipped_checks"].items():
        table.add_row(name.replace("_", " "), "-", f"skipped: {why}")
    table.add_row("elapsed", f"{verdict['elapsed_s']} s", "")
    console.print(table)
    if verdict["error_codes"]:
        console.print("action errors by kind:code  " + ", ".join(f"{k}={v}" for k, v in verdict["error_codes"].items()),
                      highlight=False)
