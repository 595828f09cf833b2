"""The seckill example's Celery app, configured from the environment.

=================  ==========================================================
``REDIS_URL``      broker, result backend and lock store
                   (default ``redis://127.0.0.1:6379/0``)
``BROKER_URL``     overrides the broker
``RESULT_BACKEND`` overrides the result backend
``REDISLOCK_URL``  overrides the lock store, which also holds the inventory
=================  ==========================================================

Run a worker with ``celery -A example_worker.app worker`` or
``python -m example_worker --worker``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from celery import Celery

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

#: The queue workers consume when started (each batch gets a queue of its own).
DEFAULT_QUEUE = "seckill"


def settings_from_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The URL settings for ``environ``: ``REDIS_URL`` plus the per-role overrides."""
    redis_url = environ.get("REDIS_URL") or DEFAULT_REDIS_URL
    return {
        "broker_url": environ.get("BROKER_URL") or redis_url,
        "result_backend": environ.get("RESULT_BACKEND") or redis_url,
        "redislock_url": environ.get("REDISLOCK_URL") or redis_url,
    }


app = Celery("example_worker", include=["example_worker.tasks"])
app.conf.update(
    settings_from_env(os.environ),
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=3600,
    task_default_queue=DEFAULT_QUEUE,
    # One message at a time per worker process, so the batch spreads over the
    # workers the way it would over separate machines.
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)
