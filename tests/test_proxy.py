"""Tests for the fault-injection proxy, each fault seen by a real client of a real server."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock.server import RedisServer
from tests.proxy import FaultProxy
from tests.support import wait_for


@pytest.fixture
def server(redislock_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A server of the test's own, so faults and data never reach other tests."""
    return redislock_server_factory()


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultProxy]:
    """A proxy in front of the test's server, stopped afterwards."""
    with FaultProxy(server.host, server.port) as running:
        yield running


def through(proxy: FaultProxy, timeout: float = 5.0, single: bool = False) -> redis.Redis:
    """A client of the proxy that never retries, so each fault surfaces as one error.

    ``Retry(NoBackoff(), 0)`` turns retries off for timeouts too; redis-py 6 and
    later deprecate ``retry_on_timeout``, and deprecation warnings fail tests here.
    """
    return redis.Redis(
        host=proxy.host,
        port=proxy.port,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 0),
        single_connection_client=single,
    )


def test_forwards_both_ways(server: RedisServer, proxy: FaultProxy) -> None:
    """Commands through the proxy reach the server and their replies come back."""
    client = through(proxy)
    assert client.set("k", "v")
    assert client.get("k") == b"v"
    assert server.client().get("k") == b"v"
    assert proxy.connections_accepted == 1
    assert proxy.active_connections() == 1
    assert proxy.bytes_to_server > 0
    assert proxy.url == f"redis://127.0.0.1:{proxy.port}/0"
    assert proxy.url_for(3).endswith(f":{proxy.port}/3")
    client.close()
    wait_for(lambda: proxy.active_connections() == 0, what="the link to close")


def test_latency_delays_each_round_trip(proxy: FaultProxy) -> None:
    """With latency set, a round trip takes at least the delay there and back."""
    client = through(proxy)
    assert client.ping()
    proxy.set_latency(0.2)
    started = time.monotonic()
    assert client.ping()
    assert time.monotonic() - started >= 0.4
    proxy.set_latency(0)
    assert client.ping()


def test_reset_all_breaks_open_connections_only(proxy: FaultProxy) -> None:
    """After reset_all an open connection fails once and a fresh one works."""
    client = through(proxy, single=True)
    assert client.ping()
    proxy.reset_all()
    assert proxy.active_connections() == 0
    with pytest.raises(redis.ConnectionError):
        client.ping()
    assert client.ping()  # the client reconnected
    assert proxy.connections_accepted == 2
    client.close()


def test_drop_replies_loses_the_reply_of_an_executed_command(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """A dropped reply is a connection error for a command the server ran exactly once."""
    client = through(proxy)
    assert client.ping()  # the handshake's replies are through before the fault
    proxy.drop_replies(1)
    with pytest.raises(redis.ConnectionError):
        client.incr("k")
    assert server.client().get("k") == b"1"
    assert client.incr("k") == 2  # one drop used up: forwarding is normal again


def test_drop_replies_until_heal(server: RedisServer, proxy: FaultProxy) -> None:
    """Without a count every reply is dropped, a new connection's handshake's too, until heal()."""
    client = through(proxy)
    assert client.ping()
    proxy.drop_replies()
    with pytest.raises(redis.ConnectionError):
        client.incr("k")
    # The reconnect fails on its handshake reply (CLIENT SETINFO), before INCR is sent.
    with pytest.raises(redis.ConnectionError):
        client.incr("k")
    assert server.client().get("k") == b"1"
    proxy.heal()
    assert client.incr("k") == 2


def test_a_held_request_reaches_the_server_after_later_ones(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """A request hold_next() holds waits at the proxy, while one sent after it on
    another connection goes through; let through, it runs, even after its client
    gave up on it and closed the connection."""
    early, late, direct = through(proxy, timeout=0.3, single=True), through(proxy), server.client()
    assert early.ping()
    proxy.hold_next()
    with pytest.raises(redis.TimeoutError):
        early.set("k", "first")
    assert proxy.held == 1
    early.close()
    assert late.set("k", "second")
    assert direct.get("k") == b"second"
    proxy.let_held_through()
    wait_for(lambda: direct.get("k") == b"first", what="the held request to run")
    late.close()


def test_a_held_request_whose_connection_is_cut_still_reaches_the_server(
    server: RedisServer, proxy: FaultProxy
) -> None:
    """cut_held() resets the connection of a request hold_next() holds: its client
    gets a connection error at once, and the request, let through later, runs all
    the same. Other connections are left alone."""
    client, other, direct = through(proxy, single=True), through(proxy), server.client()
    assert client.ping()
    assert other.ping()
    proxy.hold_next()
    errors: list[Exception] = []

    def set_first() -> None:
        try:
            client.set("k", "first")
        except redis.ConnectionError as exc:
            errors.append(exc)

    thread = threading.Thread(target=set_first)
    thread.start()
    wait_for(lambda: proxy.held == 1, what="the request to be held")
    assert proxy.cut_held() == 1
    thread.join(5)
    assert len(errors) == 1
    assert other.set("k", "second")
    proxy.let_held_through()
    wait_for(lambda: direct.get("k") == b"first", what="the held request to run")
    assert other.ping()
    client.close()
    other.close()


def test_refuse_fails_new_connections_but_keeps_open_ones(proxy: FaultProxy) -> None:
    """While refusing, a new client cannot talk, an open connection still can, heal ends it."""
    old = through(proxy, single=True)
    assert old.ping()
    proxy.refuse()
    with pytest.raises(redis.ConnectionError):
        through(proxy).ping()
    assert old.ping()
    proxy.heal()
    assert through(proxy).ping()


def test_blackhole_times_out_and_heal_recovers(proxy: FaultProxy) -> None:
    """In a black hole a command times out on the client's socket_timeout; after heal a new connection works."""
    client = through(proxy, timeout=0.5)
    assert client.ping()
    proxy.blackhole()
    sent = proxy.bytes_to_server
    started = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        client.ping()
    assert time.monotonic() - started < 5.0
    assert proxy.bytes_to_server == sent  # the PING never reached the server
    with pytest.raises(redis.TimeoutError):
        through(proxy, timeout=0.5).ping()  # new connections are swallowed as well
    proxy.heal()
    assert through(proxy, timeout=5.0).ping()


def test_stop_closes_connections_and_threads(server: RedisServer) -> None:
    """stop() closes every proxied connection: the client then sees a connection error."""
    proxy = FaultProxy(server.host, server.port).start()
    client = through(proxy, single=True)
    assert client.ping()
    proxy.stop()
    assert proxy.active_connections() == 0
    with pytest.raises(redis.ConnectionError):
        client.ping()
    client.close()
