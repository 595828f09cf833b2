"""SingletonTask against a real Redis and a real in-process Celery worker (threads pool)."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery, chain, chord, group, xmap, xstarmap
from celery.exceptions import Ignore, Reject
from celery.result import AsyncResult
from redis.cluster import RedisCluster

from celery_redislock import (
    LockBackendError,
    LockConflictError,
    LockLostError,
    RedisLock,
    SingletonTask,
    TaskSkippedError,
    is_skipped,
)
from celery_redislock.admin import force_release
from celery_redislock.heartbeat import get_heartbeat
from celery_redislock.scripts import FENCE_FIELD, LEASE_FIELD, OWNER_FIELD
from celery_redislock.server import RedisServer, free_port
from celery_redislock.task import EXPIRES_GRACE, OPTIONS, LockOptions, queued_owner
from tests.support import (
    client_left_clean,
    close_app,
    field,
    gate,
    held,
    in_process_worker,
    lock_keys,
    make_app,
    record,
    runs,
    wait_for,
)

TIMEOUT = 20
ROOT = Path(__file__).resolve().parent.parent

#: The option attributes that fall back to app.conf.
OPTION_NAMES = [option.attribute for option in OPTIONS]

#: Touches SingletonTask (``argv[1]``: help, app, getmembers) before or after
#: configuring an app (``argv[2]``), defines a task on it and one on a second app,
#: and prints what they resolved and what the base class reads as.
TOUCH_SCRIPT = """
import contextlib, inspect, io, json, sys
from celery import Celery
from celery_redislock import SingletonTask
from celery_redislock.task import OPTIONS

def touch():
    if sys.argv[1] == "help":
        with contextlib.redirect_stdout(io.StringIO()):
            help(SingletonTask)
    elif sys.argv[1] == "app":
        SingletonTask.app
    else:
        inspect.getmembers(SingletonTask)

if sys.argv[2] == "before":
    touch()
first = Celery("first")
first.conf.update(redislock_ttl=10, redislock_on_conflict="raise", redislock_prefix="first-locks")
if sys.argv[2] == "after":
    touch()

@first.task(base=SingletonTask, shared=False)
def one(): ...

second = Celery("second", set_as_current=False)
second.conf.update(redislock_ttl=20, redislock_on_conflict="retry")

@second.task(base=SingletonTask, shared=False)
def two(): ...

def seen(task):
    opts = task.lock_options
    return {"ttl": opts.ttl, "on_conflict": opts.on_conflict, "prefix": opts.prefix}

base = {o.attribute: getattr(SingletonTask, o.attribute) for o in OPTIONS}
print(json.dumps({"first": seen(one), "second": seen(two), "base": base}))
"""


def define_tasks(app: Celery) -> SimpleNamespace:
    """Register the tasks the tests drive; returns them by name."""

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.hold")
    def hold(self: Any, name: str, extra: int = 0) -> int | None:
        record("hold", (name, self.request.id, self.lock.token))
        gate(name).wait(TIMEOUT)
        return self.lock.token  # type: ignore[no-any-return]

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.hold_raise", on_conflict="raise")
    def hold_raise(self: Any, name: str) -> str:
        record("hold_raise", name)
        gate(name).wait(TIMEOUT)
        return "done"

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.hold_wait",
        on_conflict="wait",
        lock_wait=TIMEOUT,
        lock_on=("name",),
    )
    def hold_wait(self: Any, name: str, who: str) -> str:
        record("hold_wait", who)
        gate(f"{name}:{who}").wait(TIMEOUT)
        return who

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.short_wait",
        on_conflict="wait",
        lock_wait=0.2,
    )
    def short_wait(self: Any, name: str) -> str:
        gate(name).wait(TIMEOUT)
        return "done"

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.hold_retry",
        on_conflict="retry",
        lock_retry_delay=0.05,
        max_retries=50,
    )
    def hold_retry(self: Any, name: str) -> int:
        record("hold_retry", (name, self.request.retries))
        gate(name).wait(TIMEOUT)
        return int(self.request.retries)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.retry_exhausted",
        on_conflict="retry",
        lock_retry_delay=0.01,
        max_retries=2,
    )
    def retry_exhausted(self: Any, name: str) -> str:
        return "ran"

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.self_retry", max_retries=3)
    def self_retry(self: Any, name: str) -> int:
        record("self_retry", self.request.retries)
        if self.request.retries < 2:
            raise self.retry(countdown=0.05)
        return int(self.request.retries)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.until_executed",
        lock_strategy="until_executed",
        max_retries=3,
    )
    def until_executed(self: Any, name: str, retry_countdown: float = 0) -> int:
        record("until_executed", (name, self.request.retries))
        gate(f"{name}:{self.request.retries}").wait(TIMEOUT)
        if retry_countdown and self.request.retries == 0:
            raise self.retry(countdown=retry_countdown)
        return int(self.request.retries)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.retry_expiring",
        lock_strategy="until_executed",
        max_retries=1,
    )
    def retry_expiring(self: Any, name: str, queue: str) -> None:
        raise self.retry(countdown=600, expires=2, queue=queue)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.retry_expiring_running_on",
        lock_strategy="until_executed",
        max_retries=1,
    )
    def retry_expiring_running_on(
        self: Any, name: str, queue: str, expires: float, run_on: float
    ) -> str:
        self.retry(expires=expires, queue=queue, throw=False)
        time.sleep(run_on)
        return "done"

    @app.task(
        base=SingletonTask,
        shared=False,
        name="t.until_executed_expiring",
        lock_strategy="until_executed",
        expires=30,
    )
    def until_executed_expiring(name: str) -> str:
        return name

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.until_executing",
        lock_strategy="until_executing",
    )
    def until_executing(self: Any, name: str) -> str:
        record("until_executing", name)
        gate(name).wait(TIMEOUT)
        return "done"

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.until_executing_retry",
        lock_strategy="until_executing",
        max_retries=1,
    )
    def until_executing_retry(self: Any, name: str) -> int:
        record("until_executing_retry", (name, self.request.retries))
        gate(f"{name}:{self.request.retries}").wait(TIMEOUT)
        if self.request.retries == 0:
            raise self.retry(countdown=0.2)
        return int(self.request.retries)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.until_executed_rejects",
        lock_strategy="until_executed",
    )
    def until_executed_rejects(self: Any, name: str) -> None:
        raise Reject("again later", requeue=True)

    @app.task(
        base=SingletonTask,
        shared=False,
        bind=True,
        name="t.until_executed_other_args",
        lock_strategy="until_executed",
        lock_ttl=60,
    )
    def until_executed_other_args(self: Any, name: str) -> str:
        if not name.endswith("-again"):
            raise self.retry(args=(f"{name}-again",), countdown=0)
        return name

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.ends")
    def ends(self: Any, how: str) -> str:
        if how == "ignore":
            raise Ignore()
        if how == "reject":
            raise Reject("no", requeue=False)
        if how == "error":
            raise RuntimeError("boom")
        return how

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.lose", lock_ttl=0.6)
    def lose(self: Any, name: str) -> str:
        assert self.lock.held
        self.lock.check()
        redis.Redis.from_url(app.conf.redislock_url).delete(f"redislock:{{{self.lock.key}}}")
        wait_for(lambda: self.lock.lost, what="the heartbeat to notice the lost lock")
        try:
            self.lock.check()
        except LockLostError:
            return "stopped"
        return "not stopped"

    @app.task(base=SingletonTask, shared=False, bind=True, name="t.recurse", lock_key="one")
    def recurse(self: Any, depth: int) -> Any:
        if depth == 0:
            return "inner"
        stored = redis.Redis.from_url(app.conf.redislock_url)
        key = f"redislock:{{{self.lock.key}}}"
        before = stored.get(key)
        inner = recurse(depth - 1)  # a plain function call, inside the locked execution
        return [inner, before == stored.get(key), self.lock.lost]

    @app.task(shared=False, name="t.note_error")
    def note_error(request: Any, exc: Any, traceback: Any) -> None:
        record("note_error", request.id)

    @app.task(base=SingletonTask, shared=False, name="t.add")
    def add(x: int, y: int) -> int:
        record("add", (x, y))
        return x + y

    @app.task(shared=False, name="t.plain_hold")
    def plain_hold(name: str) -> str:
        gate(name).wait(TIMEOUT)
        return name

    return SimpleNamespace(**{t.__name__: t for t in [
        hold, hold_raise, hold_wait, short_wait, hold_retry, retry_exhausted, self_retry,
        until_executed, until_executing, ends, lose, add, plain_hold, recurse, note_error,
        until_executing_retry, until_executed_rejects, until_executed_other_args,
        until_executed_expiring, retry_expiring, retry_expiring_running_on,
    ]})  # fmt: skip


@pytest.fixture(scope="module")
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """A Celery app on the session server with the test tasks registered."""
    app = make_app(redislock_server.url)
    app.tasks_ns = define_tasks(app)
    yield app
    close_app(app)


@pytest.fixture(scope="module")
def tasks(app: Celery) -> SimpleNamespace:
    """The registered test tasks."""
    return app.tasks_ns  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def worker(app: Celery) -> Iterator[Any]:
    """A real worker (threads pool, 6 slots) consuming in this process."""
    with in_process_worker(app, concurrency=6) as worker:
        yield worker


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the lock database; every test must leave no lock held and no waiter
    queued behind."""
    with client_left_clean(redislock_server, queues_too=True) as client:
        yield client


def _drop_queue(server: RedisServer, queue: str) -> None:
    """Delete broker queue ``queue`` (the tasks' broker: ``server``'s database 1)."""
    broker = redis.Redis.from_url(server.url.rsplit("/", 1)[0] + "/1")
    broker.delete(queue)
    broker.close()


def unique(prefix: str) -> str:
    """A name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def running(kind: str, match: object) -> bool:
    """Whether a task recorded ``match`` (or a tuple starting with it)."""
    return any(v == match or (isinstance(v, tuple) and v[0] == match) for v in runs(kind))


@pytest.mark.usefixtures("worker")
class TestConflictModes:
    """What a duplicate does at execution time."""

    def test_skip_resolves_with_holder(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """A skipped duplicate's result resolves and names the lock and holder task id."""
        name = unique("skip")
        first = tasks.hold.delay(name)
        wait_for(lambda: running("hold", name))
        second = tasks.hold.delay(name=name, extra=0)  # same call, other spelling
        outcome = second.get(timeout=TIMEOUT)
        gate(name).set()
        token = first.get(timeout=TIMEOUT)
        assert is_skipped(outcome)
        assert outcome["holder"] == first.id
        assert outcome["lock_name"] == outcome["lock_key"]
        assert outcome["lock_name"].startswith("t.hold:")
        assert isinstance(token, int)

    def test_raise_names_key_and_holder(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """on_conflict='raise' fails the duplicate with LockConflictError naming the holder."""
        name = unique("raise")
        first = tasks.hold_raise.delay(name)
        wait_for(lambda: running("hold_raise", name))
        second = tasks.hold_raise.delay(name)
        with pytest.raises(LockConflictError) as excinfo:
            second.get(timeout=TIMEOUT)
        gate(name).set()
        assert first.get(timeout=TIMEOUT) == "done"
        assert excinfo.value.holder == first.id
        assert first.id in str(excinfo.value)
        assert "t.hold_raise:" in str(excinfo.value)

    def test_wait_runs_after_holder(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """on_conflict='wait' runs the duplicate right after the holder releases, never together."""
        name = unique("wait")
        first = tasks.hold_wait.delay(name, "a")
        wait_for(lambda: "a" in runs("hold_wait"))
        second = tasks.hold_wait.delay(name, "b")
        time.sleep(0.3)  # give the duplicate a chance to (wrongly) start
        assert "b" not in runs("hold_wait")
        gate(f"{name}:a").set()
        gate(f"{name}:b").set()
        assert first.get(timeout=TIMEOUT) == "a"
        assert second.get(timeout=TIMEOUT) == "b"

    def test_wait_gives_up(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """on_conflict='wait' fails like 'raise' once lock_wait has passed."""
        name = unique("short")
        first = tasks.short_wait.delay(name)
        wait_for(lambda: held(locks, f"redislock:{{{tasks.short_wait.lock_name((name,), {})}}}"))
        with pytest.raises(LockConflictError) as excinfo:
            tasks.short_wait.delay(name).get(timeout=TIMEOUT)
        gate(name).set()
        first.get(timeout=TIMEOUT)
        assert "after waiting 0.2 s" in str(excinfo.value)

    def test_retry_requeues_until_free(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """on_conflict='retry' re-queues the duplicate, which runs once the lock is free."""
        name = unique("retry")
        first = tasks.hold_retry.delay(name)
        wait_for(lambda: running("hold_retry", name))
        second = tasks.hold_retry.delay(name)
        wait_for(lambda: second.state == "RETRY", what="the duplicate to be re-queued")
        gate(name).set()
        assert first.get(timeout=TIMEOUT) == 0
        assert second.get(timeout=TIMEOUT) >= 1

    def test_retry_is_bounded(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """on_conflict='retry' gives up after max_retries with LockConflictError."""
        name = unique("exhaust")
        key = tasks.retry_exhausted.lock_name((name,), {})
        from celery_redislock import RedisLock

        blocker = RedisLock(locks, key, ttl=30)
        assert blocker.acquire(blocking=False)
        try:
            with pytest.raises(LockConflictError):
                tasks.retry_exhausted.delay(name).get(timeout=TIMEOUT)
        finally:
            blocker.release()


@pytest.mark.usefixtures("worker")
class TestEndPaths:
    """Every way a task can end frees (or keeps) its lock as documented."""

    @pytest.mark.parametrize("how", ["ok", "error", "ignore", "reject"])
    def test_lock_freed_on_every_end(
        self, how: str, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """Success, exception, Ignore and Reject all release the lock."""
        result = tasks.ends.delay(how)
        if how == "ok":
            assert result.get(timeout=TIMEOUT) == "ok"
        elif how == "error":
            with pytest.raises(RuntimeError):
                result.get(timeout=TIMEOUT)
        else:
            key = f"redislock:{{{tasks.ends.lock_name((how,), {})}}}"
            wait_for(lambda: not held(locks, key) and bool(runs_of_fence(locks, key)))

    def test_self_retry_really_requeues(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """self.retry() is re-queued and each attempt runs under the lock, which ends free."""
        result = tasks.self_retry.delay(unique("selfretry"))
        assert result.get(timeout=TIMEOUT) == 2

    def test_lost_lock_is_visible_in_body(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """A lock lost mid-task flips self.lock.lost and check() raises LockLostError."""
        assert tasks.lose.delay(unique("lose")).get(timeout=TIMEOUT) == "stopped"

    def test_fencing_tokens_increase(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """Successive executions on one key see strictly increasing fencing tokens."""
        name = unique("fence")
        tokens = []
        for _ in range(3):
            result = tasks.hold.delay(name)
            gate(name).set()
            tokens.append(result.get(timeout=TIMEOUT))
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == 3


def runs_of_fence(client: redis.Redis, key: str) -> bool:
    """Whether the lock at ``key`` was ever taken (its key keeps a fencing token)."""
    return bool(field(client, key, FENCE_FIELD))


@pytest.mark.usefixtures("worker")
class TestEnqueueStrategies:
    """until_executed and until_executing take the lock when the task is sent."""

    def test_until_executed_dedupes_enqueue(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A duplicate sent while the first is pending publishes nothing and gets its result."""
        name = unique("ue")
        first = tasks.until_executed.delay(name)
        second = tasks.until_executed.delay(name)
        assert second.id == first.id
        wait_for(lambda: running("until_executed", name))
        third = tasks.until_executed.apply_async((name,))
        assert third.id == first.id
        gate(f"{name}:0").set()
        assert first.get(timeout=TIMEOUT) == 0
        assert [v for v in runs("until_executed") if v[0] == name] == [(name, 0)]
        wait_for(lambda: not lock_keys(locks))
        again = tasks.until_executed.delay(name)
        assert again.id != first.id
        gate(f"{name}:0").set()
        again.get(timeout=TIMEOUT)

    def test_until_executed_survives_retry_countdown(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """Through a self.retry(countdown) the lock stays taken and the retry takes it back."""
        name = unique("uer")
        first = tasks.until_executed.delay(name, retry_countdown=1.0)
        gate(f"{name}:0").set()
        wait_for(lambda: first.state == "RETRY", what="the retry")
        assert tasks.until_executed.delay(name, retry_countdown=1.0).id == first.id
        gate(f"{name}:1").set()
        assert first.get(timeout=TIMEOUT) == 1

    def test_until_executed_outlives_countdown(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A lock taken for a countdown task lives at least as long as the countdown."""
        name = unique("uec")
        first = tasks.until_executed.apply_async((name,), countdown=2)
        key = f"redislock:{{{tasks.until_executed.lock_name((name,), {})}}}"
        assert locks.pttl(key) > 3_600_000  # lock_enqueue_ttl (1 h) plus the countdown
        assert tasks.until_executed.apply_async((name,)).id == first.id
        gate(f"{name}:0").set()
        assert first.get(timeout=TIMEOUT) == 0

    def test_a_group_of_queued_duplicates_resolves(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A group waits for each member's own id: a member whose key is held is sent
        all the same and meets on_conflict as it starts, so the group resolves."""
        name = unique("ueg")
        result = group(tasks.until_executed.s(name), tasks.until_executed.s(name)).apply_async()
        wait_for(lambda: running("until_executed", name))
        wait_for(lambda: any(is_skipped(r.result) for r in result.results), what="the skip")
        gate(f"{name}:0").set()
        outcomes = result.get(timeout=TIMEOUT)
        assert sorted(outcomes, key=is_skipped)[0] == 0
        assert is_skipped(outcomes[0]) != is_skipped(outcomes[1])

    def test_a_chain_whose_first_step_is_queued_already_fails(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A chain's step whose key is held is sent all the same: skipped as it starts, it
        fails the chain (TaskSkippedError) instead of leaving it waiting for ever."""
        name = unique("uec")
        first = tasks.until_executed.delay(name)
        wait_for(lambda: running("until_executed", name))
        result = chain(tasks.until_executed.si(name), tasks.add.si(1, 2)).apply_async()
        with pytest.raises(TaskSkippedError):
            result.get(timeout=TIMEOUT)
        gate(f"{name}:0").set()
        assert first.get(timeout=TIMEOUT) == 0

    def test_a_link_callback_that_duplicates_a_pending_call_is_not_sent(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A ``link`` callback is sent by the worker as a task of its own, with no
        workflow options: a duplicate of a call still pending is deduplicated like
        any other send, not published, and its own id never gets a result."""
        name = unique("uel")
        first = tasks.until_executed.delay(name)
        wait_for(lambda: running("until_executed", name))
        callback = tasks.until_executed.si(name)
        callback_id = callback.freeze().id
        assert tasks.add.apply_async((1, 2), link=callback).get(timeout=TIMEOUT) == 3
        gate(f"{name}:0").set()
        assert first.get(timeout=TIMEOUT) == 0
        # Sent after the callback would have been: run by now, had it been sent.
        assert tasks.add.delay(2, 2).get(timeout=TIMEOUT) == 4
        wait_for(lambda: not lock_keys(locks), what="the lock to be freed")
        assert runs("until_executed").count((name, 0)) == 1
        assert AsyncResult(callback_id, app=tasks.add.app).state == "PENDING"

    def test_an_until_executing_group_of_duplicates_runs_each(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """An until_executing member whose key is held is sent all the same and runs:
        its lock is released as it starts."""
        name = unique("uingg")
        result = group(tasks.until_executing.s(name), tasks.until_executing.s(name)).apply_async()
        wait_for(lambda: runs("until_executing").count(name) == 2, what="both members")
        gate(name).set()
        assert result.get(timeout=TIMEOUT) == ["done", "done"]

    def test_until_executing_retry_behind_a_pending_copy_is_sent(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """The retry of a running until_executing task is sent even if another copy is
        pending meanwhile (its key held): the retried task still ends, not in RETRY
        for ever."""
        name = unique("uingr")
        task = tasks.until_executing_retry
        first = task.delay(name)
        wait_for(lambda: (name, 0) in runs("until_executing_retry"), what="the first run")
        # Its countdown outlasts the first run's retry, sent as soon as the gate opens.
        pending = task.apply_async((name,), countdown=1.5)
        assert pending.id != first.id
        gate(f"{name}:0").set()
        gate(f"{name}:1").set()
        assert first.get(timeout=TIMEOUT) == 1
        assert pending.get(timeout=TIMEOUT) is not None

    def test_duplicate_of_a_holder_that_is_no_task_raises(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """With lock_on_duplicate="return", a key held by a plain RedisLock (no task,
        so no result to return) makes the send raise LockConflictError."""
        name = unique("uenotask")
        holder = RedisLock(locks, tasks.until_executed.lock_name((name,), {}), ttl=30)
        assert holder.acquire()
        with pytest.raises(LockConflictError):
            tasks.until_executed.delay(name)
        holder.release()

    def test_retry_lock_outlives_its_countdown(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """The lock taken again for a retry lives its enqueue_ttl plus the countdown:
        with a countdown longer than the enqueue_ttl, it is still held while the
        retry waits."""
        name = unique("uecd")
        first = tasks.until_executed.apply_async((name, 2.0), lock_options={"enqueue_ttl": 1})
        gate(f"{name}:0").set()
        wait_for(lambda: first.state == "RETRY", what="the retry")
        key = f"redislock:{{{tasks.until_executed.lock_name((name, 2.0), {})}}}"
        assert locks.pttl(key) > 1_000
        gate(f"{name}:1").set()
        assert first.get(timeout=TIMEOUT) == 1

    def test_an_own_retry_is_sent_whatever_lock_on_duplicate_says(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """An until_executed task's self.retry(), whose lock another task holds by
        then, is sent all the same, with lock_on_duplicate="raise" too: it meets
        on_conflict as it starts rather than be lost."""
        name = unique("ueown")
        # The retry's countdown outlasts the intruder's hold, let go once it is sent.
        first = tasks.until_executed.apply_async(
            (name, 1.5), lock_options={"on_duplicate": "raise"}
        )
        lock_name = tasks.until_executed.lock_name((name, 1.5), {})
        wait_for(lambda: running("until_executed", name))
        force_release(locks, lock_name)
        intruder = RedisLock(locks, lock_name, ttl=30, lease="intruder")
        assert intruder.acquire(blocking=False)
        gate(f"{name}:0").set()
        wait_for(lambda: first.state == "RETRY", what="the retry")
        intruder.release()
        gate(f"{name}:1").set()
        assert first.get(timeout=TIMEOUT) == 1

    def test_a_sent_retry_with_other_arguments_frees_the_first_lock(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """An until_executed task whose self.retry() goes out with other arguments
        (another lock) releases its own lock: nobody was handed it."""
        name = unique("ueargs")
        first = tasks.until_executed_other_args.delay(name)
        assert first.get(timeout=TIMEOUT) == f"{name}-again"
        key = f"redislock:{{{tasks.until_executed_other_args.lock_name((name,), {})}}}"
        wait_for(lambda: not held(locks, key), what="the first lock to be released")

    def test_reject_with_requeue_keeps_the_lock_for_the_redelivery(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """An until_executed task rejected with requeue=True keeps its lock, for the
        message that comes back (same task id): handed to the message's reservation,
        which its next delivery takes over at once and nobody else can."""
        name = unique("uerej")
        result = tasks.until_executed_rejects.apply((name,))
        lock_name = tasks.until_executed_rejects.lock_name((name,), {})
        key = f"redislock:{{{lock_name}}}"
        assert held(locks, key)
        assert field(locks, key, LEASE_FIELD) == result.id
        assert field(locks, key, OWNER_FIELD) == queued_owner(result.id)
        # For lock_ttl, as the hold it replaced: no redelivery may come at all.
        assert 0 < locks.pttl(key) <= tasks.until_executed_rejects.lock_options.ttl * 1000
        assert not RedisLock(locks, lock_name, ttl=5, lease="another").acquire(blocking=False)
        redelivery = RedisLock(locks, lock_name, ttl=5, lease=result.id, heartbeat=False)
        assert redelivery.acquire(blocking=False)
        redelivery.release()

    def test_a_chain_whose_last_step_is_queued_already_resolves(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A chain's last step (sent with an empty list of steps after it) whose key is
        held is sent all the same: it resolves as skipped instead of leaving the chain
        waiting for ever."""
        name = unique("uecl")
        first = tasks.until_executed.delay(name)
        wait_for(lambda: running("until_executed", name))
        result = chain(tasks.add.si(1, 2), tasks.until_executed.si(name)).apply_async()
        assert is_skipped(result.get(timeout=TIMEOUT))
        gate(f"{name}:0").set()
        assert first.get(timeout=TIMEOUT) == 0

    def test_a_task_id_with_a_colon_takes_its_own_lock_over(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """The execution of a message sent with an id of its own that has a colon in
        it (``report:42``) takes over the lock sent with it, runs, and frees it."""
        name = unique("colon")
        result = tasks.until_executed.apply_async((name,), task_id=f"report:{uuid.uuid4()}")
        gate(f"{name}:0").set()
        assert result.get(timeout=TIMEOUT) == 0

    def test_retry_keeps_the_options_of_its_call(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """``self.retry()`` sends the task again with the lock options of its call: the
        lock taken for the retry has the call's ``enqueue_ttl``, not the task's."""
        name = unique("ueo")
        first = tasks.until_executed.apply_async((name, 2.0), lock_options={"enqueue_ttl": 100})
        gate(f"{name}:0").set()
        wait_for(lambda: first.state == "RETRY", what="the retry")
        key = f"redislock:{{{tasks.until_executed.lock_name((name, 2.0), {})}}}"
        assert 0 < locks.pttl(key) <= 102_000
        gate(f"{name}:1").set()
        assert first.get(timeout=TIMEOUT) == 1

    def test_send_task_by_name_still_locks_at_execution(
        self, app: Celery, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """until_executed sent by name (no enqueue lock) still locks when it runs."""
        name = unique("byname")
        first = app.send_task("t.until_executed", args=(name,))
        wait_for(lambda: running("until_executed", name))
        second = app.send_task("t.until_executed", args=(name,))
        outcome = second.get(timeout=TIMEOUT)
        gate(f"{name}:0").set()
        assert first.get(timeout=TIMEOUT) == 0
        assert is_skipped(outcome)
        assert outcome["holder"] == first.id

    def test_until_executing_frees_at_start(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """until_executing dedupes while queued and frees the key once the body starts."""
        name = unique("uing")
        key = f"redislock:{{{tasks.until_executing.lock_name((name,), {})}}}"
        first = tasks.until_executing.delay(name)
        wait_for(lambda: running("until_executing", name))
        assert not held(locks, key)
        second = tasks.until_executing.delay(name)
        assert second.id != first.id
        gate(name).set()
        assert first.get(timeout=TIMEOUT) == "done"
        assert second.get(timeout=TIMEOUT) == "done"

    @pytest.mark.parametrize("strategy", ["until_executing", "until_executed"])
    def test_a_send_after_the_queued_message_expired_is_sent_and_runs(
        self,
        redislock_server: RedisServer,
        tasks: SimpleNamespace,
        locks: redis.Redis,
        strategy: str,
    ) -> None:
        """A reservation lasts no longer than its message's ``expires`` (plus
        EXPIRES_GRACE): once the message has expired unrun, a send of the same call
        is published, not deduplicated to a message that never runs."""
        name, nobody = unique("uexp"), unique("nobody")  # a queue no worker consumes
        task = getattr(tasks, strategy)
        key = f"redislock:{{{task.lock_name((name,), {})}}}"
        try:
            first = task.apply_async((name,), expires=0.5, queue=nobody)
            assert 0 < locks.pttl(key) <= (0.5 + EXPIRES_GRACE) * 1000
            wait_for(lambda: not held(locks, key), what="the reservation to end")
            second = task.apply_async((name,))
            assert second.id != first.id
            gate(name).set()
            gate(f"{name}:0").set()
            assert second.get(timeout=TIMEOUT) in ("done", 0)
        finally:
            _drop_queue(redislock_server, nobody)

    @pytest.mark.parametrize(
        ("expires", "left"),
        [
            (lambda: 30, 30),
            (lambda: 30.0, 30),
            (lambda: datetime.now(timezone.utc) + timedelta(seconds=30), 30),
            (lambda: datetime.now(timezone(timedelta(hours=-5))) + timedelta(seconds=30), 30),
            (lambda: datetime.now(timezone.utc).replace(tzinfo=None) + timedelta(seconds=30), 30),
            (lambda: (datetime.now(timezone.utc) + timedelta(seconds=30)).isoformat(), 30),
            (None, 30),
        ],
        ids=["int", "float", "aware", "aware-other-zone", "naive-utc", "iso", "task"],
    )
    def test_a_reservation_lasts_until_its_message_expires(
        self,
        redislock_server: RedisServer,
        tasks: SimpleNamespace,
        locks: redis.Redis,
        expires: Callable[[], object] | None,
        left: float,
    ) -> None:
        """``expires`` as Celery takes it (seconds, a datetime, naive read as UTC, ISO
        text; or the task's own ``expires`` when the call names none) bounds the
        reservation, a countdown past it or not."""
        name, nobody = unique("uexpt"), unique("nobody")
        task = tasks.until_executed_expiring if expires is None else tasks.until_executed
        key = f"redislock:{{{task.lock_name((name,), {})}}}"
        options = {} if expires is None else {"expires": expires()}
        try:
            task.apply_async((name,), queue=nobody, countdown=600, **options)
            pttl = locks.pttl(key)
            assert max(0, left - 1) * 1000 < pttl <= (left + EXPIRES_GRACE) * 1000
        finally:
            locks.delete(key)
            _drop_queue(redislock_server, nobody)

    def test_a_retrys_reservation_lasts_until_the_retry_expires(
        self, redislock_server: RedisServer, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """The reservation an until_executed execution hands its retry as it ends
        lasts no longer than until the retry's message expires (plus EXPIRES_GRACE),
        its countdown notwithstanding."""
        name, nobody = unique("rexp"), unique("nobody")
        task = tasks.retry_expiring
        key = f"redislock:{{{task.lock_name((name, nobody), {})}}}"
        try:
            result = task.delay(name, nobody)
            wait_for(
                lambda: field(locks, key, OWNER_FIELD) == queued_owner(result.id, 1),
                what="the hand-over to the retry's reservation",
            )
            assert 0 < locks.pttl(key) <= (2 + EXPIRES_GRACE) * 1000
        finally:
            locks.delete(key)
            _drop_queue(redislock_server, nobody)

    def test_a_retry_that_expired_as_its_sender_ran_on_is_handed_no_reservation(
        self, redislock_server: RedisServer, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """An until_executed execution that sent its retry with ``expires`` and ran
        on past the retry's expiry (plus EXPIRES_GRACE) frees the lock as it ends,
        rather than handing it to the reservation of a retry nobody runs: the same
        call sent then is published, not deduplicated to that retry."""
        name, nobody = unique("rexpon"), unique("nobody")
        task = tasks.retry_expiring_running_on
        # Runs on until its retry has expired, the grace after it included.
        call = (name, nobody, 0.1, 0.1 + EXPIRES_GRACE + 0.4)
        key = f"redislock:{{{task.lock_name(call, {})}}}"
        try:
            first = task.delay(*call)
            assert first.get(timeout=TIMEOUT) == "done"
            assert not held(locks, key)
            again = task.apply_async(call, queue=nobody)
            assert again.id != first.id
        finally:
            locks.delete(key)
            _drop_queue(redislock_server, nobody)

    def test_a_retry_handed_over_late_keeps_only_what_was_left_of_its_reservation(
        self, redislock_server: RedisServer, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """The reservation an until_executed execution that ran on hands its retry
        (sent with ``expires``) ends when the retry expires (plus EXPIRES_GRACE),
        counted from the send: what the sender ran meanwhile is not added."""
        name, nobody = unique("rexpleft"), unique("nobody")
        task = tasks.retry_expiring_running_on
        call = (name, nobody, 2.0, 1.0)
        key = f"redislock:{{{task.lock_name(call, {})}}}"
        try:
            first = task.delay(*call)
            assert first.get(timeout=TIMEOUT) == "done"
            assert field(locks, key, OWNER_FIELD) == queued_owner(first.id, 1)
            # At most 2 s + EXPIRES_GRACE from the send, of which 1 s is gone.
            assert 0 < locks.pttl(key) <= (2.0 + EXPIRES_GRACE - 0.5) * 1000
        finally:
            locks.delete(key)
            _drop_queue(redislock_server, nobody)

    @pytest.mark.parametrize("strategy", ["until_executing", "until_executed"])
    @pytest.mark.parametrize(
        "expires",
        [lambda: datetime.now(timezone.utc) - timedelta(seconds=30), lambda: 0],
        ids=["past", "zero"],
    )
    def test_a_message_expired_as_it_is_sent_takes_no_reservation(
        self,
        tasks: SimpleNamespace,
        locks: redis.Redis,
        strategy: str,
        expires: Callable[[], object],
    ) -> None:
        """A send whose ``expires`` has already passed is published (the worker
        drops it unrun) without a reservation: the same call sent next is
        published too, and runs."""
        name = unique("uexpd")
        task = getattr(tasks, strategy)
        key = f"redislock:{{{task.lock_name((name,), {})}}}"
        first = task.apply_async((name,), expires=expires())
        assert not held(locks, key)
        second = task.apply_async((name,))
        assert second.id != first.id
        gate(name).set()
        gate(f"{name}:0").set()
        assert second.get(timeout=TIMEOUT) in ("done", 0)

    def test_revoked_in_queue_frees_lock(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """Revoking a queued until_executed task frees its lock."""
        name = unique("revoke")
        key = f"redislock:{{{tasks.until_executed.lock_name((name,), {})}}}"
        result = tasks.until_executed.apply_async((name,), countdown=1)
        assert held(locks, key)
        result.revoke()
        wait_for(lambda: not held(locks, key), what="the revoked task's lock to go")
        assert not running("until_executed", name)


@pytest.mark.usefixtures("worker")
class TestWorkflows:
    """Chains, groups and chords containing singleton tasks."""

    def test_chain_of_singletons(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """A chain of singleton tasks runs each under its lock and passes results on."""
        result = chain(tasks.add.s(1, 2), tasks.add.s(10)).apply_async()
        assert result.get(timeout=TIMEOUT) == 13

    def test_skip_inside_chain_fails_the_chain(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A duplicate skipped inside a chain raises TaskSkippedError instead of passing on a marker."""
        name = unique("chain")
        first = tasks.hold.delay(name)
        wait_for(lambda: running("hold", name))
        result = chain(tasks.hold.s(name), tasks.add.s(1, 2)).apply_async()
        with pytest.raises(TaskSkippedError) as excinfo:
            result.get(timeout=TIMEOUT)
        gate(name).set()
        first.get(timeout=TIMEOUT)
        assert excinfo.value.holder == first.id

    def test_skip_as_a_chains_last_step_with_error_callbacks_fails(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A duplicate skipped as a chain's last step, with error callbacks, fails with
        TaskSkippedError, and the error callbacks run."""
        name = unique("last")
        first = tasks.hold.delay(name)
        wait_for(lambda: running("hold", name))
        result = chain(tasks.add.s(1, 2), tasks.hold.si(name)).apply_async(
            link_error=tasks.note_error.s()
        )
        with pytest.raises(TaskSkippedError):
            result.get(timeout=TIMEOUT)
        wait_for(lambda: result.id in runs("note_error"), what="the error callback")
        gate(name).set()
        first.get(timeout=TIMEOUT)

    def test_skip_as_a_chains_last_step_without_callbacks_resolves(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A duplicate skipped as a chain's last step, with nothing attached, resolves
        as skipped like a task on its own: the chain's result is the marker."""
        name = unique("lastplain")
        first = tasks.hold.delay(name)
        wait_for(lambda: running("hold", name))
        result = chain(tasks.add.s(1, 2), tasks.hold.si(name)).apply_async()
        assert is_skipped(result.get(timeout=TIMEOUT))
        gate(name).set()
        first.get(timeout=TIMEOUT)

    def test_skip_inside_chord_fails_the_chord(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """A duplicate skipped in a chord header fails the chord; the callback does not run."""
        name = unique("chord")
        first = tasks.hold.delay(name)
        wait_for(lambda: running("hold", name))
        result = chord([tasks.hold.s(name), tasks.add.s(1, 1)], tasks.add.si(100, 0)).apply_async()
        with pytest.raises(TaskSkippedError):
            result.get(timeout=TIMEOUT, propagate=True)
        gate(name).set()
        first.get(timeout=TIMEOUT)
        assert (100, 0) not in runs("add")

    def test_group_of_duplicates(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """A group of same-key singletons: one runs, the others resolve as skipped."""
        name = unique("group")
        result = group(tasks.hold.s(name) for _ in range(3)).apply_async()
        wait_for(lambda: running("hold", name))
        time.sleep(0.2)
        gate(name).set()
        outcomes = result.get(timeout=TIMEOUT)
        assert sum(1 for o in outcomes if is_skipped(o)) >= 1
        assert sum(1 for o in outcomes if isinstance(o, int)) >= 1


class TestEager:
    """apply() and task_always_eager lock exactly like a worker."""

    def test_apply_skips_when_held(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """apply() of a duplicate while the key is held returns the skip marker."""
        from celery_redislock import RedisLock

        key = tasks.add.lock_name((5, 6), {})
        holder = RedisLock(locks, key, ttl=30, lease="someone")
        assert holder.acquire(blocking=False)
        try:
            outcome = tasks.add.apply((5, 6)).get()
        finally:
            holder.release()
        assert is_skipped(outcome)
        assert outcome["holder"] == "someone"
        assert tasks.add.apply((5, 6)).get() == 11

    def test_eager_self_retry(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """An eager self.retry() runs the retries inline and leaves no lock."""
        assert tasks.self_retry.apply((unique("eager"),)).get() == 2

    def test_always_eager_until_executed(
        self, app: Celery, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """With task_always_eager, until_executed runs at once and frees its lock."""
        name = unique("always")
        gate(f"{name}:0").set()
        app.conf.task_always_eager = True
        try:
            assert tasks.until_executed.delay(name).get() == 0
        finally:
            app.conf.task_always_eager = False

    def test_direct_call_is_plain(self, tasks: SimpleNamespace, locks: redis.Redis) -> None:
        """Calling the task object directly runs the function without a lock."""
        assert tasks.add(2, 3) == 5

    def test_a_batch_signature_built_by_hand_runs_its_items_unlocked(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """xmap/xstarmap built from celery.canvas around the task's signature are
        not refused: their items are direct calls, which run while the lock is held
        (where apply() of the same call is skipped)."""
        holders = [
            RedisLock(locks, task.lock_name(args, {}), ttl=30, lease="someone")
            for task, args in ((tasks.add, (5, 6)), (tasks.ends, ("fine",)))
        ]
        assert all(holder.acquire(blocking=False) for holder in holders)
        try:
            assert is_skipped(tasks.add.apply((5, 6)).get())
            assert is_skipped(tasks.ends.apply(("fine",)).get())
            assert xstarmap(tasks.add.s(), [(5, 6)]).apply().get() == [11]
            assert xmap(tasks.ends.s(), ["fine"]).apply().get() == ["fine"]
        finally:
            for holder in holders:
                holder.release()

    @pytest.mark.parametrize(
        ("method", "items", "runner", "instead"),
        [
            ("chunks", ([(1, 2), (1, 2)], 1), "starmap", "task.s(*args)"),
            ("map", ([1, 1],), "map", "task.s(arg)"),
            ("starmap", ([(1, 2), (1, 2)],), "starmap", "task.s(*args)"),
        ],
    )
    def test_batch_signatures_that_would_run_items_unlocked_are_refused(
        self, tasks: SimpleNamespace, method: str, items: tuple[Any, ...], runner: str, instead: str
    ) -> None:
        """chunks(), map() and starmap() run each item as a direct call inside
        Celery's celery.map/celery.starmap task, which takes no lock: refused, the
        message saying why and what to send instead (a group of signatures, which
        locks: test_group_of_duplicates)."""
        with pytest.raises(TypeError) as raised:
            getattr(tasks.add, method)(*items)
        message = str(raised.value)
        assert f"{method}() of task 't.add'" in message
        assert f"celery.{runner} task" in message
        assert "a direct call takes no lock" in message
        assert f"group({instead} for " in message

    @pytest.mark.usefixtures("worker")
    def test_a_task_calling_itself_in_its_body_is_a_plain_call(
        self, tasks: SimpleNamespace, locks: redis.Redis
    ) -> None:
        """Inside the body, calling the task object is a plain function call too: it
        neither takes the lock (the same name here) nor frees the one the body holds."""
        assert tasks.recurse.delay(1).get(timeout=TIMEOUT) == ["inner", True, False]


class TestRedisTrouble:
    """The redislock_on_redis_error policy when the lock store is away."""

    def make(self, mode: str, store: str = "url") -> Any:
        """A task whose lock store is away: a ``redislock_url`` of a closed port, or
        (``store="cluster client"``) a ``redislock_client`` callable making a
        ``RedisCluster`` there, which fails as it is made."""
        port = free_port()
        app = Celery("trouble", set_as_current=False)
        app.conf.update(redislock_on_redis_error=mode)
        if store == "url":
            app.conf.redislock_url = f"redis://127.0.0.1:{port}/0"
        else:
            app.conf.redislock_client = lambda: RedisCluster(host="127.0.0.1", port=port)

        @app.task(base=SingletonTask, bind=True, shared=False, name=f"trouble.{mode}")
        def body(self: Any) -> str:
            record("trouble", mode)
            return "held" if self.lock.held else "unlocked"

        return body

    @pytest.mark.parametrize("store", ["url", "cluster client"])
    def test_fail_runs_no_body(self, store: str) -> None:
        """'fail' (default): the task fails with LockBackendError and the body never
        runs; a RedisCluster that a redislock_client callable cannot make too."""
        task = self.make("fail", store)
        result = task.apply()
        assert isinstance(result.result, LockBackendError)
        assert "fail" not in runs("trouble")

    @pytest.mark.parametrize("store", ["url", "cluster client"])
    def test_run_fails_open(self, caplog: pytest.LogCaptureFixture, store: str) -> None:
        """'run': the body runs unlocked and a warning is logged; a RedisCluster that a
        redislock_client callable cannot make too."""
        task = self.make("run", store)
        caplog.set_level(logging.WARNING, logger="celery_redislock")
        assert task.apply().get() == "unlocked"
        assert "unlocked" in caplog.text


class TestOptions:
    """Invalid options fail when the task is defined, naming the option."""

    @pytest.mark.parametrize(
        ("options", "named"),
        [
            ({"on_conflict": "explode"}, "on_conflict"),
            ({"lock_strategy": "sometimes"}, "lock_strategy"),
            ({"lock_ttl": -1}, "lock_ttl"),
            ({"lock_ttl": "10"}, "lock_ttl"),
            ({"lock_enqueue_ttl": 0}, "lock_enqueue_ttl"),
            ({"lock_wait": 0}, "lock_wait"),
            ({"lock_on_redis_error": "ignore"}, "lock_on_redis_error"),
            ({"lock_on": "event_id"}, "lock_on"),
            ({"lock_on": ("nope",)}, "lock_on"),
            ({"lock_key": 42}, "lock_key"),
            ({"lock_prefix": "a{}b"}, "lock_prefix"),
            ({"lock_prefix": ""}, "lock_prefix"),
            ({"lock_prefix": 5}, "lock_prefix"),
            ({"lock_url": "http://x"}, "lock_url"),
            ({"lock_url": 5}, "lock_url"),
        ],
    )
    def test_bad_task_option(self, options: dict[str, Any], named: str) -> None:
        """A bad task option raises at definition, and the message names it."""
        app = Celery("opts", set_as_current=False)
        app.finalize()
        with pytest.raises((ValueError, TypeError)) as excinfo:

            @app.task(base=SingletonTask, shared=False, **options)
            def purchase(event_id: int, user_id: int) -> None: ...

        assert named in str(excinfo.value)

    def test_bad_conf_names_setting(self) -> None:
        """A bad app.conf value names the redislock_* setting it came from."""
        app = Celery("conf", set_as_current=False)
        app.conf.redislock_on_conflict = "sometimes"
        app.finalize()
        with pytest.raises(ValueError) as excinfo:

            @app.task(base=SingletonTask, shared=False)
            def job() -> None: ...

        assert "app.conf.redislock_on_conflict" in str(excinfo.value)

    def test_conf_defaults_apply(self) -> None:
        """Options left unset take app.conf.redislock_* values; explicit ones win."""
        app = Celery("conf2", set_as_current=False)
        app.conf.update(redislock_ttl=12, redislock_on_conflict="raise")
        app.finalize()

        @app.task(base=SingletonTask, shared=False, on_conflict="wait")
        def job() -> None: ...

        assert job.lock_ttl == 12
        assert job.on_conflict == "wait"
        assert job.lock_strategy == "while_executing"
        assert job.lock_options == LockOptions(
            ttl=12.0,
            enqueue_ttl=3600.0,
            strategy="while_executing",
            on_conflict="wait",
            wait=30.0,
            retry_delay=1.0,
            on_redis_error="fail",
            min_replicas=0,
            on_duplicate="return",
            prefix="redislock",
            url=None,
        )

    def test_options_read_as_set_on_classes(self) -> None:
        """An option reads as in effect on a task, as set (None: unset) on its class and on the base."""
        app = Celery("reads", set_as_current=False)
        app.conf.redislock_ttl = 12
        app.finalize()

        @app.task(base=SingletonTask, shared=False, on_conflict="wait")
        def job() -> None: ...

        assert (job.lock_ttl, job.on_conflict) == (12, "wait")
        assert (type(job).lock_ttl, type(job).on_conflict) == (None, "wait")
        assert all(getattr(SingletonTask, option) is None for option in OPTION_NAMES)

    def test_options_object_is_frozen(self) -> None:
        """A task's resolved LockOptions cannot be changed after binding."""
        app = Celery("frozen", set_as_current=False)
        app.finalize()

        @app.task(base=SingletonTask, shared=False)
        def job() -> None: ...

        with pytest.raises(dataclasses.FrozenInstanceError) as excinfo:
            job.lock_options.ttl = 1.0
        assert "ttl" in str(excinfo.value)

    @pytest.mark.parametrize("when", ["before", "after"])
    @pytest.mark.parametrize("touch", ["help", "app", "getmembers"])
    def test_touching_the_base_changes_nothing(self, touch: str, when: str) -> None:
        """Touching SingletonTask before or after configuring an app leaves later tasks on their app's settings."""
        # A fresh interpreter: binding the base to Celery's default app cannot be undone.
        process = subprocess.run(
            [sys.executable, "-c", TOUCH_SCRIPT, touch, when],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=ROOT,
        )
        assert process.returncode == 0, process.stderr
        seen = json.loads(process.stdout.splitlines()[-1])
        assert seen["first"] == {"ttl": 10.0, "on_conflict": "raise", "prefix": "first-locks"}
        assert seen["second"] == {"ttl": 20.0, "on_conflict": "retry", "prefix": "redislock"}
        assert seen["base"] == dict.fromkeys(OPTION_NAMES)

    def test_touched_abstract_base_of_yours_is_left_alone(self) -> None:
        """A base class of yours bound by being touched keeps only what it set; its tasks resolve per app."""

        class Base(SingletonTask):
            lock_ttl = 7

        Base.app  # noqa: B018 - binds the abstract base to the current app
        app = Celery("abstract", set_as_current=False)
        app.conf.update(redislock_on_conflict="raise", redislock_ttl=99)
        app.finalize()

        @app.task(base=Base, shared=False)
        def job() -> None: ...

        assert (job.lock_options.ttl, job.lock_options.on_conflict) == (7.0, "raise")
        assert (Base.lock_ttl, Base.on_conflict) == (7, None)

    def test_class_based_subclass_inherits_parent_options(self) -> None:
        """A task class subclassing another inherits the options its parent set, not what it resolved."""

        class Report(SingletonTask):
            lock_ttl = 10
            on_conflict = "raise"

            def run(self, account: int) -> None: ...

        class NightlyReport(Report):
            lock_strategy = "until_executed"

        app = Celery("chain", set_as_current=False)
        app.conf.update(redislock_ttl=99, redislock_on_conflict="wait", redislock_wait=5)
        report = app.register_task(Report())
        nightly = app.register_task(NightlyReport())
        other = Celery("chain2", set_as_current=False)
        other.conf.update(redislock_wait=8, redislock_strategy="until_executing")
        elsewhere = other.register_task(Report())

        assert (nightly.lock_options.ttl, nightly.lock_options.on_conflict) == (10.0, "raise")
        assert (nightly.lock_options.strategy, nightly.lock_options.wait) == ("until_executed", 5)
        assert (report.lock_options.strategy, report.lock_options.wait) == ("while_executing", 5)
        assert (elsewhere.lock_options.strategy, elsewhere.lock_options.wait) == (
            "until_executing",
            8,
        )
        assert (NightlyReport.lock_wait, NightlyReport.lock_strategy) == (None, "until_executed")
        assert "lock_ttl" not in NightlyReport.__dict__

    def test_broker_url_is_default_store(self) -> None:
        """Without redislock_url the lock store is the broker when it is Redis."""
        app = Celery("b", broker="redis://127.0.0.1:6390/3", set_as_current=False)

        @app.task(base=SingletonTask, shared=False)
        def job() -> None: ...

        kwargs = job.lock_client.connection_pool.connection_kwargs
        assert (kwargs["port"], kwargs["db"]) == (6390, 3)

    def test_non_redis_broker_needs_url(self) -> None:
        """With a non-Redis broker and no redislock_url the error says what to set."""
        app = Celery("b", broker="amqp://guest@localhost//", set_as_current=False)

        @app.task(base=SingletonTask, shared=False)
        def job() -> None: ...

        with pytest.raises(ValueError) as excinfo:
            job.lock_client  # noqa: B018
        assert "redislock_url" in str(excinfo.value)

    def test_class_based_task_lock_key(self) -> None:
        """A lock_key function set on a class-based task is called with the task's arguments only."""

        def key_of(account: int, full: bool = False) -> int:
            return account

        class Report(SingletonTask):
            lock_key = key_of

            def run(self, account: int, full: bool = False) -> None: ...

        app = Celery("cls", set_as_current=False)
        app.conf.redislock_url = "redis://127.0.0.1:1/0"
        task = app.register_task(Report())
        assert task.lock_name((1,), {}) == task.lock_name((1,), {"full": True})
        assert task.lock_name((1,), {}) != task.lock_name((2,), {})

    @pytest.mark.parametrize(
        ("setting", "value", "error"),
        [
            ("redislock_prefix", "a{}b", ValueError),
            ("redislock_prefix", 5, TypeError),
            ("redislock_url", "http://x", ValueError),
            ("redislock_url", 5, TypeError),
        ],
    )
    def test_bad_setting_fails_at_definition(
        self, setting: str, value: object, error: type[Exception]
    ) -> None:
        """A bad redislock_prefix/redislock_url raises when the task is defined, naming the setting."""
        app = Celery("conf3", set_as_current=False)
        app.conf[setting] = value
        app.finalize()
        with pytest.raises(error) as excinfo:

            @app.task(base=SingletonTask, shared=False)
            def job() -> None: ...

        assert f"app.conf.{setting}" in str(excinfo.value)

    @pytest.mark.parametrize(
        "url", ["redis://127.0.0.1:6391/0", "rediss://127.0.0.1:6391/0", "unix:///tmp/r.sock"]
    )
    def test_redis_url_schemes_accepted(self, url: str) -> None:
        """redis://, rediss:// and unix:// URLs are accepted as lock_url and as redislock_url."""
        app = Celery("schemes", set_as_current=False)
        app.conf.redislock_url = url
        app.finalize()

        @app.task(base=SingletonTask, shared=False)
        def job() -> None: ...

        @app.task(base=SingletonTask, shared=False, lock_url=url)
        def own() -> None: ...

        assert job.lock_client is own.lock_client
        assert own.lock_options.url == url

    def test_bad_url_set_late_fails_at_use(self) -> None:
        """A redislock_url set after the task was defined is checked when read, with the same
        message (which the check at definition gives after the task's name)."""
        app = Celery("late-bad", set_as_current=False)
        app.conf.redislock_url = "http://user:secret@example.com"
        app.finalize()
        with pytest.raises(ValueError) as at_definition:

            @app.task(base=SingletonTask, shared=False, name="late-bad.early")
            def early() -> None: ...

        app.conf.redislock_url = None

        @app.task(base=SingletonTask, shared=False, name="late-bad.job")
        def job() -> None: ...

        app.conf.redislock_url = "http://user:secret@example.com"
        with pytest.raises(ValueError) as at_use:
            job.lock_client  # noqa: B018
        assert str(at_definition.value).startswith("task 'late-bad.early' (")
        assert f": {at_use.value}; fix app.conf.redislock_url" in str(at_definition.value)
        assert "app.conf.redislock_url" in str(at_use.value)
        assert "secret" not in str(at_use.value)

    def test_lock_store_follows_late_configuration(self) -> None:
        """The lock store URL is read from app.conf at use, so configuring the app late works."""
        app = Celery("late", set_as_current=False)
        app.finalize()

        @app.task(base=SingletonTask, shared=False)
        def job() -> None: ...

        app.conf.redislock_url = "redis://127.0.0.1:6391/0"
        assert job.lock_client.connection_pool.connection_kwargs["port"] == 6391
        app.conf.redislock_url = "redis://127.0.0.1:6392/0"
        assert job.lock_client.connection_pool.connection_kwargs["port"] == 6392


class TestEnqueueEdges:
    """The enqueue side of until_* strategies, without a worker."""

    def test_failed_send_frees_the_lock(self, redislock_server: RedisServer) -> None:
        """If the broker refuses the message, the until_executed lock taken for it is freed."""
        app = Celery("nobroker", set_as_current=False)
        app.conf.update(
            broker_url=f"redis://127.0.0.1:{free_port()}/0",
            redislock_url=redislock_server.url,
            task_publish_retry=False,
            broker_connection_timeout=1,
            broker_connection_retry=False,
            broker_connection_max_retries=0,
        )

        @app.task(base=SingletonTask, shared=False, lock_strategy="until_executed")
        def job(n: int) -> None: ...

        client = redislock_server.client()
        with pytest.raises(Exception) as excinfo:
            job.delay(uuid.uuid4().int)
        assert not isinstance(excinfo.value, LockConflictError)
        assert lock_keys(client) == []
        app.close()

    def test_prefix_option(self, redislock_server: RedisServer) -> None:
        """lock_prefix puts the task's lock under another key prefix."""
        app = make_app(redislock_server.url, "prefixed")

        @app.task(base=SingletonTask, bind=True, shared=False, lock_prefix="shop-locks")
        def job(self: Any) -> list[str]:
            client = redis.Redis.from_url(app.conf.redislock_url)
            return sorted(k.decode() for k in client.scan_iter("shop-locks:*"))

        keys = job.apply().get()
        assert keys == [f"shop-locks:{{{job.lock_name((), {})}}}"]
        close_app(app)


def test_interruption_right_after_acquire_releases(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception raised between taking the lock and running the body still frees it."""
    app = make_app(redislock_server.url, "interrupted")

    @app.task(base=SingletonTask, shared=False)
    def job() -> str:
        return "ran"

    def interrupted(*_: object) -> None:
        raise RuntimeError("interrupted just after the acquire")

    monkeypatch.setattr("celery_redislock.task.LockHandle", interrupted)
    result = job.apply()
    assert isinstance(result.result, RuntimeError)
    client = redislock_server.client()
    assert not held(client, f"redislock:{{{job.lock_name((), {})}}}")
    assert all(
        not lock.key.endswith(f"{{{job.lock_name((), {})}}}") for lock in get_heartbeat().held()
    )
    close_app(app)


def test_retry_countdown_grows_jittered_and_capped() -> None:
    """The retry countdown doubles per retry, is jittered 0.5-1.5x, and never exceeds
    MAX_RETRY_DELAY, jitter included."""
    from celery_redislock.task import MAX_RETRY_DELAY, retry_countdown

    first = [retry_countdown(2.0, 0) for _ in range(200)]
    assert all(1.0 <= c <= 3.0 for c in first)
    third = [retry_countdown(2.0, 2) for _ in range(200)]
    assert all(4.0 <= c <= 12.0 for c in third)
    assert all(retry_countdown(250.0, retries) <= MAX_RETRY_DELAY for retries in range(60))
    assert max(retry_countdown(250.0, 0) for _ in range(500)) == MAX_RETRY_DELAY
