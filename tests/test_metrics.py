"""Prometheus metrics from the lock signals (celery_redislock.metrics)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from celery_redislock import RedisLock, SingletonTask, is_skipped, metrics, signals
from celery_redislock.admin import force_release, read_lock
from celery_redislock.server import RedisServer, free_port
from celery_redislock.testing import hold_lock, run_worker
from celery_redislock.transport import flush
from tests.proxy import FaultProxy
from tests.support import answers_ping, close_app, held, make_app, wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app on the test server (tasks run eagerly through apply())."""
    app = make_app(redislock_server.url, "metrics")
    yield app
    close_app(app)


@pytest.fixture
def registry() -> Iterator[CollectorRegistry]:
    """A private registry the lock signals are counted into during the test."""
    registry = CollectorRegistry()
    counting = metrics.enable(registry)
    yield registry
    counting.disconnect()


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value (0 when it was never recorded)."""
    return registry.get_sample_value(name, labels) or 0.0


def test_signals_become_metrics(
    app: Celery, registry: CollectorRegistry, redislock_client: redis.Redis
) -> None:
    """Acquisitions, conflicts by action, wait and hold times and release outcomes are
    counted per task."""

    @app.task(base=SingletonTask, bind=True, shared=False, name="metrics.job")
    def job(self: SingletonTask, n: int) -> int:
        return self.lock.fence

    for n in range(3):
        job.apply((n,)).get()
    with hold_lock(job, 9):
        assert is_skipped(job.apply((9,)).get())
    wait_for(
        lambda: value(registry, "celery_redislock_hold_seconds_count", task="metrics.job") == 3,
        what="the three releases",
    )
    assert value(registry, "celery_redislock_acquired_total", task="metrics.job") == 3
    assert value(registry, "celery_redislock_wait_seconds_count", task="metrics.job") == 3
    assert (
        value(registry, "celery_redislock_conflicts_total", task="metrics.job", action="skip") == 1
    )
    assert (
        value(registry, "celery_redislock_releases_total", task="metrics.job", outcome="released")
        == 3
    )


def test_lost_lock_is_counted(
    app: Celery, registry: CollectorRegistry, redislock_client: redis.Redis
) -> None:
    """A lock taken from a running task counts as lost, and its release as outcome 'lost'."""

    @app.task(base=SingletonTask, bind=True, shared=False, name="metrics.fragile", lock_ttl=0.6)
    def fragile(self: SingletonTask) -> bool:
        force_release(redislock_client, self.lock.key)
        wait_for(lambda: self.lock.lost, what="the heartbeat to notice")
        return True

    assert fragile.apply().get()
    wait_for(
        lambda: (
            value(
                registry, "celery_redislock_releases_total", task="metrics.fragile", outcome="lost"
            )
            == 1
        ),
        what="the lost release",
    )
    assert value(registry, "celery_redislock_lost_total", task="metrics.fragile") == 1


def test_a_release_that_could_not_be_confirmed_is_counted(
    app: Celery,
    registry: CollectorRegistry,
    redislock_server: RedisServer,
    redislock_client: redis.Redis,
) -> None:
    """A release whose answer never came (the reply lost with its connection) counts as
    outcome 'failed', not 'released'."""
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        app.conf.redislock_url = proxy.url

        @app.task(base=SingletonTask, shared=False, name="metrics.unconfirmed", lock_ttl=3)
        def unconfirmed() -> bool:
            proxy.drop_replies()  # every reply from now on, the release's included
            return True

        assert unconfirmed.apply().get() is True
        wait_for(
            lambda: (
                value(registry, "celery_redislock_hold_seconds_count", task="metrics.unconfirmed")
                == 1
            ),
            what="the release's outcome",
        )
        proxy.heal()
        key = f"redislock:{{{unconfirmed.lock_name((), {})}}}"
        wait_for(lambda: not held(redislock_client, key), what="the lock to be free")
        flush()
    releases = {
        outcome: value(
            registry, "celery_redislock_releases_total", task="metrics.unconfirmed", outcome=outcome
        )
        for outcome in ("released", "lost", "failed")
    }
    assert releases == {"released": 0, "lost": 0, "failed": 1}


def test_a_lock_store_that_fails_is_counted(app: Celery, registry: CollectorRegistry) -> None:
    """A task whose lock store cannot be reached counts as unavailable, by action."""
    app.conf.redislock_url = f"redis://127.0.0.1:{free_port()}/0"
    app.conf.task_store_eager_result = False

    @app.task(base=SingletonTask, shared=False, name="metrics.down", lock_on_redis_error="run")
    def down() -> bool:
        return True

    assert down.apply().get() is True
    assert (
        value(registry, "celery_redislock_unavailable_total", task="metrics.down", action="run")
        == 1
    )


def test_enable_is_idempotent() -> None:
    """Enabling twice on one registry counts each signal once."""
    registry = CollectorRegistry()
    first = metrics.enable(registry)
    assert metrics.enable(registry) is first
    first.disconnect()


def test_setting_enables_metrics_at_worker_start(redislock_server: RedisServer) -> None:
    """app.conf.redislock_metrics = True turns the metrics on when a worker starts."""
    app = make_app(redislock_server.url, "metricsconf")
    app.conf.redislock_metrics = True
    name = f"metricsconf.job_{uuid.uuid4().hex[:8]}"

    @app.task(base=SingletonTask, shared=False, name=name)
    def job() -> None: ...

    with run_worker(app, concurrency=1):
        job.delay().get(timeout=20)
    assert REGISTRY.get_sample_value("celery_redislock_acquired_total", {"task": name}) == 1
    close_app(app)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples served on 127.0.0.1:``port``/metrics, by name and labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@pytest.mark.slow
def test_prefork_worker_serves_the_metrics_of_its_children(
    redislock_server_factory: Any, tmp_path: Path
) -> None:
    """A prefork `celery worker` with redislock_metrics and PROMETHEUS_MULTIPROC_DIR serves,
    from its main process, what its children counted: 3 acquisitions, 1 skipped
    duplicate, 1 lost lock."""
    server = redislock_server_factory()
    port = free_port()
    env = dict(
        os.environ,
        REDISLOCK_TEST_URL=server.url,
        REDISLOCK_TEST_METRICS_PORT=str(port),
        PROMETHEUS_MULTIPROC_DIR=str(tmp_path),
        PYTHONPATH=str(ROOT),
    )
    os.environ["REDISLOCK_TEST_URL"] = server.url
    sys.modules.pop("tests.metrics_app", None)
    import tests.metrics_app as mod

    node = f"metrics-{uuid.uuid4().hex[:6]}@localhost"
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "celery", "-A", "tests.metrics_app", "worker",
            "-P", "prefork", "-c", "2", "-n", node, "-l", "warning",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ],
        cwd=ROOT,
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = server.client()
    try:
        wait_for(
            lambda: worker.poll() is None and answers_ping(mod.app, node),
            timeout=60,
            what="the worker to start",
        )
        for n in range(3):
            mod.work.delay(n).get(timeout=30)
        with hold_lock(mod.work, 7):
            assert is_skipped(mod.work.delay(7).get(timeout=30))
        fragile = mod.fragile.delay(1)
        name = mod.fragile.lock_name((1,), {})
        wait_for(lambda: read_lock(client, name) is not None, what="fragile to hold its lock")
        assert force_release(client, name)
        assert fragile.get(timeout=30) is True

        def key(metric: str, **labels: str) -> tuple[str, tuple[tuple[str, str], ...]]:
            return (metric, tuple(sorted(labels.items())))

        expected = {
            key("celery_redislock_acquired_total", task="metricsapp.work"): 3.0,
            key("celery_redislock_acquired_total", task="metricsapp.fragile"): 1.0,
            key("celery_redislock_conflicts_total", task="metricsapp.work", action="skip"): 1.0,
            key("celery_redislock_wait_seconds_count", task="metricsapp.work"): 3.0,
            key("celery_redislock_hold_seconds_count", task="metricsapp.work"): 3.0,
            key("celery_redislock_releases_total", task="metricsapp.work", outcome="released"): 3.0,
            key("celery_redislock_releases_total", task="metricsapp.fragile", outcome="lost"): 1.0,
            key("celery_redislock_lost_total", task="metricsapp.fragile"): 1.0,
        }
        seen: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}

        def all_counted() -> bool:
            seen.update(scrape(port))
            return all(seen.get(k) == v for k, v in expected.items())

        wait_for(all_counted, timeout=30, what=f"the metrics {expected}, seen {seen}")
    finally:
        # At once, with its children: how it stops is not what this test looks at.
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(10)
        client.close()
        close_app(mod.app)
        sys.modules.pop("tests.metrics_app", None)
        os.environ.pop("REDISLOCK_TEST_URL", None)


def test_heartbeat_renewals_are_counted(
    registry: CollectorRegistry, redislock_server: RedisServer
) -> None:
    """Every heartbeat round reports its renewals (heartbeat_round), which become
    celery_redislock_heartbeat_total{server, result}; a lock deleted behind its back
    counts as lost."""
    server = f"{redislock_server.host}:{redislock_server.port}"
    # Renewed every 0.1 s, with more than a second to spare should the machine stall.
    kept = RedisLock(redislock_server.url, "beats", ttl=1.5, heartbeat_interval=0.1)
    doomed = RedisLock(redislock_server.url, "beats-doomed", ttl=1.5, heartbeat_interval=0.1)
    assert kept.acquire()
    assert doomed.acquire()
    direct = redislock_server.client()
    direct.delete(doomed.key)
    wait_for(
        lambda: (
            value(registry, "celery_redislock_heartbeat_total", server=server, result="renewed")
            >= 3
        ),
        what="three renewals",
    )
    wait_for(
        lambda: (
            value(registry, "celery_redislock_heartbeat_total", server=server, result="lost") >= 1
        ),
        what="the lost lock",
    )
    kept.release()
    direct.close()


def test_heartbeat_renewals_without_an_answer_are_counted_as_failed(
    registry: CollectorRegistry, redislock_server: RedisServer
) -> None:
    """A renewal the server does not answer (the connection gone dark) is reported by
    its heartbeat round as failed, and counted as
    celery_redislock_heartbeat_total{result="failed"}; the lock, renewed once the
    server answers again before its TTL ran out, is not lost."""
    rounds: list[tuple[Any, int, int, int]] = []

    def on_round(sender: Any = None, **kwargs: Any) -> None:
        rounds.append((sender, kwargs["renewed"], kwargs["failed"], kwargs["lost"]))

    signals.heartbeat_round.connect(on_round, weak=False, dispatch_uid="failed-renewals")
    try:
        with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
            server = f"{proxy.host}:{proxy.port}"
            lock = RedisLock(proxy.url, "beats-in-the-dark", ttl=6, heartbeat_interval=1)
            assert lock.acquire()
            proxy.blackhole()
            wait_for(
                lambda: (
                    value(
                        registry, "celery_redislock_heartbeat_total", server=server, result="failed"
                    )
                    >= 1
                ),
                what="a renewal without an answer",
            )
            proxy.heal()
            renewed = value(
                registry, "celery_redislock_heartbeat_total", server=server, result="renewed"
            )
            wait_for(
                lambda: (
                    value(
                        registry,
                        "celery_redislock_heartbeat_total",
                        server=server,
                        result="renewed",
                    )
                    > renewed
                ),
                what="a renewal once the server answers",
            )
            assert not lock.lost
            lock.release()
    finally:
        signals.heartbeat_round.disconnect(on_round, dispatch_uid="failed-renewals")
    ours = [(renewed, failed, lost) for sender, renewed, failed, lost in rounds if sender == server]
    assert any(failed == 1 for _, failed, _ in ours)
    assert all(lost == 0 for _, _, lost in ours)
    assert value(registry, "celery_redislock_heartbeat_total", server=server, result="lost") == 0
