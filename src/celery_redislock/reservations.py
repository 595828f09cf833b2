"""The reservation ``apply_async`` takes for a message it sends.

A task whose lock is kept from its sending on (``until_executed``,
``until_executing``) takes the lock as its message is sent, with an owner token
of the message's own (:func:`queued_owner`): the lock is then reserved for that
message, which nobody has started yet. Its execution takes the reservation over
with an owner of its own; a message that never runs (revoked, rejected, failed to
start) has its reservation freed (:func:`free_queued`), by an owner-checked
release that leaves a lock an execution took over alone.
"""

from __future__ import annotations

from celery_redislock.errors import LockNotOwnedError
from celery_redislock.lock import RedisLock
from celery_redislock.scripts import RESERVATION_SUFFIX
from celery_redislock.transport import Client


def queued_owner(task_id: str, retries: int = 0) -> str:
    """The owner token of the lock ``apply_async`` takes for a message it sends
    (``retries``: the message's retry count).

    Only that message's own execution (same task id, same lease) replaces it, with
    an owner of its own; so a lock still owned by this token belongs to a message
    nobody has started yet. A retry's reservation (``retries`` above 0) names its
    retry count, and only a delivery with that count takes it over: a copy of an
    earlier delivery of the message (delivered again by the broker) does not.
    """
    if retries > 0:
        return f"{task_id}:{retries}{RESERVATION_SUFFIX}"
    return task_id + RESERVATION_SUFFIX


def free_queued(client: Client, name: str, task_id: str, prefix: str, retries: int = 0) -> bool:
    """Free lock ``name`` if the message of ``task_id`` (``retries``: its retry
    count) still owns it, by its reservation (:func:`queued_owner`); return whether
    it did.

    The release compares the owner on the server: a lock an execution has taken
    over (with an owner of its own) is left alone.
    """
    owner = queued_owner(task_id, retries)
    lock = RedisLock(client, name, owner=owner, lease=task_id, heartbeat=False, prefix=prefix)
    try:
        lock.release()
    except LockNotOwnedError:
        return False
    return True


def queued_retries(owner: str | None, task_id: str) -> int | None:
    """The retry count of the message whose reservation (:func:`queued_owner`) of
    ``task_id`` owner token ``owner`` is; ``None`` if it is none of them."""
    if owner is None or not owner.startswith(task_id) or not owner.endswith(RESERVATION_SUFFIX):
        return None
    middle = owner[len(task_id) : -len(RESERVATION_SUFFIX)]
    if not middle:
        return 0
    return ascii_number(middle[1:]) if middle[0] == ":" else None


def hold_retries(owner: str | None, task_id: str) -> int:
    """The retry count of the message behind a hold of lease ``task_id`` with owner
    token ``owner``: its reservation's (:func:`queued_retries`), or its
    execution's, whose owner token ends with ``:<retries>`` (0 if it names none)."""
    queued = queued_retries(owner, task_id)
    if queued is not None:
        return queued
    _, colon, count = (owner or "").rpartition(":")
    return (ascii_number(count) or 0) if colon else 0


def ascii_number(text: str) -> int | None:
    """``text`` as a number, if it is written in ASCII digits only."""
    return int(text) if text.isascii() and text.isdigit() else None
