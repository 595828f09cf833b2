"""SingletonTask on an in-process worker with the solo pool (one task at a time)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import RedisLock, SingletonTask
from celery_redislock.server import RedisServer
from tests.support import (
    REDIS_6_2,
    client_left_clean,
    close_app,
    in_process_worker,
    make_app,
    server_of,
    wait_for,
)

TIMEOUT = 20


@pytest.fixture(
    scope="module",
    params=[None, pytest.param(REDIS_6_2, marks=pytest.mark.slow)],
    ids=["default", REDIS_6_2],
)
def redislock_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """The broker, results and locks of this module's worker: the default server,
    and Redis 6.2, the oldest release the package supports."""
    with server_of(request) as server:
        yield server


@pytest.fixture(scope="module")
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app whose tasks are consumed by a solo-pool worker in this process."""
    app = make_app(redislock_server.url, "solo")

    @app.task(base=SingletonTask, bind=True, shared=False, name="solo.fenced")
    def fenced(self: Any, name: str) -> int:
        return int(self.lock.token)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="solo.polite",
        on_conflict="retry",
        lock_retry_delay=0.05,
        max_retries=100,
    )
    def polite(self: Any, name: str) -> int:
        return int(self.request.retries)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="solo.patient",
        on_conflict="wait",
        lock_wait=TIMEOUT,
    )
    def patient(self: Any, name: str) -> str:
        return name

    with in_process_worker(app, pool="solo"):
        yield app
    close_app(app)


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the lock database; each test must leave no lock behind."""
    with client_left_clean(redislock_server) as client:
        yield client


def test_runs_and_releases(app: Celery, locks: redis.Redis) -> None:
    """A singleton task runs on the solo pool with a fencing token and frees its lock."""
    assert app.tasks["solo.fenced"].delay("a").get(timeout=TIMEOUT) > 0


def test_retry_does_not_block_the_only_slot(app: Celery, locks: redis.Redis) -> None:
    """on_conflict='retry' leaves the single slot free: other work runs while it waits."""
    name = uuid.uuid4().hex
    polite = app.tasks["solo.polite"]
    holder = RedisLock(locks, polite.lock_name((name,), {}), ttl=30)
    assert holder.acquire(blocking=False)
    waiting = polite.delay(name)
    wait_for(lambda: waiting.state == "RETRY", what="the duplicate to be re-queued")
    assert app.tasks["solo.fenced"].delay("other").get(timeout=TIMEOUT) > 0
    holder.release()
    assert waiting.get(timeout=TIMEOUT) >= 1


def test_wait_is_woken_by_release(app: Celery, locks: redis.Redis) -> None:
    """on_conflict='wait' blocks the slot until the holder releases, then runs."""
    name = uuid.uuid4().hex
    patient = app.tasks["solo.patient"]
    holder = RedisLock(locks, patient.lock_name((name,), {}), ttl=60)
    assert holder.acquire(blocking=False)
    result = patient.delay(name)
    wait_for(lambda: locks.zcard(holder.queue_key) == 1, what="a queued waiter")
    holder.release()
    assert result.get(timeout=TIMEOUT) == name
