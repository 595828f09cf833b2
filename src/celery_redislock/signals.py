"""Signals sent by :class:`~celery_redislock.SingletonTask`, for metrics and auditing.

Connect to them like Celery's own signals; the sender is the task::

    from celery_redislock import signals

    @signals.lock_conflict.connect
    def count_conflicts(sender, task_id, name, holder, action, **kwargs):
        CONFLICTS.labels(sender.name, action).inc()

A receiver runs inside the task's execution (or its ``apply_async``), except
``lock_lost`` and ``heartbeat_round`` (sent from the heartbeat thread) and ``lock_released`` (sent by
whichever thread reads the release's answer, moments after the task ended), so
keep it fast and thread-safe; an exception it raises is logged by Celery's
dispatcher and ignored. :mod:`celery_redislock.metrics` turns them into
Prometheus metrics.

Every signal about one lock carries its lock name as ``name``, and again as
``key`` for receivers written before it was called a name; new receivers should
take ``name`` (and accept ``**kwargs``).
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "heartbeat_round",
    "lock_acquired",
    "lock_conflict",
    "lock_lost",
    "lock_released",
    "lock_unavailable",
]

#: The lock was taken. ``name``, ``task_id``, ``token`` (fencing token) and
#: ``waited`` (seconds spent waiting for it, 0.0 when free at once).
lock_acquired = Signal(
    name="lock_acquired", providing_args={"task_id", "name", "key", "token", "waited"}
)

#: The lock was held by another task. ``action`` is what the duplicate does:
#: ``"skip"``, ``"raise"``, ``"retry"``, ``"wait"`` (sent before waiting),
#: ``"dedup"`` (an ``until_*`` enqueue that published nothing) or
#: ``"redelivered"`` (a copy of a message whose earlier delivery holds the lock:
#: it waits for it, whatever ``on_conflict`` says; ``holder`` is its own task id).
#: A waiting task that asks for the lock again after an answer read only once
#: its TTL had passed, and finds it held again, does not send it a second time.
lock_conflict = Signal(
    name="lock_conflict", providing_args={"task_id", "name", "key", "holder", "action"}
)

#: A running task's lock was lost (expired or taken over); sent from the heartbeat.
lock_lost = Signal(name="lock_lost", providing_args={"task_id", "name", "key"})

#: The task's body ended and its release got its answer. ``held`` is in seconds,
#: from the acquire to the release (a lock lost meanwhile counts to the release);
#: ``outcome`` is ``"released"`` (the lock was freed, or a hold dropped),
#: ``"lost"`` (it had expired or been taken over before the release) or
#: ``"failed"`` (no answer: retried in the background, else it expires by its TTL).
lock_released = Signal(
    name="lock_released", providing_args={"task_id", "name", "key", "held", "outcome"}
)

#: The lock store failed when a task (or its ``apply_async``) asked for its lock:
#: unreachable, timed out, out of memory, refused by its ACL. ``error`` is the
#: :class:`~celery_redislock.LockBackendError`; ``action`` is what the task does:
#: ``"fail"`` (the error is raised: the task fails, or is not sent) or ``"run"``
#: (``lock_on_redis_error="run"``: it runs, or is sent, without its lock).
lock_unavailable = Signal(
    name="lock_unavailable", providing_args={"task_id", "name", "key", "error", "action"}
)

#: A heartbeat round ended on one server (sender: the server, ``"host:port"``,
#: or ``"sentinel:<service name>"`` for a Sentinel-managed one, whichever server
#: is primary; sent from that server's heartbeat thread, for every lock it
#: renews, whether a task's or not). ``renewed``: locks renewed; ``failed``: renewals without an
#: answer (retried until the lock's local deadline); ``lost``: locks found lost.
heartbeat_round = Signal(name="heartbeat_round", providing_args={"renewed", "failed", "lost"})
