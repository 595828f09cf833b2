# mypy: disallow-untyped-decorators=False
# (Celery ships no type information, so ``@app.task`` is an untyped decorator.)
"""Throughput of a no-op SingletonTask against a plain task, and the lock's Redis cost.

Usage::

    python bench/bench_task.py [--url URL] [--tasks N] [--rounds R] [--quick]

Without ``--url`` a private server is started (see
:class:`celery_redislock.server.RedisServer`). The broker, the result backend
and the lock store all use that one server, and one ``celery worker`` process
(solo pool) runs every task, so the two kinds differ only by the lock.

Three measurements, figures only (nothing is asserted):

1. Throughput: each round enqueues N plain tasks and waits for all results, then
   N singleton tasks (the order alternates between rounds); every call has
   distinct arguments, so no singleton ever conflicts. The worker is paused
   (SIGSTOP) while a batch is enqueued and the clock runs from its resumption to
   the last result, so the figure is how fast one worker drains a backlog.
   Prints tasks/s per round, the medians, the ratio singleton/plain and, on
   Linux, the worker's CPU time per task (steadier than wall time on a busy
   machine).
2. Lock cost per uncontended singleton task: the task body path runs eagerly
   (``task.apply()``) against a second server that holds nothing but locks, so
   every command it sees is the lock's. Client requests (round trips) are
   counted on the client connection, and ``INFO commandstats`` shows what the
   scripts run inside the server.
3. Heartbeat batching: many locks held at once by one process, renewed with
   short TTLs; prints renewal rounds (one pipelined round trip each) against
   the number of EXTEND calls.

The worker subprocess imports this module as ``bench_task``; the task names are
fixed so the script and the worker agree whatever the module is called.
"""

from __future__ import annotations

import argparse
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import celery
import kombu
import redis
from celery import Celery
from celery.result import ResultSet

from celery_redislock import RedisLock, RedisServer, SingletonTask
from celery_redislock.client import get_client
from celery_redislock.heartbeat import get_heartbeat

#: Environment variable giving the worker subprocess the server URL.
URL_ENV = "CELERY_REDISLOCK_BENCH_URL"
#: Queue of the benchmark tasks (so a worker of another app on the same server
#: does not take them).
QUEUE = "celery_redislock_bench"
HERE = Path(__file__).resolve().parent


def configure(app: Celery, url: str) -> None:
    """Broker, result backend and lock store: the server at ``url``."""
    app.conf.update(
        broker_url=url,
        result_backend=url,
        redislock_url=url,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
    )


app = Celery("bench_task", set_as_current=False)
if os.environ.get(URL_ENV):
    configure(app, os.environ[URL_ENV])


@app.task(name="bench.plain", shared=False)
def plain(round_id: str, index: int, work: float = 0.0) -> None:
    """A no-op task (or one that sleeps ``work`` seconds, standing for real work)."""
    if work:
        time.sleep(work)


@app.task(name="bench.singleton", base=SingletonTask, shared=False)
def singleton(round_id: str, index: int, work: float = 0.0) -> None:
    """The same task, run under a lock keyed on its arguments."""
    if work:
        time.sleep(work)


# Environment.
def load_average() -> str:
    """The 1/5/15-minute load averages, or ``n/a``: other work on the machine skews the figures."""
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"


def describe_machine() -> list[str]:
    """Lines describing the machine and library versions."""
    return [
        f"machine: {platform.platform()} ({platform.machine()}), {os.cpu_count()} CPUs, "
        f"load average {load_average()}",
        f"python:  {platform.python_implementation()} {platform.python_version()}",
        f"celery:  {celery.__version__}, kombu {kombu.__version__}, redis-py {redis.__version__}",
    ]


def server_version(url: str) -> str:
    """``redis 7.0.15``-style name and version of the server at ``url``."""
    with redis.Redis.from_url(url) as client:
        info = client.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info['redis_version']}"


def command_calls(client: redis.Redis) -> dict[str, int]:
    """``INFO commandstats`` as ``{command: calls}`` (the INFO calls themselves left out)."""
    stats: dict[str, Any] = client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(value["calls"]) for name, value in stats.items()}
    calls.pop("info", None)
    return calls


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Per-command difference of two :func:`command_calls` snapshots (zeros dropped)."""
    diff = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    return {name: n for name, n in diff.items() if n}


# 1. Throughput with a real worker.
@contextmanager
def worker_process(url: str) -> Iterator[subprocess.Popen[bytes]]:
    """A ``celery worker`` subprocess (solo pool) importing this module."""
    env = dict(os.environ)
    env[URL_ENV] = url
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")) if p
    )
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "--app",
                "bench_task:app",
                "--quiet",
                "worker",
                "--pool",
                "solo",
                "--loglevel",
                "WARNING",
                "--without-mingle",
                "--without-gossip",
                "--without-heartbeat",
                "--queues",
                QUEUE,
                "--hostname",
                f"bench-{uuid.uuid4().hex[:8]}@%h",
            ],
            cwd=HERE,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield process
        except BaseException:
            log.seek(0)
            tail = log.read()[-4000:].decode(errors="replace")
            if tail:
                print(f"--- worker output (tail) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            if CAN_PAUSE:
                os.kill(process.pid, signal.SIGCONT)
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


#: Whether the worker can be paused while a batch is enqueued (POSIX).
CAN_PAUSE = hasattr(signal, "SIGSTOP")


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc`` only)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_batch(
    task: Any, count: int, worker: subprocess.Popen[bytes], timeout: float, work: float = 0.0
) -> tuple[float, float | None]:
    """Enqueue ``count`` calls with distinct arguments and wait for every result.

    The worker is paused while the batch is enqueued, and the clock starts when
    it resumes: the figure is how fast one worker drains a backlog, without the
    producer competing for the CPU. (Where processes cannot be paused, the clock
    starts before the first message is sent.)

    Returns the seconds taken and the worker's CPU seconds (``None`` off Linux).
    """
    round_id = uuid.uuid4().hex
    if CAN_PAUSE:
        os.kill(worker.pid, signal.SIGSTOP)
    try:
        started = time.perf_counter()
        results = ResultSet([task.apply_async((round_id, i, work)) for i in range(count)])
    finally:
        if CAN_PAUSE:
            cpu_before = cpu_seconds(worker.pid)
            started = time.perf_counter()
            os.kill(worker.pid, signal.SIGCONT)
    # join_native polls every `interval` seconds (0.5 by default, too coarse here).
    results.join_native(timeout=timeout, propagate=True, interval=0.005)
    elapsed = time.perf_counter() - started
    cpu_after = cpu_seconds(worker.pid)
    results.forget()
    if not CAN_PAUSE or cpu_before is None or cpu_after is None:
        return elapsed, None
    return elapsed, cpu_after - cpu_before


def measure_throughput(
    url: str, count: int, rounds: int, work: float = 0.0
) -> dict[str, list[float]]:
    """Alternate plain and singleton rounds on one worker.

    Returns ``{"plain": [tasks/s...], "singleton": [...], "plain_cpu": [worker CPU
    ms per task...], "singleton_cpu": [...]}`` (the CPU lists empty off Linux).
    """
    client = redis.Redis.from_url(url)
    kinds: dict[str, Any] = {"plain": plain, "singleton": singleton}
    figures: dict[str, list[float]] = {
        "plain": [],
        "singleton": [],
        "plain_cpu": [],
        "singleton_cpu": [],
    }
    evalsha = {"plain": 0, "singleton": 0}
    with worker_process(url) as worker:
        plain.apply_async(("warm-up", 0)).get(timeout=60)  # waits for the worker to be up
        for name in kinds:  # warm both paths: connections, scripts, imports
            run_batch(kinds[name], max(20, count // 10), worker, timeout=60)
        for r in range(rounds):
            order = ["plain", "singleton"] if r % 2 == 0 else ["singleton", "plain"]
            for name in order:
                before = command_calls(client)
                elapsed, cpu = run_batch(
                    kinds[name], count, worker, timeout=60 + count * (0.02 + work), work=work
                )
                calls = delta(before, command_calls(client))
                figures[name].append(count / elapsed)
                if cpu is not None:
                    figures[f"{name}_cpu"].append(cpu / count * 1000)
                evalsha[name] += calls.get("evalsha", 0) + calls.get("eval", 0)
            line = (
                f"  round {r + 1}/{rounds}: plain {figures['plain'][-1]:6.0f} tasks/s, "
                f"singleton {figures['singleton'][-1]:6.0f} tasks/s"
            )
            if figures["plain_cpu"] and figures["singleton_cpu"]:
                line += (
                    f"   (worker CPU per task: plain {figures['plain_cpu'][-1]:.2f} ms, "
                    f"singleton {figures['singleton_cpu'][-1]:.2f} ms)"
                )
            print(line, flush=True)
    extra = (evalsha["singleton"] - evalsha["plain"]) / (count * rounds)
    print(f"  EVALSHA per task in the worker, singleton minus plain: {extra:.2f}")
    return figures


# 2. Lock cost per uncontended task, on a lock-only server.
@contextmanager
def counting_requests(client: redis.Redis) -> Iterator[Callable[[], int]]:
    """Count the requests ``client`` sends (one per ``execute_command``)."""
    original: Callable[..., Any] = client.execute_command
    sent = 0

    def counted(*args: Any, **options: Any) -> Any:
        nonlocal sent
        sent += 1
        return original(*args, **options)

    setattr(client, "execute_command", counted)  # noqa: B010 - instance override
    try:
        yield lambda: sent
    finally:
        delattr(client, "execute_command")


def measure_lock_cost(lock_url: str, count: int) -> None:
    """Run the singleton body path eagerly against a lock-only server and count commands."""
    eager = Celery("bench_eager", set_as_current=False)
    eager.conf.update(redislock_url=lock_url, broker_url="memory://", result_backend=None)

    @eager.task(name="bench.eager_singleton", base=SingletonTask, shared=False)
    def eager_singleton(round_id: str, index: int) -> None:
        """The no-op under a lock."""

    @eager.task(name="bench.eager_plain", shared=False)
    def eager_plain(round_id: str, index: int) -> None:
        """The no-op."""

    lock_client = get_client(lock_url)
    for i in range(10):  # loads the scripts, opens the connection
        eager_singleton.apply(("warm-up", i)).get()
        eager_plain.apply(("warm-up", i)).get()
    started = time.perf_counter()
    for i in range(count):
        eager_plain.apply(("plain", i))
    plain_elapsed = time.perf_counter() - started
    stats = redis.Redis.from_url(lock_url)
    round_id = uuid.uuid4().hex
    before = command_calls(stats)
    with counting_requests(lock_client) as sent:
        started = time.perf_counter()
        for i in range(count):
            result = eager_singleton.apply((round_id, i))
            if result.failed():
                raise RuntimeError(f"eager singleton failed: {result.result!r}")
        elapsed = time.perf_counter() - started
        requests = sent()
    calls = delta(before, command_calls(stats))
    leftover = sum(1 for _ in stats.scan_iter("redislock:{bench.eager_singleton*}", count=1000))
    fences = sum(1 for _ in stats.scan_iter("redislock:{bench.eager_singleton*}:fence", count=1000))
    inside = {k: v for k, v in calls.items() if k not in ("evalsha", "eval", "script|load")}
    print(f"  client requests (round trips) per task: {requests / count:.2f}")
    print(
        "  EVALSHA per task: "
        f"{calls.get('evalsha', 0) / count:.2f}, EVAL {calls.get('eval', 0) / count:.2f}, "
        f"SCRIPT LOAD {calls.get('script|load', 0) / count:.2f}"
    )
    print(
        f"  commands run inside the scripts per task: {sum(inside.values()) / count:.2f} ("
        + ", ".join(f"{k} {v / count:.2f}" for k, v in sorted(inside.items()))
        + ")"
    )
    print(
        f"  left in Redis: {leftover} lock hashes, {fences} fencing counters "
        "(one per distinct key, expiring an hour after its last use)"
    )
    plain_us, singleton_us = plain_elapsed / count * 1e6, elapsed / count * 1e6
    print(
        f"  task.apply() in process: plain {plain_us:.0f} us, singleton {singleton_us:.0f} us "
        f"(the lock adds {singleton_us - plain_us:.0f} us; {count} calls each)"
    )


# 3. Heartbeat batching.
def measure_heartbeat(lock_url: str, held: int, seconds: float) -> None:
    """Hold ``held`` locks with a short TTL for ``seconds``; count renewal rounds and EXTENDs."""
    stats = redis.Redis.from_url(lock_url)
    heartbeat = get_heartbeat()
    ttl = 0.6  # renewed every 0.2 s
    locks = [RedisLock(lock_url, f"bench-heartbeat-{i}", ttl=ttl) for i in range(held)]
    for lock in locks:
        lock.acquire(blocking=False)
    # Let one renewal round pass (the first one on a server also loads the script),
    # then start and stop the window between two rounds, so none is cut in half.
    time.sleep(ttl / 3 + ttl / 6)
    rounds_before = heartbeat.rounds
    before = command_calls(stats)
    time.sleep(seconds)
    calls = delta(before, command_calls(stats))
    rounds = heartbeat.rounds - rounds_before
    for lock in locks:
        lock.release()
    lost = sum(lock.lost for lock in locks)
    print(
        f"  {held} locks held {seconds:.1f} s (TTL {ttl} s): {rounds} renewal round trips, "
        f"{calls.get('evalsha', 0)} EXTEND calls ({calls.get('evalsha', 0) / max(rounds, 1):.1f} "
        f"per round trip), {lost} lost"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its figures."""
    parser = argparse.ArgumentParser(
        description="Throughput of a no-op SingletonTask against a plain task, and the lock's Redis cost."
    )
    parser.add_argument("--url", help="Redis URL to use (default: start a private server)")
    parser.add_argument("--tasks", type=int, help="tasks per kind and round (default 1000)")
    parser.add_argument("--rounds", type=int, help="rounds of each kind (default 5)")
    parser.add_argument("--quick", action="store_true", help="a short run (about 15 s)")
    parser.add_argument(
        "--work-ms",
        type=float,
        default=0.0,
        help="milliseconds each task sleeps, standing for real work (default 0: no-op)",
    )
    options = parser.parse_args(argv)
    count = options.tasks or (200 if options.quick else 1000)
    rounds = options.rounds or (3 if options.quick else 5)
    if count < 1 or rounds < 1:
        parser.error("--tasks and --rounds must be at least 1")

    for line in describe_machine():
        print(line)
    with ExitStack() as stack:
        url = options.url or stack.enter_context(RedisServer()).url
        try:
            lock_url = stack.enter_context(RedisServer()).url
            lock_note = "a private server holding only locks"
        except Exception as exc:  # no server binary: share the given server
            lock_url = url
            lock_note = f"the main server ({exc}; other clients' commands would count)"
        print(f"server:  {server_version(url)} at {url}")
        print(f"tasks:   {count} per kind and round, {rounds} rounds, 1 worker (solo pool)")
        print(flush=True)

        configure(app, url)
        what = f"tasks of {options.work_ms:g} ms" if options.work_ms else "no-op tasks"
        print(f"Throughput, {what}, broker + results + locks on one server:")
        figures = measure_throughput(url, count, rounds, options.work_ms / 1000)
        plain_rate = statistics.median(figures["plain"])
        singleton_rate = statistics.median(figures["singleton"])
        print(f"  plain:     {plain_rate:6.0f} tasks/s (median of {rounds})")
        print(f"  singleton: {singleton_rate:6.0f} tasks/s (median of {rounds})")
        print(f"  ratio singleton/plain: {singleton_rate / plain_rate:.3f} (target >= 0.95)")
        if figures["plain_cpu"] and figures["singleton_cpu"]:
            plain_cpu = statistics.median(figures["plain_cpu"])
            singleton_cpu = statistics.median(figures["singleton_cpu"])
            print(
                f"  worker CPU per task (median): plain {plain_cpu:.2f} ms, "
                f"singleton {singleton_cpu:.2f} ms (ratio plain/singleton "
                f"{plain_cpu / singleton_cpu:.3f})"
            )
        print()

        print(f"Lock cost per uncontended singleton task, on {lock_note}:")
        measure_lock_cost(lock_url, 500 if options.quick else 2000)
        print("  (target: 2 round trips, acquire + release)")
        print()

        print("Heartbeat, one process:")
        measure_heartbeat(lock_url, 100, 1.0)
    print(f"\nload average at the end: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
