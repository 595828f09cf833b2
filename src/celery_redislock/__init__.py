"""celery_redislock: run a Celery task at most once at a time per key, with a Redis lock.

Quick start::

    from celery import Celery
    from celery_redislock import SingletonTask

    app = Celery("shop", broker="redis://localhost:6379/0")

    @app.task(base=SingletonTask)
    def rebuild_report(account_id, full=False): ...

The lock engine is usable on its own: :class:`RedisLock`.
"""

from __future__ import annotations

from celery_redislock import signals
from celery_redislock.errors import (
    KeyDerivationError,
    LockBackendError,
    LockConflictError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
    ServerNotFoundError,
    TaskSkippedError,
)
from celery_redislock.lock import RedisLock
from celery_redislock.server import RedisServer
from celery_redislock.task import LockHandle, SingletonTask, is_skipped

__version__ = "0.1.0"

__all__ = [
    "KeyDerivationError",
    "LockBackendError",
    "LockConflictError",
    "LockError",
    "LockHandle",
    "LockLostError",
    "LockNotOwnedError",
    "LockTimeoutError",
    "RedisLock",
    "RedisServer",
    "ServerNotFoundError",
    "SingletonTask",
    "TaskSkippedError",
    "__version__",
    "is_skipped",
    "signals",
]
