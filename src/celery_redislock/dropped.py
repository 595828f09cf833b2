"""The word a delivery of a retry that ended without running leaves for the
execution that sent it (and so does a delivery of a message that execution sent
under its own task id: ``self.replace()``, ``apply_async(task_id=...)``).

An ``until_executed`` execution whose body sends its own retry (raised, the
body's ``finally`` blocks still to run, or with ``self.retry(throw=False)``,
running on) hands its hold to the retry's reservation
(:func:`~celery_redislock.reservations.queued_owner`) only as it ends. A
delivery of that retry that ends without running meanwhile (it failed to start,
its pool process died before the start, its wait for that execution ended in an
exception such as a soft time limit, or it was dropped as revoked) finds no
reservation to free: nothing would ever take the reservation over once it is
there, and the lock would stay taken until ``lock_enqueue_ttl`` ran out. So it
leaves word beside the lock (:func:`free_dropped`), which the sending execution
reads as it hands its hold over (:func:`read_word`; again in the background
until the store answers, should it fail then): it then frees the lock instead,
or passes it on to the reservation of the retry a failed start sent.
Once acted on, the word is deleted (:func:`forget_word`).

A message sent from the body under the execution's own task id other than by
``self.retry()`` has no retry count (``0``), however many times the task had
retried: the execution hands its hold to that message's reservation as it ends
all the same, and a delivery of it that ended without running leaves the word
alike. No count tells that the execution sent it, but the message names the
execution's hold (its header ``redislock_sender``): the word is left only while
that very hold holds the lock (see :func:`free_dropped`'s ``sender``).

The word's key is :func:`dropped_key`: ``<lock key>:dropped:<task id>:<retry
count>`` (``0`` for a message without one), in the lock key's cluster slot. Its
value is ``<fence> <count> <ms> <id>...``: the fencing token of the hold it is
meant for (only that hold, or one it passes on to, acts on it; a later hold of
the same task id never does), what to do instead (``0 0``: free the lock; else pass it on to retry ``<count>``'s
reservation for ``<ms>`` ms), and one id per delivery that ended so (how many of
the retry's copies did). Left unread, it expires after :data:`DROPPED_WORD_TTL`
seconds, or after the TTL of the reservation it is about if that is longer.

A revoke of the task id drops every copy of the retry, wherever it waits (each
carries that id): a worker that gets the revoke while the sending execution
still holds the lock leaves the id :data:`REVOKED` (:func:`free_revoked`), which
counts for all of them, rather than wait for a worker to drop each copy as its
ETA comes. A delivery dropped later leaves the id the revoke sweep gave it
(:func:`drop_id`), so that it is not counted twice. Such a worker cannot tell
whether the execution sent a message without a retry count too: it leaves word
about that one as well (:func:`leave_revoked`), for whichever execution's hold of
the task id holds the lock; unread, it expires.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, NamedTuple, cast

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

#: The id a revoke of the task id leaves in the word (see :func:`free_revoked`):
#: every copy of the retry is dropped.
REVOKED = "revoked"

#: The count of deliveries that ended unrun a word with :data:`REVOKED` stands for.
ALL_COPIES = sys.maxsize

#: What :func:`leave_word` is given as the hold a word about a message without a
#: retry count is for when the revoke of its task id leaves it: any execution's
#: hold of the task id (every message that carries the id is dropped).
ANY_EXECUTION = ""

#: The attribute of a worker request that keeps its id in a word (see :func:`drop_id`).
_DROP_ID = "redislock_drop_id"


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
    #: How many deliveries of the retry ended so (:data:`ALL_COPIES` once revoked).
    drops: int
    #: The word as it was read.
    text: str


def drop_id(request: Any) -> str:
    """The id worker request ``request``, a delivery that ends without running,
    leaves in a word: the same each time it is asked (the revoke sweep and the
    worker's drop of the request at its ETA name one delivery), unless the
    request keeps no attributes (a request class not derived from
    :class:`celery_redislock.early.Request`)."""
    kept = getattr(request, "__dict__", None)
    if kept is None:
        return request_id()
    return str(kept.setdefault(_DROP_ID, request_id()))


def leave_word(
    client: Client,
    name: str,
    task_id: str,
    prefix: str,
    retries: int,
    word: str,
    ttl: float,
    drop: str | None = None,
    sender: str = ANY_EXECUTION,
) -> int:
    """Leave ``word`` (what to do with the hold instead of keeping it for retry
    ``retries``: ``"0 0"`` free it, ``"<count> <ms>"`` pass it on to that retry's
    reservation for that long) for the hold of an earlier delivery of the message,
    if one holds lock ``name``, tied to that hold's fencing token: 1 if it did, 2 if
    the retry's reservation holds it instead (0: neither; nothing changed).
    ``drop``: the id of the delivery that ended (:func:`drop_id`, or
    :data:`REVOKED`); a new one if ``None``. Left again with the same id, the word
    counts it once.

    ``retries`` 0: a message without a retry count, sent by an execution of
    ``task_id`` from its body; ``sender`` is that execution's owner token (the
    message's header ``redislock_sender``), the only hold the word is left for
    (:data:`ANY_EXECUTION`: any execution's, for a revoke of the task id).

    Raises:
        LockBackendError: the lock store could not be reached.
    """
    key = lock_keys(name, prefix).lock
    ms = max(1, int(max(ttl, DROPPED_WORD_TTL) * 1000))
    call = Call(
        DROPPED_SCRIPT, [key, dropped_key(name, task_id, retries, prefix)],
        [task_id, retries, ms, word, drop or request_id(), sender],
    )  # fmt: skip
    with backend_errors(f"leave word beside lock {name!r}"):
        return int(send(router_for(client), key, call, Deadline.after(DEFAULT_CALL_TIMEOUT)))


def free_dropped(
    client: Client,
    name: str,
    task_id: str,
    prefix: str,
    retries: int,
    ttl: float,
    drop: str | None = None,
    sender: str | None = None,
) -> bool:
    """Free lock ``name`` for a delivery of ``task_id``'s message (``retries``: its
    retry count; ``sender``: its header ``redislock_sender``, if any) that ended
    without running, as :func:`free_queued` does; return whether it did.

    A retry's reservation may not be there yet: the execution that sent the retry
    (``self.retry(throw=False)``) may still run on, and hand its hold to the
    reservation only as it ends. Word is then left beside the lock (for at least
    ``ttl`` seconds, and :data:`DROPPED_WORD_TTL`), tied to that execution's hold
    (its fencing token), which it reads (and deletes) as it hands over, and frees
    the lock instead: nothing would take the reservation over. In one step with
    the check that it still holds the lock, so that a hold handed over meanwhile
    is freed here. A later hold of the same task id (the id reused, or the message
    delivered again) never acts on that word. ``drop``: the delivery's id in the
    word (see :func:`leave_word`).

    So too for a message without a retry count that an execution of ``task_id``
    sent from its body (``self.replace()``, ``apply_async(task_id=...)``), which
    names that execution's hold (``sender``): the word is left for that hold
    only. A message with neither (a first delivery) leaves no word: nobody hands
    a hold to its reservation.

    Raises:
        LockBackendError: the lock store could not be reached.
    """
    if free_queued(client, name, task_id, prefix, retries):
        return True
    if retries < 1 and not sender:
        return False
    left = leave_word(client, name, task_id, prefix, retries, "0 0", ttl, drop, sender or "")
    if left != 2:
        return False
    # Handed to the reservation meanwhile.
    return free_queued(client, name, task_id, prefix, retries)


def free_revoked(
    client: Client, name: str, task_id: str, prefix: str, retries: int, ttl: float
) -> bool:
    """Free lock ``name`` for retry ``retries`` of ``task_id``, revoked by its id,
    as :func:`free_dropped` does; return whether it did.

    The revoke drops every copy of that retry, wherever it waits: the word left
    for an execution that sent the retry and still runs on says so
    (:data:`REVOKED`), and it frees the lock as it ends, however many copies it
    sent and whenever their ETAs come. Left by several workers, or again, it
    reads the same.

    Raises:
        LockBackendError: the lock store could not be reached.
    """
    return free_dropped(client, name, task_id, prefix, retries, ttl, REVOKED)


def leave_revoked(
    client: Client, name: str, task_id: str, prefix: str, ttl: float, sender: str = ANY_EXECUTION
) -> int:
    """Leave the execution of ``task_id`` that holds lock ``name`` (the hold
    ``sender`` names; :data:`ANY_EXECUTION`: whichever execution's of the task id
    it is) word that every message without a retry count it sent from its body
    (``self.replace()``, ``apply_async(task_id=...)``) is revoked: it frees the
    lock as it ends, rather than hand it to that message's reservation. For a
    revoke of the task id that finds the execution running, or holding the lock,
    while the message may sit in the broker. Unread (it sent no such message),
    the word expires. Returns as :func:`leave_word` does (2: the reservation of
    such a message holds the lock; left to the caller, which may know it for the
    reservation of a delivery about to run).

    Raises:
        LockBackendError: the lock store could not be reached.
    """
    return leave_word(client, name, task_id, prefix, 0, "0 0", ttl, REVOKED, sender)


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
    drops = ALL_COPIES if REVOKED in parts[3:] else len(parts) - 3
    return Word(fence, then, ms, drops, text)


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
