"""The exceptions raised by celery_redislock.

Every error this package raises on purpose derives from :class:`LockError`, so
one ``except LockError`` catches them all::

    LockError
    ├── LockNotOwnedError        release/extend of a lock this owner does not hold
    │   └── LockLostError        a held lock expired or was taken over while in use
    ├── LockTimeoutError         a blocking acquire gave up after its timeout
    ├── LockConflictError        a singleton task found its lock held (on_conflict="raise"/"wait")
    │   ├── TaskSkippedError     a duplicate was skipped inside a chain or chord
    │   └── DuplicateTaskError   an until_* task sent while its lock was held (on_duplicate="raise")
    ├── LockBackendError         Redis could not be reached or answered with an error
    ├── KeyDerivationError       the task's arguments cannot be turned into a lock key
    ├── NoLockError              a task body asked for a lock (or its token) it does not have
    ├── ServerNotFoundError      no Redis-compatible server binary for the embedded helper
    └── TaskOptionError          a SingletonTask's option (or the setting it takes) is bad or
                                 misspelt; also a ``TypeError`` and a ``ValueError``

Other bad arguments (a negative TTL given to ``RedisLock``, a bad per-call
``lock_options`` value) raise the built-in ``ValueError``/``TypeError`` naming
the argument: they are programming errors, not lock outcomes, and the caller's
own line is in the traceback.
"""

from __future__ import annotations


class LockError(Exception):
    """Base class of every error raised by celery_redislock."""


class _StructuredError(LockError):
    """An error whose constructor arguments are kept in ``args``.

    Celery stores a failed task's exception as its class and ``args`` and rebuilds
    it with ``cls(*args)`` on the client; keeping every constructor argument in
    ``args`` (and the message last) makes that round trip exact.
    """

    def __str__(self) -> str:
        return str(self.args[-1])


class LockNotOwnedError(_StructuredError):
    """The lock is not held by this owner, so it cannot be released or extended.

    Nothing was changed in Redis. ``name`` is the lock's name.
    """

    def __init__(self, name: str, message: str | None = None) -> None:
        self.name = name
        super().__init__(
            name,
            message
            or f"lock {name!r} is not held by this owner: it expired or another owner took it "
            "(raise the TTL, or keep the heartbeat on, if the work outlives it)",
        )


class LockLostError(LockNotOwnedError):
    """A lock that was held has been lost: it expired or another owner took it over."""

    def __init__(self, name: str, message: str | None = None) -> None:
        super().__init__(
            name,
            message
            or f"lock {name!r} was lost while held: it expired before it could be "
            "renewed, or was freed or taken over by another owner (an operator's "
            "force release, say); stop touching the protected resource",
        )


class LockTimeoutError(_StructuredError):
    """A blocking acquire did not get the lock before its timeout."""

    def __init__(self, name: str, timeout: float | None, message: str | None = None) -> None:
        self.name = name
        self.timeout = timeout
        super().__init__(
            name, timeout, message or f"could not acquire lock {name!r} within {timeout} s"
        )


class LockConflictError(_StructuredError):
    """A singleton task found its lock held by another task.

    ``name`` is the lock name and ``holder`` the task id that holds it (``None``
    if the holder is not a task or could not be read). ``key`` is the same as
    ``name``, kept for code written before the lock name was called a name.
    """

    def __init__(self, name: str, holder: str | None, message: str | None = None) -> None:
        self.name = name
        self.holder = holder
        super().__init__(
            name,
            holder,
            message or f"lock {name!r} is held by task {holder!r}; this duplicate did not run",
        )

    @property
    def key(self) -> str:
        """The lock name (an older spelling of :attr:`name`)."""
        return self.name


class DuplicateTaskError(LockConflictError):
    """An ``until_*`` task was sent while its lock was held, with ``on_duplicate="raise"``.

    Nothing was sent. ``holder`` is the id of the task that holds the lock (the one
    already queued or running), ``name`` the lock name.
    """

    def __init__(self, name: str, holder: str | None, message: str | None = None) -> None:
        super().__init__(
            name,
            holder,
            message
            or f"lock {name!r} is held by task {holder!r}: this duplicate was not sent "
            "(AsyncResult(exc.holder) follows the one that was)",
        )


class TaskSkippedError(LockConflictError):
    """A duplicate was skipped (``on_conflict="skip"``) while part of a chain or chord.

    Raised instead of returning a skip marker so the rest of the workflow does not
    run with a result it did not expect; the workflow's error callbacks run.
    """


class LockBackendError(LockError):
    """Redis could not be reached, or answered with an error, while locking."""


class KeyDerivationError(LockError, TypeError):
    """The task's arguments cannot be serialised into a lock key."""


class NoLockError(LockError):
    """A task body asked for its lock, or its fencing token, and has none.

    ``self.lock`` outside a locked execution (a plain call, an
    ``until_executing`` task, whose lock is gone once the body starts), or
    ``self.lock.fence`` in a body that runs unlocked because the lock store was
    unreachable (``lock_on_redis_error="run"``).
    """


class ServerNotFoundError(LockError):
    """No Redis-compatible server binary was found for the embedded server helper."""


class TaskOptionError(_StructuredError, TypeError, ValueError):
    """A :class:`~celery_redislock.SingletonTask` task's option, or the ``app.conf``
    setting it takes, is invalid, or a keyword given to the task is a misspelt option.

    Raised when Celery makes the task, which for an app not yet finalized is
    when the app finalizes (a worker starting, say), far from the task's
    definition: so the message names the task (its Celery name, and the
    function's ``module:qualname`` and source line when known), the option or
    setting, and what to change. ``task_name`` is the task's Celery name,
    ``option`` the option (``"on_conflict"``) or setting
    (``"app.conf.redislock_ttl"``) at fault.

    It is both a ``TypeError`` and a ``ValueError``, the built-in errors these
    problems raised before this class existed, so ``except ValueError`` (or
    ``TypeError``) around a task's definition still catches it.
    """

    def __init__(self, task_name: str | None, option: str, message: str) -> None:
        self.task_name = task_name
        self.option = option
        super().__init__(task_name, option, message)
