"""Per-process Redis clients, shared by URL.

Locks, the heartbeat and the Celery integration all ask for clients here so a
process keeps one connection pool per server instead of one per lock or per
task call. These clients time out their connects and reads after
:data:`~celery_redislock.transport.DEFAULT_CALL_TIMEOUT`; the lock's own round
trips are bounded tighter by their callers (see :mod:`celery_redislock.transport`). The cache is emptied in a forked child (Celery's prefork pool), so a
child never talks over a socket it inherited from its parent.
"""

from __future__ import annotations

import os
import threading

import redis

from celery_redislock.transport import DEFAULT_CALL_TIMEOUT

_clients: dict[str, redis.Redis] = {}
_guard = threading.Lock()


def get_client(url: str) -> redis.Redis:
    """Return this process's shared client for ``url``, creating it on first use."""
    client = _clients.get(url)
    if client is None:
        with _guard:
            client = _clients.get(url)
            if client is None:
                client = redis.Redis.from_url(
                    url,
                    health_check_interval=30,
                    socket_timeout=DEFAULT_CALL_TIMEOUT,
                    socket_connect_timeout=DEFAULT_CALL_TIMEOUT,
                )
                _clients[url] = client
    return client


def as_client(client_or_url: redis.Redis | str) -> redis.Redis:
    """Accept a ready client or a ``redis://`` URL and return a client."""
    if isinstance(client_or_url, str):
        if not client_or_url:
            raise ValueError(
                "client_or_url: an empty URL was given; pass a redis:// URL or a client"
            )
        return get_client(client_or_url)
    if isinstance(client_or_url, redis.Redis):
        return client_or_url
    raise TypeError(
        f"client_or_url must be a redis.Redis client or a redis:// URL, "
        f"not {type(client_or_url).__name__}"
    )


def _forget_after_fork() -> None:
    global _guard
    _clients.clear()
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
