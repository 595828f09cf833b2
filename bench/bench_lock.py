"""The lock engine's costs: commands, round trips, handoff, fairness, wake-ups, memory, CPU.

Usage::

    python bench/bench_lock.py [--quick] [--profile] [--url URL] [--only 1,4,5,6,7] [--json FILE]

Without ``--url`` a private server is started on a free 127.0.0.1 port (see
:class:`celery_redislock.server.RedisServer`). With ``--url``, use a server
nothing else talks to: the server-side counts (``INFO commandstats``, ``INFO
memory``) would pick up other traffic, and they are reset (``CONFIG
RESETSTAT``) between measurements.

Sections, numbered after the project's performance goals (figures only,
nothing is asserted; a figure that misses its target prints ``NOT MET``):

1. Server commands and round trips per uncontended acquire+release, and the
   time a pair takes, for ``RedisLock`` (heartbeat on and off) beside a raw
   ``SET NX PX`` + ``DEL``, redis-py's ``Lock`` and python-redis-lock.
4. Handoff latency (a release to the next waiting process's acquire) with 4
   processes, and fairness: 8 processes that ask again as soon as they release,
   acquisitions per process (max/min).
5. Wake-ups per release: 100 waiters on one name in 4 processes; wake-up
   messages received per release and ``PUBLISH`` calls per release.
6. Memory per held lock (10,000 held at once, ``INFO memory`` once the server's
   rehashing has settled, and ``MEMORY USAGE``), per free remnant after release,
   and the heartbeat's round trips to renew them all.
7. With ``--profile``: ``cProfile`` of an uncontended acquire+release loop.

Variants run interleaved over several rounds where timing matters, and each
timing shows its median with its range (min-max) across rounds: on a busy
machine the range, not the median, is the honest figure.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import itertools
import multiprocessing
import random
import secrets
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, NamedTuple

import redis
from common import (
    CommandCount,
    Findings,
    Spread,
    command_calls,
    counting_writes,
    describe_machine,
    import_peer,
    per_operation,
    percentile,
    print_profile,
    reset_stats,
    rotated,
    servers,
)

from celery_redislock import RedisLock
from celery_redislock.heartbeat import Heartbeat, get_heartbeat
from celery_redislock.scripts import EXTEND_SCRIPT
from celery_redislock.transport import Deadline
from celery_redislock.wakeups import hub_for

#: The label of the engine's default configuration, used as the reference row.
ENGINE = "RedisLock"


# 1. Commands, round trips and time per uncontended acquire+release.
class Variant(NamedTuple):
    """One way to take and free a lock, for the uncontended comparison."""

    label: str
    pair: Callable[[], None]
    #: The engine's lock, to cross-check its own round-trip counter.
    lock: RedisLock | None


def uncontended_variants(client: redis.Redis) -> tuple[list[Variant], list[str]]:
    """The acquire+release pairs compared in section 1, and notes on peers left out."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    beating = RedisLock(client, f"{name}-engine", ttl=30)
    quiet = RedisLock(client, f"{name}-quiet", ttl=30, heartbeat=False)
    redis_py = client.lock(f"{name}-redis-py", timeout=30)
    raw_key, token = f"{name}-raw", secrets.token_hex(16)

    def engine() -> None:
        beating.acquire()
        beating.release()

    def engine_quiet() -> None:
        quiet.acquire()
        quiet.release()

    def raw() -> None:
        client.set(raw_key, token, nx=True, px=30_000)
        client.delete(raw_key)

    def redis_py_lock() -> None:
        redis_py.acquire()
        redis_py.release()

    variants = [
        Variant(f"{ENGINE} (heartbeat on)", engine, beating),
        Variant(f"{ENGINE} (heartbeat off)", engine_quiet, quiet),
    ]
    if "wait" in inspect.signature(RedisLock.release).parameters:
        later = RedisLock(client, f"{name}-later", ttl=30)

        def engine_later() -> None:
            later.acquire()
            later.release(wait=False)  # type: ignore[call-arg,unused-ignore]

        variants.append(Variant(f"{ENGINE}, release(wait=False)", engine_later, later))
    variants += [
        Variant("raw SET NX PX + DEL", raw, None),
        Variant("redis-py Lock", redis_py_lock, None),
    ]
    notes = []
    redis_lock, why = import_peer("python-redis-lock")
    if redis_lock is None:
        notes.append(why)
    else:
        peer = redis_lock.Lock(client, f"{name}-prl", expire=30)

        def python_redis_lock() -> None:
            peer.acquire()
            peer.release()

        variants.append(Variant("python-redis-lock", python_redis_lock, None))
    return variants, notes


def pairs_per_second(pair: Callable[[], None], count: int) -> float:
    """Run ``pair`` ``count`` times; return pairs per second."""
    started = time.perf_counter()
    for _ in range(count):
        pair()
    return count / (time.perf_counter() - started)


def bench_commands(url: str, count: int, rounds: int, findings: Findings) -> None:
    """Section 1: server commands, round trips and time per uncontended acquire+release."""
    print(
        f"\n1. Uncontended acquire+release: server commands and round trips (average of {count}"
        f" pairs), time per pair (median and range of {rounds} interleaved rounds)"
    )
    client = redis.Redis.from_url(url)
    stats = redis.Redis.from_url(url)
    variants, notes = uncontended_variants(client)
    for variant in variants:  # scripts loaded, connections open, fence counters made
        for _ in range(20):
            variant.pair()

    counts: dict[str, tuple[float, float, CommandCount, float | None]] = {}
    for variant in variants:
        sends_before = variant.lock.transport.sends if variant.lock else 0
        reset_stats(stats)
        with counting_writes() as writes:
            for _ in range(count):
                variant.pair()
        calls = per_operation(command_calls(stats), count)
        sends = (variant.lock.transport.sends - sends_before) / count if variant.lock else None
        counts[variant.label] = (writes.total / count, writes.waited / count, calls, sends)

    timings: dict[str, list[float]] = {v.label: [] for v in variants}
    for round_index in range(rounds):
        for variant in rotated(variants, round_index):
            timings[variant.label].append(1e6 / pairs_per_second(variant.pair, count))

    print(
        f"   {'variant':<31} {'round':>6} {'waited':>9} {'EVALSHA':>8} {'other':>6}"
        f" {'all':>5}   {'us/pair':>18}   other commands per pair"
    )
    print(f"   {'':<31} {'trips':>6} {'for':>9} {'':>8} {'cmds':>6} {'cmds':>5}")
    for variant in variants:
        trips, caller, calls, _sends = counts[variant.label]
        print(
            f"   {variant.label:<31} {trips:6.2f} {caller:9.2f} {calls.scripts:8.2f}"
            f" {calls.other:6.2f} {calls.total:5.2f}   {Spread.of(timings[variant.label]).show(0):>18}"
            f"   {calls.breakdown()}"
        )
    for note in notes:
        print(f"   (left out: {note})")
    print(
        "   (round trips: requests written; waited for: those whose answer the calling thread"
        " waited for; other cmds: every command but the EVALSHAs, mostly run inside them)"
    )

    trips, caller, calls, sends = counts[f"{ENGINE} (heartbeat on)"]
    print(
        f"   {ENGINE}: the lock's own counter (Transport.sends) "
        f"{'agrees' if sends is not None and abs(sends - trips) < 0.01 else 'differs'}: "
        f"{sends:.2f} round trips per pair"
    )
    verdict = findings.add(
        1,
        f"{ENGINE} acquire+release: commands run by the scripts",
        f"{calls.other:.2f}",
        "<= 6",
        calls.other <= 6,
    )
    print(f"   {ENGINE} acquire+release: {calls.other:.2f} commands inside the scripts; {verdict}")
    verdict = findings.add(
        1,
        f"{ENGINE} acquire+release: all server commands, the EVALSHAs included",
        f"{calls.total:.2f}",
        "<= 6 (EVALSHA counted too)",
        calls.total <= 6,
    )
    print(
        f"   {ENGINE} acquire+release: {calls.total:.2f} commands counting the EVALSHAs; {verdict}"
    )
    verdict = findings.add(
        1, f"{ENGINE} acquire+release: round trips", f"{trips:.2f}", "<= 2", trips <= 2.0001
    )
    print(f"   {ENGINE} acquire+release: {trips:.2f} round trips; {verdict}")
    findings.add(
        1,
        f"{ENGINE} acquire+release: time per pair (us)",
        Spread.of(timings[f"{ENGINE} (heartbeat on)"]).show(0),
    )
    heartbeat_thread(client, seconds=1.0 if count < 1_000 else 2.0)
    stats.close()
    client.close()


def heartbeat_thread(client: redis.Redis, seconds: float) -> None:
    """What the heartbeat thread does while a worker-like loop releases lock after
    lock without waiting: an acquire, 0.5 ms, a ``release(wait=False)``, 0.5 ms."""
    lock = RedisLock(client, f"bench:thread:{uuid.uuid4().hex}", ttl=60)
    assert lock.acquire(blocking=False)
    lock.release(wait=False)
    lane = get_heartbeat()._lanes[lock.transport]
    before = (lane.wakeups, lane.notified, lane.drained)
    pairs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        assert lock.acquire(blocking=False)
        time.sleep(0.0005)
        lock.release(wait=False)
        time.sleep(0.0005)
        pairs += 1
    elapsed = time.perf_counter() - started
    wakeups, notified, drained = (
        now - then
        for now, then in zip((lane.wakeups, lane.notified, lane.drained), before, strict=True)
    )
    print(
        f"   heartbeat thread over {pairs:,} acquire + release(wait=False) pairs, one per"
        f" ~1 ms for {elapsed:.1f} s: {wakeups / elapsed:.0f} wake-ups per second,"
        f" woken early {notified} times, {drained} answers read by it (the others by the"
        " next acquire)"
    )


# 4. Handoff latency and fairness between processes.
class Phase(NamedTuple):
    """One timed contest between processes for one lock name."""

    kind: str
    name: str
    seconds: float
    #: A holder holds for a random time in this range (seconds).
    hold: tuple[float, float]
    #: Pause after a release before asking again (seconds).
    think: float
    #: How many of the pool's processes take part (the others sit it out).
    players: int


#: Handoff: 4 processes, holding 5-15 ms and pausing 20 ms, so the lock is
#: wanted by somebody at most releases without being contended all the time.
HANDOFF_PLAYERS, HANDOFF_HOLD, HANDOFF_THINK = 4, (0.005, 0.015), 0.02
#: Fairness: 8 processes holding 2 ms that ask again at once after a release.
FAIR_PLAYERS, FAIR_HOLD, FAIR_THINK = 8, (0.002, 0.002), 0.0

HANDOFF_KINDS = [
    ENGINE,
    "redis-py Lock (sleep 0.1 s)",
    "redis-py Lock (sleep 0.01 s)",
    "python-redis-lock",
]
FAIR_KINDS = [ENGINE, "redis-py Lock (sleep 0.01 s)", "python-redis-lock"]


def _new_contender(kind: str, client: redis.Redis, name: str) -> Any:
    """A lock of ``kind`` on ``name`` with ``acquire()``/``release()``."""
    if kind == ENGINE:
        return RedisLock(client, name, ttl=30)
    if kind == "redis-py Lock (sleep 0.1 s)":
        return client.lock(name, timeout=30)
    if kind == "redis-py Lock (sleep 0.01 s)":
        return client.lock(name, timeout=30, sleep=0.01)
    redis_lock, why = import_peer("python-redis-lock")
    if redis_lock is None:
        raise RuntimeError(why)
    return redis_lock.Lock(client, name, expire=30)


def _contender(url: str, index: int, phases: list[Phase], start: Any, out: Any) -> None:
    """A pool process: warm every kind up, then play each phase it takes part in.

    Times are wall-clock (``time.time()``), comparable between processes on one machine.
    """
    client = redis.Redis.from_url(url)
    for kind in {phase.kind for phase in phases}:
        lock = _new_contender(kind, client, f"warm-{uuid.uuid4().hex}")
        lock.acquire()
        lock.release()
    # The engine's wake-up subscription: set up now, not during the first handoff.
    engine = RedisLock(client, "warm", ttl=30)
    hub = hub_for(engine.transport, engine.prefix)
    waiter = hub.join()
    hub.wait_ready(Deadline.after(10))
    hub.leave(waiter)
    results: list[list[tuple[float, float, float]]] = []
    for phase in phases:
        start.wait()
        records: list[tuple[float, float, float]] = []
        if index < phase.players:
            lock = _new_contender(phase.kind, client, phase.name)
            deadline = time.time() + phase.seconds
            while time.time() < deadline:
                asked = time.time()
                lock.acquire()
                acquired = time.time()
                time.sleep(random.uniform(*phase.hold))
                released = time.time()
                lock.release()
                records.append((asked, acquired, released))
                if phase.think:
                    time.sleep(phase.think)
        results.append(records)
    out.put((index, results))


class Contest(NamedTuple):
    """What one phase's history shows."""

    #: Handoff gaps (ms): a release to the acquire of a process that was already waiting.
    gaps: list[float]
    #: Releases that found a process waiting, yet the lock went to a newcomer
    #: (a process that asked only after the release, typically the releaser again).
    barged: int
    #: Holds that overlapped another (must be 0).
    overlaps: int


def contest(records: list[list[tuple[float, float, float]]]) -> Contest:
    """Read handoffs, barging and overlaps off the ``(asked, acquired, released)`` records.

    A handoff is the time from the moment a holder called ``release()`` to the
    moment the next holder's ``acquire()`` returned, when that next holder had
    asked before the release: how long the lock sat free although the process
    that got it next was already waiting for it.
    """
    history = sorted((acq, rel, asked) for recs in records for asked, acq, rel in recs)
    gaps: list[float] = []
    barged = 0
    for prev, nxt in itertools.pairwise(history):
        if nxt[2] < prev[1]:
            gaps.append((nxt[0] - prev[1]) * 1e3)
        elif any(asked < prev[1] < acq for acq, _rel, asked in history):
            barged += 1
    overlaps = sum(1 for prev, nxt in itertools.pairwise(history) if nxt[0] < prev[1])
    return Contest(gaps, barged, overlaps)


def bench_contention(url: str, rounds: int, seconds: float, findings: Findings) -> None:
    """Section 4: handoff latency (4 processes) and fairness (8 processes)."""
    handoff_kinds, fair_kinds = list(HANDOFF_KINDS), list(FAIR_KINDS)
    redis_lock, why = import_peer("python-redis-lock")
    if redis_lock is None:
        handoff_kinds.remove("python-redis-lock")
        fair_kinds.remove("python-redis-lock")
    phases: list[Phase] = []
    for r in range(rounds):
        for kind in rotated(handoff_kinds, r):
            phases.append(
                Phase(
                    kind,
                    f"handoff-{uuid.uuid4().hex[:8]}",
                    seconds,
                    HANDOFF_HOLD,
                    HANDOFF_THINK,
                    HANDOFF_PLAYERS,
                )
            )
        for kind in rotated(fair_kinds, r):
            phases.append(
                Phase(
                    kind,
                    f"fair-{uuid.uuid4().hex[:8]}",
                    seconds,
                    FAIR_HOLD,
                    FAIR_THINK,
                    FAIR_PLAYERS,
                )
            )
    print(
        f"\n4. Handoff and fairness between processes: {rounds} rounds, {seconds:g} s per variant"
        " and round, variants interleaved"
    )
    ctx = multiprocessing.get_context("spawn")
    pool = max(HANDOFF_PLAYERS, FAIR_PLAYERS)
    start = ctx.Barrier(pool)
    out = ctx.Queue()
    processes = [
        ctx.Process(target=_contender, args=(url, i, phases, start, out)) for i in range(pool)
    ]
    for process in processes:
        process.start()
    results: dict[int, list[list[tuple[float, float, float]]]] = {}
    budget = 120 + len(phases) * (seconds + 5)
    for _ in processes:
        index, records = out.get(timeout=budget)
        results[index] = records
    for process in processes:
        process.join(30)

    gaps: dict[str, list[float]] = {kind: [] for kind in handoff_kinds}
    p50s: dict[str, list[float]] = {kind: [] for kind in handoff_kinds}
    # Keyed by (contest, kind): "handoff" or "fair".
    overlaps: dict[tuple[str, str], int] = {}
    barged: dict[tuple[str, str], int] = {}
    releases: dict[tuple[str, str], int] = {}
    ratios: dict[str, list[float]] = {kind: [] for kind in fair_kinds}
    rates: dict[str, list[float]] = {kind: [] for kind in fair_kinds}
    spreads: dict[str, list[str]] = {kind: [] for kind in fair_kinds}
    for p, phase in enumerate(phases):
        per_process = [results[i][p] for i in range(phase.players)]
        seen = contest(per_process)
        phase_gaps = seen.gaps
        key = (phase.name.split("-")[0], phase.kind)
        overlaps[key] = overlaps.get(key, 0) + seen.overlaps
        barged[key] = barged.get(key, 0) + seen.barged
        releases[key] = releases.get(key, 0) + sum(len(records) for records in per_process)
        if phase.name.startswith("handoff-"):
            gaps[phase.kind].extend(phase_gaps)
            if phase_gaps:
                p50s[phase.kind].append(percentile(phase_gaps, 0.5))
        else:
            holds = [len(records) for records in per_process]
            ratios[phase.kind].append(max(holds) / min(holds) if min(holds) else float("inf"))
            rates[phase.kind].append(sum(holds) / phase.seconds)
            spreads[phase.kind].append("/".join(map(str, holds)))

    print(
        f"   handoff, {HANDOFF_PLAYERS} processes, hold {HANDOFF_HOLD[0] * 1e3:g}-"
        f"{HANDOFF_HOLD[1] * 1e3:g} ms, pause {HANDOFF_THINK * 1e3:g} ms"
        " (release() called -> next waiting process's acquire() returned):"
    )
    print(
        f"   {'variant':<30} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}"
        f"   {'per-round p50 (range)':>22}  handoffs  barged overlaps"
    )
    for kind in handoff_kinds:
        values = gaps[kind]
        if len(values) < 2:
            print(f"   {kind:<30} too few handoffs ({len(values)})")
            continue
        print(
            f"   {kind:<30} {percentile(values, 0.5):7.2f} {percentile(values, 0.99):7.2f}"
            f" {max(values):7.2f}   {Spread.of(p50s[kind]).show(2):>22}  {len(values):8d}"
            f" {barged['handoff', kind]:7d} {overlaps['handoff', kind]:8d}"
        )
    engine_gaps = gaps[ENGINE]
    if len(engine_gaps) >= 2:
        p50, p99 = percentile(engine_gaps, 0.5), percentile(engine_gaps, 0.99)
        print(
            f"   {ENGINE} handoff median {p50:.2f} ms: "
            + findings.add(4, f"{ENGINE} handoff median (ms)", f"{p50:.2f}", "<= 1 ms", p50 <= 1.0)
            + f"; p99 {p99:.2f} ms: "
            + findings.add(4, f"{ENGINE} handoff p99 (ms)", f"{p99:.2f}", "<= 5 ms", p99 <= 5.0)
        )
    print(
        f"   fairness, {FAIR_PLAYERS} processes, hold {FAIR_HOLD[0] * 1e3:g} ms, asking again at"
        " once after each release:"
    )
    print(
        f"   {'variant':<30} {'max/min acquisitions':>22} {'holds/s':>14} {'barged':>7}"
        "   holds per process (last round)"
    )
    for kind in fair_kinds:
        print(
            f"   {kind:<30} {Spread.of(ratios[kind]).show(2):>22}"
            f" {Spread.of(rates[kind]).show(0):>14}"
            f" {barged['fair', kind] / max(releases['fair', kind], 1):7.0%}   {spreads[kind][-1]}"
            + (f"   ({overlaps['fair', kind]} overlaps!)" if overlaps["fair", kind] else "")
        )
    print(
        "   (barged: the lock went to a process that asked only after the release, although"
        " another was already waiting; in the fairness table, as a share of all holds)"
    )
    worst = Spread.of(ratios[ENGINE])
    print(
        f"   {ENGINE} max/min acquisitions per process {worst.show(2)}: "
        + findings.add(
            4,
            f"{ENGINE} fairness, max/min acquisitions per process",
            worst.show(2),
            "<= 2",
            worst.median <= 2,
        )
    )
    if redis_lock is None:
        print(f"   (left out: {why})")


# 5. Wake-ups per release.
def _waiting_process(url: str, name: str, threads: int, hold: float, out: Any) -> None:
    """``threads`` threads each take lock ``name`` once (waiting for it), hold it, free it.

    Reports the wake-up messages this process's hub received, and when the last
    of its threads released.
    """
    client = redis.Redis.from_url(url)
    RedisLock(client, f"warm-{uuid.uuid4().hex}", ttl=30, heartbeat=False).acquire(blocking=False)
    done: list[float] = []
    failures: list[str] = []

    def one() -> None:
        lock = RedisLock(client, name, ttl=30)
        try:
            if not lock.acquire(timeout=120):
                failures.append("timed out")
                return
            time.sleep(hold)
            lock.release()
            done.append(time.time())
        except Exception as exc:  # reported, not raised: a figure, not a test
            failures.append(repr(exc))

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    probe = RedisLock(client, name, ttl=30)
    hub = hub_for(probe.transport, probe.prefix)
    out.put((hub.received, max(done, default=0.0), len(done), failures))


def bench_wakeups(url: str, rounds: int, findings: Findings) -> None:
    """Section 5: wake-up messages and PUBLISH calls per release, 100 waiters in 4 processes."""
    processes_n, threads_n, hold = 4, 25, 0.001
    waiters = processes_n * threads_n
    print(
        f"\n5. Wake-ups per release: {waiters} waiters on one name ({processes_n} processes x"
        f" {threads_n} threads), each takes it once and holds it {hold * 1e3:g} ms; {rounds} round(s)"
    )
    stats = redis.Redis.from_url(url)
    ctx = multiprocessing.get_context("spawn")
    per_release: list[float] = []
    publishes: list[float] = []
    tries: list[float] = []
    drains: list[float] = []
    for r in range(rounds):
        name = f"wakeups-{uuid.uuid4().hex[:8]}"
        holder = RedisLock(stats, name, ttl=60)
        holder.acquire()
        out = ctx.Queue()
        processes = [
            ctx.Process(target=_waiting_process, args=(url, name, threads_n, hold, out))
            for _ in range(processes_n)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + 120
        while stats.zcard(holder.queue_key) < waiters and time.monotonic() < deadline:
            time.sleep(0.05)
        queued = stats.zcard(holder.queue_key)
        reset_stats(stats)
        released_at = time.time()
        holder.release()
        reports = [out.get(timeout=180) for _ in processes]
        for process in processes:
            process.join(30)
        calls = command_calls(stats)
        received = sum(report[0] for report in reports)
        taken = sum(report[2] for report in reports)
        failures = [f for report in reports for f in report[3]]
        releases = taken + 1  # every waiter's, and the holder's
        # Every EVALSHA is an acquire try, a release or a renewal (no waiter gave up
        # here): a waiter the lock is handed to sends no try after it queued.
        acquire_tries = calls.get("evalsha", 0) - releases
        per_release.append(received / releases)
        publishes.append(calls.get("publish", 0) / releases)
        tries.append(acquire_tries / max(taken, 1))
        drains.append((max(report[1] for report in reports) - released_at) * 1e3 / max(taken, 1))
        print(
            f"   round {r + 1}: {queued} queued, {taken} took it, {releases} releases;"
            f" wake-ups received {received} ({received / releases:.2f} per release),"
            f" PUBLISH {calls.get('publish', 0)} ({calls.get('publish', 0) / releases:.2f} per"
            f" release), other requests after queueing {acquire_tries}"
            f" ({acquire_tries / max(taken, 1):.2f} per acquisition), {drains[-1]:.2f} ms per"
            " handoff" + (f"; failures: {failures[:3]}" if failures else "")
        )
    woken = Spread.of(per_release)
    print(
        f"   wake-up messages per release {woken.show(2)}: "
        + findings.add(
            5, "wake-up messages received per release", woken.show(2), "<= 2", woken.high <= 2
        )
    )
    sent = Spread.of(publishes)
    print(
        f"   PUBLISH per release {sent.show(2)}: "
        + findings.add(5, "PUBLISH calls per release", sent.show(2), "<= 2", sent.high <= 2)
    )
    findings.add(
        5, "requests after queueing per acquisition, 100 waiters", Spread.of(tries).show(2)
    )
    stats.close()


# 6. Memory per held lock, and the heartbeat's batching.
def used_memory(client: redis.Redis) -> int:
    """``INFO memory`` ``used_memory``, in bytes."""
    return int(client.info("memory")["used_memory"])


def settled_memory(client: redis.Redis, timeout: float = 5.0) -> int:
    """``used_memory`` once it stops changing (at most ``timeout`` seconds).

    A keyspace that just grew past a power of two is being rehashed into a table
    twice the size, and both tables are allocated until the server's background
    rehash finishes (a fraction of a second later): up to 13 bytes per key for the
    main and expiry tables, which no lock keeps.
    """
    deadline = time.monotonic() + timeout
    last = used_memory(client)
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = used_memory(client)
        if now == last:
            break
        last = now
    return last


def hold_many(client: redis.Redis, count: int, task_like: bool, heartbeat: bool) -> list[RedisLock]:
    """``count`` held locks with distinct names, as a task or as a plain lock would hold them.

    ``task_like`` names them like a ``SingletonTask`` (``<task name>:<32 hex>``),
    with a task id as lease and, where the engine stores one, a holder description
    like a running task's; otherwise the name is short. The owner is the engine's
    default either way (72 random bits, 12 characters), as a task's is.
    """
    # What a running SingletonTask stores about itself, where the engine takes it.
    extra: dict[str, Any] = {}
    if "holder_info" in inspect.signature(RedisLock).parameters:
        extra["holder_info"] = {
            "task": "shop.tasks.purchase",
            "state": "running",
            "node": "celery@worker-1.example.com",
            "pid": "123456",
            "since": f"{time.time():.3f}",
        }
    locks = []
    for i in range(count):
        if task_like:
            task_id = str(uuid.uuid4())
            lock = RedisLock(
                client,
                f"shop.tasks.purchase:{uuid.uuid4().hex}",
                ttl=600,
                lease=task_id,
                heartbeat=heartbeat,
                **extra,
            )
        else:
            lock = RedisLock(client, f"invoice:{i}", ttl=600, heartbeat=heartbeat)
        lock.acquire(blocking=False)
        locks.append(lock)
    return locks


def drop(client: redis.Redis, locks: list[RedisLock]) -> None:
    """Forget ``locks`` locally and delete their keys (no release round trips)."""
    pipe = client.pipeline(transaction=False)
    for lock in locks:
        lock.detach()
        pipe.delete(lock.key, lock.queue_key)
    pipe.execute()


def bench_memory(url: str, count: int, findings: Findings) -> None:
    """Section 6: server memory per held lock and per free remnant; heartbeat round trips."""
    print(
        f"\n6. Memory: {count:,} locks held at once (TTL 600 s, so nothing renews them meanwhile)"
    )
    client = redis.Redis.from_url(url)
    stats = redis.Redis.from_url(url)
    # Warm up: a fresh server's first keys of this many cost more than the same keys
    # later (one-time growth, the first time a keyspace of this size is allocated).
    drop(client, hold_many(client, count, task_like=False, heartbeat=False))
    for task_like, heartbeat in ((False, False), (True, True)):
        label = (
            "as SingletonTask holds them (task name + 32 hex, lease from the task id,"
            " holder description where the engine stores one), heartbeat on"
            if task_like
            else "plain RedisLock (short name, default owner), heartbeat off"
        )
        before = settled_memory(stats)
        locks = hold_many(client, count, task_like, heartbeat)
        held = settled_memory(stats)
        per_lock = (held - before) / count
        sample = stats.memory_usage(locks[0].key, samples=0) or 0
        print(f"   {label}:")
        print(
            f"     used_memory delta per held lock {per_lock:,.0f} bytes; MEMORY USAGE of one"
            f" lock key {sample} bytes: "
            + findings.add(
                6,
                f"bytes per held lock, {'task-style' if task_like else 'plain'} (used_memory)",
                f"{per_lock:.0f}",
                "<= 200",
                per_lock <= 200,
            )
        )
        if not task_like:
            drop(client, locks)
            continue
        # The first renewal ever on a server finds the EXTEND script not cached there
        # yet (the locks were taken with ACQUIRE only); the next one is the steady state.
        beat = Heartbeat()
        transport = locks[0].transport
        for which in ("first", "next"):
            sends = transport.sends
            reset_stats(stats)
            started = time.perf_counter()
            beat.renew(locks)
            took = time.perf_counter() - started
            trips = transport.sends - sends
            raw = command_calls(stats)
            calls = per_operation(raw, count)
            lost = sum(lock.lost for lock in locks)
            line = (
                f"     {which} heartbeat renewal of all {count:,}: {trips} round trip(s) in"
                f" {took * 1e3:.0f} ms; per lock {raw.get('evalsha', 0) / count:.2f} EVALSHA,"
                f" {raw.get('eval', 0) / count:.2f} EVAL (script sent as text,"
                f" {len(EXTEND_SCRIPT.text):,} bytes each), {calls.other:.2f} other commands"
                f" ({calls.breakdown()}); {lost} lost"
            )
            if which == "first":
                findings.add(6, f"first renewal round trips for {count:,} locks", str(trips))
                print(line)
                continue
            print(
                f"{line}: "
                + findings.add(
                    6,
                    f"heartbeat round trips per interval for {count:,} locks",
                    str(trips),
                    "<= 1 per server",
                    trips <= 1,
                )
            )
        started = time.perf_counter()
        for lock in locks:
            lock.release()
        took = time.perf_counter() - started
        remnant = (settled_memory(stats) - before) / count
        sample = stats.memory_usage(locks[0].key, samples=0) or 0
        print(
            f"     after release() of all ({took / count * 1e6:.0f} us each): the free keys that"
            f" keep the fence counters stay until the locks' expiry, {remnant:,.0f} bytes per name"
            f" (MEMORY USAGE of one: {sample} bytes)"
        )
        findings.add(
            6, "bytes per released name (free key, until the lock's expiry)", f"{remnant:.0f}"
        )
        drop(client, locks)
    stats.close()
    client.close()


# 7. Where the client's time goes.
def bench_profile(url: str, count: int) -> None:
    """Section 7: cProfile of an uncontended acquire+release loop (heartbeat on)."""
    print(
        f"\n7. Client CPU: cProfile of {count:,} uncontended acquire+release pairs (heartbeat on)"
    )
    client = redis.Redis.from_url(url)
    lock = RedisLock(client, f"profile-{uuid.uuid4().hex[:8]}", ttl=30)
    for _ in range(50):
        lock.acquire()
        lock.release()
    started = time.process_time()
    for _ in range(count):
        lock.acquire()
        lock.release()
    cpu = (time.process_time() - started) / count * 1e6
    print(
        f"   without the profiler: {cpu:.0f} us of client CPU per pair (this process);"
        " the profile below counts CPU time (time.process_time), not time spent waiting"
    )
    # CPU time, not wall time: waiting for the server's reply is not the client's cost.
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for _ in range(count):
        lock.acquire()
        lock.release()
    profiler.disable()
    print_profile(profiler)
    client.close()


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections and print their figures."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a redis:// URL (default: start a private server)")
    parser.add_argument("--quick", action="store_true", help="fewer samples (about 20 s)")
    parser.add_argument("--profile", action="store_true", help="also run section 7 (cProfile)")
    parser.add_argument("--only", help="comma-separated sections to run, e.g. 1,4")
    parser.add_argument("--json", help="write the findings against the targets to this file")
    args = parser.parse_args(argv)
    sections = {int(s) for s in args.only.split(",")} if args.only else {1, 4, 5, 6, 7}
    if not args.profile and not args.only:
        sections.discard(7)

    pairs, rounds = (300, 3) if args.quick else (1_000, 5)
    contention_rounds, seconds = (2, 0.8) if args.quick else (3, 1.5)
    wakeup_rounds = 1 if args.quick else 2
    memory_locks = 2_000 if args.quick else 10_000
    findings = Findings()
    started = time.monotonic()
    with servers(args.url, 1) as (url,):
        for line in describe_machine(url):
            print(line)
        print(f"url     : {url}{'' if args.url else ' (private server)'}")
        if 1 in sections:
            bench_commands(url, pairs, rounds, findings)
        if 4 in sections:
            bench_contention(url, contention_rounds, seconds, findings)
        if 5 in sections:
            bench_wakeups(url, wakeup_rounds, findings)
        if 6 in sections:
            bench_memory(url, memory_locks, findings)
        if 7 in sections:
            bench_profile(url, 500 if args.quick else 2_000)
    print(f"\nbench_lock: {time.monotonic() - started:.0f} s")
    findings.save(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
