"""The ``celery redislock`` command, run through Celery's own command line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

from celery_redislock import RedisLock
from celery_redislock.admin import force_release, list_locks
from celery_redislock.server import RedisServer

ROOT = Path(__file__).resolve().parent.parent


def celery(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.worker_app redislock ARGS`` against the server at ``url``."""
    env = dict(os.environ, REDISLOCK_TEST_URL=url, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.worker_app", "redislock", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_list_and_release(redislock_server: RedisServer, redislock_client: redis.Redis) -> None:
    """`list` shows a held lock with its holder; `release` frees it; a second release fails."""
    lock = RedisLock(redislock_client, "shop.purchase:abc", ttl=30, lease="task-1")
    assert lock.acquire(blocking=False)
    listed = celery(redislock_server.url, "list")
    assert listed.returncode == 0, listed.stderr
    assert "shop.purchase:abc\tholder=task-1\tholds=1" in listed.stdout
    assert "1 lock(s) held" in listed.stdout
    released = celery(redislock_server.url, "release", "shop.purchase:abc")
    assert released.returncode == 0, released.stderr
    assert not lock.locked()
    again = celery(redislock_server.url, "release", "shop.purchase:abc")
    assert again.returncode != 0
    assert "no lock named" in again.stderr
    lock.detach()


def test_ping(redislock_server: RedisServer) -> None:
    """`ping` reports the lock store and its server version."""
    result = celery(redislock_server.url, "ping")
    assert result.returncode == 0, result.stderr
    assert "ok (server" in result.stdout


def test_list_locks_filters_by_pattern(redislock_client: redis.Redis) -> None:
    """list_locks matches names by glob and reports hold count and fence."""
    a = RedisLock(redislock_client, "a.task:1", ttl=30)
    b = RedisLock(redislock_client, "b.task:1", ttl=30)
    assert a.acquire()
    assert a.acquire()
    assert b.acquire()
    infos = list_locks(redislock_client, "a.*")
    assert [(i.name, i.count, i.fence) for i in infos] == [("a.task:1", 2, a.token)]
    assert force_release(redislock_client, "b.task:1")
    assert not force_release(redislock_client, "b.task:1")
    a.release()
    a.release()
    b.detach()


def test_list_locks_round_trips_escaped_names(redislock_client: redis.Redis) -> None:
    """Names that lock_keys escapes (leading '}' or backslash) are listed as given."""
    names = ["}odd{", "\\back", "plain"]
    held = [RedisLock(redislock_client, name, ttl=30) for name in names]
    for lock in held:
        assert lock.acquire()
    assert sorted(info.name for info in list_locks(redislock_client)) == sorted(names)
    for lock in held:
        lock.release()
