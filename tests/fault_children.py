"""Child processes of the process-fault tests, and the fenced resource they write to.

Run as ``python -m tests.fault_children holder ...``, ``... waiter ...`` or
``... soak ...``; each
child reports through Redis lists so the test can check the history after the
fact. :func:`fenced_write` is also used by the Celery tasks of
``tests.fault_app``.

The fenced resource keeps the highest fencing token it has seen and refuses a
write carrying a lower one. Every attempt is logged, in the order Redis ran
them, with whether it was accepted and whether the writer's hold was still the
lock's current one when it landed (the lock's ``fence`` field equals the
writer's token).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
import traceback
from collections import Counter
from typing import Any

import redis

from celery_redislock import LockBackendError, LockLostError, RedisLock
from celery_redislock.scripts import FENCE_FIELD, LAYOUT

# FENCED_WRITE reads the fence as the second field of a lock's value.
assert LAYOUT.index(FENCE_FIELD) == 1

#: KEYS[1] highest token seen; KEYS[2] the attempt log; KEYS[3] (optional) the writer's
#: lock key, on the same server (without it, no attempt is logged as current).
#: ARGV[1] the writer's token; ARGV[2] the writer's label. Returns 1 if accepted.
FENCED_WRITE = """
local top = redis.call('GET', KEYS[1])
local token = tonumber(ARGV[1])
local accepted = (not top) or token >= tonumber(top)
local lock = KEYS[3] and redis.call('GET', KEYS[3])
local holder = lock and string.match(lock, '^[^\\31]*\\31([^\\31]*)')
local current = holder ~= nil and holder ~= false and tonumber(holder) == token
if accepted then
    redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('RPUSH', KEYS[2], cjson.encode({
    writer = ARGV[2], token = ARGV[1], accepted = accepted, current = current
}))
if accepted then return 1 end
return 0
"""

#: Soak: the list every completed hold is appended to (JSON, see :func:`soak`).
SOAK_HOLDS = "soak:holds"
#: Soak: the list each worker process appends its counters to when it exits.
SOAK_STATS = "soak:stats"
#: Soak: set by the test to make the workers finish.
SOAK_STOP = "soak:stop"


def fenced_write(
    client: redis.Redis, resource: str, token: int | None, writer: str, lock_key: str | None
) -> bool:
    """Write to ``resource`` with fencing ``token``; return whether the write was accepted.

    ``lock_key``: the writer's lock, if it is on ``client``'s server (each attempt
    is logged with whether that lock's token still was the writer's), else ``None``.
    """
    if token is None:
        raise ValueError("a fenced write needs a token")
    keys = [f"{resource}:top", f"{resource}:log", *([lock_key] if lock_key else [])]
    return bool(client.eval(FENCED_WRITE, len(keys), *keys, token, writer))


def fence_log(client: redis.Redis, resource: str) -> list[dict[str, Any]]:
    """Every write attempt on ``resource``, in the order Redis ran them."""
    return [json.loads(raw) for raw in client.lrange(f"{resource}:log", 0, -1)]


def holder(
    url: str, name: str, resource: str, report_key: str, ttl: float, freeze_after_check: bool
) -> int:
    """Take lock ``name`` and write to ``resource`` until the lock is lost or a write is refused.

    Reports ``acquired`` (token, owner, pid), ``renewed`` once the hold has
    outlived its TTL (the heartbeat works), ``outcome`` (``lost-before-write``:
    ``lock.lost`` was seen before the next write; ``write-rejected``: the fence
    refused a write) and ``released`` (what ``release()`` did). With
    ``freeze_after_check`` the process stops itself (SIGSTOP) once, after it
    has been renewed, between a ``lock.lost`` that said False and the write.
    """
    client = redis.Redis.from_url(url)

    def report(event: str, **fields: Any) -> None:
        client.rpush(report_key, json.dumps({"event": event, **fields}))

    lock = RedisLock(url, name, ttl=ttl)
    if not lock.acquire(timeout=10):
        report("not-acquired")
        return 1
    taken = time.monotonic()
    report("acquired", token=lock.token, owner=lock.owner, pid=os.getpid())
    outcome, writes, renewed = "timeout", 0, False
    while time.monotonic() - taken < 30:
        if lock.lost:
            outcome = "lost-before-write"
            break
        if renewed and freeze_after_check:
            freeze_after_check = False
            os.kill(os.getpid(), signal.SIGSTOP)  # the test continues it
        if not renewed and time.monotonic() - taken > ttl + 0.2:
            report("renewed", held_for=time.monotonic() - taken)
            renewed = True
        writes += 1
        if not fenced_write(client, resource, lock.token, "child", lock.key):
            outcome = "write-rejected"
            break
        time.sleep(0.01)  # the pace of the writes
    report("outcome", outcome=outcome, lost=lock.lost, writes=writes)
    try:
        lock.release()
    except LockLostError:
        released = "LockLostError"
    except Exception as exc:
        released = f"{type(exc).__name__}: {exc}"
    else:
        released = "released"
    report("released", result=released)
    return 0


def waiter(url: str, name: str, resource: str, report_key: str, threads: int = 1) -> int:
    """Wait for lock ``name`` (60 s TTL), write to ``resource`` once with its fencing
    token, and release it; with ``threads`` above 1, as many threads do so at once
    (as a worker's thread pool would), each with a lock object of its own.

    Reports ``waiting`` (owner, pid) before it asks, ``acquired`` (token),
    ``wrote`` (whether the fence accepted the write) and ``released``.
    """
    outcomes: list[int] = []
    others = [
        threading.Thread(
            target=lambda: outcomes.append(_wait_once(url, name, resource, report_key))
        )
        for _ in range(threads - 1)
    ]
    for thread in others:
        thread.start()
    outcome = _wait_once(url, name, resource, report_key)
    for thread in others:
        thread.join()
    return max([outcome, *outcomes])


def _wait_once(url: str, name: str, resource: str, report_key: str) -> int:
    """One waiter of :func:`waiter`."""
    client = redis.Redis.from_url(url)

    def report(event: str, **fields: Any) -> None:
        client.rpush(report_key, json.dumps({"event": event, **fields}))

    lock = RedisLock(url, name, ttl=60)
    report("waiting", owner=lock.owner, pid=os.getpid())
    if not lock.acquire(timeout=60):
        report("not-acquired")
        return 1
    report("acquired", token=lock.token)
    report("wrote", accepted=fenced_write(client, resource, lock.token, "child", lock.key))
    lock.release()
    report("released")
    return 0


def soak(
    lock_url: str, record_url: str, label: str, ttl: float, threads: int, names: list[str]
) -> int:
    """Take and release locks on ``names`` from ``threads`` threads until the test says stop.

    Each completed hold is appended to :data:`SOAK_HOLDS` as ``[name, token,
    start, end, lost, label]``: ``start`` is read after ``acquire()`` returned,
    ``end`` before ``lock.lost`` is checked, both on ``CLOCK_MONOTONIC`` (one
    clock for every process of the machine), so a hold not flagged ``lost``
    certainly held the lock from ``start`` to ``end``. Backend errors are counted
    and the loop goes on; the counters go to :data:`SOAK_STATS` at exit.
    """
    record = redis.Redis.from_url(record_url)
    stats: Counter[str] = Counter()
    crashes: list[str] = []
    guard = threading.Lock()

    def count(what: str) -> None:
        with guard:
            stats[what] += 1

    def clock() -> float:
        return time.clock_gettime(time.CLOCK_MONOTONIC)

    def run(index: int) -> None:
        rng = random.Random(f"{label}-{index}-{os.getpid()}")
        try:
            while not record.exists(SOAK_STOP):
                name = rng.choice(names)
                lock = RedisLock(lock_url, name, ttl=ttl)
                try:
                    if not lock.acquire(timeout=10):
                        count("acquire_timeouts")
                        continue
                except LockBackendError:
                    count("acquire_errors")
                    continue
                lost = long = False
                try:
                    start = clock()
                    # Mostly a few ms; now and then a hold the heartbeat must renew.
                    long = rng.random() < 0.02
                    time.sleep(rng.uniform(0.2, 1.0) if long else rng.uniform(0.001, 0.004))
                    end = clock()
                    lost = lock.lost
                finally:
                    try:
                        lock.release()
                    except LockLostError:
                        # Unflagged: frozen between the check and the release, or a
                        # retried release that was not recognised (see the tests).
                        count("lost_releases" if lost else "unflagged_lost_releases")
                    except LockBackendError:
                        count("release_errors")
                count("long_holds" if long else "short_holds")
                record.rpush(SOAK_HOLDS, json.dumps([name, lock.token, start, end, lost, label]))
        except Exception:
            with guard:
                crashes.append(traceback.format_exc())

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    record.rpush(SOAK_STATS, json.dumps({"label": label, "crashes": crashes, **stats}))
    return 1 if crashes else 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fault_children")
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("holder")
    one.add_argument("url")
    one.add_argument("name")
    one.add_argument("resource")
    one.add_argument("report_key")
    one.add_argument("--ttl", type=float, default=1.0)
    one.add_argument("--freeze-after-check", action="store_true")
    queued = commands.add_parser("waiter")
    queued.add_argument("url")
    queued.add_argument("name")
    queued.add_argument("resource")
    queued.add_argument("report_key")
    queued.add_argument("--threads", type=int, default=1)
    many = commands.add_parser("soak")
    many.add_argument("lock_url")
    many.add_argument("record_url")
    many.add_argument("label")
    many.add_argument("--ttl", type=float, default=0.8)
    many.add_argument("--threads", type=int, default=2)
    many.add_argument("--names", default="a,b,c,d")
    args = parser.parse_args(argv)
    if args.command == "holder":
        return holder(
            args.url, args.name, args.resource, args.report_key, args.ttl, args.freeze_after_check
        )
    if args.command == "waiter":
        return waiter(args.url, args.name, args.resource, args.report_key, args.threads)
    return soak(
        args.lock_url, args.record_url, args.label, args.ttl, args.threads, args.names.split(",")
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
