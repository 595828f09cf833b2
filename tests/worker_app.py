"""A Celery app for the tests that run real ``celery worker`` subprocesses.

The server URL comes from ``REDISLOCK_TEST_URL``; every execution records what
it saw in Redis lists so the tests can check the history afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from typing import Any

import redis
from celery import signals as celery_signals
from celery.exceptions import Reject

from celery_redislock import SingletonTask, early, signals
from celery_redislock.admin import read_lock
from celery_redislock.lock import lock_keys
from celery_redislock.scripts import LEASE_FIELD, OWNER_FIELD
from celery_redislock.task import RequestClassWarning, _written_ahead
from tests.support import CELERY_5_7, field, make_app, wait_until

URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6379/0")
app = make_app(URL, "workers")
app.conf.update(
    broker_transport_options={
        # Short, so that the messages of a killed worker come back quickly; a test
        # that needs a held message not to be redelivered raises it.
        "visibility_timeout": float(os.environ.get("REDISLOCK_TEST_VISIBILITY_TIMEOUT", "4")),
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    },
    worker_prefetch_multiplier=1,
    worker_cancel_long_running_tasks_on_connection_loss=False,
)
if os.environ.get("REDISLOCK_TEST_CANCEL_ON_CONNECTION_LOSS"):
    app.conf.worker_cancel_long_running_tasks_on_connection_loss = True
if os.environ.get("REDISLOCK_TEST_LOCK_URL"):
    app.conf.redislock_url = os.environ["REDISLOCK_TEST_LOCK_URL"]
if os.environ.get("REDISLOCK_TEST_MAX_TASKS_PER_CHILD"):
    app.conf.worker_max_tasks_per_child = int(os.environ["REDISLOCK_TEST_MAX_TASKS_PER_CHILD"])
store = redis.Redis.from_url(URL)
if os.environ.get("REDISLOCK_TEST_LATE_REQUEST_WAIT"):
    early.LATE_REQUEST_WAIT = float(os.environ["REDISLOCK_TEST_LATE_REQUEST_WAIT"])


def log(kind: str, **fields: Any) -> None:
    """Append one JSON record to the ``log:<kind>`` list."""
    store.rpush(f"log:{kind}", json.dumps(fields))


@signals.lock_released.connect
def log_release(sender: Any, task_id: str, outcome: str, **_: Any) -> None:
    """Record every ``lock_released`` under ``log:released``, with the process it came from."""
    log("released", task_id=task_id, outcome=outcome, pid=os.getpid())


# shared=False on every task: a test process that imports this module (again, as
# test_workers does) must not hand these tasks to every Celery app it creates later.
@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    on_conflict="wait",
    lock_wait=120,
    lock_on=("key",),
)
def critical(self: Any, key: str, n: int) -> int:
    """A critical section: non-atomic read-modify-write of a counter."""
    started = time.time()
    value = int(store.get(f"counter:{key}") or 0)
    time.sleep(0.005)
    store.set(f"counter:{key}", value + 1)
    log("critical", n=n, start=started, end=time.time(), token=self.lock.token, pid=os.getpid())
    return n


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_ttl=2,
    on_conflict="wait",
    lock_wait=60,
    lock_on=("name",),
)
def sleeper(self: Any, name: str, seconds: float) -> str:
    """Sleep while holding the lock (to be killed, timed out or shut down)."""
    log("sleeper", name=name, id=self.request.id, pid=os.getpid(), token=self.lock.token)
    time.sleep(seconds)
    log("sleeper_done", name=name, id=self.request.id)
    return name


@app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=12, acks_late=True)
def late(self: Any, name: str, seconds: float) -> str:
    """An acks_late task: its first run sleeps (to be killed), a redelivery finishes."""
    run = store.incr(f"late-runs:{name}")
    log(
        "late", name=name, id=self.request.id, run=run, token=self.lock.token,
        start=time.time(), pid=os.getpid(),
    )  # fmt: skip
    if run == 1:
        time.sleep(seconds)
    log("late_done", name=name, id=self.request.id, run=run)
    return name


with warnings.catch_warnings():
    # What it warns of is what the tests show.
    warnings.simplefilter("ignore", RequestClassWarning)

    @app.task(
        base=SingletonTask, bind=True, shared=False, lock_ttl=12, acks_late=True,
        Request="celery.worker.request:Request",
    )  # fmt: skip
    def late_plain_request(self: Any, name: str, seconds: float) -> str:
        """:func:`late` with Celery's own worker request class, not derived from
        ``celery_redislock.early.Request``."""
        log("late_plain_request", name=name, id=self.request.id, pid=os.getpid())
        time.sleep(seconds)
        return name

    # Made now (the app makes its tasks when first used), inside the filter.
    late_plain_request.__evaluate__()


@app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=2, acks_late=True)
def delivered(self: Any, name: str, seconds: float) -> str:
    """An acks_late task that runs past the broker's visibility timeout, so that its
    message is delivered again while it runs."""
    log("delivered", name=name, id=self.request.id, start=time.time(), token=self.lock.token)
    time.sleep(seconds)
    log("delivered_done", name=name, end=time.time(), lost=self.lock.lost)
    return name


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_strategy="until_executed",
    lock_ttl=30,
    retry_on_worker_lost=True,
    default_retry_delay=0,
)
def lost_once(self: Any, name: str) -> str:
    """An until_executed task whose first run sleeps (to have its pool process
    killed) and that Celery sends again when it loses that process."""
    run = store.incr(f"lost-runs:{name}")
    log("lost_once", name=name, run=run, pid=os.getpid())
    if run == 1:
        time.sleep(60)
    return name


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_strategy="until_executed",
    lock_ttl=1,
    acks_late=True,
)
def rejects_once(self: Any, name: str) -> str:
    """An until_executed task whose first run sends its message back to the queue."""
    run = store.incr(f"reject-runs:{name}")
    log("rejects_once", name=name, run=run)
    if run == 1:
        raise Reject("again later", requeue=True)
    return name


class SendsBackAtStart(SingletonTask):
    """A task class whose first ``before_start`` for a name sends its message back to
    the queue (``Reject(requeue=True)``), after logging who holds the lock then
    (owner and lease) under ``sent_back``."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        if store.set(f"sent-back:{self.name}:{args[0]}", "1", nx=True):
            key = lock_keys(self.lock_name(args, kwargs)).lock
            log(
                "sent_back", id=task_id, owner=field(store, key, OWNER_FIELD),
                lease=field(store, key, LEASE_FIELD),
            )  # fmt: skip
            raise Reject("again later", requeue=True)


@app.task(
    base=SendsBackAtStart, bind=True, shared=False, lock_strategy="until_executed",
    lock_ttl=1, acks_late=True,
)  # fmt: skip
def sent_back_at_start(self: Any, name: str) -> str:
    """An acks_late until_executed task whose first start sends its message back."""
    log("sent_back_at_start", name=name, id=self.request.id)
    return name


def _until_queued_or_started(queue: str, name: str) -> None:
    """Wait (20 s at most) until a waiter is queued for the lock whose waiter queue
    is ``queue``, or the task ``name`` logged by :func:`log` has started a second
    run: a sender's cleanup that lasts until its new message, started meanwhile
    by another pool process, waits for the lock (or has run)."""
    deadline = time.monotonic() + 20
    while not store.zcard(queue) and time.monotonic() < deadline:
        if store.llen(f"log:{name}") > 1:
            break
        time.sleep(0.01)


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_strategy="until_executed",
    lock_ttl=30,
    max_retries=1,
)
def retries_in_cleanup(self: Any, name: str) -> int:
    """An until_executed task whose first run raises its retry from inside a
    ``try``/``finally`` whose cleanup lasts until the retry, started meanwhile by
    another pool process, waits for the lock (or has run). Records its steps in
    one list, in the order they happen."""
    retries = int(self.request.retries)
    log("retries_in_cleanup", step="start", retries=retries, pid=os.getpid())
    if retries:
        return retries
    queue = lock_keys(self.lock.name).queue
    try:
        raise self.retry(countdown=0)
    finally:
        _until_queued_or_started(queue, "retries_in_cleanup")
        log("retries_in_cleanup", step="cleaned", retries=retries, pid=os.getpid())


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_strategy="until_executed",
    lock_ttl=30,
)
def replaces_in_cleanup(self: Any, name: str) -> str:
    """An until_executed task whose first run replaces itself (``self.replace()``,
    which sends the replacement under its own task id) from inside a
    ``try``/``finally`` whose cleanup lasts until the replacement, started
    meanwhile by another pool process, waits for the lock (or has run). Records
    its steps in one list, in the order they happen."""
    nesting = int(self.request.replaced_task_nesting or 0)
    log("replaces_in_cleanup", step="start", nesting=nesting, pid=os.getpid())
    if nesting:
        return "replaced"
    queue = lock_keys(self.lock.name).queue
    try:
        self.replace(replaces_in_cleanup.s(name))
    finally:
        _until_queued_or_started(queue, "replaces_in_cleanup")
        log("replaces_in_cleanup", step="cleaned", nesting=nesting, pid=os.getpid())
    return "not replaced"


@signals.lock_conflict.connect
def log_conflict(sender: Any, task_id: str, action: str, **_: Any) -> None:
    """Record every ``lock_conflict`` under ``log:conflict``."""
    log("conflict", task_id=task_id, action=action)


@app.task(base=SingletonTask, bind=True, shared=False, soft_time_limit=0.5, lock_ttl=30)
def overrun(self: Any, name: str) -> str:
    """Runs past its soft time limit."""
    log("overrun", name=name)
    time.sleep(5)
    return name


def _hard_limited(self: Any, name: str, deaf: bool) -> str:
    """Runs past its hard time limit; ``deaf`` to the SIGTERM the pool sends first
    (as a task stuck in native code is), it is killed."""
    if deaf:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log("hard_limited", name=name, pid=os.getpid())
    time.sleep(30)
    return name


class FailingOnFailure(SingletonTask):
    """A task whose ``on_failure`` raises (Celery calls it for a hard time limit too)."""

    def on_failure(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("on_failure fails")


hard_limited = app.task(
    base=SingletonTask, bind=True, shared=False, time_limit=1, lock_ttl=60, name="hard_limited"
)(_hard_limited)
hard_limited_failing = app.task(
    base=FailingOnFailure, bind=True, shared=False, time_limit=1, lock_ttl=60,
    name="hard_limited_failing",
)(_hard_limited)  # fmt: skip


@app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executed")
def queued_once(self: Any, name: str) -> str:
    """An until_executed task: its key is held from the send until it has run."""
    log("queued_once", name=name, id=self.request.id)
    return str(self.request.id)


@app.task(
    base=SingletonTask,
    bind=True,
    shared=False,
    lock_strategy="until_executed",
    lock_ttl=30,
    lock_on=("name",),
)
def runs_until_told(self: Any, name: str) -> str:
    """An until_executed task that runs until ``release:<name>`` is set (at most
    60 s each), in its body and again in its ``finally``: a terminate's
    ``SIGTERM``, which ends the body, leaves it holding the lock until told."""
    log("runs_until_told", name=name, id=self.request.id, token=self.lock.token)
    try:
        _until_told(name)
    finally:
        _until_told(name)
    return name


def _until_told(name: str) -> None:
    """Wait until ``release:<name>`` is set (at most 60 s)."""
    deadline = time.monotonic() + 60
    while not store.exists(f"release:{name}") and time.monotonic() < deadline:
        time.sleep(0.01)


@app.task(bind=True, shared=False, acks_late=True)
def occupy(self: Any, name: str) -> str:
    """Holds a worker slot until ``release:<name>`` is set (at most 60 s).

    Acknowledged only when it ends, so with a prefetch limit of one the worker
    fetches nothing more from the broker while it runs.
    """
    log("occupy", name=name, id=self.request.id)
    _until_told(name)
    return name


@app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=30, lock_on=("name",))
def cleans_up(self: Any, name: str, seconds: float, cleanup: float) -> str:
    """Sleeps, then (in its ``finally``, also when a signal stops it) cleans up for
    ``cleanup`` seconds, still under the lock; a duplicate is skipped. Records its
    steps in one list, in the order they happen."""
    log("cleans_up", step="start", id=self.request.id, pid=os.getpid())
    try:
        time.sleep(seconds)
    finally:
        log("cleans_up", step="cleanup", id=self.request.id)
        time.sleep(cleanup)
        log("cleans_up", step="cleaned", id=self.request.id)
    return name


@app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=30, acks_late=True)
def dies_on_sigterm(self: Any, name: str) -> str:
    """An acks_late task whose first run ends at once on a SIGTERM, without
    unwinding (the signal's default action, as a library that resets the
    handler leaves it), so its own ``finally`` never releases; a redelivery
    finishes."""
    run = store.incr(f"dies-runs:{name}")
    log("dies_on_sigterm", name=name, run=run, pid=os.getpid(), token=self.lock.token)
    if run == 1:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        time.sleep(60)
    return name


@app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=60, lock_on=("name",))
def ahead_probe(self: Any, name: str) -> str:
    """A while_executing task whose setup (``task_prerun``, below) looks whether its
    acquire was written before it; ``name`` ``"dies"`` makes its pool process kill
    itself there, once its lock is held."""
    log("ahead_probe", name=name, id=self.request.id)
    return name


@celery_signals.task_prerun.connect
def look_ahead(sender: Any = None, task_id: str = "", args: Any = (), **_: Any) -> None:
    """Log whether an ``ahead_probe`` task's acquire was written before the tracer set
    it up, and whether its lock was held for it meanwhile (within 5 s)."""
    if getattr(sender, "name", None) != ahead_probe.name:
        return
    written = _written_ahead.get(threading.get_ident())
    key = lock_keys(ahead_probe.lock_name(args, {})).lock
    seen = wait_until(lambda: field(store, key, LEASE_FIELD) == task_id, timeout=5)
    log("set_up", id=task_id, written=written is not None and written.task_id == task_id, held=seen)
    if args[0] == "dies" and seen:
        os.kill(os.getpid(), signal.SIGKILL)


class FailingStart(SingletonTask):
    """A task class whose start fails before the task is called."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        raise RuntimeError("start failed")


@app.task(base=FailingStart, shared=False, lock_strategy="until_executed", lock_ttl=30)
def fails_to_start(name: str) -> str:
    """An until_executed task that never runs: its ``before_start`` raises."""
    log("fails_to_start", name=name)
    return name


class TroubledStart(SingletonTask):
    """A task class whose first ``before_start`` for a name goes wrong before the
    task is called: its pool process kills itself (``trouble = "dies"``, as one
    the out-of-memory killer ends while it builds the arguments), or it runs past
    the task's hard time limit (``"stalls"``). A later delivery logs who holds the
    lock (owner and lease) as ``before_start`` runs, under ``starts``."""

    trouble = "dies"

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        if store.set(f"troubled-start:{self.name}:{args[0]}", "1", nx=True):
            if self.trouble == "dies":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        key = lock_keys(self.lock_name(args, kwargs)).lock
        log(
            "starts", task=self.name, id=task_id, owner=field(store, key, OWNER_FIELD),
            lease=field(store, key, LEASE_FIELD),
        )  # fmt: skip


def troubled_start(kind: str, trouble: str, **options: Any) -> Any:
    """A :class:`TroubledStart` task named ``kind`` here, whose first delivery meets
    ``trouble``; each run is logged under ``kind``."""

    @app.task(
        base=TroubledStart, bind=True, shared=False, name=f"{__name__}.{kind}",
        trouble=trouble, **options,
    )  # fmt: skip
    def run(self: Any, name: str) -> str:
        log(kind, name=name, id=self.request.id, retries=self.request.retries)
        return name

    return run


executing_dies_as_it_starts = troubled_start(
    "executing_dies_as_it_starts", "dies", lock_strategy="until_executing"
)
executed_dies_as_it_starts = troubled_start(
    "executed_dies_as_it_starts", "dies", lock_strategy="until_executed"
)
# acks_late, but its message is acknowledged when the first delivery's pool
# process dies (no reject_on_worker_lost): nothing delivers it again.
late_dies_as_it_starts = troubled_start(
    "late_dies_as_it_starts", "dies", lock_strategy="until_executed", acks_late=True
)
# Celery requeues its message when the first delivery's pool process dies.
requeued_dies_as_it_starts = troubled_start(
    "requeued_dies_as_it_starts", "dies", lock_strategy="until_executed",
    acks_late=True, reject_on_worker_lost=True,
)  # fmt: skip
# Celery sends it again as a retry when the first delivery's pool process dies.
resent_dies_as_it_starts = troubled_start(
    "resent_dies_as_it_starts", "dies", lock_strategy="until_executing",
    retry_on_worker_lost=True, default_retry_delay=0,
)  # fmt: skip
executed_stalls_as_it_starts = troubled_start(
    "executed_stalls_as_it_starts", "stalls", lock_strategy="until_executed", time_limit=1
)
# acks_late, but its message is acknowledged when the first delivery is killed for
# its time limit (acks_on_timeout, by default): nothing delivers it again.
late_stalls_as_it_starts = troubled_start(
    "late_stalls_as_it_starts", "stalls", lock_strategy="until_executed", time_limit=1,
    acks_late=True,
)  # fmt: skip
# Celery requeues its message when the first delivery is killed for its time limit
# (Celery 5.7: acks_on_timeout off; before it, which has no such option,
# acks_on_failure_or_timeout off leaves the message unacknowledged, and the broker
# delivers it again once its visibility timeout has passed).
requeued_stalls_as_it_starts = troubled_start(
    "requeued_stalls_as_it_starts", "stalls", lock_strategy="until_executed",
    time_limit=1, acks_late=True,
    **({"acks_on_timeout": False} if CELERY_5_7 else {"acks_on_failure_or_timeout": False}),
)  # fmt: skip


class GatedStart(SingletonTask):
    """A task class whose ``before_start`` reads a lock (the pool process's
    connection to the lock store open), logs its process under ``gated``, and
    waits until the key ``gate:<task id>`` is set. Its ``__call__`` of its own
    has the pool process take the lock as the task starts, after the gate, not
    as it is handed the task."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        read_lock(self.lock_client, "warm-up", self.lock_options.prefix)
        log("gated", id=task_id, pid=os.getpid())
        deadline = time.monotonic() + 30
        while not store.get(f"gate:{task_id}") and time.monotonic() < deadline:
            time.sleep(0.01)


@app.task(base=GatedStart, bind=True, shared=False, lock_strategy="until_executed", lock_ttl=30)
def gated(self: Any, name: str) -> str:
    """An until_executed task that starts only once its gate opens, then sleeps."""
    log("gated_runs", id=self.request.id)
    time.sleep(30)
    return name


class DiesBehindItsSender(SingletonTask):
    """A task class whose second start for a name kills its pool process in
    ``before_start`` (as the out-of-memory killer would, before the execution took
    anything over) when its second argument ends in ``"-dies"``."""

    def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
        if str(args[1]).endswith("-dies") and store.incr(f"behind-starts:{args[0]}") > 1:
            os.kill(os.getpid(), signal.SIGKILL)


@app.task(
    base=DiesBehindItsSender, bind=True, shared=False, lock_strategy="until_executed",
    lock_ttl=30, lock_on=("name",), max_retries=1,
)  # fmt: skip
def sends_itself_and_runs_on(self: Any, name: str, how: str) -> str:
    """An until_executed task whose first run sends its message again under its
    own task id, with a soft time limit of 1 s (``how`` ``"retry"``:
    ``self.retry(throw=False)``; else ``apply_async(task_id=self.request.id)``),
    and runs on until that delivery has failed (20 s at most): one that starts
    meanwhile waits behind it. Logs each run, and what the sender saw of that
    delivery as it ends (``sender``)."""
    log("sends_itself_and_runs_on", id=self.request.id, retries=self.request.retries)
    if store.incr(f"behind-runs:{name}") > 1:
        return "again"
    if how == "retry":
        self.retry(countdown=0, throw=False, soft_time_limit=1)
    else:
        self.apply_async((name, how), task_id=self.request.id, soft_time_limit=1)
    deadline = time.monotonic() + 20
    result = self.AsyncResult(self.request.id)
    while result.state != "FAILURE" and time.monotonic() < deadline:
        time.sleep(0.02)
        result = self.AsyncResult(self.request.id)
    log("sender", state=result.state, error=type(result.result).__name__)
    return "sender"
