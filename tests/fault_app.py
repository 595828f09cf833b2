"""A Celery app for the process-fault tests that run real ``celery worker`` subprocesses.

The server URL comes from ``REDISLOCK_FAULT_URL``. Each worker consumes one
queue of its own (``-Q``), so a test decides which worker runs which message.
Every execution records what it saw in Redis lists (``log:<kind>``), and its
writes go to the fenced resource of :mod:`tests.fault_children`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis

from celery_redislock import LockLostError, SingletonTask
from celery_redislock.lock import lock_keys
from tests.fault_children import fenced_write
from tests.support import make_app

URL = os.environ.get("REDISLOCK_FAULT_URL", "redis://127.0.0.1:6379/0")
#: The fenced resource the tasks write to.
RESOURCE = "resource"
#: The TTL of ``fenced``'s lock, in seconds.
TTL = 1.5

app = make_app(URL, "faults")
app.conf.update(worker_prefetch_multiplier=1)
store = redis.Redis.from_url(URL)


def log(kind: str, **fields: Any) -> None:
    """Append one JSON record to the ``log:<kind>`` list."""
    store.rpush(f"log:{kind}", json.dumps(fields))


# shared=False: a test process that imports this module must not hand these tasks
# to every Celery app it creates later.
@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_ttl=TTL,
    on_conflict="wait",
    lock_wait=30,
    lock_on=("key",),
)
def fenced(self: Any, key: str, label: str, seconds: float) -> str:
    """Write to the fenced resource for up to ``seconds``, checking the lock before each write.

    Logs ``start`` (token, pid), ``renewed`` once the hold has outlived its TTL,
    and ``end`` with the outcome: ``done`` (time is up), ``lost-before-write``
    (``self.lock.check()`` raised before the next write) or ``write-rejected``
    (the fence refused a write), plus what ``self.lock`` said afterwards.
    """
    token = self.lock.token
    lock_hash = lock_keys(self.lock.key)[0]
    log("start", label=label, token=token, pid=os.getpid())
    started = time.monotonic()
    outcome, renewed = "done", False
    while time.monotonic() - started < seconds:
        try:
            self.lock.check()
        except LockLostError:
            outcome = "lost-before-write"
            break
        if not renewed and time.monotonic() - started > TTL + 0.2:
            log("renewed", label=label)
            renewed = True
        if not fenced_write(store, RESOURCE, token, label, lock_hash):
            outcome = "write-rejected"
            break
        time.sleep(0.02)  # the pace of the writes
    try:
        self.lock.check()
    except LockLostError:
        check_raised = True
    else:
        check_raised = False
    log("end", label=label, outcome=outcome, lost=self.lock.lost, check_raised=check_raised)
    return outcome
