"""Prometheus metrics for SingletonTask locks, made from :mod:`celery_redislock.signals`.

Needs the ``prometheus`` extra (``pip install "celery_redislock[prometheus]"``).
Turn it on in a worker with one call, or with a setting read at worker start::

    from celery_redislock import metrics
    metrics.enable()                     # into prometheus_client's default REGISTRY

    app.conf.redislock_metrics = True    # the same, done by every worker of the app

and expose them as any prometheus_client metric (``metrics.serve(9808)`` starts
prometheus_client's HTTP server with the right registry).

Metrics (label ``task`` is the task name):

==========================================  =========  =====================================
``celery_redislock_acquired_total``         counter    locks taken by tasks
``celery_redislock_conflicts_total``        counter    duplicates that met a held lock, by
                                                       ``action``: skip, raise, retry, wait, dedup,
                                                       redelivered
``celery_redislock_wait_seconds``           histogram  time a task waited for its lock (0 when free)
``celery_redislock_hold_seconds``           histogram  time a task held its lock: from the
                                                       acquire to the release (a lock lost
                                                       meanwhile counts to the release)
``celery_redislock_releases_total``         counter    releases by ``outcome``: released, lost
                                                       (expired or taken over first), failed
                                                       (no answer: left to its TTL)
``celery_redislock_lost_total``             counter    locks a running task lost (heartbeat)
``celery_redislock_heartbeat_total``        counter    renewals by ``result``: renewed, failed
                                                       (no answer), lost; label ``server``
                                                       (``sentinel:<service>`` for a Sentinel-
                                                       managed one, through failovers)
``celery_redislock_unavailable_total``      counter    tasks whose lock store failed as they
                                                       asked for their lock, by ``action``: fail,
                                                       run (without the lock)
==========================================  =========  =====================================

**Prefork workers.** Tasks run in pool child processes, each with metrics of its
own. Use prometheus_client's multiprocess mode: set ``PROMETHEUS_MULTIPROC_DIR``
to an empty directory in the worker's environment (before it starts, so before
prometheus_client is imported), and serve from the worker's main process with
:func:`serve`, which then reads every child's values from that directory. The
threads, solo, gevent and eventlet pools run tasks in one process and need none
of this.
"""

from __future__ import annotations

import os
import threading
from typing import Any

try:
    from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
    from prometheus_client import start_http_server as _start_http_server
    from prometheus_client.multiprocess import MultiProcessCollector
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        "celery_redislock.metrics needs prometheus-client: "
        'pip install "celery_redislock[prometheus]"'
    ) from exc

from celery_redislock import signals

__all__ = ["LockMetrics", "enable", "serve"]

#: Buckets of the wait histogram, in seconds (waits are bounded by ``lock_wait``).
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
#: Buckets of the hold histogram, in seconds (tasks run from milliseconds to hours).
HOLD_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 1800, 3600, 14400)


def _task_name(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "unknown")


class LockMetrics:
    """The metrics of one registry, fed by the lock signals while connected."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.acquired = Counter(
            "celery_redislock_acquired",
            "Locks taken by SingletonTask executions.",
            ["task"],
            registry=registry,
        )
        self.conflicts = Counter(
            "celery_redislock_conflicts",
            "Executions or enqueues that found their lock held, by what they did.",
            ["task", "action"],
            registry=registry,
        )
        self.wait = Histogram(
            "celery_redislock_wait_seconds",
            "Seconds a task waited for its lock before taking it (0 when it was free).",
            ["task"],
            buckets=WAIT_BUCKETS,
            registry=registry,
        )
        self.hold = Histogram(
            "celery_redislock_hold_seconds",
            "Seconds a task held its lock.",
            ["task"],
            buckets=HOLD_BUCKETS,
            registry=registry,
        )
        self.releases = Counter(
            "celery_redislock_releases",
            "Releases at the end of a task, by outcome: released, lost, failed.",
            ["task", "outcome"],
            registry=registry,
        )
        self.lost = Counter(
            "celery_redislock_lost",
            "Locks lost by running tasks (expired or taken over), found by the heartbeat.",
            ["task"],
            registry=registry,
        )
        self.unavailable = Counter(
            "celery_redislock_unavailable",
            "Tasks whose lock store failed as they asked for their lock, by what they did.",
            ["task", "action"],
            registry=registry,
        )
        self._uid = f"celery_redislock.metrics:{id(self)}"
        self.heartbeat = Counter(
            "celery_redislock_heartbeat",
            "Heartbeat renewals by result: renewed, failed (no answer), lost.",
            ["server", "result"],
            registry=registry,
        )
        self.connect()

    # Receivers (a failing one is logged by the signal's dispatcher).
    def _on_acquired(self, sender: Any = None, waited: float = 0.0, **_: Any) -> None:
        task = _task_name(sender)
        self.acquired.labels(task).inc()
        self.wait.labels(task).observe(max(0.0, float(waited)))

    def _on_conflict(self, sender: Any = None, action: str = "unknown", **_: Any) -> None:
        self.conflicts.labels(_task_name(sender), str(action)).inc()

    def _on_released(
        self, sender: Any = None, held: float = 0.0, outcome: str = "released", **_: Any
    ) -> None:
        task = _task_name(sender)
        self.releases.labels(task, str(outcome)).inc()
        self.hold.labels(task).observe(max(0.0, float(held)))

    def _on_heartbeat(
        self, sender: Any = None, renewed: int = 0, failed: int = 0, lost: int = 0, **_: Any
    ) -> None:
        for result, count in (("renewed", renewed), ("failed", failed), ("lost", lost)):
            if count:
                self.heartbeat.labels(str(sender), result).inc(count)

    def _on_lost(self, sender: Any = None, **_: Any) -> None:
        self.lost.labels(_task_name(sender)).inc()

    def _on_unavailable(self, sender: Any = None, action: str = "unknown", **_: Any) -> None:
        self.unavailable.labels(_task_name(sender), str(action)).inc()

    def connect(self) -> None:
        """Start counting (done on creation)."""
        signals.lock_acquired.connect(self._on_acquired, weak=False, dispatch_uid=self._uid)
        signals.lock_conflict.connect(self._on_conflict, weak=False, dispatch_uid=self._uid)
        signals.lock_released.connect(self._on_released, weak=False, dispatch_uid=self._uid)
        signals.lock_lost.connect(self._on_lost, weak=False, dispatch_uid=self._uid)
        signals.heartbeat_round.connect(self._on_heartbeat, weak=False, dispatch_uid=self._uid)
        signals.lock_unavailable.connect(self._on_unavailable, weak=False, dispatch_uid=self._uid)

    def disconnect(self) -> None:
        """Stop counting; the metrics stay in the registry with their values."""
        signals.lock_acquired.disconnect(self._on_acquired, dispatch_uid=self._uid)
        signals.lock_conflict.disconnect(self._on_conflict, dispatch_uid=self._uid)
        signals.lock_released.disconnect(self._on_released, dispatch_uid=self._uid)
        signals.lock_lost.disconnect(self._on_lost, dispatch_uid=self._uid)
        signals.heartbeat_round.disconnect(self._on_heartbeat, dispatch_uid=self._uid)
        signals.lock_unavailable.disconnect(self._on_unavailable, dispatch_uid=self._uid)


_enabled: dict[int, LockMetrics] = {}
_guard = threading.Lock()


def enable(registry: CollectorRegistry | None = None) -> LockMetrics:
    """Count the lock signals of this process into ``registry`` (default:
    prometheus_client's ``REGISTRY``). Calling it again with the same registry
    returns the same :class:`LockMetrics`: it is safe at every worker start."""
    registry = REGISTRY if registry is None else registry
    with _guard:
        metrics = _enabled.get(id(registry))
        if metrics is None or metrics.registry is not registry:
            metrics = _enabled[id(registry)] = LockMetrics(registry)
        return metrics


def serve(port: int, addr: str = "0.0.0.0", registry: CollectorRegistry | None = None) -> None:
    """Serve ``/metrics`` on ``addr:port`` from a background thread of this process.

    Without ``registry``: in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` set)
    the values of every process that wrote to that directory, so call it in a
    prefork worker's main process (at ``worker_init``); otherwise the default
    ``REGISTRY``.
    """
    if registry is None:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        else:
            registry = REGISTRY
    _start_http_server(port, addr=addr, registry=registry)
