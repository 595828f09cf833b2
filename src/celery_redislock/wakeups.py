"""Wake-ups for waiting lock holders: one subscriber per process and server.

A waiter queues itself in the lock's waiter queue (inside the acquire that finds
the lock held) with an id ``<process>.<n>``; a release that frees the lock takes
the first two ids (the second, a spare, stays queued) and publishes each on its
process's wake channel, ``<prefix>:wake:<process>``. Each process keeps one subscription to its own wake
channel per server and key prefix — a :class:`WakeHub` — shared by all its
waiters. So a release wakes at most two waiters, wherever they are, instead of
every waiter of every process.

The hub's thread subscribes (and subscribes again after a break); the waiters
read the subscription themselves, one at a time: the one reading wakes the
waiters its messages name, and when it is woken (or gives up) it hands the
reading to another. A lone waiter, the usual case in a worker process, so wakes
up in its own thread, without a hand-off from a reader thread to it.

The subscription must be in place before a waiter queues itself, or a wake-up
sent in between would be lost, and (on a single server, where a release checks
it) the waiter taken for one whose process died: :meth:`WakeHub.wait_ready`
blocks until it is (a waiter it keeps waiting too long asks for the lock without
it, now and then, until it is back; a release may pass it over meanwhile, and it
keeps its place in the queue as it asks again). When a reader finds the
subscription broken, the hub wakes every waiter (each then re-checks the lock and
waits for the hub to be subscribed again) and subscribes again, on a new
connection (:data:`SUBSCRIBE_WAIT`).

A subscription can also die without a word: a firewall or load balancer that
forgets an idle connection passes nothing on and closes nothing, and the server
keeps a subscriber that no message reaches. So a reader that has heard nothing
for :data:`PROBE_AFTER` seconds asks the server for a word: it subscribes to its
channel again, which the server confirms (a subscribed connection can send
little else, and ``PING`` would need a permission the locks' ACL does not give);
one that hears nothing for :data:`PROBE_WAIT` seconds more takes it for broken.

A hub whose transport's client has been garbage-collected (see
:attr:`~celery_redislock.transport.Transport.dropped`) retires once nobody waits
on it: its thread ends, its subscription is closed, and it leaves the process's
hubs (a waiter that comes later gets a new one).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_redislock.scripts import BEHIND_MARK, GRANT_MARK, PASSED_MARK, SPARE_MARK
from celery_redislock.transport import (
    DEFAULT_CALL_TIMEOUT,
    Deadline,
    Transport,
    _on_drop,
    describe_error,
    is_transient,
    parse_replies,
)

logger = logging.getLogger(__name__)

#: Seconds a hub keeps its subscription with no waiter before it lets it go.
IDLE_EXIT = 30.0

#: How often a reader looks up from reading, and the hub's thread checks on the
#: subscription, in seconds.
_POLL = 0.5

#: Seconds of silence on the subscription, while someone waits, after which a
#: reader subscribes again (a probe the server answers) to learn whether it works.
PROBE_AFTER = 1.0

#: Seconds a reader waits for anything after its probe before it takes the
#: subscription for broken (and the hub subscribes again on a new connection):
#: as long as any call waits for an answer, so that a server busy for a moment
#: (a slow command, a fork) is not taken for a lost subscription.
PROBE_WAIT = DEFAULT_CALL_TIMEOUT

#: Seconds the hub waits for the server to confirm a new subscription, the
#: first time it subscribes after a break (or at all); each failed attempt
#: doubles it for the next, on a new connection, up to :data:`PROBE_WAIT`. A
#: request lost in a network blip is never answered on its connection, however
#: soon the network is back: a short first wait lets a new connection subscribe
#: soon after, while a server busy for longer (a slow command, a fork) is still
#: given as long as any call to answer before long.
SUBSCRIBE_WAIT = 1.0

_process = secrets.token_hex(8)
_counter = itertools.count(1)


def process_token() -> str:
    """This process's id in waiter ids and wake channels (new after ``fork()``)."""
    return _process


class Waiter:
    """One waiting acquire: its id in the queue, whether a wake-up named it since
    its last try (and named it the spare, woken second — behind a waiter the lock
    was handed to, or not — or handed it the lock, with this fencing token), and
    the event that rings when it is woken or may take over the reading."""

    __slots__ = (
        "behind",
        "event",
        "fence",
        "following",
        "id",
        "passed",
        "recheck",
        "spare",
        "woken",
    )

    def __init__(self, waiter_id: str) -> None:
        self.id = waiter_id
        self.event = threading.Event()
        self.spare = False
        self.behind = False
        self.fence: int | None = None
        self.woken = False
        # Whether a release passed it over as dead since its last rearm() (see
        # WakeHub.unseen).
        self.passed = False
        # Whether a break of the subscription woke it (to re-check the lock once
        # subscribed again) since its last rearm().
        self.recheck = False
        # Whether it is in wait() and not reading: a reader that leaves hands it the reading.
        self.following = False


#: What a wake-up reply that makes no sense raises as it is parsed or delivered
#: (anything else raised while reading is an interruption, passed on).
_GARBLED = (ValueError, IndexError, TypeError, AttributeError)


class WakeHub:
    """The wake channel of this process on one server, for one key prefix.

    Arguments:
        transport: the server's connections.
        prefix: the key prefix (the channel is ``<prefix>:wake:<process>``).
    """

    def __init__(self, transport: Transport, prefix: str) -> None:
        self.transport = transport
        self.prefix = prefix
        self.channel = f"{prefix}:wake:{process_token()}"
        #: Whether the hub has left the process's hubs (see :meth:`retire_if_idle`).
        self.retired = False
        self._waiters: dict[str, Waiter] = {}
        self._guard = threading.Condition()
        # Whether the subscription is confirmed, and why the last attempt failed.
        self._subscribed = False
        self._failure: RedisError | None = None
        self._thread: threading.Thread | None = None
        # The subscribed connection (None while there is none), the bytes read
        # from it past the last whole reply, and the lock of the thread reading it.
        self._conn: Any = None
        self._unread = b""
        self._reading = threading.Lock()
        # When the subscription was last heard from, and when a probe was sent
        # down it since (None: not since); kept by whoever holds the reading.
        self._heard = 0.0
        self._probed: float | None = None
        #: Whether a release passed over one of this hub's waiters as dead (its
        #: channel had no subscriber on the lock's server) though its message came
        #: here: the server's subscriber count does not see this subscription, and
        #: this process's waiters no longer ask to be checked by it (but on a
        #: cluster, see ``RedisLock._wait``). Cleared as a Sentinel-managed hub
        #: follows a switch (see :meth:`primary_switched`).
        self.unseen = False
        #: Wake-up messages received, and subscriptions made, for tests and benchmarks.
        self.received = 0
        self.subscriptions = 0
        transport.watch_switches(self)

    @property
    def subscribed(self) -> bool:
        """Whether the subscription is confirmed now (a waiter may queue at once)."""
        return self._subscribed

    def unanswered(self) -> float:
        """For how long, in seconds, a probe of the subscription (see
        :data:`PROBE_AFTER`) has gone unanswered: ``0.0`` if none is owed. A
        server that hangs (frozen, cut off) shows so long before the probe gives
        up (:data:`PROBE_WAIT`)."""
        probed = self._probed
        return 0.0 if probed is None else time.monotonic() - probed

    def join(self, waiter: Waiter | None = None) -> Waiter:
        """A new waiter, or ``waiter`` (one that leaves another hub, keeping its id
        and so its place in its lock's queue); the hub subscribes (in the
        background) if it is not yet. (A retired hub works all the same, but
        for its waiters alone: see :func:`join`, which the locks use.)"""
        if waiter is None:
            waiter = Waiter(f"{process_token()}.{next(_counter)}")
        self._add(waiter, retired=True)
        return waiter

    def _add(self, waiter: Waiter, retired: bool) -> bool:
        """:meth:`join` of ``waiter``; ``False`` (nothing done) if the hub has
        retired, unless ``retired``."""
        with self._guard:
            if self.retired and not retired:
                return False
            self._waiters[waiter.id] = waiter
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="celery-redislock-wakeups", daemon=True
                )
                self._thread.start()
        return True

    def retire_if_idle(self, wait: bool = True) -> None:
        """Retire the hub if its transport's client is gone (see
        :attr:`~celery_redislock.transport.Transport.dropped`), nobody waits on it
        and its thread has ended (with its subscription): it leaves the
        process's hubs. ``wait=False``: from the client's finalizer, which may
        run amid any code, so the locks are only tried (one held now leaves
        the hub to the next look: see :func:`_retire_idle`)."""
        guard = _hubs_guard
        if not guard.acquire(blocking=wait):
            return
        try:
            if not self._guard.acquire(blocking=wait):
                return
            try:
                if self.retired or self._thread is not None or self._waiters:
                    return
                if not self.transport.dropped:
                    return
                self.retired = True
            finally:
                self._guard.release()
            key = (self.transport, self.prefix)
            if _hubs.get(key) is self:
                del _hubs[key]
        finally:
            guard.release()

    def leave(self, waiter: Waiter) -> None:
        """Forget ``waiter`` (it got the lock or gave up)."""
        with self._guard:
            self._waiters.pop(waiter.id, None)

    def wait_ready(self, deadline: Deadline, wait_if_unreachable: bool = True) -> bool:
        """Block until the subscription is confirmed, or ``deadline`` passes.

        With ``wait_if_unreachable=False``, ``False`` as soon as the server is
        found out of reach (the subscription broke, or could not be made, with a
        connection error or a timeout: a server killed, or frozen or cut off by
        the network), rather than at ``deadline``: a waiter on a Redis
        Cluster then asks for its lock at once, which finds the primary its key
        lives on now (the server of this hub may have died and been failed over).

        Raises:
            redis.RedisError: subscribing failed for a reason a retry will not
                cure (a missing ACL permission, say).
        """
        with self._guard:
            while not self._subscribed:
                failure = self._failure
                if failure is not None and not is_transient(failure):
                    raise failure
                if not wait_if_unreachable and isinstance(
                    failure, RedisConnectionError | RedisTimeoutError
                ):
                    return False
                remaining = deadline.remaining()
                if remaining <= 0:
                    return False
                self._guard.wait(remaining)
            return True

    @staticmethod
    def rearm(waiter: Waiter) -> None:
        """Forget what woke ``waiter`` before: call it before each try of the lock."""
        waiter.woken = waiter.spare = waiter.behind = waiter.recheck = waiter.passed = False
        waiter.fence = None
        waiter.event.clear()

    def rearm_spare(self, waiter: Waiter) -> bool:
        """Forget the spare's wake-up that woke ``waiter``, before it lets the first
        woken waiter go ahead; unless a later wake-up handed it the lock meanwhile
        (True: it keeps that, and takes the lock rather than pause)."""
        with self._guard:
            if waiter.fence is not None:
                return True
            if waiter.recheck:
                # The subscription broke since: that wake-up stands (the spare
                # re-checks the lock once subscribed again, rather than pause
                # reading a subscription that is gone).
                return False
            waiter.woken = waiter.spare = waiter.behind = False
            waiter.event.clear()
            return False

    def wait(self, waiter: Waiter, timeout: float) -> bool:
        """Block until a wake-up names ``waiter`` since :meth:`rearm` (True), or
        ``timeout`` seconds pass (False).

        The calling thread reads the subscription itself while no other thread
        does; otherwise it waits to be woken by the one that does, or to be
        handed the reading when that one leaves.
        """
        ends = time.monotonic() + timeout
        while not waiter.woken:
            remaining = ends - time.monotonic()
            if remaining <= 0:
                return False
            # Marked before trying: a reader that leaves after this try failed sees it.
            waiter.following = True
            if self._reading.acquire(blocking=False):
                waiter.following = False
                try:
                    read = self._read_until(waiter, ends)
                finally:
                    self._reading.release()
                    self._hand_over(waiter)
                if not read:
                    # Being subscribed again (the waiters were woken when it broke):
                    # waited for without the reading, which the hub's thread needs.
                    with self._guard:
                        if self._conn is None:
                            self._guard.wait(min(remaining, _POLL))
            else:
                # Looking up now and then all the same, whatever race it may miss.
                waiter.event.wait(min(remaining, _POLL))
                waiter.following = False
                waiter.event.clear()
        return True

    def _read_until(self, waiter: Waiter, ends: float) -> bool:
        """With the reading: deliver wake-ups until one names ``waiter``, ``ends``
        passes, or the subscription turns out broken (then every waiter is woken);
        ``False`` if there was no subscription to read."""
        with self._guard:
            conn = self._conn
        if conn is None:
            return False
        while not waiter.woken:
            remaining = ends - time.monotonic()
            if remaining <= 0:
                return True
            try:
                self.transport.bound(conn, min(remaining, _POLL))
                data = _receive(conn)
                self._heard, self._probed = time.monotonic(), None
                replies, self._unread = parse_replies(self._unread + data)
                for reply in replies:
                    if isinstance(reply, list) and reply[:1] == [b"message"]:
                        self._deliver(reply[2].decode())
            except RedisTimeoutError:
                try:
                    self._check_silence(conn)
                except RedisError as exc:
                    self._broke(conn, exc)
                    return True
                continue
            except RedisError as exc:
                self._broke(conn, exc)
                return True
            except _GARBLED as exc:
                # A reply that makes no sense: the stream cannot be trusted. It is
                # subscribed again, and every waiter re-checks the lock.
                self._broke(conn, RedisConnectionError(f"wake-up read failed: {exc!r}"))
                return True
            except BaseException as exc:
                # Interrupted while reading: a soft time limit (billiard's
                # SoftTimeLimitExceeded is an Exception), KeyboardInterrupt. Bytes
                # or wake-ups read may be lost: subscribed again as above, and the
                # interruption goes on to its caller, whose wait ends.
                self._broke(conn, RedisConnectionError(f"wake-up read failed: {exc!r}"))
                raise
        return True

    def _check_silence(self, conn: Any) -> None:
        """After a read that got nothing: probe ``conn`` once it has been silent
        for :data:`PROBE_AFTER` seconds (see the module docstring).

        Raises:
            redis.RedisError: nothing came for :data:`PROBE_WAIT` seconds after the
                probe, or sending it failed: the subscription is broken.
        """
        now = time.monotonic()
        if self._probed is not None:
            if now - self._probed >= PROBE_WAIT:
                raise RedisTimeoutError(
                    f"the wake-up subscription answered nothing in {PROBE_WAIT:g} s"
                )
        elif now - self._heard >= PROBE_AFTER:
            self.transport.bound(conn, PROBE_WAIT)
            conn.send_command("SUBSCRIBE", self.channel, check_health=False)
            self._probed = now

    def _hand_over(self, leaving: Waiter) -> None:
        """Ring one waiter that follows (waits without reading) and is not woken yet,
        so that it takes over the reading; one that does not wait at the moment
        takes it when it next waits."""
        with self._guard:
            for waiter in self._waiters.values():
                if waiter is not leaving and waiter.following and not waiter.woken:
                    waiter.event.set()
                    return

    def _deliver(self, message: str) -> None:
        """Wake the waiter a message names (as the spare, or as the one the lock
        was handed to, if it says so)."""
        self.received += 1
        if message.endswith(PASSED_MARK):
            message = message.removesuffix(PASSED_MARK)
            with self._guard:
                waiter = self._waiters.get(message)
                if waiter is not None:
                    # Passed over as dead: woken to ask again (and keep its place).
                    # (A cluster sends every node what is published: the hubs of
                    # this process on other nodes hear it too, and are not unseen.)
                    self.unseen = True
                    waiter.passed = waiter.woken = True
                    waiter.event.set()
            return
        spare = message.endswith(SPARE_MARK)
        message = message.removesuffix(SPARE_MARK)
        behind = spare and message.endswith(BEHIND_MARK)
        waiter_id, granted, fence = message.removesuffix(BEHIND_MARK).partition(GRANT_MARK)
        with self._guard:
            waiter = self._waiters.get(waiter_id)
            if waiter is not None:
                waiter.spare = spare
                waiter.behind = behind
                waiter.fence = int(fence) if granted and fence.isdigit() else None
                waiter.woken = True
                waiter.event.set()

    def primary_switched(self) -> None:
        """The transport learnt that the Sentinels replaced its primary: the
        subscription, made on the old one, is dropped as if broken, so that the
        hub subscribes on the new one and its waiters ask again there at once.
        Left on the old primary, a replica now, they would hear of a release on
        the new one only once that replica is in step with it, or at their next
        re-check. What this hub heard before (:attr:`unseen`) no longer counts:
        it subscribes on the primary itself from now on. Quick; never raises (see
        :meth:`~celery_redislock.transport.Transport.watch_switches`)."""
        self.unseen = False
        with self._guard:
            conn = self._conn
        if conn is not None:
            self._broke(conn, RedisConnectionError("the Sentinels named a new primary"))

    def _broke(self, conn: Any, error: RedisError) -> None:
        """A reader found ``conn`` broken: have the hub's thread subscribe again,
        and wake every waiter (a wake-up sent meanwhile is lost, so each re-checks
        the lock once the hub is subscribed again)."""
        with self._guard:
            if self._conn is conn:
                self._conn, self._unread, self._subscribed = None, b"", False
                self._failure = error
                self._guard.notify_all()
        self._wake_all()

    def _set_state(self, subscribed: bool, failure: RedisError | None = None) -> None:
        with self._guard:
            self._subscribed = subscribed
            self._failure = failure
            self._guard.notify_all()

    def _wake_all(self) -> None:
        """Wake every waiter: each re-checks the lock (a wake-up may have been lost)."""
        with self._guard:
            waiters = list(self._waiters.values())
        for waiter in waiters:
            waiter.recheck = True
            waiter.woken = True
            waiter.event.set()

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            if self.transport.dropped:
                self.retire_if_idle()

    def _serve(self) -> None:
        """The hub's thread: subscribe, and again after a break, while anyone waits."""
        pause = 0.05
        handshake = SUBSCRIBE_WAIT
        me = threading.current_thread()
        while True:
            with self._guard:
                if not self._waiters:
                    # Nobody waits: no reason to (re)connect.
                    self._thread = None
                    return
            conn: Any = None
            try:
                conn, rest = self._subscribe(handshake)
                pause, handshake = 0.05, SUBSCRIBE_WAIT
                with self._guard:
                    self._conn, self._unread = conn, rest
                    self._heard, self._probed = time.monotonic(), None
                    self.subscriptions += 1
                self._set_state(True)
                if self._watch(conn):
                    return
            except Exception as exc:  # the thread must not die with waiters relying on it
                if conn is None and isinstance(exc, RedisTimeoutError):
                    handshake = min(PROBE_WAIT, handshake * 2)
                self._set_state(False, exc if isinstance(exc, RedisError) else None)
                with self._guard:
                    waiting = bool(self._waiters)
                logger.log(
                    logging.WARNING if waiting else logging.DEBUG,
                    "celery_redislock: wake-up subscription on %s broke: %s; reconnecting",
                    self.transport.describe(),
                    describe_error(exc),
                )
            finally:
                with self._guard:
                    if self._conn is conn:
                        self._conn = None
                    if self._thread is me and self._subscribed:
                        self._subscribed = False
                if conn is not None:
                    # Under the reading lock: a waiter never reads a closed connection.
                    with self._reading:
                        conn.disconnect()
            # A wake-up published while the subscription was down is lost: every
            # waiter re-checks the lock once the hub is subscribed again.
            self._wake_all()
            time.sleep(pause)
            pause = min(1.0, pause * 2)

    def _watch(self, conn: Any) -> bool:
        """Keep ``conn`` as the subscription until a reader finds it broken (raises)
        or nobody has waited for :data:`IDLE_EXIT` seconds, or at all once the
        transport's client is gone (returns True: the thread ends)."""
        idle_since = time.monotonic()
        with self._guard:
            while True:
                if self._conn is not conn:
                    raise self._failure or RedisConnectionError("wake-up subscription broke")
                if self._waiters:
                    idle_since = time.monotonic()
                elif self.transport.dropped or time.monotonic() - idle_since >= IDLE_EXIT:
                    self._subscribed = False
                    self._thread = None
                    return True
                self._guard.wait(_POLL)

    def _subscribe(self, timeout: float) -> tuple[Any, bytes]:
        """A new connection subscribed to the channel within ``timeout`` seconds
        (connecting included), and what was read after the confirmation. Replies
        are read here rather than by redis-py, whose reader would hold on to what
        it read ahead: only the handshake goes through it."""
        deadline = Deadline.after(timeout)
        conn = self.transport.connection(deadline)
        try:
            self.transport.bound(conn, deadline.remaining())
            conn.send_command("SUBSCRIBE", self.channel, check_health=False)
            unread = b""
            while True:
                self.transport.bound(conn, deadline.remaining())
                replies, unread = parse_replies(unread + _receive(conn))
                for reply in replies:
                    if isinstance(reply, Exception):
                        raise reply
                    if isinstance(reply, list) and reply[:1] == [b"subscribe"]:
                        # Wake-ups can only follow the confirmation: none is in ``replies``.
                        return conn, unread
        except BaseException:
            conn.disconnect()
            raise


def _receive(conn: Any) -> bytes:
    """What the connection's socket has, waiting at most its timeout for it.

    Raises:
        redis.TimeoutError: nothing came in time.
        redis.ConnectionError: the connection broke or was closed.
    """
    try:
        data: bytes = conn._sock.recv(65536)
    except TimeoutError:
        raise RedisTimeoutError("no wake-up within the poll interval") from None
    except (OSError, AttributeError) as exc:
        raise RedisConnectionError(f"wake-up subscription broke: {exc}") from None
    if not data:
        raise RedisConnectionError("the server closed the wake-up subscription")
    return data


_hubs: dict[tuple[Transport, str], WakeHub] = {}
_hubs_guard = threading.Lock()


def hub_for(transport: Transport, prefix: str) -> WakeHub:
    """This process's hub for ``transport`` and ``prefix``."""
    hub = _hubs.get((transport, prefix))
    if hub is None:
        with _hubs_guard:
            hub = _hubs.get((transport, prefix))
            if hub is None:
                hub = _hubs[(transport, prefix)] = WakeHub(transport, prefix)
                made = True
            else:
                made = False
        if made:
            # Rare enough to look at the others then.
            _retire_idle()
    return hub


def subscribed(transport: Transport, prefix: str) -> bool:
    """Whether this process's hub for ``transport`` and ``prefix`` is subscribed
    now (see :attr:`WakeHub.subscribed`); ``False`` if there is none (none is made)."""
    hub = _hubs.get((transport, prefix))
    return hub is not None and hub.subscribed


def join(transport: Transport, prefix: str, waiter: Waiter | None = None) -> tuple[WakeHub, Waiter]:
    """This process's hub for ``transport`` and ``prefix``, joined by a new waiter
    or by ``waiter`` (see :meth:`WakeHub.join`), and that waiter. A hub that
    retires meanwhile is not joined: the hub made in its place is."""
    if waiter is None:
        waiter = Waiter(f"{process_token()}.{next(_counter)}")
    while True:
        hub = hub_for(transport, prefix)
        if hub._add(waiter, retired=False):
            return hub, waiter


def _retire_idle(transport: Transport | None = None, wait: bool = True) -> None:
    """Retire the hubs (of ``transport``, or of any) whose clients are gone, that
    nobody waits on and whose threads have ended (see :meth:`WakeHub.retire_if_idle`).
    A hub whose thread runs retires as that ends; one without, here: as its
    client is collected, or, should a lock have been held then, as the next hub
    is made."""
    guard = _hubs_guard
    if not guard.acquire(blocking=wait):
        return
    try:
        idle = [
            hub
            for (owner, _), hub in _hubs.items()
            if (owner is transport or transport is None) and owner.dropped and hub._thread is None
        ]
    finally:
        guard.release()
    for hub in idle:
        hub.retire_if_idle(wait)


def _client_dropped(transport: Transport) -> None:
    """The client of ``transport`` was garbage-collected: its idle hubs retire now
    (those whose thread runs, as it ends). It never waits for a lock."""
    _retire_idle(transport, wait=False)


def _reset_after_fork() -> None:
    global _process, _hubs_guard
    _process = secrets.token_hex(8)
    _hubs.clear()
    _hubs_guard = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
_on_drop.append(_client_dropped)
