"""Tests for the per-process client cache (celery_redislock.client)."""

from __future__ import annotations

import os
import threading
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis

from celery_redislock import client as client_module
from celery_redislock.client import as_client, get_client
from tests.support import in_forked_child

#: Forking a process that runs threads warns on Python >= 3.12; the tests below
#: fork on purpose, to check what a prefork child sees.
FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")


def test_same_url_same_client(redislock_url: str) -> None:
    """A URL maps to one shared client per process."""
    assert get_client(redislock_url) is get_client(redislock_url)
    assert get_client(redislock_url).ping()


def test_different_urls_different_clients(redislock_url: str) -> None:
    """Different URLs (here: another database) get different clients."""
    other = redislock_url.rsplit("/", 1)[0] + "/1"
    assert get_client(redislock_url) is not get_client(other)
    assert get_client(other).connection_pool.connection_kwargs["db"] == 1


def test_as_client_passes_clients_through(redislock_client: redis.Redis) -> None:
    """A ready client is used as it is, not copied."""
    assert as_client(redislock_client) is redislock_client


def test_as_client_resolves_urls(redislock_url: str) -> None:
    """A URL is resolved through the shared cache."""
    assert as_client(redislock_url) is get_client(redislock_url)


def test_empty_url_is_rejected() -> None:
    """An empty URL raises ValueError naming the argument."""
    with pytest.raises(ValueError, match="client_or_url") as excinfo:
        as_client("")
    assert "redis://" in str(excinfo.value)


@pytest.mark.parametrize("value", [None, 6379, b"redis://localhost", object()])
def test_wrong_type_is_rejected(value: Any) -> None:
    """Anything but a client or a URL string raises TypeError naming the argument."""
    with pytest.raises(TypeError) as excinfo:
        as_client(value)
    assert "client_or_url" in str(excinfo.value)
    assert type(value).__name__ in str(excinfo.value)


def test_concurrent_first_use_creates_one_client(redislock_server: Any) -> None:
    """Threads racing for a new URL all get the same client."""
    url = f"redis://{redislock_server.host}:{redislock_server.port}/2"
    client_module._clients.pop(url, None)
    start = threading.Barrier(8)
    seen: list[redis.Redis] = []

    def worker() -> None:
        start.wait()
        seen.append(get_client(url))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(seen) == 8
    assert all(client is seen[0] for client in seen)


def _child_report(url: str, parent_client_id: int, conn: Connection) -> None:
    inherited = dict(client_module._clients)
    fresh = get_client(url)
    conn.send(
        {
            "inherited": len(inherited),
            "fresh_is_parent": id(fresh) == parent_client_id,
            "ping": bool(fresh.ping()),
        }
    )
    conn.close()


@needs_fork
@pytest.mark.filterwarnings(FORK_WARNING)
def test_cache_is_emptied_in_a_forked_child(redislock_url: str) -> None:
    """A forked child starts with no cached clients and opens its own connection."""
    parent = get_client(redislock_url)
    assert parent.ping()
    report = in_forked_child(_child_report, redislock_url, id(parent))
    assert report == {"inherited": 0, "fresh_is_parent": False, "ping": True}
    # The parent's cache is untouched.
    assert get_client(redislock_url) is parent
    assert parent.ping()
