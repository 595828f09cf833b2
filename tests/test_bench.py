"""The benchmark scripts run: short runs of a few of their sections.

Figures are not checked (tests never judge speed); what is checked is that a
script starts its own servers (and workers), finishes, and reports what its
documentation says the section reports.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_bench(script: str, options: list[str], tmp_path: Path) -> tuple[str, dict[str, str]]:
    """Run ``bench/<script>`` with ``options``; assert it exits 0, and return its
    output and its findings (what each one names -> its value)."""
    findings = tmp_path / "findings.json"
    run = subprocess.run(
        [sys.executable, f"bench/{script}", *options, "--json", str(findings)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout, {item["what"]: item["value"] for item in json.loads(findings.read_text())}


def test_bench_task_runs_and_reports_the_lock_stores_time_per_command(tmp_path: Path) -> None:
    """Sections 1 and 5 of ``bench/bench_task.py`` on a few tasks: it exits 0, and
    section 5 reports the ratio to plain, where a task's time goes on the
    worker (the parts between its receipt, start, body, end and the next receipt),
    the lock store's time per ``EVALSHA`` (the scripts) and ``SET`` (the
    peers' and floors' acquire), how often per task the worker's thread slept,
    was preempted and was off its CPU in all (where the system counts it per
    thread), and a prefork pool process's time from being handed a task to its
    body, per kind."""
    options = ["--only", "1,5", "--quick", "--tasks", "20", "--rounds", "1"]
    output, reported = run_bench("bench_task.py", options, tmp_path)
    assert "lock store, time per command over these rounds" in output
    assert "where the time per task goes on the worker" in output
    assert "SingletonTask/plain throughput, interleaved, solo pool" in reported
    for part in ("receipt to start", "start to body", "body", "body to end", "end to next"):
        assert float(reported[f"SingletonTask us {part}, interleaved"]) >= 0
    for command in ("EVALSHA", "SET"):
        assert float(reported[f"lock store us per {command}, interleaved"]) > 0
    if hasattr(resource, "RUSAGE_THREAD"):
        assert "slept preempted   off CPU" in output
        for kind in ("plain task", "SingletonTask", "one round trip (floor)"):
            slept, preempted, off = (
                float(reported[f"{kind} {count} per task, interleaved"])
                for count in ("slept", "preempted", "off CPU")
            )
            assert slept >= 0
            assert preempted >= 0
            assert off == pytest.approx(slept + preempted, abs=0.02)
    # The prefork run: a pool process's time from being handed a task to its body.
    assert "from being handed a no-op task to its body" in output
    for kind in (
        "plain task", "SingletonTask", "SingletonTask, at start", "until_executed, acks_late",
    ):  # fmt: skip
        assert f"{kind} us handed to body, prefork" in reported


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="--pin needs Linux and two CPUs",
)
def test_bench_task_pins_the_worker_apart_from_the_servers(tmp_path: Path) -> None:
    """Section 5 with ``--pin``: it exits 0, says where each process runs, and
    names its findings apart from an unpinned run's."""
    options = ["--only", "5", "--quick", "--tasks", "10", "--rounds", "1", "--work-ms", "0"]
    output, reported = run_bench("bench_task.py", [*options, "--pin"], tmp_path)
    assert "the servers and the producer on the others" in output
    assert "SingletonTask/plain throughput, interleaved pinned, solo pool" in reported
    assert "SingletonTask us handed to body, prefork pinned" in reported


def test_bench_lock_runs_and_counts_commands_and_round_trips(tmp_path: Path) -> None:
    """Section 1 of ``bench/bench_lock.py``, short: it exits 0 and reports the
    commands and round trips of an uncontended acquire + release."""
    _, reported = run_bench("bench_lock.py", ["--quick", "--only", "1"], tmp_path)
    names = " ".join(reported)
    assert "round trips" in names
    assert "commands" in names
