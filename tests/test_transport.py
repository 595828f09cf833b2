"""The transport against a real server: its own reply reader (every reply shape the
engine meets, replies split over many reads, error replies, a reply cut short), and
the replies a connection still owes when its next request goes."""

from __future__ import annotations

import gc
import os
import pathlib
import select
import socket
import ssl
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_redislock import LockBackendError, RedisLock, lookup
from celery_redislock import lock as lock_module
from celery_redislock import transport as transport_module
from celery_redislock.deployments import TLSServer, make_certificates
from celery_redislock.heartbeat import Heartbeat, get_heartbeat
from celery_redislock.scripts import ACQUIRE_SCRIPT, RELEASE_SCRIPT
from celery_redislock.server import RedisServer
from celery_redislock.transport import (
    Deadline,
    MovableDeadline,
    Transport,
    pack,
    parse_replies,
    run,
    transport_for,
)
from tests.proxy import FaultProxy
from tests.support import held, in_forked_child, wait_until


def test_every_reply_shape(redislock_client: redis.Redis) -> None:
    """Simple strings, integers, bulk strings, nils, nested arrays and empty ones come
    back as redis-py gives them without decoding."""
    transport = transport_for(redislock_client)
    replies = transport.execute(
        [
            ("PING",),
            ("INCR", "counter"),
            ("SET", "text", "héllo\r\nworld"),
            ("GET", "text"),
            ("GET", "missing"),
            ("EVAL", "return {1, {'a', {}}, 'b', false}", 0),
            ("HMGET", "missing", "x", "y"),
            ("SET", "empty", ""),
            ("GET", "empty"),
        ],
        Deadline.after(5),
    )
    assert replies == [
        b"PONG",
        1,
        b"OK",
        "héllo\r\nworld".encode(),
        None,
        [1, [b"a", []], b"b", None],
        [None, None],
        b"OK",
        b"",
    ]


def test_error_replies_come_back_as_exceptions_among_the_others(
    redislock_client: redis.Redis,
) -> None:
    """An error reply is the matching redis-py exception, in its place; the
    connection stays usable."""
    transport = transport_for(redislock_client)
    replies = transport.execute(
        [
            ("SET", "plain", "v"),
            ("HGET", "plain", "f"),
            ("EVALSHA", "0" * 40, 0),
            ("GET", "plain"),
        ],
        Deadline.after(5),
    )
    assert replies[0] == b"OK"
    assert isinstance(replies[1], ResponseError)
    assert "WRONGTYPE" in str(replies[1])
    assert isinstance(replies[2], NoScriptError)
    assert replies[3] == b"v"
    assert transport.execute([("PING",)], Deadline.after(5)) == [b"PONG"]


def test_replies_larger_than_one_read(redislock_client: redis.Redis) -> None:
    """A reply much longer than one socket read, and many replies in one write, are
    put together across reads."""
    transport = transport_for(redislock_client)
    big = b"x" * 1_000_000
    redislock_client.set("big", big)
    redislock_client.rpush("list", *range(20_000))
    replies = transport.execute(
        [("GET", "big"), ("LRANGE", "list", 0, -1), *[("GET", "big")] * 3],
        Deadline.after(10),
    )
    assert replies[0] == big
    assert replies[1] == [str(i).encode() for i in range(20_000)]
    assert replies[2:] == [big] * 3


@contextmanager
def fake_server(marker: bytes, then: Callable[[socket.socket], object]) -> Iterator[Transport]:
    """A transport to a fake server on a free port: it answers the connection's
    handshake, if any, with OK to each command until a read holds
    ``marker``, then calls ``then`` with the connection and closes it."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = redis.Redis(host="127.0.0.1", port=listener.getsockname()[1], protocol=2)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            tail = b""
            while True:
                data = conn.recv(65536)
                # (The marker may come split between two reads.)
                if not data or marker in tail + data:
                    break
                tail = data[-len(marker) :]
                conn.sendall(b"+OK\r\n" * data.count(b"*"))
            then(conn)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield transport_for(client)
    finally:
        thread.join(5)
        listener.close()
        client.close()


def test_a_reply_cut_short_is_a_connection_error() -> None:
    """A server that closes the connection in the middle of a reply gives a
    connection error (the request may be retried), not a hang or a wrong value."""
    with (
        fake_server(b"GET", lambda conn: conn.sendall(b"$10\r\nhalf")) as transport,
        pytest.raises(RedisConnectionError, match="closed the connection"),
    ):
        transport.execute([("GET", "k")], Deadline.after(5))


def test_a_write_the_server_does_not_take_is_bounded_by_the_deadline() -> None:
    """A request the server stops reading (a stalled server, full buffers) gives
    up by its deadline with a timeout, and its connection is closed, not reused."""
    done = threading.Event()
    # The server reads nothing more until the test is over.
    with fake_server(b"stalled", lambda conn: done.wait(30)) as transport:
        try:
            # (Packing 64 MB takes most of a second on a busy machine: the deadline
            # leaves time for it, and runs out with the write, which fills the
            # socket buffers, under way.)
            with pytest.raises(RedisTimeoutError, match="timed out writing to"):
                transport.execute([("SET", "stalled", "x" * 64_000_000)], Deadline.after(3))
            assert transport._idle == []
        finally:
            done.set()


def test_a_new_connection_sends_only_what_the_request_needs(
    redislock_server: RedisServer,
) -> None:
    """A transport's new connection sends no CLIENT SETINFO (two round trips, for a
    label): a request on a database other than 0 costs the server a SELECT and the
    request, and no error reply (a server older than 7.2 refuses CLIENT SETINFO)."""
    admin = redislock_server.client()
    client = redislock_server.client(db=1)
    try:
        admin.config_resetstat()
        assert Transport(client).execute([("PING",)], Deadline.after(5)) == [b"PONG"]
        calls = {name: stats["calls"] for name, stats in admin.info("commandstats").items()}
        # CONFIG RESETSTAT counts itself.
        assert calls == {"cmdstat_config|resetstat": 1, "cmdstat_select": 1, "cmdstat_ping": 1}
        assert admin.info("stats")["total_error_replies"] == 0
    finally:
        client.close()
        admin.close()


def test_the_handshake_as_a_whole_ends_by_the_deadline(redislock_server: RedisServer) -> None:
    """Each step of a connection's handshake waits only for what is left of the
    deadline, not for all of it again: with a handshake of two round trips of 0.6 s
    each (AUTH, then CLIENT SETNAME and SELECT, which redis-py 8.2 and later send
    together), a connection due within 1 s times out instead of being handed over
    late; given time, the same handshake succeeds. (The server's default user has
    no password, so any password is accepted.)"""
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        client = redis.Redis(
            host=proxy.host,
            port=proxy.port,
            db=1,
            client_name="handshake",
            username="default",
            password="any",
        )
        transport = Transport(client)
        proxy.set_latency(0.3)
        with pytest.raises(RedisTimeoutError):
            transport.connection(Deadline.after(1.0))
        conn = transport.connection(Deadline.after(30))
        conn.disconnect()
        client.close()


class _StalledResolver:
    """The system's resolver as a DNS server that does not answer makes it, for one
    made-up name (standing for the lock store's): a lookup of ``name`` blocks until
    :meth:`answer`, then finds ``addresses`` (127.0.0.1). Every other lookup goes to
    the real one."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        name: str,
        addresses: tuple[str, ...] = ("127.0.0.1",),
    ) -> None:
        self.name = name
        self.answered = threading.Event()
        self.lookups = 0
        real = socket.getaddrinfo

        def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
            if host != self.name:
                return real(host, *args, **kwargs)
            self.lookups += 1
            self.answered.wait()
            return [info for address in addresses for info in real(address, *args, **kwargs)]

        monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)

    def answer(self) -> None:
        self.answered.set()


def test_a_resolver_that_does_not_answer_holds_up_a_call_only_until_its_deadline(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock store named by a host name whose lookup hangs: a call fails when its
    deadline passes, saying what it waited for, rather than when the resolver gives
    up. Callers meanwhile share the lookup under way; once it answers, a call goes
    through. An acquire that failed so was never sent: nothing is sent afterwards to
    undo it."""
    resolver = _StalledResolver(monkeypatch, "lock-store.example")
    url = f"redis://lock-store.example:{redislock_server.port}"
    first = RedisLock(url, "looked-up", ttl=30, call_timeout=0.3)
    second = RedisLock(url, "looked-up-too", ttl=30, call_timeout=0.3)
    with pytest.raises(LockBackendError, match=r"looking up the address of .lock-store\.example"):
        first.acquire(blocking=False)
    lanes = get_heartbeat()._lanes.values()
    assert not [p for lane in lanes for p in lane.pending if first.key in p.call.keys]
    with pytest.raises(LockBackendError, match="timed out"):
        second.acquire(blocking=False)
    assert resolver.lookups == 1
    resolver.answer()
    assert first.acquire(blocking=False)
    first.release()
    # Nothing is kept of a lookup: the next new connection looks the name up again.
    first.transport.close_idle()
    assert first.acquire(blocking=False)
    assert resolver.lookups == 2
    first.release()


def test_each_address_looked_up_is_tried_in_turn(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A name with several addresses: an address where nothing listens (it refuses
    the connection) is passed over for the next."""
    resolver = _StalledResolver(monkeypatch, "two.example", ("127.0.0.2", "127.0.0.1"))
    resolver.answer()
    assert lookup.resolve("two.example", redislock_server.port, 5) == ["127.0.0.2", "127.0.0.1"]
    lock = RedisLock(f"redis://two.example:{redislock_server.port}", "two-addresses", ttl=30)
    assert lock.acquire(blocking=False)
    lock.release()


def test_a_lookup_that_cannot_start_its_thread_fails_and_is_not_kept(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As the interpreter shuts down (Python 3.12, at exit) no thread can be
    started: a lookup then fails at once as a connection error, and leaves nothing
    behind for the next one to wait on."""

    def refuse(self: object) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    with monkeypatch.context() as patched:
        patched.setattr(lookup._Lookup, "start", refuse)
        with pytest.raises(redis.ConnectionError, match="interpreter shutdown"):
            lookup.resolve("localhost", redislock_server.port, 5)
    assert not lookup._lookups
    assert "127.0.0.1" in lookup.resolve("localhost", redislock_server.port, 5)


def _look_up_in_child(port: int, conn: Connection) -> None:
    conn.send(lookup.resolve("localhost", port, 5))


def test_a_child_forked_while_a_lookup_starts_looks_names_up_itself(
    redislock_server: RedisServer,
) -> None:
    """A process forked while another of its threads held the lookups' guard (as it
    starts a lookup): the child's lookups neither wait for that guard nor for a
    lookup thread it does not have."""
    with lookup._guard:
        found = in_forked_child(_look_up_in_child, redislock_server.port)
    assert "127.0.0.1" in found


def test_a_looked_up_tls_server_is_checked_against_its_name(
    redislock_tls_server: TLSServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lock connects to the address it looked up, but checks the server's
    certificate against the name it was given: a name the certificate lists
    connects, another resolving to the same address is refused."""
    resolver = _StalledResolver(monkeypatch, "elsewhere.example")
    resolver.answer()
    named = redislock_tls_server.url.replace("127.0.0.1", "localhost")
    lock = RedisLock(named, "tls-named", ttl=30)
    assert lock.acquire(blocking=False)
    lock.release()
    other = RedisLock(named.replace("localhost", "elsewhere.example"), "tls-other", ttl=30)
    with pytest.raises(LockBackendError, match=r"elsewhere\.example") as refused:
        other.acquire(blocking=False)
    assert "certificate" in str(refused.value)
    assert resolver.lookups


class _SystemCalls:
    """Counts ``os.write``/``os.read`` calls on one file descriptor (they still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, fd: int) -> None:
        self.writes: list[int] = []
        self.reads = 0
        write, read = os.write, os.read

        def counted_write(target: int, data: Any) -> int:
            if target == fd:
                self.writes.append(len(data))
            return write(target, data)

        def counted_read(target: int, size: int) -> bytes:
            if target == fd:
                self.reads += 1
            return read(target, size)

        monkeypatch.setattr(os, "write", counted_write)
        monkeypatch.setattr(os, "read", counted_read)


@pytest.mark.skipif(os.name != "posix", reason="a socket is a file descriptor on POSIX only")
def test_a_request_goes_as_one_write_and_owed_replies_as_one_read(
    redislock_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a plain connection a request is written with one ``write(2)`` (not the
    socket's ``sendall``, which CPython precedes with a ``poll``), and replies owed
    for a while are taken with one ``read(2)``; a round trip's own reply, not in
    yet, is waited for by the socket, bounded by its timeout."""
    transport = transport_for(redislock_client)
    transport.execute([("PING",)], Deadline.after(5))
    (link,) = transport._idle
    calls = _SystemCalls(monkeypatch, link.conn._sock.fileno())
    request = pack([("INCR", "written-once")])
    answers: list[Any] = []
    transport.send_deferred([("INCR", "written-once")], Deadline.after(5), answers.append)
    assert calls.writes == [len(request)]
    assert wait_until(lambda: redislock_client.get("written-once") == b"1")
    assert transport.drain(Deadline.after(5)) == 1
    assert answers == [[1]]
    assert calls.reads == 1
    assert transport.execute([("INCR", "written-once")], Deadline.after(5)) == [2]
    assert calls.writes == [len(request)] * 2
    assert calls.reads == 1


def test_without_plain_sockets_every_call_goes_through_the_socket(
    redislock_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a socket is not a file descriptor (Windows), requests and replies go
    through the socket's own methods, and round trips and owed replies work the same."""
    monkeypatch.setattr(transport_module, "_PLAIN_SOCKET", None)
    transport = transport_for(redislock_client)
    transport.execute([("PING",)], Deadline.after(5))
    (link,) = transport._idle
    calls = _SystemCalls(monkeypatch, link.conn._sock.fileno())
    answers: list[Any] = []
    transport.send_deferred([("INCR", "through-the-socket")], Deadline.after(5), answers.append)
    assert transport.execute([("INCR", "through-the-socket")], Deadline.after(5)) == [2]
    assert answers == [[1]]
    assert calls.writes == []
    assert calls.reads == 0


def test_owed_replies_not_in_yet_are_waited_for(redislock_client: redis.Redis) -> None:
    """Replies read as owed but not yet sent by the server (a slow command) are
    waited for, within the deadline, and come back whole."""
    transport = transport_for(redislock_client)
    answers: list[Any] = []
    transport.send_deferred([("BLPOP", "filled-later", 5)], Deadline.after(10), answers.append)
    pusher = threading.Timer(0.3, lambda: redislock_client.rpush("filled-later", "x"))
    pusher.start()
    assert transport.drain(Deadline.after(10)) == 1
    pusher.join()
    assert answers == [[[b"filled-later", b"x"]]]


def test_parse_replies_keeps_the_start_of_an_unfinished_reply() -> None:
    """A reader of its own gets the whole replies at the start of what it read, and
    the bytes of the one still coming, to read more onto; an error reply comes back
    as an exception among them."""
    message = b"*3\r\n$7\r\nmessage\r\n$2\r\nch\r\n$3\r\np.1\r\n"
    replies, rest = parse_replies(b":1\r\n-ERR no\r\n" + message + message[:9])
    assert replies[0] == 1
    assert isinstance(replies[1], ResponseError)
    assert replies[2] == [b"message", b"ch", b"p.1"]
    assert len(replies) == 3
    assert rest == message[:9]
    assert parse_replies(rest + message[9:]) == ([[b"message", b"ch", b"p.1"]], b"")


def test_arrays_of_integers_parse_as_item_by_item() -> None:
    """An array of integers only (a script's usual reply), matched whole, parses
    as the same array read item by item does: small, negative and large numbers,
    empty and nested arrays, an array with other items, and one not all in yet."""
    stream = (
        b"*2\r\n:1\r\n:57\r\n*0\r\n*3\r\n:-1\r\n:123456789012345678901\r\n:1024\r\n"
        b"*3\r\n:1\r\n:9\r\n$5\r\n11 12\r\n*2\r\n*1\r\n:4\r\n:5\r\n"
        b"*9\r\n" + b":7\r\n" * 9 + b"*2\r\n:1\r\n:5"
    )
    replies, rest = parse_replies(stream)
    assert replies == [
        [1, 57], [], [-1, 123456789012345678901, 1024], [1, 9, b"11 12"], [[4], 5], [7] * 9,
    ]  # fmt: skip
    assert rest == b"*2\r\n:1\r\n:5"
    assert parse_replies(rest + b"\r\n") == ([[1, 5]], b"")


def test_owed_replies_are_read_after_the_next_request_is_written(
    redislock_client: redis.Redis,
) -> None:
    """A round trip on a connection that owes replies writes its own request first
    and reads the owed ones while the server works on it; each reply still goes to
    its own reader."""
    transport = transport_for(redislock_client)
    transport.execute([("PING",)], Deadline.after(5))  # one idle connection
    events: list[Any] = []
    transport.send_deferred([("INCR", "n")], Deadline.after(5), lambda r: events.append(r))
    (link,) = transport._idle
    sock = link.conn._sock = _CountedSocket(link.conn._sock)
    sock.on_write = lambda: events.append("written")
    assert transport.execute([("INCR", "n")], Deadline.after(5)) == [2]
    assert events == ["written", [1]]
    assert not transport.owes_replies()


def test_a_connection_closed_while_owing_replies_still_gives_them_and_retries(
    redislock_client: redis.Redis,
) -> None:
    """The server closes an idle connection after answering a request written
    without waiting: the next round trip on it still hands that answer to its
    reader, finds the connection closed, and goes again on a new one."""
    transport = transport_for(redislock_client)
    answers: list[Any] = []
    transport.send_deferred([("SET", "k", "v")], Deadline.after(5), answers.append)
    assert wait_until(lambda: redislock_client.get("k") == b"v")
    assert redislock_client.client_kill_filter(_type="normal", skipme=True) >= 1
    sends = transport.sends
    assert run(transport, [("GET", "k")], Deadline.after(5)) == [b"v"]
    assert answers == [[b"OK"]]
    assert transport.sends == sends + 2


def test_a_request_written_now_keeps_its_connection_until_its_replies_are_read(
    redislock_client: redis.Redis,
) -> None:
    """``write`` and ``finish`` are a round trip's two halves: in between, the
    connection is the writer's alone (other requests take another one), and the
    replies it owed from before are read first, each by its own reader."""
    transport = transport_for(redislock_client)
    transport.execute([("PING",)], Deadline.after(5))  # one idle connection
    answers: list[Any] = []
    transport.send_deferred([("INCR", "halves")], Deadline.after(5), answers.append)
    (owing,) = transport._idle
    link = transport.write([("INCR", "halves")], Deadline.after(5))
    assert link is owing
    assert transport._idle == []
    assert transport.execute([("INCR", "elsewhere")], Deadline.after(5)) == [1]
    assert transport._idle != []
    assert link not in transport._idle
    assert answers == []
    assert transport.finish(link, 1, Deadline.after(5), ready=True) == [2]
    assert answers == [[1]]
    assert link in transport._idle
    assert not transport.owes_replies()


def test_replies_that_do_not_come_in_time_close_the_connection_of_a_request_written_now(
    redislock_client: redis.Redis,
) -> None:
    """A reply still missing at the deadline raises a timeout from ``finish``, and
    the connection is closed, not given back with the reply still coming."""
    transport = transport_for(redislock_client)
    link = transport.write([("BLPOP", "never-filled", 5)], Deadline.after(10))
    with pytest.raises(RedisTimeoutError):
        transport.finish(link, 1, Deadline.after(0.2))
    assert link not in transport._idle
    assert link.conn._sock is None


class _CountedSocket:
    """A socket whose ``settimeout`` calls are counted (each one is a system call),
    and that calls ``on_write`` before each write."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.timeouts: list[float] = []
        self.on_write: Callable[[], object] = lambda: None

    def settimeout(self, value: float) -> None:
        self.timeouts.append(value)
        self._sock.settimeout(value)

    def sendall(self, data: bytes) -> None:
        self.on_write()
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_socket_timeout_is_set_again_only_when_the_deadline_differs(
    redislock_client: redis.Redis,
) -> None:
    """Round trips whose deadlines are as long (every request without one of its
    own) keep the socket timeout the first set: setting it is a system call. A
    shorter deadline sets it again, and so does the longer one after it."""
    transport = transport_for(redislock_client)
    transport.execute([("PING",)], Deadline.after(5))
    (link,) = transport._idle
    counted = link.conn._sock = _CountedSocket(link.conn._sock)
    for _ in range(5):
        assert transport.execute([("PING",)], Deadline.after(5)) == [b"PONG"]
    assert len(counted.timeouts) <= 1
    assert 0 < link.timeout <= 5
    assert transport.execute([("PING",)], Deadline.after(0.5)) == [b"PONG"]
    assert counted.timeouts[-1] <= 0.5
    assert transport.execute([("PING",)], Deadline.after(5)) == [b"PONG"]
    assert counted.timeouts[-1] > 4


def test_a_kept_socket_timeout_still_bounds_a_stalled_read(
    redislock_client: redis.Redis,
) -> None:
    """A timeout kept from an earlier round trip still bounds the next one: a
    request the server never answers (a blocking pop) fails as a timeout."""
    transport = transport_for(redislock_client)
    transport.execute([("PING",)], Deadline.after(0.3))
    with pytest.raises(redis.TimeoutError):
        transport.execute([("BLPOP", "never-filled", 0)], Deadline.after(0.3))


def test_a_read_under_a_movable_deadline_waits_for_a_reply_many_steps_long(
    redislock_client: redis.Redis,
) -> None:
    """A read under a deadline another thread may bring forward looks at it every
    step, and reads on: a reply that takes many steps to come is read, and the
    connection stays in use."""
    transport = transport_for(redislock_client)
    deadline = MovableDeadline(time.monotonic() + 10)
    replies = transport.execute([("BLPOP", "never-filled", "0.5")], deadline)
    assert replies == [None]
    (link,) = transport._idle
    assert link.conn._sock is not None


def test_a_movable_deadline_brought_forward_ends_the_read_waiting_on_it(
    redislock_client: redis.Redis,
) -> None:
    """A read waiting on a reply that never comes (a connection gone dark) ends by
    the deadline another thread brought forward, not the one it began with, and
    its connection is closed."""
    transport = transport_for(redislock_client)
    began = time.monotonic() + 60
    deadline = MovableDeadline(began)
    link = transport.write([("BLPOP", "never-filled", 0)], deadline)
    timer = threading.Timer(0.2, deadline.bring_forward, [time.monotonic() + 0.5])
    timer.start()
    try:
        with pytest.raises(RedisTimeoutError):
            transport.finish(link, 1, deadline)
        assert time.monotonic() < began - 30  # long before the deadline it began with
    finally:
        timer.cancel()
    assert link not in transport._idle
    assert link.conn._sock is None
    deadline.bring_forward(deadline.at + 60)  # never pushed back
    assert deadline.expired()


@pytest.mark.parametrize(
    "command",
    [
        ("SET", "key", "value", "PX", 60_000),
        ("SET", "ключ", "värde", "PX", -1),
        ("SET", b"\x00\xff", "v", 0),
        ("EVALSHA", "a" * 40, 2, "k1", "k2", "", "x" * 300),
        ("SET", "k", "x" * 1023),
        ("SET", "k", "x" * 5000),
        ("RPUSH", "k", *range(70)),
    ],
)
def test_pack_encodes_as_redis_py_does(command: tuple[Any, ...]) -> None:
    """Every argument kind the engine sends (ASCII and other text, bytes, integers)
    is encoded as redis-py's own encoder encodes it."""
    expected = b"".join(redis.Connection().pack_command(*command))  # type: ignore[no-untyped-call]
    assert pack([command]) == expected
    assert pack([command, command]) == expected * 2


@pytest.mark.parametrize(
    ("lease", "info"),
    [
        ("0d4b7b3e-1234-4567-89ab-cdef01234567", "t\x1frunning\x1fw@h\x1f4242\x1f1733380000123"),
        ("", "t\x1fqueued\x1f\x1f\x1f1733380000123"),
        ("tâche-1", "t\x1frunning\x1fw@h\x1f1\x1f2"),
        ("id", "t\x1frunning\x1fhôte@h\x1f1\x1f2"),
    ],
)
def test_request_templates_encode_as_pack_does(lease: str, info: str) -> None:
    """The usual ACQUIRE and RELEASE calls, encoded from a template on every
    task's path, are byte for byte what :func:`pack` makes of them; a value that
    is not ASCII is left to :func:`pack` (``None``)."""
    # The lock's own ready-made fields (no connection is made).
    lock = RedisLock(redis.Redis(port=1), "t:ab12", ttl=60, owner="AbCdEfGhIjKl", prefix="p")
    key, queue = lock.key, lock.queue_key
    assert (key, queue) == lock_module._keys("t:ab12", "p")
    acquire = lock_module._packed_acquire(lock._keys_field, lock._ttl_field, lease, "17", info)
    expected = pack(
        [("EVALSHA", ACQUIRE_SCRIPT.sha, 2, key, queue, "AbCdEfGhIjKl", 60_000, lease, "17", "", "",
          info)]
    )  # fmt: skip
    assert acquire == (expected if (lease + info).isascii() else None)
    for args in [
        ("AbCdEfGhIjKl", "p:wake:", "18", 0, "", 7, ""),
        ("AbCdEfGhIjKl", "p:wake:", "18", 3_600_000, "17", "", "15 16"),
        ("AbCdEfGhIjKl", "p:wake:", lease or "18", 0, "", 7, ""),
    ]:
        command = ("EVALSHA", RELEASE_SCRIPT.sha, 2, key, queue, *args)
        release = lock_module._packed_release(lock._keys_field, lock._wake_field, args)
        ascii = all(str(arg).isascii() for arg in args)
        assert release == (pack([command]) if ascii else None)
    # Another shape (a release that reads the lock first) is left to pack().
    assert lock_module._packed_release(lock._keys_field, lock._wake_field, (*args, "read")) is None


@pytest.mark.parametrize("value", [True, 1.5, None, object()])
def test_pack_refuses_what_the_engine_never_sends(value: object) -> None:
    """A bool, float, None or other object is a bug, not something to guess at."""
    with pytest.raises(TypeError, match="cannot send"):
        pack([("SET", "k", value)])


FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


def _take_and_free(lock: RedisLock, conn: Connection) -> None:
    taken = lock.acquire(blocking=False)
    lock.release()
    conn.send("taken" if taken else "not taken")
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_transport_busy_as_the_process_forks_works_in_the_child(
    redislock_server: RedisServer,
) -> None:
    """A lock made before a fork works in the child even if its transport was in use
    by another thread of the parent at the moment of the fork (its lock held then):
    the child has its own."""
    lock = RedisLock(redislock_server.url, uuid.uuid4().hex, ttl=30, heartbeat=False)
    assert lock.acquire(blocking=False)
    lock.release()
    with lock.transport._guard:
        assert in_forked_child(_take_and_free, lock) == "taken"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_lock_whose_state_another_thread_held_as_the_process_forked_works_in_the_child(
    redislock_server: RedisServer,
) -> None:
    """The heartbeat's thread (or another thread of the parent) may be updating a
    lock's local state at the moment of a fork: the child, where that thread does not
    go on to finish, does not hang on the lock's first use there."""
    lock = RedisLock(redislock_server.url, uuid.uuid4().hex, ttl=30, heartbeat=False)
    assert lock.acquire(blocking=False)
    lock.release()
    with lock._state:
        assert in_forked_child(_take_and_free, lock) == "taken"


def test_idle_connections_all_closed_by_the_server_cost_one_retry(
    redislock_server: RedisServer,
) -> None:
    """Every idle connection closed by the server (a restart, CLIENT KILL, its idle
    ``timeout``): the next request finds one closed and goes on a new connection,
    rather than trying the others one by one until its attempts run out."""
    client = redislock_server.client()
    transport = transport_for(client)
    deadline = Deadline.after(5)
    links = [transport.write([("PING",)], deadline) for _ in range(transport_module.MAX_IDLE)]
    for link in links:
        assert transport.finish(link, 1, deadline) == [b"PONG"]
    killer = redislock_server.client()
    assert killer.client_kill_filter(_type="normal", skipme=True) >= transport_module.MAX_IDLE
    killer.close()
    lock = RedisLock(client, uuid.uuid4().hex, ttl=30, heartbeat=False)
    assert lock.acquire(blocking=False)
    lock.release()
    client.close()


def test_connections_left_to_the_garbage_collector_are_closed_before_it_reaches_them(
    redislock_server: RedisServer,
) -> None:
    """A transport that only a heartbeat of its own still refers to (the heartbeat
    and its lane refer to each other) is freed by the garbage collector, not as
    its last user lets go of it, and its idle connections with it, one of them
    owing a reply. Each is closed before the collector reaches it: one left open
    to it may have its socket finalized first, an unclosed-socket ResourceWarning."""
    client = redislock_server.client()
    lock = RedisLock(client, uuid.uuid4().hex, ttl=30, heartbeat=False)
    assert lock.acquire(blocking=False)
    beat = Heartbeat()
    beat.renew([lock])
    transport = lock.transport
    deadline = Deadline.after(5)
    busy = transport.write([("PING",)], deadline)  # the idle connection, taken
    transport.send_deferred([("PING",)], deadline, lambda result: None)  # a new one
    assert transport.finish(busy, 1, deadline) == [b"PONG"]
    # Whether each connection's socket was closed when the collector took it (a
    # weak reference's callback runs before any finalizer of the garbage).
    closed: list[bool] = []

    def watch(sock: socket.socket) -> Callable[[Any], None]:
        def collected(_ref: Any) -> None:
            closed.append(sock.fileno() == -1)
            sock.close()

        return collected

    watches = [weakref.ref(link.conn, watch(link.conn._sock)) for link in transport._idle]
    assert len(watches) == 2
    del lock, client, transport, busy, beat
    gc.collect()
    assert closed == [True, True]


def _two_owing_links(transport: Transport, first: Any, second: Any) -> None:
    """Leave two idle connections each owing one deferred reply: ``first``'s on
    the connection drain() reads first, ``second``'s on the other."""
    held = transport.write([("PING",)], Deadline.after(5))  # connection A, held
    transport.send_deferred([("INCR", "owed-b")], Deadline.after(5), first)  # new B
    assert transport.finish(held, 1, Deadline.after(5)) == [b"PONG"]  # A idle
    transport.send_deferred([("INCR", "owed-a")], Deadline.after(5), second)  # on A
    assert len(transport._idle) == 2


def test_drain_interrupted_on_one_connection_strands_no_other(
    redislock_client: redis.Redis,
) -> None:
    """A drain interrupted while it reads one connection's owed replies (a handler
    raising KeyboardInterrupt, or a soft time limit raised asynchronously during
    the read) must not strand the other connections it had taken off the idle
    list: their replies are still owed and must stay readable, later."""
    transport = Transport(redislock_client)
    answers: list[Any] = []

    def interrupt(result: Any) -> None:
        raise KeyboardInterrupt

    _two_owing_links(transport, interrupt, answers.append)
    with pytest.raises(KeyboardInterrupt):
        transport.drain(Deadline.after(5))
    # The second connection's reply is either handed over already, or still owed
    # on an idle connection that a later drain (the heartbeat's, flush() at exit)
    # reads.
    transport.drain(Deadline.after(5))
    assert answers == [[1]]
    assert not transport.owes_replies()


def test_reset_with_a_handler_that_raises_still_fails_every_other_owed_reply(
    redislock_client: redis.Redis,
) -> None:
    """reset() (after a failover) closes every idle connection and hands each
    reply still owed on them a connection error. A handler that raises
    KeyboardInterrupt (as _settle() allows: re-raised once the others have their
    answer) must not leave the other connections open, off the idle list, with
    their replies owed forever."""
    transport = Transport(redislock_client)
    answers: list[Any] = []

    def interrupt(result: Any) -> None:
        raise KeyboardInterrupt

    _two_owing_links(transport, interrupt, answers.append)
    links = list(transport._idle)
    with pytest.raises(KeyboardInterrupt):
        transport.reset()
    assert len(answers) == 1
    assert isinstance(answers[0], redis.ConnectionError)
    assert not transport.owes_replies()
    assert all(link.conn._sock is None for link in links)


def test_a_tls_write_the_server_takes_slowly_is_bounded_by_the_deadline(
    tmp_path: pathlib.Path,
) -> None:
    """Over TLS a write goes out record by record: a server that keeps taking the
    bytes, slowly, must not let each record have the whole time anew. The write
    gives up by its deadline, with a timeout."""
    tls = make_certificates(tmp_path)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert_file, tls.key_file)
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        raw, _ = listener.accept()
        with context.wrap_socket(raw, server_side=True) as conn:
            conn.settimeout(5)
            # 64 KB every 20 ms: each record goes well within any timeout, the
            # whole request (32 MB, more than the socket buffers take) in ten
            # seconds.
            while not done.is_set():
                try:
                    if not conn.recv(65_536):
                        return
                except OSError:
                    return
                time.sleep(0.02)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    port = listener.getsockname()[1]
    client = redis.Redis.from_url(
        f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={tls.ca_cert_file}",
        protocol=2,
    )
    try:
        transport = Transport(client)
        with pytest.raises(RedisTimeoutError, match="timed out writing to"):
            transport.execute([("SET", "slow", "x" * 32_000_000)], Deadline.after(1))
        assert transport._idle == []
    finally:
        done.set()
        thread.join(10)
        listener.close()
        client.close()


def test_the_releases_sent_again_after_a_switch_all_go_past_an_interruption() -> None:
    """Each request sent again as a switch of primary is learnt (they are taken off
    the list first) is sent, even past one interrupted by an exception raised
    asynchronously (a time limit), which is raised once they all have been; an
    ordinary failure of one is logged."""
    called: list[int] = []

    class Interrupted(BaseException):
        pass

    def interrupted() -> None:
        called.append(1)
        raise Interrupted

    def failing() -> None:
        called.append(2)
        raise ValueError("failed")

    with pytest.raises(Interrupted):
        transport_module._call_each([interrupted, failing, lambda: called.append(3)])
    assert called == [1, 2, 3]


def _kill_connection(killer: redis.Redis, link: Any) -> None:
    """Have the server close ``link``'s connection (``CLIENT KILL ADDR``), as a
    restart or its idle ``timeout`` would; the close has reached this process's
    kernel when this returns (the server closes it before it answers)."""
    host, port = link.conn._sock.getsockname()[:2]
    assert killer.client_kill(f"{host}:{port}")


@pytest.mark.skipif(not hasattr(select, "POLLRDHUP"), reason="Linux only: POLLRDHUP")
def test_a_deferred_request_goes_on_a_new_connection_once_the_server_closed_the_idle_one(
    redislock_server: RedisServer,
) -> None:
    """A request whose reply is read later is not written down an idle connection
    the server has closed (it would fail only when that reply is read): it goes on
    a new one. The replies the closed connection owed that came in before the
    close are handed over as they are, and the other idle connections, closed
    by the same cause, are dropped with it."""
    client = redislock_server.client()
    transport = transport_for(client)
    deadline = Deadline.after(5)
    key = uuid.uuid4().hex
    spare = transport.write([("PING",)], deadline)
    counted: list[Any] = []
    transport.send_deferred([("INCR", key)], deadline, counted.append)
    assert transport.finish(spare, 1, deadline) == [b"PONG"]
    killer = redislock_server.client()
    assert wait_until(lambda: killer.get(key) == b"1")
    (owing,) = transport._owed
    _kill_connection(killer, owing)
    assert killer.client_kill_filter(_type="normal", skipme=True) >= 1  # the spare too
    answered: list[Any] = []
    transport.send_deferred([("PING",)], deadline, answered.append)
    assert counted == [[1]]
    (fresh,) = transport._owed
    assert fresh is not owing
    assert fresh is not spare
    assert transport._idle == [fresh]
    transport.drain(deadline)
    assert answered == [[b"PONG"]]
    killer.close()
    client.close()


@pytest.mark.skipif(not hasattr(select, "POLLRDHUP"), reason="Linux only: POLLRDHUP")
def test_a_release_without_waiting_over_tls_goes_on_a_new_connection_once_the_server_closed_it(
    redislock_tls_server: TLSServer,
) -> None:
    """Over TLS too (on Linux: elsewhere the server's ``close_notify``, ahead of its
    close, hides it), a release without waiting is not written down the connection
    the server closed while the lock was held: its first answer frees the key."""
    # A client of its own: the URL's shared one may keep other tests' connections.
    client = redislock_tls_server.client()
    lock = RedisLock(client, uuid.uuid4().hex, ttl=30)
    transport = lock.transport
    assert lock.acquire(blocking=False)
    (idle,) = transport._idle
    assert type(idle.conn._sock) is ssl.SSLSocket
    killer = redislock_tls_server.client()
    _kill_connection(killer, idle)
    outcomes: list[str] = []
    lock.release(wait=False, then=outcomes.append)
    (fresh,) = transport._owed
    assert fresh is not idle
    transport.drain(Deadline.after(5))
    assert outcomes == ["released"]
    assert not held(killer, lock.key)
    killer.close()
    client.close()
