"""celery_redislock: run a Celery task at most once at a time per key, with a Redis lock.

Quick start::

    from celery import Celery
    from celery_redislock import SingletonTask

    app = Celery("shop", broker="redis://localhost:6379/0")

    @app.task(base=SingletonTask)
    def rebuild_report(account_id, full=False): ...

The lock engine is usable on its own: :class:`RedisLock`.

Public names (``__all__``; the tests hold this list and ``__all__`` to each other):

- ``SingletonTask``, ``LockHandle``, ``is_skipped``: the task base class, the
  lock as seen from a task body (``self.lock``), the skipped-duplicate marker test
- ``RedisLock``: the lock engine
- ``LockError``, ``LockNotOwnedError``, ``LockLostError``, ``LockTimeoutError``,
  ``LockConflictError``, ``TaskSkippedError``, ``DuplicateTaskError``, ``LockBackendError``,
  ``KeyDerivationError``, ``NoLockError``, ``ServerNotFoundError``, ``TaskOptionError``:
  the errors
- ``signals``: the Celery-style signals sent around a task's lock
- ``__version__``

Elsewhere, by purpose: :mod:`celery_redislock.admin` (read and repair locks;
``purge_locks``), :mod:`celery_redislock.metrics` (Prometheus),
:mod:`celery_redislock.testing` (the pytest kit), :mod:`celery_redislock.server`
(``RedisServer``, a private server), :mod:`celery_redislock.deployments`.
"""

from __future__ import annotations

from celery_redislock import signals
from celery_redislock.errors import (
    DuplicateTaskError,
    KeyDerivationError,
    LockBackendError,
    LockConflictError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
    NoLockError,
    ServerNotFoundError,
    TaskOptionError,
    TaskSkippedError,
)
from celery_redislock.lock import RedisLock
from celery_redislock.task import LockHandle, SingletonTask, is_skipped

__version__ = "0.1.0"

__all__ = [
    "DuplicateTaskError",
    "KeyDerivationError",
    "LockBackendError",
    "LockConflictError",
    "LockError",
    "LockHandle",
    "LockLostError",
    "LockNotOwnedError",
    "LockTimeoutError",
    "NoLockError",
    "RedisLock",
    "ServerNotFoundError",
    "SingletonTask",
    "TaskOptionError",
    "TaskSkippedError",
    "__version__",
    "is_skipped",
    "signals",
]
