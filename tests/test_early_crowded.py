"""The acquire written as the worker accepts a task (celery_redislock.early), from
several threads of one threads-pool worker at once.

Apart from ``test_early.py``: its in-process workers stay up through that module,
and one stopped while another runs in the same process sometimes has kombu's event
loop sit reading a queue poll's reply that never comes, until the broker socket's
timeout (see :func:`tests.support.make_app`): ten seconds of every run.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis
from celery import Celery

from celery_redislock import SingletonTask
from celery_redislock.server import RedisServer
from tests.support import client_left_clean, close_app, in_process_worker, make_app


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the lock database; the test must leave no lock behind."""
    with client_left_clean(redislock_server) as client:
        yield client


@pytest.fixture
def crowded(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app whose tasks run on an in-process threads pool of 8: acquires written
    ahead from several threads at once, on one transport."""
    app = make_app(redislock_server.url, "early-crowded")
    # No remote control: stopping a threads-pool worker busy with a pidbox
    # subscription sometimes leaves kombu's event loop blocked in a read of that
    # subscription, and the worker thread never ends (none of this test's business).
    app.conf.worker_enable_remote_control = False
    inside: list[int] = []
    guard = threading.Lock()
    store = redislock_server.client()

    @app.task(
        base=SingletonTask,
        shared=False,
        name="early.purchase",
        lock_on=("event",),
        on_conflict="wait",
        lock_wait=60,
    )
    def purchase(event: str, buyer: int) -> bool:
        with guard:
            inside.append(1)
            overlapping = len(inside) > 1
        try:
            sold = int(store.get(f"{event}:sold") or 0)
            time.sleep(0.002)  # a read-modify-write that a second holder would break
            if sold >= 10:
                return False
            store.set(f"{event}:sold", sold + 1)
            return not overlapping
        finally:
            with guard:
                inside.pop()

    with in_process_worker(app, pool="threads", concurrency=8):
        yield app
    store.close()
    close_app(app)


def test_threads_written_ahead_at_once_still_exclude(crowded: Celery, locks: redis.Redis) -> None:
    """50 purchases of 10 tickets on 8 threads: exactly 10 sold, never two at once."""
    event = uuid.uuid4().hex
    purchase = crowded.tasks["early.purchase"]
    results = [purchase.delay(event, buyer) for buyer in range(50)]
    outcomes = [result.get(timeout=60) for result in results]
    assert outcomes.count(True) == 10
    assert int(locks.get(f"{event}:sold") or 0) == 10
    locks.delete(f"{event}:sold")
