"""Tests for the seckill example: the batch, its invariants, dedup, fencing, cleanup."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_redislock.scripts import OWNER_FIELD
from celery_redislock.server import RedisServer
from example_worker import inventory
from example_worker.__main__ import build_parser
from example_worker.inventory import commit_sale, event_keys, open_event, stale_holder_demo
from example_worker.report import Click, RunResult, build_report
from tests.support import child_environment, field

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Batch:
    """One finished ``python -m example_worker`` run and what Redis held right after it."""

    returncode: int
    stdout: str
    stderr: str
    report: dict[str, Any]
    sales: list[dict[str, Any]]
    stock: int
    low: int
    attempts: dict[str, int]
    held_locks: list[str]


def seckill_env(redis_url: str | None) -> dict[str, str]:
    """The environment of a run: REDIS_URL set (or removed: embedded Redis), no SECKILL_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SECKILL_")}
    for name in ("REDIS_URL", "BROKER_URL", "RESULT_BACKEND", "REDISLOCK_URL"):
        env.pop(name, None)
    if redis_url is not None:
        env["REDIS_URL"] = redis_url
    return env


def run_seckill(
    args: list[str],
    tmp_path: Path,
    redis_url: str | None,
    timeout: float = 120,
    python: str | None = None,
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """Run the one command with ``--json`` and return the process and the JSON report
    (with ``python``, an interpreter of another environment, this project's sources
    on its path)."""
    report_path = tmp_path / f"report-{time.monotonic_ns()}.json"
    env = seckill_env(redis_url)
    if python is not None:
        env["PYTHONPATH"] = child_environment()["PYTHONPATH"]
    done = subprocess.run(
        [python or sys.executable, "-m", "example_worker", *args, "--json", str(report_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert report_path.exists(), f"no report written:\n{done.stdout}\n{done.stderr}"
    return done, json.loads(report_path.read_text())


def text(value: bytes | str) -> str:
    """A reply as text, whichever way the client decodes."""
    return value.decode() if isinstance(value, bytes) else value


def snapshot(
    client: redis.Redis, done: subprocess.CompletedProcess[str], report: dict[str, Any]
) -> Batch:
    """Read the event's raw keys (not through the example's own helpers)."""
    keys = event_keys(report["event_id"])
    locks = sorted(
        text(k)
        for k in client.scan_iter("redislock:{example_worker.tasks.*}")
        if field(client, k, OWNER_FIELD)  # a free lock's key stays a while, for its fence
    )
    return Batch(
        returncode=done.returncode,
        stdout=done.stdout,
        stderr=done.stderr,
        report=report,
        sales=[json.loads(raw) for raw in client.lrange(keys.sales, 0, -1)],
        stock=int(client.get(keys.stock) or 0),
        low=int(client.get(keys.low) or 0),
        attempts={text(k): int(v) for k, v in client.hgetall(keys.attempts).items()},
        held_locks=locks,
    )


@pytest.fixture(scope="module")
def locked_batch(
    redislock_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Batch]:
    """A small locked run (12 buyers, 4 tickets, 2 workers, every 3rd buyer double-clicks)."""
    done, report = run_seckill(
        ["--buyers", "12", "--tickets", "4", "--workers", "2", "--double-click-every", "3"],
        tmp_path_factory.mktemp("locked"),
        redislock_server.url,
    )
    client = redislock_server.client()
    yield snapshot(client, done, report)
    client.close()


def test_small_run_exits_zero_and_reports_ok(locked_batch: Batch) -> None:
    """The locked run exits 0 and its report ends with the invariants holding."""
    assert locked_batch.returncode == 0, locked_batch.stderr
    assert "invariants: OK" in locked_batch.stdout
    for label in ("sold", "sold out", "duplicates suppressed", "stale writes rejected"):
        assert label in locked_batch.stdout
    assert "lock wait" in locked_batch.stdout
    assert "makespan" in locked_batch.stdout
    assert locked_batch.report["invariants_ok"] is True


def test_small_run_invariants_hold_in_redis(locked_batch: Batch) -> None:
    """Redis itself shows min(tickets, buyers) sold, nobody twice, stock never below zero."""
    users = [sale["user"] for sale in locked_batch.sales]
    assert len(users) == 4
    assert len(set(users)) == len(users)
    assert locked_batch.stock == 0
    assert locked_batch.low == 0
    tokens = [sale["token"] for sale in locked_batch.sales]
    assert all(isinstance(t, int) for t in tokens)
    assert tokens == sorted(tokens), "sales are written in fencing-token order"


def test_double_click_is_one_attempt(locked_batch: Batch) -> None:
    """Every double click publishes nothing new: one purchase attempt per buyer."""
    report = locked_batch.report
    assert report["double_clickers"] == 4
    assert report["clicks"] == 16
    assert report["duplicates_suppressed"] == 4
    assert locked_batch.attempts == {f"buyer-{i:02d}": 1 for i in range(1, 13)}


def test_run_spreads_over_workers_and_frees_every_lock(locked_batch: Batch) -> None:
    """Both workers took orders, and no lock is left held after the run."""
    per_worker = locked_batch.report["per_worker"]
    assert sum(w["attempts"] for w in per_worker.values()) == 12
    assert set(per_worker) <= set(locked_batch.report["workers"])
    assert len(locked_batch.report["workers"]) == 2
    assert locked_batch.held_locks == []


def test_run_shows_the_fence_stopping_a_stale_holder(locked_batch: Batch) -> None:
    """The report's fencing check: the stalled holder's late write was rejected."""
    fencing = locked_batch.report["fencing"]
    assert fencing["stopped"] is True
    assert fencing["stale_write_accepted"] is False
    assert fencing["fresh_token"] > fencing["stale_token"]
    assert "rejected by the fence" in locked_batch.stdout


def test_no_lock_run_reports_what_happened(redislock_server: RedisServer, tmp_path: Path) -> None:
    """--no-lock runs the same batch unlocked, exits 0 and says whether it oversold."""
    done, report = run_seckill(
        ["--no-lock", "--buyers", "12", "--tickets", "4", "--workers", "2"],
        tmp_path,
        redislock_server.url,
    )
    client = redislock_server.client()
    batch = snapshot(client, done, report)
    client.close()
    assert batch.returncode == 0, batch.stderr
    assert report["mode"] == "no-lock"
    assert report["duplicates_suppressed"] == 0
    assert sum(batch.attempts.values()) == report["clicks"] == 14
    oversold = len(batch.sales) > 4 or batch.low < 0
    assert report["oversold"] is oversold
    if oversold:
        assert "OVERSOLD without the lock" in batch.stdout
    else:
        assert "no oversell this run" in batch.stdout
    assert len(batch.sales) + batch.stock == 4, "every sale decremented the stock once"


@pytest.mark.slow
def test_full_run_50_buyers_10_tickets_embedded_redis(tmp_path: Path) -> None:
    """The default run (embedded Redis, 4 workers, 50 buyers, 10 tickets) passes."""
    done, report = run_seckill([], tmp_path, redis_url=None, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "embedded" in done.stderr
    assert "invariants: OK" in done.stdout
    assert report["buyers"] == 50
    assert report["tickets"] == 10
    assert report["sold"] == 10
    assert report["duplicates_suppressed"] == 10
    assert report["attempts"] == 50
    assert len(report["workers"]) == 4
    sales = report["state"]["sales"]
    assert len({s["user"] for s in sales}) == 10
    assert report["state"]["low"] == 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_stops_workers_and_embedded_redis(signum: int) -> None:
    """Ctrl-C (or SIGTERM) mid-run stops every worker and the embedded Redis."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "example_worker",
            "--workers",
            "2",
            "--buyers",
            "300",
            "--tickets",
            "300",
            "--think",
            "0.05",
        ],
        cwd=ROOT,
        env=seckill_env(None),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stderr is not None
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = process.stderr.readline()
            if not line:
                break
            seen.append(line)
            if "opening the sale" in line:
                break
        assert any("opening the sale" in line for line in seen), "".join(seen)
        time.sleep(0.3)
        process.send_signal(signum)
        _out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    stderr = "".join(seen) + err
    assert process.returncode == 130, stderr
    pids = [int(p) for p in re.findall(r"started worker \S+ \(pid (\d+)\)", stderr)]
    assert len(pids) == 2
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    url = re.search(r"at (redis://\S+)", stderr)
    assert url is not None
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url.group(1), socket_connect_timeout=1).ping()


def test_fence_rejects_an_older_token_after_a_newer_one_wrote(
    redislock_client: redis.Redis,
) -> None:
    """commit_sale refuses a write whose token is older than one that already wrote."""
    open_event(redislock_client, "fence", tickets=3)
    assert commit_sale(redislock_client, "fence", "a", token=5).accepted
    assert commit_sale(redislock_client, "fence", "b", token=7).stock_left == 1
    stale = commit_sale(redislock_client, "fence", "c", token=6)
    assert not stale.accepted
    assert stale.newer_token == 7
    state = inventory.read_event(redislock_client, "fence")
    assert [s.user for s in state.sales] == ["a", "b"]
    assert state.stock == 1
    assert state.stale == 1
    assert commit_sale(redislock_client, "fence", "d", token=7).accepted, "same token may write"


def test_unfenced_write_is_not_checked(redislock_client: redis.Redis) -> None:
    """token=None (the --no-lock path) writes without looking at the fence."""
    open_event(redislock_client, "nofence", tickets=1)
    assert commit_sale(redislock_client, "nofence", "a", token=9).accepted
    assert commit_sale(redislock_client, "nofence", "b", token=None).accepted
    state = inventory.read_event(redislock_client, "nofence")
    assert state.stock == -1
    assert state.low == -1


def test_stale_holder_that_lost_its_lock_is_stopped(redislock_client: redis.Redis) -> None:
    """A holder that stalled past its TTL cannot write after its successor did."""
    demo = stale_holder_demo(redislock_client, "demo", "purchase-demo", stall_ttl=0.2)
    assert demo.fresh_token > demo.stale_token
    assert demo.fresh_write.accepted
    assert not demo.stale_write.accepted
    assert demo.stale_release_found_lost
    assert demo.stopped
    assert (demo.sold, demo.stock_left) == (1, 0)


def test_gated_sale_waits_for_opening_or_cancellation(redislock_client: redis.Redis) -> None:
    """Clicks wait while the sale is pending, go at the opening, and stop if it is called off."""
    open_event(redislock_client, "ungated", tickets=1)
    assert inventory.wait_for_opening(redislock_client, "ungated", limit=0)
    open_event(redislock_client, "gated", tickets=1, gated=True)
    assert not inventory.wait_for_opening(redislock_client, "gated", limit=0.05)
    opens_at = inventory.open_sale(redislock_client, "gated", delay=0.05)
    assert inventory.wait_for_opening(redislock_client, "gated", limit=0)
    assert time.time() >= opens_at
    inventory.cancel_sale(redislock_client, "gated")
    assert not inventory.wait_for_opening(redislock_client, "gated", limit=5)


def test_report_flags_an_oversell_as_failed_invariants_with_the_lock() -> None:
    """A locked run whose Redis state shows an oversell fails its invariants (exit 1)."""
    state = inventory.EventState(
        event_id="e",
        tickets=1,
        stock=-1,
        low=-1,
        sales=[inventory.Sale("a", 1), inventory.Sale("a", 2)],
        attempts={"a": 2},
    )
    clicks = [Click("a", "t1"), Click("a", "t2")]
    outcomes = {
        "t1": {"outcome": "sold", "worker": "w1", "lock_wait": 0.1},
        "t2": {"outcome": "sold", "worker": "w2", "lock_wait": 0.2},
    }
    run = RunResult(True, "e", 1, clicks, outcomes, {}, [], state, 1.0)
    report = build_report(run)
    failed = {c.name for c in report.checks if not c.ok}
    assert failed == {
        "sold == min(tickets, distinct buyers)",
        "nobody bought twice",
        "inventory never below zero",
        "one purchase attempt per buyer",
    }
    assert report.exit_code == 1
    assert "invariants: FAILED" in report.to_text()
    unlocked = build_report(RunResult(False, "e", 1, clicks, outcomes, {}, [], state, 1.0))
    assert unlocked.exit_code == 0, "without the lock an oversell is reported, not an error"
    assert "OVERSOLD" in unlocked.to_text()


def test_report_counts_failed_tasks_as_a_broken_run() -> None:
    """A task that failed makes the run exit 1 even without the lock."""
    state = inventory.EventState(event_id="e", tickets=1, stock=1, low=1)
    run = RunResult(False, "e", 1, [Click("a", "t1")], {}, {"t1": "FAILURE boom"}, [], state, 0)
    report = build_report(run)
    assert report.exit_code == 1
    assert "did not complete" in report.to_text()


def test_cli_counts_default_from_environment() -> None:
    """SECKILL_* variables set the defaults; flags override them."""
    parser = build_parser({"SECKILL_TICKETS": "3", "SECKILL_BUYERS": "7"})
    args = parser.parse_args([])
    assert (args.tickets, args.buyers, args.double_click_every) == (3, 7, 5)
    assert parser.parse_args(["--tickets", "9"]).tickets == 9
    defaults = build_parser({}).parse_args([])
    assert (defaults.tickets, defaults.buyers, defaults.no_lock) == (10, 50, False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--worker", "--enqueue-only"])
