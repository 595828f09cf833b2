"""A Celery app for the worker soak: each kind of ``SingletonTask`` writing to a
fenced resource while :mod:`tests.test_soak_workers` injects faults.

The broker and the log are on one server (``REDISLOCK_SOAK_BROKER``,
``REDISLOCK_SOAK_LOG``), the locks on another (``REDISLOCK_SOAK_LOCK``, which the
workers reach through a fault proxy), on a primary its Sentinels name
``REDISLOCK_SOAK_LOCK_MASTER``, or on the Redis Cluster of the nodes
``REDISLOCK_SOAK_LOCK_CLUSTER`` lists. Every body logs when it starts (with its
fencing token) and when it ends (with what it was told of its lock), so the test
can check afterwards that no two bodies of one lock ran at once unless the older
was told it had lost its lock.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from redis.cluster import ClusterNode, RedisCluster

from celery_redislock import LockLostError, SingletonTask
from tests.fault_children import fenced_write

#: The lists the bodies log to: ``soak:start`` and ``soak:end``.
START, END = "soak:start", "soak:end"
#: Seconds a soak task's lock lives without renewal: short, so that a worker frozen
#: for a few seconds outlives it.
TTL = 2.0
#: How long after its last check of the lock a write may land before the gap
#: counts as a pause (the process frozen between the two): the fence, not the
#: check, is what protects the resource then.
PAUSE = 0.3


broker = os.environ.get("REDISLOCK_SOAK_BROKER", "redis://127.0.0.1:6379/1")
app = Celery("soak", broker=broker, backend=broker, set_as_current=False)
app.conf.update(
    redislock_url=os.environ.get("REDISLOCK_SOAK_LOCK", "redis://127.0.0.1:6379/0"),
    task_default_queue="soak",
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    result_expires=None,
)
if os.environ.get("REDISLOCK_SOAK_LOCK_CLUSTER"):
    # The lock store is a Redis Cluster: these nodes' ``host:port``, comma-separated.
    nodes = [node.rsplit(":", 1) for node in os.environ["REDISLOCK_SOAK_LOCK_CLUSTER"].split(",")]
    app.conf.redislock_client = lambda: RedisCluster(
        startup_nodes=[ClusterNode(host, int(port)) for host, port in nodes]  # type: ignore[no-untyped-call,unused-ignore]
    )
if os.environ.get("REDISLOCK_SOAK_LOCK_MASTER"):
    # The lock store is a Sentinel-managed primary (REDISLOCK_SOAK_LOCK: sentinel://...).
    app.conf.redislock_transport_options = {"master_name": os.environ["REDISLOCK_SOAK_LOCK_MASTER"]}
if os.environ.get("REDISLOCK_SOAK_VISIBILITY_TIMEOUT"):
    # Whole workers are killed: what they had taken comes back after this long.
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ["REDISLOCK_SOAK_VISIBILITY_TIMEOUT"])
    }
log_store = redis.Redis.from_url(
    os.environ.get("REDISLOCK_SOAK_LOG", "redis://127.0.0.1:6379/2"), socket_timeout=10
)


def record(where: str, task: Any, **fields: Any) -> None:
    """Append one JSON record about the running ``task`` to the list ``where``."""
    request = task.request
    fields.update(id=request.id, pid=os.getpid(), node=request.hostname, at=time.time())
    log_store.rpush(where, json.dumps(fields))


def body(task: Any, kind: str, key: str, seconds: float) -> str:
    """Write to the resource of ``kind`` and ``key`` for ``seconds``, checking the
    lock before each write; log the start and the end with the outcome: ``done``,
    ``lost`` (the check raised) or ``refused`` (the fence refused a write, and how
    long after the last check it was made)."""
    token = task.lock.token
    record(START, task, kind=kind, key=key, token=token)
    ends = time.monotonic() + seconds
    outcome, gap = "done", 0.0
    while True:
        checked = time.monotonic()
        try:
            task.lock.check()
        except LockLostError:
            outcome = "lost"
            break
        writer = f"{task.request.id}/{os.getpid()}"
        if not fenced_write(log_store, f"resource:{kind}:{key}", token, writer, None):
            outcome, gap = "refused", time.monotonic() - checked
            break
        if time.monotonic() >= ends:
            break
        time.sleep(0.02)
    record(
        END, task, kind=kind, key=key, token=token, outcome=outcome, gap=gap, lost=task.lock.lost
    )
    return outcome


# One kind of task per duplicate mode and strategy; the lock is on ``key`` alone.
@app.task(
    base=SingletonTask, bind=True, shared=False, name="soak.wait",
    lock_ttl=TTL, lock_on=("key",), on_conflict="wait", lock_wait=60,
)  # fmt: skip
def wait(self: Any, key: str, index: int, seconds: float) -> str:
    """Waits its turn."""
    return body(self, "wait", key, seconds)


@app.task(
    base=SingletonTask, bind=True, shared=False, name="soak.skip",
    lock_ttl=TTL, lock_on=("key",),
)  # fmt: skip
def skip(self: Any, key: str, index: int, seconds: float) -> str:
    """Skipped when its lock is held."""
    return body(self, "skip", key, seconds)


@app.task(
    base=SingletonTask, bind=True, shared=False, name="soak.retry",
    lock_ttl=TTL, lock_on=("key",), on_conflict="retry", lock_retry_delay=0.1, max_retries=6,
)  # fmt: skip
def retry(self: Any, key: str, index: int, seconds: float) -> str:
    """Retried later when its lock is held (6 times at most: countdowns of 0.1 s
    doubling each time, so the last is 10 s at most)."""
    return body(self, "retry", key, seconds)


@app.task(
    base=SingletonTask, bind=True, shared=False, name="soak.until",
    lock_ttl=TTL, lock_on=("key",), lock_strategy="until_executed", lock_enqueue_ttl=120,
    acks_late=True,
)  # fmt: skip
def until(self: Any, key: str, index: int, seconds: float) -> str:
    """Locked from its send until it has run, acknowledged once it has."""
    return body(self, "until", key, seconds)


@app.task(
    base=SingletonTask, bind=True, shared=False, name="soak.replicated",
    lock_ttl=TTL, lock_on=("key",), lock_min_replicas=1,
)  # fmt: skip
def replicated(self: Any, key: str, index: int, seconds: float) -> str:
    """Taken only once a replica has its lock (a store with replicas only), skipped
    when it is held."""
    return body(self, "replicated", key, seconds)


KINDS: tuple[Any, ...] = (wait, skip, retry, until)
if os.environ.get("REDISLOCK_SOAK_LOCK_MASTER") or os.environ.get("REDISLOCK_SOAK_LOCK_CLUSTER"):
    KINDS += (replicated,)
