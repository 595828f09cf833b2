"""What an until_* duplicate gets at enqueue (lock_on_duplicate), and lock options set
for one call (apply_async(lock_options={...})), applied at enqueue and by the worker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import DuplicateTaskError, SingletonTask
from celery_redislock.server import RedisServer
from celery_redislock.testing import run_worker
from tests.support import close_app, gate, held, make_app, wait_for

TIMEOUT = 20


@pytest.fixture(scope="module")
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app with the test tasks, and a real threads-pool worker consuming its queue."""
    app = make_app(redislock_server.url, "call-options")

    @app.task(base=SingletonTask, shared=False, name="co.queued", lock_strategy="until_executed")
    def queued(name: str) -> str:
        gate(name).wait(TIMEOUT)
        return name

    @app.task(
        base=SingletonTask,
        shared=False,
        name="co.strict",
        lock_strategy="until_executed",
        lock_on_duplicate="raise",
    )
    def strict(name: str) -> str:
        gate(name).wait(TIMEOUT)
        return name

    @app.task(base=SingletonTask, bind=True, shared=False, name="co.report")
    def report(self: Any, name: str) -> dict[str, Any]:
        gate(name).wait(TIMEOUT)
        opts = self.lock.options
        return {"ttl": opts.ttl, "on_conflict": opts.on_conflict}

    with run_worker(app, concurrency=4):
        yield app
    close_app(app)


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the lock database."""
    client = redislock_server.client()
    yield client
    client.close()


def key_of(task: Any, name: str) -> str:
    """The Redis key of ``task``'s lock for ``name``."""
    return f"redislock:{{{task.lock_name((name,), {})}}}"


def test_duplicate_returns_the_holders_result_by_default(app: Celery, locks: redis.Redis) -> None:
    """An until_executed duplicate sent while the first is queued publishes nothing and
    returns the first one's AsyncResult (lock_on_duplicate="return")."""
    name = uuid.uuid4().hex
    first = app.tasks["co.queued"].delay(name)
    again = app.tasks["co.queued"].delay(name)
    assert again.id == first.id
    gate(name).set()
    assert first.get(timeout=TIMEOUT) == name


def test_duplicate_raises_with_on_duplicate_raise(app: Celery, locks: redis.Redis) -> None:
    """With lock_on_duplicate="raise", a duplicate raises DuplicateTaskError naming the
    task that holds the key, and sends nothing."""
    name = uuid.uuid4().hex
    strict = app.tasks["co.strict"]
    first = strict.delay(name)
    with pytest.raises(DuplicateTaskError) as excinfo:
        strict.delay(name)
    assert excinfo.value.holder == first.id
    assert excinfo.value.name == strict.lock_name((name,), {})
    gate(name).set()
    assert first.get(timeout=TIMEOUT) == name
    wait_for(lambda: not held(locks, key_of(strict, name)), what="the key to be freed")


def test_per_call_on_duplicate(app: Celery, locks: redis.Redis) -> None:
    """lock_options={"on_duplicate": "raise"} makes one call raise, the task's default
    staying "return" for others."""
    name = uuid.uuid4().hex
    task = app.tasks["co.queued"]
    first = task.delay(name)
    with pytest.raises(DuplicateTaskError):
        task.apply_async((name,), lock_options={"on_duplicate": "raise"})
    assert task.delay(name).id == first.id
    gate(name).set()
    assert first.get(timeout=TIMEOUT) == name


def test_per_call_options_reach_the_worker(app: Celery, locks: redis.Redis) -> None:
    """lock_options={"ttl": ...} sent with a call is what the worker locks with: the
    running task's lock carries that TTL; other calls keep the task's own."""
    name = uuid.uuid4().hex
    report = app.tasks["co.report"]
    result = report.apply_async((name,), lock_options={"ttl": 7.5, "on_conflict": "raise"})
    key = key_of(report, name)
    wait_for(lambda: held(locks, key), what="the task to take its lock")
    assert 0 < locks.pttl(key) <= 7_500
    gate(name).set()
    assert result.get(timeout=TIMEOUT) == {"ttl": 7.5, "on_conflict": "raise"}


@pytest.mark.parametrize(
    ("overrides", "error", "named"),
    [
        ({"prefix": "x"}, ValueError, "'prefix'"),
        ({"strategy": "until_executed"}, ValueError, "'strategy'"),
        ({"ttl": -1}, ValueError, "lock_options['ttl']"),
        ({"on_duplicate": "ignore"}, ValueError, "lock_options['on_duplicate']"),
        (["ttl"], TypeError, "lock_options"),
    ],
)
def test_bad_per_call_options_raise_at_send(
    app: Celery, overrides: Any, error: type[Exception], named: str
) -> None:
    """A per-call override that is not allowed, or has a bad value, raises when sending,
    naming it."""
    with pytest.raises(error) as excinfo:
        app.tasks["co.report"].apply_async(("x",), lock_options=overrides)
    assert named in str(excinfo.value)


def test_per_call_options_apply_to_apply(app: Celery) -> None:
    """``apply()`` takes ``lock_options`` too: the task runs here with them, and a bad
    one raises, naming it."""
    name = uuid.uuid4().hex
    gate(name).set()
    report = app.tasks["co.report"]
    result = report.apply((name,), lock_options={"ttl": 7.5, "on_conflict": "raise"})
    assert result.get() == {"ttl": 7.5, "on_conflict": "raise"}
    with pytest.raises(ValueError, match=r"lock_options\['ttl'\]"):
        report.apply((name,), lock_options={"ttl": -1})
