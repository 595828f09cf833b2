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

Every option is a task attribute (settable in ``@app.task(...)``) whose default
comes from ``app.conf.redislock_<option>``; values are checked when the task is
bound to its app, and a bad one raises ``ValueError``/``TypeError`` naming it.

How each way a task can end is handled (``while_executing``; the other
strategies keep the lock where noted):

=====================================  ==========================================
success, exception, soft time limit    released in the body's ``finally``
``self.retry()``                       released; ``until_executed`` hands it to the
                                       queued retry (same task id), TTL covering
                                       the countdown
``Ignore``, ``Reject``                 released (``Reject(requeue=True)`` keeps an
                                       ``until_executed`` lock for the redelivery)
revoked while queued or terminated     released by the worker's ``task_revoked``
                                       handler, by task id
hard time limit, SIGKILL, lost worker  the heartbeat dies with the process and the
                                       TTL frees the lock
=====================================  ==========================================
"""

from __future__ import annotations

import inspect
import logging
import random
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from typing import Any, ClassVar

import redis
from celery import Task
from celery import signals as celery_signals
from celery.exceptions import Reject, Retry
from celery.result import AsyncResult
from celery.utils import uuid

from celery_redislock import signals
from celery_redislock.client import get_client
from celery_redislock.errors import (
    LockBackendError,
    LockConflictError,
    LockLostError,
    TaskSkippedError,
)
from celery_redislock.keys import KeyBuilder, KeySource
from celery_redislock.lock import DEFAULT_PREFIX, RedisLock, check_ttl, release_lease

logger = logging.getLogger(__name__)

WHILE_EXECUTING = "while_executing"
UNTIL_EXECUTED = "until_executed"
UNTIL_EXECUTING = "until_executing"
STRATEGIES = (WHILE_EXECUTING, UNTIL_EXECUTED, UNTIL_EXECUTING)
CONFLICT_MODES = ("skip", "raise", "retry", "wait")
REDIS_ERROR_MODES = ("fail", "run")

#: ``option name -> (app.conf setting, default)``.
DEFAULTS: dict[str, tuple[str, Any]] = {
    "lock_url": ("redislock_url", None),
    "lock_ttl": ("redislock_ttl", 60.0),
    "lock_enqueue_ttl": ("redislock_enqueue_ttl", 3600.0),
    "lock_strategy": ("redislock_strategy", WHILE_EXECUTING),
    "on_conflict": ("redislock_on_conflict", "skip"),
    "lock_wait": ("redislock_wait", 30.0),
    "lock_retry_delay": ("redislock_retry_delay", 1.0),
    "lock_on_redis_error": ("redislock_on_redis_error", "fail"),
    "lock_prefix": ("redislock_prefix", DEFAULT_PREFIX),
}

#: Highest countdown, in seconds, of an ``on_conflict="retry"`` re-queue.
MAX_RETRY_DELAY = 300.0

#: ``apply_async`` option that re-queues without taking the enqueue-time lock.
_NO_ENQUEUE_LOCK = "redislock_no_enqueue_lock"


def skipped_result(key: str, holder: str | None) -> dict[str, Any]:
    """The result a duplicate returns with ``on_conflict="skip"``."""
    return {"skipped": True, "lock_key": key, "holder": holder}


def is_skipped(result: object) -> bool:
    """Whether a task result is the marker of a skipped duplicate."""
    return isinstance(result, dict) and result.get("skipped") is True and "lock_key" in result


class LockHandle:
    """The lock of one task execution, as seen from inside the task body.

    Available as ``self.lock`` in a bound task (``bind=True``) while it runs;
    it lives on the request context, so every execution (and every thread of
    the threads pool) sees its own.
    """

    def __init__(self, key: str, lock: RedisLock | None) -> None:
        #: The lock name (``<task name>:<digest>``).
        self.key = key
        self._lock = lock

    @property
    def token(self) -> int | None:
        """The fencing token: pass it to the resource you protect and let it reject
        writes carrying a smaller token than one it has seen."""
        return self._lock.token if self._lock is not None else None

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
            raise LockLostError(self.key)


def _check_choice(name: str, value: object, choices: Iterable[str]) -> str:
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return str(value)


def _check_options(opts: Mapping[str, Any], source: Callable[[str], str]) -> None:
    """Validate resolved options; ``source(option)`` names where a value came from."""
    check_ttl(opts["lock_ttl"], source("lock_ttl"))
    check_ttl(opts["lock_enqueue_ttl"], source("lock_enqueue_ttl"))
    check_ttl(opts["lock_wait"], source("lock_wait"))
    check_ttl(opts["lock_retry_delay"], source("lock_retry_delay"))
    _check_choice(source("lock_strategy"), opts["lock_strategy"], STRATEGIES)
    _check_choice(source("on_conflict"), opts["on_conflict"], CONFLICT_MODES)
    _check_choice(source("lock_on_redis_error"), opts["lock_on_redis_error"], REDIS_ERROR_MODES)
    url = opts["lock_url"]
    if url is not None and not isinstance(url, str):
        raise TypeError(f"{source('lock_url')} must be a redis:// URL string")
    prefix = opts["lock_prefix"]
    if not isinstance(prefix, str) or not prefix:
        raise ValueError(f"{source('lock_prefix')} must be a non-empty string")


def lock_store_url(app: Any) -> str:
    """The lock store of ``app``: ``redislock_url``, else the broker URL if it is Redis.

    Raises:
        ValueError: neither is a Redis URL; the message says what to set.
    """
    url = app.conf.get("redislock_url")
    if url:
        return str(url)
    broker = app.conf.broker_url or ""
    if not broker.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            "no Redis URL for the locks: set app.conf.redislock_url (or the task's "
            f"lock_url); the broker URL {broker!r} is not a Redis URL"
        )
    return str(broker)


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


class SingletonTask(Task):  # type: ignore[misc]
    """A task that runs at most once at a time per lock key.

    Options are the class attributes below; each left as ``None`` takes its
    ``app.conf.redislock_*`` setting (or the built-in default) when the task is
    bound, except the lock store's URL, which is read from ``app.conf`` at use so
    that configuring the app after defining its tasks works.
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
    lock_ttl: ClassVar[float | None] = None
    #: ``until_*`` strategies: seconds the lock taken at enqueue lives while the
    #: message waits in the queue (plus any countdown); nothing renews it there.
    lock_enqueue_ttl: ClassVar[float | None] = None
    #: ``"while_executing"``, ``"until_executed"`` or ``"until_executing"``.
    lock_strategy: ClassVar[str | None] = None
    #: What a duplicate does at execution: ``"skip"``, ``"raise"``, ``"retry"``, ``"wait"``.
    on_conflict: ClassVar[str | None] = None
    #: Seconds ``on_conflict="wait"`` waits before failing like ``"raise"``.
    lock_wait: ClassVar[float | None] = None
    #: Base countdown of ``on_conflict="retry"`` (doubled per retry, jittered).
    lock_retry_delay: ClassVar[float | None] = None
    #: ``"fail"``: no body runs unlocked when Redis is away; ``"run"``: run anyway, logged.
    lock_on_redis_error: ClassVar[str | None] = None
    #: Prefix of the lock keys in Redis.
    lock_prefix: ClassVar[str | None] = None

    _key_builder: ClassVar[KeyBuilder | None] = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Resolve options from ``app.conf`` and check them (a bad value raises here)."""
        super().on_bound(app)
        explicit = {name for name in DEFAULTS if getattr(cls, name) is not None}
        resolved = {}
        for name, (setting, default) in DEFAULTS.items():
            value = getattr(cls, name) if name in explicit else app.conf.get(setting)
            resolved[name] = default if value is None else value

        def source(name: str) -> str:
            return name if name in explicit else f"app.conf.{DEFAULTS[name][0]}"

        _check_options(resolved, source)
        for name, value in resolved.items():
            if name != "lock_url":
                setattr(cls, name, value)
        if cls.lock_on is not None:
            if isinstance(cls.lock_on, str) or not all(isinstance(n, str) for n in cls.lock_on):
                raise TypeError("lock_on must be a tuple of parameter names, e.g. ('event_id',)")
            cls.lock_on = tuple(cls.lock_on)
        if cls.lock_key is not None and not (
            isinstance(cls.lock_key, str) or callable(cls.lock_key)
        ):
            raise TypeError("lock_key must be a string or a callable returning the key material")
        if cls.name:
            cls._key_builder = cls._make_key_builder(cls.name)

    @classmethod
    def _make_key_builder(cls, name: str) -> KeyBuilder:
        # Read lock_key off the class without binding it: a function stored as a
        # class attribute must not receive the task as its first argument.
        lock_key = inspect.getattr_static(cls, "lock_key")
        if isinstance(lock_key, staticmethod | classmethod):
            lock_key = lock_key.__get__(None, cls)
        return KeyBuilder(name, _body_signature(cls), lock_on=cls.lock_on, lock_key=lock_key)

    # Configuration helpers.
    @property
    def lock_client(self) -> redis.Redis:
        """The (per-process, shared) client of the lock store."""
        return get_client(self.lock_url or lock_store_url(self.app))

    def lock_name(self, args: Iterable[Any] | None, kwargs: Mapping[str, Any] | None) -> str:
        """The lock name of a call: ``<task name>:<digest of its key material>``."""
        builder = self._key_builder
        if builder is None or builder.task_name != self.name:
            # A class-based task may get its name only on the instance.
            builder = type(self)._key_builder = self._make_key_builder(self.name)
        return builder(args, kwargs)

    def _new_lock(self, key: str, owner: str, ttl: float, heartbeat: bool) -> RedisLock:
        task_id = owner.split(":", 1)[0]
        return RedisLock(
            self.lock_client,
            key,
            ttl=ttl,
            owner=owner,
            lease=task_id,
            heartbeat=heartbeat,
            on_lost=self._on_lost,
            prefix=self.lock_prefix or DEFAULT_PREFIX,
        )

    def _on_lost(self, lock: RedisLock) -> None:
        logger.warning(
            "lock %s of task %s[%s] was lost while it ran; self.lock.check() will raise",
            lock.name,
            self.name,
            lock.lease,
        )
        signals.lock_lost.send(sender=self, task_id=lock.lease, key=lock.name)

    @property
    def lock(self) -> LockHandle | None:
        """The current execution's :class:`LockHandle` (``None`` outside one)."""
        return getattr(self.request, "redislock", None)

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

        A duplicate enqueued while the lock is held publishes nothing and
        returns the holder's ``AsyncResult``.
        """
        skip_lock = options.pop(_NO_ENQUEUE_LOCK, False)
        options.update(producer=producer, link=link, link_error=link_error, shadow=shadow)
        if self.lock_strategy == WHILE_EXECUTING or skip_lock:
            return super().apply_async(args, kwargs, task_id, **options)
        task_id = task_id or uuid()
        key = self.lock_name(args, kwargs)
        delay = _seconds_until(options.get("countdown") or options.get("eta"))
        lock = self._new_lock(
            key, f"{task_id}:queued", float(self.lock_enqueue_ttl or 0) + delay, heartbeat=False
        )
        try:
            acquired = lock.acquire(blocking=False)
        except LockBackendError:
            if self.lock_on_redis_error == "run":
                logger.warning(
                    "lock store unreachable; enqueuing %s[%s] unlocked", self.name, task_id
                )
                return super().apply_async(args, kwargs, task_id, **options)
            raise
        if not acquired:
            holder = lock.blocked_by
            logger.info("%s: duplicate of %s not enqueued (lock %s)", self.name, holder, key)
            signals.lock_conflict.send(
                sender=self, task_id=task_id, key=key, holder=holder, action="dedup"
            )
            if holder:
                return self.AsyncResult(holder)
            raise LockConflictError(key, holder)
        try:
            return super().apply_async(args, kwargs, task_id, **options)
        except BaseException:
            # Nothing was sent: free the key for the next attempt.
            try:
                release_lease(self.lock_client, key, task_id, self.lock_prefix or DEFAULT_PREFIX)
            except LockBackendError as exc:
                logger.warning("could not free %s after a failed send: %s", key, exc)
            raise

    # Execution side.
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            # A plain function call, outside any worker or apply(): no lock.
            return super().__call__(*args, **kwargs)
        return self._run_locked(request, args, kwargs)

    def _run_locked(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        task_id = request.id or uuid()
        key = self.lock_name(args, kwargs)
        prefix = self.lock_prefix or DEFAULT_PREFIX
        if self.lock_strategy == UNTIL_EXECUTING:
            try:
                release_lease(self.lock_client, key, task_id, prefix)
            except LockBackendError:
                if self.lock_on_redis_error != "run":
                    raise
                logger.warning(
                    "lock store unreachable; %s[%s] could not free %s", self.name, task_id, key
                )
            return self.run(*args, **kwargs)

        lock = self._new_lock(
            key, f"{task_id}:{secrets.token_hex(8)}", float(self.lock_ttl or 0), heartbeat=True
        )
        asked = taken = time.monotonic()
        keep = retrying = False
        # One try from the acquire on: an exception raised asynchronously (a soft
        # time limit) just after the lock was taken must not leave it held, and
        # renewed by this process's heartbeat, with nobody to release it.
        try:
            try:
                acquired = lock.acquire(blocking=False)
            except LockBackendError:
                if self.lock_on_redis_error != "run":
                    raise
                logger.warning(
                    "lock store unreachable; running %s[%s] unlocked", self.name, task_id
                )
                request.redislock = LockHandle(key, None)
                return self.run(*args, **kwargs)
            if not acquired:
                outcome = self._conflict(lock, key, request)
                if outcome is not None:
                    return outcome
            request.redislock = LockHandle(key, lock)
            taken = time.monotonic()
            signals.lock_acquired.send(
                sender=self, task_id=task_id, key=key, token=lock.token, waited=taken - asked
            )
            return self.run(*args, **kwargs)
        except Retry:
            # The queued retry (same task id) may already have taken the lock over.
            retrying = True
            keep = self.lock_strategy == UNTIL_EXECUTED
            raise
        except Reject as exc:
            keep = self.lock_strategy == UNTIL_EXECUTED and bool(exc.requeue)
            raise
        finally:
            if lock.holding and keep:
                lock.detach()
            elif lock.holding:
                self._release(lock, taken_over_ok=retrying)
                signals.lock_released.send(
                    sender=self, task_id=task_id, key=key, held=time.monotonic() - taken
                )

    def _release(self, lock: RedisLock, taken_over_ok: bool = False) -> None:
        try:
            lock.release()
        except LockLostError:
            if not taken_over_ok:
                logger.warning(
                    "lock %s of %s[%s] was lost before the task ended",
                    lock.name,
                    self.name,
                    lock.lease,
                )
        except LockBackendError as exc:
            logger.warning(
                "could not release lock %s (it will expire by its TTL): %s", lock.name, exc
            )

    def _conflict(self, lock: RedisLock, key: str, request: Any) -> Any:
        """Handle a held lock; return a result to end the task, or ``None`` once acquired."""
        mode = self.on_conflict
        holder = lock.blocked_by
        signals.lock_conflict.send(
            sender=self, task_id=request.id, key=key, holder=holder, action=mode
        )
        if mode == "wait":
            if lock.acquire(blocking=True, timeout=self.lock_wait):
                return None
            holder = lock.blocked_by
            raise LockConflictError(
                key,
                holder,
                f"lock {key!r} is still held by task {holder!r} after waiting {self.lock_wait} s",
            )
        if mode == "raise":
            raise LockConflictError(key, holder)
        if mode == "retry":
            base = float(self.lock_retry_delay or 1.0)
            countdown = min(MAX_RETRY_DELAY, base * 2 ** (request.retries or 0))
            countdown *= random.uniform(0.5, 1.5)
            raise self.retry(
                exc=LockConflictError(key, holder),
                countdown=countdown,
                **{_NO_ENQUEUE_LOCK: True},
            )
        if request.callbacks or request.chain or request.chord:
            raise TaskSkippedError(
                key,
                holder,
                f"lock {key!r} is held by task {holder!r}: this duplicate was skipped, "
                "so the rest of its chain/chord does not run",
            )
        logger.info("%s[%s] skipped: lock %s held by %s", self.name, request.id, key, holder)
        return skipped_result(key, holder)


def _release_revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    """Free the lock of a task revoked in the queue or terminated while running."""
    if not isinstance(sender, SingletonTask) or request is None or not request.id:
        return
    try:
        key = sender.lock_name(request.args, request.kwargs)
        release_lease(sender.lock_client, key, request.id, sender.lock_prefix or DEFAULT_PREFIX)
    except Exception as exc:  # a signal handler must not break the worker
        logger.warning("could not free the lock of revoked task %s: %s", request.id, exc)


celery_signals.task_revoked.connect(_release_revoked, weak=False)
