"""A message delivered again while an earlier delivery of it holds its lock (same task
id, same lease): never run beside it, never dropped while the earlier one may be dead."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from celery.app.task import Context
from celery.exceptions import Ignore, Reject, Retry
from celery.signals import (
    before_task_publish,
    task_failure,
    task_postrun,
    task_retry,
    task_revoked,
)

from celery_redislock import RedisLock, SingletonTask, signals
from celery_redislock import lock as lock_module
from celery_redislock.admin import force_release
from celery_redislock.heartbeat import get_heartbeat
from celery_redislock.lock import lock_keys
from celery_redislock.scripts import OWNER_FIELD
from celery_redislock.server import RedisServer, free_port
from celery_redislock.task import (
    REDELIVERY_GRACE,
    LockHandle,
    free_queued,
    queued_owner,
    skipped_result,
)
from celery_redislock.transport import ATTEMPTS, flush
from tests.proxy import FaultProxy
from tests.support import (
    CELERY_5_7,
    close_app,
    field,
    in_process_worker,
    make_app,
    scheduled_copies,
    wait_for,
)
from tests.support import lock_keys as held_keys


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

    waits = {"lock_wait": 0.2} if mode == "wait" else {}

    @app.task(base=SingletonTask, shared=False, on_conflict=mode, lock_ttl=1, **waits)
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


@pytest.mark.parametrize("found", ["the reservation", "one made again"])
def test_a_reservation_found_in_place_of_its_executions_hold_is_freed_as_it_ends(
    app: Celery, redislock_client: redis.Redis, found: str
) -> None:
    """An ``until_executed`` execution takes its message's reservation over, and the
    store then loses the take-over, as the replica a failover promotes does when the
    take-over had not reached it: here the body puts the reservation back. As the
    execution ends, its release finds the reservation in place of its hold (the
    lock lost): it frees it, rather than leave it for ``lock_enqueue_ttl`` with
    every send of the call meanwhile returning this task's result. Only that
    reservation, tied to the fencing token the send gave it: one of the same owner
    token made again since, with another token, stays."""
    released: list[tuple[str, str]] = []
    runs: list[str] = []
    dumped: list[bytes] = []

    def receive(sender: Any, task_id: str, outcome: str, **_: Any) -> None:
        released.append((task_id, outcome))

    @app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed")
    def job(self: SingletonTask) -> str:
        runs.append(self.request.id)
        key, owner = lock_keys(self.lock.name).lock, queued_owner(self.request.id)
        if len(runs) > 1:
            return "again"
        if found == "the reservation":
            redislock_client.restore(key, 30_000, dumped[0], replace=True)
        else:
            redislock_client.delete(key)
            lease = self.request.id
            again = RedisLock(redislock_client, self.lock.name, ttl=30, owner=owner, lease=lease)
            assert again.acquire(blocking=False)
        assert field(redislock_client, key, OWNER_FIELD) == owner
        return "first"

    key = lock_keys(job.lock_name((), {})).lock
    signals.lock_released.connect(receive, weak=False)
    try:
        first = job.delay()
        reservation = redislock_client.dump(key)
        assert isinstance(reservation, bytes)
        dumped.append(reservation)
        with in_process_worker(app):
            assert first.get(timeout=15) == "first"
            wait_for(lambda: (first.id, "lost") in released, what="the release to find it lost")

            def freeing() -> list[Any]:
                """The reservation's free, while it waits to be sent."""
                lanes = get_heartbeat()._lanes.values()
                owner = queued_owner(first.id)
                return [p for lane in lanes for p in lane.pending if owner in p.call.args]

            wait_for(lambda: not freeing(), what="the reservation's free to land")
            if found == "the reservation":
                assert field(redislock_client, key, OWNER_FIELD) is None
                assert job.delay().get(timeout=15) == "again"
            else:
                assert field(redislock_client, key, OWNER_FIELD) == queued_owner(first.id)
    finally:
        signals.lock_released.disconnect(receive)


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


def test_a_retrys_reservation_goes_to_the_retry_not_to_a_copy_of_the_message(
    app: Celery, redislock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The reservation an ``until_executed`` task hands its lock to as it sends its
    retry is the retry's: a copy of the message's earlier delivery that finds it is
    dropped (``IGNORED``) without running, and the retry takes it over."""
    ran: list[int] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed")
    def job(self: SingletonTask) -> str:
        ran.append(self.request.retries)
        return "ran"

    name = job.lock_name((), {})
    reserved = RedisLock(
        redislock_client, name, ttl=30, owner=queued_owner("message-10", 1), lease="message-10"
    )
    assert reserved.acquire(blocking=False)

    with caplog.at_level("INFO", logger="celery_redislock.task"):
        assert job.apply(task_id="message-10").state == "IGNORED"
    assert "was sent again as its retry 1" in caplog.text
    assert reserved.owned()
    assert job.apply(task_id="message-10", retries=1).get() == "ran"
    assert ran == [1]
    assert not reserved.owned()
    assert field(redislock_client, lock_keys(name).lock, OWNER_FIELD) is None


def test_a_copy_of_a_message_whose_retry_runs_is_dropped_at_once(
    app: Celery, redislock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A copy of a message's earlier delivery that finds a later retry of the message
    running (its execution's hold) is dropped without waiting for it to end: the
    retry has taken the message's place."""

    @app.task(base=SingletonTask, shared=False, lock_ttl=30)
    def job() -> None: ...

    retry = RedisLock(
        redislock_client, job.lock_name((), {}), ttl=30, owner="runningretry:2", lease="m-11"
    )
    assert retry.acquire(blocking=False)
    results: list[Any] = []
    try:
        with caplog.at_level("INFO", logger="celery_redislock.task"):
            copy = threading.Thread(
                target=lambda: results.append(job.apply(task_id="m-11", retries=1))
            )
            copy.start()
            copy.join(10)  # the hold had 30 s left: a copy that waited would still wait
        assert not copy.is_alive()
        assert [result.state for result in results] == ["IGNORED"]
        assert "was sent again as its retry 2" in caplog.text
        assert retry.owned()
    finally:
        retry.release()


@pytest.mark.parametrize("other_lease", ["another-task", None], ids=["task", "no lease"])
def test_a_copy_meets_on_conflict_as_soon_as_another_task_takes_the_lock(
    app: Celery,
    redislock_client: redis.Redis,
    conflicts: list[tuple[str, str]],
    other_lease: str | None,
) -> None:
    """A copy waiting for its message's first delivery to end stops waiting once the
    lock goes to another owner (queued ahead of it): another task, or a lock without
    a lease on the same name. It meets ``on_conflict`` then, not at the end of the
    time the first hold had left."""

    @app.task(base=SingletonTask, shared=False, lock_ttl=30)
    def job() -> None: ...

    name = job.lock_name((), {})
    first = RedisLock(redislock_client, name, ttl=30, lease="m-12")
    assert first.acquire(blocking=False)
    other = RedisLock(redislock_client, name, ttl=30, lease=other_lease)
    queue = lock_keys(name).queue
    taken: list[bool] = []
    waiter = threading.Thread(target=lambda: taken.append(other.acquire(timeout=30)))
    waiter.start()
    wait_for(lambda: redislock_client.zcard(queue) == 1, what="the other task to queue")
    results: list[Any] = []
    copy = threading.Thread(target=lambda: results.append(job.apply(task_id="m-12")))
    copy.start()
    wait_for(lambda: redislock_client.zcard(queue) == 2, what="the copy to queue")
    try:
        first.release()
        waiter.join(10)
        copy.join(10)  # the first hold had 30 s left

        assert not copy.is_alive()
        assert taken == [True]
        assert [result.get() for result in results] == [skipped_result(name, other_lease)]
        assert ("m-12", "skip") in conflicts
    finally:
        other.release()
    assert redislock_client.zcard(queue) == 0


def test_a_copy_waiting_behind_a_task_that_retries_does_not_run_ahead_of_the_retry(
    app: Celery, redislock_client: redis.Redis, conflicts: list[tuple[str, str]]
) -> None:
    """A real worker runs an ``until_executed`` task; a copy of its message (same id,
    as a broker delivers it again) waits behind it. The task then retries with a
    countdown, handing its lock to the retry's reservation: the copy finds that and
    is dropped, instead of taking the reservation and running the message again
    ahead of the retry. The retry runs; nothing stays locked."""
    go = threading.Event()
    runs: list[int] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=2, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append(self.request.retries)
        if self.request.retries == 0:
            go.wait(30)
            # Longer than the copy waits before it looks again (the hold's TTL).
            raise self.retry(countdown=3)
        return len(runs)

    with in_process_worker(app, concurrency=2):
        result = job.delay()
        wait_for(lambda: runs == [0], what="the first delivery")
        app.send_task(job.name, task_id=result.id)
        wait_for(lambda: (result.id, "redelivered") in conflicts, what="the copy to wait")
        go.set()
        assert result.get(timeout=30) == 2

    assert runs == [0, 1]
    assert field(redislock_client, lock_keys(job.lock_name((), {})).lock, OWNER_FIELD) is None
    assert redislock_client.zcard(lock_keys(job.lock_name((), {})).queue) == 0


def test_a_renewal_after_the_hand_over_to_a_sent_retry_reports_no_loss(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """An ``until_executed`` task that sends its retry hands its hold to the retry's
    reservation: a renewal that comes after that, before the task has ended (here:
    as the retry is published), does not find the hold gone and report it lost."""
    holds: list[RedisLock] = []
    lost: list[str] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        if self.request.retries == 0:
            hold = self.lock._lock
            assert hold is not None
            holds.append(hold)
            raise self.retry(countdown=0)
        return int(self.request.retries)

    def publishing(**_: Any) -> None:
        if holds:
            get_heartbeat().renew(holds)

    def receive(sender: Any, task_id: str, **_: Any) -> None:
        lost.append(task_id)

    before_task_publish.connect(publishing, weak=False)
    signals.lock_lost.connect(receive, weak=False)
    try:
        with in_process_worker(app):
            assert job.delay().get(timeout=30) == 1
    finally:
        before_task_publish.disconnect(publishing)
        signals.lock_lost.disconnect(receive)
    assert len(holds) == 1
    assert lost == []
    assert field(redislock_client, lock_keys(job.lock_name((), {})).lock, OWNER_FIELD) is None


@pytest.mark.parametrize("deduplicate", [True, False])
def test_a_copy_whose_first_delivery_succeeded_meanwhile_is_skipped_as_celery_would(
    app: Celery,
    redislock_client: redis.Redis,
    conflicts: list[tuple[str, str]],
    deduplicate: bool,
) -> None:
    """With Celery's ``worker_deduplicate_successful_tasks`` (an ``acks_late`` task, a
    persistent result backend), a copy that takes the lock after its message's first
    delivery succeeded is dropped, as Celery drops a redelivered message of a task
    that succeeded before it starts; the stored result stays the first one's.
    Without it, the copy runs: a broker delivers a message at least once."""
    app.conf.worker_deduplicate_successful_tasks = deduplicate
    ran: list[bool] = []

    @app.task(base=SingletonTask, shared=False, acks_late=True, lock_ttl=30)
    def job() -> str:
        ran.append(True)
        return "copy"

    first = RedisLock(redislock_client, job.lock_name((), {}), ttl=30, lease="m-20")
    assert first.acquire(blocking=False)
    results: list[Any] = []
    copy = threading.Thread(target=lambda: results.append(job.apply(task_id="m-20")))
    copy.start()
    wait_for(lambda: ("m-20", "redelivered") in conflicts, what="the copy to wait")
    app.backend.mark_as_done("m-20", "first")
    first.release()
    copy.join(30)

    assert [result.state for result in results] == ["IGNORED" if deduplicate else "SUCCESS"]
    assert ran == ([] if deduplicate else [True])
    if deduplicate:
        assert app.AsyncResult("m-20").get(timeout=5) == "first"
    assert field(redislock_client, lock_keys(job.lock_name((), {})).lock, OWNER_FIELD) is None


def test_a_task_sent_again_as_a_retry_is_sent_whoever_holds_its_lock(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """A send of an ``until_executed`` message as a retry (a retry count above 0: the
    worker sending again a task whose pool process died, with
    ``task_retry_on_worker_lost``) is published even if its lock is still held, by the
    dead run's hold the worker could not free or by another task: somebody waits for
    its id, and it meets the hold as it starts. A first send is a duplicate."""
    queue = redis.Redis.from_url(app.conf.broker_url)

    @app.task(base=SingletonTask, shared=False, lock_strategy="until_executed", lock_ttl=30)
    def job() -> None: ...

    name = job.lock_name((), {})
    dead = RedisLock(redislock_client, name, ttl=30, lease="m-21", heartbeat=False)
    assert dead.acquire(blocking=False)
    try:
        assert job.apply_async(task_id="m-21", retries=1).id == "m-21"
        assert queue.llen(app.conf.task_default_queue) == 1
        assert job.apply_async(task_id="m-21").id == "m-21"
        assert job.apply_async().id == "m-21"
        assert queue.llen(app.conf.task_default_queue) == 1
        # The dead run's hold is left as it was, for the retry to wait out.
        assert field(redislock_client, lock_keys(name).lock, OWNER_FIELD) == dead.owner
    finally:
        queue.delete(app.conf.task_default_queue)
        queue.close()
        dead.release()


def test_a_copy_of_a_message_running_in_the_same_process_is_dropped_at_once(
    app: Celery, redislock_client: redis.Redis, conflicts: list[tuple[str, str]]
) -> None:
    """On the threads pool a copy of a message may run in the process that runs its
    first delivery: that delivery is alive, so the copy is dropped without waiting
    the time the hold had left, and frees its pool slot."""
    go = threading.Event()
    runs: list[str] = []
    ended: list[tuple[str, str]] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=30)
    def job(self: SingletonTask) -> str:
        runs.append(str(self.request.id))
        go.wait(30)
        return "first"

    def postrun(task_id: str, state: str, **_: Any) -> None:
        ended.append((task_id, state))

    task_postrun.connect(postrun, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            result = job.delay()
            wait_for(lambda: runs, what="the first delivery")
            app.send_task(job.name, task_id=result.id)
            # The hold had 30 s left: a copy that waited would still wait.
            wait_for(lambda: (result.id, "IGNORED") in ended, timeout=10, what="the copy")
            assert (result.id, "redelivered") in conflicts
            go.set()
            assert result.get(timeout=30) == "first"
    finally:
        task_postrun.disconnect(postrun)
        go.set()
    assert len(runs) == 1


def test_an_until_executing_copy_of_a_running_message_runs_beside_it(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """``until_executing`` frees its lock as the body starts, so nothing holds the
    call's name while the body runs: a copy of the message delivered meanwhile
    (the same task id) runs beside the first delivery, as documented. Use
    ``until_executed`` or ``while_executing`` to keep it out."""
    go = threading.Event()
    runs: list[str] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executing")
    def job(self: SingletonTask) -> str:
        runs.append(str(self.request.id))
        go.wait(30)
        return "ran"

    try:
        with in_process_worker(app, concurrency=2):
            result = job.delay()
            wait_for(lambda: runs, what="the first delivery")
            app.send_task(job.name, task_id=result.id)
            wait_for(lambda: len(runs) == 2, timeout=10, what="the copy to run beside it")
            assert runs == [result.id, result.id]
            go.set()
            assert result.get(timeout=30) == "ran"
    finally:
        go.set()
    assert held_keys(redislock_client) == []


def test_a_retry_rejected_with_requeue_keeps_its_lock_for_itself_not_for_an_older_copy(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """A retry of an ``until_executed`` message that rejects it with requeue hands its
    lock to that retry's reservation: a copy of an earlier delivery of the message
    is dropped, and the requeued retry takes the lock when it comes back."""
    ran: list[int] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        acks_late=True,
    )  # fmt: skip
    def job(self: SingletonTask) -> str:
        ran.append(int(self.request.retries))
        if len(ran) == 1:
            raise Reject("again", requeue=True)
        return "ran"

    name = job.lock_name((), {})
    key = lock_keys(name).lock
    job.apply(task_id="m-30", retries=2)
    assert field(redislock_client, key, OWNER_FIELD) == queued_owner("m-30", 2)

    assert job.apply(task_id="m-30").state == "IGNORED"
    assert job.apply(task_id="m-30", retries=2).get() == "ran"
    assert ran == [2, 2]
    assert field(redislock_client, key, OWNER_FIELD) is None
    # A revoke finds such a reservation by the retry count of the message.
    ran.clear()
    job.apply(task_id="m-31", retries=1)
    assert free_queued(redislock_client, name, "m-31", "redislock", retries=1)


def test_a_retry_that_starts_before_the_execution_that_sent_it_ends_waits_for_it(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """A retry that starts (in the same process, on the threads pool) while the
    execution that sent it still holds the lock is not taken for a copy of that
    execution: it waits for it to end, then runs."""
    runs: list[tuple[int, bool]] = []
    ended = threading.Event()

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=30, max_retries=1)
    def job(self: SingletonTask) -> None:
        runs.append((int(self.request.retries), ended.is_set()))
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)
            # Still holding the lock while the retry starts, and queues.
            wait_for(lambda: redislock_client.zcard(lock_keys(self.lock.name).queue) == 1)
            ended.set()

    with in_process_worker(app, concurrency=2):
        job.delay()
        wait_for(lambda: len(runs) == 2, what="the retry to run")
    assert runs == [(0, False), (1, True)]


class _Cleanup:
    """A ``with`` block whose exit runs ``then``."""

    def __init__(self, then: Any) -> None:
        self.then = then

    def __enter__(self) -> None:
        return None

    def __exit__(self, *_: object) -> None:
        self.then()


@pytest.mark.parametrize("strategy", ["while_executing", "until_executed"])
@pytest.mark.parametrize("block", ["finally", "with"])
def test_a_raised_retry_does_not_run_before_its_senders_cleanup_has_ended(
    app: Celery,
    redislock_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
    block: str,
) -> None:
    """``raise self.retry()`` from inside a ``try``/``finally`` (or a ``with`` block):
    the retry, sent before that cleanup runs, may start meanwhile (here on another
    thread), but does not run its body until the execution that sent it has ended:
    it waits for it, then runs, woken as its sender hands the lock on
    (``until_executed``: to the retry's reservation, which it takes over), not at
    its next re-check. The lock is free once it has."""
    # Longer than the test waits: a waiter nobody wakes would still wait.
    monkeypatch.setattr(lock_module, "RECHECK", 60.0)
    runs: list[tuple[int, bool]] = []
    ended = threading.Event()

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy=strategy, lock_ttl=30,
        max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append((int(self.request.retries), ended.is_set()))

        def cleanup() -> None:
            keys = lock_keys(self.lock.name)
            # The retry waits behind this execution (or, wrongly, has run).
            wait_for(lambda: len(runs) == 2 or redislock_client.zcard(keys.queue) == 1)
            hold = self.lock._lock
            assert hold is not None
            # Still this execution's, and not taken for lost.
            assert field(redislock_client, keys.lock, OWNER_FIELD) == hold.owner
            self.lock.check()
            ended.set()

        if self.request.retries:
            return int(self.request.retries)
        if block == "finally":
            try:
                raise self.retry(countdown=0)
            finally:
                cleanup()
        with _Cleanup(cleanup):
            raise self.retry(countdown=0)

    with in_process_worker(app, concurrency=2):
        assert job.delay().get(timeout=15) == 1
        name = job.lock_name((), {})
        wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    assert runs == [(0, False), (1, True)]


def test_an_autoretry_runs_after_its_senders_cleanup_and_takes_its_lock_over(
    app: Celery, redislock_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``until_executed`` with ``autoretry_for``: Celery sends the retry once the body
    has raised, its ``finally`` blocks done; the retry runs once the execution that
    sent it has ended, taking over the hold it was handed, without a loss reported;
    the lock is free once it has run."""
    monkeypatch.setattr(lock_module, "RECHECK", 60.0)
    runs: list[tuple[int, bool]] = []
    lost: list[str] = []
    ended = threading.Event()

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, autoretry_for=(ValueError,), retry_kwargs={"countdown": 0},
        max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append((int(self.request.retries), ended.is_set()))
        if self.request.retries:
            return int(self.request.retries)
        try:
            raise ValueError("not yet")
        finally:
            ended.set()

    def receive(sender: Any, task_id: str, **_: Any) -> None:
        lost.append(task_id)

    signals.lock_lost.connect(receive, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            assert job.delay().get(timeout=15) == 1
            name = job.lock_name((), {})
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    finally:
        signals.lock_lost.disconnect(receive)
    assert runs == [(0, False), (1, True)]
    assert lost == []


@pytest.mark.parametrize("retried", [False, True], ids=["first-run", "retried-run"])
@pytest.mark.parametrize("how", ["replace", "send-own-id", "send-own-id-and-return"])
@pytest.mark.parametrize("strategy", ["until_executed", "while_executing"])
def test_a_send_of_its_own_id_from_the_body_runs_only_once_its_sender_has_ended(
    app: Celery,
    redislock_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    how: str,
    retried: bool,
    strategy: str,
) -> None:
    """A body that sends its own task id again, by
    ``self.replace()`` (Celery sends the replacement under the same id, then raises
    ``Ignore``) or by ``apply_async(task_id=self.request.id)``, keeps its lock until
    it has ended, its ``finally`` included. The new message, started meanwhile on
    another thread, is neither run beside it nor dropped as a copy of it (even sent
    with fewer retries than the sender's, as a replacement is): it waits for it,
    woken as the hold is handed to its reservation (``until_executed``) or
    released (``while_executing``), then runs and frees the lock."""
    monkeypatch.setattr(lock_module, "RECHECK", 60.0)
    events: list[str] = []
    lost: list[str] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy=strategy,
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask, n: int) -> str:
        request = self.request
        if retried and not events and not request.retries:
            raise self.retry(countdown=0)
        first = not events
        events.append(f"start {'sender' if first else 'new'}")
        if not first:
            return "new"
        keys = lock_keys(self.lock.name)
        try:
            if how == "replace":
                self.replace(job.s(n))
            self.apply_async((n,), task_id=request.id)
            if how == "send-own-id":
                raise Ignore()
            return "sender"
        finally:
            # The new message waits behind this execution (or, wrongly, has run).
            wait_for(lambda: len(events) > 1 or redislock_client.zcard(keys.queue) == 1)
            hold = self.lock._lock
            assert hold is not None
            assert field(redislock_client, keys.lock, OWNER_FIELD) == hold.owner
            self.lock.check()
            events.append("sender ended")

    def receive(sender: Any, task_id: str, **_: Any) -> None:
        lost.append(task_id)

    done: list[str] = []
    signals.lock_lost.connect(receive, weak=False)
    try:
        with in_process_worker(app, concurrency=2):

            @task_postrun.connect(weak=False)
            def ended(task_id: str, retval: Any = None, **_: Any) -> None:
                if retval == "new":
                    done.append(task_id)

            try:
                sent = job.delay(1)
                wait_for(lambda: done, what="the new message to run")
                assert done == [sent.id]
                if how == "replace":
                    assert sent.get(timeout=10) == "new"
                name = job.lock_name((1,), {})
                wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
            finally:
                task_postrun.disconnect(ended)
    finally:
        signals.lock_lost.disconnect(receive)
    assert events == ["start sender", "sender ended", "start new"]
    assert lost == []


def _call_eagerly(job: Any) -> list[Any]:
    """``job.apply_async((1,))`` (in eager mode) in a thread of its own, waited for
    20 s as a hang guard only; what it returned, in a list."""
    out: list[Any] = []
    caller = threading.Thread(target=lambda: out.append(job.apply_async((1,))), daemon=True)
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "the eager call still waits"
    return out


@pytest.mark.parametrize("header", [False, True], ids=["plain", "sender-header"])
@pytest.mark.parametrize("strategy", ["until_executed", "while_executing"])
def test_an_eager_send_of_its_own_id_from_the_body_runs_at_once(
    app: Celery, redislock_client: redis.Redis, strategy: str, header: bool
) -> None:
    """With ``task_always_eager``, a body's ``apply_async(task_id=self.request.id)``
    runs the new execution nested in the sender, on its thread: it cannot wait for
    its sender to end. ``until_executed`` hands the hold over at once and the
    nested run takes it; ``while_executing`` finds its sender alive and drops the
    nested run. Even a message naming its sender in its header (one put there by
    hand) is not kept waiting for it. Either way the call returns and leaves the
    lock free."""
    app.conf.task_always_eager = True
    runs: list[str] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy=strategy, lock_ttl=30,
    )  # fmt: skip
    def job(self: SingletonTask, n: int) -> str:
        runs.append("new" if runs else "sender")
        if len(runs) == 1:
            hold = self.lock._lock
            assert hold is not None
            headers = {"redislock_sender": hold.owner} if header else {}
            self.apply_async((n,), task_id=self.request.id, headers=headers)
            return "sender"
        return "new"

    out = _call_eagerly(job)
    assert out[0].result == "sender"
    assert runs == (["sender", "new"] if strategy == "until_executed" else ["sender"])
    assert _lock_free(redislock_client, job.lock_name((1,), {}))


@pytest.mark.parametrize("strategy", ["until_executed", "while_executing", "until_executing"])
def test_an_eager_replace_with_the_same_call_is_dropped_as_a_copy(
    app: Celery, redislock_client: redis.Redis, strategy: str
) -> None:
    """With ``task_always_eager``, Celery runs a replacement with ``apply()``, on the
    sender's thread while the sender still holds its lock, not with
    ``apply_async()``: a replacement with the same arguments of an
    ``until_executed`` or ``while_executing`` task finds that hold and is dropped
    as a copy, never run; ``until_executing``, whose lock is free once the body
    has started, runs it. (Celery's eager replace then fails the call: it waits
    for the replacement's result within the task, a plain task's too.) Either
    way the call returns and leaves the lock free."""
    app.conf.task_always_eager = True
    runs: list[str] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy=strategy, lock_ttl=30,
    )  # fmt: skip
    def job(self: SingletonTask, n: int) -> str:
        runs.append("new" if runs else "sender")
        if len(runs) == 1:
            self.replace(job.s(n))
        return "new"

    out = _call_eagerly(job)
    assert isinstance(out[0].result, RuntimeError)  # Celery's own, as said above
    assert runs == (["sender", "new"] if strategy == "until_executing" else ["sender"])
    assert _lock_free(redislock_client, job.lock_name((1,), {}))


@pytest.mark.parametrize("start", ["at once", "slow"])
def test_a_copy_of_a_send_of_its_own_id_is_a_copy_of_the_delivery_that_took_the_hand_over(
    app: Celery, redislock_client: redis.Redis, monkeypatch: pytest.MonkeyPatch, start: str
) -> None:
    """A message a body sent under its own task id (``until_executed``) is delivered
    twice while its sender still cleans up: both deliveries wait for the sender.
    The one that takes the hand-over first runs; the other, finding the lock passed
    from the sender to that delivery, is a copy of it from then on: not kept
    waiting behind it however long it runs (then to run the body again), but
    dropped, that delivery being known alive, even while it has yet to get from
    its wait to its body (``slow``: a moment between the two)."""
    if start == "slow":

        class SlowHandle(LockHandle):
            def __init__(self, *args: Any) -> None:
                time.sleep(0.5)
                super().__init__(*args)

        monkeypatch.setattr("celery_redislock.task.LockHandle", SlowHandle)
    app.conf.task_acks_late = True
    events: list[str] = []
    ended: list[str] = []
    captured: dict[str, Any] = {}
    copy_sent = threading.Event()

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, acks_late=True,
    )  # fmt: skip
    def job(self: SingletonTask, n: int) -> str:
        first = not events
        events.append("sender" if first else "new")
        if not first:
            # Runs on until the other delivery has ended (or, wrongly, a while,
            # that one waiting behind it).
            with contextlib.suppress(AssertionError):
                wait_for(lambda: len(ended) >= 2, timeout=5)
            return "new"
        queue = lock_keys(self.lock.name).queue
        try:
            self.apply_async((n,), task_id=self.request.id)
            raise Ignore()
        finally:
            wait_for(copy_sent.is_set, what="the copy to be sent")
            wait_for(lambda: redislock_client.zcard(queue) == 2, what="both deliveries to wait")

    def grab(headers: dict[str, Any], **_: Any) -> None:
        if headers.get("redislock_sender"):
            captured.setdefault("headers", dict(headers))

    def postrun(task_id: str, state: str, **_: Any) -> None:
        ended.append(state)

    before_task_publish.connect(grab, weak=False)
    task_postrun.connect(postrun, weak=False)
    try:
        with in_process_worker(app, concurrency=3):
            sent = job.delay(1)
            wait_for(lambda: "headers" in captured, what="the send of its own id")
            extra = {k: v for k, v in captured["headers"].items() if k.startswith("redislock_")}
            # The broker delivers that message a second time.
            app.send_task(job.name, args=(1,), task_id=sent.id, headers=extra)
            copy_sent.set()
            wait_for(lambda: len(ended) == 3, timeout=20, what="every delivery to end")
            name = job.lock_name((1,), {})
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    finally:
        before_task_publish.disconnect(grab)
        task_postrun.disconnect(postrun)
    assert events == ["sender", "new"]


def test_a_replacement_keeps_its_senders_chain(app: Celery, redislock_client: redis.Redis) -> None:
    """A chain step that replaces itself: its replacement (sent with the rest of
    the chain, under the step's id) runs once the step has ended, and the chain
    goes on from it."""
    ran: list[str] = []

    @app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed")
    def step(self: SingletonTask, n: int) -> int:
        if not self.request.replaced_task_nesting:
            ran.append("sender")
            self.replace(step.s(n))
        ran.append("replacement")
        return n + 1

    @app.task(shared=False)
    def after(n: int) -> int:
        ran.append("after")
        return n * 10

    with in_process_worker(app, concurrency=2):
        result = (step.s(1) | after.s()).delay()
        assert result.get(timeout=15) == 20
        wait_for(lambda: _lock_free(redislock_client, step.lock_name((1,), {})), what="a free lock")
    assert ran == ["sender", "replacement", "after"]


@pytest.mark.parametrize("strategy", ["while_executing", "until_executed"])
def test_a_retry_waits_for_the_execution_that_sent_it_however_long_that_runs(
    app: Celery, redislock_client: redis.Redis, strategy: str
) -> None:
    """A retry whose sender runs on, renewing the lock, for longer than a copy would
    wait (the hold's TTL plus the grace), is not dropped like a copy: it waits for
    the sender to end, then runs."""
    runs: list[tuple[int, bool]] = []
    ended = threading.Event()

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_ttl=0.5, max_retries=1,
        lock_strategy=strategy,
    )  # fmt: skip
    def job(self: SingletonTask) -> None:
        runs.append((int(self.request.retries), ended.is_set()))
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)
            wait_for(lambda: redislock_client.zcard(lock_keys(self.lock.name).queue) == 1)
            # Renewed all along, past what a copy waits for: 0.5 s + the grace.
            time.sleep(0.5 + REDELIVERY_GRACE + 1.5)
            ended.set()

    with in_process_worker(app, concurrency=2):
        job.delay()
        wait_for(lambda: len(runs) == 2, what="the retry to run")
        name = job.lock_name((), {})
        key = lock_keys(name).lock
        wait_for(lambda: field(redislock_client, key, OWNER_FIELD) is None, what="a free lock")
    assert runs == [(0, False), (1, True)]


def test_an_execution_of_a_retry_names_its_retry_count_in_its_owner_token(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """What a copy of an earlier delivery reads to know it was superseded: a retry's
    execution holds the lock under an owner token ending in ``:<retries>``, and a
    first delivery's names none."""
    owners: list[str] = []

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask) -> None:
        owners.append(str(field(redislock_client, lock_keys(self.lock.name).lock, OWNER_FIELD)))

    job.apply(task_id="m-40", retries=3)
    job.apply(task_id="m-41")

    assert owners[0].endswith(":3")
    assert ":" not in owners[1]


@pytest.mark.parametrize("how", ["apply_throw", "eager_propagates"])
def test_an_eager_retry_that_propagates_leaves_no_lock_behind(
    app: Celery, redislock_client: redis.Redis, how: str
) -> None:
    """``self.retry()`` of an ``until_executed`` task run eagerly with its errors
    propagated (``apply(throw=True)``, ``task_eager_propagates``) raises ``Retry`` out
    of the call: no retry runs, so nothing may keep the lock for it."""
    from celery.exceptions import Retry

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=60, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> str:
        raise self.retry(countdown=0)

    name = job.lock_name((), {})
    if how == "apply_throw":
        with pytest.raises(Retry):
            job.apply(task_id="message-eager-1", throw=True)
    else:
        app.conf.task_always_eager = True
        app.conf.task_eager_propagates = True
        try:
            with pytest.raises(Retry):
                job.delay()
        finally:
            app.conf.task_always_eager = False
            app.conf.task_eager_propagates = False
    assert field(redislock_client, lock_keys(name).lock, OWNER_FIELD) is None


def _lock_free(client: redis.Redis, name: str) -> bool:
    return field(client, lock_keys(name).lock, OWNER_FIELD) is None


@pytest.mark.parametrize("order", ["retry_first", "sender_first"])
def test_a_retry_sent_as_its_sender_runs_on_that_fails_to_start_leaves_the_lock_free(
    app: Celery, redislock_client: redis.Redis, order: str
) -> None:
    """``until_executed``: an execution sends its retry with ``self.retry(throw=False)``
    and runs on; the retry's ``before_start`` raises. Whether that happens while the
    sender still holds the lock (it hands its hold to the retry's reservation only as
    it ends) or after, nothing is left holding the lock for the retry: it is free once
    both have ended, and the same call sent again runs."""
    failed = threading.Event()
    runs: list[int] = []

    class FailsOnRetry(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries:
                if order == "sender_first":
                    key = lock_keys(self.lock_name((), {})).lock
                    # Handed to the retry's reservation (which the hold taken as the
                    # worker accepted the retry may have taken over since).
                    wait_for(
                        lambda: str(field(redislock_client, key, OWNER_FIELD)).endswith(
                            (queued_owner(task_id, 1), ":1")
                        ),
                        what="the sender to hand its hold to the retry's reservation",
                    )
                raise RuntimeError("not ready for the retry")

    @app.task(
        base=FailsOnRetry, bind=True, shared=False, lock_strategy="until_executed", lock_ttl=30,
        max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> None:
        runs.append(int(self.request.retries))
        if self.request.retries == 0 and len(runs) == 1:
            self.retry(countdown=0, throw=False)
            if order == "retry_first":
                wait_for(failed.is_set, what="the retry's start to fail")

    def on_failure(task_id: str = "", **_: Any) -> None:
        failed.set()

    task_failure.connect(on_failure, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            first = job.delay()
            wait_for(failed.is_set, what="the retry's start to fail")
            name = job.lock_name((), {})
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
            again = job.delay()
            assert again.id != first.id
            again.get(timeout=15)
    finally:
        task_failure.disconnect(on_failure, sender=job)
    assert runs == [0, 0]


@pytest.mark.parametrize("order", ["retry_first", "sender_first"])
def test_a_retry_sent_as_its_sender_runs_on_that_is_revoked_leaves_the_lock_free(
    app: Celery, redislock_client: redis.Redis, order: str
) -> None:
    """``until_executed``: an execution sends its retry (with a countdown) with
    ``self.retry(throw=False)`` and runs on; the task is revoked, and the worker
    drops the retry's message at its ETA. Whether that happens while the sender
    still holds the lock or after it handed its hold to the retry's reservation,
    the lock is free once both have ended, and the same call sent again runs."""
    dropped = threading.Event()
    runs: list[int] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> None:
        runs.append(int(self.request.retries))
        if self.request.retries == 0 and len(runs) == 1:
            self.retry(countdown=0.5, throw=False)
            self.app.control.revoke(self.request.id)
            if order == "retry_first":
                wait_for(dropped.is_set, what="the worker to drop the revoked retry")

    def on_revoked(request: Any = None, **_: Any) -> None:
        dropped.set()

    # Connected after celery_redislock's own receiver, so called after it.
    task_revoked.connect(on_revoked, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            first = job.delay()
            wait_for(dropped.is_set, what="the worker to drop the revoked retry")
            name = job.lock_name((), {})
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
            again = job.delay()
            assert again.id != first.id
            again.get(timeout=15)
    finally:
        task_revoked.disconnect(on_revoked, sender=job)
    assert runs == [0, 0]


@pytest.mark.parametrize(
    ("drop", "order"),
    [
        ("fails-to-start", "dropped_first"),
        ("fails-to-start", "sender_first"),
        ("revoked", "dropped_first"),
    ],
)
@pytest.mark.parametrize("how", ["replace", "send-own-id"])
def test_a_send_of_its_own_id_that_ends_unrun_as_its_sender_runs_leaves_the_lock_free(
    app: Celery, redislock_client: redis.Redis, how: str, drop: str, order: str
) -> None:
    """``until_executed``: an execution sends its own task id again without a retry
    count, by ``self.replace()`` (the sender's ``finally`` still to run) or by
    ``apply_async(task_id=self.request.id)`` (running on), and the new message ends
    without running: its ``before_start`` raises, or the task id is revoked and the
    worker drops the message. Whether that happens while the sender still holds the
    lock (it hands its hold to the message's reservation only as it ends) or after,
    nothing is left holding the lock for the message: it is free once both have
    ended, long before ``lock_enqueue_ttl``, and the same call sent again runs."""
    sent, dropped, settled = threading.Event(), threading.Event(), threading.Event()
    runs: list[str] = []
    senders: list[str] = []
    countdown = 0.5 if drop == "revoked" else 0

    class FailsOnTheNewMessage(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if drop != "fails-to-start" or not sent.is_set() or settled.is_set():
                return
            if order == "sender_first":
                key = lock_keys(self.lock_name((1,), {})).lock
                wait_for(
                    lambda: field(redislock_client, key, OWNER_FIELD) not in (None, *senders),
                    what="the sender to hand its hold over",
                )
            raise RuntimeError("not ready for the new message")

    @app.task(
        base=FailsOnTheNewMessage, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, lock_enqueue_ttl=3600,
    )  # fmt: skip
    def job(self: SingletonTask, n: int) -> str:
        runs.append(self.request.id)
        if sent.is_set():
            return "again"
        hold = self.lock._lock
        assert hold is not None
        senders.append(hold.owner)
        sent.set()
        try:
            if how == "replace":
                self.replace(job.s(n).set(countdown=countdown))
            self.apply_async((n,), task_id=self.request.id, countdown=countdown)
            return "sender"
        finally:
            if drop == "revoked":
                self.app.control.revoke(self.request.id)
            if order == "dropped_first":
                wait_for(dropped.is_set, what="the new message to end unrun")

    def on_failure(**_: Any) -> None:
        dropped.set()

    def on_revoked(request: Any = None, **_: Any) -> None:
        dropped.set()

    task_failure.connect(on_failure, sender=job, weak=False)
    # Connected after celery_redislock's own receiver, so called after it.
    task_revoked.connect(on_revoked, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            first = job.delay(1)
            wait_for(dropped.is_set, what="the new message to end unrun")
            name = job.lock_name((1,), {})
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
            settled.set()
            again = job.delay(1)
            assert again.id != first.id
            assert again.get(timeout=15) == "again"
    finally:
        task_failure.disconnect(on_failure, sender=job)
        task_revoked.disconnect(on_revoked, sender=job)
    assert runs == [first.id, again.id]
    # A revoke this worker handles before it has the new message finds the
    # sender's hold by a search, and cannot tell whether the sender also sent a
    # retry: it leaves word about retry 1 too, which nobody reads; it expires.
    left = _words(redislock_client) if drop == "revoked" else []
    assert all(key.endswith(b":1") and redislock_client.pttl(key) > 0 for key in left)
    assert [key for key in _words(redislock_client) if key not in left] == []


def test_a_delivery_behind_its_sender_that_cannot_leave_word_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A retry's delivery whose wait behind the execution that sent it ends in an
    exception (a soft time limit, the lock store out of reach) leaves that
    execution word to free the lock as it ends (see
    ``test_a_send_of_its_own_id_that_fails_behind_its_running_sender_leaves_the_lock_free``);
    with the lock store out of reach that fails, and is logged, never raised: the
    delivery ends with its own exception."""
    app = make_app(f"redis://127.0.0.1:{free_port()}/0", "behind-unreachable")
    try:

        @app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed")
        def job(self: SingletonTask, n: int) -> int:
            return n

        request = Context(id="id-behind", retries=1, is_eager=False)
        with caplog.at_level("WARNING", logger="celery_redislock.task"):
            job._ended_behind_sender("t:behind", request, job.lock_options, RuntimeError())
        assert "could not leave it word to free lock t:behind" in caplog.text
    finally:
        close_app(app)


#: A queue no worker consumes: a message sent there stays in the broker.
NOBODY = "redelivery-nobody"


@pytest.mark.parametrize(
    ("where", "copies", "by"),
    [
        ("waiting for its ETA", 1, "id"),
        ("waiting for its ETA", 2, "id"),
        ("in the broker", 1, "id"),
        ("in the broker", 2, "id"),
        ("waiting for its ETA", 1, "stamp"),
    ],
)
def test_a_retry_revoked_long_before_its_eta_frees_the_lock_as_its_sender_ends(
    redislock_server: RedisServer,
    redislock_client: redis.Redis,
    where: str,
    copies: int,
    by: str,
) -> None:
    """``until_executed``: an execution sends its retry (``copies`` times) with a long
    countdown with ``self.retry(throw=False)`` and runs on; the task is revoked (by
    its id, or by its stamp) while the retry waits for its ETA in the worker, or
    still sits in the broker. The lock is free as soon as the sender ends, not once
    the countdown has passed (every ``delay()`` meanwhile would be deduplicated to a
    retry that never runs), and the same call sent again runs."""
    label = f"{copies}-{where.split()[-1].lower()}-{by}"
    app = make_app(redislock_server.url, f"revoke-eta-{label}")
    stamp = f"batch-{uuid.uuid4().hex}"
    go_on = threading.Event()
    sent = threading.Semaphore(0)
    runs: list[int] = []
    options: dict[str, Any] = {"queue": NOBODY} if where == "in the broker" else {}

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> None:
        runs.append(int(self.request.retries))
        if self.request.retries == 0 and len(runs) == 1:
            for _ in range(copies):
                self.retry(countdown=60, throw=False, **options)
                sent.release()
            assert go_on.wait(30)

    @app.task(base=SingletonTask, shared=False, lock_strategy="until_executed")
    def marker(name: str) -> None:
        pass

    try:
        with in_process_worker(app, concurrency=2):
            first = job.s().stamp(batch=stamp).apply_async() if by == "stamp" else job.delay()
            for _ in range(copies):
                assert sent.acquire(timeout=15), "the retry was not sent"
            if where == "waiting for its ETA":
                wait_for(
                    lambda: scheduled_copies(first.id) == copies,
                    what="the worker to hold the retry",
                )
            # A revoke of another id, sent after it, tells when this one was handled.
            marked = marker.apply_async(("marker",), queue=NOBODY)
            marker_key = lock_keys(marker.lock_name(("marker",), {})).lock
            if by == "stamp":
                app.control.revoke_by_stamped_headers({"batch": stamp})
            else:
                app.control.revoke(first.id)
            app.control.revoke(marked.id)
            wait_for(
                lambda: field(redislock_client, marker_key, OWNER_FIELD) is None,
                what="the revokes to be handled",
            )
            name = job.lock_name((), {})
            assert not _lock_free(redislock_client, name)  # the sender holds it still
            go_on.set()
            # Long before the retry's ETA (a bound only against a hang).
            wait_for(lambda: _lock_free(redislock_client, name), timeout=10, what="a free lock")
            again = job.delay()
            assert again.id != first.id
            again.get(timeout=15)
    finally:
        go_on.set()
        close_app(app)
        # The messages left: the retry in the queue nobody consumes, or restored to
        # this test's own queue as the worker stopped.
        broker = redis.Redis.from_url(redislock_server.url.rsplit("/", 1)[0] + "/1")
        broker.delete(NOBODY, app.conf.task_default_queue)
        broker.close()
    assert runs == [0, 0]


@pytest.mark.parametrize("how", ["replace", "send-own-id"])
def test_a_send_of_its_own_id_revoked_in_the_broker_frees_the_lock_as_its_sender_ends(
    app: Celery, redislock_client: redis.Redis, redislock_server: RedisServer, how: str
) -> None:
    """``until_executed``: an execution sends its own task id again without a retry
    count (``self.replace()``, or ``apply_async(task_id=self.request.id)`` and runs
    on) to a queue no worker consumes; the task id is revoked while the sender still
    runs. No worker ever sees that message, but the worker running the sender leaves
    it word that every message of its id is revoked: the lock is free as soon as the
    sender ends, not once ``lock_enqueue_ttl`` has passed."""
    go_on, sent = threading.Event(), threading.Event()
    runs: list[str] = []

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, lock_enqueue_ttl=3600,
    )  # fmt: skip
    def job(self: SingletonTask, n: int) -> None:
        runs.append(self.request.id)
        if len(runs) > 1:
            return
        try:
            if how == "replace":
                self.replace(job.s(n).set(queue=NOBODY))
            self.apply_async((n,), task_id=self.request.id, queue=NOBODY)
        finally:
            sent.set()
            assert go_on.wait(30)

    @app.task(base=SingletonTask, shared=False, lock_strategy="until_executed")
    def marker(name: str) -> None:
        pass

    try:
        with in_process_worker(app, concurrency=2):
            first = job.delay(1)
            assert sent.wait(15), "the new message was not sent"
            # A revoke of another id, sent after it, tells when this one was handled.
            marked = marker.apply_async(("marker",), queue=NOBODY)
            marker_key = lock_keys(marker.lock_name(("marker",), {})).lock
            app.control.revoke(first.id)
            app.control.revoke(marked.id)
            wait_for(
                lambda: field(redislock_client, marker_key, OWNER_FIELD) is None,
                what="the revokes to be handled",
            )
            name = job.lock_name((1,), {})
            assert not _lock_free(redislock_client, name)  # the sender holds it still
            go_on.set()
            wait_for(lambda: _lock_free(redislock_client, name), timeout=10, what="a free lock")
            again = job.delay(1)
            assert again.id != first.id
            again.get(timeout=15)
    finally:
        go_on.set()
        broker = redis.Redis.from_url(redislock_server.url.rsplit("/", 1)[0] + "/1")
        broker.delete(NOBODY)
        broker.close()
    assert runs == [first.id, again.id]


def test_a_retry_sent_from_before_start_finds_its_reservation_at_once(
    app: Celery, redislock_client: redis.Redis, conflicts: list[tuple[str, str]]
) -> None:
    """``until_executed``, threads pool: ``before_start`` sends the retry and raises
    it. The hold taken as the worker accepted the task is handed to the retry's
    reservation before the retry is sent, so a retry that starts before the failed
    start has ended takes its reservation over at once: it never finds the lock held
    by the delivery that sent it (and never waits for it)."""
    runs: list[int] = []

    class RetriesAtStart(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries == 0:
                try:
                    self.retry(countdown=0)
                except Retry as exc:
                    # The retry runs, or finds the lock held, before this start ends.
                    wait_for(lambda: runs or conflicts, what="the retry to start")
                    raise exc from None

    @app.task(
        base=RetriesAtStart, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append(int(self.request.retries))
        return int(self.request.retries)

    with in_process_worker(app, concurrency=2):
        assert job.delay().get(timeout=15) == 1
        name = job.lock_name((), {})
        wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    assert runs == [1]
    assert conflicts == []


def test_a_retry_from_before_start_that_ran_before_the_start_ended_is_not_reserved_again(
    app: Celery, redislock_client: redis.Redis, conflicts: list[tuple[str, str]]
) -> None:
    """``until_executed``, threads pool: ``before_start`` sends the retry, which
    takes its reservation over, runs and frees the lock before the failed start
    ends. The failed start's end does not make the retry's reservation again
    (nothing would take it over: the lock would stay taken for
    ``lock_enqueue_ttl``): the lock is free, and the same call sent again runs."""
    runs: list[int] = []
    ended: list[str] = []

    class RetriesAtStart(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries == 0 and not runs:
                try:
                    self.retry(countdown=0)
                except Retry as exc:
                    name = self.lock_name((), {})
                    wait_for(lambda: runs, what="the retry to run")
                    wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
                    raise exc from None

        def on_retry(self, exc: Any, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
            # After the failed start has given back what it held.
            ended.append(task_id)

    @app.task(
        base=RetriesAtStart, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append(int(self.request.retries))
        return int(self.request.retries)

    with in_process_worker(app, concurrency=2):
        first = job.delay()
        assert first.get(timeout=15) == 1
        wait_for(lambda: ended, what="the failed start to end")
        name = job.lock_name((), {})
        wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
        again = job.delay()
        assert again.id != first.id
        assert again.get(timeout=15) == 0
    assert runs == [1, 0]
    assert conflicts == []


def test_a_retry_from_before_start_that_cannot_be_sent_gives_the_hold_back(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """``until_executed``, threads pool: ``before_start`` sends the retry, and making
    its reservation raises something other than a Redis error (here a countdown
    past the longest TTL a lock takes). The hold taken as the worker accepted the
    task is given back, not left renewed by the heartbeat: the lock is free, and
    the same call sent again runs."""
    runs: list[int] = []
    tried: list[str] = []

    class RetriesAtStart(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if not tried:
                tried.append(task_id)
                self.retry(countdown=400_000_000)

    @app.task(
        base=RetriesAtStart, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append(int(self.request.retries))
        return 7

    with in_process_worker(app, concurrency=2):
        first = job.delay()
        if CELERY_5_7:
            with pytest.raises(Exception, match="ttl"):
                first.get(timeout=15)
        else:
            # Celery before 5.7 rejects the message of a task whose retry cannot be
            # sent, and stores no result.
            wait_for(lambda: bool(tried), what="the retry to be tried")
        name = job.lock_name((), {})
        wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
        again = job.delay()
        assert again.id != first.id
        assert again.get(timeout=15) == 7
        if not CELERY_5_7:
            assert first.state == "PENDING"
    assert runs == [0]


def _wait_until_passed_on_to_the_second_retry(
    client: redis.Redis, task: SingletonTask, task_id: str
) -> None:
    """Wait, in the second retry's ``before_start``, until the lock has been passed
    on to its reservation (it asks for no lock: the hold is already its own)."""
    key = lock_keys(task.lock_name((), {})).lock
    wait_for(
        lambda: str(field(client, key, OWNER_FIELD)).endswith((queued_owner(task_id, 2), ":2")),
        what="the lock to be passed on to the second retry's reservation",
    )


def test_a_retry_sent_by_a_failed_start_while_its_sender_runs_on_is_handed_the_lock(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """``until_executed``: an execution sends its retry with ``self.retry(throw=False)``
    and runs on; that retry's ``before_start`` sends a retry of its own and raises it
    while the sender still holds the lock. As the sender ends, its hold goes on to the
    second retry's reservation (not to the first retry's, which nobody would take
    over), and the second retry runs."""
    retried = threading.Event()
    runs: list[int] = []

    class RetriesOnRetry(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries == 1:
                raise self.retry(countdown=0)
            if self.request.retries == 2:
                _wait_until_passed_on_to_the_second_retry(redislock_client, self, task_id)

    @app.task(
        base=RetriesOnRetry, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=2,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append(int(self.request.retries))
        if self.request.retries == 0:
            self.retry(countdown=0, throw=False)
            wait_for(retried.is_set, what="the first retry's start to send the second")
        return int(self.request.retries)

    def on_retry(**_: Any) -> None:
        retried.set()

    task_retry.connect(on_retry, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=3):
            job.delay()
            wait_for(lambda: 2 in runs, what="the second retry to run")
            name = job.lock_name((), {})
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    finally:
        task_retry.disconnect(on_retry, sender=job)
    assert runs == [0, 2]


@pytest.mark.parametrize("how", ["replace", "send-own-id"])
def test_a_retry_sent_by_the_failed_start_of_a_send_of_its_own_id_is_handed_the_lock(
    app: Celery, redislock_client: redis.Redis, how: str
) -> None:
    """``until_executed``: an execution sends its own task id again without a retry
    count (``self.replace()``, or ``apply_async(task_id=self.request.id)`` and runs
    on); the new message's ``before_start`` sends a retry and raises it while the
    sender still holds the lock. As the sender ends, its hold goes on to that retry's
    reservation (not to the new message's, which nobody would take over), and the
    retry runs."""
    sent, retried = threading.Event(), threading.Event()
    runs: list[int] = []

    class RetriesOnTheNewMessage(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries == 1:
                key = lock_keys(self.lock_name((1,), {})).lock
                wait_for(
                    lambda: str(field(redislock_client, key, OWNER_FIELD)).endswith(
                        (queued_owner(task_id, 1), ":1")
                    ),
                    what="the lock to be passed on to the retry's reservation",
                )
            elif sent.is_set():
                raise self.retry(countdown=0)

    @app.task(
        base=RetriesOnTheNewMessage, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, lock_enqueue_ttl=3600, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask, n: int) -> int:
        runs.append(int(self.request.retries))
        if self.request.retries:
            return 1
        sent.set()
        try:
            if how == "replace":
                self.replace(job.s(n))
            self.apply_async((n,), task_id=self.request.id)
        finally:
            wait_for(retried.is_set, what="the new message's start to send a retry")
        return 0

    def on_retry(**_: Any) -> None:
        retried.set()

    task_retry.connect(on_retry, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=3):
            job.delay(1)
            wait_for(lambda: 1 in runs, what="the retry to run")
            name = job.lock_name((1,), {})
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    finally:
        task_retry.disconnect(on_retry, sender=job)
    assert runs == [0, 1]
    assert _words(redislock_client) == []


def _words(client: redis.Redis) -> list[bytes]:
    """The keys of the word left beside a lock by a retry's delivery that ended unrun."""
    return list(client.scan_iter(match="*:dropped:*"))


@pytest.mark.parametrize("first_sender", ["ends", "loses_its_hold"])
def test_word_left_for_an_earlier_use_of_a_task_id_does_not_free_its_next_retry(
    app: Celery, redislock_client: redis.Redis, first_sender: str
) -> None:
    """``until_executed``: a retry sent with ``self.retry(throw=False)`` fails to start
    while its sender runs on, and leaves word for it. A sender that ends frees the
    lock, and deletes the word once it has acted on it; one that lost its hold meanwhile (freed
    by an operator and taken by another, as when its worker died and the TTL ran
    out) never reads it. The task id is used again (an id the caller derives, or the
    message delivered again after its worker died): that execution's own retry,
    which waits for its countdown, keeps the lock reserved (the word left for the
    earlier hold is not for this one), and a duplicate publishes nothing."""
    failed, ended = threading.Event(), threading.Event()
    state = {"round": 1}
    runs: list[tuple[int, int]] = []
    seen: dict[str, str | None] = {}
    senders: list[str] = []

    class FailsOnFirstRetry(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries and state["round"] == 1:
                raise RuntimeError("not ready for the retry")

    @app.task(
        base=FailsOnFirstRetry, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> None:
        runs.append((state["round"], int(self.request.retries)))
        if self.request.retries == 0:
            self.retry(countdown=1.5 if state["round"] == 2 else 0, throw=False)
            if state["round"] == 1:
                wait_for(failed.is_set, what="the retry's start to fail")
                if first_sender == "loses_its_hold":
                    assert force_release(redislock_client, name)
                    assert other.acquire(blocking=False)

    name = job.lock_name((), {})
    key = lock_keys(name).lock
    other = RedisLock(redislock_client, name, ttl=30, heartbeat=False)

    def on_failure(**_: Any) -> None:
        failed.set()

    def on_postrun(task_id: str = "", task: Any = None, **_: Any) -> None:
        if not task.request.retries:
            senders.append(task_id)
            if len(senders) == 2:
                seen["owner"] = field(redislock_client, key, OWNER_FIELD)
                ended.set()

    task_failure.connect(on_failure, sender=job, weak=False)
    task_postrun.connect(on_postrun, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            job.apply_async(task_id="derived-id")
            wait_for(failed.is_set, what="the retry's start to fail")
            wait_for(lambda: len(senders) == 1, what="the sender to end")
            if first_sender == "loses_its_hold":
                assert len(_words(redislock_client)) == 1
                other.release()
            else:
                # Read and deleted by the sender.
                assert _words(redislock_client) == []
            assert _lock_free(redislock_client, name)
            state["round"] = 2
            job.apply_async(task_id="derived-id")
            wait_for(ended.is_set, what="the second sender to end")
            assert seen["owner"] == queued_owner("derived-id", 1)
            assert job.delay().id == "derived-id"
            wait_for(lambda: (2, 1) in runs, what="the second round's retry to run")
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    finally:
        task_failure.disconnect(on_failure, sender=job)
        task_postrun.disconnect(on_postrun, sender=job)
    assert runs == [(1, 0), (2, 0), (2, 1)]
    assert _words(redislock_client) == []


def test_word_to_pass_the_lock_on_left_for_an_earlier_use_of_a_task_id_is_not_heeded(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """``until_executed``: a retry sent with ``self.retry(throw=False)`` sends a second
    retry from its ``before_start`` and raises it while its sender runs on; the sender
    passes its hold on to the second retry as it ends. The task id is used again:
    that execution's own retry, sent with a countdown, runs (it is not taken for a
    copy the second retry superseded), and the lock is free once it has."""
    retried = threading.Event()
    state = {"round": 1}
    runs: list[tuple[int, int]] = []

    class RetriesOnFirstRetry(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if state["round"] == 2:
                return
            if self.request.retries == 1:
                raise self.retry(countdown=0)
            if self.request.retries == 2:
                _wait_until_passed_on_to_the_second_retry(redislock_client, self, task_id)

    @app.task(
        base=RetriesOnFirstRetry, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=2,
    )  # fmt: skip
    def job(self: SingletonTask) -> int:
        runs.append((state["round"], int(self.request.retries)))
        if self.request.retries == 0:
            self.retry(countdown=0.5 if state["round"] == 2 else 0, throw=False)
            if state["round"] == 1:
                wait_for(retried.is_set, what="the first retry's start to send the second")
        return int(self.request.retries)

    def on_retry(**_: Any) -> None:
        retried.set()

    name = job.lock_name((), {})
    task_retry.connect(on_retry, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=3):
            job.apply_async(task_id="derived-id")
            wait_for(lambda: (1, 2) in runs, what="the second retry to run")
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
            state["round"] = 2
            job.apply_async(task_id="derived-id")
            wait_for(lambda: (2, 1) in runs, timeout=10, what="the second round's retry to run")
            wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
    finally:
        task_retry.disconnect(on_retry, sender=job)
    assert runs == [(1, 0), (1, 2), (2, 0), (2, 1)]
    assert _words(redislock_client) == []


@pytest.mark.parametrize("second", ["runs", "fails_to_start", "first_fails_after_the_hand_over"])
def test_a_retry_sent_twice_as_its_sender_runs_on_keeps_the_lock_while_a_copy_may_run(
    app: Celery, redislock_client: redis.Redis, second: str
) -> None:
    """``until_executed``: an execution calls ``self.retry(throw=False)`` twice (two
    messages with the same retry count); the first one's ``before_start`` raises
    while the sender still runs on. As the sender ends, the lock is reserved for the
    second, which waits for its countdown (a duplicate publishes nothing) and runs;
    if the second fails to start too, before the sender ends, the lock is freed. A
    first copy that fails to start only after the hand-over frees the reservation:
    the second, waiting for its countdown, no longer holds the lock (a duplicate is
    published), and runs all the same."""
    failed = threading.Semaphore(0)
    starts: list[int] = []
    runs: list[int] = []
    seen: dict[str, str | None] = {}

    class FailsOnRetry(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries:
                starts.append(1)
                if second == "first_fails_after_the_hand_over" and len(starts) == 1:
                    wait_for(lambda: "owner" in seen, what="the sender to end")
                if len(starts) == 1 or second == "fails_to_start":
                    raise RuntimeError("not ready for the retry")

    @app.task(
        base=FailsOnRetry, bind=True, shared=False, lock_strategy="until_executed",
        lock_ttl=30, max_retries=1,
    )  # fmt: skip
    def job(self: SingletonTask) -> None:
        runs.append(int(self.request.retries))
        if runs == [0]:
            self.retry(countdown=0, throw=False)
            if second == "first_fails_after_the_hand_over":
                self.retry(countdown=1.5, throw=False)
                return
            wait_for(lambda: failed.acquire(blocking=False), what="the first copy to fail")
            if second == "runs":
                self.retry(countdown=1.5, throw=False)
            else:
                self.retry(countdown=0, throw=False)
                wait_for(lambda: failed.acquire(blocking=False), what="the second to fail")

    name = job.lock_name((), {})
    key = lock_keys(name).lock

    def on_failure(**_: Any) -> None:
        failed.release()

    def on_postrun(task: Any = None, **_: Any) -> None:
        if not task.request.retries and "owner" not in seen:
            seen["owner"] = field(redislock_client, key, OWNER_FIELD)

    task_failure.connect(on_failure, sender=job, weak=False)
    task_postrun.connect(on_postrun, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            first = job.delay()
            wait_for(lambda: "owner" in seen, what="the sender to end")
            if second == "fails_to_start":
                assert seen["owner"] is None
                assert runs == [0]
            else:
                if second == "runs":
                    assert seen["owner"] == queued_owner(first.id, 1)
                    assert job.delay().id == first.id
                else:
                    # (Or taken over as the worker accepted the first copy.)
                    assert str(seen["owner"]).endswith((queued_owner(first.id, 1), ":1"))
                    wait_for(lambda: failed.acquire(blocking=False), what="the first to fail")
                    assert _lock_free(redislock_client, name)
                    duplicate = job.delay()
                    assert duplicate.id != first.id
                    duplicate.get(timeout=15)
                wait_for(lambda: 1 in runs, what="the second copy to run")
                wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
                assert sorted(runs) == ([0, 1] if second == "runs" else [0, 0, 1])
    finally:
        task_failure.disconnect(on_failure, sender=job)
        task_postrun.disconnect(on_postrun, sender=job)
    assert _words(redislock_client) == []


@pytest.mark.parametrize(
    "lost",
    ["read", "delete", "every read", "every read, then a flush", "every read, then the exit's"],
)
def test_a_lost_answer_about_the_word_a_failed_retry_left_still_frees_the_lock(
    redislock_server: RedisServer,
    redislock_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    lost: str,
) -> None:
    """``until_executed``: the retry an execution sent with ``self.retry(throw=False)``
    fails to start while the execution runs on, and leaves word to free the lock. As
    the execution ends, the answer to its read of that word (or to its delete of it)
    is lost after the server ran it, and the request is sent again: the lock is
    freed all the same, and no word is left behind. The answer to every try of the
    read lost (the hold already went to the retry's reservation): the word is read
    again in the background once the store answers, and the reservation freed, not
    kept until lock_enqueue_ttl for a retry that never runs. A flush (as the process
    exits) does that at once, whenever the next try in the background was due; the
    flush as the process exits does it even while the try in the background is
    stuck on a connection gone dark."""
    failed = threading.Event()
    seen: dict[str, str | None] = {}
    drops = ATTEMPTS if lost.startswith("every read") else 1
    if lost == "every read, then a flush":
        monkeypatch.setattr("celery_redislock.retried.RETRY_PAUSE", 600.0)
    elif lost == "every read, then the exit's":
        monkeypatch.setattr("celery_redislock.retried.RETRY_PAUSE", 1.0)
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        app = make_app(redislock_server.url, "lostword")
        app.conf.redislock_url = proxy.url_for(0)

        class FailsOnRetry(SingletonTask):
            def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
                if self.request.retries:
                    raise RuntimeError("not ready for the retry")

        @app.task(
            base=FailsOnRetry, bind=True, shared=False, lock_strategy="until_executed",
            lock_ttl=30, lock_enqueue_ttl=600, max_retries=1,
        )  # fmt: skip
        def job(self: SingletonTask) -> None:
            if self.request.retries == 0:
                self.retry(countdown=0, throw=False)
                wait_for(failed.is_set, what="the retry's start to fail")
                wait_for(lambda: _words(redislock_client), what="the retry's word")
                # The first request about the word from here on is the read.
                proxy.drop_reply_to(
                    _words(redislock_client)[0], count=drops, skip=int(lost == "delete")
                )

        key = lock_keys(job.lock_name((), {})).lock

        def on_postrun(task: Any = None, **_: Any) -> None:
            if not task.request.retries:
                seen["owner"] = field(redislock_client, key, OWNER_FIELD)

        task_failure.connect(lambda **_: failed.set(), sender=job, weak=False)
        task_postrun.connect(on_postrun, sender=job, weak=False)
        try:
            with in_process_worker(app, concurrency=2):
                job.delay()
                wait_for(lambda: "owner" in seen, what="the sender to end")
                if lost == "every read, then a flush":
                    flush()
                elif lost == "every read, then the exit's":
                    # The try in the background goes on a connection gone dark.
                    proxy.hold_next(1)
                    wait_for(lambda: proxy.held == 1, what="the try in the background held")
                    flush(final=True)
                    assert field(redislock_client, key, OWNER_FIELD) is None
                    proxy.let_held_through()
                if lost.startswith("every read"):
                    wait_for(
                        lambda: field(redislock_client, key, OWNER_FIELD) is None,
                        timeout=10,
                        what="the reservation freed in the background",
                    )
        finally:
            task_postrun.disconnect(on_postrun, sender=job)
            close_app(app)
        assert proxy.marked_drops == drops
    if not lost.startswith("every read"):
        assert seen["owner"] is None
    assert _words(redislock_client) == []


@pytest.mark.parametrize("propagates", [False, True], ids=["caught", "propagates"])
def test_a_retry_whose_send_failed_is_not_counted_as_sent(
    app: Celery, redislock_client: redis.Redis, propagates: bool
) -> None:
    """``until_executed``: ``self.retry(throw=False)`` whose send fails (its
    arguments cannot be serialized: Celery raises ``Reject``, nothing was sent)
    sends no copy that could take the lock over. Caught, and the retry sent again
    (one message), which fails to start while the execution runs on: the lock is
    free as the execution ends, not kept for a second copy. Propagated: the
    execution ends with the lock free, not handed to the reservation of a retry
    that never comes."""
    failed = threading.Event()
    errors: list[BaseException] = []
    seen: dict[str, str | None] = {}

    class FailsOnRetry(SingletonTask):
        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            if self.request.retries:
                raise RuntimeError("not ready for the retry")

    @app.task(
        base=FailsOnRetry, bind=True, shared=False, lock_strategy="until_executed",
        lock_key="fixed", lock_ttl=30, lock_enqueue_ttl=600, max_retries=3,
    )  # fmt: skip
    def job(self: SingletonTask, **_: Any) -> None:
        if self.request.retries:
            return
        if propagates:
            self.retry(kwargs={"unsendable": object()}, countdown=0, throw=False)
        try:
            self.retry(kwargs={"unsendable": object()}, countdown=0, throw=False)
        except Reject as exc:
            errors.append(exc)
        self.retry(countdown=0, throw=False)
        wait_for(failed.is_set, what="the retry's start to fail")

    key = lock_keys(job.lock_name((), {})).lock

    def on_postrun(task: Any = None, **_: Any) -> None:
        if not task.request.retries:
            seen["owner"] = field(redislock_client, key, OWNER_FIELD)

    task_failure.connect(lambda **_: failed.set(), sender=job, weak=False)
    task_postrun.connect(on_postrun, sender=job, weak=False)
    try:
        with in_process_worker(app, concurrency=2):
            job.delay()
            wait_for(lambda: "owner" in seen, what="the sender to end")
    finally:
        task_postrun.disconnect(on_postrun, sender=job)
    assert seen["owner"] is None
    assert len(errors) == int(not propagates)


@pytest.mark.parametrize(
    ("strategy", "mode"),
    [
        ("until_executed", "fail"),
        ("until_executing", "fail"),
        ("until_executed", "run"),
        ("until_executed", "taken over"),
        ("until_executed", "made again"),
    ],
)
def test_an_until_task_that_cannot_reach_its_store_as_it_starts_frees_its_reservation(
    redislock_server: RedisServer, redislock_client: redis.Redis, strategy: str, mode: str
) -> None:
    """An ``until_*`` call is sent (its reservation made); the lock store refuses
    connections as the worker starts it, so its execution fails
    (``lock_on_redis_error="fail"``) or runs unlocked (``"run"``), never taking the
    reservation over. Once the store answers again, the reservation is freed in the
    background: the same call sent again runs, rather than return this result for
    ``lock_enqueue_ttl``; with ``"run"``, even while the unlocked body still runs.
    Only that reservation, by its owner token: a hold another execution took
    meanwhile (``"taken over"``: the lock freed and taken while the store was
    away from the worker) stays; and, tied to the reservation's fencing token (the
    message names it), so does a later reservation of the same task id, which has
    the same owner token (``"made again"``: the call sent again under that id
    once the first reservation was gone)."""
    runs: list[int] = []
    go_on = threading.Event()
    with FaultProxy("127.0.0.1", redislock_server.port) as proxy:
        app = make_app(redislock_server.url, f"away-at-start-{strategy}-{mode}")
        app.conf.redislock_url = proxy.url

        @app.task(
            base=SingletonTask, shared=False, lock_strategy=strategy, lock_key="fixed",
            lock_on_redis_error="run" if mode == "run" else "fail", lock_ttl=30,
        )  # fmt: skip
        def job(n: int) -> int:
            runs.append(n)
            if n == 1:
                wait_for(go_on.is_set, what="the test to let the first call end")
            return n

        key = lock_keys(job.lock_name((1,), {})).lock
        try:
            first = job.delay(1)
            assert field(redislock_client, key, OWNER_FIELD) == queued_owner(first.id)
            proxy.refuse()
            proxy.reset_all()
            if mode != "run":
                go_on.set()
            with in_process_worker(app, concurrency=2):
                if mode == "run":
                    wait_for(lambda: runs == [1], what="the unlocked body to run")
                else:
                    first.get(timeout=30, propagate=False)
                    assert first.failed()

                def freeing() -> list[Any]:
                    """The reservation's free, while it waits to be sent again."""
                    lanes = get_heartbeat()._lanes.values()
                    owner = queued_owner(first.id)
                    return [p for lane in lanes for p in lane.pending if owner in p.call.args]

                if mode in ("taken over", "made again"):
                    assert freeing()
                    redislock_client.delete(key)
                    name = job.lock_name((1,), {})
                    if mode == "made again":
                        owner = queued_owner(first.id)
                        other = RedisLock(
                            redislock_client, name, ttl=30, owner=owner, lease=first.id
                        )
                    else:
                        other = RedisLock(redislock_client, name, ttl=30)
                    assert other.acquire(blocking=False)
                proxy.heal()
                if mode in ("taken over", "made again"):
                    wait_for(lambda: not freeing(), what="the free to land")
                    assert other.owned()
                    other.release()
                wait_for(
                    lambda: field(redislock_client, key, OWNER_FIELD) is None,
                    timeout=10,
                    what="the reservation to be freed",
                )
                again = job.delay(2)
                assert again.id != first.id
                assert again.get(timeout=15) == 2
                go_on.set()
                if mode == "run":
                    assert first.get(timeout=15) == 1
        finally:
            go_on.set()
            proxy.heal()
            close_app(app)
    assert runs == ([1, 2] if mode == "run" else [2])


def test_a_requeued_message_that_cannot_reach_its_store_as_it_starts_frees_its_reservation(
    redislock_server: RedisServer, redislock_client: redis.Redis
) -> None:
    """``until_executed``, ``acks_late``: the first delivery raises
    ``Reject(requeue=True)``, handing its hold to the message's reservation, made
    anew with another fencing token than the one the send made (which the
    message still names). The store refuses connections as the redelivery
    starts, so it fails without taking the reservation over; once the store
    answers, that reservation is freed in the background all the same (by its
    owner token: the broker marks the message redelivered), not left for
    ``lock_enqueue_ttl``, and the same call sent again runs."""
    runs: list[int] = []
    with FaultProxy("127.0.0.1", redislock_server.port) as proxy:
        app = make_app(redislock_server.url, "requeued-away-at-start")
        app.conf.redislock_url = proxy.url

        @app.task(
            base=SingletonTask, shared=False, lock_strategy="until_executed", lock_key="fixed",
            lock_on_redis_error="fail", lock_ttl=30, acks_late=True, lock_enqueue_ttl=3600,
        )  # fmt: skip
        def job(n: int) -> int:
            runs.append(n)
            if len(runs) == 1:
                raise Reject("again", requeue=True)
            return n

        key = lock_keys(job.lock_name((1,), {})).lock

        def postrun(**_: Any) -> None:
            if runs == [1] and not proxy_refused:
                # Handed to the message's reservation: the store goes away before
                # the redelivery starts.
                proxy_refused.append(field(redislock_client, key, OWNER_FIELD))
                proxy.refuse()
                proxy.reset_all()

        proxy_refused: list[str | None] = []
        task_postrun.connect(postrun, weak=False)
        try:
            first = job.delay(1)
            with in_process_worker(app, concurrency=1):
                first.get(timeout=30, propagate=False)
                assert first.failed()
                assert proxy_refused == [queued_owner(first.id)]
                proxy.heal()
                wait_for(
                    lambda: field(redislock_client, key, OWNER_FIELD) is None,
                    timeout=20,
                    what="the reservation to be freed",
                )
                again = job.delay(2)
                assert again.id != first.id
                assert again.get(timeout=15) == 2
        finally:
            task_postrun.disconnect(postrun)
            proxy.heal()
            close_app(app)
    assert runs == [1, 2]


@pytest.mark.parametrize("end", ["retry", "reject"])
def test_a_hold_that_cannot_be_handed_to_the_redelivery_is_freed_once_the_store_answers(
    redislock_server: RedisServer, redislock_client: redis.Redis, end: str
) -> None:
    """``until_executed``, ``raise self.retry()`` (or ``Reject(requeue=True)``,
    ``acks_late``): the lock store is unreachable as the execution ends, so its
    hold cannot be handed to the reservation of the message coming back. Once the
    store answers again, that hold is freed in the background (by its owner
    token): the redelivery, waiting behind it, runs then, not once the hold's
    ``lock_ttl`` has run out; the lock is free after it."""
    runs: list[int] = []
    sender_ends = threading.Event()
    ended = threading.Event()
    healed = threading.Event()
    again = threading.Event()
    with FaultProxy("127.0.0.1", redislock_server.port) as proxy:
        app = make_app(redislock_server.url, f"hand-over-blip-{end}")
        app.conf.redislock_url = proxy.url

        @app.task(
            base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed",
            lock_ttl=60, max_retries=1, acks_late=True,
        )  # fmt: skip
        def job(self: SingletonTask) -> int:
            runs.append(len(runs))
            if len(runs) > 1:
                again.set()
                return 1
            try:
                if end == "retry":
                    raise self.retry(countdown=0)
                raise Reject("again", requeue=True)
            finally:
                wait_for(sender_ends.is_set, what="the store to go away")

        @app.task(shared=False)
        def gate() -> None:
            # Keeps the worker's only thread until the store is back: the
            # redelivery (queued behind) starts only then.
            wait_for(healed.is_set, timeout=30, what="the store to come back")

        def postrun(sender: Any, **_: Any) -> None:
            ended.set()

        task_postrun.connect(postrun, sender=job, weak=False)
        name = job.lock_name((), {})
        try:
            with in_process_worker(app, concurrency=1):
                first = job.delay()
                wait_for(lambda: runs == [0], what="the first execution")
                gate.delay()
                proxy.refuse()
                proxy.reset_all()
                sender_ends.set()
                # Its hand-over failed as it ended: the hold is still its own.
                assert ended.wait(20), "the first execution did not end"
                assert field(redislock_client, lock_keys(name).lock, OWNER_FIELD) is not None
                proxy.heal()
                healed.set()
                # Far sooner than the 60 s lock_ttl (a hang guard, not a timing).
                assert again.wait(20), "the redelivery waited for the hold to expire"
                assert first.get(timeout=15) == 1
                wait_for(lambda: _lock_free(redislock_client, name), what="a free lock")
        finally:
            task_postrun.disconnect(postrun, sender=job)
            sender_ends.set()
            healed.set()
            proxy.heal()
            close_app(app)
    assert runs == [0, 1]
