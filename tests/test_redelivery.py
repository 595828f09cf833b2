"""A message delivered again while an earlier delivery of it holds its lock (same task
id, same lease): never run beside it, never dropped while the earlier one may be dead."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import RedisLock, SingletonTask, signals
from celery_redislock.lock import lock_keys
from celery_redislock.scripts import OWNER_FIELD
from celery_redislock.server import RedisServer
from celery_redislock.task import queued_owner
from tests.support import close_app, field, make_app, wait_for


@pytest.fixture
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app on the test server (tasks run eagerly through apply())."""
    app = make_app(redislock_server.url, "redelivery")
    yield app
    close_app(app)


@pytest.fixture
def conflicts() -> Iterator[list[tuple[str, str]]]:
    """The ``(task_id, action)`` of every ``lock_conflict`` sent meanwhile."""
    seen: list[tuple[str, str]] = []

    def receive(sender: Any, task_id: str, action: str, **_: Any) -> None:
        seen.append((task_id, action))

    signals.lock_conflict.connect(receive, weak=False)
    yield seen
    signals.lock_conflict.disconnect(receive)


@pytest.mark.parametrize("mode", ["skip", "raise", "retry", "wait"])
def test_a_copy_of_a_message_whose_first_delivery_renews_its_lock_is_dropped(
    app: Celery, redislock_client: redis.Redis, conflicts: list[tuple[str, str]], mode: str
) -> None:
    """Whatever ``on_conflict`` says, a copy of a running message (its holder alive,
    renewing the lock) does not run: it waits as long as the hold had left, then ends
    as ``IGNORED`` (nothing stored over the running one's state); the first delivery
    keeps its lock."""
    ran: list[bool] = []

    @app.task(base=SingletonTask, shared=False, on_conflict=mode, lock_ttl=1, lock_wait=0.2)
    def job() -> None:
        ran.append(True)

    first = RedisLock(redislock_client, job.lock_name((), {}), ttl=1, lease="message-1")
    assert first.acquire(blocking=False)
    try:
        result = job.apply(task_id="message-1")

        assert result.state == "IGNORED"
        assert ran == []
        assert first.owned()
        assert not first.lost
        assert ("message-1", "redelivered") in conflicts
    finally:
        first.release()


def test_a_copy_of_a_message_runs_once_its_first_delivery_releases(
    app: Celery, redislock_client: redis.Redis, conflicts: list[tuple[str, str]]
) -> None:
    """A copy that finds the first delivery's hold (or a retry whose predecessor has not
    released yet) waits for its release, then takes the lock and runs — even with
    ``on_conflict="skip"``."""
    tokens: list[int] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=30)
    def job(self: SingletonTask) -> str:
        tokens.append(self.lock.fence)
        return "ran"

    first = RedisLock(redislock_client, job.lock_name((), {}), ttl=30, lease="message-2")
    assert first.acquire(blocking=False)
    results: list[Any] = []
    copy = threading.Thread(target=lambda: results.append(job.apply(task_id="message-2")))
    copy.start()
    wait_for(lambda: ("message-2", "redelivered") in conflicts, what="the copy to wait")
    first.release()
    copy.join(30)

    assert [result.get() for result in results] == ["ran"]
    assert first.token is not None
    assert tokens[0] > first.token


def test_a_copy_of_a_message_whose_first_delivery_died_runs_once_the_hold_expires(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """The hold of a first delivery that died (nothing renews it) is waited out, not
    taken over: the copy runs once it has expired, and is not skipped."""

    tokens: list[int] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=30)
    def job(self: SingletonTask) -> str:
        tokens.append(self.lock.fence)
        return "ran"

    dead = RedisLock(redislock_client, job.lock_name((), {}), ttl=1, lease="m-3", heartbeat=False)
    assert dead.acquire(blocking=False)

    result = job.apply(task_id="m-3")

    assert result.get() == "ran"
    # Taking a hold over hands out the next token; a name whose key expired has its
    # counter seeded anew from the server clock (in microseconds, a second on).
    assert dead.token is not None
    assert tokens[0] > dead.token + 1


def test_a_reservation_of_the_message_is_taken_over_at_once(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """The lock an ``until_executed`` send took (its reservation, owner
    ``<task id>:queued``) is the message's own: its execution takes it over without
    waiting."""

    @app.task(base=SingletonTask, shared=False, lock_strategy="until_executed")
    def job() -> str:
        return "ran"

    name = job.lock_name((), {})
    reserved = RedisLock(
        redislock_client, name, ttl=30, owner=queued_owner("message-4"), lease="message-4"
    )
    assert reserved.acquire(blocking=False)
    assert field(redislock_client, lock_keys(name).lock, OWNER_FIELD) == queued_owner("message-4")

    assert job.apply(task_id="message-4").get() == "ran"
    assert not reserved.owned()


def test_a_send_with_the_id_of_a_running_until_executed_task_publishes_nothing(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """Sending a message with the task id of an ``until_executed`` execution that
    still runs (not its own retry) returns that task's result and sends nothing:
    the running execution keeps its lock."""
    release = threading.Event()

    @app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed")
    def job(self: SingletonTask) -> str:
        release.wait(30)
        return "ran"

    results: list[Any] = []
    running = threading.Thread(target=lambda: results.append(job.apply(task_id="message-5")))
    running.start()
    key = lock_keys(job.lock_name((), {})).lock
    wait_for(lambda: field(redislock_client, key, "s") == "running", what="the execution")
    owner = field(redislock_client, key, OWNER_FIELD)

    again = job.apply_async(task_id="message-5")

    assert again.id == "message-5"
    assert field(redislock_client, key, OWNER_FIELD) == owner
    release.set()
    running.join(30)
    assert [result.get() for result in results] == ["ran"]


def test_a_second_send_of_a_queued_message_publishes_nothing(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """Sending an ``until_executed`` message again with the id of one still queued
    (its reservation holds the lock) is a duplicate: nothing is published, and the
    reservation keeps one hold, which revoking the message frees."""
    from celery_redislock.revoke import free_queued

    @app.task(base=SingletonTask, shared=False, lock_strategy="until_executed")
    def job() -> str:
        return "ran"

    name = job.lock_name((), {})
    key = lock_keys(name).lock
    first = job.apply_async(task_id="message-6")
    again = job.apply_async(task_id="message-6")

    assert again.id == first.id
    assert field(redislock_client, key, "n") is None  # one hold, not two
    assert free_queued(redislock_client, name, "message-6", "redislock")
    assert field(redislock_client, key, OWNER_FIELD) is None


def test_an_eager_retry_of_an_until_executed_task_is_handed_its_lock(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """``self.retry()`` of an ``until_executed`` task run eagerly (``apply()``, which
    runs the retry at once without sending it) hands the lock to the retry: it runs
    without waiting for the first execution's hold to expire."""
    tokens: list[int] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=20, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        tokens.append(self.lock.fence)
        if len(tokens) == 1:
            raise self.retry(countdown=0)
        return len(tokens)

    conflicts: list[str] = []

    def receive(sender: Any, action: str, **_: Any) -> None:
        conflicts.append(action)

    signals.lock_conflict.connect(receive, weak=False)
    try:
        assert job.apply(task_id="message-7").get() == 2
    finally:
        signals.lock_conflict.disconnect(receive)
    assert conflicts == []
    assert tokens[1] > tokens[0]


def test_a_waiting_copy_of_a_message_waits_as_long_as_the_hold_had_left(
    app: Celery, redislock_client: redis.Redis, conflicts: list[tuple[str, str]]
) -> None:
    """With ``on_conflict="wait"``, a copy of a running message does not wait
    ``lock_wait`` for its own task id: it reports ``redelivered``, not ``wait``."""

    @app.task(base=SingletonTask, shared=False, on_conflict="wait", lock_wait=20, lock_ttl=1)
    def job() -> None: ...

    first = RedisLock(redislock_client, job.lock_name((), {}), ttl=1, lease="message-8")
    assert first.acquire(blocking=False)
    try:
        assert job.apply(task_id="message-8").state == "IGNORED"
    finally:
        first.release()
    assert [action for task_id, action in conflicts if task_id == "message-8"] == ["redelivered"]


def test_a_retry_with_other_arguments_leaves_no_lock_behind(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """An ``until_executed`` task that retries with other arguments (another lock)
    hands its own lock to nobody: it is released, not left held for its TTL."""

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=60, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask, step: int) -> int:
        if step == 0:
            raise self.retry(args=(1,), countdown=0)
        return step

    assert job.apply((0,), task_id="message-9").get() == 1
    for step in (0, 1):
        assert (
            field(redislock_client, lock_keys(job.lock_name((step,), {})).lock, OWNER_FIELD) is None
        )
