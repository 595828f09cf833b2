"""The run's report: what happened, and whether the invariants held."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from celery_redislock import is_skipped
from example_worker.inventory import EventState, StaleHolderDemo


@dataclass(frozen=True)
class Click:
    """One submission by a buyer and the id of the task that answers it."""

    user: str
    task_id: str


@dataclass(frozen=True)
class Check:
    """One invariant and whether it held."""

    name: str
    ok: bool
    detail: str


@dataclass
class RunResult:
    """Everything a run observed, before judging it."""

    locked: bool
    event_id: str
    tickets: int
    clicks: list[Click]
    #: Results of the tasks that succeeded, by task id.
    outcomes: dict[str, dict[str, Any]]
    #: Error text of the tasks that failed, by task id.
    failures: dict[str, str]
    #: Ids of tasks still unfinished when the run stopped waiting.
    unfinished: list[str]
    state: EventState
    makespan: float
    workers: list[str] = field(default_factory=list)
    fencing: StaleHolderDemo | None = None


@dataclass
class Report:
    """The judged run: numbers, invariants and the exit code."""

    run: RunResult
    buyers: int
    double_clickers: int
    duplicates_suppressed: int
    attempts: int
    outcome_counts: Counter[str]
    per_worker: dict[str, dict[str, int]]
    lock_wait_total: float
    lock_wait_max: float
    checks: list[Check]
    broken: list[str]

    @property
    def oversold(self) -> bool:
        """More tickets sold than were on sale, or the stock went below zero."""
        state = self.run.state
        return state.sold > state.tickets or state.low < 0

    @property
    def invariants_ok(self) -> bool:
        """Every invariant held."""
        return all(check.ok for check in self.checks)

    @property
    def exit_code(self) -> int:
        """0 when the run worked (and, with the lock, every invariant held), else 1."""
        if self.broken:
            return 1
        if self.run.locked and not self.invariants_ok:
            return 1
        return 0

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready form of the report."""
        run = self.run
        return {
            "mode": "lock" if run.locked else "no-lock",
            "event_id": run.event_id,
            "tickets": run.tickets,
            "buyers": self.buyers,
            "clicks": len(run.clicks),
            "double_clickers": self.double_clickers,
            "duplicates_suppressed": self.duplicates_suppressed,
            "attempts": self.attempts,
            "sold": run.state.sold,
            "outcomes": dict(sorted(self.outcome_counts.items())),
            "stale_writes_rejected": run.state.stale,
            "stock_left": run.state.stock,
            "lowest_stock": run.state.low,
            "oversold": self.oversold,
            "per_worker": self.per_worker,
            "workers": run.workers,
            "lock_wait_total": self.lock_wait_total,
            "lock_wait_max": self.lock_wait_max,
            "makespan": run.makespan,
            "failures": run.failures,
            "unfinished": run.unfinished,
            "fencing": run.fencing.as_dict() if run.fencing else None,
            "invariants": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks],
            "invariants_ok": self.invariants_ok,
            "broken": self.broken,
            "exit_code": self.exit_code,
            "state": run.state.as_dict(),
        }

    def to_json(self) -> str:
        """The report as JSON."""
        return json.dumps(self.as_dict(), indent=2, sort_keys=True)

    def to_text(self) -> str:
        """The report for people."""
        run, state = self.run, self.run.state
        counts = self.outcome_counts
        mode = "with the lock" if run.locked else "WITHOUT the lock (--no-lock)"
        clicks = len(run.clicks)
        lines = [
            f"seckill report: event {run.event_id}, {mode}",
            "",
            f"  tickets on sale        {run.tickets}",
            f"  buyers                 {self.buyers} ({self.double_clickers} clicked twice: "
            f"{clicks} clicks)",
            f"  duplicates suppressed  {self.duplicates_suppressed}"
            + (
                " (a second click while the first was pending: nothing sent)"
                if run.locked
                else " (no lock: every click ran)"
            ),
            f"  purchase attempts      {self.attempts}",
            f"  sold                   {state.sold}",
            f"  sold out               {counts.get('sold_out', 0)}",
            f"  already had a ticket   {counts.get('already_has_ticket', 0)}",
            *(
                [f"  cancelled              {counts['cancelled']} (the sale was called off)"]
                if counts.get("cancelled")
                else []
            ),
            f"  stale writes rejected  {state.stale}",
            f"  stock left             {state.stock} (lowest ever {state.low})",
        ]
        if run.locked:
            lines.append(
                f"  lock wait              total {self.lock_wait_total:.2f} s, "
                f"max {self.lock_wait_max:.2f} s"
            )
        lines.append(f"  makespan               {run.makespan:.2f} s")
        lines.append("  per worker             attempts  sold")
        for name, numbers in sorted(self.per_worker.items()):
            lines.append(f"    {name:<28} {numbers['attempts']:>6} {numbers['sold']:>5}")
        if run.fencing is not None:
            demo = run.fencing
            late = "rejected by the fence" if not demo.stale_write.accepted else "ACCEPTED"
            lines += [
                "",
                f"  fencing check          holder A (token {demo.stale_token}) stalled "
                "past its lock's TTL;",
                f"                         holder B (token {demo.fresh_token}) took the lock "
                "and sold the last ticket;",
                f"                         A woke up and wrote with its older token: {late}",
                f"                         (sold {demo.sold}, stock {demo.stock_left})",
            ]
        if self.broken:
            lines += ["", "  the run did not complete:"]
            lines += [f"    - {problem}" for problem in self.broken]
        lines += ["", "invariants:"]
        for check in self.checks:
            mark = "ok  " if check.ok else "FAIL"
            lines.append(f"  [{mark}] {check.name}: {check.detail}")
        if run.locked:
            lines.append("invariants: OK" if self.invariants_ok else "invariants: FAILED")
        else:
            if self.oversold:
                lines.append(
                    f"OVERSOLD without the lock: {state.sold} tickets sold of {run.tickets} "
                    f"(stock {state.stock}); buyers raced between checking and decrementing"
                )
            else:
                lines.append(
                    "no oversell this run: the race did not hit (it may not on every run; "
                    "try again, or raise --buyers/--workers)"
                )
            lines.append(
                "(without the lock a broken invariant is the expected outcome, not an error)"
            )
        return "\n".join(lines)


def build_report(run: RunResult) -> Report:
    """Count, time and judge a run."""
    state = run.state
    seen_ids: set[str] = set()
    per_user: Counter[str] = Counter()
    suppressed = 0
    for click in run.clicks:
        per_user[click.user] += 1
        if click.task_id in seen_ids:
            suppressed += 1
        seen_ids.add(click.task_id)
    buyers = len(per_user)
    double_clickers = sum(1 for n in per_user.values() if n > 1)

    counts: Counter[str] = Counter()
    per_worker: dict[str, dict[str, int]] = {}
    waits: list[float] = []
    for outcome in run.outcomes.values():
        if is_skipped(outcome):
            # A duplicate that reached a worker but found the click's lock held.
            suppressed += 1
            counts["skipped"] += 1
            continue
        kind = str(outcome.get("outcome"))
        counts[kind] += 1
        worker = str(outcome.get("worker") or "?")
        numbers = per_worker.setdefault(worker, {"attempts": 0, "sold": 0})
        numbers["attempts"] += 1
        numbers["sold"] += kind == "sold"
        waits.append(float(outcome.get("lock_wait") or 0.0))
    attempts = sum(state.attempts.values())

    broken: list[str] = []
    if run.failures:
        broken.append(
            f"{len(run.failures)} task(s) failed: "
            + "; ".join(
                f"{task_id}: {error}" for task_id, error in sorted(run.failures.items())[:5]
            )
        )
    if run.unfinished:
        broken.append(
            f"{len(run.unfinished)} task(s) had not finished when the run stopped waiting"
        )

    expected = min(run.tickets, buyers)
    twice = state.bought_twice()
    checks = [
        Check(
            "sold == min(tickets, distinct buyers)",
            state.sold == expected,
            f"{state.sold} == min({run.tickets}, {buyers}) = {expected}",
        ),
        Check(
            "nobody bought twice",
            not twice,
            "every sale went to a different buyer"
            if not twice
            else f"{len(twice)} buyer(s) got two tickets: {', '.join(twice[:5])}",
        ),
        Check(
            "inventory never below zero",
            state.low >= 0 and state.stock == state.tickets - state.sold,
            f"lowest stock {state.low}, stock {state.stock} == {state.tickets} - {state.sold} sold"
            if state.stock == state.tickets - state.sold
            else f"lowest stock {state.low}, but stock {state.stock} != "
            f"{state.tickets} - {state.sold} sold",
        ),
    ]
    if run.locked:
        checks.append(
            Check(
                "one purchase attempt per buyer",
                all(n == 1 for n in state.attempts.values()) and len(state.attempts) == buyers,
                f"{attempts} attempts by {len(state.attempts)} of {buyers} buyers",
            )
        )
    if run.fencing is not None:
        checks.append(
            Check(
                "a stale holder's write is rejected",
                run.fencing.stopped,
                f"token {run.fencing.stale_token} after {run.fencing.fresh_token}: "
                + ("rejected" if not run.fencing.stale_write.accepted else "accepted"),
            )
        )
    return Report(
        run=run,
        buyers=buyers,
        double_clickers=double_clickers,
        duplicates_suppressed=suppressed,
        attempts=attempts,
        outcome_counts=counts,
        per_worker=per_worker,
        lock_wait_total=sum(waits),
        lock_wait_max=max(waits, default=0.0),
        checks=checks,
        broken=broken,
    )
