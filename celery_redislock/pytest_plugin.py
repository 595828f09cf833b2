"""Pytest fixtures that give every test a real Redis-compatible server.

Registered through the ``pytest11`` entry point, so installing the package is
enough: ``pytest`` needs no Redis running beforehand.

Fixtures:
    redislock_server          one server for the whole session
    redislock_url             its ``redis://`` URL
    redislock_client          a client to it, with the database flushed before the test
    redislock_server_factory  starts extra independent servers, stopped after the test
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from celery_redislock.server import RedisServer


@pytest.fixture(scope="session")
def redislock_server() -> Iterator[RedisServer]:
    """A private server on a free 127.0.0.1 port, shared by the session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redislock_url(redislock_server: RedisServer) -> str:
    """The session server's URL."""
    return redislock_server.url


@pytest.fixture
def redislock_client(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the session server; the database is emptied first."""
    client = redislock_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redislock_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start more servers (``factory(binary=None, extra_args=())``); all stop afterwards."""
    started: list[RedisServer] = []

    def factory(binary: str | None = None, extra_args: tuple[str, ...] = ()) -> RedisServer:
        server = RedisServer(binary=binary, extra_args=extra_args).start()
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()
