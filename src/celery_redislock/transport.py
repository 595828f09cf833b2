"""Bounded, retried round trips to one Redis server.

Every command the lock engine and the heartbeat send goes through a
:class:`Transport`: it keeps connections of its own, built from the settings of
the client it was made from (so a client handed in by a user lends its host,
credentials, TLS and database, but not its timeouts or retry policy), and runs
each round trip against a :class:`Deadline` chosen by the caller:

* connecting, the handshake, writing and every reply read are all bounded by the
  deadline, so a stalled or black-holed server costs the caller at most its own
  timeout, never a client library's default;
* a connection error or timeout closes that connection (its state is unknown);
* on a Sentinel-managed server, a connection that has had no answer for a while
  (:data:`PRIMARY_RECHECK`) is reused only once the Sentinels name its server as
  the primary, and a timeout closes the idle connections too: a primary frozen
  through a failover still takes writes when it comes back, until it is demoted;
* :func:`run` retries transient errors a bounded number of times within the
  deadline, and a request refused unrun by a stalled server (loading its data,
  busy with a long script, or a cluster node while its cluster is down) as often
  as the deadline allows. It is meant for requests the server recognises when they arrive a
  second time (the engine's scripts carry a request id for that), so a retried
  request whose first attempt did land never acts twice.

Redis errors leave this module as :class:`~celery_redislock.errors.LockBackendError`
through :func:`backend_errors`, the one place where they are translated.
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import logging
import math
import os
import re
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar, cast

import redis
from redis._parsers.base import BaseParser
from redis.backoff import NoBackoff
from redis.cluster import PRIMARY, RedisCluster
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MovedError,
    NoPermissionError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, SentinelConnectionPool

from celery_redislock.errors import LockBackendError
from celery_redislock.lookup import is_address, resolve

#: Deadline, in seconds, of a round trip whose caller set none of its own
#: (a non-blocking acquire, a release, an extend, a read).
DEFAULT_CALL_TIMEOUT = 5.0

#: How many times one request is sent at most (first try included).
ATTEMPTS = 3

#: Pause before the second and third try, in seconds (cut short by the deadline).
BACKOFF = (0.0, 0.02, 0.1)

#: Pause, in seconds, between the tries of a request the server refused because
#: it is still loading its data (``LOADING``): those are made until the deadline,
#: on the connection the refusal came on.
LOADING_PAUSE = 0.1

#: Codes of the errors by which a server refuses a request, none of which it ran,
#: for a state it leaves on its own or by an operator's hand: busy running a
#: script or function past ``busy-reply-threshold`` (``BUSY``), refusing writes
#: because it cannot save to disk (``MISCONF``, under
#: ``stop-writes-on-bgsave-error``) or has fewer replicas than
#: ``min-replicas-to-write`` (``NOREPLICAS``), or a Redis Cluster node refusing
#: every request about a key while the cluster is down (``CLUSTERDOWN``: a
#: primary has failed and no replica has taken its slots over yet). A cluster
#: node checks its state before it runs a command, and answers ``CLUSTERDOWN``
#: instead.
HELD_OFF = ("BUSY", "MISCONF", "NOREPLICAS", "CLUSTERDOWN")

#: Codes of the refusals (:data:`HELD_OFF`) that :func:`run` asks again about
#: until the deadline: states that usually end within a call's time (a long
#: script, a cluster's failover), not by an operator's hand.
STALLED = ("BUSY", "CLUSTERDOWN")

#: Errors after which the request may be sent again: the connection broke, the
#: reply did not come in time, the server is still loading its data, or it was
#: demoted to a replica by a failover (a fresh connection finds the new primary).
TRANSIENT: tuple[type[RedisError], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ReadOnlyError,
)

#: Idle connections a transport keeps for reuse; more are opened when needed.
MAX_IDLE = 8

#: How often, in seconds, a Sentinel-managed transport asks the Sentinels which
#: server is primary while it is in use: the first request due after this long
#: since the last question asks (one request a period, whichever comes first,
#: however busy the connections are). An operator's ``SENTINEL FAILOVER`` leaves
#: the old primary up and taking writes until the Sentinels demote it, seconds
#: later, so a connection in constant use would never notice the switch by a
#: silence. A connection that has had no answer for longer than this asks too
#: before it is reused: a primary frozen through a failover that comes back
#: still takes writes until the Sentinels demote it. While releases wait to be
#: sent again should a switch be learnt (:meth:`Transport.resend_on_switch`), the
#: heartbeat's lane of the transport asks as often, however idle the transport.
PRIMARY_RECHECK = 1.0
#: The most a request waits for the Sentinels' answer before it goes on (on the
#: connection it has, or a new one to the primary they last named), in seconds:
#: Sentinels that do not answer cost it no more.
PRIMARY_QUESTION = 0.25
#: How often, in seconds, a process about to exit asks the Sentinels again while
#: they fail its primary over, for releases that wait for the switch (see
#: :meth:`Transport.learn_switch`).
FAILOVER_POLL = 0.1
#: How long Sentinels that could not be asked are left alone, in seconds.
SENTINELS_REST = 10.0
#: How far back, in seconds, a release answered before a switch of primary was
#: learnt, or before a request to the primary first failed, is sent again to the
#: new primary (see :meth:`Transport.resend_on_switch` and
#: :meth:`Router.resend_on_move`): the old primary may have answered it after
#: its replica was promoted (the Sentinels announce a switch a moment after the
#: promotion, learnt here up to :data:`PRIMARY_RECHECK` later), or died before
#: its replica had it.
SWITCH_RESEND = 10.0
#: How long, in seconds, a message reservation's free (or a release by lease)
#: that a primary answered within :data:`SWITCH_RESEND` before it was found
#: failing waits to be sent again to the replica promoted in its place, at most:
#: a failover is learnt a ``cluster-node-timeout`` (Redis Cluster, 15 s by
#: default) or a ``down-after-milliseconds`` (Sentinel, 30 s by default) and an
#: election after the primary failed. (A lock's own release waits until its
#: hold would have expired.)
FAILOVER_WAIT = 60.0

#: The socket type whose descriptor :meth:`_Link.send` and :meth:`_Link.receive`
#: may write to and read from directly: a plain one, where a socket is a file descriptor (POSIX); ``None``
#: elsewhere (on Windows a socket is not one), where every call goes through the
#: socket's own methods.
_PLAIN_SOCKET: type[socket.socket] | None = socket.socket if os.name == "posix" else None

#: How :meth:`_Link.shut` asks whether the server closed an idle connection:
#: ``poll(2)`` without waiting (``None`` where there is none, on Windows: the
#: check is then skipped). The events it watches: data or a close come in, and
#: (Linux) the server's end shut; those that say the server closed it.
_POLL: Callable[[], Any] | None = getattr(select, "poll", None)
_PEER_SHUT: int = getattr(select, "POLLRDHUP", 0)
_WATCHED: int = getattr(select, "POLLIN", 0) | _PEER_SHUT
_HUNG_UP: int = getattr(select, "POLLHUP", 0) | getattr(select, "POLLERR", 0) | _PEER_SHUT

#: What to do with the replies of requests sent with :meth:`Transport.send_deferred`:
#: called once with the replies (error replies as exceptions among them), or with
#: the error that kept them from being read. It runs in whichever thread reads
#: them, so it must be quick and must not raise.
ReplyHandler = Callable[[list[Any] | RedisError], None]

#: The text of each of the engine's scripts by digest (filled in by
#: :class:`celery_redislock.scripts.Script`): a deferred request sent by digest
#: goes by text once the server may have lost its scripts (see
#: :meth:`Transport._closed_by_server`).
SCRIPT_TEXTS: dict[str, str] = {}

logger = logging.getLogger(__name__)


class Deadline:
    """A point in time (on the monotonic clock) by which a call must be over."""

    __slots__ = ("at",)

    def __init__(self, at: float) -> None:
        self.at = at

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        """The deadline ``seconds`` from now."""
        return cls(time.monotonic() + seconds)

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.at - time.monotonic()

    def expired(self) -> bool:
        """Whether the deadline has passed."""
        return time.monotonic() >= self.at

    def __repr__(self) -> str:
        return f"<Deadline in {self.remaining():.3f} s>"


#: How long a read under a :class:`MovableDeadline` blocks at most before it
#: looks at the deadline again, in seconds.
WATCH_STEP = 0.05


class MovableDeadline(Deadline):
    """A deadline that another thread may bring forward while a call waits on it
    (see :meth:`bring_forward`): a read under it blocks :data:`WATCH_STEP` at a
    time and looks again, so it ends soon after the deadline it has now. (A
    connect or a write keeps the deadline it had when it began.)"""

    __slots__ = ()

    def bring_forward(self, at: float) -> None:
        """End the call by ``at`` (on the monotonic clock), if that is earlier."""
        if at < self.at:
            self.at = at


class _Step(Exception):
    """A step of a read under a :class:`MovableDeadline` passed, not the deadline."""


#: How much shorter than the time left to a round trip's deadline, as a fraction
#: of it, a connection's socket timeout may be and still be kept (see
#: :meth:`_Link.bound`).
TIMEOUT_SLACK = 1 / 64

#: Connection settings a transport always sets itself: its own timeouts per
#: call, no retries inside redis-py (they would resend requests behind our
#: back), RESP2 replies as bytes, and no ``CLIENT SETINFO`` (library name and
#: version) in the handshake: two round trips on every new connection, for a
#: label. A redis-py that knows ``driver_info`` is given one with an empty name
#: and version, which it sends nothing for (redis-py 8 takes ``None`` for that
#: too, 7 takes ``None`` for its own default); an earlier one takes
#: ``lib_name=None, lib_version=None`` (deprecated since).
_OVERRIDES: dict[str, Any] = {
    "retry_on_timeout": False,
    "retry_on_error": [],
    "health_check_interval": 0,
    "decode_responses": False,
    "protocol": 2,
    "socket_keepalive": True,
    **(
        {"driver_info": importlib.import_module("redis.driver_info").DriverInfo("", "")}
        if importlib.util.find_spec("redis.driver_info") is not None
        else {"lib_name": None, "lib_version": None}
    ),
}


class Transport:
    """Connections of the lock engine's own to one Redis server.

    Arguments:
        client: the client whose connection settings (host, port, database,
            credentials, TLS) the transport copies.
    """

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self.connection_class: type[Any] = _bounded_handshake(pool.connection_class)
        #: The service name of a Sentinel-managed server, ``None`` for any other.
        self.service: str | None = None
        # A Sentinel-managed primary: the pool's proxy, which knows the Sentinels
        # (a Sentinel-managed replica pool picks its server as redis-py does).
        self._sentinel: Any = None
        if isinstance(pool, SentinelConnectionPool):
            self.service = pool.service_name
            if pool.is_master:
                self._sentinel = pool.connection_kwargs["connection_pool"]
        #: Whether the transport follows the Sentinels' switches of primary (a
        #: Sentinel-managed primary): see :meth:`resend_on_switch`.
        self.follows_switches = self._sentinel is not None
        #: The primary's address as the Sentinels last named it (``None`` before
        #: they were first asked, and for a server not managed by Sentinel).
        self.primary: tuple[str, int] | None = None
        # When a question to the Sentinels last failed, and when one was last
        # asked (on the monotonic clock).
        self._unanswered_at = -math.inf
        self._asked_at = -math.inf
        #: When a switch of primary was last learnt (on the monotonic clock).
        self.switched_at = -math.inf
        #: Whether the Sentinels, when last asked, were failing the primary over
        #: (a replica being promoted: they name the new primary once it has taken over).
        self.failing_over = False
        # The primary the Sentinels last named, found refusing writes (READONLY)
        # since: not connected to without asking them again.
        self._demoted: tuple[str, int] | None = None
        # Requests answered lately that are sent again should the primary turn
        # out to have been replaced meanwhile: (written at, until, send again).
        self._on_switch: collections.deque[tuple[float, float, Callable[[], object]]] = (
            collections.deque()
        )
        # When a request to the primary first failed, if none was answered
        # since: the requests answered within SWITCH_RESEND before then wait
        # for a switch, however long the Sentinels take to announce one.
        self._failed_at: float | None = None
        # Told when a switch of primary is learnt (the heartbeat's lanes).
        self._watchers: weakref.WeakSet[Any] = weakref.WeakSet()
        # The routers of a cluster whose requests this primary answered wait to
        # be sent again should their keys move (see Router.resend_on_move).
        self._move_watchers: weakref.WeakSet[Router] = weakref.WeakSet()
        # Server push notifications (RESP3 only) are the client's business; the
        # client's library name and version are given up with CLIENT SETINFO.
        kwargs = {
            k: v
            for k, v in pool.connection_kwargs.items()
            if "maint_notifications" not in k and k not in ("lib_name", "lib_version")
        }
        kwargs.update(_OVERRIDES, retry=Retry(NoBackoff(), 0))
        connect = kwargs.get("redis_connect_func")
        if getattr(connect, "__self__", None) is not None:
            # A method of another client (a Redis Cluster gives each node's client
            # its own on_connect): held weakly, or the transport would keep that
            # client, and so the one it was made for, alive (see transport_for).
            kwargs["redis_connect_func"] = _weakly(connect)
        self._kwargs = kwargs
        self._idle: list[Any] = []
        # Replies still owed on a connection, oldest first: (how many, handler,
        # the request's number in ``sends``).
        self._owed: dict[Any, list[tuple[int, ReplyHandler, int]]] = {}
        self._guard = threading.Lock()
        # Calls of _settle() under way (see reading_owed()).
        self._settling = 0
        self._pid = os.getpid()
        _every_transport.add(self)
        #: Whether the client this transport was made for (see :func:`transport_for`)
        #: has been garbage-collected. Whatever of the package still needs the
        #: transport keeps it (a request retried in the background, replies owed);
        #: once nothing does, its heartbeat lane and wake-up hubs retire, and its
        #: connections are closed.
        self.dropped = False
        #: Requests written to the server (round trips started), for tests and benchmarks.
        self.sends = 0
        #: Digests of the scripts this server has run for us (cached there).
        self.scripts: set[str] = set()
        #: The server's name for metrics, which does not change while the
        #: process runs: ``host:port`` (or the socket path), or for a
        #: Sentinel-managed server ``sentinel:<service name>``, whichever server
        #: is primary (a label per failover would grow without bound).
        self.name = self.describe()

    def describe(self, address: tuple[str, int] | None = None) -> str:
        """``host:port`` (or the socket path) of the server, for messages. A
        Sentinel-managed server is ``sentinel:<service name> at host:port``, the
        address being ``address`` (a connection's) or else the primary's as the
        Sentinels last named it."""
        if self.service is not None:
            address = address or self.primary
            return f"sentinel:{self.service}" + (
                f" at {address[0]}:{address[1]}" if address else ""
            )
        if "path" in self._kwargs:
            return str(self._kwargs["path"])
        return f"{self._kwargs.get('host', 'localhost')}:{self._kwargs.get('port', 6379)}"

    def execute(self, commands: Sequence[Sequence[Any]], deadline: Deadline) -> list[Any]:
        """Send ``commands`` in one write and read every reply: one round trip.

        A reply that is an error comes back as the ``ResponseError`` instance; a
        connection error or timeout raises, after closing the connection.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the round trip did not complete.
        """
        return self.finish(self.write(commands, deadline), len(commands), deadline)

    def write(
        self, commands: Sequence[Sequence[Any]], deadline: Deadline, packed: bytes | None = None
    ) -> _Link:
        """The first half of :meth:`execute`: write ``commands`` on a connection
        that stays the caller's until it reads their replies with :meth:`finish`.
        ``packed``: their encoding (:func:`pack`), if the caller has made it already.

        In between, the caller may do other work while the server answers; the
        connection is nobody else's, so the replies wait for it there.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the request could not be
                written (nothing was sent, or not all of it).
        """
        # _write(), inline: this is every request's path.
        try:
            link = self._checkout(deadline, settle=False)
        except RedisError as exc:
            ended(exc, ran=False)
            raise
        try:
            link.send(pack(commands) if packed is None else packed, deadline, self)
        except BaseException:
            self._checkin(link, False)
            raise
        self.sends += 1
        return link

    def discard(self, link: _Link) -> None:
        """The end of what :meth:`write` wrote on ``link`` for a caller that will
        not read its replies (an exception raised before it could): the
        connection is closed, and replies owed on it from before are failed."""
        self._checkin(link, False)

    def finish(self, link: _Link, count: int, deadline: Deadline, ready: bool = False) -> list[Any]:
        """The second half of :meth:`execute`: read the ``count`` replies of what
        :meth:`write` wrote on ``link``, then give the connection back. ``ready``:
        it was written a while ago, so the replies are likely in already.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the replies did not all
                come in time (the connection is then closed).
        """
        healthy = False
        try:
            # Replies owed on the link come first; read after the write, they cost
            # nothing while the server works on it.
            broken = self._settle(link, deadline) if self._owed else None
            if broken is not None:
                # This request was written: it may have run, whatever the
                # earlier one's error says of that one.
                raise RedisConnectionError(
                    f"connection lost before the reply was read: {broken}"
                ) from broken
            replies = link.read(count, deadline, self, ready)
            healthy = True
            return replies
        except BusyLoadingError:
            # Refused while the server loads its data: the connection is sound.
            healthy = True
            raise
        finally:
            self._checkin(link, healthy)

    def send_deferred(
        self,
        commands: Sequence[Sequence[Any]],
        deadline: Deadline,
        handler: ReplyHandler,
        packed: bytes | None = None,
    ) -> None:
        """Write ``commands`` now and read their replies later (``packed``: their
        encoding, as for :meth:`write`).

        The replies are read by the next request on the same connection (just
        after it writes its own), by :meth:`drain`, or by :meth:`flush`, and handed
        to ``handler``; if the connection breaks first, ``handler`` gets the error.
        When this returns, the request is in the kernel's send buffer: the server
        will run it even if this process dies before reading the reply.

        Raises:
            redis.ConnectionError, redis.TimeoutError: the request could not be
                written (nothing was sent, or not all of it).
        """
        # Replies owed on the link from before stay owed: they come first in the
        # stream, and the read that takes this request's reply takes them too.
        # A connection due for a check is checked first (see _still_primary()):
        # a release written to a server no longer the primary would leave the
        # lock on the new one held, and the answer read would vouch for the link.
        link = self._write(commands, deadline, packed)
        guard = self._guard
        # (Not ``with``: see _checkout().)
        guard.acquire()
        try:
            self.sends += 1
            self._owed.setdefault(link, []).append((len(commands), handler, self.sends))
            # _checkin() for a link that owes replies, under the same lock.
            if self._pid == _process_id:
                self._idle.append(link)
                return
        finally:
            guard.release()
        link.close()

    def owes_replies(self) -> bool:
        """Whether replies of deferred requests are still unread."""
        with self._guard:
            return bool(self._owed)

    def reading_owed(self) -> bool:
        """Whether replies of deferred requests are still unread, or being read
        (their handlers not all called yet)."""
        with self._guard:
            return bool(self._owed) or self._settling > 0

    def drain(self, deadline: Deadline, written_by: int | None = None) -> int:
        """Read the replies owed on idle connections and hand them to their
        handlers; return how many connections were read.

        With ``written_by`` (a value :attr:`sends` had), only connections owing
        a reply to a request written by then are read: a later one is left for
        the connection's next request, which reads it for free.
        """
        with self._guard:
            owing = [
                link
                for link in self._idle
                if (owed := self._owed.get(link))
                and (written_by is None or owed[0][2] <= written_by)
            ]
            self._idle = [link for link in self._idle if link not in owing]
        left = list(owing)
        try:
            while left:
                link = left.pop(0)
                healthy = False
                try:
                    healthy = self._settle(link, deadline) is None
                finally:
                    self._checkin(link, healthy)
        finally:
            # Interrupted (a handler's SystemExit, an asynchronous exception): the
            # connections not read yet go back as they were, still owing, to be
            # read by their next request or the next drain.
            for link in left:
                self._checkin(link, True)
        return len(owing)

    def reset(self) -> None:
        """Close every idle connection (after a failover, the next call reconnects).

        Called when a server refused a write as a replica (``READONLY``): on a
        Sentinel-managed server, the next request asks the Sentinels which server
        is primary, however recently they failed to answer, and does not fall
        back on the one they named last (see :meth:`_connect`)."""
        with self._guard:
            idle, self._idle = self._idle, []
            if self._sentinel is not None:
                self._demoted = self.primary
                self._unanswered_at = self._asked_at = -math.inf
        self._close(idle, "connection reset before its reply was read")

    def watch_switches(self, watcher: Any) -> None:
        """Call ``watcher.primary_switched()`` (quick, never raising) whenever this
        transport learns that the Sentinels replaced the primary, from the thread
        that learns it; held weakly. Nothing for a server not managed by Sentinel."""
        if self._sentinel is not None:
            with self._guard:
                self._watchers.add(watcher)

    def resend_on_switch(
        self, written_at: float, until: float, again: Callable[[], object]
    ) -> bool:
        """Call ``again`` should this transport learn, within :data:`SWITCH_RESEND`
        of ``written_at`` and before ``until`` (both on the monotonic clock), that
        the Sentinels replaced the primary: a request written at ``written_at`` and
        answered may have been answered by the old primary after its replica was
        promoted, and never reach the new one. At once if a switch was learnt
        after it was written. Once a request to the primary fails, the requests
        answered within :data:`SWITCH_RESEND` before then wait until their
        ``until``, however long the Sentinels take to announce a failover (a
        ``down-after-milliseconds``, 30 s by default, and an election): the
        primary may have died before its replica had them. Nothing for a server
        not managed by Sentinel.

        Returns whether ``again`` waits for a switch: the Sentinels are then to be
        asked once a :data:`PRIMARY_RECHECK` until it no longer does, whether or
        not requests come (see :meth:`primary_check_at`), which the heartbeat's
        lane of this transport does.

        ``again`` must be quick and must not raise (it runs in the thread that
        learns the switch); it must be safe to run for a request that did land.
        """
        if self._sentinel is None:
            return False
        with self._guard:
            now = time.monotonic()
            if self.switched_at < written_at:
                entries = self._on_switch
                since = self._resend_since(now)
                while entries and entries[0][0] < since:
                    entries.popleft()
                entries.append((written_at, until, again))
                return True
        _call_quietly(again)
        return False

    @property
    def checks_primary(self) -> bool:
        """Whether the primary may be asked about, however idle the transport
        (see :meth:`primary_check_at`): a Sentinel-managed one, or a cluster
        primary whose requests wait to be sent again should their keys move."""
        return self.follows_switches or bool(self._move_watchers)

    def primary_check_at(self) -> float | None:
        """When (on the monotonic clock) the Sentinels are next to be asked which
        server is primary for the requests that wait for a switch (see
        :meth:`resend_on_switch`), however idle the transport is: a
        :data:`PRIMARY_RECHECK` after they were last asked, or after a rest of
        :data:`SENTINELS_REST` once they did not answer. ``None`` when no request
        waits (those that can no longer be sent again are dropped).

        A cluster primary's: when it is next to be asked whether it still
        serves the keys of the requests it answered that wait to be sent again
        should their keys move (see :meth:`Router.check_moves`)."""
        if self._sentinel is None:
            if not self._move_watchers:
                return None
            times = [router.move_check_at(self) for router in list(self._move_watchers)]
            return min((at for at in times if at is not None), default=None)
        with self._guard:
            now = time.monotonic()
            entries = self._on_switch
            since = self._resend_since(now)
            while entries and entries[0][0] < since:
                entries.popleft()
            if not any(until > now for _, until, _ in entries):
                entries.clear()
                return None
            return max(self._asked_at + PRIMARY_RECHECK, self._unanswered_at + SENTINELS_REST)

    def _resend_since(self, now: float) -> float:
        """Since when the requests answered wait for a switch (see
        :meth:`resend_on_switch`): :data:`SWITCH_RESEND` before ``now``, or
        before a request to the primary first failed. Under ``_guard``."""
        failed_at = self._failed_at
        return (now if failed_at is None else min(now, failed_at)) - SWITCH_RESEND

    def _failing(self) -> None:
        """A request to a Sentinel-managed primary failed (see :meth:`resend_on_switch`)."""
        if self._sentinel is not None and self._failed_at is None:
            self._failed_at = time.monotonic()

    def check_primary(self) -> None:
        """Ask the Sentinels which server is primary (for :data:`PRIMARY_QUESTION`
        at most) if :meth:`primary_check_at` says it is time: a switch learnt so
        sends again the requests that wait for one. Sentinels that do not answer
        are left alone for :data:`SENTINELS_REST`; never raises a
        :class:`~redis.RedisError`. While no switch is learnt, the primary is
        sent a ``PING`` too (for :data:`PRIMARY_QUESTION` at most): one that
        fails keeps the requests waiting for a switch however long the
        Sentinels take to announce it, in a process that sends nothing (see
        :meth:`resend_on_switch`); one answered says the primary is up. A
        cluster primary is asked instead whether it still serves the keys of
        the requests that wait to be sent again should they move (see
        :meth:`Router.check_moves`)."""
        if self._sentinel is None:
            for router in list(self._move_watchers):
                router.check_moves(self)
            return
        at = self.primary_check_at()
        now = time.monotonic()
        if at is None or at > now:
            return
        with self._guard:
            self._asked_at = max(self._asked_at, now)
        switched = self.switched_at
        self._ask_quietly(now, PRIMARY_QUESTION)
        if self.switched_at == switched:
            try:
                self.execute([("PING",)], Deadline.after(PRIMARY_QUESTION))
            except RedisError:
                pass  # Counted as failing as its connection ended (see _failing).

    def learn_switch(self, first: Deadline, wait: Deadline) -> None:
        """If requests wait for a switch of primary (see :meth:`resend_on_switch`),
        ask the Sentinels which server is primary, by ``first``, however recently
        they were asked: a process about to exit learns the switch that it would
        have learnt within :data:`PRIMARY_RECHECK` had it gone on running, and
        those requests go again (handed to the heartbeat, whose requests
        :func:`flush` sends next). While the Sentinels answer that a failover of this primary is
        under way (its replica promoted, not announced yet), they are asked again
        every :data:`FAILOVER_POLL` until they name the new primary or ``wait``
        passes, each time for :data:`PRIMARY_QUESTION` at most. Never raises a
        :class:`~redis.RedisError`."""
        if self.primary_check_at() is None:
            return
        deadline = first
        while True:
            now = time.monotonic()
            budget = min(PRIMARY_QUESTION, deadline.at - now)
            if budget <= 0:
                return
            switched = self.switched_at
            if not self._ask_quietly(now, budget) or self.switched_at != switched:
                return
            if not self.failing_over or wait.remaining() <= FAILOVER_POLL:
                return
            time.sleep(FAILOVER_POLL)
            deadline = wait

    def _ask_quietly(self, now: float, budget: float) -> bool:
        """Ask the Sentinels which server is primary, for ``budget`` seconds at most
        from ``now``; whether they named one. A failure is logged, and Sentinels
        that did not answer are left alone for :data:`SENTINELS_REST`."""
        try:
            self._ask_primary(Deadline(now + budget))
            return True
        except RedisError as exc:
            if _sentinels_silent(exc):
                self._unanswered_at = now
            logger.debug(
                "celery_redislock: could not ask the Sentinels which server is the "
                "primary of %r: %s",
                self.service,
                exc,
            )
            return False

    def close_idle(self) -> None:
        """Close the idle connections that owe no replies. One connection found
        closed by the server says the others likely are too (a restart, ``CLIENT
        KILL``, its ``timeout`` for idle clients): the next request then makes a
        new one rather than try them one by one. Those that owe replies stay, to
        be read (or to fail) in their turn."""
        with self._guard:
            idle = [link for link in self._idle if link not in self._owed]
            self._idle = [link for link in self._idle if link in self._owed]
        for link in idle:
            link.close()

    def connection(self, deadline: Deadline) -> Any:
        """A connected connection of this transport's own, for a subscriber.

        The caller owns it and must ``disconnect()`` it; reads and writes on it
        are bounded with :meth:`bound`.
        """
        conn = self.connection_class(**self._kwargs)
        self._connect(conn, deadline)
        return conn

    @staticmethod
    def bound(conn: Any, seconds: float) -> None:
        """Let the next socket operation on ``conn`` block at most ``seconds``."""
        sock = getattr(conn, "_sock", None)
        if sock is None:
            raise RedisConnectionError("connection closed")
        sock.settimeout(max(0.001, seconds))

    def _connect(self, conn: Any, deadline: Deadline) -> None:
        remaining = deadline.remaining()
        if remaining <= 0:
            raise RedisTimeoutError(f"no time left to connect to {self.describe()}")
        # The TCP connect (and a TLS handshake) gets the time left; each command of
        # the handshake (AUTH, SELECT, ...) what is left of it when it goes.
        conn.socket_connect_timeout = remaining
        conn.socket_timeout = remaining
        conn.handshake_deadline = deadline
        try:
            if self._sentinel is not None:
                # redis-py would ask the Sentinels with their own timeouts and retries.
                conn.connect_to(self._primary_for_connect(deadline))
            else:
                conn.connect()
        finally:
            conn.handshake_deadline = None

    def _primary_for_connect(self, deadline: Deadline) -> tuple[str, int]:
        """The address a new connection goes to: the primary the Sentinels name.

        Once they have named one, they are asked for :data:`PRIMARY_QUESTION` at
        most (and half the time left to ``deadline``), and not at all while they
        are left alone after a question they did not answer (:data:`SENTINELS_REST`):
        the connection then goes to the primary they named last, unless that
        server has refused a write as a replica since (see :meth:`reset`). Their
        outage alone does not stop the locks. Before they have named one, they
        get the whole deadline.

        Raises:
            redis.TimeoutError, redis.ConnectionError: see :func:`_discover_master`.
        """
        known = self.primary
        if known is None or known == self._demoted:
            return self._ask_primary(deadline)
        now = time.monotonic()
        if now - self._unanswered_at > SENTINELS_REST:
            budget = min(PRIMARY_QUESTION, max(0.0, deadline.at - now) / 2)
            try:
                return self._ask_primary(Deadline(now + budget))
            except RedisError as exc:
                if not _sentinels_silent(exc):
                    # The primary they named last is down: no use connecting there.
                    raise
                self._unanswered_at = now
                logger.debug(
                    "celery_redislock: could not ask the Sentinels which server is the "
                    "primary of %r (connecting to %s, named last): %s",
                    self.service,
                    f"{known[0]}:{known[1]}",
                    exc,
                )
        return known

    def _ask_primary(self, deadline: Deadline) -> tuple[str, int]:
        """The primary's address, asked of the Sentinels by ``deadline`` and kept
        as :attr:`primary`. Idle connections to any other address are closed: the
        server they reach is no longer the primary, and may still take writes
        until the Sentinels demote it (a primary frozen through a failover).

        Raises:
            redis.TimeoutError, redis.ConnectionError: see :func:`_discover_master`.
        """
        asked_at = time.monotonic()
        failing_over: list[bool] = []
        address = _discover_master(self._sentinel, deadline, failing_over)
        again: list[Callable[[], object]] = []
        with self._guard:
            self._asked_at = max(self._asked_at, asked_at)
            self.failing_over = any(failing_over)
            self._demoted = None
            switched = self.primary is not None and self.primary != address
            self.primary = address
            stale = [link for link in self._idle if link.address != address]
            if stale:
                self._idle = [link for link in self._idle if link.address == address]
            if switched:
                now = time.monotonic()
                self.switched_at = now
                since = self._resend_since(now)
                again = [
                    resend
                    for written_at, until, resend in self._on_switch
                    if written_at >= since and until > now
                ]
                self._on_switch.clear()
                self._failed_at = None
        if switched:
            logger.info(
                "celery_redislock: the Sentinels name %s the new primary of %r: sending "
                "again %d release(s) answered lately",
                f"{address[0]}:{address[1]}",
                self.service,
                len(again),
            )
            with self._guard:
                watchers = list(self._watchers)
            # Each one called, even past an exception raised asynchronously (a
            # time limit) in another: the requests were taken off the list.
            _call_each([*again, *(watcher.primary_switched for watcher in watchers)])
        if stale:
            logger.info(
                "celery_redislock: the Sentinels name %s the primary of %r: closing %d "
                "connection(s) to another server",
                f"{address[0]}:{address[1]}",
                self.service,
                len(stale),
            )
            self._close(stale, f"{self.describe(stale[0].address)} is no longer the primary")
        return address

    def _still_primary(self, link: _Link, deadline: Deadline) -> bool:
        """Whether ``link``, an idle connection of a Sentinel-managed transport,
        may be reused: its server is the primary the Sentinels last named, after
        they were asked (for :data:`PRIMARY_QUESTION` at most, and half the time
        left to ``deadline``) if the link has had no answer within
        :data:`PRIMARY_RECHECK`, or if no request of this transport has asked
        them within that time (one request a period asks, busy connections or
        not), whatever the request, a deferred one too.

        Sentinels that cannot be asked now leave the connection in use (they are
        not asked again for :data:`SENTINELS_REST`): their outage alone does not
        stop the locks. A link found stale is closed.
        """
        now = time.monotonic()
        due = now - link.used > PRIMARY_RECHECK
        if not due and now - self._asked_at > PRIMARY_RECHECK:
            with self._guard:
                # One request of those due at once asks; the others go on.
                due = now - self._asked_at > PRIMARY_RECHECK
                if due:
                    self._asked_at = now
        if due and now - self._unanswered_at > SENTINELS_REST:
            self._ask_quietly(now, min(PRIMARY_QUESTION, max(0.0, deadline.at - now) / 2))
        if link.address == self.primary or self.primary is None:
            return True
        self._close([link], f"{self.describe(link.address)} is no longer the primary")
        return False

    def _close(self, links: list[_Link], why: str) -> None:
        """Close ``links``; the replies owed on them fail with ``why``. A
        handler's ``SystemExit`` is raised once every one is closed."""
        raised: BaseException | None = None
        for link in links:
            try:
                self._fail_owed(link, RedisConnectionError(why))
            except BaseException as exc:
                raised = raised or exc
            finally:
                link.close()
        if raised is not None:
            raise raised

    def _timed_out(self) -> None:
        """A request timed out. On a Sentinel-managed server that may be a primary
        stalled or cut off while the Sentinels fail over: the idle connections to
        it are closed too, so the next request asks them which server is primary."""
        if self._sentinel is not None:
            self.close_idle()

    def _write(
        self, commands: Sequence[Sequence[Any]], deadline: Deadline, packed: bytes | None = None
    ) -> _Link:
        """Write ``commands`` whole on a connection (its owed replies left unread)
        and return it. A connection that could not be opened, or a write refused
        before its first byte, did not run the request (see :func:`may_have_run`);
        a write cut short may have run the commands it sent whole.

        The idle connection taken is first checked, without a round trip, for a
        close by the server (see :meth:`_Link.shut`). A request written down one
        it closed would fail only when its reply is read, later: for a release,
        a moment in which the lock stays held after the caller moved on (a task
        whose result is stored). :meth:`write` needs no check: its caller reads
        the reply at once, and sends the request again on a new connection.
        """
        try:
            link = self._checkout(deadline, settle=False, probe=True)
        except RedisError as exc:
            ended(exc, ran=False)
            raise
        if not self.scripts:
            # The server may have lost its scripts (see _closed_by_server()).
            commands, packed = _by_text(commands, packed)
        try:
            link.send(pack(commands) if packed is None else packed, deadline, self)
        except BaseException:
            self._checkin(link, False)
            raise
        return link

    def _checkout(self, deadline: Deadline, settle: bool = True, probe: bool = False) -> _Link:
        """An idle connection (or a new one); with ``settle``, the replies it owes
        are read first (and a connection found broken is replaced). With ``probe``,
        an idle connection the server has closed is not taken (see
        :meth:`_closed_by_server`)."""
        guard = self._guard
        # acquire() and release(), not ``with``: half the cost, on every request.
        guard.acquire()
        try:
            if self._pid != _process_id:
                # A forked child never talks over its parent's sockets.
                self._idle, self._owed, self._pid = [], {}, _process_id
            link = self._idle.pop() if self._idle else None
        finally:
            guard.release()
        while probe and link is not None and link.shut():
            self._closed_by_server(link, deadline)
            with self._guard:
                link = self._idle.pop() if self._idle and self._pid == _process_id else None
        if link is not None and self._sentinel is not None:
            try:
                fresh = self._still_primary(link, deadline)
            except BaseException:
                # Interrupted while the Sentinels were asked (a soft time limit):
                # the connection goes back as it was, with the replies it owes.
                with self._guard:
                    if self._pid == _process_id:
                        self._idle.append(link)
                        link = None
                if link is not None:
                    self._close([link], "connection dropped before its reply was read")
                raise
            if not fresh:
                link = None
        if link is not None and settle and self._owed and self._settle(link, deadline) is not None:
            link = None
        if link is None:
            conn = self.connection_class(**self._kwargs)
            try:
                self._connect(conn, deadline)
            except BaseException:
                self._failing()
                conn.disconnect()
                raise
            link = _Link(conn)
            if self._sentinel is not None:
                link.address = (conn.host, conn.port)
        return link

    def _closed_by_server(self, link: _Link, deadline: Deadline) -> None:
        """Close ``link``, an idle connection the server has closed, and the other
        idle ones that owe no replies: a restart, ``CLIENT KILL`` or the server's
        idle ``timeout`` closes them all (see :meth:`close_idle`). The replies it
        owes that came in before the close are handed over first; the others fail
        (a release is then sent again in the background).

        A restart closes them too, and the server has lost its scripts: the
        digests known are forgotten, so that the request about to be written, and
        the next ones, go by text until answered (a release refused ``NOSCRIPT``
        would be sent again only once that answer is read). They are forgotten
        after the replies owed are handed over: an answer of the server before
        its restart says nothing of the one after it."""
        try:
            self._settle(link, deadline)
        finally:
            self.scripts.clear()
            try:
                link.close()
            finally:
                self.close_idle()

    def _checkin(self, link: _Link, healthy: bool) -> None:
        if not healthy:
            self._failing()
            try:
                self._fail_owed(
                    link, RedisConnectionError("connection lost before its reply was read")
                )
            finally:
                link.close()
            return
        if self._sentinel is not None:
            # It had an answer now (see _still_primary()).
            link.used = time.monotonic()
            self._failed_at = None
        guard = self._guard
        # (Not ``with``: see _checkout().)
        guard.acquire()
        try:
            # A connection that owes replies stays, whatever the count, until read.
            if self._pid == _process_id and (len(self._idle) < MAX_IDLE or link in self._owed):
                self._idle.append(link)
                return
        finally:
            guard.release()
        link.close()

    def _settle(self, link: _Link, deadline: Deadline) -> RedisError | None:
        """Read the replies owed on ``link`` and hand them over; the error that broke
        it, if it broke (it is then closed).

        Every handler gets its answer. One that raises ``SystemExit`` or
        ``KeyboardInterrupt`` has it raised again once the others have theirs; a
        read interrupted by an exception raised asynchronously (a soft time
        limit) leaves the link closed, and the handlers not yet called get a
        connection error (a release then goes again in the background).
        """
        guard = self._guard
        # (Not ``with``: see _checkout().)
        guard.acquire()
        try:
            owed = self._owed.pop(link, None)
            if not owed:
                return None
            self._settling += 1
        finally:
            guard.release()
        broken: RedisError | None = None
        raised: BaseException | None = None
        handed = 0
        try:
            for count, handler, _sent in owed:
                result: list[Any] | RedisError
                if broken is None:
                    try:
                        result = link.read(count, deadline, self, True)  # ready
                    except BusyLoadingError as exc:
                        # That request's answer, every reply of it read.
                        result = exc
                    except RedisError as exc:
                        broken = result = exc
                else:
                    result = broken
                handed += 1
                # _hand_over(), inline: this reads every release that did not wait.
                try:
                    handler(result)
                except Exception:
                    logger.exception("celery_redislock: a deferred reply's handler failed")
                except BaseException as exc:
                    raised = raised or exc
        finally:
            try:
                if handed < len(owed):
                    link.close()
                    error = RedisConnectionError("interrupted before its reply was read")
                    for _count, handler, _sent in owed[handed:]:
                        _hand_over(handler, error)
            finally:
                guard.acquire()
                try:
                    self._settling -= 1
                finally:
                    guard.release()
        if raised is not None:
            raise raised
        return broken

    def _fail_owed(self, link: _Link, error: RedisError) -> None:
        with self._guard:
            owed = self._owed.pop(link, None)
        raised: BaseException | None = None
        for _count, handler, _sent in owed or ():
            try:
                _hand_over(handler, error)
            except BaseException as exc:
                # As in _settle(): every handler gets its answer first.
                raised = raised or exc
        if raised is not None:
            raise raised


def _discover_master(
    pool: Any, deadline: Deadline, failing_over: list[bool] | None = None
) -> tuple[str, int]:
    """The address of the primary that the Sentinels of ``pool`` (a Sentinel
    connection pool) name, asked over connections of transports of their own, by
    ``deadline``.

    The Sentinels are asked in turn, as redis-py does, and the first to name a
    primary in good standing (``Sentinel.check_master_state``) goes to the front of
    the list. Each gets an even share of the time left, with one share kept for
    connecting to the primary: one that does not answer cannot take it all.

    ``failing_over``, if given, is told whether the Sentinel that named the
    primary is failing it over (``True`` appended): a replica is being promoted,
    and is named once it has taken over.

    Raises:
        redis.TimeoutError: the deadline passed first.
        redis.sentinel.MasterNotFoundError: no Sentinel named a primary in good
            standing (a connection error: the request may be sent again).
    """
    manager = pool.sentinel_manager
    service = pool.service_name
    sentinels = list(manager.sentinels)
    errors: list[str] = []
    # Whether a Sentinel answered, naming no primary in good standing.
    answered = False
    for number, sentinel in enumerate(sentinels):
        remaining = deadline.remaining()
        if remaining <= 0:
            break
        share = Deadline.after(remaining / (len(sentinels) - number + 1))
        transport = transport_for(sentinel)
        try:
            # What redis-py asks (a Sentinel's ACL may allow just that).
            (reply,) = transport.execute([("SENTINEL", "MASTERS")], share)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            errors.append(f"{transport.describe()}: {exc}")
            continue
        if not isinstance(reply, list):
            errors.append(f"{transport.describe()}: {reply}")
            continue
        states = (_sentinel_state(item) for item in reply if isinstance(item, list))
        state = next((state for state in states if state and state["name"] == service), None)
        if state is None or not manager.check_master_state(state, service):
            answered = True
            continue
        # Put this Sentinel at the front, as redis-py does.
        at = next((i for i, known in enumerate(manager.sentinels) if known is sentinel), 0)
        if at:
            manager.sentinels[0], manager.sentinels[at] = sentinel, manager.sentinels[0]
        if failing_over is not None:
            failing_over.append(state["failing_over"])
        forced = getattr(manager, "_force_master_ip", None)
        return (forced if forced is not None else state["ip"]), state["port"]
    if deadline.expired():
        raise RedisTimeoutError(f"no Sentinel named the primary of {service!r} in time")
    error = MasterNotFoundError(
        f"No master found for {service!r}" + (f": {'; '.join(errors)}" if errors else "")
    )
    setattr(error, _ANSWERED, answered)
    raise error


#: The attribute of a :class:`MasterNotFoundError` that says a Sentinel answered
#: (the primary is down, a failover under way), rather than none could be asked.
_ANSWERED = "_celery_redislock_answered"


def _sentinels_silent(exc: RedisError) -> bool:
    """Whether a question to the Sentinels that failed with ``exc`` went unanswered
    (they are then left alone for :data:`SENTINELS_REST`), rather than answered
    with no primary in good standing."""
    return not getattr(exc, _ANSWERED, False)


def _sentinel_state(reply: list[Any]) -> dict[str, Any] | None:
    """What ``Sentinel.check_master_state`` reads of one primary's state in a
    ``SENTINEL MASTERS`` reply (a flat list of names and values), with its name and
    address; ``None`` if malformed."""
    try:
        fields = {
            bytes(reply[i]).decode(): bytes(reply[i + 1]).decode()
            for i in range(0, len(reply) - 1, 2)
        }
        flags = set(fields["flags"].split(","))
        return {
            "name": fields["name"],
            "ip": fields["ip"],
            "port": int(fields["port"]),
            "is_master": "master" in flags,
            "is_sdown": "s_down" in flags,
            "is_odown": "o_down" in flags,
            "failing_over": "failover_in_progress" in flags,
            "num-other-sentinels": int(fields["num-other-sentinels"]),
        }
    except (KeyError, TypeError, ValueError):
        return None


class _BoundedHandshake:
    """Mixed into the connection class of a transport (see :func:`_bounded_handshake`).

    redis-py sends the commands of a connection's handshake (``AUTH``,
    ``CLIENT SETNAME``, ``SELECT``, a cluster replica's ``READONLY``) one after
    another, each waiting for its reply with the connection's socket timeout. While
    :attr:`handshake_deadline` is set (by :meth:`Transport._connect`), each gets
    the time left to it instead, so the handshake as a whole ends by the deadline.
    """

    #: The deadline of the connect under way (``None`` after it).
    handshake_deadline: Deadline | None = None

    def send_command(self, *args: Any, **kwargs: Any) -> None:
        deadline = self.handshake_deadline
        if deadline is not None:
            remaining = deadline.remaining()
            if remaining <= 0:
                raise RedisTimeoutError(f"no time left for the handshake ({args[0]})")
            sock = getattr(self, "_sock", None)
            if sock is not None:
                sock.settimeout(remaining)
        cast(Any, super()).send_command(*args, **kwargs)


class _LookedUp(redis.connection.Connection):
    """Mixed in under a TCP connection class (see :func:`_bounded_handshake`).

    While a connect is bounded by :attr:`_BoundedHandshake.handshake_deadline`,
    the host name is looked up by :func:`~celery_redislock.lookup.resolve` within
    it, and the TCP connection made to each address found in turn, each with the
    time left. A TLS layer above still checks the server's certificate against the
    name.
    """

    def _connect(self) -> socket.socket:
        connect: Callable[[], socket.socket] = super()._connect
        deadline: Deadline | None = getattr(self, "handshake_deadline", None)
        name = self.host
        if deadline is None or is_address(name):
            return connect()
        error: OSError = TimeoutError(f"no time left to connect to {name}")
        for address in resolve(name, self.port, deadline.remaining()):
            remaining = deadline.remaining()
            if remaining <= 0:
                break
            # The TCP connect and what follows it on the socket (a TLS handshake)
            # get what is left after the lookup.
            self.host = address
            self.socket_connect_timeout = self.socket_timeout = remaining
            try:
                return connect()
            except OSError as exc:
                error = exc
            finally:
                self.host = name
        raise error


def _weakly(method: Any) -> Callable[[Any], None]:
    """A connection's ``redis_connect_func`` that calls the bound ``method`` while
    its object lives, and the connection's own handshake after (``on_connect``,
    what redis-py calls when no such function is given)."""
    held = weakref.WeakMethod(method)

    def connect(connection: Any) -> None:
        bound = held()
        if bound is None:
            connection.on_connect()
        else:
            bound(connection)

    return connect


_bounded_classes: dict[type[Any], type[Any]] = {}


def _bounded_handshake(connection_class: type[Any]) -> type[Any]:
    """``connection_class`` with :class:`_BoundedHandshake` mixed in, and for a TCP
    one :class:`_LookedUp` under its own ``_connect`` (one class per class)."""
    bounded = _bounded_classes.get(connection_class)
    if bounded is None:
        name = f"Bounded{connection_class.__name__}"
        bases: tuple[type[Any], ...] = (_BoundedHandshake, connection_class)
        if connection_class is redis.connection.Connection:
            bases = (_BoundedHandshake, _LookedUp)
        elif issubclass(connection_class, redis.connection.Connection):
            bases += (_LookedUp,)
        bounded = _bounded_classes.setdefault(connection_class, type(name, bases, {}))
    return bounded


class _Incomplete(Exception):
    """The bytes read so far end inside a reply."""


def _by_text(
    commands: Sequence[Sequence[Any]], packed: bytes | None
) -> tuple[Sequence[Sequence[Any]], bytes | None]:
    """``commands`` with those sent by digest (``EVALSHA``) of a script whose text
    is known (:data:`SCRIPT_TEXTS`) sent by text, and their encoding (``packed``,
    or ``None`` once changed)."""
    if not any(command[0] == "EVALSHA" and command[1] in SCRIPT_TEXTS for command in commands):
        return commands, packed
    return [
        ("EVAL", SCRIPT_TEXTS[command[1]], *command[2:])
        if command[0] == "EVALSHA" and command[1] in SCRIPT_TEXTS
        else command
        for command in commands
    ], None


class _Link:
    """One connection of a transport, with the bytes read from it but not yet parsed.

    The connection is a redis-py one: it connects, authenticates, selects the
    database and speaks TLS. Once connected, requests are written to its socket
    and replies read from it here, with a small RESP2 parser for the few reply
    shapes the engine's commands have, several times cheaper than the general one.

    The connection is closed by :meth:`close`, or else as the link is dropped,
    however it is dropped. A transport last reached from a reference cycle (a
    heartbeat and its lanes refer to each other) is freed by the garbage
    collector, with the links it still holds: left to the collector, a socket may
    be finalized before the connection that would close it, an unclosed-socket
    ``ResourceWarning``.
    """

    __slots__ = ("__weakref__", "address", "closer", "conn", "poller", "timeout", "unread", "used")

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        #: Closes the connection once: called by :meth:`close`, or as the link
        #: is dropped. Not at exit: the flush reads what the connections owe then.
        self.closer = weakref.finalize(self, conn.disconnect)
        self.closer.atexit = False
        self.unread = b""
        # The socket's timeout as last set here (-1: not yet).
        self.timeout = -1.0
        #: For a Sentinel-managed server: the address connected to, and when the
        #: last answer was read (on the monotonic clock).
        self.address: tuple[str, int] | None = None
        self.used = time.monotonic()
        #: The poll object of :meth:`shut`, made at its first call.
        self.poller: Any = None

    def bound(self, deadline: Deadline, transport: Transport, step: bool = False) -> None:
        """Let the next socket operation block until ``deadline`` at most (with
        ``step``, a read under a :class:`MovableDeadline`: :data:`WATCH_STEP` at most).

        Setting a socket's timeout costs a system call, so it is set a little
        short of the time left, and kept while it is no more than the time left
        and short of it by at most :data:`TIMEOUT_SLACK` of it: round trips with
        deadlines of the same length (every request without one of its own) set
        it once. An operation may so give up a little early, never late.
        """
        remaining = deadline.at - time.monotonic()
        if remaining <= 0:
            self.close()
            transport._timed_out()
            raise RedisTimeoutError(
                f"no reply from {transport.describe(self.address)} within the deadline"
            )
        sock = self.conn._sock
        if sock is None:
            raise RedisConnectionError("connection closed")
        if step and type(deadline) is MovableDeadline:
            # To the deadline itself at the last step (not short of it): a step
            # that ends before it is read on.
            timeout = min(remaining, WATCH_STEP)
            if timeout != self.timeout:
                self.timeout = timeout
                sock.settimeout(timeout)
        elif not remaining * (1 - TIMEOUT_SLACK) <= self.timeout <= remaining:
            self.timeout = max(0.001, remaining * (1 - TIMEOUT_SLACK / 2))
            sock.settimeout(self.timeout)

    def send(self, data: bytes, deadline: Deadline, transport: Transport) -> None:
        """Write ``data`` (whole requests) by ``deadline``.

        CPython polls a socket that has a timeout before each send and receive, a
        system call that is wasted when the kernel can take the bytes, or has them,
        at once. So on a plain POSIX socket (not TLS, not wrapped) a write is first
        tried as one ``write(2)`` (and a receive that is ``ready`` as one
        ``read(2)``, see :meth:`receive`). The socket always has a timeout, so
        neither blocks: what they do not finish is left to the socket's method,
        bounded by its timeout.

        Raises:
            redis.ConnectionError, redis.TimeoutError: it failed or ran out of
                time (the connection is then closed). Refused before a byte was
                written, the request did not run (see :func:`may_have_run`).
        """
        try:
            # bound()'s test of the timeout kept, inline: this runs on every request.
            remaining = deadline.at - time.monotonic()
            if not remaining * (1 - TIMEOUT_SLACK) <= self.timeout <= remaining:
                self.bound(deadline, transport)
            sock = self.conn._sock
            if type(sock) is _PLAIN_SOCKET:
                try:
                    written = os.write(sock.fileno(), data)
                except BlockingIOError:
                    written = 0
                except OSError as exc:
                    # Nothing was sent: the request did not run.
                    raise ended(self._failed(exc, "writing to", transport), ran=False) from None
                if written == len(data):
                    return
                sock.sendall(memoryview(data)[written:])
            else:
                sock.sendall(data)
        except RedisError:
            self.close()
            raise
        except (OSError, AttributeError) as exc:
            raise self._failed(exc, "writing to", transport) from None

    def receive(self, deadline: Deadline, transport: Transport, ready: bool = False) -> bytes:
        """Receive what has come in by ``deadline`` (nothing: the server closed the
        connection). ``ready``: the replies of a request written a while ago, which
        are likely in already: taken with one ``read(2)`` (see :meth:`send`).

        Raises:
            redis.ConnectionError, redis.TimeoutError: it failed or ran out of
                time (the connection is then closed).
            _Step: a step of a read under a :class:`MovableDeadline` passed, not
                the deadline (the connection is sound).
        """
        try:
            # bound()'s test of the timeout kept, inline: this runs on every request.
            remaining = deadline.at - time.monotonic()
            if (
                not remaining * (1 - TIMEOUT_SLACK) <= self.timeout <= remaining
                or type(deadline) is MovableDeadline
            ):
                self.bound(deadline, transport, step=True)
            sock = self.conn._sock
            if ready and type(sock) is _PLAIN_SOCKET:
                try:
                    return os.read(sock.fileno(), 65536)
                except BlockingIOError:
                    pass
            received: bytes = sock.recv(65536)
            return received
        except RedisError:
            self.close()
            raise
        except TimeoutError as exc:
            if type(deadline) is MovableDeadline and not deadline.expired():
                # A step: the connection is sound, the read goes on (see read()).
                raise _Step from None
            raise self._failed(exc, "reading from", transport) from None
        except (OSError, AttributeError) as exc:
            raise self._failed(exc, "reading from", transport) from None

    def shut(self) -> bool:
        """Whether the server has closed this idle connection: its close (or a
        reset) has come in. Asked without waiting or a round trip, with one
        ``poll(2)``, before a request whose reply is read later is written on it.

        Replies owed on it that came in are no sign of a close. On Linux the
        close is seen even behind them (the server's end shut, ``POLLRDHUP``).
        Elsewhere, when data came in, the first byte is peeked at (nothing: the
        server closed it), so a close behind unread replies is not seen there,
        nor on TLS, where the server's ``close_notify`` comes before its close.
        Where there is no ``poll(2)`` (Windows), nothing is checked.
        """
        sock = self.conn._sock
        if sock is None:
            return True
        poller = self.poller
        if poller is None:
            if _POLL is None:
                return False
            poller = self.poller = _POLL()
            poller.register(sock, _WATCHED)
        events = poller.poll(0)
        if not events:
            return False
        if events[0][1] & _HUNG_UP:
            return True
        if _PEER_SHUT or type(sock) is not _PLAIN_SOCKET:
            return False
        try:
            # It does not wait: the poll found something to read.
            return not sock.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    def _failed(self, exc: BaseException, doing: str, transport: Transport) -> RedisError:
        """Close the connection after ``exc``, raised while ``doing`` it (``"writing
        to"``, ``"reading from"``), and return the error that says so."""
        self.close()
        if isinstance(exc, TimeoutError):
            transport._timed_out()
            return RedisTimeoutError(f"timed out {doing} {transport.describe(self.address)}")
        return RedisConnectionError(
            f"error while {doing} {transport.describe(self.address)}: {exc}"
        )

    def close(self) -> None:
        self.unread = b""
        self.timeout = -1.0
        self.poller = None
        self.closer()

    def read(
        self, count: int, deadline: Deadline, transport: Transport, ready: bool = False
    ) -> list[Any]:
        """Read ``count`` replies; error replies come back as exceptions among them.
        ``ready``: they were asked for a while ago, so they are likely in already
        (see :meth:`receive`).

        Raises:
            redis.ConnectionError, redis.TimeoutError: the replies did not all
                come in time, or the connection broke (it is then closed); also an
                error reply of the connection kind (a refused password, too many
                clients: the connection is closed; the server still loading its
                data: it stays open, every reply read).
        """
        if count == 1:
            # The usual read, one reply (a script's, a deferred release's), whole in
            # what came in already or in one receive: taken without the loop below,
            # which a reply that is an error, or not in yet, goes on to.
            data = self.unread
            if not data:
                try:
                    data = self.receive(deadline, transport, ready)
                except _Step:
                    pass
                else:
                    if not data:
                        self.close()
                        raise RedisConnectionError(
                            f"{transport.describe(self.address)} closed the connection"
                        )
                    self.unread, ready = data, False
            if data:
                try:
                    reply, at = _parse(data, 0)
                except _Incomplete:
                    pass
                else:
                    if not isinstance(reply, RedisError):
                        self.unread = data[at:]
                        return [reply]
        replies: list[Any] = []
        loading: BusyLoadingError | None = None
        # Whether a command of the request was not refused so: it may have run.
        ran = False
        # Parsed from an offset, and the rest kept once: many replies in one read
        # (a heartbeat round's) cost linear time, not a copy of the rest per reply.
        data, at = self.unread, 0
        while len(replies) < count:
            # Nothing read yet is the usual start: receive without a parse first.
            if at < len(data):
                try:
                    reply, at = _parse(data, at)
                except _Incomplete:
                    pass
                else:
                    if isinstance(reply, RedisError) and not isinstance(reply, ResponseError):
                        # Refused: this command did not run.
                        if not isinstance(reply, BusyLoadingError):
                            self.close()
                            raise ended(reply, ran)
                        # The connection stays in step, and serves once the data
                        # is in: the request's other replies are read too.
                        loading = loading or reply
                    else:
                        ran = True
                    replies.append(reply)
                    continue
            try:
                received = self.receive(deadline, transport, ready)
            except _Step:
                # The deadline may have been brought forward: receive() looks at it.
                continue
            ready = False
            if not received:
                self.close()
                raise RedisConnectionError(
                    f"{transport.describe(self.address)} closed the connection"
                )
            data, at = data[at:] + received, 0
        self.unread = data[at:]
        if loading is not None:
            # (The data came in while the commands were read: some ran.)
            raise ended(loading, ran)
        return replies


def parse_replies(data: bytes) -> tuple[list[Any], bytes]:
    """The complete RESP2 replies at the start of ``data`` (error replies as
    exception instances), and the bytes left after them: the start of a reply
    still to come, if any. For readers of their own, such as a subscription."""
    replies, at = [], 0
    while at < len(data):
        try:
            reply, at = _parse(data, at)
        except _Incomplete:
            break
        replies.append(reply)
    return replies, data[at:]


#: The small numbers of replies by their digits (``b"-1"`` to ``b"1023"``).
_SMALL_INTS = {str(n).encode(): n for n in range(-1, 1024)}


#: Arrays of ``n`` integer items, by ``n`` (a few: the scripts' replies), matched
#: whole by one expression rather than item by item.
_INTEGERS = tuple(re.compile(rb":(-?[0-9]+)\r\n" * n) for n in range(8))


#: How Redis 6.2 quotes a ``READONLY`` refusal in the error of the script whose
#: write it refused (Redis 7 replies with the refusal itself, ``READONLY ...``).
_SCRIPT_READ_ONLY = ": -READONLY "


def _parse(data: bytes, at: int) -> tuple[Any, int]:
    """One RESP2 reply from ``data[at:]``, and where it ends.

    Replies are as redis-py gives them without decoding: bytes, int, ``None``,
    lists, and error replies as exception instances.

    Raises:
        _Incomplete: ``data`` ends before the reply does.
    """
    start, end = at, data.find(b"\r\n", at)
    if end < 0:
        raise _Incomplete
    kind, line, at = data[start], data[start + 1 : end], end + 2
    # Most numbers in replies are small (a script's outcome, a length): looked
    # up, not parsed, they cost a fraction of int().
    number = _SMALL_INTS.get(line)
    if kind == 0x3A:  # ':' integer
        return (int(line) if number is None else number), at
    if kind == 0x24:  # '$' bulk string
        size = int(line) if number is None else number
        if size < 0:
            return None, at
        if len(data) < at + size + 2:
            raise _Incomplete
        return data[at : at + size], at + size + 2
    if kind == 0x2A:  # '*' array
        size = int(line) if number is None else number
        if size < 0:
            return None, at
        whole = _INTEGERS[size].match(data, at) if size < len(_INTEGERS) else None
        if whole is not None:
            # Integers only, all in: the usual reply of a script, matched at once.
            return list(map(int, whole.groups())), whole.end()
        items: list[Any] = []
        for _item in range(size):
            if at < len(data) and data[at] == 0x3A:
                # An integer item, parsed here: most arrays the scripts return
                # are of integers, and a call per item would double their cost.
                end = data.find(b"\r\n", at)
                if end < 0:
                    raise _Incomplete
                line = data[at + 1 : end]
                number = _SMALL_INTS.get(line)
                items.append(int(line) if number is None else number)
                at = end + 2
            else:
                item, at = _parse(data, at)
                items.append(item)
        return items, at
    if kind == 0x2B:  # '+' simple string
        return line, at
    if kind == 0x2D:  # '-' error
        text = line.decode("utf-8", errors="replace")
        error = BaseParser.parse_error(text)  # type: ignore[no-untyped-call]
        if _SCRIPT_READ_ONLY in text and type(error) is ResponseError:
            # A replica refuses every write: the script, stopped at its first,
            # wrote nothing, as with any READONLY.
            error = ReadOnlyError(text)
        return error, at
    raise RedisConnectionError(f"protocol error: unexpected reply {data[start:end]!r}")


#: The RESP header of every argument and array length :func:`pack` uses ready-made
#: (``"$12"``, ``"*5"``): one lookup instead of formatting a number each time.
_LENGTHS = tuple(f"${n}" for n in range(1024))
_ARRAYS = tuple(f"*{n}" for n in range(64))


def pack(commands: Sequence[Sequence[Any]]) -> bytes:
    """The RESP encoding of ``commands``, for one write.

    The engine's arguments are only ``str``, ``bytes`` and ``int``; encoding them
    here is several times cheaper than the general-purpose encoder of redis-py,
    and this runs on every request. The usual request (ASCII text and integers,
    fewer than 64 arguments of fewer than 1,024 characters each) is built as
    text, its headers and arguments joined by ``CRLF``, and encoded once;
    anything else takes the general encoder.
    """
    parts: list[str] = []
    append = parts.append
    try:
        for command in commands:
            append(_ARRAYS[len(command)])
            for arg in command:
                kind = type(arg)
                if kind is not str:
                    if kind is not int:
                        return _pack_any(commands)
                    arg = str(arg)  # (an int's digits: its type is int itself)
                append(_LENGTHS[len(arg)])
                append(arg)
    except IndexError:  # a longer argument, or more of them, than the tables hold
        return _pack_any(commands)
    append("")
    text = "\r\n".join(parts)
    return text.encode() if text.isascii() else _pack_any(commands)


def _pack_any(commands: Sequence[Sequence[Any]]) -> bytes:
    """:func:`pack` for arguments of any type it accepts."""
    parts = []
    for command in commands:
        parts.append(b"*%d\r\n" % len(command))
        for arg in command:
            kind = type(arg)
            if kind is str:
                data = arg.encode()
            elif kind is bytes:
                data = arg
            elif kind is int:
                data = b"%d" % arg
            elif isinstance(arg, str):
                data = str.encode(arg)
            elif isinstance(arg, bytes):
                data = bytes(arg)
            elif isinstance(arg, int) and not isinstance(arg, bool):
                data = b"%d" % int(arg)
            else:
                raise TypeError(f"cannot send a {type(arg).__name__} to Redis: {arg!r}")
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def _call_quietly(again: Callable[[], object]) -> None:
    """Call ``again`` (see :meth:`Transport.resend_on_switch`); whatever exception
    it raises is logged, never propagated."""
    try:
        again()
    except Exception:
        logger.exception("celery_redislock: sending a request again after a switch failed")


def _call_each(calls: Sequence[Callable[[], object]]) -> None:
    """:func:`_call_quietly` each of ``calls``, every one of them even if one is
    interrupted by a ``BaseException`` (one raised asynchronously, a time limit);
    the first such is raised once they have all been called."""
    raised: BaseException | None = None
    for call in calls:
        try:
            _call_quietly(call)
        except BaseException as exc:
            raised = raised or exc
    if raised is not None:
        raise raised


def _hand_over(handler: ReplyHandler, result: list[Any] | RedisError) -> None:
    """Call a reply handler; whatever it raises is logged, never propagated."""
    try:
        handler(result)
    except Exception:
        logger.exception("celery_redislock: a deferred reply's handler failed")


# This process's id, kept here rather than asked of the kernel on every request.
_process_id = os.getpid()


def _forked() -> None:
    global _process_id
    _process_id = os.getpid()


os.register_at_fork(after_in_child=_forked)

_transports: weakref.WeakKeyDictionary[redis.Redis, Transport] = weakref.WeakKeyDictionary()
_transports_guard = threading.Lock()


#: What :func:`_client_dropped` calls with a transport whose client was
#: garbage-collected: the heartbeat and the wake-up hubs register theirs on
#: import. Each runs in whatever thread collected the client, possibly amid a
#: garbage collection that interrupted any code (one holding a lock of the
#: package, say), so it must never wait for a lock, nor start a thread, nor raise.
_on_drop: list[Callable[[Transport], None]] = []


def transport_for(client: redis.Redis) -> Transport:
    """The transport of ``client`` (one per client object and process).

    Once ``client`` is garbage-collected the transport is marked
    :attr:`~Transport.dropped`: what was made for it alone (its heartbeat lane
    and thread, its wake-up hubs, its connections) goes once nothing of the
    package needs it any more."""
    transport = _transports.get(client)
    if transport is None:
        with _transports_guard:
            transport = _transports.get(client)
            if transport is None:
                transport = _transports[client] = Transport(client)
                # It refers to the transport, never to the client; and not at
                # exit, when the flush needs every lane and transport as it is.
                weakref.finalize(client, _client_dropped, transport).atexit = False
    return transport


def _client_dropped(transport: Transport) -> None:
    """``transport``'s client was garbage-collected: mark it, and tell the
    heartbeat and the wake-up hubs (see :data:`_on_drop`)."""
    transport.dropped = True
    for hook in list(_on_drop):
        try:
            hook(transport)
        except Exception:  # pragma: no cover - the hooks do not raise
            logger.debug("celery_redislock: a hook for a dropped client failed", exc_info=True)


#: A client the engine accepts: one server (plain, Sentinel-managed, TLS, unix
#: socket) or a Redis Cluster.
Client = redis.Redis | RedisCluster


class Router:
    """Finds the transport a lock key's requests go to.

    For one server that is its transport; for a Redis Cluster, the transport of
    the primary that owns the key's slot, as the cluster client's slot map says.
    """

    def __init__(self, client: Client) -> None:
        # Weak: a router is cached per client (see router_for), and must not
        # keep it alive; whoever uses the router holds the client.
        self._client = weakref.ref(client)
        #: The one transport of a single server, ``None`` for a cluster (looked up
        #: once: this is hot, and a check of the client's kind is slow).
        self.single = None if isinstance(client, RedisCluster) else transport_for(client)
        # The slot map's refresh under way, or the last one (see redirected()).
        self._refresh: _SlotRefresh | None = None
        self._refresh_guard = threading.Lock()
        # The questions of where the slots of a primary that failed live now, by
        # that primary, under way or the last (see relocate()).
        self._questions: dict[Transport, _SlotQuestion] = {}
        # Requests answered lately, sent again should the slot map come to put
        # their key on another primary than the one that answered them (see
        # resend_on_move): (written at, until, that primary's transport, the
        # key's slot, send again), about oldest first.
        self._answered: collections.deque[_Answered] = collections.deque()
        self._answered_guard = threading.Lock()
        # How long the list may grow before it is pruned whole (see resend_on_move).
        self._prune_at = _PRUNE_FLOOR
        # When this router last changed the slot map (on the monotonic clock).
        self._moved_at = -math.inf
        # By the primary that answered them: when the last of those requests
        # was written, its key, and until when the last of them may be sent
        # again; when that primary was last asked whether it still serves them
        # (see check_moves); and when a request to it first failed, if it has
        # not answered since (see relocate): those it answered within
        # SWITCH_RESEND before then wait for the failover, however long it takes.
        self._latest: dict[Transport, tuple[float, str, float]] = {}
        self._checked: dict[Transport, float] = {}
        self._failed_at: dict[Transport, float] = {}
        _every_router.add(self)

    @property
    def client(self) -> Client:
        """The client this router routes for."""
        client = self._client()
        if client is None:  # pragma: no cover - its users hold it
            raise RuntimeError("the client of this router was garbage-collected")
        return client

    def transport(self, key: str) -> Transport:
        """The transport for ``key``'s slot."""
        if self.single is not None:
            return self.single
        client = cast(RedisCluster, self.client)
        return self._serving(client, client.keyslot(key))  # type: ignore[no-untyped-call]

    @staticmethod
    def _serving(client: RedisCluster, slot: int) -> Transport:
        """The transport of the primary the slot map names for ``slot``."""
        node = client.nodes_manager.get_node_from_slot(slot)
        return transport_for(client.get_redis_connection(node))

    def transports(self) -> list[Transport]:
        """Every primary's transport (one for a single server)."""
        if self.single is not None:
            return [self.single]
        client = cast(RedisCluster, self.client)
        primaries = client.get_primaries()  # type: ignore[no-untyped-call]
        return [transport_for(client.get_redis_connection(n)) for n in primaries]

    def asked(self, exc: AskError) -> Transport | None:
        """The transport of the primary an ``ASK`` reply names: the one a slot half-way
        through a migration (resharding) has already moved the key to. Requests sent
        there must follow an ``ASKING``. ``None`` for a node the cluster client does
        not know (the caller's error then stands)."""
        if self.single is not None:
            return None
        client = cast(RedisCluster, self.client)
        node = client.get_node(host=exc.host, port=exc.port)  # type: ignore[no-untyped-call]
        if node is None:
            return None
        return transport_for(client.get_redis_connection(node))

    def redirected(self, exc: BaseException, deadline: Deadline | None = None) -> bool:
        """Learn from ``exc`` where keys live now; return whether a new try may help.

        A single server has nowhere else to go. On a cluster, a ``MOVED`` reply
        updates the slot map; a connection error or timeout (a primary died, a
        failover may be under way) refreshes it from the cluster.

        The refresh is waited for until ``deadline`` at most (by default the
        deadline of the round trip that raised ``exc``, see :func:`run`): it asks
        the cluster's nodes with the cluster client's own timeouts, so it runs in
        a thread of its own and goes on there if the caller cannot wait for it;
        the slot map is then new for the next request. A refresh that fails, or
        does not end in time, is ``False``: the caller's error stands.
        """
        if self.single is not None:
            return False
        client = cast(RedisCluster, self.client)
        if isinstance(exc, MovedError):
            move_slot(client.nodes_manager, exc)
            self._map_changed(exc.slot_id)
            return True
        if isinstance(exc, AskError):
            # A slot half-way through a migration: its keys settle shortly.
            return True
        if isinstance(exc, TRANSIENT):
            if deadline is None:
                deadline = getattr(exc, _DEADLINE, None) or Deadline.after(DEFAULT_CALL_TIMEOUT)
            with self._refresh_guard:
                refresh = self._refresh
                if refresh is None or refresh.done.is_set():
                    refresh = self._refresh = _SlotRefresh(client, self._map_changed)
            return refresh.wait(deadline)
        return False

    def relocate(
        self, key: str, failed: Transport, deadline: Deadline, inline: bool = False
    ) -> bool:
        """After ``failed``, the primary the slot map names for ``key``, could not
        be reached: learn from the cluster's other nodes which primaries serve
        the slots the map gives ``failed`` now, and put them in the slot map (the
        locks of every such slot, their renewals too, follow); return whether the
        map names another primary for ``key`` now.

        The nodes are asked (``CLUSTER SLOTS``) one after another, primaries
        first, never ``failed``, each for :data:`SLOT_QUESTION` at most, and the
        first answer counts: a frozen or cut-off node (one that answers nothing,
        not even a refusal) costs no more than that. The question runs in a
        thread of its own, one per failed primary at a time, and is waited for until
        ``deadline`` at most: one whose caller's time is up (a past ``deadline``)
        goes on there, so the next request finds the new primary. ``inline``: it
        runs in the caller's thread instead, until ``deadline`` (a process about
        to exit may start no thread). A single server has nowhere else to go:
        ``False``.
        """
        if self.single is not None:
            return False
        client = cast(RedisCluster, self.client)
        with self._answered_guard:
            if failed in self._latest:
                self._failed_at.setdefault(failed, time.monotonic())
        if inline:
            _SlotQuestion.ask(client, failed, self._map_changed, deadline)
            return self.transport(key) is not failed
        with self._refresh_guard:
            question = self._questions.get(failed)
            if question is None or question.done.is_set():
                # Those answered are forgotten.
                self._questions = {t: q for t, q in self._questions.items() if not q.done.is_set()}
                question = self._questions[failed] = _SlotQuestion(
                    client, failed, self._map_changed
                )
        question.done.wait(max(0.0, deadline.remaining()))
        return self.transport(key) is not failed

    def resend_on_move(
        self,
        transport: Transport,
        key: str,
        written_at: float,
        until: float,
        again: Callable[[], object],
    ) -> None:
        """Call ``again`` should the slot map, changed by this router within
        :data:`SWITCH_RESEND` of ``written_at`` and before ``until`` (both on the
        monotonic clock), put ``key`` on another primary than ``transport``'s,
        which answered a request about it written at ``written_at``. A primary
        may answer a release and die before its replica, promoted in its place,
        has it (a replica is sent writes once they have run), or come back from
        a freeze and take it before it learns that its replica was promoted: the
        hold would stay on the new primary until its TTL. The change is learnt
        when a request of this process finds the key's primary gone or moved (a
        renewal, an acquire, a release: see :meth:`redirected` and
        :meth:`relocate`), or when the heartbeat's lane of ``transport`` asks
        it, a :data:`MOVE_RECHECK` after the last such request at first, then
        as often, while any waits to be sent again (see :meth:`check_moves`),
        however idle the process; at once if the map
        changed after ``written_at``. Once a request to ``transport`` fails (see
        :meth:`relocate`), the requests it answered within :data:`SWITCH_RESEND`
        before then wait for the change until ``until``, however long after them
        it comes: a failover is learnt a ``cluster-node-timeout`` and an election
        after the primary failed. ``again`` as for
        :meth:`Transport.resend_on_switch`. Nothing on a single server.

        The caller has the lane watch (see
        :meth:`~celery_redislock.heartbeat.Heartbeat.watch_primary`)."""
        if self.single is not None:
            return
        slot = cast(RedisCluster, self.client).keyslot(key)  # type: ignore[no-untyped-call]
        with self._answered_guard:
            entries = self._answered
            now = time.monotonic()
            while entries and not self._waits(entries[0], now):
                entries.popleft()
            if len(entries) >= self._prune_at:
                # Those that no longer wait, kept behind one that waits for its
                # primary's failover (answered by another primary, or earlier):
                # pruned whole once the list has doubled since, so that it holds
                # what waits and no more, for a constant cost per request.
                self._answered = entries = collections.deque(
                    entry for entry in entries if self._waits(entry, now)
                )
                self._prune_at = max(_PRUNE_FLOOR, 2 * len(entries))
            entries.append((written_at, until, transport, slot, again))
            # It answered: not failing (any more).
            self._failed_at.pop(transport, None)
            latest = self._latest.get(transport)
            if latest is None:
                self._latest[transport] = (written_at, key, until)
            elif latest[0] <= written_at:
                self._latest[transport] = (written_at, key, max(until, latest[2]))
            else:
                self._latest[transport] = (*latest[:2], max(until, latest[2]))
            moved = self._moved_at >= written_at
        transport._move_watchers.add(self)
        if moved:
            self._map_changed()

    def _waits(self, entry: _Answered | tuple[float, float, Transport], now: float) -> bool:
        """Whether a request answered lately (see :meth:`resend_on_move`), written
        at, until and by whom its first three items say, may still be sent again:
        written within :data:`SWITCH_RESEND` before now, or before a request to
        that primary first failed, and not past its ``until``. Under
        ``_answered_guard``."""
        written_at, until, transport = entry[:3]
        return until > now and written_at >= self._failed_at.get(transport, now) - SWITCH_RESEND

    def _forget(self, transport: Transport) -> None:
        """No request ``transport`` answered waits any more: it is asked no more
        (see :meth:`move_check_at`). Under ``_answered_guard``."""
        self._latest.pop(transport, None)
        self._checked.pop(transport, None)
        self._failed_at.pop(transport, None)

    def move_check_at(self, transport: Transport) -> float | None:
        """When (on the monotonic clock) ``transport``'s primary is next to be
        asked whether it still serves the keys of the requests it answered
        lately (see :meth:`check_moves`); ``None`` when none waits to be sent
        again (see :meth:`resend_on_move`)."""
        with self._answered_guard:
            latest = self._latest.get(transport)
            if latest is None:
                return None
            # Nothing can be sent again through a client that was dropped.
            waits = self._client() is not None
            if not waits or not self._waits((latest[0], latest[2], transport), time.monotonic()):
                self._forget(transport)
                return None
            return max(latest[0], self._checked.get(transport, -math.inf)) + MOVE_RECHECK

    def check_moves(self, transport: Transport, now_by: Deadline | None = None) -> None:
        """If :meth:`move_check_at` says it is time, ask ``transport``'s primary
        about the key of the last request it answered that waits to be sent
        again should its key move (a ``PTTL``, within :data:`SLOT_QUESTION`): an
        answer ``MOVED`` (it no longer serves the slot: it came back from a
        freeze as a replica) puts the slot where it says, and no answer at all
        (it died, or hangs) has the other nodes asked where its slots live now
        (see :meth:`relocate`); either sends again the requests whose key lives
        elsewhere now. A process that makes no request of its own learns so of
        a failover, however long it takes once the primary is found gone (see
        :meth:`resend_on_move`). ``now_by``: ask now, whenever it was last
        asked, all in the caller's thread and by then (a process about to exit,
        see :func:`flush`). Never raises a :class:`~redis.RedisError`."""
        at = self.move_check_at(transport)
        now = time.monotonic()
        if at is None or (at > now and now_by is None):
            return
        with self._answered_guard:
            self._checked[transport] = now
            latest = self._latest.get(transport)
        if latest is None:
            return
        key = latest[1]
        deadline = Deadline.after(SLOT_QUESTION)
        if now_by is not None:
            deadline = Deadline(min(deadline.at, now_by.at))
        try:
            [reply] = run(transport, [("PTTL", key)], deadline, 1)
        except RedisError as exc:
            if isinstance(exc, TRANSIENT):
                # Waited for until the deadline at most: it goes on in its thread
                # (asked in this one by a process about to exit).
                inline = now_by is not None
                self.relocate(key, transport, now_by or deadline, inline)
            return
        if isinstance(reply, MovedError):
            self.redirected(reply)
        elif not isinstance(reply, RedisError):
            # It answered as the key's primary: not failing (any more).
            with self._answered_guard:
                self._failed_at.pop(transport, None)

    def learn_moves(self, deadline: Deadline) -> None:
        """Ask each primary of this process whose releases wait to be sent again
        should their keys move (see :meth:`resend_on_move`) whether it still
        serves them, now and one after another, all by ``deadline`` (see
        :meth:`check_moves`): a process about to exit learns the failover or
        move that the heartbeat would have learnt within :data:`MOVE_RECHECK`
        had it gone on running, and those releases go again (handed to the
        heartbeat, whose requests :func:`flush` sends next). Never raises a
        :class:`~redis.RedisError`."""
        with self._answered_guard:
            waiting = [t for t in self._latest if t._pid == _process_id]
        for transport in waiting:
            if deadline.expired():
                return
            self.check_moves(transport, deadline)

    def _map_changed(self, slot: int | None = None) -> None:
        """This router changed the slot map (only where ``slot`` lives, if given):
        send again the requests answered lately (see :meth:`resend_on_move`)
        whose key it puts on another primary than the one that answered them
        now. Quick; never raises a :class:`~redis.RedisError`."""
        now = time.monotonic()
        with self._answered_guard:
            self._moved_at = now
            recent = [
                entry
                for entry in self._answered
                if (slot is None or entry[3] == slot) and self._waits(entry, now)
            ]
        if not recent:
            return
        try:
            client = cast(RedisCluster, self.client)
            moved = [entry for entry in recent if self._serving(client, entry[3]) is not entry[2]]
        except Exception as exc:  # pragma: no cover - the client is gone
            logger.debug("celery_redislock: could not look the slot map up: %s", exc)
            return
        if not moved:
            return
        with self._answered_guard:
            # Each sent again once: taken off the list (those added meanwhile stay).
            gone = {id(entry) for entry in moved}
            self._answered = collections.deque(
                entry for entry in self._answered if id(entry) not in gone
            )
            # A primary none of whose requests wait any more is asked no more.
            waiting = {entry[2] for entry in self._answered if self._waits(entry, now)}
            for transport in {entry[2] for entry in moved} - waiting:
                self._forget(transport)
        logger.info(
            "celery_redislock: the cluster's slot map moved the keys of %d release(s) "
            "answered lately to another primary: sending them again there",
            len(moved),
        )
        _call_each([entry[4] for entry in moved])


#: A request answered lately (see :meth:`Router.resend_on_move`): written at,
#: until, the transport that answered it, its key's slot, what sends it again.
_Answered = tuple[float, float, Transport, int, Callable[[], object]]

#: How many requests answered lately a router keeps before it first prunes the
#: whole list of them (see :meth:`Router.resend_on_move`).
_PRUNE_FLOOR = 64


#: How often, in seconds, a Redis Cluster primary that answered releases within
#: :data:`SWITCH_RESEND` is asked whether it still serves their keys (see
#: :meth:`Router.check_moves`), by the heartbeat's lane of its transport.
MOVE_RECHECK = 1.0

#: How long, in seconds, one Redis Cluster node is given to say which primary
#: serves a slot (``CLUSTER SLOTS``) when the primary the slot map names could
#: not be reached (see :meth:`Router.relocate`).
SLOT_QUESTION = 0.5


class _SlotQuestion:
    """Which primaries serve the slots of a primary that failed now, as the first
    node of the cluster (not that one) that answers says, put in the cluster
    client's slot map: in a thread of its own (see :meth:`Router.relocate`)."""

    def __init__(self, client: RedisCluster, failed: Transport, moved: Callable[[], None]) -> None:
        self.done = threading.Event()
        thread = threading.Thread(
            target=self._run,
            args=(client, failed, moved),
            name="celery-redislock-cluster-slot",
            daemon=True,
        )
        thread.start()

    def _run(self, client: RedisCluster, failed: Transport, moved: Callable[[], None]) -> None:
        try:
            self.ask(client, failed, moved)
        finally:
            self.done.set()

    @staticmethod
    def ask(
        client: RedisCluster,
        failed: Transport,
        moved: Callable[[], None],
        deadline: Deadline | None = None,
    ) -> None:
        """Ask the nodes, in the caller's thread, by ``deadline`` if given (each
        node :data:`SLOT_QUESTION` at most). Never raises."""
        try:
            nodes = sorted(
                client.get_nodes(),  # type: ignore[no-untyped-call]
                key=lambda node: node.server_type != PRIMARY,
            )
            for node in nodes:
                transport = transport_for(client.get_redis_connection(node))
                if transport is failed:
                    continue
                question = Deadline.after(SLOT_QUESTION)
                if deadline is not None:
                    if deadline.expired():
                        return
                    question = Deadline(min(question.at, deadline.at))
                try:
                    [reply] = run(transport, [("CLUSTER", "SLOTS")], question, 1)
                except RedisError:
                    continue
                served = _served(reply, node.host)
                if not served:
                    continue
                # Every slot the map gives the failed node (not only this one)
                # goes where the answer puts it: the locks of the others follow
                # too, their renewals among them.
                manager = client.nodes_manager
                failed_names = {
                    each.name
                    for each in nodes
                    if each.redis_connection is not None
                    and _transports.get(each.redis_connection) is failed
                }
                for low, high, host, port in served:
                    for slot in range(low, high + 1):
                        owners = manager.slots_cache.get(slot)
                        if owners and owners[0].name in failed_names:
                            move_slot(manager, MovedError(f"{slot} {host}:{port}"))
                moved()
                return
        except Exception as exc:
            logger.debug(
                "celery_redislock: could not learn where the slots of %s live: %s",
                failed.describe(),
                exc,
            )


def _served(reply: Any, host: str) -> list[tuple[int, int, str, int]]:
    """The slot ranges of a ``CLUSTER SLOTS`` reply, each with the address of its
    primary (an empty host: ``host``, the node that answered); none for a reply
    that is not a list of them (an error)."""
    if not isinstance(reply, list):
        return []
    ranges = []
    for served in reply:
        primary = served[2]
        named = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
        ranges.append((int(served[0]), int(served[1]), named or host, int(primary[1])))
    return ranges


def move_slot(manager: Any, moved: MovedError) -> None:
    """Point the slot ``moved`` names at the node it names, in ``manager`` (a
    cluster client's ``NodesManager``), now.

    redis-py 7.2 and later do that with ``move_slot()``. Earlier ones keep one
    such error and apply it at their next slot lookup: here it is applied at
    once, under the manager's lock, and a redirection to the slot's primary
    already (which those releases would mistake for a failover) is ignored.
    """
    move = getattr(manager, "move_slot", None)
    if move is not None:
        move(moved)
        return
    with manager._lock:
        owners = manager.slots_cache.get(moved.slot_id)
        node = manager.get_node(host=moved.host, port=moved.port)
        if owners and node is not None and owners[0] is node:
            return
        manager._moved_exception = moved
        manager._update_moved_slots()


class _SlotRefresh:
    """One refresh of a cluster client's slot map, in a thread of its own.

    ``nodes_manager.initialize()`` asks the cluster's nodes one after another,
    each with the cluster client's own timeouts, whatever the deadline of the
    request that needs it; and it raises ``RedisClusterException`` (not a
    ``RedisError``) when no node answers. Run here, a caller waits for it only
    until its own deadline, and whatever it raises is its failure, never the
    caller's.
    """

    def __init__(self, client: RedisCluster, refreshed: Callable[[], None]) -> None:
        self.done = threading.Event()
        #: Whether the slot map was refreshed (meaningful once ``done`` is set).
        self.ok = False
        # The thread holds the client only while it runs.
        thread = threading.Thread(
            target=self._run,
            args=(client, refreshed),
            name="celery-redislock-cluster-refresh",
            daemon=True,
        )
        thread.start()

    def _run(self, client: RedisCluster, refreshed: Callable[[], None]) -> None:
        try:
            client.nodes_manager.initialize()
        except Exception as exc:
            logger.debug("celery_redislock: could not refresh the cluster's slot map: %s", exc)
        else:
            self.ok = True
            refreshed()
        finally:
            self.done.set()

    def wait(self, deadline: Deadline) -> bool:
        """Whether the refresh succeeded by ``deadline``."""
        return self.done.wait(max(0.0, deadline.remaining())) and self.ok


_routers: weakref.WeakKeyDictionary[Any, Router] = weakref.WeakKeyDictionary()

#: The attribute by which an error :func:`run` raises carries the deadline of
#: the round trip it ended.
_DEADLINE = "_celery_redislock_deadline"


def router_for(client: Client) -> Router:
    """The router of ``client`` (one per client object and process: every lock
    of a client shares it)."""
    router = _routers.get(client)
    if router is None:
        router = _routers[client] = Router(client)
    return router


def run(
    transport: Transport,
    commands: Sequence[Sequence[Any]],
    deadline: Deadline,
    attempts: int = ATTEMPTS,
    unsure: Callable[[], object] | None = None,
) -> list[Any]:
    """:meth:`Transport.execute`, retried on transient errors within ``deadline``;
    ``unsure()`` is called after each try that may have run without its answer
    coming (see :func:`may_have_run`), whether or not a later try is answered.

    A request refused unrun because the server is loading its data (``LOADING``)
    or is stalled (:data:`STALLED`) is asked again every :data:`LOADING_PAUSE`
    until the deadline, not counted as a try. Only for requests that are safe to
    send twice.

    Raises:
        redis.RedisError: the last error, once the attempts or the time ran out.
    """
    attempt = 0
    # Whether a try so far may have run: the error that ends the call says so.
    ran = False
    while True:
        try:
            # execute(), inline: this is every request's path.
            replies = transport.finish(transport.write(commands, deadline), len(commands), deadline)
        except RedisError as exc:
            ran = ran or may_have_run(exc)
            if ran and unsure is not None:
                unsure()
            if not isinstance(exc, TRANSIENT):
                ended(exc, ran)
                raise
            error: RedisError = exc
            if type(exc) is RedisConnectionError:
                # Lost (not refused: a server loading its data, a bad password).
                transport.close_idle()
        else:
            for reply in replies:
                # (A ReadOnlyError is a ResponseError; the usual reply is neither.)
                if isinstance(reply, ResponseError) and (
                    isinstance(reply, ReadOnlyError) or held_off(reply) in STALLED
                ):
                    break
            else:
                return replies
            error = reply
            if isinstance(error, ReadOnlyError):
                transport.reset()
        if isinstance(error, BusyLoadingError) or held_off(error) in STALLED:
            # Refused unrun while the server reads its data or runs a long
            # script, or while its cluster is down (a failover under way):
            # asked again until the deadline, however long that takes, rather
            # than counted as a try (the server is stalled, not lost).
            pause = LOADING_PAUSE
        else:
            attempt += 1
            pause = BACKOFF[min(attempt, len(BACKOFF) - 1)]
        if attempt == attempts or deadline.remaining() <= pause:
            # What it failed within, for Router.redirected() (a cluster's refresh).
            setattr(error, _DEADLINE, deadline)
            raise ended(error, ran)
        if pause:
            time.sleep(pause)


#: What a server that refuses writes for now means for the locks.
_NO_WRITES = (
    "Until then no lock can be taken, renewed or released, and a held lock whose "
    "TTL runs out meanwhile is lost"
)


#: The attribute of an error that ended a request: whether a try of it may have
#: run (see :func:`may_have_run`).
_MAY_HAVE_RUN = "_celery_redislock_may_have_run"

_Error = TypeVar("_Error", bound=RedisError)


def ended(exc: _Error, ran: bool) -> _Error:
    """Mark ``exc``, the error that ends a request, with whether a try of it may
    have run (``ran``), for :func:`may_have_run`; return it."""
    setattr(exc, _MAY_HAVE_RUN, ran)
    return exc


def may_have_run(exc: BaseException) -> bool:
    """Whether a request that failed with ``exc`` may have run on the server all
    the same: one of its tries was written whole, and its reply was lost to a
    broken connection or a timeout.

    No when every try failed before its request was written (a refused
    connection, a name that could not be looked up, a write cut short) or was
    refused unrun. An error not marked by :func:`ended` is judged by its type.
    """
    ran = getattr(exc, _MAY_HAVE_RUN, None)
    if ran is None:
        return isinstance(exc, (RedisConnectionError, RedisTimeoutError))
    return bool(ran)


def held_off(exc: object) -> str | None:
    """The code (one of :data:`HELD_OFF`) of the refusal ``exc`` is, if the server
    refused a request for a state it may leave: nothing of the request ran, and it
    may be sent again later. ``None`` for any other error, or a reply."""
    if not isinstance(exc, ResponseError):
        return None
    if isinstance(exc, ClusterDownError):
        # redis-py drops the code from the error's text.
        return "CLUSTERDOWN"
    text = str(exc)
    for code in HELD_OFF:
        # Redis 6.2 reports an error raised in a script after where it was raised.
        if text.startswith(code + " ") or f": -{code} " in text:
            return code
    return None


def is_transient(exc: object) -> bool:
    """Whether another try may soon cure ``exc``: one of :data:`TRANSIENT`, a
    server busy running a script (``BUSY``), or a cluster down while a failover
    is under way (``CLUSTERDOWN``)."""
    return isinstance(exc, TRANSIENT) or held_off(exc) in STALLED


def describe_error(exc: BaseException) -> str:
    """A one-line account of a Redis error that says what to do about it."""
    if isinstance(exc, NoPermissionError) or any(
        sign in str(exc) for sign in ("can't run this command", "ACL failure")
    ):
        return (
            f"{exc} (the Redis user lacks a permission the locks need: see the "
            "ACL section of the documentation's Deployments page)"
        )
    if isinstance(exc, OutOfMemoryError) or "OOM command not allowed" in str(exc):
        return (
            f"{exc} (the lock store is out of memory: it takes no new lock until memory "
            "is freed or its maxmemory raised; held locks are still renewed, and freed by their "
            "last release)"
        )
    if isinstance(exc, BusyLoadingError):
        return f"the server is still loading its data ({exc})"
    code = held_off(exc)
    if code == "MISCONF":
        return (
            f"{exc} (the lock store refuses writes because it cannot save its data to "
            f"disk: fix its disk or its persistence settings, as its log says. {_NO_WRITES})"
        )
    if code == "NOREPLICAS":
        return (
            f"{exc} (the lock store refuses writes because fewer replicas than its "
            f"min-replicas-to-write are connected: bring them back. {_NO_WRITES})"
        )
    if code == "CLUSTERDOWN":
        return (
            f"{exc} (CLUSTERDOWN: the Redis Cluster refuses requests while a primary has "
            "failed and no replica has taken its slots over yet, or while a slot has no "
            "primary; it answers again once a replica is promoted, usually within a few "
            "cluster-node-timeouts. If it lasts, CLUSTER NODES shows the failed primary "
            "(bring it back, or give it a replica) or the slots with none (assign them). "
            f"{_NO_WRITES})"
        )
    if code == "BUSY":
        return (
            f"{exc} (the lock store is busy running a script or function past its "
            "busy-reply-threshold, lua-time-limit before Redis 7: it answers again once "
            "that ends, or is stopped with SCRIPT KILL or FUNCTION KILL)"
        )
    if isinstance(exc, RedisTimeoutError):
        return f"timed out ({exc})"
    if isinstance(exc, RedisConnectionError):
        return f"unreachable ({exc})"
    if isinstance(exc, AskError | TryAgainError):
        return slot_moving(exc)
    return str(exc)


def slot_moving(exc: AskError | TryAgainError) -> str:
    """What a Redis Cluster's ``MOVED``, ``ASK`` or ``TRYAGAIN`` that a request
    could not get past in time means, for an operator."""
    if isinstance(exc, AskError):
        # (A MovedError is an AskError.)
        reply = "MOVED" if isinstance(exc, MovedError) else "ASK"
        what = (
            f"cluster slot {exc.slot_id} is being moved between primaries "
            f"({reply} to {exc.host}:{exc.port})"
        )
    else:
        what = (
            "a request about both of a lock's keys (the lock and its waiter queue) was "
            "refused while their cluster slot is moved: Redis refuses one while only one "
            "of the two keys is on the primary it reaches, the other having moved already "
            f"or not existing at all (a lock with no waiters has no queue; TRYAGAIN: {exc})"
        )
    return (
        f"{what}, and the request could not follow in time: try again once the move has "
        "ended; a move left half-way (a `redis-cli --cluster reshard` that stopped) is "
        "ended by `redis-cli --cluster fix`"
    )


@contextmanager
def backend_errors(action: str) -> Iterator[None]:
    """Turn a Redis error inside the block into :class:`LockBackendError`.

    ``action`` says what was being done, e.g. ``"acquire lock 'x'"``.
    """
    try:
        yield
    except RedisError as exc:
        raise LockBackendError(f"could not {action}: {describe_error(exc)}") from exc


#: How long :func:`flush` takes at most, in seconds (a process's exit waits for it).
FLUSH_TIMEOUT = DEFAULT_CALL_TIMEOUT

#: The share of :func:`flush`'s time that reading the owed replies may take, the
#: rest being for sending again what the background retries: a connection gone
#: dark (the server reachable on a new one) must leave time to send again what it
#: did not answer. Each of the two takes this share at most.
FLUSH_READ_SHARE = 0.5

#: What :func:`flush` calls once it has read the owed replies of the idle
#: connections, with its reading deadline: the heartbeat has the reads its
#: threads are in end by then (see :func:`celery_redislock.heartbeat.finish_rounds`).
_after_reading: list[Callable[[Deadline], None]] = []

#: What :func:`flush` calls then, with its deadline for sending and its
#: ``final``: the heartbeat sends the requests it retries in the background (see
#: :func:`celery_redislock.heartbeat.send_pending_now`). The heartbeat registers
#: both on import.
_after_drain: list[Callable[[Deadline, bool], None]] = []

#: Whether a final :func:`flush` runs in this process: the heartbeat then starts
#: no thread for what is handed to it meanwhile (none may be started at
#: interpreter shutdown), and the flush sends that itself.
exiting = False


def flush(timeout: float | None = None, final: bool = False) -> None:
    """Read every reply still owed in this process, then send the requests it
    retries in the background (a release whose answer was lost, that one too),
    all within ``timeout`` (by default :data:`FLUSH_TIMEOUT`).

    Reading takes :data:`FLUSH_READ_SHARE` of the time at most: a reply not read
    by then counts as lost, and its request goes again, with the rest of the
    time, on a new connection. Sending takes that share at most too: a server out
    of reach costs the whole ``timeout``, and half of it when no reply was owed.
    ``final``: the process is about to exit (at exit, or a pool child's end), so
    nothing is left to the background: a request that could not be sent is
    logged as given up.

    Before sending, the Sentinels of a Sentinel-managed primary, and a cluster's
    primaries, that answered releases which may have to go again are asked
    whether the primary was replaced or the keys moved (see
    :func:`_learn_switches` and :func:`_learn_moves`): such releases go then.
    """
    global exiting
    if timeout is None:
        timeout = FLUSH_TIMEOUT
    share = timeout * FLUSH_READ_SHARE
    start = time.monotonic()
    reading = Deadline(start + share)
    exiting = final
    try:
        # Every transport, not only those of transport_for(): a forked child also
        # writes on transports it reached through objects made before the fork.
        for transport in list(_every_transport):
            if transport._pid == _process_id and transport.owes_replies():
                transport.drain(reading)
        for finish in list(_after_reading):
            finish(reading)
    finally:
        # Even past a handler's SystemExit: what it left to send goes all the same.
        deadline = Deadline(min(start + timeout, time.monotonic() + share))
        try:
            try:
                _learn_switches(deadline)
                _learn_moves(deadline)
            finally:
                for send in list(_after_drain):
                    send(deadline, final)
        finally:
            exiting = False


def _learn_switches(deadline: Deadline) -> None:
    """For :func:`flush`: ask the Sentinels of this process's Sentinel-managed
    transports whose releases wait for a switch of primary which server is
    primary, all within one :data:`PRIMARY_QUESTION` (and by ``deadline``); while
    they answer that a failover is under way, again until they name the new
    primary, for half the time left to ``deadline`` at most (see
    :meth:`Transport.learn_switch`). A switch learnt so hands those releases to
    the heartbeat, which the flush then sends to the new primary: a process that
    exits right after releasing on a primary the Sentinels replace (one that
    still takes writes, as after an operator's ``SENTINEL FAILOVER``) leaves no
    lock held on the new one until its TTL."""
    now = time.monotonic()
    first = Deadline(min(deadline.at, now + PRIMARY_QUESTION))
    wait = Deadline(min(deadline.at, now + max(PRIMARY_QUESTION, deadline.remaining() / 2)))
    for transport in list(_every_transport):
        if transport._pid != _process_id or not transport.follows_switches:
            continue
        try:
            transport.learn_switch(first, wait)
        except Exception:
            # One server's failure keeps no other's requests from going.
            logger.exception(
                "celery_redislock: asking the Sentinels of %s before sending failed",
                transport.describe(),
            )


def _learn_moves(deadline: Deadline) -> None:
    """For :func:`flush`: have each cluster router of this process ask, by
    ``deadline``, the primaries whose releases wait to be sent again should
    their keys move, whether they still serve them (see
    :meth:`Router.learn_moves`). A failover or move learnt so hands those
    releases to the heartbeat, which the flush then sends where the keys live
    now: a process that exits right after a primary answered its releases and
    died before its replica had them (or came back from a freeze as a replica)
    leaves no lock held on the new primary until its TTL."""
    for router in list(_every_router):
        if router.single is not None:
            continue
        try:
            router.learn_moves(deadline)
        except Exception:
            # One router's failure keeps no other's requests from going.
            logger.exception("celery_redislock: asking a cluster where its keys live failed")


def _flush_at_exit() -> None:
    """:func:`flush` as the process exits."""
    flush(final=True)


atexit.register(_flush_at_exit)


#: Every transport and router of this process, so that a forked child can make
#: their locks anew: another thread of the parent may have held one as it forked
#: (the child has no such thread to release it), and an object made before the
#: fork (a lock's router, and its transport) stays reachable in the child.
_every_transport: weakref.WeakSet[Transport] = weakref.WeakSet()
_every_router: weakref.WeakSet[Router] = weakref.WeakSet()


def _forget_after_fork() -> None:
    global _transports_guard
    _transports.clear()
    _routers.clear()
    _transports_guard = threading.Lock()
    for transport in list(_every_transport):
        transport._guard = threading.Lock()
        # Reads of the parent's threads, which have none here.
        transport._settling = 0
        # The parent's releases are the parent's to send again.
        transport._on_switch.clear()
        transport._failed_at = None
        transport._move_watchers = weakref.WeakSet()
    for router in list(_every_router):
        # A refresh under way in the parent has no thread here to end it.
        router._refresh, router._refresh_guard = None, threading.Lock()
        # The parent's releases are the parent's to send again.
        router._answered, router._answered_guard = collections.deque(), threading.Lock()
        router._prune_at = _PRUNE_FLOOR
        router._latest, router._checked, router._failed_at = {}, {}, {}


os.register_at_fork(after_in_child=_forget_after_fork)
