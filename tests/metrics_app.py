"""A Celery app for the metrics test: a prefork ``celery worker`` subprocess with
``redislock_metrics = True`` that serves ``/metrics`` from its main process.

The server URL comes from ``REDISLOCK_TEST_URL`` and the metrics port from
``REDISLOCK_TEST_METRICS_PORT``; ``PROMETHEUS_MULTIPROC_DIR`` is set by the test.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import signals as celery_signals

from celery_redislock import SingletonTask
from tests.support import make_app

URL = os.environ.get("REDISLOCK_TEST_URL", "redis://127.0.0.1:6379/0")
app = make_app(URL, "metricsapp")
app.conf.update(redislock_metrics=True, worker_prefetch_multiplier=1)


@celery_signals.worker_init.connect
def serve_metrics(sender: Any = None, **_: Any) -> None:
    """Serve /metrics on 127.0.0.1 from the worker's main process."""
    port = os.environ.get("REDISLOCK_TEST_METRICS_PORT")
    if port:
        from celery_redislock import metrics

        metrics.serve(int(port), addr="127.0.0.1")


@app.task(base=SingletonTask, bind=True, shared=False, name="metricsapp.work")
def work(self: SingletonTask, n: int) -> int:
    """Take the lock of ``n`` and return its fencing token."""
    return self.lock.fence


@app.task(base=SingletonTask, bind=True, shared=False, name="metricsapp.fragile", lock_ttl=1.5)
def fragile(self: SingletonTask, n: int) -> bool:
    """Hold the lock of ``n`` until it is lost (at most 30 s); return whether it was."""
    deadline = time.monotonic() + 30
    while not self.lock.lost and time.monotonic() < deadline:
        time.sleep(0.02)
    return self.lock.lost
