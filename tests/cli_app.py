"""A Celery app for the ``celery redislock`` command tests.

Imported twice: by the test process, which runs its tasks on an in-process
worker (configured with ``configure_app``), and by the command under test
(``celery -A tests.cli_app redislock …``), which reads the server URL from
``REDISLOCK_TEST_URL``. A task holds its lock until the test sets ``go:<name>``
in Redis (``cliapp.waiting`` waits for its lock first, if another holds it),
so the two processes share the same picture. With
``REDISLOCK_TEST_CLUSTER`` (ports of Redis Cluster nodes on the loopback, separated
by commas), the locks live in that cluster, through a ``redislock_client``
callable as the documentation shows it. ``REDISLOCK_TEST_BACKEND_URL`` moves the
result backend elsewhere; ``REDISLOCK_TEST_ELSEWHERE_URL`` adds a task whose locks
live in a store of its own at that URL, and ``REDISLOCK_TEST_MISCONFIGURED`` a task
with an invalid option value (the command's side only: the test process imports
this module without them).
"""

from __future__ import annotations

import os
import time

import redis
from redis.cluster import ClusterNode, RedisCluster

from celery_redislock import SingletonTask
from celery_redislock.testing import configure_app
from tests.support import make_app

app = make_app(os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6379/0"), "cliapp")
if os.environ.get("REDISLOCK_TEST_LOCK_URL"):
    app.conf.redislock_url = os.environ["REDISLOCK_TEST_LOCK_URL"]
if os.environ.get("REDISLOCK_TEST_BACKEND_URL"):
    app.conf.result_backend = os.environ["REDISLOCK_TEST_BACKEND_URL"]
if os.environ.get("REDISLOCK_TEST_CLUSTER"):
    _ports = os.environ["REDISLOCK_TEST_CLUSTER"].split(",")
    _nodes = [ClusterNode("127.0.0.1", int(port)) for port in _ports]  # type: ignore[no-untyped-call]
    app.conf.redislock_client = lambda: RedisCluster(startup_nodes=_nodes)


def store() -> redis.Redis:
    """A client to the lock store (the go signals live there too)."""
    return redis.Redis.from_url(str(app.conf.redislock_url))


@app.task(base=SingletonTask, bind=True, shared=False, name="cliapp.report")
def report(self: SingletonTask, account_id: int, full: bool = False) -> int:
    """Hold the lock until ``go:<account_id>`` is set (at most 30 s); return the fence."""
    deadline = time.monotonic() + 30
    client = store()
    while not client.exists(f"go:{account_id}") and time.monotonic() < deadline:
        time.sleep(0.01)
    client.close()
    return self.lock.fence


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    name="cliapp.waiting",
    on_conflict="wait",
    lock_wait=30,
    lock_on=("account_id",),
)
def waiting(self: SingletonTask, account_id: int, go: str) -> int:
    """Wait for the lock of ``account_id`` while another holds it, then hold it until
    ``go:<go>`` is set (at most 30 s); return the fence."""
    deadline = time.monotonic() + 30
    client = store()
    while not client.exists(f"go:{go}") and time.monotonic() < deadline:
        time.sleep(0.01)
    client.close()
    return self.lock.fence


@app.task(base=SingletonTask, shared=False, name="cliapp.queued", lock_strategy="until_executed")
def queued(name: str) -> str:
    """An until_executed task: its lock is held from the send."""
    return name


if os.environ.get("REDISLOCK_TEST_ELSEWHERE_URL"):

    @app.task(
        base=SingletonTask,
        shared=False,
        name="cliapp.elsewhere",
        lock_url=os.environ["REDISLOCK_TEST_ELSEWHERE_URL"],
    )
    def elsewhere(name: str) -> str:
        """A task whose locks live in a lock store of its own."""
        return name


if os.environ.get("REDISLOCK_TEST_MISCONFIGURED"):

    @app.task(base=SingletonTask, shared=False, name="cliapp.misconfigured", on_conflict="ignore")
    def misconfigured(name: str) -> str:
        """A task with an invalid option value: its options raise when read."""
        return name


def use(url: str) -> None:
    """Point the app at the server at ``url`` (the test process's side)."""
    configure_app(app, url)
