"""The task integration's tests on Redis 6.2, the oldest release the package
supports (the engine's and a solo worker's run there in their own modules, as a
param of their server fixture)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from celery_redislock.server import SERVER_ENV
from tests.support import CHILD_PYTEST_OPTIONS, REDIS_6_2, binary_of, child_environment

ROOT = Path(__file__).resolve().parent.parent

#: The tests run there: every strategy and outcome of a task (reservations, the
#: accept hook, revokes, redeliveries, retries, call options), the heartbeat, the
#: deferred release, the lock store, the signals, metrics and the command line.
#: Their cluster and Sentinel tests are skipped there (see ``tests/conftest.py``).
OLDEST_REDIS_TESTS = tuple(
    f"tests/test_{name}.py"
    for name in (
        "task", "task_face", "call_options", "sent_names", "retried", "early", "revoke",
        "redelivery", "heartbeat", "release_nowait", "store", "signals", "metrics", "cli",
        "kit",
    )
)  # fmt: skip


@pytest.mark.slow
def test_the_oldest_supported_redis_passes_the_task_tests(request: pytest.FixtureRequest) -> None:
    """With every server it starts a Redis 6.2 (the broker, results and locks),
    a session of the tests in :data:`OLDEST_REDIS_TESTS` passes (skipped where
    no Redis 6.2 can be had)."""
    env = child_environment()
    env[SERVER_ENV] = str(binary_of(request, REDIS_6_2))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *OLDEST_REDIS_TESTS, *CHILD_PYTEST_OPTIONS],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    # The deployments were left out: that session saw its servers were Redis 6.2.
    assert "need Redis 7" in result.stdout
    assert " failed" not in result.stdout
