"""Real workers of every pool, every duplicate mode, under injected faults.

A prefork, a threads and a solo worker run the tasks of :mod:`tests.soak_app`
(``wait``, ``skip``, ``retry`` and an ``until_executed`` one with ``acks_late``)
on four keys, sent at random, while the test kills and freezes pool processes,
freezes whole workers, resets, cuts, slows and drops the replies of their
connections to the lock store, and freezes the store, restarts it (with its
data), kills it and starts it again (with its data, as after a crash), or wipes
it (killed and started again without its data). Afterwards: no two bodies of one
lock ran at once unless the older one was told it had lost its lock, or the
store lost its data between their starts (then the later one's fencing token is
higher); no write the fence refused came right after a check that passed, unless
the store lost its data in between; every message was taken; no lock is left
held; every key has an expiry.

``REDISLOCK_SOAK_SECONDS`` makes the soak longer, and
``REDISLOCK_SOAK_KILL_WORKERS=1`` kills (and starts again) whole workers too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import redis

from celery_redislock.server import RedisServer
from tests.proxy import FaultProxy
from tests.support import close_app, lock_keys, tail, wait_for

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.slow,
    # The pool processes are found in /proc.
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]

#: Seconds of sends and faults (longer soaks: set ``REDISLOCK_SOAK_SECONDS``).
SOAK_SECONDS = float(os.environ.get("REDISLOCK_SOAK_SECONDS", "30"))
#: Whether whole workers are killed too (``REDISLOCK_SOAK_KILL_WORKERS=1``), and
#: started again: the messages they had taken and not acknowledged come back once
#: the broker's visibility timeout (:data:`VISIBILITY_TIMEOUT`) has passed, so the
#: test waits that much longer for them. Left out by default for that wait.
KILL_WORKERS = bool(os.environ.get("REDISLOCK_SOAK_KILL_WORKERS"))
VISIBILITY_TIMEOUT = 15.0
#: Pools and their concurrency (the prefork one first: its pool processes are faulted).
POOLS = (("prefork", 2), ("threads", 2), ("solo", 1))
#: Seconds between two faults (at random in this range).
FAULT_GAP = (0.3, 2.0)
#: How long a freeze lasts at most: longer than the tasks' TTL, so some bodies lose
#: their locks.
LONGEST_FREEZE = 3.5
#: Seconds without progress after which the test gives up waiting for the backlog:
#: longer than a retry's countdown, a waiter's wait, and a killed worker's
#: messages' way back.
STILL = 75.0 + (VISIBILITY_TIMEOUT if KILL_WORKERS else 0.0)
#: Bodies that must have run, for the soak to have shown anything.
MIN_BODIES = 50


class Body(NamedTuple):
    """One execution of a soak task's body, from its logs."""

    began: float
    ended: float  # when its process was killed, for a body killed before its end
    token: int
    task_id: str
    pid: int
    outcome: str  # done, lost, refused, killed
    gap: float  # refused: seconds from the last check of the lock to the write
    lost: bool  # what the lock said at the end


def start_worker(
    env: dict[str, str], pool: str, concurrency: int, log: Path
) -> subprocess.Popen[bytes]:
    """A ``celery worker`` on the soak app, in a process group of its own."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "tests.soak_app", "worker",
                "-P", pool, "-c", str(concurrency), "-n", f"{pool}@localhost", "-l", "info",
                "--without-gossip", "--without-mingle", "--without-heartbeat", "-Q", "soak",
            ],
            cwd=ROOT, env=env, start_new_session=True, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip


def pool_children(worker: subprocess.Popen[bytes]) -> list[int]:
    """The pool processes of a prefork worker (Linux)."""
    try:
        with open(f"/proc/{worker.pid}/task/{worker.pid}/children") as listing:
            return [int(pid) for pid in listing.read().split()]
    except OSError:
        return []


def send_signal(send: Callable[[int, int], None], pid: int, signum: int) -> bool:
    """``send(pid, signum)`` (``os.kill`` or ``os.killpg``); ``False`` if the process
    has gone: a pool process listed before its worker reaped it."""
    try:
        send(pid, signum)
    except ProcessLookupError:
        return False
    return True


class Store(NamedTuple):
    """The lock store: its server, the directory of its data, and when it lost its
    data (``time.time()`` as it was killed, each time it was wiped)."""

    server: RedisServer
    data: Path
    wiped: list[float]


def inject_fault(
    rng: random.Random,
    workers: list[subprocess.Popen[bytes]],
    restart: Callable[[int], None],
    proxy: FaultProxy,
    store: Store,
    killed: dict[int, float],
) -> str:
    """Inject one fault at random, wait for it to end, and return its name
    (``restart(i)`` starts ``workers[i]`` again, after a ``kill_worker``)."""
    index = rng.randrange(len(workers))
    worker = workers[index]
    children = pool_children(workers[0])  # the prefork worker's
    freeze = rng.uniform(0.5, LONGEST_FREEZE)
    fault = rng.choice(
        [
            "kill_child",
            "stop_child",
            "stop_worker",
            "reset",
            "cut",
            "drop_replies",
            "slow",
            "stall_store",
            "restart_store",
            "crash_store",
            "wipe_store",
            *(["kill_worker"] if KILL_WORKERS else []),
        ]
    )
    if fault in ("kill_child", "stop_child") and not children:
        fault = "stop_worker"
    if fault == "kill_child":
        victim, at = rng.choice(children), time.time()
        if send_signal(os.kill, victim, signal.SIGKILL):
            # (A process killed before, not reaped yet, died then.)
            killed.setdefault(victim, at)
    elif fault == "stop_child":
        victim = rng.choice(children)
        send_signal(os.kill, victim, signal.SIGSTOP)
        time.sleep(freeze)
        send_signal(os.kill, victim, signal.SIGCONT)
    elif fault == "stop_worker":
        send_signal(os.killpg, worker.pid, signal.SIGSTOP)
        time.sleep(freeze)
        send_signal(os.killpg, worker.pid, signal.SIGCONT)
    elif fault == "kill_worker":
        pids, at = (worker.pid, *pool_children(worker)), time.time()
        send_signal(os.killpg, worker.pid, signal.SIGKILL)
        for pid in pids:
            killed.setdefault(pid, at)
        worker.wait(10)
        restart(index)
    elif fault == "reset":
        proxy.reset_all()
    elif fault == "cut":
        proxy.blackhole()
        time.sleep(rng.uniform(0.3, 2.5))
        proxy.heal()
    elif fault == "drop_replies":
        proxy.drop_replies(rng.randint(1, 3))
    elif fault == "slow":
        proxy.set_latency(rng.uniform(0.05, 0.4))
        time.sleep(rng.uniform(0.5, 2.0))
        proxy.set_latency(0.0)
    elif fault == "restart_store":
        # Stopped (SIGTERM) and started again on the same port, with its data.
        store.server.restart()
    elif fault == "crash_store":
        # Killed (SIGKILL) and started again: what it answered is on disk.
        store.server.kill()
        store.server.restart()
    elif fault == "wipe_store":
        # Killed and started again without its data: every lock is gone.
        store.wiped.append(time.time())
        store.server.kill()
        for path in store.data.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        store.server.restart()
    else:
        with store.server.paused():
            time.sleep(rng.uniform(0.3, 2.5))
    return fault


def bodies(log: redis.Redis, killed: dict[int, float]) -> tuple[dict[str, list[Body]], list[Any]]:
    """The bodies that ran, per lock (kind and key), and the starts with no end whose
    process was not killed."""
    ends: dict[tuple[str, int, int], list[dict[str, Any]]] = defaultdict(list)
    for raw in log.lrange("soak:end", 0, -1):
        end = json.loads(raw)
        ends[end["id"], end["pid"], end["token"]].append(end)
    per_lock: dict[str, list[Body]] = defaultdict(list)
    open_ended = []
    for raw in log.lrange("soak:start", 0, -1):
        start = json.loads(raw)
        matching = ends[start["id"], start["pid"], start["token"]]
        if matching:
            end = matching.pop(0)
            ended, outcome, gap, lost = end["at"], end["outcome"], end["gap"], end["lost"]
        elif killed.get(start["pid"], 0.0) >= start["at"]:
            ended, outcome, gap, lost = killed[start["pid"]], "killed", 0.0, False
        else:
            open_ended.append(start)
            continue
        per_lock[f"{start['kind']}:{start['key']}"].append(
            Body(start["at"], ended, start["token"], start["id"], start["pid"], outcome, gap, lost)
        )
    return per_lock, open_ended


def overlaps(per_lock: dict[str, list[Body]], wiped: list[float]) -> tuple[list[str], int]:
    """Bodies of one lock that ran at once while the older one was told nothing of
    a loss, and writes the fence refused right after a check that passed; and how
    many pairs of bodies ran at once across a wipe of the store.

    The store losing its data (at the times in ``wiped``) frees every lock: a
    holder learns of it only at its next renewal, so a body that began before
    and one that began after may run at once, and the older's check may pass
    just before the newer writes. Such a pair is no problem if the newer has
    the higher fencing token: then the fence refuses what the older writes
    after it."""
    from tests.soak_app import PAUSE

    def wiped_between(start: float, end: float) -> bool:
        return any(start < at <= end for at in wiped)

    problems = []
    across = 0
    for lock, runs in per_lock.items():
        runs.sort()
        for i, first in enumerate(runs):
            if (
                first.outcome == "refused"
                and first.gap < PAUSE
                and not wiped_between(first.began, first.ended)
            ):
                problems.append(f"{lock}: {first} wrote {first.gap:.3f} s after its check passed")
            for second in runs[i + 1 :]:
                if second.began >= first.ended:
                    break
                if wiped_between(first.began, second.began):
                    across += 1
                    if second.token <= first.token:
                        problems.append(f"{lock}: {second} began after a wipe, below {first}")
                    continue
                older = min(first, second, key=lambda body: body.token)
                if older.outcome not in ("lost", "refused") and not older.lost:
                    problems.append(f"{lock}: {first} and {second} ran at once")
    return problems, across


@pytest.fixture
def soak_servers(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> Iterator[tuple[RedisServer, Store, FaultProxy]]:
    """The broker's server (also the logs'), the lock store (which keeps its data
    across a restart or a crash: every write is in its append-only file before it
    answers), and a proxy before it."""
    data = tmp_path / "store"
    data.mkdir()
    persistent = ("--appendonly", "yes", "--appendfsync", "always", "--dir", str(data))
    broker, store = redislock_server_factory(), redislock_server_factory(extra_args=persistent)
    with FaultProxy(store.host, store.port) as proxy:
        yield broker, Store(store, data, []), proxy


def test_real_workers_under_injected_faults_never_run_one_lock_twice_at_once(
    soak_servers: tuple[RedisServer, Store, FaultProxy], tmp_path: Path
) -> None:
    """Under kills, freezes, resets, cuts, lost replies, a frozen, restarted, crashed or
    wiped store, no lock runs two bodies at once unless the older was told it lost
    the lock (or the store lost its data, and the newer's token is higher), every
    message is taken, and nothing is left held."""
    broker, store, proxy = soak_servers
    seed = random.randrange(2**32)
    # The faults and the sends each draw from a generator of their own.
    rng, sends = random.Random(seed), random.Random(seed + 1)
    urls = {
        "REDISLOCK_SOAK_BROKER": broker.url_for(db=1),
        "REDISLOCK_SOAK_LOG": broker.url_for(db=2),
        "REDISLOCK_SOAK_LOCK": store.server.url,
    }
    # The test sends (and an until_executed send reserves) on the store directly;
    # the workers reach it through the proxy.
    os.environ.update(urls)
    sys.modules.pop("tests.soak_app", None)
    import tests.soak_app as soak_app

    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    env = dict(os.environ, PYTHONPATH=path, REDISLOCK_SOAK_LOCK=proxy.url)
    if KILL_WORKERS:
        env["REDISLOCK_SOAK_VISIBILITY_TIMEOUT"] = str(VISIBILITY_TIMEOUT)
    logs = [tmp_path / f"{pool}.log" for pool, _ in POOLS]
    workers = [start_worker(env, pool, n, log) for (pool, n), log in zip(POOLS, logs, strict=True)]
    queue = redis.Redis.from_url(urls["REDISLOCK_SOAK_BROKER"])
    log = redis.Redis.from_url(urls["REDISLOCK_SOAK_LOG"])
    lock_store = store.server.client()
    killed: dict[int, float] = {}
    faults: Counter[str] = Counter()
    stop = threading.Event()
    injector_errors: list[BaseException] = []

    def restart(index: int) -> None:
        (pool, concurrency), worker_log = POOLS[index], logs[index]
        workers[index] = start_worker(env, pool, concurrency, worker_log)

    def inject() -> None:
        try:
            while not stop.wait(rng.uniform(*FAULT_GAP)):
                faults[inject_fault(rng, workers, restart, proxy, store, killed)] += 1
        except BaseException as exc:
            injector_errors.append(exc)

    injector = threading.Thread(target=inject, name="soak-faults")
    sent = refused_sends = 0
    try:
        wait_for(lambda: len(pool_children(workers[0])) == POOLS[0][1], 60, "the prefork pool")
        time.sleep(2.0)  # the other workers start meanwhile
        injector.start()
        began = time.monotonic()
        while time.monotonic() - began < SOAK_SECONDS:
            task = sends.choice(soak_app.KINDS)
            key = f"k{sends.randrange(4)}"
            try:
                task.apply_async((key, sent, sends.choice((0.0, 0.05, 0.3, 1.0, 2.5))))
            except Exception:
                # An until_executed send while the store is frozen: refused, nothing queued.
                refused_sends += 1
            sent += 1
            time.sleep(sends.uniform(0.02, 0.2))
        stop.set()
        injector.join()
        summary = f"seed {seed}: {sent} sent ({refused_sends} refused), faults {dict(faults)}"
        assert not injector_errors, f"{injector_errors}; {summary}"
        proxy.heal()
        # The backlog left when the sends stop takes as long as it takes: the wait
        # gives up only once nothing has moved for a while.
        last, moved = None, time.monotonic()
        while True:
            state = (
                queue.llen("soak"),
                queue.hlen("unacked"),
                log.llen(soak_app.START),
                log.llen(soak_app.END),
                len(bodies(log, killed)[1]),
            )
            if state[:2] == (0, 0) and state[4] == 0:
                break
            if state != last:
                last, moved = state, time.monotonic()
            # (queued, taken and unacknowledged, started, ended, not ended)
            assert time.monotonic() - moved < STILL, f"stuck at {state}; {summary}"
            time.sleep(0.2)
        per_lock, _ = bodies(log, killed)
        outcomes = Counter(body.outcome for runs in per_lock.values() for body in runs)
        summary += f", bodies {dict(outcomes)}"
        assert all(worker.poll() is None for worker in workers), summary
        assert sum(outcomes.values()) >= MIN_BODIES, summary
        problems, across = overlaps(per_lock, store.wiped)
        summary += f", {across} pairs at once across a wipe"
        assert not problems, f"{len(problems)} problems, first: {problems[:5]}; {summary}"
        # A hold of a killed or frozen process is freed by its worker or expires.
        wait_for(lambda: not lock_keys(lock_store), soak_app.TTL + 5, f"locks freed ({summary})")
        keys = list(lock_store.scan_iter("*"))
        assert keys, summary
        assert all(lock_store.pttl(key) > 0 for key in keys), summary
        print(summary)  # shown with -s or -rP
    except BaseException:
        for worker_log in logs:
            print(f"--- {worker_log.name}\n{tail(worker_log)}", file=sys.stderr)
        raise
    finally:
        stop.set()
        if injector.is_alive():
            injector.join()
        proxy.heal()
        for worker in workers:
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            worker.wait(10)
        for client in (queue, log, lock_store):
            client.close()
        close_app(soak_app.app)
        sys.modules.pop("tests.soak_app", None)
        for name in urls:
            os.environ.pop(name, None)
