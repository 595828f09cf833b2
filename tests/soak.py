"""The worker soak: real workers of every pool, every duplicate mode, under
injected faults (see :mod:`tests.test_soak_workers` and
:mod:`tests.test_soak_deployments`).

A prefork, a threads and a solo worker run the tasks of :mod:`tests.soak_app`
(``wait``, ``skip``, ``retry`` and an ``until_executed`` one with ``acks_late``)
on four keys, sent at random, while a thread kills and freezes pool processes
and freezes whole workers, and faults the lock store: a single server behind a
fault proxy (:func:`fault_server`), a Sentinel-managed primary
(:func:`fault_sentinel`) or a Redis Cluster (:func:`fault_cluster`).

Afterwards (:func:`soak`): no two bodies of one lock ran at once unless the
older one was told it had lost its lock, or the store may have lost locks
between their starts (a wipe, a failover: then the later one's fencing token is
the higher); no write the fence refused came right after a check that passed,
unless the store may have lost locks during that body; every message was taken;
no lock is left held; every key has an expiry.

``REDISLOCK_SOAK_SECONDS`` makes a soak longer, and
``REDISLOCK_SOAK_KILL_WORKERS=1`` kills (and starts again) whole workers too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import redis

from celery_redislock.deployments import ClusterDeployment, DeploymentError, SentinelDeployment
from celery_redislock.scripts import LEASE_FIELD
from celery_redislock.server import RedisServer
from tests.proxy import FaultProxy
from tests.support import close_app, fields, lock_keys, tail, wait_for

ROOT = Path(__file__).resolve().parent.parent

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
#: Faults of the workers, whatever the store.
WORKER_FAULTS = (
    "kill_child",
    "stop_child",
    "stop_worker",
    *(("kill_worker",) if KILL_WORKERS else ()),
)
#: Faults of a single lock store, behind the proxy.
SERVER_FAULTS = (
    "reset", "cut", "drop_replies", "slow", "stall_store", "restart_store", "crash_store", "wipe_store"
)  # fmt: skip
#: Faults of a Sentinel-managed lock store.
SENTINEL_FAULTS = ("failover", "kill_primary", "stall_primary")
#: Faults of a Redis Cluster lock store.
CLUSTER_FAULTS = ("kill_primary", "stall_primary")
#: The Sentinels' ``failover-timeout``: how long they wait for the replica they
#: promote to say it is a primary (on a busy machine, longer than the default).
FAILOVER_TIMEOUT_MS = 10_000
#: Seconds a failover of a failed primary may take: one that the Sentinels give
#: up is tried again after twice ``failover-timeout``.
FAILOVER_WAIT = 3 * FAILOVER_TIMEOUT_MS / 1000 + 10
#: From when to when (``time.time()``) the lock store may have lost locks: a
#: wipe, a failover.
Loss = tuple[float, float]


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


class Workers:
    """The soak's workers (one per pool of :data:`POOLS`), their logs, and when each
    process killed by the test died."""

    def __init__(self, env: dict[str, str], directory: Path) -> None:
        self.env = env
        self.logs = [directory / f"{pool}.log" for pool, _ in POOLS]
        self.processes = [self._start(index) for index in range(len(POOLS))]
        #: pid: when it was killed (``time.time()``).
        self.killed: dict[int, float] = {}

    def _start(self, index: int) -> subprocess.Popen[bytes]:
        (pool, concurrency), log = POOLS[index], self.logs[index]
        return start_worker(self.env, pool, concurrency, log)

    def restart(self, index: int) -> None:
        """Start the worker of ``POOLS[index]`` again (after it was killed)."""
        self.processes[index] = self._start(index)

    def children(self) -> list[int]:
        """The pool processes of the prefork worker (the first)."""
        return pool_children(self.processes[0])

    def kill(self) -> None:
        """Kill every worker and its pool processes."""
        for worker in self.processes:
            send_signal(os.killpg, worker.pid, signal.SIGKILL)
            worker.wait(10)

    def tails(self) -> str:
        """The end of each worker's log."""
        return "\n".join(f"--- {log.name}\n{tail(log)}" for log in self.logs)


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


def fault_workers(rng: random.Random, workers: Workers, fault: str) -> None:
    """Inject ``fault`` (one of :data:`WORKER_FAULTS`) and wait for it to end."""
    index = rng.randrange(len(workers.processes))
    worker = workers.processes[index]
    children = workers.children()
    freeze = rng.uniform(0.5, LONGEST_FREEZE)
    if fault in ("kill_child", "stop_child") and not children:
        fault = "stop_worker"
    if fault == "kill_child":
        victim, at = rng.choice(children), time.time()
        if send_signal(os.kill, victim, signal.SIGKILL):
            # (A process killed before, not reaped yet, died then.)
            workers.killed.setdefault(victim, at)
    elif fault == "stop_child":
        victim = rng.choice(children)
        send_signal(os.kill, victim, signal.SIGSTOP)
        time.sleep(freeze)
        send_signal(os.kill, victim, signal.SIGCONT)
    elif fault == "stop_worker":
        send_signal(os.killpg, worker.pid, signal.SIGSTOP)
        time.sleep(freeze)
        send_signal(os.killpg, worker.pid, signal.SIGCONT)
    else:  # kill_worker
        pids, at = (worker.pid, *pool_children(worker)), time.time()
        send_signal(os.killpg, worker.pid, signal.SIGKILL)
        for pid in pids:
            workers.killed.setdefault(pid, at)
        worker.wait(10)
        workers.restart(index)


class Store(NamedTuple):
    """A single lock store: its server, the directory of its data, and the proxy
    the workers reach it through."""

    server: RedisServer
    data: Path
    proxy: FaultProxy


def fault_server(rng: random.Random, store: Store, fault: str, losses: list[Loss]) -> str:
    """Inject ``fault`` (one of :data:`SERVER_FAULTS`) and wait for it to end; a
    wipe is added to ``losses``. Returns ``fault``."""
    server, proxy = store.server, store.proxy
    if fault == "reset":
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
        server.restart()
    elif fault == "crash_store":
        # Killed (SIGKILL) and started again: what it answered is on disk.
        server.kill()
        server.restart()
    elif fault == "wipe_store":
        # Killed and started again without its data: every lock is gone.
        began = time.time()
        server.kill()
        for path in store.data.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        server.restart()
        losses.append((began, time.time()))
    else:  # stall_store
        with server.paused():
            time.sleep(rng.uniform(0.3, 2.5))
    return fault


def fault_sentinel(deployment: SentinelDeployment, fault: str, losses: list[Loss]) -> str:
    """Inject ``fault`` (one of :data:`SENTINEL_FAULTS`) on the primary, wait until a
    replica has replaced it and it is a replica in step again, and add that span to
    ``losses``: writes the old primary took and had not passed on are lost, and a
    frozen one takes writes after it wakes, until the Sentinels demote it.
    Returns ``fault``."""
    began = time.time()
    old = deployment.master()
    if fault == "failover":
        sentinel = deployment.sentinel_servers[0].client(socket_timeout=5)
        try:
            sentinel.sentinel_failover(deployment.master_name)
        finally:
            sentinel.close()
        # On a busy machine the Sentinel may give up waiting for the replica it
        # promoted, which it then makes a replica again (no failover, but it was
        # a primary for a moment).
        with contextlib.suppress(DeploymentError):
            deployment.wait_for_failover(timeout=FAILOVER_TIMEOUT_MS / 1000 + 5, old=old)
    elif fault == "kill_primary":
        old.kill()
        deployment.wait_for_failover(timeout=FAILOVER_WAIT, old=old)
        old.restart()
    else:  # stall_primary
        with old.paused():
            deployment.wait_for_failover(timeout=FAILOVER_WAIT, old=old)
    try:
        wait_for(lambda: settled(deployment), 60, "the replicas in step")
    except AssertionError:
        raise AssertionError(f"after {fault}, replicas not in step: {roles(deployment)}") from None
    losses.append((began, time.time()))
    return fault


def fault_cluster(
    rng: random.Random, cluster: ClusterDeployment, fault: str, losses: list[Loss]
) -> str:
    """Inject ``fault`` (one of :data:`CLUSTER_FAULTS`) on a primary that has a
    replica in step, wait until the replica has taken its slots over and the
    cluster is whole again, and add that span to ``losses``. A killed primary
    stays down (its shard has no replica left), so only the first
    ``kill_primary`` kills, and the later ones freeze; a frozen primary comes back
    as the replica of its heir. Without a primary that has a replica left, nothing.
    Returns what it did: ``fault``, or ``no_replica_left``."""
    began = time.time()
    ready = [
        node for node in cluster.primaries() if any(in_step(r, node) for r in cluster.replicas())
    ]
    if not ready:
        return "no_replica_left"
    if fault == "kill_primary" and len(ready) < cluster.masters:
        # One kill a soak: a killed node stays down, its shard without a replica.
        fault = "stall_primary"
    victim = rng.choice(ready)
    if fault == "kill_primary":
        cluster.kill(victim)
        cluster.wait_for_failover(victim, timeout=30)
    else:  # stall_primary
        cluster.pause(victim)
        try:
            cluster.wait_for_failover(victim, timeout=30)
        finally:
            victim.resume()
        wait_for(
            lambda: any(in_step(victim, node) for node in cluster.primaries()),
            30,
            f"node {victim.port} a replica again",
        )
    cluster.wait_until_ok(timeout=30)
    losses.append((began, time.time()))
    return fault


def in_step(replica: RedisServer, primary: RedisServer) -> bool:
    """Whether ``replica`` is a replica of ``primary`` with its link up."""
    client = replica.client(socket_timeout=1)
    try:
        info = client.info("replication")
    except redis.RedisError:
        return False
    finally:
        client.close()
    return bool(
        info.get("role") == "slave"
        and info.get("master_port") == primary.port
        and info.get("master_link_status") == "up"
    )


def roles(deployment: SentinelDeployment) -> dict[int, Any]:
    """Each data server's replication role and link, by port (for failure messages)."""
    found: dict[int, Any] = {}
    for server in deployment.servers:
        client = server.client(socket_timeout=1)
        try:
            info = client.info("replication")
            found[server.port] = (
                info.get("role"),
                info.get("master_port"),
                info.get("master_link_status"),
            )
        except redis.RedisError as exc:
            found[server.port] = repr(exc)
        finally:
            client.close()
    return found


def settled(deployment: SentinelDeployment) -> bool:
    """Whether every data server but the primary the Sentinels name is its replica,
    with its link up."""
    try:
        primary = deployment.master()
    except Exception:
        return False
    return all(in_step(server, primary) for server in deployment.servers if server is not primary)


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


def overlaps(per_lock: dict[str, list[Body]], losses: list[Loss]) -> tuple[list[str], int]:
    """Bodies of one lock that ran at once while the older one was told nothing of
    a loss, and writes the fence refused right after a check that passed; and how
    many pairs of bodies ran at once across a span in which the store may have
    lost locks.

    A store that loses locks (wiped, failed over to a replica that had not
    received them, or frozen and still taking writes after the failover until it
    is demoted) lets a second holder in: a holder learns of it only at its next
    renewal, so a body that began before or during such a span and one that
    began after its start may run at once, and the older's check may pass just
    before the newer writes. Such a pair is no problem if the later one has the
    higher fencing token: then the fence refuses what the other writes after
    it."""
    from tests.soak_app import PAUSE

    def lost_locks(start: float, end: float) -> bool:
        return any(start < until and began < end for began, until in losses)

    problems = []
    across = 0
    for lock, runs in per_lock.items():
        runs.sort()
        for i, first in enumerate(runs):
            if (
                first.outcome == "refused"
                and first.gap < PAUSE
                and not lost_locks(first.began, first.ended)
            ):
                problems.append(f"{lock}: {first} wrote {first.gap:.3f} s after its check passed")
            for second in runs[i + 1 :]:
                if second.began >= first.ended:
                    break
                if lost_locks(first.began, second.began):
                    across += 1
                    if second.token <= first.token:
                        problems.append(f"{lock}: {second} began after a loss, below {first}")
                    continue
                older = min(first, second, key=lambda body: body.token)
                if older.outcome not in ("lost", "refused") and not older.lost:
                    problems.append(f"{lock}: {first} and {second} ran at once")
    return problems, across


def drain(queue: redis.Redis, log: redis.Redis, workers: Workers, summary: str) -> None:
    """Wait until every message sent is taken and every body that began has ended
    (or its process was killed). The backlog left when the sends stop takes as long
    as it takes: the wait fails only once nothing has moved for :data:`STILL`."""
    from tests.soak_app import END, START

    last, moved = None, time.monotonic()
    while True:
        state = (
            queue.llen("soak"),
            queue.hlen("unacked"),
            log.llen(START),
            log.llen(END),
            len(bodies(log, workers.killed)[1]),
        )
        if state[:2] == (0, 0) and state[4] == 0:
            return
        if state != last:
            last, moved = state, time.monotonic()
        # (queued, taken and unacknowledged, started, ended, not ended)
        assert time.monotonic() - moved < STILL, f"stuck at {state}; {summary}"
        time.sleep(0.2)


def left_held(
    lock_store: redis.Redis,
    per_lock: dict[str, list[Body]],
    refused_ids: set[str],
    workers: Workers,
) -> list[Any]:
    """What is known of each lock still held: its value and TTL, whether the send
    of its lease's message was refused, the bodies that message ran, its result,
    and every line the workers logged about it."""
    from tests.soak_app import app

    left: list[Any] = []
    for key in lock_keys(lock_store):
        held = fields(lock_store, key)
        lease = held.get(LEASE_FIELD)
        ran = [body for runs in per_lock.values() for body in runs if body.task_id == lease]
        result = app.AsyncResult(lease)
        told = [
            line
            for log_path in workers.logs
            for line in log_path.read_text(errors="replace").splitlines()
            if lease and lease in line
        ]
        left.append(
            (key, held, lock_store.pttl(key), f"refused send: {lease in refused_ids}", ran,
             result.state, repr(result.result), told)
        )  # fmt: skip
    return left


def soak(
    directory: Path,
    broker: RedisServer,
    lock_env: dict[str, str],
    worker_lock_url: str,
    lock_store: redis.Redis,
    store_faults: tuple[str, ...],
    fault_store: Callable[[random.Random, str, list[Loss]], str],
) -> None:
    """Run the soak, check it, and print its summary.

    ``lock_env`` says where the locks are, to the test's sends and (but for
    ``REDISLOCK_SOAK_LOCK``, which is ``worker_lock_url`` for them) the workers;
    ``lock_store`` is a client of the store, for the last checks (closed here);
    ``fault_store(rng, fault, losses)`` injects one of ``store_faults``, waits
    for it to end, adds to ``losses`` when the store may have lost locks, and
    returns the name of what it did."""
    seed = random.randrange(2**32)
    # The faults and the sends each draw from a generator of their own.
    rng, sends = random.Random(seed), random.Random(seed + 1)
    env = {
        "REDISLOCK_SOAK_BROKER": broker.url_for(db=1),
        "REDISLOCK_SOAK_LOG": broker.url_for(db=2),
        **lock_env,
    }
    os.environ.update(env)
    sys.modules.pop("tests.soak_app", None)
    import tests.soak_app as soak_app

    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    worker_env = dict(os.environ, PYTHONPATH=path, REDISLOCK_SOAK_LOCK=worker_lock_url)
    if KILL_WORKERS:
        worker_env["REDISLOCK_SOAK_VISIBILITY_TIMEOUT"] = str(VISIBILITY_TIMEOUT)
    workers = Workers(worker_env, directory)
    queue = redis.Redis.from_url(env["REDISLOCK_SOAK_BROKER"])
    log = redis.Redis.from_url(env["REDISLOCK_SOAK_LOG"])
    faults: Counter[str] = Counter()
    losses: list[Loss] = []
    stop = threading.Event()
    injector_errors: list[BaseException] = []

    def inject() -> None:
        try:
            while not stop.wait(rng.uniform(*FAULT_GAP)):
                fault = rng.choice((*WORKER_FAULTS, *store_faults))
                if fault in WORKER_FAULTS:
                    fault_workers(rng, workers, fault)
                else:
                    fault = fault_store(rng, fault, losses)
                faults[fault] += 1
        except BaseException as exc:
            injector_errors.append(exc)

    injector = threading.Thread(target=inject, name="soak-faults")
    sent = 0
    refused_ids: set[str] = set()
    try:
        wait_for(lambda: len(workers.children()) == POOLS[0][1], 60, "the prefork pool")
        time.sleep(2.0)  # the other workers start meanwhile
        injector.start()
        began = time.monotonic()
        while time.monotonic() - began < SOAK_SECONDS:
            task = sends.choice(soak_app.KINDS)
            key = f"k{sends.randrange(4)}"
            task_id = str(uuid.UUID(int=sends.getrandbits(128), version=4))
            try:
                task.apply_async(
                    (key, sent, sends.choice((0.0, 0.05, 0.3, 1.0, 2.5))), task_id=task_id
                )
            except Exception:
                # An until_executed send while the store is out of reach: refused,
                # nothing queued.
                refused_ids.add(task_id)
            sent += 1
            time.sleep(sends.uniform(0.02, 0.2))
        stop.set()
        injector.join()
        summary = f"seed {seed}: {sent} sent ({len(refused_ids)} refused), faults {dict(faults)}"
        assert not injector_errors, f"{injector_errors}; {summary}"
        drain(queue, log, workers, summary)
        per_lock, _ = bodies(log, workers.killed)
        outcomes = Counter(body.outcome for runs in per_lock.values() for body in runs)
        kinds = Counter(lock.split(":")[0] for lock, runs in per_lock.items() for _ in runs)
        summary += f", bodies {dict(outcomes)} ({dict(kinds)})"
        assert all(worker.poll() is None for worker in workers.processes), summary
        assert sum(outcomes.values()) >= MIN_BODIES, summary
        problems, across = overlaps(per_lock, losses)
        summary += f", {across} pairs at once across a loss of locks"
        assert not problems, f"{len(problems)} problems, first: {problems[:5]}; {summary}"
        # A hold of a killed or frozen process is freed by its worker or expires.
        try:
            wait_for(lambda: not lock_keys(lock_store), soak_app.TTL + 5, "locks freed")
        except AssertionError:
            left = left_held(lock_store, per_lock, refused_ids, workers)
            raise AssertionError(f"locks left held: {left}; losses {losses}; {summary}") from None
        keys = list(lock_store.scan_iter("*"))
        assert keys, summary
        assert all(lock_store.pttl(key) > 0 for key in keys), summary
        print(summary)  # shown with -s or -rP
    except BaseException:
        print(workers.tails(), file=sys.stderr)
        raise
    finally:
        stop.set()
        if injector.is_alive():
            injector.join()
        workers.kill()
        for client in (queue, log, lock_store):
            client.close()
        close_app(soak_app.app)
        sys.modules.pop("tests.soak_app", None)
        for name in env:
            os.environ.pop(name, None)
