"""The word a delivery of a retry that ended without running leaves for the
execution that sent it.

An ``until_executed`` execution whose body sends its own retry (raised, the
body's ``finally`` blocks still to run, or with ``self.retry(throw=False)``,
running on) hands its hold to the retry's reservation
(:func:`~celery_redislock.reservations.queued_owner`) only as it ends. A delivery of that retry that ends without running meanwhile (it failed to
start, or was dropped as revoked) finds no reservation to free: nothing would
ever take the reservation over once it is there, and the lock would stay taken
until ``lock_enqueue_ttl`` ran out. So it leaves word beside the lock
(:func:`free_dropped`), which the sending execution reads as it hands its hold
over (:func:`read_word`): it then frees the lock instead, or passes it on to the
reservation of the retry a failed start sent. Once acted on, the word is deleted
(:func:`forget_word`).

The word's key is :func:`dropped_key`: ``<lock key>:dropped:<task id>:<retry
count>``, in the lock key's cluster slot. Its value is ``<fence> <count> <ms>
<id>...``: the fencing token of the hold it is meant for (only that hold, or one
it passes on to, acts on it; a later hold of the same task id never does), what
to do instead (``0 0``: free the lock; else pass it on to retry ``<count>``'s
reservation for ``<ms>`` ms), and one id per delivery that ended so (how many of
the retry's copies did). Left unread, it expires after :data:`DROPPED_WORD_TTL`
seconds, or after the TTL of the reservation it is about if that is longer.
"""

from __future__ import annotations

import logging
from typing import NamedTuple, cast

from celery_redislock.errors import LockBackendError
from celery_redislock.ids import request_id
from celery_redislock.lock import lock_keys
from celery_redislock.reservations import ascii_number, free_queued
from celery_redislock.scripts import DROPPED_SCRIPT, FORGET_WORD_SCRIPT, Call, send
from celery_redislock.transport import (
    DEFAULT_CALL_TIMEOUT,
    Client,
    Deadline,
    backend_errors,
    router_for,
)

logger = logging.getLogger(__name__)


#: Seconds, at least, the word that a retry's delivery ended without running lasts
#: (see :func:`free_dropped`): the execution that sent the retry and runs on
#: reads it as it ends, if that is within this time.
DROPPED_WORD_TTL = 86_400.0


def dropped_key(name: str, task_id: str, retries: int, prefix: str) -> str:
    """The key of the word that a delivery of retry ``retries`` of ``task_id``
    ended without running, beside lock ``name``'s key (in its cluster slot)."""
    return f"{lock_keys(name, prefix).lock}:dropped:{task_id}:{retries}"


class Word(NamedTuple):
    """The word a delivery of a retry that ended without running left (see
    :func:`free_dropped`)."""

    #: The fencing token of the hold it was left for.
    fence: int
    #: The retry whose reservation that hold goes to instead (0: none, it is freed).
    then: int
    #: That reservation's TTL, in ms.
    ms: int
    #: How many deliveries of the retry ended so.
    drops: int
    #: The word as it was read.
    text: str


def leave_word(
    client: Client, name: str, task_id: str, prefix: str, retries: int, word: str, ttl: float
) -> int:
    """Leave ``word`` (what to do with the hold instead of keeping it for retry
    ``retries``: ``"0 0"`` free it, ``"<count> <ms>"`` pass it on to that retry's
    reservation for that long) for the hold of an earlier delivery of the message,
    if one holds lock ``name``, tied to that hold's fencing token: 1 if it did, 2 if
    the retry's reservation holds it instead (0: neither; nothing changed).

    Raises:
        LockBackendError: the lock store could not be reached.
    """
    key = lock_keys(name, prefix).lock
    ms = max(1, int(max(ttl, DROPPED_WORD_TTL) * 1000))
    call = Call(
        DROPPED_SCRIPT, [key, dropped_key(name, task_id, retries, prefix)],
        [task_id, retries, ms, word, request_id()],
    )  # fmt: skip
    with backend_errors(f"leave word beside lock {name!r}"):
        return int(send(router_for(client), key, call, Deadline.after(DEFAULT_CALL_TIMEOUT)))


def free_dropped(
    client: Client, name: str, task_id: str, prefix: str, retries: int, ttl: float
) -> bool:
    """Free lock ``name`` for a delivery of ``task_id``'s message (``retries``: its
    retry count) that ended without running, as :func:`free_queued` does; return
    whether it did.

    A retry's reservation may not be there yet: the execution that sent the retry
    (``self.retry(throw=False)``) may still run on, and hand its hold to the
    reservation only as it ends. Word is then left beside the lock (for at least
    ``ttl`` seconds, and :data:`DROPPED_WORD_TTL`), tied to that execution's hold
    (its fencing token), which it reads (and deletes) as it hands over, and frees
    the lock instead: nothing would take the reservation over. In one step with
    the check that it still holds the lock, so that a hold handed over meanwhile
    is freed here. A later hold of the same task id (the id reused, or the message
    delivered again) never acts on that word.

    Raises:
        LockBackendError: the lock store could not be reached.
    """
    if free_queued(client, name, task_id, prefix, retries):
        return True
    if retries < 1 or leave_word(client, name, task_id, prefix, retries, "0 0", ttl) != 2:
        return False
    # Handed to the reservation meanwhile.
    return free_queued(client, name, task_id, prefix, retries)


def read_word(client: Client, name: str, task_id: str, retries: int, prefix: str) -> Word | None:
    """The word a delivery of retry ``retries`` left (see :func:`leave_word`), if
    any. Only read (a read whose answer was lost is sent again, and finds it
    still there): the hold it was left for deletes it once it acted on it (see
    :func:`forget_word`).

    Raises:
        LockBackendError: the lock store could not be reached.
    """
    key = dropped_key(name, task_id, retries, prefix)
    with backend_errors(f"read word beside lock {name!r}"):
        raw = send(router_for(client), key, ("GET", key), Deadline.after(DEFAULT_CALL_TIMEOUT))
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    parts = text.split(" ")
    numbers = [ascii_number(part) for part in parts[:3]]
    if len(parts) < 4 or None in numbers:
        return None
    fence, then, ms = cast("list[int]", numbers)
    return Word(fence, then, ms, len(parts) - 3, text)


def forget_word(
    client: Client, name: str, task_id: str, retries: int, prefix: str, word: Word
) -> None:
    """Delete ``word``, read by :func:`read_word`, once it was acted on: after
    the hold went to retry ``retries``'s reservation, none is left for it, and no
    other hold acts on it. Only if it still reads the same, so that a delete sent
    again (its answer lost) is harmless. A word that cannot be deleted is left to
    expire: no hold acts on it again."""
    key = dropped_key(name, task_id, retries, prefix)
    call = Call(FORGET_WORD_SCRIPT, [key], [word.text])
    try:
        with backend_errors(f"delete word beside lock {name!r}"):
            send(router_for(client), key, call, Deadline.after(DEFAULT_CALL_TIMEOUT))
    except LockBackendError as exc:
        logger.info("word %s, acted on, is left to expire: %s", key, exc)
