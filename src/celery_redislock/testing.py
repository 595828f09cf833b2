"""A test kit for code that uses celery_redislock: a private Redis, a real worker,
and helpers that stage what other holders do to your task's lock.

An opt-in pytest plugin: enable it in your ``conftest.py``::

    pytest_plugins = ["celery_redislock.testing"]

(or run ``pytest -p celery_redislock.testing``). Nothing is loaded otherwise:
installing celery_redislock does not touch other pytest sessions. The helpers
raise their own ``AssertionError`` messages, so the module opts out of pytest's
assertion rewriting (PYTEST_DONT_REWRITE): a ``conftest.py`` may import them
before it lists the plugin, without a warning.

Fixtures (each server starts on a free 127.0.0.1 port, only when a test asks):
    redislock_server          one server for the whole session (``.url``, ``.client()``)
    redislock_url             its ``redis://`` URL
    redislock_client          a client to its database 0 (where :func:`configure_app`
                              puts the locks), emptied before the test
    redislock_server_factory  ``factory(binary=None, extra_args=())`` starts more
                              independent servers, stopped after the test

Deployments (from :mod:`celery_redislock.deployments`):
    redislock_cluster              a 3-primary Redis Cluster for the session
                                   (``.client()`` is a ``RedisCluster``)
    redislock_cluster_factory      ``factory(masters=3, replicas_per_master=0)``: clusters
                                   of the test's own (to kill nodes in), stopped after it
    redislock_sentinel             a primary, one replica and three Sentinels for the
                                   session (``.sentinel_url``, ``.transport_options``,
                                   ``.client()``); do not kill its primary: use the factory
    redislock_sentinel_factory     ``factory(replicas=1, sentinels=3)``: Sentinel deployments
                                   of the test's own (``.kill_master()``,
                                   ``.wait_for_failover()``), stopped after it
    redislock_tls_server           a TLS-only server for the session (``.url`` is
                                   ``rediss://…?ssl_cert_reqs=required&ssl_ca_certs=…``,
                                   ``.ca_path``); needs ``cryptography``; skipped
                                   when the server binary has no TLS
    redislock_acl_server_factory   ``factory(rules, username="locker", password=…)``: a new
                                   server with that ACL user; returns an ``AclUser``
                                   (``.url``, ``.client()``, ``.server``)

Session servers and deployments are shared: a test must leave no keys behind (or
clean up what it wrote) and must not stop or kill their processes.

Helpers, for testing your own duplicate handling against a real lock:
    configure_app(app, url)          point an app's broker, results and locks at a server
    run_worker(app)                  a real worker (threads pool) in this process
    hold_lock(task, *args, **kw)     hold the lock of that call as another task would
    leave_stale_lock(task, *args, ttl=…, **kw)
                                     leave a crashed holder's lock behind: nobody
                                     renews it, it frees after ``ttl`` seconds
    wait_for_lock(task, *args, timeout=10, **kw)
                                     wait until the call's lock is held (by a running
                                     or queued task); returns what ``list`` shows of it
    steal_lock(task, *args, **kw)    take the lock of a running call away from it:
                                     its ``self.lock.check()`` raises ``LockLostError``
    assert_no_locks(client)          fail if any lock is held or any waiter queued
"""

from __future__ import annotations

import functools
import gc
import logging
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from celery import _state as celery_state
from celery.contrib.testing.worker import TestWorkController, start_worker
from celery.worker import state as worker_state

from celery_redislock.admin import LockInfo, glob_escape, list_locks, read_lock
from celery_redislock.deployments import (
    AclUser,
    ClusterDeployment,
    SentinelDeployment,
    TLSServer,
    create_acl_user,
    tls_available,
)
from celery_redislock.heartbeat import get_heartbeat
from celery_redislock.lock import DEFAULT_PREFIX, RedisLock, since_now
from celery_redislock.scripts import LEASE_FIELD, OWNER_FIELD
from celery_redislock.server import RedisServer
from celery_redislock.task import SingletonTask
from celery_redislock.transport import Client

__all__ = [
    "assert_no_locks",
    "configure_app",
    "hold_lock",
    "leave_stale_lock",
    "run_worker",
    "steal_lock",
    "wait_for_lock",
]


# Fixtures.
@pytest.fixture(scope="session")
def redislock_server() -> Iterator[RedisServer]:
    """A private server on a free 127.0.0.1 port, shared by the session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redislock_url(redislock_server: RedisServer) -> str:
    """The session server's URL."""
    return redislock_server.url


@pytest.fixture
def redislock_client(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the session server's database 0, emptied first (a worker's broker
    database, 1 with :func:`configure_app`, is left alone)."""
    client = redislock_server.client()
    client.flushdb()
    yield client
    client.close()


@pytest.fixture
def redislock_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start more servers (``factory(binary=None, extra_args=())``); all stop afterwards."""
    started: list[RedisServer] = []

    def factory(binary: str | None = None, extra_args: tuple[str, ...] = ()) -> RedisServer:
        server = RedisServer(binary=binary, extra_args=extra_args).start()
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def redislock_cluster() -> Iterator[ClusterDeployment]:
    """A Redis Cluster of three primaries (no replicas), shared by the session."""
    with ClusterDeployment(masters=3) as cluster:
        yield cluster


@pytest.fixture
def redislock_cluster_factory() -> Iterator[Callable[..., ClusterDeployment]]:
    """Start clusters of the test's own (``factory(masters=3, replicas_per_master=0,
    **kwargs)``, as :class:`ClusterDeployment` takes them); all stop afterwards."""
    started: list[ClusterDeployment] = []

    def factory(masters: int = 3, replicas_per_master: int = 0, **kwargs: Any) -> ClusterDeployment:
        cluster = ClusterDeployment(masters, replicas_per_master, **kwargs)
        started.append(cluster)
        return cluster.start()

    yield factory
    for cluster in started:
        cluster.stop()


@pytest.fixture(scope="session")
def redislock_sentinel() -> Iterator[SentinelDeployment]:
    """A primary with one replica watched by three Sentinels, shared by the session."""
    with SentinelDeployment(replicas=1, sentinels=3) as deployment:
        yield deployment


@pytest.fixture
def redislock_sentinel_factory() -> Iterator[Callable[..., SentinelDeployment]]:
    """Start Sentinel deployments of the test's own (``factory(replicas=1, sentinels=3,
    **kwargs)``, as :class:`SentinelDeployment` takes them); all stop afterwards."""
    started: list[SentinelDeployment] = []

    def factory(replicas: int = 1, sentinels: int = 3, **kwargs: Any) -> SentinelDeployment:
        deployment = SentinelDeployment(replicas=replicas, sentinels=sentinels, **kwargs)
        started.append(deployment)
        return deployment.start()

    yield factory
    for deployment in started:
        deployment.stop()


@pytest.fixture(scope="session")
def redislock_tls_server() -> Iterator[TLSServer]:
    """A server that accepts only TLS, with a throw-away CA, shared by the session.

    Tests that use it are skipped when the server binary was built without TLS.
    """
    if not tls_available():
        pytest.skip("the Redis server binary was built without TLS support")
    with TLSServer() as server:
        yield server


@pytest.fixture
def redislock_acl_server_factory() -> Iterator[Callable[..., AclUser]]:
    """Start a server with one ACL user: ``factory(rules, username="locker",
    password="locker-password")`` returns the :class:`AclUser`; servers stop afterwards."""
    started: list[RedisServer] = []

    def factory(
        rules: Sequence[str],
        username: str = "locker",
        password: str = "locker-password",
        binary: str | None = None,
    ) -> AclUser:
        server = RedisServer(binary=binary)
        started.append(server)
        return create_acl_user(server.start(), username, password, rules)

    yield factory
    for server in started:
        server.stop()


# Helpers.
def configure_app(app: Any, url: str) -> Any:
    """Point ``app``'s broker, result backend and lock store at the server at ``url``.

    The broker and results use database 1 and the locks database 0 of that
    server, so a test can look at (and clean) the locks without touching queued
    messages; results do not expire. Call it before the app first sends a task or reads a result (a
    session or module fixture): Celery keeps its connections once made. Returns
    the app.
    """
    base = url.rsplit("/", 1)[0]
    app.conf.update(
        broker_url=f"{base}/1",
        result_backend=f"{base}/1",
        redislock_url=url,
        broker_connection_retry_on_startup=True,
        # Results on a throw-away server need no expiry; and Celery writes expiring
        # results with a redis-py call that warns it is deprecated, which a test
        # session turning warnings into errors would see as failed result writes.
        result_expires=None,
    )
    return app


@contextmanager
def run_worker(
    app: Any,
    concurrency: int = 4,
    pool: str = "threads",
    shutdown_timeout: float = 30.0,
    startup_timeout: float = 60.0,
    **options: Any,
) -> Iterator[Any]:
    """Run a real Celery worker for ``app`` in this process while the block runs.

    A threads-pool worker consumes the app's default queue, executes tasks
    (locks, heartbeat, revokes and all) and answers remote-control commands;
    it stops, after the tasks it runs have finished, when the block ends, and
    what Celery changes for the worker is put back: the root logger's level, and
    the current and default app (Celery makes ``app`` both).
    ``options`` go to Celery's ``start_worker`` (``hostname=``, ``queues=``…).

    Raises:
        RuntimeError: the worker failed to start, or was not ready within
            ``startup_timeout`` seconds (the block does not run); or, when the
            block ends, the worker or a task it runs was still running after
            ``shutdown_timeout`` seconds.
    """
    # Celery sets the root logger's level for the worker (ERROR by default); what
    # is logged after the worker stopped must not depend on it.
    root = logging.getLogger()
    level = root.level
    current, default = getattr(celery_state._tls, "current_app", None), celery_state.default_app
    try:
        worker_cm = start_worker(
            app,
            pool=pool,
            concurrency=concurrency,
            perform_ping_check=False,
            shutdown_timeout=shutdown_timeout,
            WorkController=functools.partial(_Worker, startup_timeout=startup_timeout),
            **options,
        )
        worker = worker_cm.__enter__()
        try:
            yield worker
        finally:
            deadline = time.monotonic() + shutdown_timeout
            # A stopped in-process worker drops (rather than closes) its broker
            # connections; collect them now, quietly, not in some later test.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)
                try:
                    worker_cm.__exit__(None, None, None)
                except RuntimeError:
                    # Celery's wait for the worker thread ran out: it leaves the
                    # process-wide stop flag set, which would stop every later
                    # worker of this process before it is ready.
                    _finish_stopping(worker)
                    _wait_for_pool_threads(worker, deadline)
                    raise RuntimeError(
                        "the worker was still stopping after shutdown_timeout: raise it "
                        "(a worker takes about a second to notice it is told to stop)"
                    ) from None
                _wait_for_pool_threads(worker, deadline)
                gc.collect()
    finally:
        root.setLevel(level)
        celery_state._set_current_app(current)
        celery_state.set_default_app(default)


class _Worker(TestWorkController):  # type: ignore[misc]
    """Celery's in-process test worker, whose wait for start-up gives up.

    Celery's waits for ever on an event only a started worker sets, so a worker
    that fails to start (a bootstep raises) would hang the test session. This
    one waits until ``startup_timeout`` and notices a worker thread that ended.
    """

    def __init__(self, *args: Any, startup_timeout: float, **kwargs: Any) -> None:
        self._startup_timeout = startup_timeout
        self._thread: threading.Thread | None = None
        self._startup_error: BaseException | None = None
        super().__init__(*args, **kwargs)

    def start(self) -> Any:
        """Run the worker (in its own thread), remembering that thread."""
        self._thread = threading.current_thread()
        return super().start()

    def stop(self, in_sighandler: bool = False, exitcode: int | None = None) -> None:
        """Stop the worker; before it was ready, keep the error it is stopping on.

        Celery's ``start()`` logs a start-up error and calls this from its
        ``except`` block, so the error is still the one being handled here.
        """
        if not self._on_started.is_set() and self._startup_error is None:
            self._startup_error = sys.exc_info()[1]
        super().stop(in_sighandler=in_sighandler, exitcode=exitcode)

    def ensure_started(self) -> None:
        """Wait until the worker is ready to consume.

        Raises:
            RuntimeError: the worker failed to start, or was not ready in time.
        """
        deadline = time.monotonic() + self._startup_timeout
        while not self._on_started.wait(0.05):
            # A failed start is reported once the worker thread has ended, so that
            # its shutdown does not go on into whatever runs next.
            error = self._startup_error
            ended = self._thread is not None and not self._thread.is_alive()
            if ended and error is not None:
                raise RuntimeError(f"the worker failed to start: {error!r}") from error
            if ended:
                raise RuntimeError(
                    f"the worker stopped before it was ready (exit code {self.exitcode!r})"
                )
            if time.monotonic() >= deadline:
                cause = f" (it was failing with {error!r})" if error is not None else ""
                raise RuntimeError(
                    f"the worker was not ready within {self._startup_timeout:g} s{cause}"
                ) from error


#: How long, at most, a worker whose stop outlasted ``shutdown_timeout`` is given
#: to finish stopping before ``run_worker`` raises (its loop notices the stop
#: flag about once a second).
STOP_GRACE = 5.0


def _finish_stopping(worker: Any) -> None:
    """Give the worker thread :data:`STOP_GRACE` to end, then clear Celery's stop
    flag if it has, so that later workers of this process can start."""
    thread = getattr(worker, "_thread", None)
    if thread is not None:
        thread.join(STOP_GRACE)
    if thread is None or not thread.is_alive():
        worker_state.should_terminate = None


def _wait_for_pool_threads(worker: Any, deadline: float) -> None:
    """Wait, until ``deadline``, for the tasks still running on a threads pool.

    Celery stops an in-process worker with a cold terminate, which leaves the
    threads pool's executor alone: a running task would go on (holding and
    renewing its lock) after the worker is gone, into the next test. Tasks not
    yet started are cancelled; the running ones are waited for.

    Raises:
        RuntimeError: a pool thread was still running at ``deadline``.
    """
    executor = getattr(getattr(worker, "pool", None), "executor", None)
    if not isinstance(executor, ThreadPoolExecutor):
        return  # other pools run their tasks in the worker thread or in processes
    executor.shutdown(wait=False, cancel_futures=True)
    # shutdown(wait=True) has no timeout; its threads are joined one by one instead.
    threads: list[threading.Thread] = list(getattr(executor, "_threads", ()))
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    running = [thread.name for thread in threads if thread.is_alive()]
    if running:
        raise RuntimeError(
            f"tasks still running on the worker's threads pool ({', '.join(running)}) "
            "after shutdown_timeout: raise it if your tasks take longer to finish"
        )


def _call_lock(task: SingletonTask, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The lock name of ``task(*args, **kwargs)``, checking that ``task`` is a SingletonTask."""
    if not isinstance(task, SingletonTask):
        raise TypeError(f"{task!r} is not a SingletonTask")
    return task.lock_name(args, kwargs)


def _holder(task: SingletonTask, state: str, node: str) -> dict[str, str]:
    return {
        "task": task.name[:200],
        "state": state,
        "node": node,
        "pid": "0",
        "since": since_now(),
    }


@contextmanager
def hold_lock(task: SingletonTask, /, *args: Any, **kwargs: Any) -> Iterator[RedisLock]:
    """Hold the lock of the call ``task(*args, **kwargs)`` while the block runs, as
    another execution of the task would (a holder with a task id of its own).

    Inside the block a duplicate meets the task's ``on_conflict`` (an
    ``until_executed`` task's ``delay()`` returns the holder's ``AsyncResult``).
    The lock is renewed while held and released when the block ends. Yields
    the :class:`RedisLock` (its ``lease`` is the holder's task id).
    """
    name = _call_lock(task, args, kwargs)
    options = task.lock_options
    lock = RedisLock(
        task.lock_client,
        name,
        ttl=options.ttl,
        lease=f"held-by-test-{secrets.token_hex(6)}",
        holder_info=_holder(task, "running", "test@hold_lock"),
        prefix=options.prefix,
    )
    if not lock.acquire(blocking=False):
        raise AssertionError(f"lock {name!r} is already held by {lock.blocked_by!r}")
    try:
        yield lock
    finally:
        if lock.holding:
            try:
                lock.release()
            except Exception:  # lost or stolen in the block: nothing left to free
                lock.detach()


def leave_stale_lock(task: SingletonTask, /, *args: Any, ttl: float = 1.0, **kwargs: Any) -> str:
    """Leave the lock of ``task(*args, **kwargs)`` held as a crashed worker would:
    held by a task id nobody runs, never renewed, freed by its TTL after ``ttl``
    seconds (or by a release). Returns the lock name."""
    name = _call_lock(task, args, kwargs)
    lock = RedisLock(
        task.lock_client,
        name,
        ttl=ttl,
        lease=f"crashed-{secrets.token_hex(6)}",
        heartbeat=False,
        holder_info=_holder(task, "running", "crashed@leave_stale_lock"),
        prefix=task.lock_options.prefix,
    )
    if not lock.acquire(blocking=False):
        raise AssertionError(f"lock {name!r} is already held by {lock.blocked_by!r}")
    lock.detach()
    return name


def wait_for_lock(
    task: SingletonTask, /, *args: Any, timeout: float = 10.0, **kwargs: Any
) -> LockInfo:
    """Wait until the lock of ``task(*args, **kwargs)`` is held, and return it as
    ``celery redislock show`` sees it (``.holder``, ``.state``, ``.node``…).

    Raises:
        AssertionError: it was not held within ``timeout`` seconds.
    """
    name = _call_lock(task, args, kwargs)
    client, prefix = task.lock_client, task.lock_options.prefix
    deadline = time.monotonic() + timeout
    while True:
        info = read_lock(client, name, prefix)
        if info is not None:
            return info
        if time.monotonic() >= deadline:
            raise AssertionError(f"lock {name!r} was not taken within {timeout:g} s")
        time.sleep(0.01)


@contextmanager
def steal_lock(task: SingletonTask, /, *args: Any, **kwargs: Any) -> Iterator[RedisLock]:
    """Take the lock of a running call ``task(*args, **kwargs)`` away from it, as if it
    had expired and another holder had taken it, while the block runs.

    The running execution's lock is lost from then on: its ``self.lock.lost`` is
    true and ``self.lock.check()`` raises :class:`~celery_redislock.LockLostError`
    — at once when it runs in this process (a :func:`run_worker` worker), at its
    next renewal (within ``lock_ttl / 3``) in another one. The new hold has a newer
    fencing token (the yielded lock's ``token``) and is released when the block
    ends.

    Raises:
        AssertionError: nobody holds that lock.
    """
    name = _call_lock(task, args, kwargs)
    options = task.lock_options
    client = task.lock_client
    probe = RedisLock(client, name, heartbeat=False, prefix=options.prefix)
    held = probe._read()
    victim = held.get(LEASE_FIELD) if OWNER_FIELD in held else None
    if victim is None:
        raise AssertionError(f"lock {name!r} is not held by a task: nothing to steal")
    # Handed over in the holder's name: the script takes it over atomically, with a
    # new fence, and no waiter can slip in between.
    thief = RedisLock(
        client,
        name,
        ttl=options.ttl,
        lease=victim,
        holder_info=_holder(task, "running", "test@steal_lock"),
        prefix=options.prefix,
    )
    thief._handed_from = held[OWNER_FIELD]
    if not thief.acquire(blocking=False):
        raise AssertionError(f"could not take lock {name!r} over from {victim!r}")
    beat = get_heartbeat()
    # A holder in this process learns at once: renewing it now finds it taken.
    beat.renew([lock for lock in beat.held() if lock.key == thief.key and lock is not thief])
    try:
        yield thief
    finally:
        if thief.holding:
            try:
                thief.release()
            except Exception:
                thief.detach()


def assert_no_locks(client: Client, prefix: str = DEFAULT_PREFIX, timeout: float = 2.0) -> None:
    """Fail unless, within ``timeout`` seconds, no lock under ``prefix`` is held and no
    waiter is queued (releases at the end of a task may land just after its result)."""
    deadline = time.monotonic() + timeout
    while True:
        held: list[LockInfo] = list_locks(client, "*", prefix)
        queues = sorted(
            key.decode() if isinstance(key, bytes) else str(key)
            for key in client.scan_iter(f"{glob_escape(prefix)}:{{*}}:waiters", count=1000)
        )
        if not held and not queues:
            return
        if time.monotonic() >= deadline:
            lines = [
                f"{info.name} (holder {info.holder}, {info.state or 'no state'})" for info in held
            ]
            lines += [f"{queue} (waiters queued)" for queue in queues]
            raise AssertionError("locks left behind:\n  " + "\n  ".join(lines))
        time.sleep(0.02)
