"""The lock engine: a re-entrant, fenced, self-renewing Redis lock.

Example::

    from celery_redislock import RedisLock

    lock = RedisLock("redis://127.0.0.1:6379/0", "invoice:42", ttl=30)
    with lock:                       # waits for the lock, renews it while held
        write(invoice, fence=lock.token)

Keys, for a lock named ``N`` with the default prefix::

    redislock:{N}           string: owner, fence, request id, ...       (held: as long as
                            the lock; free: until the lock's expiry, or FENCE_TTL
                            when little of it was left, for its fencing counter;
                            fields in a fixed order, see celery_redislock.scripts)
    redislock:{N}:waiters   sorted set of queued waiters                (while someone waits)
    redislock:wake:<P>      pub/sub channel of process P, never a key   (its waiters' wake-ups)

(a name starting with ``}`` or ``\\`` is written ``\\N`` inside the braces, so the
hash tag is never empty and both keys share one cluster slot).

Acquire, release and extend are each one round trip (an ``EVALSHA``), bounded by
a deadline and retried on a broken connection; the scripts recognise a retried
request, so a retry never acts twice (see :mod:`celery_redislock.scripts`). A
waiter queues itself (in the acquire that finds the lock held) and sleeps until
a release wakes it or the holder's remaining TTL runs out — a lock that expires
wakes nobody, so the TTL bounds every wait. A release hands the lock to the
first queued waiter (and wakes it, and a second one in case it has gone): first
come, first served, and the woken waiter holds the lock without asking again
(but while the name lists undone acquires: then it is woken to ask, the free
lock kept for it a moment; see :mod:`celery_redislock.scripts`).

The holder keeps a local deadline: the send time of the last confirmed acquire
or renewal plus the TTL (for a hold a release handed over: the send time of the
waiter's last try plus the grant's TTL). The server cannot expire the lock
before it, so until then the hold is certain; once it passes,
:attr:`RedisLock.lost` is true whether or not the heartbeat has run since.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, ClassVar, Literal, NamedTuple, NoReturn

from redis.exceptions import (
    AskError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_redislock import wakeups
from celery_redislock.client import as_client
from celery_redislock.errors import (
    LockBackendError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
)
from celery_redislock.heartbeat import Heartbeat, _Lane, get_heartbeat
from celery_redislock.ids import owner_token, request_id
from celery_redislock.scripts import (
    ACQUIRE_SCRIPT,
    CLUSTER_TRY,
    COPY_MARK,
    EXTEND_SCRIPT,
    GRANT_MS,
    HOLDER_FIELDS,
    LEASE_FIELD,
    LEAVE_SCRIPT,
    OWNER_FIELD,
    RELEASE_LEASE_SCRIPT,
    RELEASE_SCRIPT,
    SEPARATOR,
    UNDO_MARK,
    Acquired,
    AcquireReply,
    Call,
    Released,
    decode_lock,
    queue_entry,
    send,
    unwatched,
)
from celery_redislock.transport import (
    DEFAULT_CALL_TIMEOUT,
    FAILOVER_WAIT,
    SLOT_QUESTION,
    SWITCH_RESEND,
    TRANSIENT,
    Client,
    Deadline,
    Router,
    Transport,
    backend_errors,
    describe_error,
    held_off,
    is_transient,
    may_have_run,
    router_for,
)
from celery_redislock.wakeups import Waiter, WakeHub

logger = logging.getLogger(__name__)

#: How long a free lock's key (and its fencing counter) outlives its last
#: release, in ms. After it expires the next token is seeded from the server
#: clock (microseconds), so tokens still increase.
FENCE_TTL_MS = 3_600_000

#: A release leaves the free key's expiry as it is (the lock's own, which the
#: heartbeat kept pushing ahead) when more than the release's deadline plus this
#: many seconds of it are surely left: a retry of the release still finds the
#: key, and the free key goes with the lock's TTL rather than after FENCE_TTL_MS.
KEEP_EXPIRY_MARGIN = 1.0

#: The longest, in seconds, a waiter waits for a wake-up before it asks again. A
#: release wakes the first two queued waiters; should both be gone (a worker
#: killed with several waiting tasks), their grants lapse and wake nobody, and the
#: next waiter, asleep until the holder's TTL it last saw, would leave the lock
#: free for as long. (A wake-up lost with a subscription that died unnoticed is
#: made up for the same way.)
RECHECK = 5.0

#: The longest, in seconds, a waiter without a wake-up subscription (its process
#: could not subscribe again yet, after a break or a network blip) waits before it
#: asks for the lock again; it asks at once when the subscription is back.
UNSUBSCRIBED_RECHECK = 0.5

#: How long, in seconds, the second waiter a release wakes (the spare, woken in
#: case the first has gone) waits before it asks for the lock: the first, which
#: usually takes it within a millisecond, does not have to race it.
SPARE_HEAD_START = 0.005

#: How many of its waiters that gave up a lock object remembers (see
#: ``RedisLock._leave_queue``): each one's queue entry may outlive it.
GONE_WAITERS = 4

#: The fencing token an undo names (RELEASE's ARGV[6]) to leave every hold as it
#: is, and only list its acquire as undone (see ``RedisLock._undo_call``): no
#: hold has it, as tokens start from the server clock in microseconds.
NO_HOLD_FENCE = 0

#: Default key prefix.
DEFAULT_PREFIX = "redislock"

#: Default TTL of a lock, in seconds.
DEFAULT_TTL = 60.0

#: Longest TTL or duration accepted, in seconds (about 10 years). Redis keeps
#: expiries in milliseconds on a 64-bit clock, but a lock that outlives its
#: holder for longer than this is a lock that never frees: crash recovery rests on
#: the TTL.
MAX_SECONDS = 315_360_000.0

#: How long, in seconds, an acquire waits for replicas to confirm it (``min_replicas``).
DEFAULT_REPLICA_TIMEOUT = 1.0

#: How long, in seconds, a renewal round whose Redis Cluster primary could not be
#: reached waits for the other nodes to say which primary serves its slots now
#: (see :meth:`~celery_redislock.transport.Router.relocate`): two of them asked,
#: if the first does not answer.
RELOCATE_WAIT = 2 * SLOT_QUESTION

#: Shortest TTL accepted, in seconds: Redis counts expiries in milliseconds.
MIN_TTL = 0.001

#: How often, in seconds, a waiter on a Redis Cluster looks up from waiting for
#: its wake-up to see whether its lock's key has moved to another primary (see
#: :meth:`RedisLock._wait_on`).
WATCH_HUB = 0.25

#: Shortest deadline of a round trip made for a caller whose own time is
#: (nearly) up, in seconds: a last check still gets a fair chance to answer.
MIN_CALL = 0.05

#: How long, in seconds, a waiter that gives up waits for the server to take it
#: out of the queue before it returns (and leaves the queue in the background):
#: past its timeout, so short.
LEAVE_WAIT = 0.2

#: What a ``release(wait=False)`` turned out to do: freed or dropped a hold, found
#: the lock already lost, failed for good, or is being retried in the background.
ReleaseOutcome = Literal["released", "lost", "failed", "retrying"]


def check_ttl(value: object, argument: str = "ttl", expiry: bool = True) -> float:
    """Return ``value`` as a number of seconds Redis can store, or raise naming ``argument``
    (``expiry``: the value is a lock's lifetime, and the message says why it is bounded).

    Raises:
        TypeError: not a number.
        ValueError: not finite, below :data:`MIN_TTL`, or above :data:`MAX_SECONDS`.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{argument} must be a number of seconds, not {type(value).__name__}")
    if not MIN_TTL <= value <= MAX_SECONDS:
        why = "; a lock that never expires is never freed after a crash" if expiry else ""
        raise ValueError(
            f"{argument} must be a finite number of seconds from {MIN_TTL} to "
            f"{MAX_SECONDS:.0f} (about 10 years), got {value!r}{why}"
        )
    return float(value)


def check_timeout(value: object, argument: str = "timeout") -> float | None:
    """Return ``value`` as a non-negative number of seconds or ``None`` (no limit)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{argument} must be a number of seconds or None, not {type(value).__name__}"
        )
    if not value >= 0:
        raise ValueError(f"{argument} must be >= 0 seconds or None, got {value!r}")
    if value == float("inf"):
        return None
    return float(value)


#: ``".000"`` to ``".999"``: the fraction :func:`since_now` ends with, ready-made
#: (formatting a number costs more than the rest of the description).
_MILLISECONDS = tuple(f".{n:03d}" for n in range(1000))

# The whole second since_now() last wrote, and its digits: one pair, replaced
# whole, so that a thread reads either the old pair or the new one.
_last_second: tuple[int, str] = (-1, "")


def since_now() -> str:
    """Now, as a holder description's ``since`` has it: seconds since the epoch
    to the millisecond, cut rather than rounded, so never later than now."""
    global _last_second
    ms = time.time_ns() // 1_000_000
    second = ms // 1000
    known, digits = _last_second
    if second != known:
        digits = str(second)
        _last_second = (second, digits)
    return digits + _MILLISECONDS[ms % 1000]


#: Longest value of a holder description field, in characters.
MAX_INFO_LENGTH = 200


def check_holder_info(value: object, argument: str = "holder_info") -> str:
    """The ACQUIRE argument for a holder description: one value per
    :data:`~celery_redislock.scripts.HOLDER_FIELDS` name up to the last that is not
    empty, joined by :data:`~celery_redislock.scripts.SEPARATOR` (``""`` for none)."""
    if value is None:
        return ""
    if not isinstance(value, Mapping):
        raise TypeError(f"{argument} must be a mapping of str to str, not {type(value).__name__}")
    unknown = set(value) - set(HOLDER_FIELDS)
    if unknown:
        raise ValueError(
            f"{argument} has unknown field(s) {sorted(map(str, unknown))}; "
            f"known: {', '.join(HOLDER_FIELDS)}"
        )
    for field, text in value.items():
        if not isinstance(text, str) or len(text) > MAX_INFO_LENGTH:
            raise ValueError(
                f"{argument}[{field!r}] must be a str of at most {MAX_INFO_LENGTH} characters"
            )
        check_stored(text, f"{argument}[{field!r}]")
    values = [str(value.get(field, "")) for field in HOLDER_FIELDS]
    while values and not values[-1]:
        values.pop()  # (an empty field at the end is not sent)
    return SEPARATOR.join(values)


def check_name(value: object, argument: str = "name") -> str:
    """Return ``value`` if it is a non-empty string Redis can store (UTF-8 encodable)."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{argument} must be a non-empty string")
    if value.isascii():
        # (A flag of the string: no copy made to find it out.)
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{argument} {value!r} cannot be encoded as UTF-8 ({exc.reason} at "
            f"position {exc.start}); lone surrogates cannot be sent to Redis"
        ) from None
    return value


def check_stored(value: str, argument: str) -> str:
    """Return ``value`` if a lock's value can hold it: it must not contain
    :data:`~celery_redislock.scripts.SEPARATOR`, which separates the fields."""
    if SEPARATOR in value:
        raise ValueError(
            f"{argument} {value!r} contains {SEPARATOR!r}, which separates the fields of "
            "a lock's stored value; use one without it"
        )
    return value


def check_prefix(value: object, argument: str = "prefix") -> str:
    """Return ``value`` if it is a usable key prefix (non-empty, no empty ``{}`` tag)."""
    prefix = check_name(value, argument)
    if _empty_hash_tag(prefix):
        raise ValueError(
            f"{argument} {prefix!r} contains an empty {{hash tag}}; the lock's keys would "
            "land on different cluster slots"
        )
    return prefix


def _empty_hash_tag(text: str) -> bool:
    """Whether the first ``{`` in ``text`` is directly followed by ``}`` (an empty tag,
    which Redis Cluster ignores, hashing the whole key instead)."""
    start = text.find("{")
    return start != -1 and text[start + 1 : start + 2] == "}"


class LockKeys(NamedTuple):
    """The Redis keys of one lock name."""

    #: The lock key (held, or free and keeping the fence counter).
    lock: str
    #: The sorted set of queued waiters.
    queue: str


def wake_channel_prefix(prefix: str = DEFAULT_PREFIX) -> str:
    """The start of every process's wake channel, ``<prefix>:wake:``."""
    return f"{prefix}:wake:"


def lock_keys(name: str, prefix: str = DEFAULT_PREFIX) -> LockKeys:
    """Return the keys (lock key, waiter queue) of a lock name.

    The name is the ``{hash tag}`` of every key, so the keys one script touches
    share a cluster slot. A name starting with ``}`` would make that tag empty, so
    such names (and, to keep the mapping one-to-one, names starting with ``\\``)
    get a ``\\`` in front inside the braces.

    Raises:
        ValueError: ``prefix`` itself contains an empty hash tag (``{}``).
    """
    check_prefix(prefix)
    check_name(name)
    return LockKeys(*_keys(name, prefix))


def _keys(name: str, prefix: str) -> tuple[str, str]:
    """:func:`lock_keys` of a name and prefix already checked."""
    if name.startswith(("}", "\\")):
        name = "\\" + name
    base = f"{prefix}:{{{name}}}"
    return base, f"{base}:waiters"


def name_from_key(key: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The lock name behind a lock key: the inverse of :func:`lock_keys`."""
    name = key[len(prefix) + 2 : -1]
    return name[1:] if name.startswith("\\") else name


#: The frees of a hold that :meth:`RedisLock._free_later` sends in the background,
#: tied to the hold's fencing token, and the undos of unconfirmed acquires
#: (:meth:`RedisLock._undo`), tied to the acquire's request id, by the router of
#: their store and lock key, each with when it gives up; each goes once the
#: heartbeat's tries of it end (landed or given up), or, past its time, as
#: another is added. Until one lands, the next acquire of that key in this
#: process sends it ahead, in its own round trip: a hold due to be freed (the
#: reservation of a send that failed while the store was unreachable, or that
#: a send's acquire made though its answer was lost) no longer meets that
#: acquire, back-off or not. Tied to its hold, a free that arrives after the
#: lock changed hands (even to the same owner token, a message's reservation
#: made again) changes nothing.
_frees_pending: weakref.WeakKeyDictionary[Router, dict[str, tuple[tuple[Call, float], ...]]] = (
    weakref.WeakKeyDictionary()
)
_frees_guard = threading.Lock()


def _pending_frees(router: Router, key: str) -> tuple[tuple[Call, float], ...]:
    """The frees sent in the background still due for lock ``key`` (see
    :data:`_frees_pending`); those that gave up are forgotten."""
    with _frees_guard:
        by_key = _frees_pending.get(router)
        if not by_key or key not in by_key:
            return ()
        now = time.monotonic()
        due = tuple(item for item in by_key[key] if item[1] > now)
        _keep(router, by_key, key, due)
        return due


def _pend_free(router: Router, key: str, item: tuple[Call, float]) -> Callable[[], None]:
    """Keep ``item``, a free of lock ``key`` sent in the background, to go ahead of
    the next acquire of that key in this process (see :data:`_frees_pending`);
    return what forgets it once the heartbeat's tries of it end."""
    with _frees_guard:
        now = time.monotonic()
        # Those past their time go too (whose end was never reported).
        kept = {
            other: due
            for other, frees in _frees_pending.get(router, {}).items()
            if (due := tuple(free for free in frees if free[1] > now))
        }
        kept[key] = (*kept.get(key, ()), item)
        _frees_pending[router] = kept
    return functools.partial(_free_ended, weakref.ref(router), key, item)


def _frees_landed(router: Router, key: str, landed: tuple[tuple[Call, float], ...]) -> None:
    """Forget the frees ``landed`` ahead of a request about ``key`` that was
    answered, or whose tries in the background have ended."""
    with _frees_guard:
        by_key = _frees_pending.get(router)
        if not by_key or key not in by_key:
            return
        _keep(router, by_key, key, tuple(item for item in by_key[key] if item not in landed))


def _free_ended(held: weakref.ref[Router], key: str, item: tuple[Call, float]) -> None:
    """The heartbeat's tries of the free ``item`` of lock ``key`` have ended: it
    is no longer sent ahead of an acquire (see :data:`_frees_pending`)."""
    router = held()
    if router is not None:
        _frees_landed(router, key, (item,))


def _keep(
    router: Router,
    by_key: dict[str, tuple[tuple[Call, float], ...]],
    key: str,
    frees: tuple[tuple[Call, float], ...],
) -> None:
    """Keep ``frees`` as those still due for ``key`` (under ``_frees_guard``):
    none left, the key goes, and the router with its last key."""
    if frees:
        by_key[key] = frees
        return
    del by_key[key]
    if not by_key:
        del _frees_pending[router]


class RedisLock:
    """A distributed lock held by an owner token, not by a thread.

    Arguments:
        client_or_url: a ``redis.Redis`` client or a ``redis://`` URL (clients for
            a URL are shared per process). A client lends its connection settings
            (host, database, credentials, TLS); the lock makes its own bounded
            connections with them, kept for the client's next locks. A client
            may be made for a job and dropped after it: once it is
            garbage-collected, and nothing of its locks still needs them (a held
            lock, which keeps its client, a release retried in the background, the
            answer of a ``release(wait=False)``), those connections are closed and
            the heartbeat and wake-up threads made for it end.
        name: the lock's name; every holder of the same name excludes the others.
        ttl: seconds the lock lives without renewal (default 60; never ``None``: a
            lock always expires), so a crashed holder's lock frees itself after at
            most this long.
        owner: the owner token. Default: 72 random bits in 12 characters. Two ``RedisLock``
            objects with the same owner are the same holder (re-entrant).
        lease: an optional lease id (a Celery task id). A hold whose owner is
            the lease's reservation (``<lease>`` +
            :data:`~celery_redislock.scripts.RESERVATION_SUFFIX`) is taken over by
            the next owner of the lease instead of waiting, with a new fencing
            token; the old owner's next renewal finds it lost. Two other owners
            of one lease exclude each other like any two owners.
        heartbeat: renew the lock in the background while held (default on).
        heartbeat_interval: seconds between renewals; default ``ttl / 3``.
        on_lost: called with the lock, from the heartbeat thread, if it is lost
            (a hold already lost as :meth:`acquire` returns it included).
        blocking_timeout: how long ``with lock:`` waits before raising
            :class:`~celery_redislock.errors.LockTimeoutError`; ``None`` waits forever.
        call_timeout: deadline, in seconds, of a round trip that has none of its
            own (a non-blocking acquire, release, extend, reads); a blocking
            acquire's timeout bounds its round trips instead when shorter.
        min_replicas: replicas that must confirm a new hold (Redis ``WAIT``, in the
            same round trip as the acquire) within ``replica_timeout`` seconds;
            otherwise the hold is given back and acquire raises
            :class:`~celery_redislock.errors.LockBackendError`. This narrows the
            window in which a failover loses a lock; it does not close it — the
            fencing token is the real defence.
        replica_timeout: see ``min_replicas``.
        holder_info: a description of the holder stored with each new hold (same
            round trip), for operators: any of ``task``, ``state``, ``node``,
            ``pid``, ``since`` (strings of at most 200 characters), stored as
            given, also with a hold a release hands to this lock after it waited
            (a :class:`~celery_redislock.task.SingletonTask`'s ``since`` alone is
            made when its hold began).
        prefix: key prefix.

    One object is one holder: threads sharing it share its holds (it is
    re-entrant by owner, not by thread), so give each thread its own object for
    exclusion between them.

    Raises:
        TypeError, ValueError: an argument is invalid; the message names it.
    """

    # The state every lock starts with, as class attributes: a lock stores its
    # own only once it changes (one is built for every task execution).
    #: The fencing token of the current hold; strictly increasing per name.
    token: int | None = None
    #: The lease (task id) that held the lock when an acquire last failed;
    #: ``None`` if it had none. Saves a round trip to ask who is in the way.
    blocked_by: str | None = None
    # The owner token of that hold, when it had this lock's lease (a reservation
    # of it, or another delivery of the same task).
    _blocked_owner: str | None = None
    # Whether another owner held it then (not: free, kept for the waiters a
    # release woke).
    _blocked_taken = False
    _lost = False
    _holds = 0
    # How many holds (taken or re-entered) acquires have confirmed: a verdict of
    # the heartbeat reached before the last one is not for the hold it made.
    _confirmations = 0
    _expiry = 0.0
    _pttl = 0
    # A waiter's place in the lock's queue, kept across its tries.
    _position: str | None = None
    # Send time of the last try of a waiting acquire, and the last fencing token
    # handed out for the name as that try found it held (None until it answers).
    _tried = 0.0
    _held_fence: int | None = None
    # Send time of the first try of the current acquire that may have run while
    # its reply never came (a later try's answer does not settle it: see _undo()).
    _unconfirmed: float | None = None
    # The releases the lock remembered as the current hold was taken (see
    # scripts.AcquireReply.released).
    _released: str | None = None
    # Whether the current hold came after waiting for another's: others are then
    # likely queued still, so its release reads the lock before it writes (see
    # scripts.RELEASE, ARGV[8]).
    _waited = False
    # The request id of the last change this object made to its hold, as the
    # server records it (None: not known): the release of an inner hold acts
    # only if it still is, so that one sent again after the holder re-entered
    # the lock does not drop a second hold (see scripts.RELEASE, ARGV[5]).
    _last_change: str | None = None
    # The inner releases that failed and are sent again in the background, with
    # when they give up: until one has landed, a later release of the hold it
    # dropped would drop another instead, so the next request that changes the
    # lock sends them first, in its own round trip (see _ahead()). The undo of
    # an acquire whose answer never came goes with them (see _undo()), and so
    # does a release that did not wait whose answer that request could not
    # read in time (see _read_owed()).
    _behind: tuple[tuple[Call, float], ...] = ()
    # How many of this object's releases that did not wait have no answer yet:
    # the next request that changes the lock reads them first (see _read_owed()),
    # so that one that failed goes ahead of it, in order.
    _unanswered = 0
    # Those releases, each as the ARGV it is sent again with, when it gives up
    # and whether it went among those sent ahead already, in a list emptied once
    # it is answered: one still owed after the next request's read (another
    # thread reads its connection) goes ahead of that request all the same, and
    # of the later ones until it lands, without their waiting for it again (see
    # _read_owed()).
    _owing: tuple[list[Any], ...] = ()
    _owed_by = 0
    _owed_on: Transport | None = None
    # Whether extend() gave the hold more than the lock's TTL since the last
    # renewal: the next renewal cuts it back, and the local deadline with it.
    _extended = False
    # When the last extend() was answered: a renewal sent before that may have
    # landed before the extend on the server, so it does not move the local
    # deadline past what the extend set.
    _extend_answered = -math.inf
    # One floor per extend() on its way: the earliest expiry a renewal confirmed
    # meanwhile set (it may have landed after the extend, setting the lock's own TTL).
    _extending: tuple[list[float], ...] = ()
    # The heartbeat lane renewing the current hold, if any.
    _lane: _Lane | None = None
    # The owner token of a hold of this lock's lease that its holder hands to this
    # object: the next acquire takes it over (see scripts.ACQUIRE, ARGV[8]).
    _handed_from = ""
    # Whether the next acquire only moves the hold ``_handed_from`` names, and
    # takes nothing if that hold has gone (see scripts.ACQUIRE, ARGV[10]).
    _move_only = False
    # The owner token and fencing token (None: not known) of the message's
    # reservation this lock's acquire takes over, if any (an ``until_*`` task's
    # execution): see _free_reservation().
    _reserved_by: tuple[str, int | None] | None = None
    # The ids of this object's last waiters that gave up (at most GONE_WAITERS,
    # space-separated): a queue entry of theirs may outlive them, and a hold a
    # release hands to one is nobody's, which the next acquire takes anew rather
    # than re-enter (see scripts.ACQUIRE, ARGV[9]).
    _gone_waiters = ""
    # Whether the holder description's ``since`` (its last value) says when the
    # hold began, as a SingletonTask execution's does (see _shared()): an acquire
    # that may wait, and every try of its wait, write the time it is sent there,
    # and a waiter's queue entry leaves it to the release that hands it the lock
    # (see scripts.queue_entry). Otherwise the description is stored as given.
    _since_kept = False

    # The state set by _fill() (every lock has all of it).
    #: The lock's name, and the Redis keys of its value and of its waiter queue.
    name: str
    key: str
    queue_key: str
    #: The owner token (:func:`~celery_redislock.ids.owner_token` unless given).
    owner: str
    #: The lease (a Celery task id), ``""`` for none.
    lease: str
    ttl: float
    heartbeat_interval: float
    blocking_timeout: float | None
    call_timeout: float
    #: Replicas that must confirm a new hold (``WAIT``) before acquire succeeds.
    min_replicas: int
    replica_timeout: float
    client: Client
    prefix: str
    wake_prefix: str
    heartbeat: bool
    on_lost: Callable[[RedisLock], Any] | None
    #: The holder's description, as ACQUIRE takes it (see :func:`check_holder_info`).
    _info: str
    #: RESP bulk strings of the values every ACQUIRE and RELEASE by digest of the
    #: lock sends as they are (see :func:`_packed_acquire`): its key, queue key and
    #: owner token, in that order; its TTL in ms; its wake channel prefix.
    _keys_field: str
    _ttl_field: str
    _wake_field: str
    #: Guards every object's local hold state (its sections are a few
    #: assignments, never a request or a callback). One for all objects, so that
    #: a child forked while another thread held it can be given a new one.
    _state: ClassVar[threading.Lock] = threading.Lock()
    #: Signalled (with ``_state`` held) when a release that did not wait is
    #: answered while a request waits for such an answer (``_awaiting`` of them).
    _answers: ClassVar[threading.Condition] = threading.Condition(_state)
    _awaiting: ClassVar[int] = 0
    _heartbeat: Heartbeat | None
    _router: Router

    def __init__(
        self,
        client_or_url: Client | str,
        name: str,
        ttl: float = DEFAULT_TTL,
        *,
        owner: str | None = None,
        lease: str | None = None,
        heartbeat: bool = True,
        heartbeat_interval: float | None = None,
        on_lost: Callable[[RedisLock], Any] | None = None,
        blocking_timeout: float | None = None,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        min_replicas: int = 0,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
        holder_info: Mapping[str, str] | None = None,
        prefix: str = DEFAULT_PREFIX,
        _heartbeat: Heartbeat | None = None,
    ) -> None:
        check_name(name)
        check_prefix(prefix)
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be callable or None, not {type(on_lost).__name__}")
        ttl = check_ttl(ttl)
        if heartbeat_interval is not None:
            interval = check_ttl(heartbeat_interval, "heartbeat_interval", expiry=False)
            if interval >= ttl:
                raise ValueError(
                    f"heartbeat_interval ({heartbeat_interval}) must be shorter than ttl ({ttl}), "
                    "or the lock expires between renewals"
                )
        if owner is not None:
            check_stored(check_name(owner, "owner"), "owner")
        if lease is not None and lease != "":
            check_stored(check_name(lease, "lease"), "lease")
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int):
            raise TypeError(f"min_replicas must be an int, not {type(min_replicas).__name__}")
        if min_replicas < 0:
            raise ValueError(f"min_replicas must be >= 0, got {min_replicas}")
        shared = self._shared(
            as_client(client_or_url),
            ttl,
            on_lost=on_lost,
            min_replicas=min_replicas,
            prefix=prefix,
            heartbeat=heartbeat,
            heartbeat_interval=None if heartbeat_interval is None else interval,
            blocking_timeout=check_timeout(blocking_timeout, "blocking_timeout"),
            call_timeout=check_ttl(call_timeout, "call_timeout", expiry=False),
            replica_timeout=check_ttl(replica_timeout, "replica_timeout", expiry=False),
            beat=_heartbeat,
        )
        self._fill(
            shared, name, owner or owner_token(), lease or "", check_holder_info(holder_info)
        )

    @staticmethod
    def _shared(
        client: Client,
        ttl: float,
        *,
        on_lost: Callable[[RedisLock], Any] | None,
        min_replicas: int,
        prefix: str,
        heartbeat: bool = True,
        heartbeat_interval: float | None = None,
        blocking_timeout: float | None = None,
        call_timeout: float = DEFAULT_CALL_TIMEOUT,
        replica_timeout: float = DEFAULT_REPLICA_TIMEOUT,
        beat: Heartbeat | None = None,
        since_kept: bool = False,
    ) -> dict[str, Any]:
        """The state of a lock that does not depend on its name or holder, from
        checked values. Locks of one kind (the executions of one task) share it:
        it is built once, and copied into each by :meth:`_fill`.

        ``since_kept``: the holder descriptions these locks are given have all of
        :data:`~celery_redislock.scripts.HOLDER_FIELDS`, the last (``since``)
        :func:`since_now` as the lock is made; the lock keeps it saying when the
        hold began, should it wait for it (see :meth:`_stamp_since`)."""
        ttl = float(ttl)
        kept = {"_since_kept": True} if since_kept else {}
        wake_prefix = wake_channel_prefix(prefix)
        return {
            **kept,
            "ttl": ttl,
            "_ttl_field": _bulk(str(max(1, int(ttl * 1000)))),
            "_wake_field": _bulk(wake_prefix),
            "heartbeat_interval": ttl / 3 if heartbeat_interval is None else heartbeat_interval,
            "blocking_timeout": blocking_timeout,
            "call_timeout": call_timeout,
            "min_replicas": min_replicas,
            "replica_timeout": replica_timeout,
            "client": client,
            "prefix": prefix,
            "wake_prefix": wake_prefix,
            "heartbeat": heartbeat,
            "on_lost": on_lost,
            "_heartbeat": beat,
            "_router": router_for(client),
        }

    @classmethod
    def _from_shared(
        cls, shared: Mapping[str, Any], name: str, owner: str, lease: str, info: str
    ) -> RedisLock:
        """A lock of :meth:`_shared` state, built from values already checked: the
        per-execution lock of a :class:`~celery_redislock.task.SingletonTask`,
        built without checking them once more on every run."""
        lock = cls.__new__(cls)
        lock._fill(shared, name, owner, lease, info)
        return lock

    def _fill(
        self, shared: Mapping[str, Any], name: str, owner: str, lease: str, info: str
    ) -> None:
        """Set the state every lock starts with: ``shared`` (see :meth:`_shared`), its
        name, owner token, lease (``""`` for none) and holder description (as
        :func:`check_holder_info` returns it)."""
        state = self.__dict__
        state.update(shared)
        state["name"] = name
        state["key"], state["queue_key"] = key, queue_key = _keys(name, shared["prefix"])
        state["owner"] = owner
        state["_keys_field"] = (
            f"${len(key)}\r\n{key}\r\n${len(queue_key)}\r\n{queue_key}\r\n${len(owner)}\r\n{owner}\r\n"
        )
        state["lease"] = lease
        state["_info"] = info

    def __repr__(self) -> str:
        return f"<RedisLock {self.name!r} owner={self.owner[:8]}… token={self.token}>"

    # The heartbeat's view of the lock.
    @property
    def transport(self) -> Transport:
        """The connections this lock's requests travel on (on a cluster, those of
        the primary that owns the lock's slot now)."""
        return self._router.single or self._router.transport(self.key)

    @property
    def ttl_ms(self) -> int:
        """The TTL in whole milliseconds (at least 1)."""
        return max(1, int(self.ttl * 1000))

    @property
    def renew_interval(self) -> float:
        """Seconds between heartbeat renewals."""
        return self.heartbeat_interval

    def _renewed(self, sent: float) -> None:
        with self._state:
            self._may_have_renewed(sent)
            if self._lost:
                return
            if self._extended:
                # A renewal sets the lock's own TTL, shorter than the extend's: the
                # server's expiry may now be no later than this renewal's.
                self._expiry = sent + self.ttl
                self._extended = False
            elif sent < self._extend_answered:
                # Sent before a (shorter) extend was answered: it may have landed
                # before the extend.
                self._expiry = min(self._expiry, sent + self.ttl)
            else:
                self._expiry = max(self._expiry, sent + self.ttl)

    def _renewal_failed(self, sent: float) -> None:
        """A renewal sent at ``sent`` failed after it was written: it may have run
        all the same (its answer lost), so the server's expiry may be no later than
        its own, however much longer an extend made it."""
        with self._state:
            self._may_have_renewed(sent)
            self._expiry = min(self._expiry, sent + self.ttl)

    def _may_have_renewed(self, sent: float) -> None:
        """Bound by a renewal sent at ``sent`` the expiry each extend on its way
        will take: the renewal may run on the server after it."""
        for floor in self._extending:
            floor[0] = min(floor[0], sent + self.ttl)

    def _expires_at(self) -> float:
        return self._expiry

    @property
    def _clustered(self) -> bool:
        return self._router.single is None

    def _redirected(self, exc: BaseException) -> bool:
        router = self._router
        if router.single is None and isinstance(exc, TRANSIENT):
            # A primary out of reach (killed, or hung: frozen, cut off): the other
            # nodes say which primary serves its slots now, so that the renewals
            # reach the replica promoted in its place before the holds expire.
            failed = router.transport(self.key)
            return router.relocate(self.key, failed, Deadline.after(RELOCATE_WAIT))
        return router.redirected(exc)

    def _confirmed(self) -> int:
        return self._confirmations

    def _mark_lost(self, confirmed: int) -> bool | None:
        """Mark the current hold lost, on a verdict reached when ``confirmed``
        holds had been confirmed; return whether there was one not yet known to be
        lost (then :meth:`_report_lost` is due), or ``None`` (nothing marked) when
        an acquire has confirmed a hold since: the verdict is not for it."""
        with self._state:
            if self._confirmations != confirmed:
                return None
            if self._lost or self._holds == 0:
                return False
            self._lost = True
        return True

    def _report_lost(self) -> None:
        """Tell ``on_lost`` (from the heartbeat thread) that the lock was lost."""
        if self.on_lost is not None:
            self.on_lost(self)

    # Public API.
    @property
    def lost(self) -> bool:
        """Whether a hold of this object can no longer be trusted.

        True once the heartbeat found the lock taken over or expired, and as soon
        as the local deadline (the send time of the last confirmed acquire or
        renewal, plus the TTL) has passed — whether or not the heartbeat has run
        since, so a process resumed after a long pause sees it before its next write.
        """
        if self._lost:
            return True
        return self._holds > 0 and time.monotonic() >= self._expiry

    def check(self) -> None:
        """Raise unless this object holds the lock and its hold is still certain.

        Raises:
            LockLostError: the lock was held but is lost (see :attr:`lost`).
            LockNotOwnedError: this object does not hold the lock.
        """
        if self.lost:
            raise LockLostError(self.name)
        if self._holds == 0:
            raise LockNotOwnedError(self.name)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; return whether it was taken.

        A hold whose answer is read only once its TTL (counted from when the
        request was sent) has passed is taken, but :attr:`lost` as this returns:
        another may hold the lock by then. It is not renewed, and, with the
        heartbeat on, the heartbeat reports it lost at once (``on_lost``), as any
        hold whose local deadline passes.

        Arguments:
            blocking: wait for the lock if another owner holds it.
            timeout: with ``blocking``, give up after this many seconds
                (``None``: wait as long as it takes). It also bounds the round
                trips, so a stalled server costs at most this long (at least
                :data:`MIN_CALL`), and :data:`LEAVE_WAIT` more for a waiter
                that gives up to leave the queue (then it leaves it in the
                background).

        Raises:
            LockBackendError: Redis could not be reached (after retries within the
                deadline) or answered with an error.
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        return self._acquire(blocking, timeout)

    def _acquire(
        self,
        blocking: bool,
        timeout: float | None,
        held: Callable[[], Any] | None = None,
        stop: Callable[[], bool] | None = None,
        late_to_caller: bool = False,
    ) -> bool:
        """:meth:`acquire` with a checked ``timeout``; ``held()`` is called once if
        the lock is found held, before it is waited for (or given up on, for a
        ``timeout`` of 0): how a task reports the conflict it waits out. After
        each try that finds the lock held, the wait ends (``False``) if ``stop()``
        says so: how a task stops waiting for a hold that is no longer the one it
        waits out. ``late_to_caller``: a hold whose answer comes after its TTL is
        left to the caller (see :meth:`_record`)."""
        started = time.monotonic()
        ends = None if timeout is None or not blocking else started + timeout
        # Every try of this call sends the same request id: a try that landed
        # although its reply was lost is recognised by the next one.
        request = request_id()
        self._unconfirmed = None
        acquired = False
        try:
            deadline = (
                Deadline(started + self.call_timeout) if ends is None else self._call_deadline(ends)
            )
            waits = blocking and timeout != 0
            if waits and wakeups.subscribed(self.transport, self.prefix):
                # The process's wake-up subscription is in place: the first try
                # can queue, and a lock found held needs no second.
                acquired = self._wait(ends, request, held, stop=stop, late_to_caller=late_to_caller)
            else:
                if blocking and self._since_kept:
                    # (Usually after a try that found the lock held.)
                    self._stamp_since()
                acquired = self._try_acquire(deadline, request, late_to_caller=late_to_caller)
                if not acquired and held is not None:
                    held()
                if not acquired and waits and not (stop is not None and stop()):
                    acquired = self._wait(
                        ends, request, found_held=True, stop=stop, late_to_caller=late_to_caller
                    )
            return acquired
        finally:
            if self._unconfirmed is not None:
                self._undo(request, self._unconfirmed, kept=acquired)

    def release(
        self, wait: bool = True, then: Callable[[ReleaseOutcome], Any] | None = None
    ) -> None:
        """Drop one hold; the last hold frees the lock, or hands it to the next waiter.

        If Redis cannot be reached, the hold is dropped locally all the same: the
        lock is no longer renewed, the release is retried in the background until
        the lock's TTL would have run out, and this call raises. A release the
        server refuses (an ACL without a permission it needs) is dropped the same
        way, and raises, but is not retried: the lock expires by its TTL.

        Arguments:
            wait: wait for the server's answer (the default). With ``wait=False``
                the release is written to the server and the call returns: the
                hold is dropped locally at once (renewal stops), and the answer is
                read later — by the next request on that connection, or by the
                heartbeat thread once it has waited
                :data:`~celery_redislock.heartbeat.DRAIN_DELAY` to twice that
                with no request coming, or at exit. A lock found already lost
                is then logged, and a failed release retried in the background.
            then: with ``wait=False``, called with the outcome once the answer is
                read (from whichever thread reads it); it then also decides what to
                log about a lock found lost.

        Raises:
            LockNotOwnedError: this owner does not hold the lock (nothing deleted).
            LockLostError: this object held it, but it expired or was taken over.
            LockBackendError: Redis could not be reached; see above.
        """
        now = started = time.monotonic()
        if self._unanswered:
            # Before anything changes here: an interruption leaves the hold as it was.
            self._read_owed(Deadline(started + self.call_timeout))
            now = time.monotonic()
        request = request_id()
        inner = self._holds > 1
        args: tuple[Any, ...] = (
            self.owner,
            self.wake_prefix,
            request,
            # _free_ttl_ms(now), inline: this runs on every release.
            0 if self._expiry - now > self.call_timeout + KEEP_EXPIRY_MARGIN else FENCE_TTL_MS,
            "",
            "" if self.token is None else self.token,
            self._released or "",
        )
        if self._waited:
            # Others are likely queued still: read the lock before writing it.
            args = (*args, "read")
        # Sent again in the background, an inner hold's release acts only on the
        # hold as this object last changed it: arriving after the holder took the
        # lock once more, it drops no second hold. (Not the first send: another
        # object of the same owner, or another thread, may have changed it since;
        # the hold remembers a copy that dropped a hold of it, for the first send
        # arriving after it.)
        resend = _sent_again(args, self._last_change if inner else None)
        if inner:
            # Counted as landed from now on (the next inner release may follow
            # before this one's answer is read); unknown again if it fails.
            self._last_change = request
        if not wait:
            self._release_later(args, resend, then, now)
            return
        deadline = Deadline(started + self.call_timeout)
        call = self._release_call(args)
        if self._holds == 1:
            # The last hold: off the heartbeat before the release lands, so that a
            # renewal answered after it cannot report this lock lost.
            self._stop_renewal()
        ahead = self._ahead() if self._behind else ()
        transport = self.transport
        # When the hold would have expired; for a release of a hold this object
        # never took (a message's reservation, freed by the owner token alone),
        # a TTL of this lock's from now.
        until = self._expiry if self._holds else now + self.ttl
        try:
            result = Released(self._run(call, deadline, before=ahead))
        except RedisError as exc:
            self._release_failed(self._release_call(resend), exc)
        except BaseException:
            # Raised asynchronously (a soft time limit) before the answer came: as
            # for an answer lost, the hold is dropped here and the release is sent
            # again in the background (recognised if it ran).
            interrupted = RedisConnectionError("interrupted before its answer was read")
            with contextlib.suppress(LockBackendError):
                self._release_failed(self._release_call(resend), interrupted)
            raise
        if ahead:
            self._landed(ahead)
        if result is Released.NOT_OWNED:
            was_held = self._forget()
            if was_held:
                self._lost = True
                raise LockLostError(self.name)
            raise LockNotOwnedError(self.name)
        with self._state:
            self._holds = max(0, self._holds - 1)
            done = result is Released.FREED or self._holds == 0
        if done:
            self._forget()
        elif self.heartbeat and self._lane is None:
            # Another thread sharing this object took the lock again while what
            # was the last hold's release went (off the heartbeat): renew it again.
            self._lane = self._beat().register(self)
        if result is Released.FREED and (transport.follows_switches or self._clustered):
            # Only a release that freed the lock: one that dropped an inner hold
            # (of this owner's other object), sent again, would drop another.
            self._resend_on_switch(transport, now, resend, until)

    def _release_call(self, args: tuple[Any, ...]) -> Call:
        """The RELEASE script call of this lock with these ARGV."""
        return Call(RELEASE_SCRIPT, (self.key, self.queue_key), args)

    def _free_later(
        self, until: float, what: str, fence: int | None = None, owner: str | None = None
    ) -> None:
        """Free the lock in the background, if this owner (or ``owner``) still holds
        it, once the store answers: sent until it lands or ``until``. Never another
        owner's hold. Tied to the hold's fencing token (this object's, or
        ``fence`` for a hold it never took, such as a message's reservation),
        it never frees a later hold of the same owner token either, and the next
        acquire of the key in this process sends it first (see
        :data:`_frees_pending`). With neither known, it goes by the owner token
        alone."""
        token = self.token if fence is None else fence
        call = self._free_call(self.owner if owner is None else owner, token)
        then = None if token is None else _pend_free(self._router, self.key, (call, until))
        self._beat().retry_in_background(self, call, until, what, quiet=True, then=then)

    def _free_call(self, owner: str, fence: int | None) -> Call:
        """The RELEASE call that frees the hold of ``owner`` (tied to ``fence``, if
        known) whatever its count, remembered by no earlier release."""
        args = (
            owner, self.wake_prefix, request_id(), FENCE_TTL_MS, "", "" if fence is None else fence, "",
        )  # fmt: skip
        return self._release_call(args)

    def _free_reservation(self, written_at: float, at_once: bool) -> None:
        """Free the reservation of the message this lock's execution runs
        (:attr:`_reserved_by`): its acquire, written at ``written_at``, took it
        over, or found the lock held by another, and the execution ends.

        Where a failover promotes a replica that the take-over had not reached
        (the old primary took it, or the release too, after the promotion, or had
        not passed it on), or the send made the reservation on the new primary
        while the execution asked the old one (which may take writes until the
        Sentinels demote it), the reservation is left there, and nobody else
        frees it: for ``lock_enqueue_ttl``, every send of the same call would
        be deduplicated to a task that has ended. With ``at_once`` (its release
        found the hold gone: on the primary it asks, the reservation may be what
        is there instead), it is freed in the background at once; and it is freed
        on the new primary should the process learn within ``SWITCH_RESEND`` of
        ``written_at`` that the Sentinels had replaced a Sentinel-managed one,
        or that a cluster's slot map puts the key on another primary (an
        acquire that found another's hold learns nothing from a free sent where
        it found it, and sends none). A release whose
        answer is lost, sent again in the background, takes a free of the
        reservation along (see :meth:`_send_later`). Only that
        reservation goes, by its owner token and (if known) its fencing token:
        a hold another execution took over stays, and where there is none it
        changes nothing."""
        reserved = self._reserved_by
        if reserved is None:
            return
        owner, fence = reserved
        what = f"freeing lock {self.name!r} reserved by {owner!r}, whose execution has ended"
        until = written_at + SWITCH_RESEND + max(self.call_timeout, MIN_CALL)
        if at_once:
            self._free_later(max(until, time.monotonic() + self.ttl), what, fence, owner)
        transport = self.transport
        if transport.follows_switches or self._clustered:
            call = self._free_call(owner, fence)
            # (A failover may be learnt that long after the release: see FAILOVER_WAIT.)
            until = max(until, written_at + FAILOVER_WAIT)
            _resend_on_switch(self._beat(), self._router, transport, written_at, call, until, what)

    def _free_ttl_ms(self, now: float) -> int:
        """How long the key outlives a release sent ``now`` (the RELEASE script's
        ARGV[4]): 0 (its expiry stays the lock's own) while enough of the hold's
        local deadline is left, which the server's expiry is never earlier than."""
        left = self._expiry - now
        return 0 if left > self.call_timeout + KEEP_EXPIRY_MARGIN else FENCE_TTL_MS

    def _release_later(
        self,
        args: tuple[Any, ...],
        resend: tuple[Any, ...],
        then: Callable[[ReleaseOutcome], Any] | None,
        now: float,
    ) -> None:
        """``release(wait=False)`` of a RELEASE call with these ARGV (``resend``: those
        it is sent again with, in the background), sent ``now``: write the release,
        drop the hold, read the answer later."""
        transport = self._router.single or self.transport
        # While this release counts as unanswered (see _settled()): what it is
        # sent again with, until when (set below), and (once it is) whether it was
        # put among those sent ahead of the next request (see _read_owed()).
        counted: list[Any] = [resend, 0.0, False]
        # One section for the hold and the count: every release takes it.
        state = self._state
        # (Not ``with``: see _record().)
        state.acquire()
        try:
            if self._holds == 0:
                raise LockNotOwnedError(self.name)
            self._holds -= 1
            last = self._holds == 0
            until = counted[1] = self._expiry
            # The hold this release is for: an answer read after the object took
            # the lock anew (a new fencing token) says nothing about the new hold.
            token = self.token
            self._unanswered += 1
            self._owing = (*self._owing, counted)
            self._owed_by = _process_id
            self._owed_on = transport
        finally:
            state.release()
        lane = self._lane
        if last:
            # The count is 0 already: renewal stops now, whatever the send does.
            self._stop_renewal()
        ahead = self._ahead() if self._behind else ()

        def answered(result: list[Any] | RedisError) -> None:
            # _settled(), inline: this runs on every release.
            state = self._state
            state.acquire()
            try:
                if counted:
                    counted.clear()
                    self._unanswered -= 1
                    if not self._unanswered:
                        self._owing = ()
                    if RedisLock._awaiting:
                        self._answers.notify_all()
            finally:
                state.release()
            reply = result if isinstance(result, RedisError) else result[len(ahead)]
            outcome: ReleaseOutcome
            if not isinstance(reply, Exception):
                # It ran, so the server has the script now: the next goes by digest.
                if ahead:
                    self._landed(ahead)
                transport.scripts.add(RELEASE_SCRIPT.sha)
                if reply != _NOT_OWNED:
                    # The usual answer: nothing more to do (but on a primary the
                    # Sentinels, or a cluster failover, may turn out to have
                    # replaced meanwhile, a release that freed the lock goes
                    # again; one that dropped an inner hold, of this owner's
                    # other object, would drop another).
                    if reply == Released.FREED and (transport.follows_switches or self._clustered):
                        self._resend_on_switch(transport, now, resend, until)
                        if self._reserved_by is not None:
                            self._free_reservation(now, at_once=False)
                    if then is not None:
                        then("released")
                    return
                with self._state:
                    if self.token == token:
                        self._lost = True
                if last and self._reserved_by is not None:
                    self._free_reservation(now, at_once=True)
                if then is None:
                    logger.warning(
                        "celery_redislock: lock %s was no longer held when released (it "
                        "had expired or been taken over)",
                        self.name,
                    )
                outcome = "lost"
            else:
                again = _send_again(reply)
                if result is not reply:
                    if ahead and not again:
                        self._landed(ahead)
                    if not isinstance(reply, NoScriptError):
                        # It ran (its error was the script's).
                        transport.scripts.add(RELEASE_SCRIPT.sha)
                if again:
                    # Not run, not known to have run, or refused by a replica: send it
                    # again (it is recognised if it did run).
                    self._send_later(
                        self._release_call(resend), max(until, time.monotonic() + MIN_CALL), last
                    )
                    outcome = "retrying"
                else:
                    logger.warning(
                        "celery_redislock: releasing lock %s failed: %s", self.name, reply
                    )
                    outcome = "failed"
            if self._last_change == args[2]:
                self._last_change = None
            if then is not None:
                then(outcome)

        # By text until this server is known to have the script: a deferred
        # request that meets NOSCRIPT would only be sent again. (What by_sha() and
        # by_text() of _release_call(args) give, without building the Call: it
        # is needed only to send the release again.)
        packed = None
        if RELEASE_SCRIPT.sha in transport.scripts:
            command = ("EVALSHA", RELEASE_SCRIPT.sha, 2, self.key, self.queue_key, *args)
            if not ahead:
                packed = _packed_release(self._keys_field, self._wake_field, args)
        else:
            command = ("EVAL", RELEASE_SCRIPT.text, 2, self.key, self.queue_key, *args)
        try:
            transport.send_deferred(
                [*(call.by_text() for call, _until in ahead), command] if ahead else [command],
                Deadline(now + self.call_timeout),
                answered,
                packed,
            )
        except RedisError as exc:
            self._settled(counted)
            with self._state:
                self._holds += 1
            self._release_failed(self._release_call(resend), exc)
        except BaseException:
            self._settled(counted)
            # Raised asynchronously while it was written: it may not have gone.
            self._send_later(
                self._release_call(resend), max(until, time.monotonic() + MIN_CALL), last
            )
            raise
        if lane is None or lane.transport is not transport or not lane.drain_later():
            self._beat().drain_later(transport)

    def _resend_on_switch(
        self, transport: Transport, written_at: float, resend: tuple[Any, ...], until: float
    ) -> None:
        """A last hold's release written at ``written_at`` was answered by a
        Sentinel-managed primary, or a cluster primary: should the process learn
        soon that the Sentinels had replaced it, or that the cluster's slot map
        puts the key on another primary now, the release goes again, in the
        background, to the new one (until ``until``, when the hold would have
        expired). The old primary may have answered it after its replica was
        promoted (an operator's failover leaves it up), or died before its
        replica had it, and the lock would stay held there until its TTL.
        Sent again, a release that did land changes nothing; one that finds the
        lock taken since by another owner, or anew, leaves it alone."""
        _resend_on_switch(
            self._beat(),
            self._router,
            transport,
            written_at,
            self._release_call(resend),
            until,
            f"releasing lock {self.name!r} again on the new primary",
        )

    def _settled(self, counted: list[bool]) -> None:
        """A release that did not wait is answered, or failed as it was written:
        no longer unanswered (see :meth:`_read_owed`), once only (``counted`` is
        emptied)."""
        with self._state:
            if counted:
                counted.clear()
                self._unanswered -= 1
                if not self._unanswered:
                    self._owing = ()
                if RedisLock._awaiting:
                    self._answers.notify_all()

    def extend(self, ttl: float | None = None) -> None:
        """Reset the remaining TTL to ``ttl`` seconds (default: the lock's TTL).

        With the heartbeat on, it goes on renewing the lock to its own TTL, the
        next time before ``ttl`` runs out: a shorter ``ttl`` brings the next
        renewal forward, and a longer one lasts until the next renewal.
        An extend that raises after it was written may still have run (its
        answer lost): the holder's local deadline (see :attr:`lost`) is then no
        later than ``ttl`` from now.

        Raises:
            LockNotOwnedError: this owner does not hold the lock.
            LockLostError: this object held it, but it expired or was taken over
                (the hold of this owner on the server has another fencing token).
            LockBackendError: Redis could not be reached.
        """
        new_ttl = self.ttl if ttl is None else check_ttl(ttl)
        sent = time.monotonic()
        # The hold's fencing token, if this object holds it: another hold of the
        # same owner (a copy of an earlier one, on a primary promoted since) is not
        # this object's. Without a hold of its own, any hold of the owner.
        token = self.token if self._holds > 0 and self.token is not None else ""
        call = Call(EXTEND_SCRIPT, [self.key], [self.owner, max(1, int(new_ttl * 1000)), token])
        floor = [math.inf]
        with self._state:
            self._extending = (*self._extending, floor)
        # A listing of an unconfirmed try goes first: a copy of that try arriving
        # after this extend would otherwise renew the hold to the lock's own TTL.
        ahead = self._ahead() if self._behind else ()
        try:
            with backend_errors(f"extend lock {self.name!r}"):
                result = self._run(call, self._call_deadline(None), before=ahead)
        except BaseException as exc:
            with self._state:
                self._extending = tuple(f for f in self._extending if f is not floor)
                if not isinstance(exc, LockBackendError) or may_have_run(exc.__cause__ or exc):
                    # It may have run all the same (its answer lost): a shorter
                    # TTL then holds on the server.
                    self._expiry = min(self._expiry, sent + new_ttl)
            raise
        if ahead:
            self._landed(ahead)
        if result != 1:
            with self._state:
                self._extending = tuple(f for f in self._extending if f is not floor)
            if self._forget():
                self._lost = True
                raise LockLostError(self.name)
            raise LockNotOwnedError(self.name)
        with self._state:
            self._extending = tuple(f for f in self._extending if f is not floor)
            # A renewal answered while this extend was on its way may have run
            # after it on the server: the expiry is then no later than its own.
            self._expiry = min(sent + new_ttl, floor[0])
            self._extended = new_ttl > self.ttl
            self._extend_answered = time.monotonic()
            renewed = self._holds > 0 and not self._lost
        if self.heartbeat and renewed and new_ttl < self.ttl:
            # Registered anew, due before the shorter TTL runs out.
            first = min(new_ttl / 3, self.heartbeat_interval)
            self._lane = self._beat().register(self, first)

    def locked(self) -> bool:
        """Whether any owner holds the lock now."""
        return OWNER_FIELD in self._read()

    def owned(self) -> bool:
        """Whether this owner holds the lock now (asks Redis)."""
        return self._read().get(OWNER_FIELD) == self.owner

    def holder_lease(self) -> str | None:
        """The lease (task id) of whoever holds the lock now, if any."""
        fields = self._read()
        return fields.get(LEASE_FIELD) if OWNER_FIELD in fields else None

    @property
    def holding(self) -> bool:
        """Whether this object counts a hold (its local view: no round trip)."""
        return self._holds > 0

    def detach(self) -> None:
        """Stop renewing and forget the hold locally, leaving Redis untouched.

        The lock then lives until its TTL runs out, unless the holder handed it
        over first (how a retried Celery task keeps its lock across the retry).
        """
        self._forget()

    def _hand_over(self, to: RedisLock) -> bool:
        """Move this object's hold to ``to``, another owner of its lease, in an
        acquire of ``to`` that names this owner token (how a task's ``before_start``
        hands its lock to its own retry's reservation); return whether the hold moved.

        The hold is off the heartbeat meanwhile, so that no renewal sent between
        the move and its reply finds it gone and reports it lost. It is forgotten
        once it moved, and renewed on its schedule again if not.

        Raises:
            LockBackendError: as :meth:`acquire` (the hold is renewed again).
        """
        to._handed_from = self.owner
        renewed = self._lane is not None
        self._stop_renewal()
        moved = False
        try:
            moved = to.acquire(blocking=False)
        finally:
            if moved:
                self._forget()
            elif renewed and self.holding:
                # When the renewal it missed was due.
                due = self._expiry - self.ttl + self.renew_interval - time.monotonic()
                self._lane = self._beat().register(self, max(0.0, due))
        return moved

    def __enter__(self) -> RedisLock:
        if not self.acquire(blocking=True, timeout=self.blocking_timeout):
            raise LockTimeoutError(self.name, self.blocking_timeout)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    # Internal steps.
    def _call_deadline(self, ends: float | None) -> Deadline:
        """The deadline of one round trip for a caller whose own time ends at ``ends``."""
        now = time.monotonic()
        at = now + self.call_timeout
        if ends is not None:
            at = min(at, max(ends, now + MIN_CALL))
        return Deadline(at)

    def _read(self) -> dict[str, str]:
        """The lock's fields as stored now (:func:`~celery_redislock.scripts.decode_lock`)."""
        with backend_errors(f"read lock {self.name!r}"):
            return decode_lock(self._run(("GET", self.key), self._call_deadline(None)))

    def _run(
        self,
        call: Call | tuple[Any, ...],
        deadline: Deadline,
        then: Sequence[tuple[Any, ...]] = (),
        before: Sequence[tuple[Call, float]] = (),
    ) -> Any:
        """:func:`~celery_redislock.scripts.send` for this lock's key (``before``:
        what :meth:`_ahead` gave)."""
        calls = [c for c, _ in before] if before else ()
        return send(self._router, self.key, call, deadline, then, calls)

    def _sender(self) -> Callable[[Call, Deadline], Any] | None:
        """What sends a call to wherever this lock's key lives now, holding no
        reference to the lock (for requests the heartbeat sends again in the
        background, which must not keep a dropped lock alive); ``None`` on a
        single server, where the key has nowhere else to live (a Sentinel-managed
        primary's switches are followed by its transport itself)."""
        if self._router.single is not None:
            return None
        # The client too: the router holds it weakly, and the lock may have been
        # its only other holder.
        router, key, client = self._router, self.key, self.client

        def sender(call: Call, deadline: Deadline, _client: Client = client) -> Any:
            return send(router, key, call, deadline)

        return sender

    def _acquire_call(self, request: str, entry: str = "") -> Call:
        """The ACQUIRE script call of one try (a waiter with this queue ``entry``
        is queued if the lock is held)."""
        return Call(ACQUIRE_SCRIPT, (self.key, self.queue_key), self._acquire_args(request, entry))

    def _acquire_args(self, request: str, entry: str = "") -> tuple[str | int, ...]:
        """The ARGV of :meth:`_acquire_call`."""
        args: tuple[str | int, ...] = (
            self.owner,
            max(1, int(self.ttl * 1000)),
            self.lease,
            request,
            entry,
            (self._position or "") if entry else "",
        )
        # The description is left out, not sent empty, when there is none (unless
        # a hand-over or gone waiters follow it).
        if self._move_only:
            args = (*args, self._info, self._handed_from, self._gone_waiters, "1", self.wake_prefix)
        elif self._gone_waiters:
            args = (*args, self._info, self._handed_from, self._gone_waiters)
        elif self._handed_from:
            args = (*args, self._info, self._handed_from)
        elif self._info:
            args = (*args, self._info)
        return args

    def _try_acquire(
        self, deadline: Deadline, request: str, entry: str = "", late_to_caller: bool = False
    ) -> bool:
        """One acquire round trip; record the hold, or who holds the lock instead.

        A waiter (with its queue ``entry``) that finds the lock held is queued
        (keeping its place). ``late_to_caller``: see :meth:`_record`.
        """
        if self._unanswered:
            self._read_owed(deadline)
        call = self._acquire_call(request, entry)
        wait = self._replica_wait(deadline) if self.min_replicas else ()
        sent = self._tried = time.monotonic()
        self._held_fence = None
        ahead = self._ahead() if self._behind else ()
        frees = _pending_frees(self._router, self.key) if _frees_pending else ()
        try:
            # (An undo of this object's is among both: it goes once.)
            before = (
                [c for c, _ in (*ahead, *(free for free in frees if free not in ahead))]
                if ahead or frees
                else ()
            )
            raw = send(self._router, self.key, call, deadline, wait, before, self._unsure)
            reply = AcquireReply.parse(raw[0] if wait else raw)
        except RedisError as exc:
            if self._unconfirmed is None and may_have_run(exc):
                self._unconfirmed = sent
            raise LockBackendError(
                f"could not acquire lock {self.name!r}: {describe_error(exc)}"
            ) from exc
        except BaseException:
            # Raised asynchronously (a soft time limit) while the request may have
            # been written: the caller undoes what it may have done.
            if self._unconfirmed is None:
                self._unconfirmed = sent
            raise
        # A reply settles nothing about an earlier try of the same request that
        # may have been written: it may not have reached the server yet (held up
        # on the network, on the connection that broke), and arrive after this
        # one, or after the call ends. It stays unconfirmed, and is undone as
        # the call ends (see _undo()).
        if ahead:
            self._landed(ahead)
        if frees:
            _frees_landed(self._router, self.key, frees)
        if wait and reply.outcome is _TAKEN:
            self._check_replicas(raw[1], request, deadline)
        return self._record(reply, sent, request, late_to_caller)

    def _unsure(self) -> None:
        """A try of the acquire round trip sent last may have run, its answer lost,
        and been sent again (see :func:`~celery_redislock.scripts.send`): it stays
        unconfirmed until the call ends, whatever the next try is answered (see
        :meth:`_undo`)."""
        if self._unconfirmed is None:
            self._unconfirmed = self._tried

    def _record(
        self, reply: AcquireReply, sent: float, request: str, late_to_caller: bool = False
    ) -> bool:
        """Keep what an acquire sent at ``sent`` found: the hold it made (registered
        with the heartbeat), or who holds the lock instead; return whether it holds.

        A hold read only once its TTL had passed is registered too, due at once:
        the heartbeat finds it lost and reports it (``on_lost``), as for any hold
        whose local deadline passes. With ``late_to_caller`` (a task's acquire,
        whose caller gives such a hold back and asks anew before its body runs)
        it is left off the heartbeat instead: not renewed, and not reported lost."""
        if reply.outcome is _HELD:
            self.blocked_by = reply.holder
            self._blocked_owner = reply.owner
            self._blocked_taken = reply.taken
            self._pttl = reply.pttl
            self._held_fence = reply.last_fence
            self._position = reply.position or self._position
            return False
        state = self._state
        # acquire() and release(), not ``with``: half the cost, on every acquire.
        state.acquire()
        try:
            # Off the heartbeat: no hold yet, or the heartbeat found it lost.
            first = self._holds == 0 or self._lost
            if reply.outcome is _TAKEN:
                self._holds = 1
                self._released = reply.released
                self._waited = False
            else:
                self._holds += 1
            self.token = reply.fence
            self._lost = False
            self._expiry = sent + self.ttl
            self._extended = False
            self._last_change = request
            self._confirmations += 1
        finally:
            state.release()
        # A new hold (TAKEN) is registered even if this object still counted
        # holds from a lock it lost, and so is a hold re-entered after the
        # heartbeat found it lost (the server still had it): losing it took it
        # off the heartbeat.
        now = time.monotonic()
        late = now >= self._expiry
        if self.heartbeat and (first or reply.outcome is _TAKEN) and not (late and late_to_caller):
            # Renewed an interval after the request was sent, not after its reply
            # was read: a reply read late (written ahead as a worker accepted the
            # task) leaves the hold less of its TTL.
            due = max(0.0, sent + self.heartbeat_interval - now)
            self._lane = (self._heartbeat or get_heartbeat()).register(self, due)
        return True

    def _send_acquire(self, request: str | None = None) -> SentAcquire | None:
        """Write a non-blocking acquire now and read its reply later, with
        :meth:`_acquire_sent`: the round trip then overlaps what the caller does
        in between. The connection it is written on waits for that read.
        ``request``: its request id (a new one by default).

        ``None`` when it cannot go ahead of its caller: replicas must confirm it
        (``min_replicas``), or the store is a cluster (a redirection needs the
        reply). A write that fails is not raised here: it is the answer
        :meth:`_acquire_sent` reads. The whole acquire, tries included, has one
        ``call_timeout`` from the moment it was written, and at least half of one
        from the moment its reply is read: the caller's own work in between (a
        worker's, however slow) does not leave it without time to read a reply
        that came in long since.
        """
        ahead = self._acquire_to_send(request)
        if ahead is not None:
            self._write_acquire(ahead)
        return ahead

    def _acquire_to_send(self, request: str | None = None) -> SentAcquire | None:
        """The first half of :meth:`_send_acquire`: the acquire to write, not
        written yet (``None`` where it cannot go ahead of its caller). A caller
        that must give it back whatever happens keeps it before it is written
        with :meth:`_write_acquire`: an exception raised asynchronously as it is
        written then leaves it in the caller's hands, to read and give back."""
        transport = self._router.single
        if (
            transport is None
            or self.min_replicas
            or self._behind
            or (_frees_pending and _pending_frees(self._router, self.key))
        ):
            return None
        return SentAcquire(self, transport, request or request_id())

    def _write_acquire(self, ahead: SentAcquire) -> None:
        """The second half of :meth:`_send_acquire`: write ``ahead``. A write that
        fails is not raised: it is the answer :meth:`_acquire_sent` reads."""
        transport = ahead.transport
        # By text until this server is known to have the script: a request that
        # meets NOSCRIPT would only have to go again. (What by_sha() and by_text()
        # of _acquire_call() give, without building the Call.)
        packed = None
        if ACQUIRE_SCRIPT.sha in transport.scripts:
            if self._info and not self._handed_from and not self._gone_waiters:
                packed = _packed_acquire(
                    self._keys_field, self._ttl_field, self.lease, ahead.request, self._info
                )
            script = ("EVALSHA", ACQUIRE_SCRIPT.sha, 2, self.key, self.queue_key)
        else:
            script = ("EVAL", ACQUIRE_SCRIPT.text, 2, self.key, self.queue_key)
        # (Only a request that needs pack() itself is built for it.)
        commands = () if packed is not None else [(*script, *self._acquire_args(ahead.request))]
        try:
            ahead.link = transport.write(commands, Deadline(ahead.sent + self.call_timeout), packed)
            ahead.written = True
        except RedisError as exc:
            # Not written, or not whole: it did not run.
            ahead.answer = exc

    def _acquire_sent(self, ahead: SentAcquire) -> bool:
        """``acquire(blocking=False)`` whose first try is ``ahead``, written earlier.

        Its reply is read now (by the deadline :meth:`_send_acquire` gives). A try
        that failed is sent again with the same request id, which the script
        recognises if the first one ran (and should the first still be on its
        way, it is undone, or only listed as undone if the call holds the lock,
        as the call ends: see :meth:`_undo`). A hold whose reply came after its TTL is
        :attr:`lost` as this returns and left to the caller (to give back): it is
        not put on the heartbeat, so not reported lost.

        Raises:
            LockBackendError: as :meth:`acquire`.
        """
        # Unconfirmed until its reply is read: an exception raised asynchronously
        # meanwhile (a soft time limit) leaves it to be undone below.
        self._unconfirmed = ahead.sent if ahead.written else None
        acquired = False
        try:
            deadline = Deadline(
                max(ahead.sent + self.call_timeout, time.monotonic() + self.call_timeout / 2)
            )
            reply = ahead.reply(deadline)
            if isinstance(reply, list):
                self._unconfirmed = None
                ahead.transport.scripts.add(ACQUIRE_SCRIPT.sha)
                acquired = self._record(
                    AcquireReply.parse(reply), ahead.sent, ahead.request, late_to_caller=True
                )
                return acquired
            if not (ahead.written and may_have_run(reply)):
                self._unconfirmed = None
            if isinstance(reply, RedisTimeoutError) and deadline.remaining() < MIN_CALL:
                # The server did not answer in the time the call had: what is left
                # of it is no time for another try.
                raise LockBackendError(
                    f"could not acquire lock {self.name!r}: {describe_error(reply)}"
                ) from reply
            # Not run (NOSCRIPT: the server lost its scripts), not known to
            # have run, or an error the usual round trip reports or follows.
            acquired = self._try_acquire(deadline, ahead.request, late_to_caller=True)
            return acquired
        finally:
            if self._unconfirmed is not None:
                self._undo(ahead.request, self._unconfirmed, kept=acquired)

    def _acquire_at_once(self) -> bool | None:
        """``acquire(blocking=False)`` as an acquire written ahead whose reply is
        read at once (:meth:`_send_acquire`, then :meth:`_acquire_sent`): the
        request written from the lock's encoded fields, without the layers of the
        general path, which also queues, waits and batches what goes ahead of a
        request. ``None`` (nothing sent) where it cannot go that way: see
        :meth:`_send_acquire`. A hold whose reply came after its TTL is left to
        the caller, as :meth:`_acquire_sent` leaves it.

        From before the request is written until its reply is read, an exception
        raised asynchronously (a soft time limit) has what the request may have
        done undone in the background, as :meth:`acquire` has.

        Raises:
            LockBackendError: as :meth:`acquire`.
        """
        request = request_id()
        self._unconfirmed = time.monotonic()
        acquired = False
        ahead = None
        try:
            ahead = self._send_acquire(request)
            if ahead is None:
                self._unconfirmed = None
                return None
            acquired = self._acquire_sent(ahead)
            return acquired
        finally:
            if self._unconfirmed is not None:
                if ahead is not None:
                    # Its reply is never read.
                    ahead.drop()
                self._undo(request, self._unconfirmed, kept=acquired)

    def _replica_wait(self, deadline: Deadline) -> list[tuple[Any, ...]]:
        """The ``WAIT`` that follows an acquire when replicas must confirm it."""
        seconds = min(self.replica_timeout, deadline.remaining() - MIN_CALL / 2)
        return [("WAIT", self.min_replicas, max(1, int(seconds * 1000)))]

    def _check_replicas(self, acknowledged: Any, request: str, deadline: Deadline) -> None:
        """Give the lock back, and raise, if too few replicas confirmed the acquire.

        The hold is given back before this returns (in the background only if
        that fails): a caller that tries again at once must not find it, re-enter
        it and be told it holds a lock no replica confirmed.
        """
        if not isinstance(acknowledged, Exception) and int(acknowledged) >= self.min_replicas:
            return
        try:
            self._run(
                self._undo_call(request),
                Deadline(max(deadline.at, time.monotonic() + MIN_CALL / 2)),
            )
        except BaseException as exc:
            self._undo(request, time.monotonic())
            if not isinstance(exc, RedisError):
                raise
        else:
            self._unconfirmed = None
            self._last_change = None
        raise LockBackendError(
            f"lock {self.name!r} was taken on the primary, but "
            + (
                f"only {acknowledged} of {self.min_replicas} replica(s) confirmed it"
                if not isinstance(acknowledged, Exception)
                else f"WAIT failed ({acknowledged})"
            )
            + f" within {self.replica_timeout} s; it was given back. Check the "
            "replicas, or lower min_replicas"
        )

    def _undo_call(self, request: str, kept: bool = False) -> Call:
        """The release that undoes acquire ``request``, if it is still the lock's
        last change. Whatever it finds, the lock lists ``request`` (and this
        owner) as undone for the acquire's TTL (an hour at least), through the
        holds and frees that follow, so that the acquire, should it arrive after
        its undo (held up on the network), takes nothing, whoever holds the lock
        then (see :data:`~celery_redislock.scripts.RELEASE`, ARGV[10]). The last
        :data:`~celery_redislock.scripts.UNDONE_REMEMBERED` undos of the name are
        listed so; the list goes with the key (a hold that expires rather than
        being released).

        With ``kept`` (the acquire's caller holds what it took, confirmed by a
        later try of it) it only lists ``request``, and leaves every hold as it
        is: it names the hold by :data:`NO_HOLD_FENCE`, a fencing token no hold
        has, and the release leaves a hold with another token alone."""
        keep = max(FENCE_TTL_MS, int(self.ttl * 1000))
        fence = NO_HOLD_FENCE if kept else ""
        args = [self.owner, self.wake_prefix, request_id(), keep, request, fence]
        return Call(RELEASE_SCRIPT, [self.key, self.queue_key], [*args, "", "", "", UNDO_MARK])

    def _undo(self, request: str, sent: float, kept: bool = False) -> None:
        """Release, in the background, the hold an unconfirmed acquire may have made
        (sent first at ``sent``); with ``kept``, only make sure that a copy of it
        still on its way takes nothing (see :meth:`_undo_call`).

        A try of an acquire that may have been written (its answer lost) is
        unconfirmed, whatever the later tries of the same request are answered:
        it may still be on its way, held up on the network on the connection that
        broke, and reach the server after them, or after the call has ended. A
        call that ends without the lock undoes it; one that ends holding the lock
        (``kept``: a later try took it, or a release handed it to the waiter)
        has it listed as undone, so that such a copy neither re-enters the hold
        once its last change is another (a count of two, of which the holder's
        release drops one) nor takes the lock after the holder's release, for an
        owner that neither renews nor releases it. Only on this path: a call
        whose tries were all answered sends nothing more.

        The undo acts only if that acquire landed and is still the last change to the
        lock, rather than leave the lock held for a whole TTL by an owner that
        does not know it holds it. Until it has landed, the next request of this
        object that changes the lock sends it first (see :meth:`_ahead`): an
        acquire made again meanwhile would otherwise re-enter the unknown hold
        (a count of two, of which its release drops one), and the undo, no longer
        behind the last change, would then leave the other for the TTL. So does
        the next acquire of the key by any other object of this process (see
        :data:`_frees_pending`; a task's send makes a new one each time), which
        would otherwise find the unknown hold: refused (a message deduplicated
        to one never sent), or, of the same owner, re-entering it. A ``kept``
        one goes ahead of them alike, so that it is listed before this object's
        next change to the hold (until then a copy that arrives is recognised
        as the hold's last change, and only renews it).
        """
        self._unconfirmed = None
        if not kept:
            # If it lands, it makes a change this object does not know the id of.
            self._last_change = None
        # A kept hold's listing is sent for a TTL from now: the try it names may
        # have gone long before the hold was taken (a waiter's).
        item = (self._undo_call(request, kept), (time.monotonic() if kept else sent) + self.ttl)
        with self._state:
            if self._holds and not kept:
                # A re-entry that landed set the lock's own TTL (the undo keeps
                # it), back from a longer extend's. (A copy of a kept hold's try
                # that lands renews the hold, or is refused: its deadline stays.)
                self._expiry = min(self._expiry, sent + self.ttl)
            self._behind = (*self._behind, item)
        self._beat().retry_in_background(
            self,
            *item,
            f"undoing the unconfirmed acquire of lock {self.name!r}"
            if not kept
            else f"listing as undone the unconfirmed first try of the acquire of lock {self.name!r}",
            # Finding nothing to undo is as expected as undoing a hold.
            quiet=True,
            then=_pend_free(self._router, self.key, item),
        )

    def _wait(
        self,
        ends: float | None,
        request: str,
        held: Callable[[], Any] | None = None,
        found_held: bool = False,
        stop: Callable[[], bool] | None = None,
        late_to_caller: bool = False,
    ) -> bool:
        """Queue for the lock and wait to be woken (or for the holder's TTL), until
        ``ends`` or until ``stop()`` is true after a try; ``held()`` is called once,
        after the first try that finds the lock held (``found_held``: a try before
        this call found it so; ``late_to_caller``: see :meth:`_record`).

        The process's wake-up subscription must be live before a try, or a
        wake-up could slip by between the try and the wait: a waiter waits for it
        (a call's timeout at most), and tries without it if it is not back by then.
        Without it, no wake-up can come: the waiter asks again every
        :data:`UNSUBSCRIBED_RECHECK` seconds, and at once when it is back. A
        subscription not in place is no failure to reach Redis by itself: only a
        failed try is (one without the subscription counts from when it went, or
        from the last try answered since). A failed try is retried with a short
        pause; a waiter that has failed to reach Redis for ``call_timeout`` seconds
        in a row (or whose time ran out after a failure) raises, but for one whose
        last try, having found the lock held before, timed out with the time: that
        returns ``False``.

        On a Redis Cluster the waiter's subscription follows its lock's key: once
        a try has found the key on another primary (a failover promoted a
        replica), the waiter moves to that primary's hub, keeping its id (its
        place in the queue), and is subscribed there before its next try, made
        at once. A hub whose server cannot be reached (killed, frozen, cut off)
        is not waited for: a try finds where the key lives now. A failed try
        after which the cluster names another primary for the key starts the
        count of failures afresh.
        """
        hub, waiter = wakeups.join(self.transport, self.prefix)
        # On a cluster, a try is not held up by a subscription to a node out of reach.
        cluster = self._router.single is None
        # The hub subscribes on the server that holds the queue: a release may
        # read there whether this process still lives (see scripts.WATCHED).
        # Where that server changes (a Sentinel switch, a cluster's slot that
        # moves), a release there before the process follows passes its
        # waiters over, and they ask again in their places: a cluster sends
        # every node what is published, and a Sentinel-managed hub subscribes
        # on the new primary as the switch is learnt (WakeHub.primary_switched).
        # A cluster's hub is on the node itself, which counts it, whatever it
        # heard (a waiter passed over there has its key on another primary now,
        # whose hub it moves to). A cluster node counts only for a slot it serves
        # (see scripts.WATCHED_ON_CLUSTER).
        watched = cluster or not hub.unseen
        marked = queue_entry(
            waiter.id,
            self.owner,
            self.ttl_ms,
            self.lease,
            self._info,
            watched,
            since_at_grant=self._since_kept,
            cluster=cluster,
        )
        # Sent while the subscription is down (or after a release passed the waiter
        # over all the same), lest every release take the waiter for dead.
        plain = unwatched(marked)
        entry = marked
        self._position = None
        acquired = False
        failing_since: float | None = None
        pause = 0.01
        last_try = False
        # Whether the last try was made with the subscription in place (or there
        # was none yet): the next waits for it, if it broke, before it goes.
        subscribed = True
        # Without it, since when the waiter has heard nothing from Redis (None:
        # it has it).
        unheard_since: float | None = None
        # Whether a try whose answer was lost may have queued the entry without
        # this waiter learning its position.
        unsure = False
        try:
            while True:
                now = time.monotonic()
                trying = False
                if watched and waiter.passed:
                    # A release passed it over as dead (and took its entry out of
                    # the queue), yet its message came (see WakeHub.unseen): it asks
                    # again at once, queued in its place, and is not checked again.
                    watched = False
                try:
                    if cluster and hub.transport is not self.transport:
                        hub = self._follow_key(hub, waiter)
                        subscribed = True
                    # Re-armed first: a break of the subscription right after it is
                    # confirmed wakes this waiter, which then waits for it again.
                    hub.rearm(waiter)
                    # After a try without it, the wait for it is already over.
                    subscribed = hub.wait_ready(
                        self._call_deadline(ends) if subscribed else Deadline(0.0),
                        wait_if_unreachable=not cluster,
                    )
                    if subscribed:
                        unheard_since = None
                    elif unheard_since is None:
                        unheard_since = now
                    entry = marked if watched and subscribed else plain
                    if self._since_kept:
                        self._stamp_since()
                    now = time.monotonic()
                    trying = True
                    if self._try_acquire(self._call_deadline(ends), request, entry, late_to_caller):
                        acquired = True
                        if found_held:
                            self._waited = True
                        return True
                    found_held = True
                    if held is not None:
                        report, held = held, None
                        report()
                    if stop is not None and stop():
                        return False
                    failing_since, pause = None, 0.01
                    if not subscribed:
                        unheard_since = time.monotonic()
                    if self._pttl > 0:
                        wait = min(self._pttl / 1000, RECHECK)
                    else:
                        # Just expired; or a key without expiry (only an operator's
                        # PERSIST makes one), asked about again every RECHECK.
                        wait = RECHECK if self._pttl == -1 else 0.001
                    if not subscribed:
                        wait = min(wait, UNSUBSCRIBED_RECHECK)
                    if ends is not None:
                        remaining = ends - time.monotonic()
                        if remaining <= 0 or last_try:
                            return False
                        # Sleeping to the deadline: the try after it is the last.
                        last_try = remaining <= wait
                        wait = min(wait, remaining)
                    if cluster and hub.transport is not self.transport:
                        # The key lives on another primary now (the try followed
                        # it there), where a release sends its wake-ups:
                        # subscribed there before the next try, at once.
                        continue
                    if not subscribed:
                        # No wake-up can come: asked again after the pause, or as
                        # soon as the subscription is back (one sent before it is
                        # lost).
                        if hub.wait_ready(Deadline.after(wait)):
                            last_try = False
                        continue
                    if self._wait_on(hub, waiter, wait) if cluster else hub.wait(waiter, wait):
                        last_try = False
                        if waiter.spare:
                            # Woken second: the first woken waiter goes ahead, unless
                            # it is gone (then this one takes the lock after the pause:
                            # behind a lock handed to the first, once the grant has run
                            # out). Still queued at the front, it may be woken again
                            # meanwhile by the next release: then it is handed the lock,
                            # or asks at once.
                            pause_for = SPARE_HEAD_START
                            if waiter.behind:
                                # The grant is the first waiter's TTL if shorter: a
                                # waiter for the same lock usually has this one's.
                                pause_for = min(GRANT_MS, self.ttl_ms) / 1000
                            if ends is not None:
                                pause_for = min(pause_for, max(0.0, ends - time.monotonic()))
                            if not hub.rearm_spare(waiter):
                                hub.wait(waiter, pause_for)
                        if waiter.fence is not None and self._keep_handed(waiter.fence):
                            acquired = True
                            return True
                    continue
                except RedisError as exc:
                    error = LockBackendError(
                        f"could not wait for lock {self.name!r}: {describe_error(exc)}"
                    )
                    error.__cause__ = exc
                except LockBackendError as exc:
                    error = exc
                except BaseException:
                    # Raised asynchronously (a soft time limit): a try under way may
                    # have queued this waiter.
                    unsure = unsure or trying
                    raise
                cause = error.__cause__
                unsure = unsure or (trying and cause is not None and may_have_run(cause))
                # Only a broken connection, a timeout or a busy server is worth
                # another try.
                if not is_transient(error.__cause__):
                    raise error
                if cluster and hub.transport is not self.transport:
                    # The cluster names another primary for the key now (a
                    # failover): not out of reach, but on its way there, where
                    # the next try goes (its failures count from now).
                    failing_since = time.monotonic()
                elif failing_since is None:
                    # A try that fails without the subscription confirms what its
                    # absence suggested: Redis has been out of reach since it went
                    # (or since the last try it answered).
                    failing_since = now if unheard_since is None else unheard_since
                out_of_time = ends is not None and time.monotonic() + pause >= ends
                failing_long = time.monotonic() - failing_since >= self.call_timeout
                timed_out = trying and isinstance(cause, RedisTimeoutError)
                if out_of_time and found_held and timed_out and not failing_long:
                    # The time ran out with the lock last found held, and the last
                    # try got no answer in what was left of it (a server further
                    # away than that): what a timeout says, not a lock store out of
                    # reach, which a refused connection shows. A try that may have
                    # run is undone as the call ends.
                    return False
                if out_of_time or failing_long:
                    raise error
                time.sleep(pause)
                pause = min(0.5, pause * 2)
        finally:
            hub.leave(waiter)
            if not acquired and (self._position is not None or unsure):
                self._leave_queue(entry)
            self._position = None

    def _stamp_since(self) -> None:
        """Make the holder description's ``since`` now (see ``_since_kept``): the
        try about to be sent takes the lock, if it does, no earlier than that.
        Its queue entry leaves ``since`` to a release that hands the lock over."""
        info = self._info
        self._info = info[: info.rindex(SEPARATOR) + 1] + since_now()

    def _wait_on(self, hub: WakeHub, waiter: Waiter, timeout: float) -> bool:
        """:meth:`WakeHub.wait` on a Redis Cluster: whether ``waiter`` was woken
        within ``timeout`` seconds. While the hub's server leaves a probe of the
        subscription unanswered for :data:`CLUSTER_TRY` (it hangs: frozen, cut
        off), the other nodes are asked where the lock's key lives now; ``False``
        as soon as that is another primary, whose hub the waiter then moves to,
        there to be woken by the next release (a lock handed to it by one
        meanwhile is found by the try that follows the move)."""
        ends = time.monotonic() + timeout
        while True:
            if hub.wait(waiter, min(WATCH_HUB, ends - time.monotonic())):
                return True
            if time.monotonic() >= ends:
                return False
            if hub.unanswered() >= CLUSTER_TRY:
                # In the background: looked at again after the next slice.
                self._router.relocate(self.key, hub.transport, Deadline(0.0))
            if hub.transport is not self.transport:
                return False

    def _follow_key(self, hub: WakeHub, waiter: Waiter) -> WakeHub:
        """Move ``waiter`` from ``hub`` to the hub of the primary this lock's key
        lives on now (a Redis Cluster's failover or resharding moved it); return
        that hub. The waiter keeps its id, so its place in the queue: the hub it
        leaves stops subscribing once nobody else waits on it."""
        hub.leave(waiter)
        moved, _ = wakeups.join(self.transport, self.prefix, waiter)
        return moved

    def _keep_handed(self, fence: int) -> bool:
        """Hold the lock a release handed to this waiter (with ``fence``), without
        a round trip, if that is safe; else the next try confirms it.

        A hold handed over after this waiter's last try has a higher token than
        the one that try found (a wake-up read late can be older than the try, and
        is then left to the next try). That release gave the hold ``GRANT_MS`` (at
        most the TTL), so the server cannot expire it before the last try's send
        time plus that: the local deadline. It is kept if at least half of that
        is left and the heartbeat renews it (to the full TTL, a third of the way
        through the grant); a hold that replicas must confirm (``min_replicas``)
        always takes the round trip, which waits for them.
        """
        if not self.heartbeat or self.min_replicas:
            return False
        if self._held_fence is None or fence <= self._held_fence:
            return False
        # What the release gave it, in whole ms as the script counts them.
        granted = min(self.ttl_ms, GRANT_MS) / 1000
        now = time.monotonic()
        if self._tried + granted - now < granted / 2:
            return False
        with self._state:
            self._holds = 1
            self.token = fence
            self._lost = False
            self._expiry = self._tried + granted
            self._waited = True
            # The release that handed it over made the last change.
            self._last_change = None
        # Renewed (to the full TTL) when a third of the grant has gone, as a lock
        # with the grant's TTL would be.
        self._lane = self._beat().register(self, max(0.0, self._tried + granted / 3 - now))
        return True

    def _leave_queue(self, entry: str) -> None:
        """Leave the waiter queue, so the next release wakes somebody still waiting,
        and give back the lock if a release handed it over meanwhile (in the
        background if Redis does not answer at once).

        The waiter is remembered as gone: its entry may stay all the same (a
        leave that never lands, a failover to a replica that missed it), and the
        hold a release may hand to it later is this object's next acquire's to
        take anew.
        """
        waiter = str(json.loads(entry)[0])
        with self._state:
            gone = [waiter, *self._gone_waiters.split()][:GONE_WAITERS]
            self._gone_waiters = " ".join(gone)
        call = Call(
            LEAVE_SCRIPT,
            [self.key, self.queue_key],
            [self.owner, self.wake_prefix, request_id(), FENCE_TTL_MS, entry],
        )
        try:
            self._run(call, Deadline.after(min(self.call_timeout, LEAVE_WAIT)))
        except RedisError:
            self._beat().retry_in_background(
                self,
                call,
                time.monotonic() + self.call_timeout,
                f"leaving the queue of lock {self.name!r}",
                quiet=True,
            )

    def _release_failed(self, call: Call, exc: RedisError) -> NoReturn:
        """A release failed: stop renewing and raise. One that may not have run,
        or may land later (no answer, no script, a replica answering after a
        failover) or that the server refused for now (it cannot write: a disk,
        missing replicas, a long script, its cluster down during a failover) is
        retried in the background; one the server refused for good (an ACL, a
        key of another kind) would only be refused again."""
        # Whether it landed is not known.
        self._last_change = None
        with self._state:
            self._holds = max(0, self._holds - 1)
            last = self._holds == 0
            until = self._expiry
        if last:
            self._forget()
        else:
            # An inner hold: the outer one stays renewed, so keep trying a while.
            until = time.monotonic() + self.ttl
        again = _send_again(exc)
        if again:
            self._send_later(call, until, last)
        if last:
            then = "it is no longer renewed and expires by its TTL"
            if again:
                then += "; the release is retried in the background until then"
        else:
            then = "the release is retried in the background" if again else "the outer hold stays"
        raise LockBackendError(
            f"could not release lock {self.name!r}: {describe_error(exc)}; {then}"
        ) from exc

    def _send_later(self, call: Call, until: float, last: bool) -> None:
        """Send a release that failed (``last``: of the last hold) again in the
        background until ``until``, behind the inner releases still sent again:
        copies of those are due with it, so they go ahead of it, in its round
        trip. One of an inner hold joins them, for the next request to send first."""
        beat = self._beat()
        what = f"releasing lock {self.name!r}"
        behind = self._ahead()
        for earlier, ends in behind:
            beat.retry_in_background(self, earlier, ends, what, quiet=True)
        if not last and behind and not call.args[4]:
            # Sent right behind the one before it (here and in the next request's
            # round trip), it acts only once that one has: it changes nothing once
            # the hold changed again since (its holder took the lock again), as
            # one that knows its hold's last change does.
            earlier = behind[-1][0].args[2]
            call = call._replace(args=(*call.args[:4], earlier, *call.args[5:]))
        # An inner release sent again may find the hold changed since, and then
        # changes nothing: not worth a warning.
        beat.retry_in_background(self, call, until, what, quiet=not last, on_switch=last)
        if last and self._reserved_by is not None:
            # Behind it on the same lane, and like it to wherever the key lives
            # by then: should it find the reservation in place of its hold.
            owner, fence = self._reserved_by
            self._free_later(until, f"{what} reserved by {owner!r}", fence, owner)
        if not last:
            with self._state:
                self._behind = (*self._behind, (call, until))

    def _read_owed(self, deadline: Deadline) -> None:
        """Read the answers still owed on this process's idle connections to the
        server this object's releases that did not wait went to, if one of them is
        still unanswered, with half of what is left of the request's ``deadline``:
        a release that failed (or whose answer did not come in that time) is then
        among those sent again ahead of the request about to go (see
        :meth:`_ahead`), instead of learned of while that request's own round trip
        reads it, too late to go first.

        An answer another thread reads meanwhile (the heartbeat's, which found
        the connection idle first) is waited for within the same time. A release
        whose answer still has not come goes ahead of the request all the same:
        sent twice, a release changes nothing the second time (see
        :data:`~celery_redislock.scripts.RELEASE`), and sent after the request,
        it would act on the hold that request leaves (drop one of two holds the
        request was to free, or find the hold changed and change nothing). Once
        it went so, the later requests do not wait for its answer again: its
        copy goes ahead of each until one lands, and a copy that dropped a hold
        is remembered by the hold, for the first send arriving after it (see
        :data:`~celery_redislock.scripts.COPIES_REMEMBERED`)."""
        if not self._unanswered:
            return
        if self._owed_by != _process_id or self._owed_on is None:
            # A forked child: the answers are its parent's to read.
            with self._state:
                self._unanswered = 0
                self._owing = ()
            return
        with self._state:
            if all(item[2] for item in self._owing if item):
                return
        reading = Deadline.after(deadline.remaining() / 2)
        with contextlib.suppress(RedisError):
            # Where they were written (a cluster slot may have moved since).
            self._owed_on.drain(reading)
        if not self._unanswered:
            return
        with self._state:
            RedisLock._awaiting += 1
            try:
                while self._unanswered and (left := reading.remaining()) > 0:
                    self._answers.wait(left)
            finally:
                RedisLock._awaiting -= 1
            owed = [item for item in self._owing if item and not item[2]]
            if not owed:
                return
            now = time.monotonic()
            behind = [call for call, _until in self._behind]
            for item in owed:
                args, until, _ahead = item
                item[2] = True
                call = self._release_call(args)
                if call not in behind:
                    self._behind = (*self._behind, (call, max(until, now + MIN_CALL)))

    def _ahead(self) -> tuple[tuple[Call, float], ...]:
        """The inner releases still sent again in the background (with when they
        give up), to go ahead of the next request that changes the lock. Sent again
        twice, a release changes nothing the second time."""
        if not self._behind:
            return ()
        now = time.monotonic()
        with self._state:
            self._behind = tuple(item for item in self._behind if item[1] > now)
            return self._behind

    def _landed(self, ahead: tuple[tuple[Call, float], ...]) -> None:
        """Forget the releases ``ahead`` of a request that was answered: each has
        landed, or found nothing left to change."""
        with self._state:
            self._behind = tuple(item for item in self._behind if item not in ahead)
        if _frees_pending:
            # An undo among them no longer goes ahead of other objects' acquires.
            _frees_landed(self._router, self.key, ahead)

    def _beat(self) -> Heartbeat:
        return self._heartbeat or get_heartbeat()

    def _forget(self) -> bool:
        """Drop local hold state; return whether this object thought it held the lock."""
        with self._state:
            was_held = self._holds > 0
            self._holds = 0
        self._stop_renewal()
        return was_held

    def _stop_renewal(self) -> None:
        """Take the lock off the heartbeat (no-op if it is not on it)."""
        lane, self._lane = self._lane, None
        # Its lane first; the heartbeat finds it if the lock moved lanes (a cluster
        # slot that moved to another primary) since it was registered.
        if self.heartbeat and (lane is None or not lane.unregister(self)):
            self._beat().unregister(self)


#: The first items of an ACQUIRE and a RELEASE call by digest with two keys, as
#: :func:`~celery_redislock.transport.pack` encodes them, without the count of
#: items in front.
_ACQUIRE_HEAD = (
    f"$7\r\nEVALSHA\r\n${len(ACQUIRE_SCRIPT.sha)}\r\n{ACQUIRE_SCRIPT.sha}\r\n$1\r\n2\r\n"
)
_RELEASE_HEAD = (
    f"$7\r\nEVALSHA\r\n${len(RELEASE_SCRIPT.sha)}\r\n{RELEASE_SCRIPT.sha}\r\n$1\r\n2\r\n"
)


def _bulk(text: str) -> str:
    """``text`` as a RESP bulk string, as :func:`~celery_redislock.transport.pack`
    encodes an ASCII argument."""
    return f"${len(text)}\r\n{text}\r\n"


def _packed_acquire(
    keys_field: str, ttl_field: str, lease: str, request: str, info: str
) -> bytes | None:
    """What :func:`~celery_redislock.transport.pack` makes of the usual ACQUIRE
    call by digest (a first try, not queued, with a holder description, nothing
    handed over, no gone waiters: ``EVALSHA <sha> 2 key queue_key owner ttl_ms
    lease request "" "" info``), made from one template rather than argument by
    argument: every task's acquire is one. ``keys_field`` and ``ttl_field``: the
    lock's ready-made bulk strings of the key, queue key and owner token, and of
    the TTL (see :meth:`RedisLock._fill`). ``None`` if a value is not ASCII (its
    length in bytes differs): :func:`pack` encodes that one."""
    text = (
        f"*12\r\n{_ACQUIRE_HEAD}{keys_field}{ttl_field}${len(lease)}\r\n{lease}\r\n"
        f"${len(request)}\r\n{request}\r\n$0\r\n\r\n$0\r\n\r\n${len(info)}\r\n{info}\r\n"
    )
    return text.encode() if text.isascii() else None


def _packed_release(keys_field: str, wake_field: str, args: tuple[Any, ...]) -> bytes | None:
    """What :func:`~celery_redislock.transport.pack` makes of a RELEASE call by
    digest with these ARGV, as :meth:`RedisLock.release` makes them (the free
    TTL an ``int``, the fence an ``int`` or ``""``, the others ``str``; the
    owner token and the wake channel prefix the lock's own, whose bulk strings
    ``keys_field`` and ``wake_field`` are), made from one template, as
    :func:`_packed_acquire` does; ``None`` for another shape than the usual
    seven, or a value not ASCII."""
    if len(args) != 7:
        return None
    _owner, _wake, request, free_ttl, change, token, released = args
    free, fence = str(free_ttl), str(token)
    text = (
        f"*12\r\n{_RELEASE_HEAD}{keys_field}{wake_field}${len(request)}\r\n{request}"
        f"\r\n${len(free)}\r\n{free}\r\n${len(change)}\r\n{change}\r\n${len(fence)}\r\n{fence}"
        f"\r\n${len(released)}\r\n{released}\r\n"
    )
    return text.encode() if text.isascii() else None


def _sent_again(args: tuple[Any, ...], change: str | None) -> tuple[Any, ...]:
    """The ARGV a RELEASE with these ARGV (as :meth:`RedisLock.release` makes them)
    is sent again with, in the background or ahead of a later request: marked as
    a copy (:data:`~celery_redislock.scripts.COPY_MARK`), and acting only on a hold
    whose last change is ``change``, if given."""
    read = args[7] if len(args) > 7 else ""
    return (*args[:4], change or args[4], *args[5:7], read, COPY_MARK)


#: The outcomes read on every acquire and release, as names of this module: an
#: enum member read off its class costs several times a global's lookup.
_HELD, _TAKEN = Acquired.HELD, Acquired.TAKEN
_NOT_OWNED = Released.NOT_OWNED


#: Errors after which a request may not have run, and is sent again.
_NOT_RUN = (NoScriptError, RedisConnectionError, RedisTimeoutError)

#: Errors after which a failed release is sent again in the background: it may
#: not have run, or (a replica answering after a failover) may land once the
#: connection reaches the new primary, or (a cluster slot moving) once it goes
#: where its key is now.
_SEND_AGAIN = (*_NOT_RUN, ReadOnlyError, AskError, MovedError, TryAgainError)


def _send_again(exc: object) -> bool:
    """Whether a release that failed with ``exc`` is sent again in the background:
    one of :data:`_SEND_AGAIN`, or refused unrun by a server that takes it once it
    can write again, or once its cluster is up again
    (:func:`~celery_redislock.transport.held_off`)."""
    return isinstance(exc, _SEND_AGAIN) or held_off(exc) is not None


class SentAcquire:
    """A non-blocking acquire written ahead of the moment its caller needs the
    answer (:meth:`RedisLock._send_acquire`); :meth:`RedisLock._acquire_sent`
    reads the reply and keeps what it says.

    Whoever writes one must claim it exactly once: either by finishing it, or
    by :meth:`abandon`, which gives back a hold it made.
    """

    __slots__ = ("answer", "claimed", "link", "lock", "request", "sent", "transport", "written")

    def __init__(self, lock: RedisLock, transport: Transport, request: str) -> None:
        self.lock = lock
        self.transport = transport
        self.request = request
        self.sent = time.monotonic()
        #: Whether it was written whole (else it did not run).
        self.written = False
        #: The connection it was written on, until its reply is read from it.
        self.link: Any = None
        #: The script's reply, or the error that kept it from coming; ``None``
        #: until read.
        self.answer: Any = None
        self.claimed = False

    def claim(self) -> bool:
        """Whether this caller is the first to claim it (it then must finish it)."""
        first, self.claimed = not self.claimed, True
        return first

    def reply(self, deadline: Deadline) -> Any:
        """The script's reply (an exception instance if it failed), read by ``deadline``."""
        link, self.link = self.link, None
        if link is not None:
            try:
                self.answer = self.transport.finish(link, 1, deadline, True)[0]
            except RedisError as exc:
                self.answer = exc
        return self.answer

    def drop(self) -> None:
        """Close the connection it was written on, if its reply has not been read
        (an exception raised before the read): that reply is never read."""
        link, self.link = self.link, None
        if link is not None:
            self.transport.discard(link)

    def abandon(self) -> None:
        """Give back the hold it made, if it made one, when nobody will use it
        (the task it was sent for never started). Unless already claimed."""
        if not self.claim():
            return
        try:
            if self.lock._acquire_sent(self):
                self.lock.release(wait=False)
        except LockError as exc:
            logger.warning(
                "celery_redislock: could not give back lock %s taken for a task that "
                "never started (it expires by its TTL): %s",
                self.lock.name,
                exc,
            )


def _resend_on_switch(
    beat: Heartbeat,
    router: Router,
    transport: Transport,
    written_at: float,
    call: Call,
    until: float,
    what: str,
) -> None:
    """A release ``call`` written at ``written_at`` freed a lock on a
    Sentinel-managed primary, or a Redis Cluster primary (``transport``'s):
    should the process learn soon that the Sentinels had replaced it, or that
    the cluster's slot map puts the lock's key on another primary now (a
    failover: see :meth:`~celery_redislock.transport.Router.resend_on_move`),
    ``call`` goes again, in the background, to the new one (until ``until``;
    see :meth:`~celery_redislock.transport.Transport.resend_on_switch`). The
    transport's heartbeat lane asks the Sentinels, or the cluster primary
    whether it still serves the key, meanwhile, should no request ask first (a
    process gone idle)."""
    if router.single is None:
        again = functools.partial(beat.send_where_it_lives, router, call, until, what)
        router.resend_on_move(transport, call.keys[0], written_at, until, again)
        beat.watch_primary(transport)
    elif transport.resend_on_switch(
        written_at, until, functools.partial(beat.send_in_background, transport, call, until, what)
    ):
        beat.watch_primary(transport)


def release_lease(
    client_or_url: Client | str,
    name: str,
    lease: str,
    prefix: str = DEFAULT_PREFIX,
    timeout: float = DEFAULT_CALL_TIMEOUT,
) -> bool:
    """Free lock ``name`` if the given lease (task id) holds it, whatever its hold count.

    For paths where no holder's process can release it itself: the key of a send
    that failed, or of an ``until_executing`` task as it starts. Returns whether it was
    freed. Retried safely on a broken connection within ``timeout`` seconds.

    On a Sentinel-managed primary, a release that freed the lock is sent again to
    the new primary should the process learn within
    :data:`~celery_redislock.transport.SWITCH_RESEND` that the Sentinels had
    replaced it (the old one may have answered after its replica was promoted):
    it frees only the hold it freed (by its fencing token), not one the lease
    took since.

    Raises:
        LockBackendError: Redis could not be reached.
    """
    client = as_client(client_or_url)
    key, queue = lock_keys(name, prefix)
    request = request_id()
    call = Call(
        RELEASE_LEASE_SCRIPT,
        [key, queue],
        [lease, wake_channel_prefix(prefix), request, FENCE_TTL_MS],
    )
    router = router_for(client)
    written_at = time.monotonic()
    with backend_errors(f"release lock {name!r}"):
        reply = send(router, key, call, Deadline.after(timeout))
    # {1, fence} when freed now, 1 when by an earlier arrival (fence unknown).
    fence = reply[1] if isinstance(reply, list) else None
    transport = router.single or router.transport(key)
    if fence is not None and (transport.follows_switches or router.single is None):
        again = Call(RELEASE_LEASE_SCRIPT, [key, queue], [*call.args, fence])
        # (A failover may be learnt that long after the release: see FAILOVER_WAIT.)
        until = written_at + max(SWITCH_RESEND + max(timeout, MIN_CALL), FAILOVER_WAIT)
        _resend_on_switch(
            get_heartbeat(),
            router,
            transport,
            written_at,
            again,
            until,
            f"releasing lock {name!r} of lease {lease!r} again on the new primary",
        )
    return bool(reply[0] if isinstance(reply, list) else reply)


# This process's id, kept here rather than asked of the kernel on every release.
_process_id = os.getpid()


def _new_state_guard_after_fork() -> None:
    global _process_id, _frees_guard
    _process_id = os.getpid()
    # The parent's heartbeat (or another of its threads) may have held the
    # guards as the process forked; that thread does not exist here to free them.
    RedisLock._state = threading.Lock()
    RedisLock._answers = threading.Condition(RedisLock._state)
    RedisLock._awaiting = 0
    _frees_guard = threading.Lock()
    # The parent sends its own background frees; the child's acquires owe none.
    _frees_pending.clear()


os.register_at_fork(after_in_child=_new_state_guard_after_fork)
