"""The acquire written as the worker accepts a task (celery_redislock.early): the
engine's two halves, and SingletonTask on the pools that run a task in the
accepting thread."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded, Terminated, WorkerLostError
from billiard.pool import SIG_SOFT_TIMEOUT, soft_timeout_sighandler
from celery import Celery
from celery import signals as celery_signals
from celery.app.trace import build_tracer
from celery.contrib.testing.mocks import TaskMessage
from celery.exceptions import Reject
from celery.worker.state import task_ready

from celery_redislock import LockBackendError, RedisLock, SingletonTask, signals
from celery_redislock.early import (
    Request,
    _comes_back,
    _process_gone,
    _requeued_on_timeout,
    trace_ahead,
)
from celery_redislock.heartbeat import Heartbeat
from celery_redislock.lock import lock_keys
from celery_redislock.scripts import LEASE_FIELD, OWNER_FIELD
from celery_redislock.server import RedisServer
from celery_redislock.task import _shown, _written_ahead, queued_owner
from celery_redislock.transport import transport_for
from tests.proxy import FaultProxy
from tests.support import (
    CELERY_5_7,
    client_left_clean,
    close_app,
    field,
    gate,
    held,
    hold_count,
    in_process_worker,
    make_app,
    record,
    runs,
    wait_for,
    wait_until,
)

TIMEOUT = 20

# Some tasks here use Celery's own request class on purpose, which warns.
pytestmark = pytest.mark.filterwarnings("ignore::celery_redislock.task.RequestClassWarning")


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the lock database; each test must leave no lock behind."""
    with client_left_clean(redislock_server) as client:
        yield client


def sends(lock: RedisLock) -> int:
    """Requests written so far on the transport of ``lock``."""
    return lock.transport.sends


class TestEngine:
    """RedisLock._send_acquire writes the acquire; _acquire_sent reads and keeps its reply."""

    def test_written_ahead_and_read_later_is_one_round_trip(self, locks: redis.Redis) -> None:
        """The hold is made on the server before its reply is read, and reading it
        writes nothing more."""
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=30)
        ahead = lock._send_acquire()
        assert ahead is not None
        written = sends(lock)
        assert wait_until(lambda: held(locks, lock.key))
        assert lock._acquire_sent(ahead)
        assert sends(lock) == written
        assert lock.token is not None
        assert lock.owned()
        lock.release()

    def test_its_connection_waits_for_the_read_while_others_are_used(
        self, locks: redis.Redis
    ) -> None:
        """Requests made between the write and the read (another lock's, in the
        same thread) go on other connections: the reply waits on its own one, which
        is given back once it is read."""
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=30)
        other = RedisLock(locks, uuid.uuid4().hex, ttl=30)
        assert lock.transport is other.transport
        ahead = lock._send_acquire()
        assert ahead is not None
        link = ahead.link
        assert other.acquire(blocking=False)
        other.release()
        assert link not in lock.transport._idle
        written = sends(lock)
        assert lock._acquire_sent(ahead)
        assert sends(lock) == written
        assert link in lock.transport._idle
        assert other.token is not None
        assert lock.token is not None
        lock.release()

    def test_held_by_another_reports_the_holder(self, locks: redis.Redis) -> None:
        name = uuid.uuid4().hex
        holder = RedisLock(locks, name, ttl=30, lease="task-1")
        assert holder.acquire(blocking=False)
        lock = RedisLock(locks, name, ttl=30)
        ahead = lock._send_acquire()
        assert ahead is not None
        assert not lock._acquire_sent(ahead)
        assert lock.blocked_by == "task-1"
        holder.release()

    def test_a_server_that_lost_its_scripts_runs_it_again(
        self, locks: redis.Redis, redislock_server: RedisServer
    ) -> None:
        """A NOSCRIPT reply (the server flushed its scripts) means it did not run:
        the acquire goes again, by text."""
        warm = RedisLock(locks, uuid.uuid4().hex, ttl=30)
        assert warm.acquire(blocking=False)
        warm.release()
        redislock_server.client().script_flush()
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=30)
        ahead = lock._send_acquire()
        assert ahead is not None
        assert lock._acquire_sent(ahead)
        assert hold_count(locks, lock.key) == 1
        lock.release()

    def test_a_lost_reply_is_asked_again_and_counts_once(
        self, redislock_server_factory: Callable[..., RedisServer]
    ) -> None:
        """The acquire ran but its reply was lost with the connection: asked again
        with the same request id, it is recognised, so the hold counts once."""
        server = redislock_server_factory()
        direct = server.client()
        with FaultProxy(server.host, server.port) as proxy:
            lock = RedisLock(proxy.url, uuid.uuid4().hex, ttl=30)
            assert lock.acquire(blocking=False)  # opens the connection
            lock.release()
            proxy.drop_replies(1)
            ahead = lock._send_acquire()
            assert ahead is not None
            assert lock._acquire_sent(ahead)
            assert lock.token is not None
            assert hold_count(direct, lock.key) == 1
            lock.release()
            assert not held(direct, lock.key)
        direct.close()

    def test_a_reply_read_later_than_call_timeout_is_still_read(self, locks: redis.Redis) -> None:
        """The caller's own work between the write and the read (a slow
        ``task_prerun`` receiver) does not count against the server: the reply,
        in long since, is read, not taken for a timeout."""
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=30, call_timeout=0.3)
        assert lock.acquire(blocking=False)  # opens the connection
        lock.release()
        ahead = lock._send_acquire()
        assert ahead is not None
        time.sleep(0.5)
        assert lock._acquire_sent(ahead)
        assert hold_count(locks, lock.key) == 1
        lock.release()

    def test_a_stalled_server_costs_one_call_timeout(
        self, redislock_server_factory: Callable[..., RedisServer]
    ) -> None:
        """The acquire's tries share one ``call_timeout`` from its write: when the
        answer never came in time, it is not written again with a fresh one."""
        server = redislock_server_factory()
        lock = RedisLock(server.url, uuid.uuid4().hex, ttl=30, call_timeout=0.5)
        assert lock.acquire(blocking=False)  # opens the connection
        lock.release()
        with server.paused():
            ahead = lock._send_acquire()
            assert ahead is not None
            written = sends(lock)
            with pytest.raises(LockBackendError, match=r"timed out|no time left"):
                lock._acquire_sent(ahead)
            assert sends(lock) == written

    def test_abandoned_gives_the_hold_back(self, locks: redis.Redis) -> None:
        """An acquire written for a task that never started is given back, not left to its TTL."""
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=60)
        ahead = lock._send_acquire()
        assert ahead is not None
        ahead.abandon()
        assert not lock.owned()
        assert wait_until(lambda: not held(locks, lock.key))
        # Claimed once: finishing it afterwards is no longer possible.
        assert not ahead.claim()

    def test_a_reply_read_late_is_renewed_an_interval_after_it_was_written(
        self, locks: redis.Redis
    ) -> None:
        """The hold a written-ahead acquire made ages from the moment it was written:
        read late, it is renewed an interval after it was written (at once, when that
        has passed), not an interval after the read, by when its TTL could have run
        out on the server."""
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=6)  # renewed every 2 s
        ahead = lock._send_acquire()
        assert ahead is not None
        time.sleep(3)
        assert lock._acquire_sent(ahead)
        # Renewed within 1.6 s of the read: not the 2 s after it a late renewal takes.
        assert wait_until(lambda: locks.pttl(lock.key) > 5_000, timeout=1.6)
        lock.release()

    def test_a_reply_read_after_its_ttl_is_left_to_the_caller(self, locks: redis.Redis) -> None:
        """A written-ahead acquire whose reply is read only once the hold's TTL has
        passed (counted from when it was written) is taken but lost as it is read,
        and left to its caller (the task gives it back and asks anew): it is not put
        on the heartbeat, so neither renewed nor reported lost through ``on_lost``,
        even after a later renewal round on the same server."""
        beat = Heartbeat()
        reported: list[RedisLock] = []
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=0.3, on_lost=reported.append, _heartbeat=beat)
        witness = RedisLock(
            locks, uuid.uuid4().hex, ttl=30, heartbeat_interval=0.05, _heartbeat=beat
        )
        try:
            ahead = lock._send_acquire()
            assert ahead is not None
            time.sleep(0.5)  # the hold's TTL runs out before its reply is read
            assert lock._acquire_sent(ahead)
            assert lock.lost
            assert lock not in beat.held()
            assert witness.acquire(blocking=False)
            first = witness._expiry
            wait_for(lambda: witness._expiry > first, what="the witness lock's first renewal")
            assert reported == []
            assert lock not in beat.held()
            lock.release(wait=False)
        finally:
            if witness.owned():
                witness.release()
            beat.stop()
        assert wait_until(lambda: not held(locks, lock.key))

    def test_not_written_ahead_when_replicas_must_confirm(self, locks: redis.Redis) -> None:
        lock = RedisLock(locks, uuid.uuid4().hex, ttl=30, min_replicas=1)
        assert lock._send_acquire() is None


# -- SingletonTask on a worker ---------------------------------------------------


class _Wrapped(SingletonTask):
    """A task class with a __call__ of its own."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


class _FailingStart(SingletonTask):
    """A task class whose start fails before the task is called."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        raise RuntimeError("start failed")


#: How many times _PutBackStart put each task id's message back.
_PUT_BACK: dict[str, int] = {}


class _PutBackStart(SingletonTask):
    """A task class whose start (a resource not ready yet) sends the message back
    before the task is called: once with ``Reject(requeue=True)``, or twice as its
    retry (``retry_start``). It waits first for gate ``<argument>:behind``, which
    the test opens once it has queued what the message must come back behind."""

    retry_start = False

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        done = _PUT_BACK.get(task_id, 0)
        if done == (2 if self.retry_start else 1):
            return
        _PUT_BACK[task_id] = done + 1
        gate(f"{args[0]}:behind").wait(TIMEOUT)
        if self.retry_start:
            raise self.retry(countdown=0)
        raise Reject("not yet", requeue=True)


@pytest.fixture(scope="module", params=["solo", "threads"])
def app(request: pytest.FixtureRequest, redislock_server: RedisServer) -> Iterator[Celery]:
    """An app whose tasks run on an in-process worker of the pool given."""
    app = make_app(redislock_server.url, f"early-{request.param}")

    @app.task(base=SingletonTask, shared=False, name="early.plain")
    def plain(name: str) -> str:
        return name

    @app.task(base=_Wrapped, shared=False, name="early.wrapped")
    def wrapped(name: str) -> str:
        return name

    @app.task(base=_Wrapped, shared=False, name="early.wrapped_wait", on_conflict="wait")
    def wrapped_wait(name: str) -> str:
        return name

    @app.task(
        base=SingletonTask,
        shared=False,
        name="early.own_request",
        Request="celery.worker.request:Request",
    )
    def own_request(name: str) -> str:
        return name

    @app.task(base=_FailingStart, shared=False, name="early.failing", lock_ttl=60)
    def failing(name: str) -> str:
        return name

    @app.task(
        base=_FailingStart,
        shared=False,
        name="early.failing_ue",
        lock_ttl=60,
        lock_strategy="until_executed",
    )
    def failing_ue(name: str) -> str:
        return name

    put_back_options: list[tuple[str, dict[str, Any]]] = [
        ("early.reject_ue", {"acks_late": True}),
        ("early.retry_ue", {"retry_start": True}),
        # Nothing written ahead (as on the prefork pool): only the reservation.
        ("early.reject_ue_own", {"acks_late": True, "Request": "celery.worker.request:Request"}),
        ("early.retry_ue_own", {"retry_start": True, "Request": "celery.worker.request:Request"}),
    ]
    for name, options in put_back_options:

        @app.task(
            base=_PutBackStart,
            shared=False,
            name=name,
            lock_on=("arg",),
            lock_ttl=60,
            lock_strategy="until_executed",
            **options,
        )
        def put_back(arg: str, _kind: str = name) -> str:
            record(_kind, arg)
            return arg

    @app.task(shared=False, name="early.occupy", acks_late=True)
    def occupy(name: str) -> str:
        """Holds the worker's one slot until the test opens gate ``name`` (at most 20 s)."""
        record("early.occupy", name)
        gate(name).wait(TIMEOUT)
        return name

    @app.task(base=SingletonTask, shared=False, name="early.short", lock_ttl=1)
    def short(name: str) -> str:
        return name

    with in_process_worker(app, pool=request.param):
        yield app
    close_app(app)


@pytest.fixture
def at_start(app: Celery, locks: redis.Redis) -> Iterator[dict[str, Any]]:
    """What each task saw as it started (``task_prerun``, just before it is called):
    whether an acquire was written ahead for it, and whether its lock was held by then."""
    seen: dict[str, Any] = {}

    def started(sender: Any = None, task_id: str = "", **_: Any) -> None:
        written = _written_ahead.get(threading.get_ident())
        ahead = written is not None and written.task_id == task_id
        seen["ahead"] = ahead
        if ahead:
            key = lock_keys(sender.lock_name(sender.request.args, sender.request.kwargs)).lock
            seen["held"] = wait_until(lambda: field(locks, key, LEASE_FIELD) == task_id, timeout=5)

    celery_signals.task_prerun.connect(started, weak=False)
    yield seen
    celery_signals.task_prerun.disconnect(started)


def test_lock_is_taken_before_the_task_is_called(app: Celery, at_start: dict[str, Any]) -> None:
    assert app.tasks["early.plain"].delay("a").get(timeout=TIMEOUT) == "a"
    assert at_start == {"ahead": True, "held": True}


def test_a_call_of_its_own_acquires_as_the_task_starts(
    app: Celery, at_start: dict[str, Any]
) -> None:
    """A subclass's __call__ might never start the locked execution: nothing is
    written ahead for it."""
    assert app.tasks["early.wrapped"].delay("b").get(timeout=TIMEOUT) == "b"
    assert at_start == {"ahead": False}


@pytest.mark.parametrize(("name", "at_once"), [("early.wrapped", 1), ("early.wrapped_wait", 0)])
def test_an_acquire_made_as_the_task_starts_is_read_at_once_unless_it_may_wait(
    app: Celery, at_start: dict[str, Any], monkeypatch: pytest.MonkeyPatch, name: str, at_once: int
) -> None:
    """A task nothing was written ahead for (here one with a __call__ of its own, as
    a prefork pool process's) writes its acquire and reads the reply at once, as
    one written ahead is read, not through the general path; it takes that path
    only when it may wait for the lock (``on_conflict="wait"``), whose first try
    queues if the lock is held. Both run as they are: the calls are only counted."""
    calls = {"at once": 0, "general": 0}
    at_once_of, general_of = RedisLock._acquire_at_once, RedisLock._acquire

    def counted_at_once(lock: RedisLock) -> bool | None:
        calls["at once"] += 1
        return at_once_of(lock)

    def counted_general(lock: RedisLock, *args: Any, **kwargs: Any) -> bool:
        calls["general"] += 1
        return general_of(lock, *args, **kwargs)

    monkeypatch.setattr(RedisLock, "_acquire_at_once", counted_at_once)
    monkeypatch.setattr(RedisLock, "_acquire", counted_general)
    assert app.tasks[name].delay(name).get(timeout=TIMEOUT) == name
    assert at_start == {"ahead": False}
    assert calls == {"at once": at_once, "general": 1 - at_once}


def test_a_request_class_of_its_own_acquires_as_the_task_starts(
    app: Celery, at_start: dict[str, Any]
) -> None:
    """Only a request class derived from celery_redislock.early.Request writes ahead."""
    assert app.tasks["early.own_request"].delay("e").get(timeout=TIMEOUT) == "e"
    assert at_start == {"ahead": False}


def test_a_task_that_never_starts_gives_its_lock_back(app: Celery, locks: redis.Redis) -> None:
    """Its start failed before it was called: the hold written ahead is given back
    as the failure is recorded (the lock's TTL is a minute; ``locks`` waits 10 s)."""
    with pytest.raises(RuntimeError, match="start failed"):
        app.tasks["early.failing"].delay("c").get(timeout=TIMEOUT)


@pytest.mark.parametrize("name", ["early.failing", "early.failing_ue"])
def test_a_task_whose_start_failed_has_its_lock_free_once_its_failure_is_seen(
    app: Celery, locks: redis.Redis, name: str
) -> None:
    """``before_start`` raised, so the task was never called: the hold written
    ahead (and an until_executed message's reservation) is given back before the
    tracer stores the failure, so a client that sees the failure finds the key
    free, and sending the task again sends it. (A ``task_failure`` receiver, which
    runs once the failure is stored, keeps the worker from going on until the test
    has looked.)"""
    task = app.tasks[name]
    arg = uuid.uuid4().hex
    key = lock_keys(task.lock_name((arg,), {})).lock
    looked = threading.Event()

    def slow_report(sender: Any = None, **_: Any) -> None:
        if sender is task:
            looked.wait(TIMEOUT)

    celery_signals.task_failure.connect(slow_report, weak=False)
    try:
        result = task.delay(arg)
        with pytest.raises(RuntimeError, match="start failed"):
            result.get(timeout=TIMEOUT)
        holder = field(locks, key, LEASE_FIELD)
        again = task.delay(arg)
    finally:
        looked.set()
        celery_signals.task_failure.disconnect(slow_report)
    assert holder is None
    assert again.id != result.id
    with pytest.raises(RuntimeError, match="start failed"):
        again.get(timeout=TIMEOUT)


@pytest.mark.parametrize(
    "name", ["early.reject_ue", "early.retry_ue", "early.reject_ue_own", "early.retry_ue_own"]
)
def test_a_message_its_start_sent_back_keeps_its_reservation(
    app: Celery, locks: redis.Redis, name: str
) -> None:
    """``Reject(requeue=True)`` from ``before_start`` of an acks_late until_executed
    task, or ``self.retry()`` from it: the hold written ahead (or, with nothing
    written ahead, the message's own reservation) goes to the reservation of the
    message that comes back, as from the body, so a duplicate sent while that
    message waits in the queue publishes nothing. The message then runs once (a
    retry's retry, sent back again, too: not held up by its own reservation)."""
    task = app.tasks[name]
    arg = uuid.uuid4().hex
    key = lock_keys(task.lock_name((arg,), {})).lock
    result = task.delay(arg)
    # The message comes back behind this one, which holds the worker's only slot.
    app.tasks["early.occupy"].delay(arg)
    gate(f"{arg}:behind").set()
    try:
        wait_for(lambda: arg in runs("early.occupy"), timeout=TIMEOUT, what="the slot taken")
        assert _PUT_BACK.get(result.id) == 1
        assert arg not in runs(name)
        owner = field(locks, key, OWNER_FIELD)
        duplicate = task.delay(arg)
    finally:
        gate(arg).set()
    retries = 1 if "retry" in name else 0
    assert owner == queued_owner(result.id, retries)
    assert duplicate.id == result.id
    assert result.get(timeout=TIMEOUT) == arg
    assert runs(name).count(arg) == 1
    assert _PUT_BACK[result.id] == (2 if retries else 1)


def test_a_duplicate_found_ahead_is_still_a_conflict(app: Celery, locks: redis.Redis) -> None:
    name = uuid.uuid4().hex
    task = app.tasks["early.plain"]
    holder = RedisLock(locks, task.lock_name((name,), {}), ttl=30)
    assert holder.acquire(blocking=False)
    result = task.delay(name).get(timeout=TIMEOUT)
    assert result["skipped"] is True
    holder.release()


def test_a_hold_written_ahead_that_expired_before_the_task_started_is_asked_for_anew(
    app: Celery, locks: redis.Redis
) -> None:
    """Work between the worker's accept and the task's start (a slow ``task_prerun``
    receiver) that outlasts the lock's TTL: the hold written ahead expired meanwhile
    and another took the lock. The task does not run on that stale answer: it asks
    again, and meets the other holder as any duplicate does."""
    name = uuid.uuid4().hex
    task = app.tasks["early.short"]
    rival = RedisLock(locks, task.lock_name((name,), {}), ttl=30)

    def slow_start(sender: Any = None, args: Any = (), **_: Any) -> None:
        if sender is task and list(args) == [name]:
            # The hold written ahead (a TTL of 1 s, not yet renewed) runs out.
            assert wait_until(lambda: rival.acquire(blocking=False), timeout=10)

    lost: list[Any] = []

    def on_lost(sender: Any = None, **fields: Any) -> None:
        lost.append(fields)

    celery_signals.task_prerun.connect(slow_start, weak=False)
    signals.lock_lost.connect(on_lost, weak=False, dispatch_uid="written-ahead-expired")
    try:
        result = task.delay(name).get(timeout=TIMEOUT)
    finally:
        celery_signals.task_prerun.disconnect(slow_start)
    try:
        assert result["skipped"] is True
        assert rival.owned()
        # The stale hold was given back, not reported lost: the task never ran under it.
        assert lost == []
    finally:
        signals.lock_lost.disconnect(on_lost, dispatch_uid="written-ahead-expired")
        rival.release()


def test_prefork_parent_writes_nothing(app: Celery, locks: redis.Redis) -> None:
    """The prefork pool reports the child that runs the task: the accepting parent
    writes no acquire (the child acquires as the task starts)."""
    task = app.tasks["early.plain"]
    message = TaskMessage(task.name, args=("d",))
    request = Request(message, app=app, task=task)
    written = transport_for(task.lock_client).sends
    request.on_accepted(os.getpid() + 1, time.monotonic())
    task_ready(request)
    assert threading.get_ident() not in _written_ahead
    assert transport_for(task.lock_client).sends == written


def test_accepted_here_writes_it_and_a_failure_gives_it_back(
    app: Celery, locks: redis.Redis
) -> None:
    task = app.tasks["early.plain"]
    name = uuid.uuid4().hex
    request = Request(TaskMessage(task.name, args=(name,)), app=app, task=task)
    request.on_accepted(os.getpid(), time.monotonic())
    task_ready(request)
    assert _written_ahead[threading.get_ident()].task_id == request.id
    key = lock_keys(task.lock_name((name,), {})).lock
    assert wait_until(lambda: held(locks, key))
    request._give_back()
    assert threading.get_ident() not in _written_ahead
    assert wait_until(lambda: not held(locks, key))


def test_an_acquire_its_task_never_read_is_given_back_at_the_next(
    app: Celery, locks: redis.Redis
) -> None:
    """A thread runs one task at a time: an acquire still unread when the thread
    accepts its next task belongs to a task that never started, and is given back."""
    task = app.tasks["early.plain"]
    names = [uuid.uuid4().hex, uuid.uuid4().hex]
    requests = [Request(TaskMessage(task.name, args=(n,)), app=app, task=task) for n in names]
    keys = [lock_keys(task.lock_name((n,), {})).lock for n in names]
    for request in requests:
        request.on_accepted(os.getpid(), time.monotonic())
        task_ready(request)
    assert wait_until(lambda: not held(locks, keys[0]))
    assert wait_until(lambda: held(locks, keys[1]))
    # The first one's failure, recorded late, leaves the second one's acquire alone.
    requests[0]._give_back()
    assert _written_ahead[threading.get_ident()].task_id == requests[1].id
    assert held(locks, keys[1])
    requests[1]._give_back()
    assert wait_until(lambda: not held(locks, keys[1]))


def test_a_task_the_tracer_skips_gives_its_lock_back(app: Celery, locks: redis.Redis) -> None:
    """The tracer may end a task as a success without calling it (a redelivered task
    already done, with ``worker_deduplicate_successful_tasks``): the hold written
    ahead is given back as the success is recorded."""
    task = app.tasks["early.plain"]
    name = uuid.uuid4().hex
    request = Request(TaskMessage(task.name, args=(name,)), app=app, task=task)
    request.on_accepted(os.getpid(), time.monotonic())
    task_ready(request)
    key = lock_keys(task.lock_name((name,), {})).lock
    assert wait_until(lambda: held(locks, key))
    request.on_success((False, None, 0.0))
    assert threading.get_ident() not in _written_ahead
    assert wait_until(lambda: not held(locks, key))


@pytest.fixture
def pool_app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app as a prefork pool process has it once Celery has built its tasks'
    tracers (``__trace__``), and before ``worker_process_init``; nothing runs it."""
    app = make_app(redislock_server.url, "early-pool")
    options: dict[str, Any] = {"shared": False, "ignore_result": True, "lock_ttl": 60}
    app.task(base=SingletonTask, name="pool.plain", **options)(_echo)
    app.task(base=_Wrapped, name="pool.wrapped", **options)(_echo)
    until = {"lock_strategy": "until_executed", **options}
    app.task(base=SingletonTask, name="pool.until", **until)(_echo)
    app.task(base=SingletonTask, name="pool.until_late", acks_late=True, **until)(_echo)
    app.task(
        base=SingletonTask, name="pool.until_requeued", acks_late=True,
        reject_on_worker_lost=True, **until,
    )(_echo)  # fmt: skip
    app.task(base=SingletonTask, name="pool.executing", lock_strategy="until_executing", **options)(
        _echo
    )
    app.task(shared=False, name="pool.celery", ignore_result=True)(_echo)
    for task in app.tasks.values():
        task.__trace__ = build_tracer(task.name, task, app=app, hostname=POOL_NODE)
    yield app
    close_app(app)


#: The node name the tracers of ``pool_app`` are built for.
POOL_NODE = "pool@test"


def _echo(name: str) -> str:
    return name


def handed(task_name: str, name: str) -> tuple[str, dict[str, Any]]:
    """A task id, and what a prefork pool process hands the tracer of ``task_name``
    with it (``fast_trace_task``'s request) for a call with argument ``name``."""
    task_id = str(uuid.uuid4())
    request = {
        "id": task_id, "task": task_name, "hostname": POOL_NODE, "delivery_info": {},
        "args": (name,), "kwargs": {}, "is_eager": False,
    }  # fmt: skip
    return task_id, request


def test_a_pool_process_writes_a_while_executing_acquire_before_the_tracer(
    pool_app: Celery, locks: redis.Redis
) -> None:
    """At ``worker_process_init`` the tracer of each while_executing SingletonTask
    (and until_executed whose message Celery never delivers again once its pool
    process is lost: without ``acks_late``, or with it and no requeue) is made to
    write the acquire first: by ``task_prerun`` it is kept for the task (its lock
    held), and the task reads it as it starts, runs and releases. The others are
    left as they are."""
    trace_ahead(pool_app)
    wrapped = {n for n, t in pool_app.tasks.items() if hasattr(t.__trace__, "__wrapped__")}
    assert wrapped == {"pool.plain", "pool.until", "pool.until_late"}
    task = pool_app.tasks["pool.plain"]
    name = uuid.uuid4().hex
    key = lock_keys(task.lock_name((name,), {})).lock
    seen: dict[str, Any] = {}

    def started(sender: Any = None, task_id: str = "", **_: Any) -> None:
        written = _written_ahead.get(threading.get_ident())
        seen["written"] = written is not None and written.task_id == task_id
        seen["held"] = wait_until(lambda: field(locks, key, LEASE_FIELD) == task_id, timeout=5)

    celery_signals.task_prerun.connect(started, sender=task, weak=False)
    try:
        task_id, request = handed(task.name, name)
        outcome = task.__trace__(task_id, (name,), {}, request)
    finally:
        celery_signals.task_prerun.disconnect(started, sender=task)
    assert outcome[0] == name
    assert seen == {"written": True, "held": True}
    assert threading.get_ident() not in _written_ahead
    assert wait_until(lambda: not held(locks, key))
    # Made once per process: a second look wraps nothing again.
    trace_ahead(pool_app)
    assert not hasattr(task.__trace__.__wrapped__, "__wrapped__")
    # Another library's wrapper (functools.wraps) is no reason to leave a tracer be.
    other = pool_app.tasks["pool.until"]
    built = other.__trace__.__wrapped__

    @functools.wraps(built)
    def instrumented(*args: Any, **kwargs: Any) -> Any:
        return built(*args, **kwargs)

    other.__trace__ = instrumented
    trace_ahead(pool_app)
    assert other.__trace__.__wrapped__ is instrumented


def test_an_acquire_a_pool_process_wrote_for_a_task_its_tracer_never_calls_is_given_back(
    pool_app: Celery, locks: redis.Redis
) -> None:
    """The tracer may end a task without calling it (its setup failed, a redelivery
    of a task already done is skipped): the hold written ahead is given back as the
    tracer returns, not left for the lock's TTL (a minute)."""
    task = pool_app.tasks["pool.plain"]
    name = uuid.uuid4().hex
    key = lock_keys(task.lock_name((name,), {})).lock
    calls: list[str] = []

    def never_calls(task_id: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        calls.append(task_id)
        assert wait_until(lambda: held(locks, key))
        return None, None, None, None

    task.__trace__ = never_calls
    trace_ahead(pool_app)
    task_id, request = handed(task.name, name)
    task.__trace__(task_id, (name,), {}, request)
    assert calls == [task_id]
    assert threading.get_ident() not in _written_ahead
    assert wait_until(lambda: not held(locks, key), timeout=5)


def test_a_soft_time_limit_as_a_pool_process_writes_an_acquire_leaves_no_hold(
    pool_app: Celery, locks: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A soft time limit that strikes just after the acquire is written (kept for
    the task before it was written) ends the task with ``SoftTimeLimitExceeded``,
    its tracer never run, and the hold is given back: the limit is not swallowed
    as a failed write, and the hold not left for the lock's TTL."""
    task = pool_app.tasks["pool.plain"]
    name = uuid.uuid4().hex
    key = lock_keys(task.lock_name((name,), {})).lock
    calls: list[str] = []

    def tracer(task_id: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        calls.append(task_id)
        return None, None, None, None

    write_acquire = RedisLock._write_acquire

    def strikes_after_the_write(lock: RedisLock, ahead: Any) -> None:
        write_acquire(lock, ahead)
        os.kill(os.getpid(), SIG_SOFT_TIMEOUT)  # Celery's soft time limit
        # The handler runs in this thread before the loop ends.
        for _ in range(1000):
            pass

    task.__trace__ = tracer
    trace_ahead(pool_app)
    monkeypatch.setattr(RedisLock, "_write_acquire", strikes_after_the_write)
    previous = signal.signal(SIG_SOFT_TIMEOUT, soft_timeout_sighandler)
    try:
        task_id, request = handed(task.name, name)
        with pytest.raises(SoftTimeLimitExceeded):
            task.__trace__(task_id, (name,), {}, request)
    finally:
        signal.signal(SIG_SOFT_TIMEOUT, previous)
    assert calls == []
    assert threading.get_ident() not in _written_ahead
    assert wait_until(lambda: not held(locks, key), timeout=5)


def test_a_child_process_that_ended_is_seen_gone_before_it_is_reaped() -> None:
    """What the worker looks for after killing a pool process for its hard time
    limit: a child that has ended counts as gone even while it waits to be reaped
    (a zombie); one that runs does not."""
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert wait_until(lambda: _process_gone(ended.pid))
        assert ended.returncode is None  # not reaped yet
        assert not _process_gone(running.pid)
        assert not _process_gone(os.getpid())
    finally:
        running.kill()
        running.wait()
        ended.wait()


@pytest.mark.parametrize(
    ("options", "exc", "cancelled", "requeued"),
    [
        ({}, WorkerLostError(), False, False),
        ({"acks_late": True, "reject_on_worker_lost": True}, WorkerLostError(), False, True),
        (
            # (Celery 5.7 sends it again as a retry; before, the option is unknown.)
            {"acks_late": True, "reject_on_worker_lost": True, "retry_on_worker_lost": True},
            WorkerLostError(),
            False,
            not CELERY_5_7,
        ),
        ({"acks_late": True, "reject_on_worker_lost": True}, Terminated(), False, False),
        ({}, Terminated(), True, True),
        ({}, SystemExit(), True, True),
        ({}, SystemExit(), False, False),
    ],
    ids=[
        "lost",
        "lost-requeued",
        "lost-sent-as-a-retry",
        "revoked-and-terminated",
        "terminated-as-cancelled",
        "exit-as-cancelled",
        "exit",
    ],
)
def test_a_message_whose_pool_process_died_is_known_to_come_back_as_celery_decides(
    redislock_server: RedisServer,
    options: dict[str, Any],
    exc: BaseException,
    cancelled: bool,
    requeued: bool,
) -> None:
    """Whether a message whose pool process died before its start keeps its
    reservation (its delivery comes back and takes it over) follows Celery's own
    ``on_failure``: requeued with ``acks_late`` and ``reject_on_worker_lost`` (not
    when sent again as a retry, ``retry_on_worker_lost``), left unacked when the
    worker cancelled it as it lost its broker connection, and dropped when revoked
    and terminated."""
    app = make_app(redislock_server.url, "early-requeued")
    try:

        @app.task(base=SingletonTask, shared=False, name="early.requeued", **options)
        def job(name: str) -> str:
            return name

        request = Request(TaskMessage(job.name, args=("r",)), app=app, task=job)
        request._already_cancelled = cancelled
        assert request._requeued_when_lost(exc) is requeued
    finally:
        close_app(app)


@pytest.mark.parametrize(
    ("options", "cancels", "comes_back"),
    [
        ({}, False, False),
        ({}, True, False),
        ({"reject_on_worker_lost": True}, False, False),
        ({"acks_late": True}, False, False),
        ({"acks_late": True, "reject_on_worker_lost": True}, False, True),
        (
            # (Celery 5.7 sends it again as a retry; before, the option is unknown.)
            {"acks_late": True, "reject_on_worker_lost": True, "retry_on_worker_lost": True},
            False,
            not CELERY_5_7,
        ),
        (
            {"acks_late": True, "acks_on_timeout": False}
            if CELERY_5_7
            else {"acks_late": True, "acks_on_failure_or_timeout": False},
            False,
            True,
        ),
        ({"acks_late": True}, True, True),
    ],
    ids=[
        "acks-early",
        "acks-early-cancelled-on-connection-loss",
        "acks-early-rejected-when-lost",
        "acks-late",
        "requeued-when-lost",
        "sent-as-a-retry-when-lost",
        "requeued-on-its-time-limit",
        "cancelled-on-connection-loss",
    ],
)
def test_whether_a_message_may_come_back_once_its_pool_process_is_lost_decides_writing_ahead(
    redislock_server: RedisServer, options: dict[str, Any], cancels: bool, comes_back: bool
) -> None:
    """An until_executed task's pool process writes its acquire ahead (taking the
    send's reservation over before the task starts) only if Celery never delivers
    its message again once that process is lost: not ``acks_late``, or without a
    requeue when the process is lost (``reject_on_worker_lost``, unless Celery 5.7
    sends a retry instead) or killed for its time limit, and without
    ``worker_cancel_long_running_tasks_on_connection_loss`` (which cancels
    ``acks_late`` tasks only). A message that may come back keeps its reservation
    until a delivery starts."""
    app = make_app(redislock_server.url, "early-comes-back")
    app.conf.worker_cancel_long_running_tasks_on_connection_loss = cancels
    try:
        job = app.task(
            base=SingletonTask, shared=False, name="early.comes_back",
            lock_strategy="until_executed", **options,
        )(_echo)  # fmt: skip
        assert _comes_back(job) is comes_back
        job.__trace__ = build_tracer(job.name, job, app=app, hostname=POOL_NODE)
        trace_ahead(app)
        assert hasattr(job.__trace__, "__wrapped__") is not comes_back
    finally:
        close_app(app)


@pytest.mark.parametrize(
    ("options", "requeued"),
    [
        ({}, False),
        ({"acks_late": True}, False),
        ({"acks_late": True, "acks_on_timeout": False}, True),
        ({"acks_late": True, "acks_on_failure_or_timeout": False}, True),
    ],
    ids=["acks-early", "acks-late", "requeued", "requeued-by-the-older-setting"],
)
def test_a_message_killed_for_its_time_limit_is_known_to_come_back_as_celery_decides(
    redislock_server: RedisServer, options: dict[str, Any], requeued: bool
) -> None:
    """Celery requeues a message killed for its hard time limit only with
    ``acks_late`` and without ``acks_on_timeout`` (which falls back to
    ``acks_on_failure_or_timeout``): only then is its reservation kept."""
    app = make_app(redislock_server.url, "early-timeout")
    try:

        @app.task(base=SingletonTask, shared=False, name="early.timeout", **options)
        def job(name: str) -> str:
            return name

        assert _requeued_on_timeout(job) is requeued
    finally:
        close_app(app)


@pytest.mark.parametrize(
    "late", ["its own", "begun after it was seen gone", "its process id taken again"]
)
def test_the_second_look_frees_only_a_late_hold_of_the_dead_pool_process(
    app: Celery, locks: redis.Redis, monkeypatch: pytest.MonkeyPatch, late: str
) -> None:
    """The worker's second look for a hold of a pool process that died frees one
    the process asked for before it was seen gone (landed late), and leaves alone a
    hold with the same task id, node and process id that began after that, or
    while a live process has that id: a pool process started since, given the same
    id, running a delivery of the same message again."""
    monkeypatch.setattr("celery_redislock.early.LATE_REQUEST_WAIT", 0.0)
    task = app.tasks["early.plain"]
    name = uuid.uuid4().hex
    request = Request(TaskMessage(task.name, args=(name,)), app=app, task=task)
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        if late != "its process id taken again":
            process.kill()
            process.wait()
        request.on_accepted(process.pid, time.monotonic())
        seen_gone = time.time() - (10.0 if late == "begun after it was seen gone" else 0.0)
        time.sleep(0.01)  # (the hold begins after that, to the millisecond)
        hold = RedisLock(
            locks,
            task.lock_name((name,), {}),
            ttl=30,
            lease=request.id,
            heartbeat=False,
            holder_info={
                "task": task.name,
                "state": "running",
                "node": _shown(str(request.hostname)),
                "pid": str(process.pid),
                "since": f"{time.time() - (1.0 if late == 'its own' else 0.0):.3f}",
            },
        )
        assert hold.acquire(blocking=False)
        request._free_late_hold(seen_gone)
        assert held(locks, hold.key) is (late != "its own")
        hold.detach()
        locks.delete(hold.key)
    finally:
        # Out of the worker state on_accepted entered it in (this process's): an
        # in-process worker of a later test would list it among its active tasks.
        task_ready(request)
        process.kill()
        process.wait()
