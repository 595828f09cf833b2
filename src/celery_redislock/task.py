"""SingletonTask: run a Celery task at most once at a time per key.

Example::

    from celery import Celery
    from celery_redislock import SingletonTask

    app = Celery("shop", broker="redis://localhost:6379/0")

    @app.task(base=SingletonTask)                      # key: task name + all arguments
    def rebuild_report(account_id, full=False): ...

    @app.task(base=SingletonTask, bind=True, lock_on=("event_id",),
              on_conflict="wait", lock_wait=30)
    def purchase(self, event_id, user_id):
        stock.write(event_id, ..., fence=self.lock.token)

Every option is a task attribute (settable in ``@app.task(...)`` or in the body
of a task class) whose default comes from ``app.conf.redislock_<option>``. When
Celery makes the task and binds it to its app (at ``@app.task`` on an app already
finalized, otherwise as the app finalizes or the task is first used) the options
are resolved and checked once, into the task's own :class:`LockOptions`
(``task.lock_options``); a bad value, or a misspelt option, raises
:class:`~celery_redislock.errors.TaskOptionError` naming the task, the option or
the setting, and what to change, and an option the others leave without effect
warns (:class:`UnusedOptionWarning`). Nothing resolved
is ever written back onto a class, so a base class (``SingletonTask`` itself,
or an abstract one of yours) keeps only what was set on it, and a task defined
later still takes the ``app.conf`` values of its own app.

How each way a task can end is handled (``while_executing``; the other
strategies keep the lock where noted):

=====================================  ==========================================
success, exception, soft time limit    released in the body's ``finally``
``self.retry()``                       released; ``until_executed`` hands it to the
                                       queued retry (same task id), TTL covering
                                       the countdown, as the execution ends (its
                                       ``finally`` blocks done; the retry waits
                                       for it): freed instead if a delivery of
                                       the retry (of each copy sent) ended unrun
                                       meanwhile, see
                                       :mod:`celery_redislock.dropped`
``Ignore``, ``Reject``                 released (``Reject(requeue=True)`` hands an
                                       ``until_executed`` lock to the message's
                                       reservation, for the redelivery)
``before_start`` raises                given back before the failure is stored,
                                       the message's reservation freed (kept as
                                       for the body's ``Reject``/``self.retry()``;
                                       a retry's, whose sender runs on, freed as
                                       the sender ends)
revoked while queued                   ``until_*``: freed by the workers as soon as
                                       the revoke reaches them (revoked by its
                                       stamps: a message a worker holds; one
                                       handed to the pool runs, and keeps it)
                                       (:mod:`celery_redislock.revoke`); also by
                                       the ``task_revoked`` handler when a worker
                                       drops the message (a retry's, whose sender
                                       runs on: as the sender ends, which the
                                       revoke tells it at once)
terminated while running               released in the body's ``finally`` if the
(``revoke(terminate=True)``)           signal raises in it (``SIGTERM``), or as
                                       the task ends if it lives through the
                                       signal; never while it may still run
a prefork pool process dies (killed,   freed by the worker as it sees the process
terminated, cancelled), or is killed   gone (:mod:`celery_redislock.early`)
for its hard time limit
SIGKILL of the worker, machine lost    the heartbeat dies with the process and the
                                       TTL frees the lock
the message delivered again meanwhile  the copy waits for the earlier delivery's
                                       hold; dropped (``Ignore``) if a live
                                       holder still renews it
                                       (:meth:`SingletonTask._redelivered`); a
                                       retry waits for its sender to end
=====================================  ==========================================
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import os
import random
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any, ClassVar, Literal, NamedTuple, cast, get_args

from celery import Task
from celery import signals as celery_signals
from celery.exceptions import Ignore, Reject, Retry
from celery.result import AsyncResult
from celery.states import SUCCESS
from celery.utils import uuid
from celery.utils.dispatch import Signal
from celery.utils.imports import symbol_by_name
from kombu import serialization

from celery_redislock import signals
from celery_redislock.client import check_url
from celery_redislock.dropped import DROPPED_WORD_TTL as DROPPED_WORD_TTL
from celery_redislock.dropped import Word, drop_id, forget_word, leave_word, read_word
from celery_redislock.dropped import dropped_key as dropped_key
from celery_redislock.dropped import free_dropped as free_dropped
from celery_redislock.errors import (
    DuplicateTaskError,
    LockBackendError,
    LockConflictError,
    LockLostError,
    NoLockError,
    TaskOptionError,
    TaskSkippedError,
)
from celery_redislock.ids import owner_token
from celery_redislock.keys import Delivered, KeyBuilder, KeySource
from celery_redislock.lock import (
    DEFAULT_PREFIX,
    DEFAULT_TTL,
    MAX_INFO_LENGTH,
    RedisLock,
    ReleaseOutcome,
    SentAcquire,
    check_name,
    check_prefix,
    check_stored,
    check_timeout,
    check_ttl,
    release_lease,
    since_now,
)
from celery_redislock.reservations import ascii_number, hold_retries
from celery_redislock.reservations import free_queued as free_queued
from celery_redislock.reservations import queued_owner as queued_owner
from celery_redislock.reservations import queued_retries as queued_retries
from celery_redislock.retried import retry_later
from celery_redislock.scripts import (
    FENCE_FIELD,
    HOLDER_FIELDS,
    OWNER_FIELD,
    SEPARATOR,
    decode_lock,
    send,
)
from celery_redislock.store import (
    check_client_source,
    check_transport_options,
    lock_store,
    store_url,
)
from celery_redislock.transport import (
    DEFAULT_CALL_TIMEOUT,
    Client,
    Deadline,
    backend_errors,
    flush,
    router_for,
)

logger = logging.getLogger(__name__)

#: When the lock is taken and released.
Strategy = Literal["while_executing", "until_executed", "until_executing"]
#: What a duplicate does at execution.
ConflictMode = Literal["skip", "raise", "retry", "wait"]
#: What a task does when the lock store cannot be reached.
RedisErrorMode = Literal["fail", "run"]
DuplicateMode = Literal["return", "raise"]

WHILE_EXECUTING: Strategy = "while_executing"
UNTIL_EXECUTED: Strategy = "until_executed"
UNTIL_EXECUTING: Strategy = "until_executing"
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)
CONFLICT_MODES: tuple[ConflictMode, ...] = get_args(ConflictMode)
REDIS_ERROR_MODES: tuple[RedisErrorMode, ...] = get_args(RedisErrorMode)
DUPLICATE_MODES: tuple[DuplicateMode, ...] = get_args(DuplicateMode)

#: Highest countdown, in seconds, of an ``on_conflict="retry"`` re-queue.
MAX_RETRY_DELAY = 300.0

#: Seconds a task's executions in one process go on with the lock store they
#: last looked up in ``app.conf`` before looking again: a store setting changed
#: in a running worker takes effect for them within this. (Looking the store up
#: reads several settings, which costs every execution several microseconds.)
STORE_RECHECK = 1.0

#: Seconds a copy of a message waits for the hold of an earlier delivery of it
#: beyond the time that hold had left when first found: a holder that has died
#: renews nothing, so its hold is gone by then; one still held is renewed by a
#: holder alive (see :meth:`SingletonTask._redelivered`).
REDELIVERY_GRACE = 1.0

#: Seconds an ``until_*`` send's reservation outlives its message's ``expires``:
#: a worker that took the message just before it expired finds the reservation
#: still there to take over (see :func:`_reservation_ttl`).
EXPIRES_GRACE = 1.0


class _OwnDelivery(Exception):
    """A waiting task found its own task id holding the lock (another delivery of
    its message): it stops ``lock_wait``'s wait for :meth:`SingletonTask._redelivered`."""


#: ``apply_async`` option with lock option overrides for one call.
CALL_OPTIONS = "lock_options"

#: The options ``lock_options={...}`` may override (fields of :class:`LockOptions`);
#: the strategy, the prefix and the store make the lock itself and stay per task.
PER_CALL_OPTIONS = frozenset(
    {"ttl", "enqueue_ttl", "on_conflict", "wait", "retry_delay", "on_redis_error",
     "min_replicas", "on_duplicate"}
)  # fmt: skip

#: Message header carrying a call's overrides to the worker.
_OVERRIDES_HEADER = "redislock_options"

#: Message header of an ``until_*`` message: the lock name its send reserved,
#: which its execution takes (and frees) rather than deriving one of its own.
_NAME_HEADER = "redislock_name"

#: Message header of an ``until_*`` message whose send made its reservation:
#: ``<retry count>:<fencing token>`` of that reservation, which a background free
#: of it (its execution could not reach the store as it began) is tied to, so
#: that it never frees a later reservation of the same task id (same owner token).
#: A message whose reservation was handed over, or not made, carries none: one
#: copied into a retry's headers from its request goes as the retry is sent (and
#: one that did not, naming another retry count, is not heeded; nor is it on a
#: delivery marked redelivered: see :func:`_sent_fence`).
_FENCE_HEADER = "redislock_fence"

#: ``apply_async`` option that re-queues without taking the enqueue-time lock.
_NO_ENQUEUE_LOCK = "redislock_no_enqueue_lock"

#: Request attribute set once an execution has entered its locked path: a call of
#: the task from its own body then runs as a plain function call.
_ENTERED = "redislock_entered"

#: Request attribute set while ``self.retry(throw=False)`` sends the retry: the
#: execution runs on (from ``before_start`` too, which hands nothing over).
_RUNS_ON = "redislock_runs_on"

#: Message header of a send of an execution's own task id from its body (its
#: retry, ``self.replace()``, ``apply_async(task_id=self.request.id)``): the owner
#: token of that execution's hold, which it hands to the message's reservation
#: (``until_executed``) or releases (``while_executing``) only as it ends. A
#: delivery that finds that hold waits for it as long as it runs, rather than be
#: dropped as a copy of a running delivery; one that ends without running while
#: that hold holds the lock leaves it word to free the lock instead (see
#: :func:`free_dropped`): a message without a retry count names its sender so.
_SENDER_HEADER = "redislock_sender"

#: Request attribute: the retry count and delay (s) of a send of its own task id
#: and lock an execution's body made (its retry, raised or sent as it runs on with
#: ``self.retry(throw=False)``; ``self.replace()``; ``apply_async`` of that id),
#: whose reservation it hands its hold to as it ends (``until_executed``), and how
#: many copies of it the execution sent (each call whose send returned counts one;
#: the longest delay is kept).
_SENT_RETRY = "redislock_sent_retry"

#: What :data:`_SENT_RETRY` holds: the retry count, the delay (s) its reservation
#: keeps beyond ``lock_enqueue_ttl``, the copies sent, and the monotonic time its
#: reservation ends at the latest (its message expired then; ``None``: never).
_SentRetry = tuple[int, float, int, float | None]


def _execution_owner(retries: int) -> str:
    """A new owner token for an execution of a message with retry count ``retries``,
    which a retry's (above 0) names, as its reservation does."""
    return f"{owner_token()}:{retries}" if retries else owner_token()


def _retries(value: object) -> int:
    """A message's retry count as its request or options give it (0 if none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


@dataclass(frozen=True)
class LockOptions:
    """The lock options of one task, resolved and checked when it is bound to its app.

    Built from the task's attributes (``lock_ttl=...`` in ``@app.task(...)``),
    falling back to ``app.conf.redislock_*`` and then to the built-in defaults.
    Read it as ``task.lock_options``.
    """

    #: Seconds a lock lives without renewal (``lock_ttl``).
    ttl: float
    #: Seconds the enqueue-time lock of the ``until_*`` strategies lives (``lock_enqueue_ttl``).
    enqueue_ttl: float
    #: When the lock is taken and released (``lock_strategy``).
    strategy: Strategy
    #: What a duplicate does at execution (``on_conflict``).
    on_conflict: ConflictMode
    #: Seconds ``on_conflict="wait"`` waits (``lock_wait``).
    wait: float
    #: Base countdown of ``on_conflict="retry"`` (``lock_retry_delay``).
    retry_delay: float
    #: What happens when the lock store is away (``lock_on_redis_error``).
    on_redis_error: RedisErrorMode
    #: Prefix of the lock keys (``lock_prefix``).
    prefix: str
    #: Replicas that must confirm a new hold before the task runs (``lock_min_replicas``).
    min_replicas: int
    #: What sending an ``until_*`` task whose key is held does (``lock_on_duplicate``):
    #: return the holder's ``AsyncResult``, or raise :class:`DuplicateTaskError`.
    on_duplicate: DuplicateMode
    #: The task's own lock store (``lock_url``); ``None``: the app's, read from
    #: ``app.conf`` at use so that configuring the app late works.
    url: str | None


class _Option(NamedTuple):
    """One option: task attribute, :class:`LockOptions` field, ``app.conf`` setting, default."""

    attribute: str
    field: str
    setting: str
    default: object


#: The options that fall back to an ``app.conf`` setting, in ``LockOptions`` order.
OPTIONS: tuple[_Option, ...] = (
    _Option("lock_ttl", "ttl", "redislock_ttl", DEFAULT_TTL),
    _Option("lock_enqueue_ttl", "enqueue_ttl", "redislock_enqueue_ttl", 3600.0),
    _Option("lock_strategy", "strategy", "redislock_strategy", WHILE_EXECUTING),
    _Option("on_conflict", "on_conflict", "redislock_on_conflict", "skip"),
    _Option("lock_wait", "wait", "redislock_wait", 30.0),
    _Option("lock_retry_delay", "retry_delay", "redislock_retry_delay", 1.0),
    _Option("lock_on_redis_error", "on_redis_error", "redislock_on_redis_error", "fail"),
    _Option("lock_prefix", "prefix", "redislock_prefix", DEFAULT_PREFIX),
    _Option("lock_min_replicas", "min_replicas", "redislock_min_replicas", 0),
    _Option("lock_on_duplicate", "on_duplicate", "redislock_on_duplicate", "return"),
)

#: The names a task's lock options are given by (``lock_ttl=...`` in ``@app.task``).
OPTION_ATTRIBUTES = frozenset(
    {option.attribute for option in OPTIONS} | {"lock_on", "lock_key", "lock_url"}
)


#: Every ``app.conf`` setting celery_redislock reads.
KNOWN_SETTINGS: frozenset[str] = frozenset(
    {option.setting for option in OPTIONS}
    | {"redislock_url", "redislock_client", "redislock_transport_options", "redislock_metrics"}
)


class UnknownSettingWarning(UserWarning):
    """An ``app.conf`` setting is named like a celery_redislock one, but is none (a typo)."""


class UnusedOptionWarning(UserWarning):
    """A task sets an option that its other options leave without effect
    (``lock_wait`` on a task whose ``on_conflict`` is not ``"wait"``, say)."""


class RequestClassWarning(UserWarning):
    """A :class:`SingletonTask`'s ``Request`` is not derived from
    :class:`celery_redislock.early.Request`: its worker loses what that class does."""


#: The send options of a call that gives none.
_NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})

#: Where :class:`SingletonTask`'s worker request class lives (``Request``).
_EARLY_REQUEST = "celery_redislock.early:Request"


def _derives_from_early(request_class: Any) -> bool:
    """Whether ``request_class`` (a class, or its ``module:name`` path) is
    :class:`celery_redislock.early.Request` or derives from it; ``True`` when it
    cannot be told (a path that does not import: the worker will say so).
    Compared by name, so that a producer need not import the worker's modules."""
    if isinstance(request_class, str):
        if request_class.replace(":", ".") == _EARLY_REQUEST.replace(":", "."):
            return True
        try:
            request_class = symbol_by_name(request_class)
        except Exception:
            return True
    return not isinstance(request_class, type) or any(
        f"{kind.__module__}:{kind.__qualname__}" == _EARLY_REQUEST for kind in request_class.__mro__
    )


def check_request_class(task: Any) -> bool:
    """Warn (:class:`RequestClassWarning`) when ``task``'s ``Request`` is not
    derived from :class:`celery_redislock.early.Request`; return whether it is.

    Nothing fails without it, so it would go unnoticed: the worker no longer
    frees the lock of a pool process killed while running the task (it waits
    for its TTL), nor writes the acquire as it accepts the task."""
    request_class = getattr(task, "Request", _EARLY_REQUEST)
    if _derives_from_early(request_class):
        return True
    shown = request_class if isinstance(request_class, str) else request_class.__qualname__
    warnings.warn(
        f"task {task.name!r}: its Request ({shown}) is not derived from "
        "celery_redislock.early.Request, so the lock of a pool process killed while "
        "running it (out of memory, time limit, revoke(terminate=True)) is left to "
        "its TTL; derive the request class from celery_redislock.early.Request",
        RequestClassWarning,
        stacklevel=2,
    )
    return False


# Apps whose settings were checked already: each warns once.
_settings_checked: weakref.WeakSet[Any] = weakref.WeakSet()


def check_settings(app: Any) -> list[str]:
    """Warn (:class:`UnknownSettingWarning`, once per app) about each ``redislock_*``
    setting of ``app`` that celery_redislock does not know, naming the closest
    known one; return the unknown names.

    A misspelt setting would otherwise be ignored without a word, leaving the
    default in force (``redislock_ttl_seconds = 600`` still gives 60 s locks).
    """
    if app in _settings_checked:
        return []
    _settings_checked.add(app)
    unknown = []
    for name in sorted({str(key) for key in app.conf}):
        lowered = name.lower()
        if not lowered.startswith("redislock_") or name in KNOWN_SETTINGS:
            continue
        unknown.append(name)
        if lowered in KNOWN_SETTINGS:
            hint = f"did you mean {lowered}? (settings are lower-case)"
        else:
            close = difflib.get_close_matches(lowered, sorted(KNOWN_SETTINGS), n=1, cutoff=0.6)
            hint = (
                f"did you mean {close[0]}?"
                if close
                else f"known settings: {', '.join(sorted(KNOWN_SETTINGS))}"
            )
        warnings.warn(
            f"app.conf.{name} is not a celery_redislock setting and is ignored; {hint}",
            UnknownSettingWarning,
            stacklevel=2,
        )
    return unknown


def retry_countdown(base: float, retries: int) -> float:
    """The countdown of an ``on_conflict="retry"`` re-queue: ``base`` doubled per
    earlier retry, times a random factor from 0.5 to 1.5 (so duplicates spread
    out), at most :data:`MAX_RETRY_DELAY`."""
    grown: float = base * 2.0 ** min(retries, 32)
    return min(MAX_RETRY_DELAY, grown * random.uniform(0.5, 1.5))


def _sent_overrides(request: Any) -> Any:
    """The ``lock_options`` a message was sent with (a header), if any."""
    found = getattr(request, _OVERRIDES_HEADER, None)
    if found is None:
        found = (getattr(request, "headers", None) or {}).get(_OVERRIDES_HEADER)
    return found


def _sent_name(request: Any) -> Any:
    """The lock name the send of ``request``'s message reserved (a header), if
    any: an execution's context holds its message's headers as attributes, a
    worker's request in its ``request_dict``.

    An eager run (``apply()``) keeps the headers it was given apart
    (``headers``): a first run's are its send's (its arguments went through the
    serializer since, which may have changed what they name); those of an eager
    retry are copied from the call it retries, which may have other arguments,
    so a retry derives its name as its own send did.
    """
    found = getattr(request, _NAME_HEADER, None)
    if found is None:
        headers = getattr(request, "request_dict", None)
        if headers:
            found = headers.get(_NAME_HEADER)
        elif getattr(request, "is_eager", False) and not getattr(request, "retries", 0):
            given = getattr(request, "headers", None)
            found = given.get(_NAME_HEADER) if isinstance(given, dict) else None
    return found


def _text_header(request: Any, name: str) -> str | None:
    """Header ``name`` of ``request``'s message, if it is text: an execution's
    context holds the headers as attributes, a worker's request in its
    ``request_dict``, an eager run in its ``headers``."""
    found = getattr(request, name, None)
    if found is None:
        headers = getattr(request, "request_dict", None) or getattr(request, "headers", None)
        if isinstance(headers, dict):
            found = headers.get(name)
    return found if isinstance(found, str) else None


def request_sender(request: Any) -> str | None:
    """The owner token of the hold of the execution whose body sent ``request``'s
    message under its own task id (see :data:`_SENDER_HEADER`), if any."""
    return _text_header(request, _SENDER_HEADER)


def _sent_fence(request: Any) -> int | None:
    """The fencing token of the reservation the send of ``request``'s message made
    (see :data:`_FENCE_HEADER`), if the message names it for its own retry count
    and that reservation may still be the one the message has.

    Not for a delivery its broker marks redelivered: the message came back, and
    the reservation it finds may have been made anew since, with another fencing
    token, by an earlier delivery that handed its hold to it (``Reject(requeue=
    True)`` of an ``until_executed`` task), which a free tied to the send's token
    would leave for ``lock_enqueue_ttl``. Its reservation is freed by its owner
    token alone."""
    delivery = getattr(request, "delivery_info", None)
    if isinstance(delivery, dict) and delivery.get("redelivered"):
        return None
    found = _text_header(request, _FENCE_HEADER)
    if found is None:
        return None
    retries, _, fence = found.partition(":")
    if ascii_number(retries) != request_retries(request):
        return None
    return ascii_number(fence)


def request_retries(request: Any) -> int:
    """The retry count of the message behind ``request``: an execution's context,
    or a worker request (which carries it in its message)."""
    retries = getattr(request, "retries", None)
    if retries is None:
        retries = (getattr(request, "request_dict", None) or {}).get("retries")
    return _retries(retries)


def _send(signal: Signal, task: Task, name: str, **arguments: Any) -> None:
    """Send one of :mod:`celery_redislock.signals` about lock ``name``: as ``name``, and
    again as ``key``, its spelling for receivers written before it was called a name.
    Free when nobody listens: this runs on every execution."""
    if signal.receivers:
        signal.send(sender=task, name=name, key=name, **arguments)


class _Ahead(NamedTuple):
    """An acquire written as the worker accepted a task (:mod:`celery_redislock.early`)."""

    task_id: str
    sent: SentAcquire
    opts: LockOptions


#: The acquires written as the worker accepted a task, by the thread that runs the
#: task (one task at a time per thread): the task reads its own as it starts.
_written_ahead: dict[int, _Ahead] = {}

#: The owner tokens of the executions running in this process (threads or solo
#: pool), with the process id: a copy of a message that finds one of them holding
#: its lock knows that delivery alive without waiting.
_running_here: dict[str, str] = {}

#: The owner tokens of the executions running on this thread, outermost first:
#: more than one when an execution runs another eagerly (``task_always_eager``,
#: ``apply()``) from its body. A delivery that finds one of them holding its lock
#: runs nested inside that execution, which cannot end while it waits.
_on_this_thread = threading.local()


def _held_on_this_thread() -> list[str]:
    """The owner tokens of the executions running on this thread (see
    :data:`_on_this_thread`), which the caller may change."""
    held: list[str] | None = getattr(_on_this_thread, "owners", None)
    if held is None:
        held = _on_this_thread.owners = []
    return held


def take_written_ahead(task_id: str) -> _Ahead | None:
    """This thread's acquire written ahead, if it is task ``task_id``'s (then it is
    this caller's to finish or give back)."""
    me = threading.get_ident()
    found = _written_ahead.get(me)
    if found is None or found.task_id != task_id:
        return None
    return _written_ahead.pop(me, None)


#: Attribute marking a ``before_start`` wrapped by :func:`_guarded_start`.
_GUARDED = "_redislock_guarded"


def _guarded_start(start: Any) -> Any:
    """``start``, a task class's ``before_start``, made to give back what the
    execution holds when it raises (see :meth:`SingletonTask._start_failed`).

    Celery's tracer calls ``before_start`` inside the task's ``try``, after the
    worker accepted the task and before the task is called: an exception from it
    ends the execution before ``__call__`` (which releases in its ``finally``),
    and the tracer stores the outcome right away.
    """

    @functools.wraps(start)
    def before_start(self: SingletonTask, *args: Any, **kwargs: Any) -> Any:
        try:
            return start(self, *args, **kwargs)
        except BaseException as exc:
            # Only the outermost one, for a subclass's that calls its parent's.
            if type(self).before_start is before_start:
                self._start_failed(exc)
            raise

    setattr(before_start, _GUARDED, True)
    return before_start


def _in_workflow(options: Mapping[str, Any]) -> bool:
    """Whether ``apply_async``'s ``options`` send one step of a workflow: a chain's
    (the steps after it travel with it; the last step gets an empty list), a
    group's or chord's member, or a task with callbacks."""
    return options.get("chain") is not None or any(
        options.get(name) for name in ("chord", "group_id", "link", "link_error")
    )


def _free_in_background(lock: RedisLock, what: str, fence: int | None = None) -> None:
    """Free ``lock``'s hold in the background once the store answers again, until
    its TTL, by its owner token, and tied to its fencing token (``lock``'s, or
    ``fence`` for a hold it did not take) when known: a hold another owner took
    since stays, and so does a later hold of the same owner token (see
    :meth:`RedisLock._free_later`). ``what`` names it in the log. Never raises:
    a hold that cannot be freed so expires by its TTL."""
    try:
        lock._free_later(time.monotonic() + lock.ttl, what, fence)
    except Exception as error:
        logger.warning("%s: not possible (it expires by its TTL): %s", what, error)


class _Heeding:
    """Where heeding the word left beside a lock stands (see
    :meth:`SingletonTask._heed_dropped`): the reservation the hold went to,
    retry ``retries``'s, for ``copies`` of it, the fencing tokens the word may
    name (the holds that went there in turn), and until when (the reservation's
    TTL) it is worth doing in the background, should the store fail."""

    def __init__(
        self,
        task: SingletonTask,
        reservation: RedisLock,
        retries: int,
        opts: LockOptions,
        fences: list[int],
        copies: int,
    ) -> None:
        self.task, self.opts = task, opts
        self.reservation, self.retries, self.fences, self.copies = (
            reservation, retries, fences, copies,
        )  # fmt: skip
        self.until = time.monotonic() + reservation.ttl

    def moved(self, reservation: RedisLock, retries: int) -> None:
        """The hold was passed on to ``reservation``, retry ``retries``'s."""
        if self.reservation.token is not None:
            self.fences.append(self.reservation.token)
        self.reservation, self.retries, self.copies = reservation, retries, 1
        self.until = time.monotonic() + reservation.ttl

    @property
    def what(self) -> str:
        """What it is, for the log."""
        return (
            f"heeding word about the message (retry count {self.retries}) of {self.task.name}"
            f"[{self.reservation.lease}] beside lock {self.reservation.name!r}"
        )

    def attempt(self) -> None:
        """Heed the word once more (see :meth:`SingletonTask._heed_words`).

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        self.task._heed_words(self)


def skipped_result(name: str, holder: str | None) -> dict[str, Any]:
    """The result a duplicate returns with ``on_conflict="skip"``: the lock name as
    ``lock_name`` (and as ``lock_key``, its older spelling) and the holder's task id."""
    return {"skipped": True, "lock_name": name, "lock_key": name, "holder": holder}


def is_skipped(result: object) -> bool:
    """Whether a task result is the marker of a skipped duplicate."""
    return isinstance(result, dict) and result.get("skipped") is True and "lock_key" in result


class LockHandle:
    """The lock of one task execution, as seen from inside the task body.

    Available as ``self.lock`` in a bound task (``bind=True``) while it runs;
    it lives on the request context, so every execution (and every thread of
    the threads pool) sees its own.
    """

    def __init__(
        self, name: str, lock: RedisLock | None, options: LockOptions | None = None
    ) -> None:
        #: The lock name (``<task name>:<digest>``).
        self.name = name
        #: The lock options this execution runs with: the task's, with the call's
        #: ``lock_options={...}`` applied.
        self.options = options
        self._lock = lock

    @property
    def key(self) -> str:
        """The lock name (an earlier name of :attr:`name`, kept for compatibility: a
        *key* is a Redis key, and the lock's Redis key is ``<prefix>:{<name>}``)."""
        return self.name

    @property
    def token(self) -> int | None:
        """The fencing token: pass it to the resource you protect and let it reject
        writes carrying a smaller token than one it has seen. ``None`` when the
        task runs unlocked (``lock_on_redis_error="run"``); :attr:`fence` raises
        instead."""
        return self._lock.token if self._lock is not None else None

    @property
    def fence(self) -> int:
        """The fencing token, as an ``int`` (what :attr:`token` is when there is one).

        Raises:
            NoLockError: the task runs without a lock (``lock_on_redis_error="run"``
                and the store was unreachable), so it has no token to write with.
        """
        token = self.token
        if token is None:
            raise NoLockError(
                f"lock {self.name!r} was not taken (the lock store was unreachable and "
                'lock_on_redis_error="run"): there is no fencing token to write with'
            )
        return token

    @property
    def held(self) -> bool:
        """False when the task runs without a lock (``lock_on_redis_error="run"``)."""
        return self._lock is not None

    @property
    def lost(self) -> bool:
        """True once the heartbeat found the lock expired or taken over."""
        return self._lock is not None and self._lock.lost

    def check(self) -> None:
        """Raise :class:`LockLostError` if the lock has been lost."""
        if self.lost:
            raise LockLostError(self.name)


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, or raise naming ``name``."""
    listed = ", ".join(map(repr, choices))
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {listed}, not a {type(value).__name__}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {listed}, got {value!r}")
    return value


#: Kept under its earlier name: :func:`celery_redislock.client.check_url`.
check_redis_url = check_url


def _check_option(option: _Option, value: object, source: str) -> object:
    """Check one resolved option value; ``source`` names where it came from."""
    if option.field == "strategy":
        return _check_choice(source, value, STRATEGIES)
    if option.field == "on_conflict":
        return _check_choice(source, value, CONFLICT_MODES)
    if option.field == "on_redis_error":
        return _check_choice(source, value, REDIS_ERROR_MODES)
    if option.field == "on_duplicate":
        return _check_choice(source, value, DUPLICATE_MODES)
    if option.field == "prefix":
        return check_prefix(value, source)
    if option.field == "min_replicas":
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{source} must be an int, not {type(value).__name__}")
        if value < 0:
            raise ValueError(f"{source} must be >= 0, got {value}")
        return value
    return check_ttl(value, source, expiry=option.field in ("ttl", "enqueue_ttl"))


#: How close (``difflib`` ratio, names lower-cased) a keyword given to a task
#: that is not a ``lock_*`` name must come to an option's name to be taken for a
#: misspelling of it (``on_confict``, ``lockttl``). Celery's own task attributes
#: come no closer than 0.77 (``Strategy``), and a word of an option's name
#: (``strategy``, ``conflict``, ``retry_delay``) stays below it, free for a task's own use.
NEAR_MISS = 0.85


def resembled_option(name: str) -> str | None:
    """The option ``name`` is taken for a misspelling of, or ``None``.

    A name within :data:`NEAR_MISS` of an option's, or an ``on_*`` option's
    name without its ``lock_`` prefix (``on_duplicate``, ``on_redis_error``:
    ``on_conflict`` has none, so they are easily written so; a plain value of
    that name has no use in Celery, whose ``on_*`` names are handlers).
    """
    lowered = name.lower()
    if lowered.startswith("on_") and f"lock_{lowered}" in OPTION_ATTRIBUTES:
        return f"lock_{lowered}"
    close = difflib.get_close_matches(lowered, sorted(OPTION_ATTRIBUTES), n=1, cutoff=NEAR_MISS)
    return close[0] if close else None


def _body_function(task_class: type[Task]) -> Any:
    """The function ``@app.task`` made ``task_class`` of (unwrapped from what
    ``pydantic=True`` wraps it in), or the ``run`` a task class of its own
    defines; ``None`` if it defines none."""
    run = vars(task_class).get("run")
    func = run.__func__ if isinstance(run, staticmethod | classmethod) else run
    if not inspect.isfunction(func):
        return None
    with contextlib.suppress(ValueError):
        func = inspect.unwrap(func)
    return func


def _body_of(task_class: type[Task]) -> str | None:
    """Where ``task_class``'s task is defined, for messages: the ``module:qualname``
    of the function ``@app.task`` made it of (or of the task class), and the file
    and line that function starts at when known."""
    func = _body_function(task_class)
    if func is not None and vars(task_class).get("_decorated"):
        module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    else:
        module, qualname = task_class.__module__, task_class.__qualname__
    if not module or not qualname:
        return None
    code = getattr(func, "__code__", None)
    where = f"{module}:{qualname}"
    return f"{where}, {code.co_filename}:{code.co_firstlineno}" if code is not None else where


def _named_task(task_class: type[Task], task_name: str | None) -> str:
    """The task an option is about, as messages name it: ``task 'shop.purchase'
    (shop:purchase, /app/shop.py:12)``."""
    what = f"task {task_name!r}" if task_name else f"task class {task_class.__qualname__}"
    body = _body_of(task_class)
    return f"{what} ({body})" if body else what


def _setting_advice(setting: str) -> str:
    """What to change when the app setting ``setting`` is bad."""
    attribute = {option.setting: option.attribute for option in OPTIONS}.get(setting)
    if setting == "redislock_url":
        attribute = "lock_url"
    if attribute is None:
        return f"fix app.conf.{setting}"
    return (
        f"fix app.conf.{setting} (it is what every SingletonTask of the app that "
        f"sets no {attribute} of its own takes)"
    )


@contextlib.contextmanager
def _option_checked(task_class: type[Task], task_name: str | None, source: str) -> Iterator[None]:
    """Raise a ``TypeError``/``ValueError`` from the check of ``source`` (an
    option, or ``app.conf.<setting>``) as a :class:`TaskOptionError` naming the
    task and what to change: it is often raised far from the task's definition,
    as the app finalizes, with no frame of the user's code in the traceback."""
    try:
        yield
    except TaskOptionError:
        raise
    except (TypeError, ValueError) as exc:
        if source.startswith("app.conf."):
            advice = _setting_advice(source[len("app.conf.") :])
        else:
            advice = f"fix {source} where the task is defined (@app.task(...) or its class)"
        raise TaskOptionError(
            task_name, source, f"{_named_task(task_class, task_name)}: {exc}; {advice}"
        ) from exc


def _check_option_names(task_class: type[SingletonTask], task_name: str | None = None) -> None:
    """Refuse a value given to the task as an option SingletonTask does not have.

    ``@app.task(base=SingletonTask, lock_on_conflict="retry")`` makes a class
    attribute of any keyword, so a misspelt option would otherwise be ignored
    without a word, its default left in force. Only plain values count (methods
    and properties are the task's own business), and of those every ``lock_*``
    name, and any other within :data:`NEAR_MISS` of an option's name
    (``on_confict``): Celery's own task attributes, and others of the task's
    own, pass.

    Raises:
        TaskOptionError: an unknown option; the message names the task, the
            keyword and the closest known option.
    """
    # Names, not hasattr(): reading some (Task.app) binds the class to an app.
    taken = set(dir(SingletonTask))
    for klass in task_class.__mro__:
        if klass is SingletonTask:
            return
        for name, value in vars(klass).items():
            if (
                name.startswith("_")
                or name in taken
                or callable(value)
                or isinstance(value, property | staticmethod | classmethod)
            ):
                continue
            if name.startswith("lock_"):
                known = sorted(OPTION_ATTRIBUTES)
                if name[len("lock_") :] in OPTION_ATTRIBUTES:
                    close: str | None = name[len("lock_") :]
                else:
                    matches = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
                    close = matches[0] if matches else None
                hint = (
                    f"did you mean {close}?"
                    if close
                    else f"the options are {', '.join(known)} (a plain value of your own "
                    "must not be named lock_*)"
                )
            else:
                close = resembled_option(name)
                if close is None:
                    continue
                hint = (
                    f"did you mean {close}? (a name of your own must not come this close "
                    "to an option's)"
                )
            where = "" if klass is task_class else f", set on class {klass.__qualname__},"
            raise TaskOptionError(
                task_name,
                name,
                f"{_named_task(task_class, task_name)}: {name}{where} is not a SingletonTask "
                f"option, and would be ignored; {hint}",
            )


def resolve_options(
    task_class: type[SingletonTask], app: Any, task_name: str | None = None
) -> LockOptions:
    """The options of ``task_class`` on ``app``: its own attributes, else ``app.conf``.

    An attribute counts as set when it is not ``None`` on ``task_class`` (set
    there, on a parent class of yours, or by ``task_annotations``).
    ``task_name`` (default: ``task_class.name``) is the task's name, for messages.

    Raises:
        TaskOptionError: a value is invalid (a ``TypeError`` and a ``ValueError``);
            the message names the task, the option (``lock_ttl``) or the setting
            (``app.conf.redislock_ttl``) it came from, and what to change.
    """
    if task_name is None:
        task_name = getattr(task_class, "name", None)
    _check_option_names(task_class, task_name)
    values: dict[str, object] = {}
    for option in OPTIONS:
        value, source = getattr(task_class, option.attribute), option.attribute
        if value is None:
            value = app.conf.get(option.setting)
            if value is None:
                value = option.default
            else:
                source = f"app.conf.{option.setting}"
        with _option_checked(task_class, task_name, source):
            values[option.field] = _check_option(option, value, source)
    url = task_class.lock_url
    if url is not None:
        with _option_checked(task_class, task_name, "lock_url"):
            check_redis_url(url, "lock_url")
    elif app.conf.get("redislock_url"):
        with _option_checked(task_class, task_name, "app.conf.redislock_url"):
            check_redis_url(app.conf.get("redislock_url"), "app.conf.redislock_url")
    with _option_checked(task_class, task_name, "app.conf.redislock_client"):
        check_client_source(app.conf.get("redislock_client"))
    setting = "app.conf.redislock_transport_options"
    with _option_checked(task_class, task_name, setting):
        check_transport_options(app.conf.get("redislock_transport_options"), setting)
    return LockOptions(
        ttl=cast(float, values["ttl"]),
        enqueue_ttl=cast(float, values["enqueue_ttl"]),
        strategy=cast(Strategy, values["strategy"]),
        on_conflict=cast(ConflictMode, values["on_conflict"]),
        wait=cast(float, values["wait"]),
        retry_delay=cast(float, values["retry_delay"]),
        on_redis_error=cast(RedisErrorMode, values["on_redis_error"]),
        prefix=cast(str, values["prefix"]),
        min_replicas=cast(int, values["min_replicas"]),
        on_duplicate=cast(DuplicateMode, values["on_duplicate"]),
        url=url,
    )


def unused_options(task_class: type[SingletonTask], options: LockOptions) -> list[str]:
    """Why each option set on ``task_class`` itself has no effect with ``options``
    (the task's resolved options), one text per option.

    Only the task's own class counts (``@app.task(...)``'s keywords, or the body
    of the class registered as the task): a value inherited from a base class,
    or taken from ``app.conf``, is a default for many tasks, some of which use it.
    """
    own = vars(task_class)
    found = []
    if options.strategy == WHILE_EXECUTING:
        for attribute, what in (
            (
                "lock_enqueue_ttl",
                "the life of the lock an until_* strategy takes as the task is sent",
            ),
            ("lock_on_duplicate", "what sending an until_* task whose lock is held does"),
        ):
            if own.get(attribute) is not None:
                found.append(
                    f"{attribute} has no effect on a task whose lock_strategy is "
                    f"'while_executing' (it is {what}): remove it, or set lock_strategy"
                )
    for attribute, mode, what in (
        ("lock_wait", "wait", "how long on_conflict='wait' waits"),
        ("lock_retry_delay", "retry", "the base countdown of on_conflict='retry'"),
    ):
        if own.get(attribute) is not None and options.on_conflict != mode:
            found.append(
                f"{attribute} has no effect with on_conflict={options.on_conflict!r} (it is "
                f"{what}; only a call sent with lock_options={{'on_conflict': {mode!r}}} "
                f"uses it): remove it, or set on_conflict={mode!r}"
            )
    return found


def _warn_unused_options(task: SingletonTask, options: LockOptions) -> None:
    """Warn (:class:`UnusedOptionWarning`) about each option ``task`` sets to no
    effect, at the line its function (or its class's ``run``) starts at when known:
    the warning is raised as the task is made, often as the app finalizes, far
    from its definition."""
    task_class = type(task)
    code = getattr(_body_function(task_class), "__code__", None)
    for why in unused_options(task_class, options):
        message = f"{_named_task(task_class, task.name)}: {why}"
        if code is None:
            warnings.warn(message, UnusedOptionWarning, stacklevel=3)
        else:
            warnings.warn_explicit(
                message, UnusedOptionWarning, code.co_filename, code.co_firstlineno
            )


def lock_store_url(app: Any) -> str:
    """The URL of ``app``'s lock store: ``redislock_url``, else the broker URL if it
    is a Redis one (``redislock_client``, when set, takes precedence over both), as
    :func:`~celery_redislock.store.store_url` gives it (a broker made TLS by
    ``broker_use_ssl`` as ``rediss://``, without those options).

    Read at each use, so that configuring the app after defining its tasks works.

    Raises:
        ValueError, TypeError: ``redislock_url`` is not a Redis URL, or it is unset
            and the broker URL is not one either; the message says what to set.
    """
    return store_url(app)[0]


def _round_trip(
    args: tuple[Any, ...], kwargs: dict[str, Any], serializer: str
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` as a message encoded with ``serializer`` delivers them."""
    content_type, encoding, data = serialization.dumps(  # type: ignore[no-untyped-call,unused-ignore]
        [list(args), kwargs], serializer=serializer
    )
    # Made here from the caller's own values: read whatever the worker accepts.
    sent_args, sent_kwargs = serialization.loads(  # type: ignore[no-untyped-call,unused-ignore]
        data, content_type, encoding, force=True
    )
    return tuple(sent_args), dict(sent_kwargs)


def _delivered_by(task_class: type[Task]) -> Delivered:
    """What a worker receives of a call's arguments, once they have gone through
    the task's serializer (read at each call: Celery sets it as the task binds)."""

    def delivered(
        args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return _round_trip(args, kwargs, getattr(task_class, "serializer", None) or "json")

    return delivered


def _body_signature(cls: type[Task]) -> Any:
    """The signature calls are bound to: ``run`` without ``self`` for bound tasks."""
    run = inspect.getattr_static(cls, "run")
    func = run.__func__ if isinstance(run, staticmethod) else run
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # pragma: no cover - callables without one
        return None
    if not isinstance(run, staticmethod):
        params = list(signature.parameters.values())[1:]
        signature = signature.replace(parameters=params)
    return signature


def _seconds_until(when: object) -> float:
    """Seconds until a countdown/ETA (a number or a datetime), at least 0."""
    if isinstance(when, int | float):
        return max(0.0, float(when))
    if isinstance(when, datetime):
        now = datetime.now(when.tzinfo or timezone.utc)
        if when.tzinfo is None:
            now = now.replace(tzinfo=None)
        return max(0.0, (when - now).total_seconds())
    return 0.0


def _expires_in(expires: object) -> float | None:
    """Seconds until a message's ``expires`` (seconds, a datetime, naive read as
    UTC as Celery reads it, or the ISO text a retry carries), 0 if it has passed;
    ``None`` if it names no expiry."""
    if isinstance(expires, str):
        try:
            expires = datetime.fromisoformat(expires)
        except ValueError:
            return None  # Celery refuses it as the message is built
    if isinstance(expires, bool) or not isinstance(expires, int | float | datetime):
        return None
    return _seconds_until(expires)


def _reservation_ttl(ttl: float, left: float | None) -> float:
    """``ttl`` for an ``until_*`` send's reservation, cut to ``left``, the time left
    until the message's ``expires`` (see :func:`_expires_in`; ``None``: it names
    none), plus :data:`EXPIRES_GRACE`.

    A message that has expired is dropped unrun, by the worker that reaches it or
    by none; a reservation kept for it past that would deduplicate every later
    send of the call to a message that never runs.
    """
    if left is None:
        return ttl
    return min(ttl, max(0.001, left + EXPIRES_GRACE))


class _ResolvedOption:
    """A task attribute for an option: as set on a class, as in effect on a task.

    Read on a class (``SingletonTask.lock_ttl``, ``type(task).lock_ttl``) it is
    ``None`` unless a class of yours sets it, which then replaces this object in
    that class's namespace; read on a task it is the value in
    ``task.lock_options``. Only the reading differs: nothing is ever stored here.
    """

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, task: SingletonTask | None, owner: type | None = None) -> object:
        if task is None:
            return None
        return getattr(task.lock_options, self.field)


def _resolved(field: str) -> Any:
    """The class attribute of an option whose value in effect is ``LockOptions.<field>``."""
    return _ResolvedOption(field)


class _ProcessInfo:
    """This process's host name and id, for holder descriptions (read once, and
    again in a forked child, rather than on every task)."""

    def __init__(self) -> None:
        self.hostname = ""
        self.pid = ""
        self.refresh()

    def refresh(self) -> None:
        self.hostname = socket.gethostname()
        self.pid = str(os.getpid())


_process = _ProcessInfo()
os.register_at_fork(after_in_child=_process.refresh)


class SingletonTask(Task):  # type: ignore[misc]
    """A task that runs at most once at a time per lock key.

    Options are the class attributes below, set in ``@app.task(...)`` or in the
    body of a task class (a subclass of a task class inherits them). Each left
    as ``None`` takes its ``app.conf.redislock_*`` setting, or the built-in
    default. They are resolved and checked once, when Celery makes the task and
    binds it to its app (at ``@app.task`` on an app already finalized, otherwise
    as the app finalizes or the task is first used), into ``task.lock_options`` (a
    frozen :class:`LockOptions`); assigning an attribute afterwards has no effect.
    A bad value, a misspelt option, or one of the settings they take being bad,
    raises :class:`~celery_redislock.errors.TaskOptionError` then.

    Reading an option on a task (``task.lock_ttl``) gives the value in effect,
    as in ``task.lock_options``; reading it on a class gives what was set there
    (``None``: not set). ``lock_url`` reads as set: ``None`` means the app's lock
    store, which is read from ``app.conf`` at use so that configuring the app
    after defining its tasks works (a task's executions in one process look it up
    again every :data:`STORE_RECHECK` seconds).
    """

    #: Parameter names the key is made of (default: all parameters).
    lock_on: ClassVar[tuple[str, ...] | None] = None
    #: A constant key, or a callable taking the task's arguments and returning
    #: the key material; overrides ``lock_on``.
    lock_key: ClassVar[KeySource | None] = None
    #: Redis URL of the lock store (default: ``redislock_url``, else the broker
    #: URL when it is a Redis URL).
    lock_url: ClassVar[str | None] = None
    #: Seconds a lock lives without renewal; renewed every ``lock_ttl / 3``.
    lock_ttl: ClassVar[float | None] = _resolved("ttl")
    #: ``until_*`` strategies: seconds the lock taken at enqueue lives while the
    #: message waits in the queue (plus any countdown); nothing renews it there.
    lock_enqueue_ttl: ClassVar[float | None] = _resolved("enqueue_ttl")
    #: ``"while_executing"``, ``"until_executed"`` or ``"until_executing"``.
    lock_strategy: ClassVar[str | None] = _resolved("strategy")
    #: What a duplicate does at execution: ``"skip"``, ``"raise"``, ``"retry"``, ``"wait"``.
    on_conflict: ClassVar[str | None] = _resolved("on_conflict")
    #: Seconds ``on_conflict="wait"`` waits before failing like ``"raise"``.
    lock_wait: ClassVar[float | None] = _resolved("wait")
    #: Base countdown of ``on_conflict="retry"`` (doubled per retry, jittered).
    lock_retry_delay: ClassVar[float | None] = _resolved("retry_delay")
    #: ``"fail"``: no body runs unlocked when Redis is away; ``"run"``: run anyway, logged.
    lock_on_redis_error: ClassVar[str | None] = _resolved("on_redis_error")
    #: Prefix of the lock keys in Redis.
    lock_prefix: ClassVar[str | None] = _resolved("prefix")
    #: Replicas that must confirm a new hold (Redis ``WAIT``) before the body runs;
    #: narrows what a failover can lose, see the Deployments page of the documentation.
    lock_min_replicas: ClassVar[int | None] = _resolved("min_replicas")
    #: ``until_*``: what sending a duplicate does: ``"return"`` the holder's
    #: ``AsyncResult`` (nothing is sent), or ``"raise"`` :class:`DuplicateTaskError`.
    lock_on_duplicate: ClassVar[str | None] = _resolved("on_duplicate")

    #: The worker's request class for these tasks: it writes the acquire as the
    #: worker accepts the task, on pools that run it in the accepting thread
    #: (:mod:`celery_redislock.early`). A request class of your own should
    #: derive from it (:class:`RequestClassWarning` otherwise).
    Request = _EARLY_REQUEST

    # Per task (set on the task instance, never on a class).
    _lock_options: LockOptions | None = None
    _key_builder: KeyBuilder | None = None
    # The lock store, options, process id and shared lock state of the last
    # execution, and when to look the lock store up again.
    _lock_kind: tuple[Client, LockOptions, str, Mapping[str, Any], float] | None = None
    # The worker node and process id of the last execution, and its holder
    # description without the time it began.
    _running_as: tuple[Any, str, str] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # A before_start of a subclass (or of a mixin) runs after the worker
        # accepted the task, inside the tracer's try: an exception from it must
        # give back what the execution holds before the tracer stores the
        # outcome. Celery calls no before_start for a class that has none.
        start = inspect.getattr_static(cls, "before_start")
        if (
            inspect.isfunction(start)
            and start is not Task.before_start
            and not getattr(start, _GUARDED, False)
        ):
            cls.before_start = _guarded_start(start)

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Resolve and check the options of the tasks of this class (a bad value raises here).

        Celery calls it as it makes a task: at ``@app.task`` on an app already
        finalized, otherwise as the app finalizes (a worker starting,
        ``app.finalize()``, ``app.tasks`` read) or the task is first used. Only a
        class registered as a task of ``app`` has options of its own: a base class
        bound by being touched (``SingletonTask.app``, ``help()``) is left alone.

        Raises:
            TaskOptionError: an option, or a setting it takes, is bad or misspelt.
        """
        super().on_bound(app)
        tasks = [task for task in list(app._tasks.values()) if type(task) is cls]
        for task in tasks:
            # Celery binds a task again as its app finalizes: warn the first time only.
            first = task._lock_options is None
            options = task._configure(app)
            if first:
                _warn_unused_options(task, options)
            check_request_class(task)
        if tasks:
            check_settings(app)
            from celery_redislock.revoke import RevokedLockRelease

            # Its workers free the until_* lock of a task revoked while queued.
            app.steps["consumer"].add(RevokedLockRelease)

    def _configure(self, app: Any) -> LockOptions:
        """Resolve and check this task's options and key derivation; keep them on the task.

        Raises:
            TaskOptionError: an option, or a setting it takes, is bad.
        """
        options = resolve_options(type(self), app, self.name)
        builder = None
        if self.name:
            source = "lock_key" if type(self).lock_key is not None else "lock_on"
            with _option_checked(type(self), self.name, source):
                builder = self._make_key_builder(self.name)
        self._lock_options, self._key_builder = options, builder
        return options

    @classmethod
    def _make_key_builder(cls, name: str) -> KeyBuilder:
        lock_on = cls.lock_on
        if lock_on is not None and (
            isinstance(lock_on, str)
            or not isinstance(lock_on, Iterable)
            or not all(isinstance(n, str) for n in lock_on)
        ):
            raise TypeError(
                f"lock_on must be a tuple of parameter names, e.g. ('event_id',), got {lock_on!r}"
            )
        # Read lock_key off the class without binding it: a function stored as a
        # class attribute must not receive the task as its first argument.
        lock_key = inspect.getattr_static(cls, "lock_key")
        if isinstance(lock_key, staticmethod | classmethod):
            lock_key = lock_key.__get__(None, cls)
        if lock_key is not None and not (isinstance(lock_key, str) or callable(lock_key)):
            raise TypeError(
                "lock_key must be a string or a callable returning the key material, "
                f"not {type(lock_key).__name__}"
            )
        return KeyBuilder(
            name,
            _body_signature(cls),
            lock_on=lock_on,
            lock_key=lock_key,
            delivered=_delivered_by(cls) if callable(lock_key) else None,
        )

    # Configuration helpers.
    @property
    def lock_options(self) -> LockOptions:
        """This task's resolved options (see :class:`LockOptions`)."""
        options = self._lock_options
        if options is None:
            # Not registered when its class was bound (an instance made by hand).
            options = self._configure(self.app)
        return options

    def options_for_call(self, overrides: object) -> LockOptions:
        """This task's options with one call's ``lock_options={...}`` applied.

        Raises:
            TypeError, ValueError: an override is not a per-call option, or its
                value is invalid; the message names it (``lock_options['ttl']``).
        """
        if not overrides:
            return self.lock_options
        if not isinstance(overrides, Mapping):
            raise TypeError(
                f"{CALL_OPTIONS} must be a dict of lock options for this call, "
                f"not {type(overrides).__name__}"
            )
        unknown = sorted(str(name) for name in overrides if name not in PER_CALL_OPTIONS)
        if unknown:
            raise ValueError(
                f"{CALL_OPTIONS} has {', '.join(map(repr, unknown))}, which cannot be set per "
                f"call; those that can: {', '.join(sorted(PER_CALL_OPTIONS))}"
            )
        values: dict[str, Any] = {
            option.field: _check_option(
                option, overrides[option.field], f"{CALL_OPTIONS}[{option.field!r}]"
            )
            for option in OPTIONS
            if option.field in overrides
        }
        return dataclasses.replace(self.lock_options, **values)

    @property
    def lock_client(self) -> Client:
        """The (per-process, shared) client of the lock store (see :mod:`celery_redislock.store`)."""
        return lock_store(self.app, self.lock_options.url)

    def lock_name(self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        """The lock name of a call: ``<task name>:<digest of its key material>``.

        Named as its send names it: a ``pydantic=True`` task's models as the
        dicts its message carries (unless the task's serializer is pickle), as
        the worker sees them."""
        return self._builder()(*self._as_sent(args, kwargs, _NO_OPTIONS))

    def _message_name(self, request: Any, args: Any, kwargs: Any) -> str:
        """The lock name of the message behind ``request`` (an execution's context
        or a worker's request), whose arguments are ``args`` and ``kwargs``.

        An ``until_*`` message carries the name its send reserved (see
        :meth:`apply_async`): that one, whatever this process would derive (a
        producer of another version, a ``lock_key`` that gives another result
        here, or raises), so that the execution takes over and frees the very
        reservation that was made. A message without it (from an earlier
        release) and a ``while_executing`` one, which nothing reserved, are
        named here (:meth:`lock_name`).
        """
        if (self._lock_options or self.lock_options).strategy != WHILE_EXECUTING:
            sent = _sent_name(request)
            if sent is not None:
                return check_name(sent, f"message header {_NAME_HEADER!r}")
        # Delivered already: named as they are.
        return self._builder()(args, kwargs)

    def _builder(self) -> KeyBuilder:
        """This task's :class:`KeyBuilder`."""
        builder = self._key_builder
        if builder is None or builder.task_name != self.name:
            # A class-based task may get its name only on the instance.
            builder = self._key_builder = self._make_key_builder(self.name)
        return builder

    def _new_lock(
        self, key: str, task_id: str, owner: str, ttl: float, heartbeat: bool, opts: LockOptions
    ) -> RedisLock:
        """A lock of ``key`` held for the task ``task_id`` (its lease) by ``owner``."""
        return RedisLock(
            self.lock_client,
            key,
            ttl=ttl,
            owner=owner,
            lease=task_id,
            heartbeat=heartbeat,
            on_lost=self._on_lost,
            min_replicas=opts.min_replicas if heartbeat else 0,
            holder_info=self._holder_info(running=heartbeat),
            prefix=self.lock_options.prefix,
        )

    def _holder_info(self, running: bool) -> dict[str, str]:
        """Who holds the lock, stored with it for ``celery redislock list``."""
        values = self._holder_text(running).split(SEPARATOR)
        return dict(zip(HOLDER_FIELDS, values, strict=True))

    def _holder_text(self, running: bool, request: Any = None) -> str:
        """:meth:`_holder_info` as a lock sends it: its values in
        :data:`HOLDER_FIELDS` order, joined by the field separator (``request``:
        the current one, if the caller has it at hand). Its ``since`` is now: an
        execution's lock makes it anew should it wait for the lock (see
        ``RedisLock._since_kept``)."""
        since = since_now()
        if not running:
            return SEPARATOR.join((_shown(self.name), "queued", "", "", since))
        node = getattr(request or self.request, "hostname", None) or _process.hostname
        kept = self._running_as
        if kept is None or kept[0] != node or kept[1] != _process.pid:
            # The same for every execution in this worker process: all but the time.
            described = (_shown(self.name), "running", _shown(str(node)), _process.pid, "")
            kept = self._running_as = (node, _process.pid, SEPARATOR.join(described))
        return kept[2] + since

    def _on_lost(self, lock: RedisLock) -> None:
        logger.warning(
            "lock %s of task %s[%s] was lost while it ran; self.lock.check() will raise",
            lock.name,
            self.name,
            lock.lease,
        )
        _send(signals.lock_lost, self, lock.name, task_id=lock.lease)

    @property
    def lock(self) -> LockHandle:
        """The current execution's :class:`LockHandle`, inside a bound task's body.

        Raises:
            NoLockError: there is none: outside a locked execution (a plain
                function call, ``apply_async``'s side), or in an
                ``until_executing`` task, whose lock is released as its body starts.
        """
        handle: LockHandle | None = getattr(self.request, "redislock", None)
        if handle is None:
            why = (
                "an until_executing task's lock is released as its body starts"
                if self.lock_options.strategy == UNTIL_EXECUTING
                else "self.lock exists only inside the body of a locked execution"
            )
            raise NoLockError(f"task {self.name!r} holds no lock here: {why}")
        return handle

    # Enqueue side.
    def apply_async(
        self,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> AsyncResult:
        """Send the task; ``until_*`` strategies take the lock first.

        A duplicate enqueued while the lock is held publishes nothing and returns
        the holder's ``AsyncResult`` (``lock_on_duplicate="return"``) or raises
        :class:`DuplicateTaskError` (``"raise"``).

        ``lock_options={...}`` overrides lock options for this call only (see
        :data:`PER_CALL_OPTIONS`); they travel with the message, so the
        execution uses them too. A bad one raises here, naming it.

        The name an ``until_*`` send reserves travels with the message too (see
        :meth:`_message_name`): the execution takes that one, whatever the worker
        would derive.
        """
        skip_lock = options.pop(_NO_ENQUEUE_LOCK, False)
        overrides = options.pop(CALL_OPTIONS, None)
        if overrides is None:
            # Sent again by self.retry(): the overrides travel in its headers.
            overrides = (options.get("headers") or {}).get(_OVERRIDES_HEADER)
        opts = self.options_for_call(overrides)
        if overrides:
            # The worker applies them too: they travel with the message.
            options["headers"] = {**(options.get("headers") or {}), _OVERRIDES_HEADER: overrides}
        options.update(producer=producer, link=link, link_error=link_error, shadow=shadow)
        if opts.strategy == WHILE_EXECUTING or skip_lock:
            # (A re-queue of a message that met a holder keeps the name it was
            # sent with, which the holder holds.)
            running = self._running_hold(task_id)
            if running is not None and not self._sent_eagerly():
                # Its own task id sent from the body (self.replace(), say): the
                # delivery waits for this hold, not dropped as a copy of it.
                headers = options.get("headers") or {}
                options["headers"] = {**headers, _SENDER_HEADER: running.owner}
            # By name: a base class between this one and Celery's may name fewer.
            return super().apply_async(args, kwargs, task_id, **options)
        task_id = task_id or uuid()
        key = self._builder()(*self._as_sent(args, kwargs, options))
        # The name its execution takes: this one, not one the worker derives (a
        # retry's headers, copied from its request, name the first send's).
        headers = {**(options.get("headers") or {}), _NAME_HEADER: key}
        # (One copied from the request of an execution that sends its retry.)
        headers.pop(_FENCE_HEADER, None)
        options["headers"] = headers
        # What the reservation (or a retry's, handed over as its sender ends) keeps
        # beyond lock_enqueue_ttl: the countdown, or less, below 0, for a message
        # that expires sooner (Celery adds the task's own ``expires`` to a call
        # that names none).
        delay = _seconds_until(options.get("countdown") or options.get("eta"))
        expires = options.get("expires", self.expires)
        expires_in = _expires_in(expires)
        delay = _reservation_ttl(opts.enqueue_ttl + delay, expires_in) - opts.enqueue_ttl
        # (Monotonic) when a retry's reservation ends at the latest, handed over
        # however late its sender ends: once its message has expired.
        end = None if expires_in is None else time.monotonic() + expires_in + EXPIRES_GRACE
        retries = _retries(options.get("retries"))
        running = self._own_hold(task_id, key)
        if expires_in is not None and expires_in <= 0 and running is None:
            # Expired already: published as Celery would, and dropped unrun by the
            # worker that reaches it. No reservation, which would deduplicate the
            # same call sent next to it; an execution that comes all the same
            # takes the lock as one finding no reservation does.
            return self._publish(args, kwargs, task_id, options, None)
        # What the execution records once the retry is sent (only then: a send
        # that raises sent no copy that could take the hold over).
        sent: _SentRetry | None = None
        if (
            running is not None
            and getattr(self.request, _ENTERED, False)
            and not self._sent_eagerly()
        ):
            # Its own task id sent from the body: self.retry() (or Celery's
            # autoretry around it), self.replace(), or apply_async(task_id=
            # self.request.id). The execution keeps its hold until it has ended,
            # its ``finally`` blocks and ``with`` exits included (or all it runs
            # on to), and hands it over then; the message's delivery waits for it.
            options["headers"] = {**options["headers"], _SENDER_HEADER: running.owner}
            before = getattr(self.request, _SENT_RETRY, None)
            sent = (retries, delay, 1, end)
            if before is not None and before[0] == retries:
                # Another copy of the same retry: each must end unrun for a free.
                last = None if end is None or before[3] is None else max(end, before[3])
                sent = (retries, max(delay, before[1]), before[2] + 1, last)
            running = None
        try:
            # (Making the lock resolves the store: its client may fail to reach it.)
            lock = self._new_lock(
                key,
                task_id,
                queued_owner(task_id, retries),
                opts.enqueue_ttl + delay,
                heartbeat=False,
                opts=opts,
            )
            # Its own retry from before_start: the start hands its hold over now.
            acquired = lock.acquire(blocking=False) if running is None else running._hand_over(lock)
        except LockBackendError as exc:
            self._drop_start_hold(running)
            self._unavailable(key, task_id, exc, opts)
            if opts.on_redis_error == "run":
                logger.warning("%s; enqueuing %s[%s] unlocked", exc, self.name, task_id)
                return self._publish(args, kwargs, task_id, options, sent)
            raise
        except BaseException:
            # A reservation that could not be made (an option out of range, an
            # interruption): the hold read for a failed start goes back, not on
            # renewing with nobody to release it.
            self._drop_start_hold(running)
            raise
        if not acquired:
            self._drop_start_hold(running)
            holder = lock.blocked_by
            if (
                retries
                or self._own_retry(task_id)
                or (opts.on_duplicate == "return" and _in_workflow(options))
            ):
                # Somebody waits for this message's own id: a workflow (a group's
                # member, a chain's next step), or the caller of a task sent again
                # as a retry (by itself, or by the worker after its pool process
                # died). Sent all the same, it meets on_conflict as it starts (or
                # waits out the hold of an earlier delivery of its own).
                logger.info(
                    "%s: duplicate of %s sent as a workflow step or a retry (lock %s)",
                    self.name,
                    holder,
                    key,
                )
                return self._publish(args, kwargs, task_id, options, sent)
            logger.info("%s: duplicate of %s not enqueued (lock %s)", self.name, holder, key)
            _send(signals.lock_conflict, self, key, task_id=task_id, holder=holder, action="dedup")
            if opts.on_duplicate == "raise":
                raise DuplicateTaskError(key, holder)
            if holder:
                return self.AsyncResult(holder)
            raise LockConflictError(key, holder)
        if running is None and lock.token is not None:
            headers[_FENCE_HEADER] = f"{retries}:{lock.token}"
        try:
            return self._publish(args, kwargs, task_id, options, sent)
        except BaseException:
            # Nothing was sent: free the key for the next attempt.
            freed = False
            try:
                release_lease(self.lock_client, key, task_id, opts.prefix)
                freed = True
            except LockBackendError as exc:
                logger.warning(
                    "could not free %s after a failed send (freed once the store answers): %s",
                    key,
                    exc,
                )
            finally:
                if not freed:
                    # The store unreachable (often in the outage that failed the
                    # send), or an interruption: not left to its TTL, every send of
                    # the call meanwhile deduplicated to a message never sent.
                    _free_in_background(
                        lock,
                        f"freeing lock {key!r} reserved for {self.name}[{task_id}]"
                        " after a failed send",
                    )
            raise

    def _as_sent(self, args: Any, kwargs: Any, options: Mapping[str, Any]) -> tuple[Any, Any]:
        """A call's arguments as its message delivers them to a worker, so that
        the name a send reserves is the one the execution derives.

        Celery dumps the pydantic models of a ``pydantic=True`` task to dicts
        unless the message is pickled; and a ``serializer=`` given to this call
        delivers the arguments as it, not the task's serializer, encodes them
        (a ``str`` Enum member as its value under JSON), which a callable
        ``lock_key`` sees once the worker's own round trip is done.
        """
        dump = getattr(self, "_dump_pydantic_arguments", None)
        if dump is not None:
            # As Celery decides it: this call's serializer, else the task's.
            chosen = (
                options["serializer"]
                if "serializer" in options
                else self._get_exec_options().get("serializer")
            )
            if chosen != "pickle":
                args, kwargs = dump(args, kwargs)
        # The worker puts what it receives through the task's serializer (see
        # _delivered_by); the message goes as Celery encodes it.
        serializer = (
            options.get("serializer")
            or getattr(self, "serializer", None)
            or self.app.conf.task_serializer
        )
        if (
            serializer != (getattr(type(self), "serializer", None) or "json")
            and self._builder().delivered is not None
            and isinstance(args or (), list | tuple)
            and isinstance(kwargs or {}, Mapping)
        ):
            with contextlib.suppress(Exception):
                # A value this serializer refuses is refused by the send too.
                args, kwargs = _round_trip(tuple(args or ()), dict(kwargs or {}), serializer)
        return args, kwargs

    def _publish(
        self,
        args: Any,
        kwargs: Any,
        task_id: str,
        options: dict[str, Any],
        sent: _SentRetry | None,
    ) -> Any:
        """Send the message (Celery's ``apply_async``); once it is sent, record
        ``sent`` on the running execution: the retry it sent as it runs on (see
        :data:`_SENT_RETRY`). A send that raises records nothing, so the execution
        does not keep its hold for a copy that was never sent."""
        result = super().apply_async(args, kwargs, task_id, **options)
        if sent is not None:
            setattr(self.request, _SENT_RETRY, sent)
        return result

    def apply(self, *args: Any, **options: Any) -> Any:
        """Run the task here and now (Celery's ``apply``, with its arguments), locked
        as in a worker.

        ``lock_options={...}`` overrides lock options for this call, as with
        :meth:`apply_async`; a bad one raises here, naming it.

        Celery's parameters are not named here but passed on as given: binding a
        call's keyword options to a list of named parameters twice, here and in
        Celery's ``apply``, costs a comparison of each option with each name.
        """
        overrides = options.pop(CALL_OPTIONS, None)
        try:
            if overrides:
                self.options_for_call(overrides)
                return self._apply_overridden(overrides, *args, **options)
            return super().apply(*args, **options)
        except Retry as exc:
            # An eager self.retry() propagated (apply(throw=True),
            # task_eager_propagates): its retry never runs, so the reservation the
            # execution handed its until_executed hold to must not keep the lock.
            self._free_eager_reservation(exc)
            raise

    def _free_eager_reservation(self, exc: Retry) -> None:
        """Free the reservation an eager ``self.retry()`` was handed (see
        :meth:`_reserve`), whose retry does not run: ``exc`` propagated."""
        sig = getattr(exc, "sig", None)
        if (
            sig is None
            or not getattr(exc, "is_eager", False)
            or self.lock_options.strategy != UNTIL_EXECUTED
        ):
            return
        task_id = sig.options.get("task_id")
        if not task_id:
            return
        try:
            name = self.lock_name(sig.args, sig.kwargs)
            retries = _retries(sig.options.get("retries"))
            # (Not handed over, another lock or a store that failed then: nothing.)
            free_queued(self.lock_client, name, task_id, self.lock_options.prefix, retries)
        except Exception as error:
            logger.warning(
                "could not free the lock of %s[%s], whose eager retry does not run "
                "(it expires by its TTL): %s",
                self.name,
                task_id,
                error,
            )

    def _apply_overridden(
        self,
        overrides: object,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        link: Any = None,
        link_error: Any = None,
        task_id: str | None = None,
        retries: int | None = None,
        throw: bool | None = None,
        logfile: str | None = None,
        loglevel: str | None = None,
        headers: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Any:
        """:meth:`apply` with the checked ``lock_options`` of the call, which travel
        in its headers as in a message."""
        headers = {**(headers or {}), _OVERRIDES_HEADER: overrides}
        return super().apply(
            args,
            kwargs,
            link,
            link_error,
            task_id,
            retries,
            throw,
            logfile,
            loglevel,
            headers,
            **options,
        )

    def retry(
        self,
        args: Iterable[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: datetime | None = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Retry:
        """Celery's ``retry``. Sent from the body, the execution keeps its lock until
        it has ended: its ``finally`` blocks and ``with`` exits, or, with
        ``throw=False``, all it runs on to (the retry, should it start meanwhile,
        waits for it). An ``until_executed`` one then hands the lock to the retry
        (or frees it, if a delivery of the retry ended without running meanwhile,
        of each copy when it sent the retry more than once: see
        :func:`free_dropped`)."""
        request = self.request
        runs_on = not request.called_directly and not throw
        if runs_on:
            setattr(request, _RUNS_ON, True)
        try:
            return super().retry(args, kwargs, exc, throw, eta, countdown, max_retries, **options)
        finally:
            if runs_on:
                delattr(request, _RUNS_ON)

    def _sent_eagerly(self) -> bool:
        """Whether a send runs the message here and now, inside the call
        (``task_always_eager``): an execution sending its own task id cannot make
        it wait for its own end, so its hold goes (or meets the new run) at once.
        Asked only of such a send: the setting is a lookup in the app's
        configuration."""
        return bool(self.app.conf.task_always_eager)

    def _own_retry(self, task_id: str) -> bool:
        """Whether sending ``task_id`` sends the running execution's own task id
        (its ``self.retry()``, ``self.replace()``, or a send under that id)."""
        request = self.request
        return not request.called_directly and request.id == task_id

    def _running_hold(self, task_id: str | None) -> RedisLock | None:
        """The hold of the execution whose body sends ``task_id``, its own task id."""
        if task_id is None or not self._own_retry(task_id):
            return None
        handle = getattr(self.request, "redislock", None)
        lock = handle._lock if handle is not None else None
        return lock if lock is not None and lock.holding else None

    def _own_hold(self, task_id: str, name: str) -> RedisLock | None:
        """The running execution's hold of lock ``name``, when sending ``task_id``
        sends its own task id (which it hands the hold to: at once from
        ``before_start``, as it ends from the body)."""
        if not self._own_retry(task_id):
            return None
        request = self.request
        handle = getattr(request, "redislock", None)
        if handle is None and not getattr(request, _ENTERED, False):
            # Not started: self.retry() from before_start.
            return None if getattr(request, _RUNS_ON, False) else self._held_at_start(task_id, name)
        lock = handle._lock if handle is not None else None
        return lock if lock is not None and lock.name == name and lock.holding else None

    def _held_at_start(self, task_id: str, name: str) -> RedisLock | None:
        """The hold of lock ``name`` written ahead for the current execution
        (:mod:`celery_redislock.early`), which has not started: its
        ``before_start`` sends its retry (``until_executed``). Read now, so that
        it is handed to the retry's reservation before the retry is sent: a retry
        that started before the failed start gave it back would wait for it."""
        me = threading.get_ident()
        written = _written_ahead.get(me)
        if (
            written is None
            or written.task_id != task_id
            or written.opts.strategy != UNTIL_EXECUTED
            or written.sent.lock.name != name
        ):
            return None
        _written_ahead.pop(me, None)
        if not written.sent.claim():
            return None
        lock = written.sent.lock
        try:
            acquired = lock._acquire_sent(written.sent)
        except LockBackendError as exc:
            logger.warning(
                "could not read the lock %s taken for %s[%s]: %s", name, self.name, task_id, exc
            )
            return None
        if acquired and lock.lost:
            # Read after its TTL: another may hold the lock by now.
            lock.release(wait=False, then=_no_report)
            return None
        return lock if acquired else None

    def _drop_start_hold(self, lock: RedisLock | None) -> None:
        """Give back a hold :meth:`_held_at_start` read that could not be handed
        to the retry's reservation: nobody else would."""
        if lock is None or not lock.holding or getattr(self.request, _ENTERED, False):
            return
        try:
            lock.release(wait=False, then=_no_report)
        except LockBackendError as exc:
            logger.warning("%s (lock %s expires by its TTL)", exc, lock.name)

    # Execution side.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or getattr(request, _ENTERED, False):
            # A plain function call: outside any worker or apply(), or the task
            # calling itself from its own body (still that execution's request).
            return super().__call__(*args, **kwargs)
        setattr(request, _ENTERED, True)
        return self._run_locked(request, args, kwargs)

    # Celery's batch signatures, which would run every item unlocked.
    def chunks(self, it: Any, n: int) -> Any:
        """Refused: see :meth:`_no_batches`.

        Raises:
            TypeError: always; the message says what to send instead.
        """
        raise self._no_batches("chunks", "starmap", "group(task.s(*args) for args in items)")

    def map(self, it: Any) -> Any:
        """Refused: see :meth:`_no_batches`.

        Raises:
            TypeError: always; the message says what to send instead.
        """
        raise self._no_batches("map", "map", "group(task.s(arg) for arg in items)")

    def starmap(self, it: Any) -> Any:
        """Refused: see :meth:`_no_batches`.

        Raises:
            TypeError: always; the message says what to send instead.
        """
        raise self._no_batches("starmap", "starmap", "group(task.s(*args) for args in items)")

    def _no_batches(self, method: str, runner: str, instead: str) -> TypeError:
        """Why ``method`` (``chunks``, ``map``, ``starmap``) is refused.

        Celery runs the items of these signatures inside its built-in
        ``celery.map``/``celery.starmap`` task (``runner``), each as a direct
        call of this task, which takes no lock (see :meth:`__call__`): items
        with the same lock name would run at once. A ``group`` of the task's own
        signatures (``instead``) sends each item as a message of its own, which
        locks.
        """
        return TypeError(
            f"{method}() of task {self.name!r} would run each item as a direct call of "
            f"the task inside Celery's celery.{runner} task, and a direct call takes no "
            "lock: items with the same lock name would run at once. Send a group of the "
            f"task's signatures instead: {instead}"
        )

    def _execution_lock(
        self, key: str, task_id: str, opts: LockOptions, request: Any, retries: int | None = None
    ) -> RedisLock:
        """The lock of one execution (``request``: its context, or its worker
        request; ``retries``: its message's retry count, if the caller has it)."""
        if SEPARATOR in task_id:
            check_stored(task_id, "task id")
        kept = self._lock_kind
        same = kept is not None and kept[1] is opts and kept[2] == _process.pid
        now = time.monotonic()
        if kept is None or not same or now >= kept[4]:
            client = lock_store(self.app, opts.url)
            if kept is not None and same and kept[0] is client:
                shared = kept[3]
            else:
                # What every execution with these options shares (one per task and
                # process, unless a call overrides options): a forked child has
                # connections of its own, even to a client object it inherited.
                # Its description's since is when the hold began, whether it
                # waited for the lock or not.
                shared = RedisLock._shared(
                    client,
                    opts.ttl,
                    on_lost=self._on_lost,
                    min_replicas=opts.min_replicas,
                    prefix=opts.prefix,
                    since_kept=True,
                )
            kept = self._lock_kind = (client, opts, _process.pid, shared, now + STORE_RECHECK)
        if retries is None:
            # request_retries(), for a first delivery (the usual one) without a call.
            retries = getattr(request, "retries", None)
            retries = request_retries(request) if retries != 0 else 0
        lock = RedisLock._from_shared(
            kept[3],
            key,
            _execution_owner(retries) if retries else owner_token(),
            task_id,
            self._holder_text(running=True, request=request),
        )
        if opts.strategy != WHILE_EXECUTING:
            # The reservation its send made, which its acquire takes over: freed
            # should a failover lose the take-over (see RedisLock._free_reservation).
            reservation = queued_owner(task_id, retries)
            lock._reserved_by = (reservation, _sent_fence(request))
            if retries and opts.strategy == UNTIL_EXECUTED:
                # A retry's delivery: the reservation its sender left is its own.
                lock._handed_from = reservation
        return lock

    def _acquire_ahead(self, message: Any) -> None:
        """Write the acquire of an execution the worker has just accepted, to be
        read as it starts (see :mod:`celery_redislock.early`); ``message`` is its
        worker request."""
        me = threading.get_ident()
        stale = _written_ahead.pop(me, None)
        if stale is not None:
            # Its task never started, nor failed where the worker could see it.
            stale.sent.abandon()
        if type(self).__call__ is not SingletonTask.__call__:
            # A __call__ of a subclass may not start the locked execution.
            return
        try:
            headers = message.request_dict
            overrides = headers.get(_OVERRIDES_HEADER)
            opts = (
                self.options_for_call(overrides)
                if overrides
                else (self._lock_options or self.lock_options)
            )
            if opts.strategy == UNTIL_EXECUTING:
                return
            task_id = check_name(message.id, "task id")
            key = self._message_name(message, message.args, message.kwargs)
            lock = self._execution_lock(
                key, task_id, opts, message, _retries(headers.get("retries"))
            )
        except Exception:
            # Raised again as the task starts, and reported then.
            return
        ahead = lock._acquire_to_send()
        if ahead is not None:
            # Kept before it is written: an exception raised asynchronously as it
            # is written (a soft time limit) leaves it to be given back.
            # _Ahead(...) without its Python-level __new__: every accepted task's.
            _written_ahead[me] = tuple.__new__(_Ahead, (task_id, ahead, opts))
            lock._write_acquire(ahead)

    def _run_locked(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ahead: SentAcquire | None = None
        written = _written_ahead.pop(threading.get_ident(), None) if _written_ahead else None
        if written is not None and written.task_id != request.id:
            # Written for a task that never started: this thread runs another.
            written.sent.abandon()
            written = None
        if written is not None and written.sent.claim():
            ahead, opts = written.sent, written.opts
            lock = ahead.lock
            key, task_id, asked = lock.name, lock.lease, ahead.sent
        else:
            task_id = request.id or uuid()
            key = self._message_name(request, args, kwargs)
            opts = self.options_for_call(_sent_overrides(request))
            if opts.strategy == UNTIL_EXECUTING:
                try:
                    release_lease(self.lock_client, key, task_id, opts.prefix)
                except LockBackendError as exc:
                    self._unavailable(key, task_id, exc, opts)
                    self._free_reservation_later(key, task_id, request, opts)
                    if opts.on_redis_error != "run":
                        raise
                    logger.warning("%s; %s[%s] runs all the same", exc, self.name, task_id)
                return self.run(*args, **kwargs)
            check_name(task_id, "task id")
            try:
                lock = self._execution_lock(key, task_id, opts, request)
            except LockBackendError as exc:
                # The store's client could not be made (a redislock_client
                # callable that could not reach it): as an acquire that failed.
                self._unavailable(key, task_id, exc, opts)
                if opts.on_redis_error != "run":
                    raise
                return self._run_unlocked(request, key, task_id, exc, opts, args, kwargs)
            asked = time.monotonic()
        taken = asked
        keep = retrying = reserve = False
        # When it began to wait (on_conflict="wait"), once it found the lock held.
        waiting: list[float] = []
        # Looked up once: its hold is pushed on it below and popped as it ends.
        on_thread = _held_on_this_thread()
        # Known to run here from its first ask on, not only once it has read that
        # it holds: a copy of its message on another thread that finds the lock
        # handed to it (both waited) is dropped, never left to wait behind it.
        _running_here[lock.owner] = _process.pid
        # One try from the acquire on: an exception raised asynchronously (a soft
        # time limit) just after the lock was taken must not leave it held, and
        # renewed by this process's heartbeat, with nobody to release it.
        try:
            try:
                first: bool | None = None
                if ahead is not None:
                    first = lock._acquire_sent(ahead)
                elif opts.on_conflict != "wait":
                    # As if written ahead, its reply read at once (a task of a
                    # prefork pool process, whose acquire nothing wrote ahead):
                    # the general path's layers, there to queue and wait, cost
                    # a worker more per task.
                    first = lock._acquire_at_once()
                if first is not None:
                    acquired = first
                    if acquired and lock.lost:
                        # Read only once the hold's TTL had passed (the work
                        # between the worker's accept and the task's start, or a
                        # stalled store or process, took that long): another may
                        # hold the lock by now. Given back, if it is still there,
                        # and asked for anew.
                        lock = self._ask_anew(lock, key, task_id, opts, request)
                        first = None
                if first is None:

                    def held() -> None:
                        if lock.blocked_by == task_id:
                            # Another delivery of this message: not lock_wait's wait.
                            raise _OwnDelivery
                        if not waiting:
                            # Reported once per delivery: an ask made again after a
                            # late answer (below) goes on with the same wait.
                            waiting.append(self._wait_begins(lock, key, request, opts))

                    # A hold whose answer is read only once its TTL had passed (the
                    # process frozen, or the store stalled, while the try that took
                    # it was on its way) is given back and asked for once more, as
                    # above, before the body runs; a second such hold is kept, on
                    # the heartbeat, which reports it lost. The ask made again waits
                    # only for what is left of lock_wait, and a conflict it meets is
                    # not reported a second time.
                    limit = check_timeout(opts.wait)
                    wait_ends = None if limit is None else time.monotonic() + limit
                    for late_to_caller in (True, False):
                        if opts.on_conflict == "wait":
                            left = None if wait_ends is None else wait_ends - time.monotonic()
                            # A first try that can queue (see RedisLock._acquire): no
                            # second request when the lock is held.
                            try:
                                acquired = lock._acquire(
                                    True,
                                    None if left is None else max(0.0, left),
                                    held,
                                    None,
                                    late_to_caller,
                                )
                            except _OwnDelivery:
                                acquired = False
                        else:
                            acquired = lock._acquire(False, None, None, None, late_to_caller)
                        if not (acquired and lock.lost and late_to_caller):
                            break
                        lock = self._ask_anew(lock, key, task_id, opts, request)
            except LockBackendError as exc:
                # Only a first try that failed runs the task unlocked, not a wait.
                self._unavailable(key, task_id, exc, opts, unlocked=not waiting)
                if not waiting:
                    # (One that waits found the lock held by another: no reservation.)
                    self._free_reservation_later(key, task_id, request, opts)
                if waiting or opts.on_redis_error != "run":
                    raise
                return self._run_unlocked(request, key, task_id, exc, opts, args, kwargs)
            if not acquired and lock.blocked_by != task_id and lock._reserved_by is not None:
                # Held by another: its message's reservation, taken over by
                # nobody, can be left only on a primary promoted meanwhile.
                lock._free_reservation(asked, at_once=False)
            if not acquired and lock.blocked_by == task_id:
                # Another delivery of this very message: whether it is alive decides.
                outcome = self._redelivered(lock, key, request, opts, waiting)
                if outcome is not None:
                    return outcome
            elif waiting:
                self._waited(lock, key, request, opts, waiting[0], acquired)
            elif not acquired:
                outcome = self._conflict(lock, key, request, opts, waiting)
                if outcome is not None:
                    return outcome
            request.redislock = LockHandle(key, lock, opts)
            on_thread.append(lock.owner)
            taken = time.monotonic()
            if signals.lock_acquired.receivers:
                _send(
                    signals.lock_acquired,
                    self,
                    key,
                    task_id=task_id,
                    token=lock.token,
                    waited=taken - waiting[0] if waiting else 0.0,
                )
            return self.run(*args, **kwargs)
        except Retry as exc:
            retrying = True
            if opts.strategy == UNTIL_EXECUTED and getattr(exc, "is_eager", False):
                # Run at once by apply(), not sent: handed the hold here, if it is
                # a retry of the same call (the same lock). A retry that was sent
                # is handed it below (see _SENT_RETRY).
                keep = reserve = self._same_lock(exc.sig, key)
            raise
        except Reject as exc:
            keep = reserve = opts.strategy == UNTIL_EXECUTED and bool(exc.requeue)
            raise
        finally:
            _running_here.pop(lock.owner, None)
            if on_thread and on_thread[-1] == lock.owner:
                on_thread.pop()
            sent: _SentRetry | None = getattr(request, _SENT_RETRY, None)
            # What is left of the reservation of that retry (s): until its message
            # expires, plus EXPIRES_GRACE, counted from its send, not from now.
            left = None if sent is None or sent[3] is None else sent[3] - time.monotonic()
            if left is not None and left <= 0:
                # Expired while its sender ran on: nobody runs it, so nobody is
                # handed the hold (an execution of it all the same takes the
                # lock as one finding no reservation does).
                sent = None
            if sent is not None and opts.strategy == UNTIL_EXECUTED:
                # A retry its body sent (raised, or sent as it ran on): held for it.
                keep = reserve = True
            if lock._holds > 0:  # lock.holding, inline: every execution ends here
                if keep:
                    # Renewed no more before it changes hands: no renewal finds it lost.
                    lock.detach()
                    if reserve:
                        # A message requeued waits in the queue like one just sent;
                        # an eager retry, or a task without acks_late (whose message
                        # Celery does not requeue), comes at once or never.
                        requeued = not retrying and self.acks_late and not request.is_eager
                        ttl = opts.enqueue_ttl if requeued else opts.ttl
                        # The message that comes back: this one again, or its retry.
                        retries = request_retries(request) + int(retrying)
                        if sent is not None:
                            # (It may wait for its countdown, as one just sent.)
                            retries, ttl = sent[0], opts.enqueue_ttl + sent[1]
                            if left is not None:
                                ttl = min(ttl, left)
                        # (A retry sent as it ran on may have ended unrun meanwhile.)
                        self._reserve(
                            lock, opts, ttl, retries, heed=sent is not None,
                            copies=sent[2] if sent is not None else 1,
                        )  # fmt: skip
                else:
                    self._release(lock, time.monotonic() - taken, retrying)

    def _ask_anew(
        self, lock: RedisLock, key: str, task_id: str, opts: LockOptions, request: Any
    ) -> RedisLock:
        """Give back the hold of ``lock``, read only once its TTL had passed, and
        return the execution's lock to ask with anew (known to run here from now
        on, as ``lock`` was)."""
        lock.release(wait=False, then=_no_report)
        _running_here.pop(lock.owner, None)
        fresh = self._execution_lock(key, task_id, opts, request)
        _running_here[fresh.owner] = _process.pid
        return fresh

    def _run_unlocked(
        self,
        request: Any,
        key: str,
        task_id: str,
        error: LockBackendError,
        opts: LockOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run the body without lock ``key``, whose store failed as the execution
        began (``lock_on_redis_error="run"``)."""
        logger.warning("%s; running %s[%s] unlocked", error, self.name, task_id)
        request.redislock = LockHandle(key, None, opts)
        return self.run(*args, **kwargs)

    def _free_reservation_later(
        self, key: str, task_id: str, request: Any, opts: LockOptions
    ) -> None:
        """Free, in the background once the store answers again, the reservation
        of the message of ``task_id`` (``until_*``), whose execution could not
        reach the store as it began, and so never took the reservation over: it
        failed (``lock_on_redis_error="fail"``) or runs unlocked (``"run"``).
        Left alone, the reservation would outlive it by up to
        ``lock_enqueue_ttl``, every send of the same call meanwhile returning
        this execution's result instead of running. Only that message's
        reservation goes, by its owner token: a hold another execution took
        over (or this one's acquire did, should it land after all) stays. Never
        raises: a reservation that cannot be freed expires by its TTL."""
        if opts.strategy == WHILE_EXECUTING or request.is_eager:
            return
        what = f"freeing lock {key!r} reserved for {self.name}[{task_id}]"
        try:
            owner = queued_owner(task_id, request_retries(request))
            reservation = self._new_lock(
                key, task_id, owner, opts.enqueue_ttl, heartbeat=False, opts=opts
            )
        except Exception as error:
            logger.warning("%s: not possible (it expires by its TTL): %s", what, error)
            return
        _free_in_background(reservation, what, _sent_fence(request))

    def _same_lock(self, signature: Any, name: str) -> bool:
        """Whether the call ``signature`` (a retry's) takes lock ``name``."""
        try:
            return (
                signature is not None and self.lock_name(signature.args, signature.kwargs) == name
            )
        except Exception:
            return False

    def _reserve(
        self,
        lock: RedisLock,
        opts: LockOptions,
        ttl: float,
        retries: int,
        heed: bool = False,
        copies: int = 1,
        fence: int | None = None,
    ) -> bool:
        """Hand an execution's hold to the reservation of its message coming back
        with retry count ``retries``: after ``Reject(requeue=True)`` of an
        ``until_executed`` task, an eager ``self.retry()``, or a retry the body
        sent (raised, or sent as it ran on with ``self.retry(throw=False)``; one
        sent from ``before_start`` was handed the hold as it was sent). That
        delivery takes it over at once, while nobody else can (a copy of an
        earlier delivery of the message included, for a retry's); one that
        started meanwhile, queued behind the hold, is woken as it moves. If the
        lock store fails, the hold is freed in the background once the store
        answers (see :meth:`_free_unmoved_later`), or (a hand-over whose answer
        was lost) the reservation it made is. Returns whether the hold moved.

        With ``heed``, for a retry that was sent while the hold was kept (by the
        execution running on, or by a start that failed; ``copies`` of it), the
        hold then goes where the word a delivery of that retry left for this hold
        says, if it ended without running meanwhile (see :meth:`_heed_dropped`).
        ``fence``: the hold's fencing token, if ``lock`` does not know it (a
        reservation read, not taken)."""
        reservation = self._take_reservation(lock, opts, ttl, retries)
        if reservation is None:
            return False
        if heed:
            held = fence if fence is not None else lock.token
            self._heed_dropped(reservation, retries, opts, [] if held is None else [held], copies)
        return True

    def _take_reservation(
        self, lock: RedisLock, opts: LockOptions, ttl: float, retries: int
    ) -> RedisLock | None:
        """The reservation of retry ``retries`` (TTL ``ttl``) that ``lock``'s hold
        was handed to (see :meth:`_reserve`), ``None`` if it did not move."""
        owner = queued_owner(lock.lease, retries)
        try:
            reservation = self._new_lock(
                lock.name, lock.lease, owner, ttl, heartbeat=False, opts=opts
            )
            reservation._handed_from = lock.owner
            # A move, never a new hold: a hold taken over meanwhile (its retry
            # took it, ran and released it) is not made again.
            reservation._move_only = True
            moved = reservation.acquire(blocking=False)
        except LockBackendError as exc:
            logger.warning(
                "could not keep lock %s for the redelivery of %s[%s]; it is freed once "
                "the lock store answers, and taken anew by the redelivery: %s",
                lock.name,
                self.name,
                lock.lease,
                exc,
            )
            self._free_unmoved_later(lock)
            return None
        return reservation if moved else None

    def _free_unmoved_later(self, lock: RedisLock) -> None:
        """Free ``lock``'s hold, which could not be handed to a redelivery's
        reservation (see :meth:`_take_reservation`), in the background once the
        store answers again, rather than leave it until its TTL: nobody would
        take it over, and the redelivery (a retry waits behind the execution
        that sent it) would wait for it to expire. Freed, it wakes that
        redelivery, which takes the lock anew; a redelivery that already ended
        (its start failed in the same outage) leaves the lock free. By the
        hold's owner token only: a hold the move made after all (its answer
        lost) is the reservation's, and stays, as does any other owner's.

        The lock is not reserved between that free and the redelivery's start:
        the same call sent meanwhile is not deduplicated, and the redelivery
        then meets its hold as any conflicting execution does (``on_conflict``).
        A move sent again in the background instead would keep the lock for a
        redelivery that may have already ended, until the reservation's TTL.
        Never raises: a hold that cannot be freed expires by its TTL."""
        _free_in_background(
            lock,
            f"freeing lock {lock.name!r} not handed to the redelivery of {self.name}[{lock.lease}]",
        )

    def _heed_dropped(
        self,
        reservation: RedisLock,
        retries: int,
        opts: LockOptions,
        fences: list[int],
        copies: int,
    ) -> None:
        """Once a hold (its fencing token among ``fences``) went to ``reservation``,
        retry ``retries``'s (0: a message without a retry count the body sent under
        its own task id): if a delivery of that retry ended without running
        while the hold was still kept for it (it failed to start, or was dropped
        as revoked; see :func:`free_dropped`), free the reservation, which nobody
        would take over, or pass it on to the retry that failed start sent (and
        heed that one's word in turn).

        Only word left for that hold is acted on: word left for another hold of
        the task id (an earlier use of the id, an earlier delivery of the
        message) is stale, and the reservation is kept for the retry. So it is
        while fewer deliveries ended unrun than ``copies`` of the retry were sent:
        another is on its way. Either way the word is deleted once acted on.

        Should the lock store fail meanwhile (the word not read, say, every
        answer lost), it is done again in the background until the store
        answers (see :class:`~celery_redislock.retried.Retried`), from where it stands (the reservation
        it was passed on to, if it was), for as long as that reservation's TTL:
        a reservation nobody takes over would otherwise keep the lock, and
        every send of the same call would be deduplicated to a message that
        never runs. Done late, or twice, it is harmless: the free and the
        move are owner-checked, and the word is only acted on by the holds it
        names. Never raises.
        """
        heeding = _Heeding(self, reservation, retries, opts, fences, copies)
        try:
            self._heed_words(heeding)
        except LockBackendError as exc:
            logger.warning(
                "could not check whether the message it sent (retry count %d) of %s[%s] ended "
                "without running; done again once the lock store answers (else lock %s "
                "expires by its TTL, or free it with `celery redislock release`): %s",
                heeding.retries,
                self.name,
                reservation.lease,
                reservation.name,
                exc,
            )
            retry_later(heeding)

    def _heed_words(self, heeding: _Heeding) -> None:
        """Read the word left beside the lock for ``heeding``'s reservation, act
        on it and forget it, and so on along the retries it is passed on to (see
        :meth:`_heed_dropped`), noting in ``heeding`` where it stands.

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        client, opts = self.lock_client, heeding.opts
        # Each word names a later retry: a chain of them ends.
        while True:
            reservation, retries = heeding.reservation, heeding.retries
            name, task_id = reservation.name, reservation.lease
            word = read_word(client, name, task_id, retries, opts.prefix)
            if word is None:
                return
            following = self._heed_word(
                reservation, word, retries, opts, heeding.fences, heeding.copies
            )
            forget_word(client, name, task_id, retries, opts.prefix, word)
            if following is None:
                return
            heeding.moved(following, word.then)

    def _heed_word(
        self,
        reservation: RedisLock,
        word: Word,
        retries: int,
        opts: LockOptions,
        fences: list[int],
        copies: int,
    ) -> RedisLock | None:
        """Act on ``word``, left by a delivery of retry ``retries`` whose
        reservation holds the lock now (see :meth:`_heed_dropped`): the reservation
        of the retry it is passed on to, if it was; ``None`` if it was kept or
        freed.

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        client, name, task_id = self.lock_client, reservation.name, reservation.lease
        if word.fence not in fences:
            logger.info(
                "%s[%s]: word left for another hold of lock %s about the message it sent "
                "(retry count %d) "
                "ignored; the lock is kept for that retry",
                self.name,
                task_id,
                name,
                retries,
            )
            return None
        if word.drops < copies:
            logger.info(
                "%s[%s]: %d of the %d copies of the message it sent (retry count %d) "
                "ended without running; lock %s is kept for the others",
                self.name,
                task_id,
                word.drops,
                copies,
                retries,
                name,
            )
            return None
        if word.then <= retries:
            if free_queued(client, name, task_id, opts.prefix, retries):
                logger.info(
                    "%s[%s]: the message it sent (retry count %d) ended without running; "
                    "lock %s freed",
                    self.name,
                    task_id,
                    retries,
                    name,
                )
            return None
        return self._take_reservation(reservation, opts, word.ms / 1000, word.then)

    def _start_failed(self, exc: BaseException) -> None:
        """Give back what the execution of the current request holds, whose
        ``before_start`` raised ``exc``, before the tracer stores the outcome (a
        client that sees it and sends the task again finds the key free): the
        hold written ahead as the worker accepted the task
        (:mod:`celery_redislock.early`), and an ``until_*`` message's
        reservation, which the execution never took over.

        Kept, as the reservation of the message that comes back, for a delivery
        that comes: the message requeued by ``Reject(requeue=True)`` of an
        ``acks_late`` task, or the retry ``self.retry()`` sent (as from the
        body). A retry's delivery whose reservation is not there yet (the
        execution that sent it runs on after ``self.retry(throw=False)``) leaves
        that execution word to free it, or pass it on, as it ends (see
        :func:`free_dropped`), as does a delivery of a message that execution sent
        under its own task id from its body (``self.replace()``,
        ``apply_async(task_id=...)``). An exception that is no ``Exception`` (the process
        ends) gives back only the hold written ahead. Never raises: a store that fails leaves the
        lock to its TTL, logged.
        """
        request = self.request
        task_id = request.id
        if request.called_directly or not task_id or getattr(request, _ENTERED, False):
            # Not a start: called by hand, or from the running body.
            return
        written = take_written_ahead(task_id) if _written_ahead else None
        if written is None and not isinstance(exc, Exception):
            return
        try:
            if written is not None:
                opts, name = written.opts, written.sent.lock.name
            else:
                opts = self.options_for_call(_sent_overrides(request))
                if opts.strategy == WHILE_EXECUTING:
                    return
                name = self._message_name(request, request.args, request.kwargs)
            kept = None
            if isinstance(exc, Exception):
                kept = self._kept_for(exc, request, name, opts)
            moved = False
            if written is not None:
                moved = self._give_back_ahead(written.sent, opts, kept)
            if opts.strategy == WHILE_EXECUTING or not isinstance(exc, Exception):
                return
            retries, sender = request_retries(request), request_sender(request)
            if kept is None:
                # Only the message's reservation: never an execution's hold.
                if request.is_eager:
                    free_queued(self.lock_client, name, task_id, opts.prefix, retries)
                else:
                    self._free_message(request, name, opts)
            elif kept[0] != retries and not moved:
                self._pass_on(name, task_id, retries, kept, opts, sender)
        except Exception as error:
            logger.warning(
                "could not give back the lock of %s[%s], whose start failed (it expires "
                "by its TTL): %s",
                self.name,
                task_id,
                error,
            )

    def _kept_for(
        self, exc: Exception, request: Any, name: str, opts: LockOptions
    ) -> tuple[int, float] | None:
        """The retry count and TTL of the reservation lock ``name`` is kept as for
        the delivery that comes after ``before_start`` raised ``exc``; ``None``
        when none comes."""
        if opts.strategy == WHILE_EXECUTING or request.is_eager:
            return None
        if isinstance(exc, Reject):
            # Celery requeues the message of an acks_late task only.
            if exc.requeue and self.acks_late:
                return request_retries(request), opts.enqueue_ttl
            return None
        if isinstance(exc, Retry) and self._same_lock(exc.sig, name):
            sent = exc.sig.options
            delay = _seconds_until(sent.get("countdown") or sent.get("eta"))
            return _retries(sent.get("retries")), opts.enqueue_ttl + delay
        return None

    def _pass_on(
        self,
        name: str,
        task_id: str,
        retries: int,
        kept: tuple[int, float],
        opts: LockOptions,
        sender: str | None = None,
    ) -> None:
        """Hand the reservation of the message of ``task_id`` with retry count
        ``retries``, whose start failed, to the reservation ``kept`` (retry count,
        TTL) names: the retry the start sent.

        A retry's reservation (``until_executed``) may not be there yet: the
        execution that sent that retry may still run on (``self.retry(throw=False)``)
        and hand its hold over only as it ends. It is then left word to pass the
        hold on to ``kept`` as it does (see :func:`free_dropped`). So is the
        execution that sent a message without a retry count under its own task id
        (``self.replace()``, ``apply_async(task_id=...)``), whose hold ``sender``
        (the message's header) names.

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        reservation = self._new_lock(
            name, task_id, queued_owner(task_id, retries), opts.enqueue_ttl,
            heartbeat=False, opts=opts,
        )  # fmt: skip
        # (Word left for the reservation names its fencing token.)
        fence = self._reserved_fence(reservation)
        if self._reserve(reservation, opts, kept[1], kept[0], heed=True, fence=fence):
            return
        if not (retries or sender) or opts.strategy != UNTIL_EXECUTED:
            return
        word = f"{kept[0]} {max(1, int(kept[1] * 1000))}"
        client, prefix, ttl = self.lock_client, opts.prefix, kept[1]
        if leave_word(client, name, task_id, prefix, retries, word, ttl, None, sender or "") == 2:
            # Handed to this retry's reservation meanwhile.
            fence = self._reserved_fence(reservation)
            self._reserve(reservation, opts, kept[1], kept[0], heed=True, fence=fence)

    def _reserved_fence(self, reservation: RedisLock) -> int | None:
        """The fencing token of ``reservation``'s hold, if it holds its lock (a
        read: the hold was made by another).

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        key, deadline = reservation.key, Deadline.after(DEFAULT_CALL_TIMEOUT)
        with backend_errors(f"read lock {reservation.name!r}"):
            raw = send(router_for(self.lock_client), key, ("GET", key), deadline)
        fields = decode_lock(raw)
        if fields.get(OWNER_FIELD) != reservation.owner:
            return None
        return ascii_number(fields.get(FENCE_FIELD, ""))

    def _give_back_ahead(
        self, sent: SentAcquire, opts: LockOptions, kept: tuple[int, float] | None
    ) -> bool:
        """Give back the hold written ahead for an execution that never started, or
        hand it to the reservation ``kept`` (retry count, TTL) names; return
        whether it was handed over.

        Raises:
            LockBackendError: its reply could not be read (the hold, if made,
                expires by its TTL).
        """
        if kept is None:
            sent.abandon()
            return False
        if not sent.claim():
            return False
        lock = sent.lock
        if not lock._acquire_sent(sent):
            return False
        # Renewed no more before it changes hands.
        lock.detach()
        return self._reserve(
            lock, opts, kept[1], kept[0], heed=kept[0] != hold_retries(lock.owner, lock.lease or "")
        )

    def _release(self, lock: RedisLock, held: float, taken_over_ok: bool = False) -> None:
        """Release without waiting for the answer: the request is written before the
        worker stores the task's result, so a client that sees the result and sends
        the task again finds the key free, but the task does not wait a round trip
        for it. The answer is read moments later; ``lock_released`` reports it."""

        def answered(outcome: ReleaseOutcome) -> None:
            if outcome == "lost" and not taken_over_ok:
                logger.warning(
                    "lock %s of %s[%s] was lost before the task ended",
                    lock.name,
                    self.name,
                    lock.lease,
                )
            elif outcome in ("failed", "retrying"):
                logger.warning(
                    "could not confirm the release of lock %s of %s[%s]; it is retried "
                    "in the background, or expires by its TTL",
                    lock.name,
                    self.name,
                    lock.lease,
                )
            if signals.lock_released.receivers:
                self._report_release(lock, held, outcome)

        try:
            lock.release(wait=False, then=answered)
        except LockBackendError as exc:
            # The error says what becomes of the lock (retried in the background,
            # or left to its TTL).
            logger.warning("%s", exc)
            self._report_release(lock, held, "failed")

    def _report_release(self, lock: RedisLock, held: float, outcome: str) -> None:
        """Send ``lock_released`` (a release being retried reports ``"failed"``)."""
        _send(
            signals.lock_released,
            self,
            lock.name,
            task_id=lock.lease,
            held=held,
            outcome="failed" if outcome == "retrying" else outcome,
        )

    def _unavailable(
        self,
        key: str,
        task_id: str,
        error: LockBackendError,
        opts: LockOptions,
        unlocked: bool = True,
    ) -> None:
        """Send :data:`~celery_redislock.signals.lock_unavailable` for lock ``key``:
        the task runs (or is sent) without it when ``lock_on_redis_error`` is
        ``"run"`` and ``unlocked`` allows it, and fails otherwise."""
        action = "run" if unlocked and opts.on_redis_error == "run" else "fail"
        _send(signals.lock_unavailable, self, key, task_id=task_id, error=error, action=action)

    def _wait_begins(self, lock: RedisLock, key: str, request: Any, opts: LockOptions) -> float:
        """Report that the lock is held and the task waits for it (``on_conflict="wait"``);
        return when the wait began."""
        holder = lock.blocked_by
        _send(signals.lock_conflict, self, key, task_id=request.id, holder=holder, action="wait")
        logger.info(
            "%s[%s] waits up to %g s: lock %s held by %s",
            self.name,
            request.id,
            opts.wait,
            key,
            holder,
        )
        return time.monotonic()

    def _waited(
        self,
        lock: RedisLock,
        key: str,
        request: Any,
        opts: LockOptions,
        started: float,
        acquired: bool,
    ) -> None:
        """Report how a wait that began at ``started`` ended; raise
        :class:`LockConflictError` if the lock was not acquired."""
        if acquired:
            logger.info(
                "%s[%s] got lock %s after waiting %.3f s",
                self.name,
                request.id,
                key,
                time.monotonic() - started,
            )
            return
        holder = lock.blocked_by
        logger.info(
            "%s[%s] gave up after waiting %g s: lock %s still held by %s",
            self.name,
            request.id,
            opts.wait,
            key,
            holder,
        )
        raise LockConflictError(
            key,
            holder,
            f"lock {key!r} is still held by task {holder!r} after waiting {opts.wait:g} s",
        )

    def _redelivered(
        self, lock: RedisLock, name: str, request: Any, opts: LockOptions, waiting: list[float]
    ) -> Any:
        """Wait out the hold of an earlier delivery of this execution's own message
        (same task id): a message the broker delivered again while it still ran (a
        Redis broker's visibility timeout, a broker connection lost under
        ``acks_late``), or a retry whose predecessor has not released yet.

        Whatever ``on_conflict`` says, the two never run at once, and this copy is
        not dropped while the earlier one may be dead: it waits as long as that
        hold had left (plus :data:`REDELIVERY_GRACE`), during which a dead
        holder's hold expires and a live one's is renewed. (A holder of the same
        retry count running in this process, on the threads pool, is known alive
        at once; so is one this delivery runs nested in, on the same thread, sent
        eagerly from its body, whatever the header or retry count says.) Freed or expired in that time, the lock is taken (the wait's
        start is added to ``waiting``) and ``None`` returned: the task runs.
        Still held, its holder is alive and runs the message: this copy raises
        ``Ignore`` (its message is acknowledged, and no state is stored over the
        running one's). Taken by another task meanwhile, it meets ``on_conflict``
        (see :meth:`_conflict`) as soon as it finds so. A retry whose lock is held
        by an execution of an earlier delivery of its message (the one that sent
        it, which ran on after ``self.retry(throw=False)``) is not a copy: it
        waits for that execution however long it runs, then runs. Nor is a
        message an execution's body sent under its own task id (its retry,
        ``self.replace()``, ``apply_async(task_id=self.request.id)``: see
        :data:`_SENDER_HEADER`) that finds that execution's hold: it waits
        likewise, whatever its retry count. Should that hold pass meanwhile to
        another delivery of the message (a copy of it delivered beside it,
        which took the hand-over first), this one is a copy of that delivery
        from then on, and meets it as above. Should that wait end in an
        exception with nothing held (a soft time limit fires), the delivery
        ends without running and leaves the execution word to free the lock as
        it ends (see :meth:`_ended_behind_sender`).

        A copy whose message was sent again since, as a retry, finding that retry
        holding the lock (its reservation, or its execution), is superseded: it
        raises ``Ignore`` too, at once, and the retry runs. With Celery's
        ``worker_deduplicate_successful_tasks``, a copy that takes the lock after
        its first delivery succeeded raises ``Ignore`` as well (see
        :meth:`_succeeded`).
        """
        started = time.monotonic()
        lease = lock.lease
        owner = lock._blocked_owner
        # A retry behind an execution of an earlier delivery of its message (the
        # one that sent it, running on after ``self.retry(throw=False)``) waits for
        # it however long it runs: a hold no longer renewed expires within its TTL.
        # So does a message an execution's body sent under its own id (its
        # replacement, a send of that id), named by its header.
        # Never for a hold of an execution on this thread: this delivery runs
        # nested in it (sent eagerly from its body), which cannot end meanwhile.
        nested = owner is not None and owner in _held_on_this_thread()
        behind_sender = not nested and (
            (
                queued_retries(owner, lease or "") is None
                and hold_retries(owner, lease or "") < request_retries(request)
            )
            or (owner is not None and owner == request_sender(request))
        )
        limit = None if behind_sender else max(0, lock._pttl) / 1000 + REDELIVERY_GRACE
        _send(
            signals.lock_conflict, self, name, task_id=lock.lease, holder=lock.lease,
            action="redelivered",
        )  # fmt: skip
        # A delivery of the same message running in this process is alive: no need
        # to wait and see. (A retry waits for the execution that sent it to end.)
        here = nested or (
            not behind_sender
            and _running_here.get(owner or "") == _process.pid
            and hold_retries(owner, lease or "") == request_retries(request)
        )
        if not here and not self._superseded(lock, request):
            logger.info(
                "%s[%s]: an earlier delivery of this message holds lock %s; waiting %s for "
                "it to end",
                self.name,
                request.id,
                name,
                "as long as it runs" if limit is None else f"up to {limit:.1f} s",
            )

            passed: list[bool] = []

            def stop() -> bool:
                # No longer the earlier delivery's hold: another owner's (a task's,
                # or a lock's without a lease), or a retry's reservation. (Not
                # taken: freed for the waiters a release woke.)
                taken = lock._blocked_taken and lock.blocked_by != lease
                if taken or self._superseded(lock, request):
                    return True
                holder = lock._blocked_owner
                if (
                    behind_sender
                    and holder is not None
                    and holder != owner
                    and queued_retries(holder, lease or "") is None
                ):
                    # The sender's hold passed to another delivery of this message
                    # (a copy of it that took the hand-over first): no longer one
                    # to wait for however long it runs.
                    passed.append(True)
                    return True
                return False

            try:
                acquired = lock._acquire(True, limit, stop=stop)
            except Exception as exc:
                if behind_sender and not lock.holding:
                    # (A soft time limit, the store out of reach.)
                    self._ended_behind_sender(name, request, opts, exc)
                raise
            if acquired:
                if (
                    not behind_sender
                    and hold_retries(owner, lease or "") == request_retries(request)
                    and self._succeeded(request)
                ):
                    logger.info(
                        "%s[%s] dropped: an earlier delivery of this message succeeded "
                        "while it waited (worker_deduplicate_successful_tasks)",
                        self.name,
                        request.id,
                    )
                    raise Ignore()
                waiting.append(started)
                return None
            if passed and lock.blocked_by == lease:
                # Met as a copy of the delivery that now holds it.
                return self._redelivered(lock, name, request, opts, waiting)
        if self._superseded(lock, request):
            logger.info(
                "%s[%s] dropped: this message was sent again as its retry %d, which holds lock %s",
                self.name,
                request.id,
                hold_retries(lock._blocked_owner, lease),
                name,
            )
            raise Ignore()
        if lock.blocked_by != lease:
            # Freed by the earlier delivery and taken by another task meanwhile.
            return self._conflict(lock, name, request, opts, waiting)
        logger.warning(
            "%s[%s] dropped: this message was delivered again while an earlier delivery, "
            "still renewing lock %s, runs it",
            self.name,
            request.id,
            name,
        )
        raise Ignore()

    def _free_message(
        self, request: Any, name: str, opts: LockOptions, drop: str | None = None
    ) -> bool:
        """Free lock ``name`` (under ``opts``, the options of the message's call) if
        ``request``'s message, which ends without running,
        still owns it by its reservation (:func:`free_queued`: never an
        execution's hold); return whether it did. For an ``until_executed``
        message whose reservation is not there yet (the execution that sent it
        from its body still runs), leave that execution word to free it as it
        ends instead (:func:`free_dropped`; ``drop``: the delivery's id, see
        :func:`~celery_redislock.dropped.drop_id`).

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        retries = request_retries(request)
        if opts.strategy == UNTIL_EXECUTED:
            return free_dropped(
                self.lock_client, name, request.id, opts.prefix, retries, opts.enqueue_ttl,
                drop, request_sender(request),
            )  # fmt: skip
        return free_queued(self.lock_client, name, request.id, opts.prefix, retries)

    def _ended_behind_sender(
        self, name: str, request: Any, opts: LockOptions, exc: Exception
    ) -> None:
        """Leave word for the execution this delivery waited behind (the one that
        sent its message from its body: its retry, or a send of its own task id),
        whose wait ended in ``exc`` (a soft time limit fired, the lock store out of
        reach) with nothing held: the delivery ends without running, as one whose
        ``before_start`` raised, and that execution frees lock ``name`` as it ends
        rather than hand it to a reservation nobody takes over (see
        :func:`free_dropped`); a reservation it was handed meanwhile is freed
        here. ``until_executed`` only: no other strategy hands a hold to its
        message. Never raises: word that cannot be left (the store still out of
        reach) leaves the lock to that reservation's TTL, logged."""
        if opts.strategy != UNTIL_EXECUTED or request.is_eager:
            return
        try:
            self._free_message(request, name, opts)
        except Exception as error:
            logger.warning(
                "%s[%s] ended without running (%s) while the execution that sent it ran; "
                "could not leave it word to free lock %s as it ends (the lock may stay "
                "reserved for this message until lock_enqueue_ttl, or free it with "
                "`celery redislock release`): %s",
                self.name,
                request.id,
                type(exc).__name__,
                name,
                error,
            )

    def _succeeded(self, request: Any) -> bool:
        """Whether Celery's ``worker_deduplicate_successful_tasks`` applies to this
        task (``acks_late``, a persistent result backend) and the execution of
        ``request`` has succeeded already. Celery skips a message its broker marks
        redelivered that way, before it starts; a copy found waiting behind its own
        message's first delivery is skipped so once that has ended, whether or not
        its broker marked it."""
        app = self.app
        if not (
            (app.conf.task_acks_late or self.acks_late)
            and app.conf.worker_deduplicate_successful_tasks
            and getattr(self.backend, "persistent", False)
        ):
            return False
        try:
            return bool(self.AsyncResult(request.id).state == SUCCESS)
        except Exception as exc:
            logger.warning("could not read the state of %s[%s]: %s", self.name, request.id, exc)
            return False

    @staticmethod
    def _superseded(lock: RedisLock, request: Any) -> bool:
        """Whether the hold of ``lock``'s lease its last try found is a later retry's
        of the message (its reservation, or its execution) than ``request``'s: not
        the hold of the execution that sent ``request``'s message (a task with
        retries that replaced itself sent its replacement with none)."""
        if lock._blocked_owner is None or lock._blocked_owner == request_sender(request):
            return False
        return hold_retries(lock._blocked_owner, lock.lease or "") > request_retries(request)

    def _conflict(
        self, lock: RedisLock, key: str, request: Any, opts: LockOptions, waiting: list[float]
    ) -> Any:
        """Handle a held lock; return a result to end the task, or ``None`` once acquired
        (after waiting for it: when the wait began is added to ``waiting``)."""
        mode = opts.on_conflict
        if mode == "wait":
            started = self._wait_begins(lock, key, request, opts)
            waiting.append(started)
            self._waited(
                lock, key, request, opts, started, lock.acquire(blocking=True, timeout=opts.wait)
            )
            return None
        holder = lock.blocked_by
        _send(signals.lock_conflict, self, key, task_id=request.id, holder=holder, action=mode)
        if mode == "raise":
            logger.info(
                "%s[%s] raises LockConflictError: lock %s held by %s",
                self.name,
                request.id,
                key,
                holder,
            )
            raise LockConflictError(key, holder)
        if mode == "retry":
            countdown = retry_countdown(opts.retry_delay, request.retries or 0)
            logger.info(
                "%s[%s] retries in %.1f s: lock %s held by %s",
                self.name,
                request.id,
                countdown,
                key,
                holder,
            )
            unlocked: dict[str, Any] = {_NO_ENQUEUE_LOCK: True}
            raise self.retry(exc=LockConflictError(key, holder), countdown=countdown, **unlocked)
        if request.callbacks or request.errbacks or request.chain or request.chord:
            logger.info(
                "%s[%s] skipped inside a workflow: lock %s held by %s",
                self.name,
                request.id,
                key,
                holder,
            )
            raise TaskSkippedError(
                key,
                holder,
                f"lock {key!r} is held by task {holder!r}: this duplicate was skipped, "
                "so what follows it (its chain, chord or callbacks) does not run",
            )
        logger.info("%s[%s] skipped: lock %s held by %s", self.name, request.id, key, holder)
        return skipped_result(key, holder)


def _release_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Free what the message of a revoked task still holds while queued: its
    reservation (:func:`free_queued`), never an execution's hold.

    A hold of its lease under another owner is an execution's: of another delivery
    of the message (the broker delivered it again), which Celery lets finish, or of
    this one, terminated while it runs (``revoke(terminate=True)``). Celery sends
    ``task_revoked`` for a terminate as it sends the signal, while the task may
    still run: a prefork child ends on ``SIGTERM`` by raising ``SystemExit`` in the
    task, whose ``finally`` then runs, and a signal may be ignored. The task
    releases its lock as it ends; the hold of a pool process that dies with it is
    freed by the worker once the process is gone (:mod:`celery_redislock.early`).
    """
    if not isinstance(sender, SingletonTask) or request is None or not request.id:
        return
    try:
        name = sender._message_name(request, request.args, request.kwargs)
        # (A revoke sweep of the request left the same drop id: counted once.)
        sender._free_message(request, name, sender.lock_options, drop_id(request))
    except Exception as exc:  # a signal handler must not break the worker
        logger.warning("could not free the lock of revoked task %s: %s", request.id, exc)


celery_signals.task_revoked.connect(_release_revoked, weak=False)


def _metrics_at_worker_start(sender: Any = None, **_: Any) -> None:
    """Turn on :mod:`celery_redislock.metrics` in a worker whose app sets
    ``redislock_metrics = True``: in its main process at ``worker_init`` (the
    prefork children inherit it) and in each pool child at ``worker_process_init``."""
    from celery import current_app

    app = getattr(sender, "app", None) or current_app
    if app.conf.get("redislock_metrics"):
        from celery_redislock import metrics

        metrics.enable()


def _ahead_in_pool_process(**_: Any) -> None:
    """Have this prefork pool process write each task's acquire as it is handed
    the task (:func:`celery_redislock.early.trace_ahead`)."""
    from celery import current_app

    from celery_redislock.early import trace_ahead

    try:
        trace_ahead(current_app)
    except Exception as exc:  # a signal handler must not break the worker
        logger.warning(
            "celery_redislock: this pool process writes no acquire ahead (its tasks "
            "acquire as they start): %s",
            exc,
        )


def _flush_at_child_exit(**_: Any) -> None:
    """Read the answers a prefork pool child still owes (the releases it wrote
    without waiting), and send the releases it retries in the background, before
    it exits: it ends with ``os._exit``, which skips the ``atexit`` hook that does
    it in other processes."""
    try:
        flush(final=True)
    except Exception as exc:  # a signal handler must not break the worker
        logger.warning("could not read the last answers of the lock store: %s", exc)


celery_signals.worker_process_shutdown.connect(_flush_at_child_exit, weak=False)
celery_signals.worker_init.connect(_metrics_at_worker_start, weak=False)
celery_signals.worker_process_init.connect(_metrics_at_worker_start, weak=False)
celery_signals.worker_process_init.connect(_ahead_in_pool_process, weak=False)


def _shown(text: str) -> str:
    """``text`` as a lock's holder description can hold it (see
    :func:`~celery_redislock.lock.check_holder_info`)."""
    return text.replace(SEPARATOR, " ")[:MAX_INFO_LENGTH]


def _no_report(outcome: object) -> None:
    """A release's answer that needs no word (see :meth:`RedisLock.release`)."""
