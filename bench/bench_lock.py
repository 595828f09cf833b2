"""Cost and handoff latency of RedisLock against plain Redis and redis-py's Lock.

Usage::

    python bench/bench_lock.py [--url URL] [--quick]

Without ``--url`` a private server is started (see
:class:`celery_redislock.server.RedisServer`); with it, use a server nothing else
is talking to, or the server-side counts in part 3 pick up other traffic.

Three measurements, figures only (nothing is asserted):

1. Uncontended throughput: acquire+release pairs per second on one name, one
   client, one thread, for ``RedisLock`` (heartbeat off and on), a raw
   ``SET key val NX PX`` + ``DEL`` pair, and ``redis.lock.Lock``. Ratios are
   against the raw pair, the cheapest thing that can be called a lock.
2. Handoff latency: 4 processes contend for one name; each holds it briefly,
   releases, pauses, and asks again. The latency is the time from one process's
   release to the moment another process holds it (release -> next holder),
   p50/p99 over every handoff between different processes. ``RedisLock`` waiters
   are woken by a pub/sub message; redis-py's ``Lock`` polls, sleeping between
   attempts (0.1 s by default).
3. Redis round trips per uncontended acquire+release, from the server's own
   counters (``INFO stats`` socket reads, ``INFO commandstats``) and from the
   client's connection (writes), with the scripts already loaded.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import platform
import random
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import redis

from celery_redislock import RedisLock, RedisServer

#: Seconds a contender holds the lock (drawn at random between the two), and
#: pauses after releasing it (part 2). Four contenders then keep the lock in
#: demand: others are waiting at nearly every release. The pause is as long as
#: redis-py's default poll interval, so a releaser does not cut the measured gap
#: short by taking the lock straight back.
HOLD = (0.04, 0.08)
THINK = 0.1
CONTENDERS = 4


def machine_report(client: redis.Redis) -> str:
    """Platform, CPUs, Python and server versions, one per line."""
    info = client.info("server")
    server = (
        f"valkey {info['valkey_version']}"
        if "valkey_version" in info
        else f"redis {info['redis_version']}"
    )
    return "\n".join(
        [
            f"machine : {platform.platform()} ({platform.machine()}), {os.cpu_count()} CPUs",
            f"python  : {platform.python_implementation()} {platform.python_version()}",
            f"redis-py: {redis.__version__}",
            f"server  : {server}",
        ]
    )


# Part 1: uncontended throughput.


def pairs_per_second(pair: Callable[[], None], count: int) -> float:
    """Run ``pair`` ``count`` times after a short warm-up; return pairs per second."""
    for _ in range(min(200, count)):
        pair()
    started = time.perf_counter()
    for _ in range(count):
        pair()
    return count / (time.perf_counter() - started)


def uncontended_pairs(client: redis.Redis) -> dict[str, Callable[[], None]]:
    """The acquire+release pairs compared in parts 1 and 3, by label."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    quiet = RedisLock(client, f"{name}-quiet", ttl=30, heartbeat=False)
    beating = RedisLock(client, f"{name}-beating", ttl=30)
    redis_py = client.lock(f"{name}-redis-py", timeout=30)
    raw_key = f"{name}-raw"
    token = uuid.uuid4().hex

    def redislock_quiet() -> None:
        quiet.acquire()
        quiet.release()

    def redislock_beating() -> None:
        beating.acquire()
        beating.release()

    def raw() -> None:
        client.set(raw_key, token, nx=True, px=30_000)
        client.delete(raw_key)

    def redis_py_lock() -> None:
        redis_py.acquire()
        redis_py.release()

    return {
        "raw SET NX PX + DEL": raw,
        "RedisLock, heartbeat off": redislock_quiet,
        "RedisLock, heartbeat on": redislock_beating,
        "redis-py Lock": redis_py_lock,
    }


def bench_uncontended(client: redis.Redis, count: int, rounds: int) -> None:
    print(
        f"\n1. Uncontended acquire+release, one thread: median of {rounds} rounds"
        f" of {count} pairs, variants interleaved"
    )
    pairs = uncontended_pairs(client)
    samples: dict[str, list[float]] = {label: [] for label in pairs}
    labels = list(pairs)
    for round_index in range(rounds):
        shift = round_index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            samples[label].append(pairs_per_second(pairs[label], count))
    rates = {label: statistics.median(values) for label, values in samples.items()}
    baseline = rates["raw SET NX PX + DEL"]
    for label, rate in rates.items():
        print(
            f"   {label:<26} {rate:>9,.0f} pairs/s   {1e6 / rate:>6.0f} us/pair"
            f"   x{rate / baseline:.2f} of raw"
        )


# Part 2: handoff latency between processes.


def _contender(url: str, kind: str, name: str, seconds: float, start: Any, out: Any) -> None:
    """One contending process: ask, hold, release, pause, until time is up."""
    client = redis.Redis.from_url(url)
    lock: Any
    if kind == "RedisLock":
        lock = RedisLock(client, name, ttl=30)
    elif kind == "redis-py Lock (sleep 0.1 s)":
        lock = client.lock(name, timeout=30)
    else:
        lock = client.lock(name, timeout=30, sleep=0.01)
    records: list[tuple[float, float, float]] = []
    start.wait()
    deadline = time.time() + seconds
    while time.time() < deadline:
        asked = time.time()
        lock.acquire(blocking=True)
        acquired = time.time()
        time.sleep(random.uniform(*HOLD))
        released = time.time()
        lock.release()
        records.append((asked, acquired, released))
        time.sleep(THINK)
    out.put(records)


def percentile(values: list[float], fraction: float) -> float:
    """The value at ``fraction`` (0..1) of the sorted values (nearest rank)."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def bench_handoff(url: str, seconds: float) -> None:
    print(
        f"\n2. Handoff latency (release -> next holder, when a process was waiting),"
        f" {CONTENDERS} processes, {seconds:g} s each; hold {HOLD[0] * 1e3:g}-{HOLD[1] * 1e3:g} ms,"
        f" pause {THINK * 1e3:g} ms"
    )
    ctx = multiprocessing.get_context("spawn")
    kinds = ["RedisLock", "redis-py Lock (sleep 0.1 s)", "redis-py Lock (sleep 0.01 s)"]
    for kind in kinds:
        name = f"handoff-{uuid.uuid4().hex[:8]}"
        start = ctx.Barrier(CONTENDERS)
        out = ctx.Queue()
        processes = [
            ctx.Process(target=_contender, args=(url, kind, name, seconds, start, out))
            for _ in range(CONTENDERS)
        ]
        for process in processes:
            process.start()
        results = [out.get(timeout=seconds + 60) for _ in processes]
        for process in processes:
            process.join(30)
        history = sorted(
            (
                (acquired, released, asked)
                for records in results
                for asked, acquired, released in records
            ),
        )
        # The gap after each release that found a process already waiting: how
        # long the lock stayed free although someone wanted it.
        handoffs = [
            (nxt[0] - prev[1]) * 1e3
            for prev, nxt in itertools.pairwise(history)
            if any(asked < prev[1] < acquired for acquired, _released, asked in history)
        ]
        waits = [(acquired - asked) * 1e3 for acquired, _released, asked in history]
        overlaps = sum(1 for prev, nxt in itertools.pairwise(history) if nxt[0] < prev[1])
        if len(handoffs) < 2:
            print(f"   {kind:<30} too few handoffs ({len(handoffs)})")
            continue
        print(
            f"   {kind:<30} handoff p50 {percentile(handoffs, 0.5):6.2f} ms"
            f"  p99 {percentile(handoffs, 0.99):6.2f} ms"
            f"   wait p50 {percentile(waits, 0.5):6.2f} ms  p99 {percentile(waits, 0.99):6.2f} ms"
            f"   ({len(handoffs)} handoffs,"
            f" {len(history) / seconds:,.0f} holds/s, {overlaps} overlaps)"
        )


# Part 3: round trips.


@contextmanager
def counting_client(host: str, port: int) -> Iterator[tuple[redis.Redis, list[int]]]:
    """A client whose connections count their writes (one per request or pipeline)."""
    writes = [0]

    class CountingConnection(redis.Connection):
        def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            writes[0] += 1
            super().send_packed_command(command, check_health)  # type: ignore[no-untyped-call]

    pool = redis.ConnectionPool(host=host, port=port, connection_class=CountingConnection)
    client = redis.Redis(connection_pool=pool)
    try:
        yield client, writes
    finally:
        client.close()


def server_counters(client: redis.Redis) -> tuple[int, int]:
    """(socket reads, EVALSHA calls) the server has processed so far."""
    reads = int(client.info("stats")["total_reads_processed"])
    evalsha = int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    return reads, evalsha


def bench_round_trips(client: redis.Redis, count: int) -> None:
    kwargs = client.connection_pool.connection_kwargs
    host, port = kwargs.get("host", "127.0.0.1"), kwargs.get("port", 6379)
    print(f"\n3. Round trips per uncontended acquire+release (average over {count} pairs)")
    observer = redis.Redis(host=host, port=port)
    with counting_client(host, port) as (counted, writes):
        for label, pair in uncontended_pairs(counted).items():
            for _ in range(10):  # load the scripts, open the connection
                pair()
            reads_0, _ = server_counters(observer)
            reads_1, evalsha_1 = server_counters(observer)
            writes_before = writes[0]
            for _ in range(count):
                pair()
            reads_2, evalsha_2 = server_counters(observer)
            # Reading the counters costs the observer a few reads of its own.
            measuring = reads_1 - reads_0
            print(
                f"   {label:<26} client writes {(writes[0] - writes_before) / count:4.2f}"
                f"   server reads {(reads_2 - reads_1 - measuring) / count:4.2f}"
                f"   of which EVALSHA {(evalsha_2 - evalsha_1) / count:4.2f}"
            )
    observer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a redis:// URL (default: start a private server)")
    parser.add_argument("--quick", action="store_true", help="fewer pairs, shorter contention")
    args = parser.parse_args(argv)

    pairs, rounds = (500, 3) if args.quick else (2_000, 5)
    seconds = 1.5 if args.quick else 5.0
    server: RedisServer | None = None
    url: str = args.url
    if not url:
        server = RedisServer().start()
        url = server.url
    client = redis.Redis.from_url(url)
    try:
        print(machine_report(client))
        print(f"url     : {url}{' (private server)' if server else ''}")
        bench_uncontended(client, pairs, rounds)
        bench_handoff(url, seconds)
        bench_round_trips(client, 1_000)
    finally:
        client.close()
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
