"""The heartbeat: keeps held locks alive from the background.

Every lock taken with ``heartbeat=True`` registers here. The locks of each Redis
server form a *lane* with a thread of its own, so a dead or stalled server
delays the renewals of its own locks only. A lane sleeps until its earliest lock
is due, then renews every lock that is due (or nearly due) in one pipelined
round trip, however many locks the process holds on that server.

Each round trip is bounded by the earliest local deadline in the batch (the
send time of a lock's last confirmed renewal plus its TTL), so a black-holed
connection cannot hold up the verdict; and by the time the lane's next other
lock is due, even one taken while the round waits for its answer, so a round
stuck on a connection gone dark holds up no other lock's renewal: it fails, its
connection is closed, and the renewals go out again on another. A lock is
marked lost, taken off its lane and reported through its ``on_lost`` callback
when the server says another owner holds it (or nobody does), or when its local
deadline passes before a renewal is confirmed; it is never renewed again.

The lanes hold their locks weakly: a held lock that nobody references any more
(dropped without ``release()``) is not kept alive — it is logged and left to
expire by its TTL. A lane also retries, for a bounded time, requests that must
reach the server eventually, such as a release whose reply never came; and, on
a Sentinel-managed primary, asks the Sentinels which server is primary while
releases wait to be sent again should they have switched (see
:meth:`_Lane.watch_primary`).

Threads are rebuilt lazily in a child process after ``fork()``, which starts
with no locks and no threads; a lane's thread ends when it has had nothing to do
for a while, and the lane retires with it (the next lock of its server makes
another). A lane whose transport's client has been garbage-collected (see
:attr:`~celery_redislock.transport.Transport.dropped`) retires as soon as it
has nothing left to do: no lock to renew, no request to retry, no reply owed to
read. Its thread ends and the transport's idle connections are closed, so an
application that makes a client per job leaves nothing behind once it drops it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from redis.exceptions import AskError, MovedError, RedisError, TryAgainError

from celery_redislock import signals
from celery_redislock import transport as _transport
from celery_redislock.scripts import CLUSTER_TRY, EXTEND_SCRIPT, Call, Released, run_calls
from celery_redislock.transport import (
    DEFAULT_CALL_TIMEOUT,
    TRANSIENT,
    WATCH_STEP,
    Deadline,
    MovableDeadline,
    Router,
    Transport,
    describe_error,
    may_have_run,
)

logger = logging.getLogger(__name__)

#: Seconds a lane's thread stays alive with nothing to renew or retry.
IDLE_EXIT = 30.0

#: Shortest deadline given to a renewal round trip, in seconds.
MIN_ROUND_TRIP = 0.05

#: Pause between retries of a failed renewal, at most (seconds).
RENEW_RETRY = 0.5

#: While renewals keep failing, a lane logs the failure at most this often
#: (seconds); the warnings in between are counted in the next one.
RENEW_WARNING_EVERY = 10.0

#: How long a reply owed on an idle connection waits for the connection's next
#: request before the lane reads it itself, in seconds: at least this long, at
#: most twice (see :meth:`_Lane.drain_later`).
DRAIN_DELAY = 0.05


class Renewable(Protocol):
    """What the heartbeat needs from a lock."""

    name: str
    key: str
    owner: str
    #: The fencing token of the hold (``None``: unknown): a renewal extends only
    #: the hold with this token.
    token: int | None

    @property
    def transport(self) -> Transport: ...

    @property
    def ttl_ms(self) -> int: ...

    @property
    def renew_interval(self) -> float: ...

    def _renewed(self, sent: float) -> None: ...

    def _renewal_failed(self, sent: float) -> None: ...

    def _confirmed(self) -> int: ...

    def _mark_lost(self, confirmed: int) -> bool | None: ...

    def _report_lost(self) -> None: ...

    def _expires_at(self) -> float: ...

    def _redirected(self, exc: BaseException) -> bool: ...

    @property
    def _clustered(self) -> bool: ...


def _token(token: int | None) -> int | str:
    """A fencing token as the scripts take it: ``""`` for unknown."""
    return "" if token is None else token


class _Entry(weakref.ref["Renewable"]):
    """A registered lock: a weak reference to it that also holds its ``id()`` and
    name (to log, should the lock be garbage-collected while registered) and when
    it is next due. One object per registration, made without a Python-level call."""

    __slots__ = ("due", "ident", "name")
    due: float
    ident: int
    name: str


#: A lock to renew, the registration the renewal is for (``None`` for a lock
#: not registered on the lane: renewed, but never rescheduled, moved or lost),
#: and how many holds the lock had confirmed when the round was formed: a
#: verdict is not for a hold confirmed after that (see ``Renewable._mark_lost``).
_Renewal = tuple[Renewable, _Entry | None, int]


#: Replies that say a request went to a primary that no longer (or not alone)
#: holds its key's slot: sent again, it follows the key.
_REDIRECTS = (AskError, MovedError, TryAgainError)

#: What a request retried in the background follows its key on, on a cluster
#: (see :meth:`_Lane._send_pending`): a redirection, or its primary unreachable
#: (a failed primary, whose replica takes its slots over: sent again, the
#: request refreshes the slot map, and reaches the promoted replica once the
#: cluster names it).
_FOLLOWED = (*_REDIRECTS, *TRANSIENT)


def _follow_by(budget: float) -> Deadline:
    """The deadline of requests that follow their keys (see :func:`_follow`) in a
    round with ``budget`` seconds left: they hold up the lane's other work no
    longer than a retry's pause."""
    return Deadline.after(min(budget, RENEW_RETRY))


def _follow(redirect: Callable[[Call, Deadline], Any], call: Call, deadline: Deadline) -> Any:
    """``call`` sent by ``redirect`` to wherever its key lives now (a lock's
    ``_run``, or its ``_sender()``), by ``deadline`` (see :func:`_follow_by`): its
    reply, or the error it met (whatever it is: the request then goes through the
    usual retry and give-up bookkeeping)."""
    try:
        return redirect(call, deadline)
    except Exception as exc:
        return exc


class _Pending:
    """A request the lane keeps sending until it lands or ``until`` passes."""

    __slots__ = (
        "call",
        "next_try",
        "on_switch",
        "pause",
        "quiet",
        "redirect",
        "router",
        "settled",
        "then",
        "until",
        "what",
    )

    def __init__(
        self,
        call: Call,
        until: float,
        what: str,
        now: float,
        quiet: bool,
        redirect: Callable[[Call, Deadline], Any] | None,
        on_switch: bool = False,
        then: Callable[[], None] | None = None,
        router: Router | None = None,
    ) -> None:
        self.call = call
        #: Called once it has settled (landed or given up), by whoever settled it.
        self.then = then
        #: A last hold's release: once it frees the lock, it goes again to a new
        #: primary should the Sentinels turn out to have replaced the one that
        #: answered (see Transport.resend_on_switch), or the cluster's slot map
        #: come to put its key on another primary (see Router.resend_on_move).
        self.on_switch = on_switch
        #: Sends the call to wherever its key lives now, on a cluster (see
        #: _Lane._send_pending); ``None`` elsewhere.
        self.redirect = redirect
        #: The cluster's router of a last hold's release (``None`` elsewhere).
        self.router = router
        self.until = until
        self.what = what
        self.quiet = quiet
        self.next_try = now
        self.pause = 0.1
        #: Landed, or given up: set (with the lane's ``cond`` held) by whichever
        #: sender knew first, the lane's thread or a flush (see
        #: :func:`send_pending_now`), which alone logs it.
        self.settled = False


class _Lane:
    """The locks of one server and the thread that renews them."""

    def __init__(self, heartbeat: Heartbeat, transport: Transport) -> None:
        self.heartbeat = heartbeat
        self.transport = transport
        self.clock = heartbeat._clock
        # Taken as itself (not through ``cond``, a Python-level wrapper) where a
        # lock is registered or released: that is on every task's path.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.entries: dict[int, _Entry] = {}
        self.pending: list[_Pending] = []
        # Whether the lane's thread is in a round that reads owed answers (whose
        # handlers may hand requests over to be sent again) or sends pending
        # requests (and reports what it settles: logs it, calls its ``then``): a
        # flush at exit waits for it before the process ends (send_pending_now).
        self.busy = False
        # When to look for replies owed on idle connections (None: nothing owed),
        # which requests' replies to read then (those up to this value of the
        # transport's ``sends``), and whether a reply was deferred since the last look.
        self.drain_at: float | None = None
        self.drain_mark = 0
        self.deferred = False
        #: Times the thread woke up, times a caller woke it early, and connections
        #: whose owed replies it read itself (for tests and benchmarks).
        self.wakeups = 0
        self.notified = 0
        self.drained = 0
        self.thread: threading.Thread | None = None
        # When the sleeping thread wakes by itself (-inf while it is awake).
        self.wake_at = -math.inf
        # The deadline of the renewal round the thread is in (None: in none),
        # brought forward by a lock registered meanwhile that is due before it.
        self.round: MovableDeadline | None = None
        # Entries whose lock was garbage-collected while registered, to log.
        self.collected: deque[_Entry] = deque()
        self._collect = self.collected.append
        self.pid = _pid
        #: Whether the lane has left its heartbeat (see :meth:`_retire`): what is
        #: handed to it from then on goes to the transport's lane now.
        self.retired = False
        # When the last renewal failure was logged, and the failures since.
        self.warned_at = -math.inf
        self.unwarned = 0

    # Called from any thread.
    def register(self, lock: Renewable, due: float | None = None) -> _Lane:
        """Renew ``lock`` from now on, first at ``due`` (on the lane's clock; by
        default a renewal interval from now); return the lane it is registered
        on: this one, or the transport's lane now should this one have retired."""
        entry = _Entry(lock, self._collect)
        entry.ident, entry.name = id(lock), lock.name
        guard = self.lock
        # acquire() and release(), not ``with``: half the cost, on every hold taken.
        guard.acquire()
        try:
            if not self.retired:
                entry.due = self.clock() + lock.renew_interval if due is None else due
                self.entries[entry.ident] = entry
                # _wake()'s own test, first: usually nothing is to be done.
                if self.thread is None or entry.due < self.wake_at:
                    self._wake(entry.due)
                elif (round_trip := self.round) is not None:
                    # The thread is in a round: it waits for its answer no later than
                    # this lock is due (a connection gone dark holds up no renewal).
                    now = time.monotonic()
                    round_trip.bring_forward(now + max(entry.due - self.clock(), MIN_ROUND_TRIP))
                return self
        finally:
            guard.release()
        return self.heartbeat._lane(self.transport).register(lock, due)

    def primary_switched(self) -> None:
        """The transport learnt that the Sentinels replaced its primary: renew
        every lock now, on the new primary. A renewal answered by the old one
        since the switch did not reach the new one, whose copy of the lock may
        run out first; and a lock the old primary handed out since is not held
        on the new one: its holder finds it lost now, not a renewal interval
        later."""
        if self.pid != _pid:
            return
        with self.cond:
            if not self.entries:
                return
            now = self.clock()
            for entry in self.entries.values():
                entry.due = min(entry.due, now)
            self._wake(now)

    def watch_primary(self) -> None:
        """A request of this lane's transport waits for a switch of primary (see
        :meth:`~celery_redislock.transport.Transport.resend_on_switch`), or for
        its key to move to another cluster primary (see
        :meth:`~celery_redislock.transport.Router.resend_on_move`): have the
        thread ask the Sentinels, or the cluster primary, in time
        (:meth:`_check_at`), should no request of the transport ask them first.
        The thread is woken only if it would not wake by then anyway."""
        if self.pid != _pid:
            return
        with self.lock:
            if not self.retired:
                at = self._check_at(self.clock())
                if at is not None:
                    self._wake(at)
                return
        self.heartbeat._lane(self.transport).watch_primary()

    def _check_at(self, now: float) -> float | None:
        """When, on the lane's clock (``now`` on it), its transport's Sentinels are
        next to be asked for the requests that wait for a switch of primary;
        ``None``: no request waits."""
        at = self.transport.primary_check_at()
        if at is None:
            return None
        return now + max(0.0, at - time.monotonic())

    def unregister(self, lock: Renewable) -> bool:
        """Stop renewing ``lock``; return whether it was registered here (``False``
        in a forked child, whose lanes are its own)."""
        if self.pid != _pid:
            return False
        guard = self.lock
        # (Not ``with``: see register().)
        guard.acquire()
        try:
            entry = self.entries.get(id(lock))
            if entry is not None and entry() is lock:
                del self.entries[id(lock)]
                return True
        finally:
            guard.release()
        return False

    def add_pending(
        self,
        call: Call,
        until: float,
        what: str,
        quiet: bool,
        redirect: Callable[[Call, Deadline], Any] | None = None,
        on_switch: bool = False,
        then: Callable[[], None] | None = None,
        router: Router | None = None,
    ) -> None:
        with self.cond:
            if not self.retired:
                self.pending.append(
                    _Pending(
                        call, until, what, self.clock(), quiet, redirect, on_switch, then, router
                    )
                )
                self._wake(self.clock())
                return
        self.heartbeat._lane(self.transport).add_pending(
            call, until, what, quiet, redirect, on_switch, then, router
        )

    def drain_later(self) -> bool:
        """Have the owed replies read soon; ``False`` (nothing done) in a forked
        child, whose lanes are its own.

        The first call starts a cadence: the thread looks every
        :data:`DRAIN_DELAY` and reads only the replies owed since before its last
        look, which no request came to read in a whole period. While replies are
        deferred again and again (a worker releasing lock after lock), the next
        request reads each one, the thread reads none, and nobody wakes it: it
        stops looking after a period with nothing deferred and nothing owed.
        """
        if self.pid != _pid:
            return False
        if self.deferred and self.drain_at is not None:
            # Looking already, and told of a reply deferred since its last look
            # (read without the lock: a look that clears ``deferred`` meanwhile
            # finds this request's reply owed, and keeps looking). Never so on a
            # retired lane, which retired with nothing to look for.
            return True
        with self.lock:
            if not self.retired:
                self.deferred = True
                if self.drain_at is None:
                    self.drain_at = self.clock() + DRAIN_DELAY
                    # The first look reads what is owed now.
                    self.drain_mark = self.transport.sends
                    self._wake(self.drain_at)
                return True
        return self.heartbeat._lane(self.transport).drain_later()

    def locks(self) -> list[Renewable]:
        with self.cond:
            return [lock for e in self.entries.values() if (lock := e()) is not None]

    def renewals(self, locks: Iterable[Renewable]) -> list[_Renewal]:
        """``locks``, each with its current registration here (or ``None``)."""
        with self.cond:
            return [(lock, self._entry_of(lock), lock._confirmed()) for lock in locks]

    def _entry_of(self, lock: Renewable) -> _Entry | None:
        """With ``cond`` held: the current registration of ``lock``, if any."""
        entry = self.entries.get(id(lock))
        return entry if entry is not None and entry() is lock else None

    def _is_current(self, entry: _Entry) -> bool:
        """With ``cond`` held: whether ``entry`` is still its lock's registration.

        A renewal's verdict applies to the hold it was sent for only: the same
        lock object may have been released and taken again meanwhile (a new
        registration), and a 0 for the old hold says nothing about the new one.
        """
        return self.entries.get(entry.ident) is entry

    def stop(self) -> threading.Thread | None:
        """Drop the registered locks and have the thread end; return the thread."""
        with self.cond:
            self.entries.clear()
            self.cond.notify()
            return self.thread

    def _wake(self, at: float) -> None:
        """With ``cond`` held: make sure a thread runs and wakes by ``at``. None
        is started while the process flushes before it exits (see
        :func:`send_pending_now`, which sends what is pending itself)."""
        if self.thread is None:
            if _transport.exiting:
                return
            self.thread = threading.Thread(
                target=self._run, name="celery-redislock-heartbeat", daemon=True
            )
            self.thread.start()
        elif at < self.wake_at:
            # Only when earlier than planned: with one TTL for all locks that is
            # never, and taking a lock costs no thread switch.
            self.notified += 1
            self.cond.notify()

    # The lane's thread.
    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    batch = self._next_batch()
                    if batch is None:
                        return
                    renewals, pending, drain, check = batch
                    self.busy = bool(pending) or drain is not None
                try:
                    self._round(renewals, pending, drain, check)
                finally:
                    with self.cond:
                        self.busy = False
                        self.cond.notify_all()
                # No strong reference may outlive the round: a lock dropped by its
                # user must be collectable while the thread sleeps.
                del batch, renewals, pending, drain, check
        finally:
            # However the thread ends, the next caller that needs one starts another.
            with self.cond:
                if self.thread is threading.current_thread():
                    self.thread = None
                closing = self.retired and self.transport.dropped
            if closing:
                # Nothing of the package needs the connections any more.
                self.transport.close_idle()

    def _round(
        self,
        renewals: list[_Renewal],
        pending: list[_Pending],
        drain: int | None,
        check: bool,
    ) -> None:
        """One round of the lane's thread: what :meth:`_next_batch` found due."""
        if check:
            # Whatever the Sentinels say, quickly: sends again the
            # requests that wait for a switch, if one is learnt.
            try:
                self.transport.check_primary()
            except BaseException:
                # As for a round: the thread renews every lock on this server.
                logger.exception("celery_redislock: asking which server is primary failed")
        try:
            if renewals:
                self.renew(renewals, lane_thread=True)
                self.heartbeat.rounds += 1
            if pending:
                self._send_pending(pending)
            if drain is not None:
                try:
                    self.drained += self.transport.drain(
                        self._movable(self._budget()), written_by=drain
                    )
                finally:
                    self._end_round()
        except BaseException:
            # The round runs its users' code (the handlers of deferred
            # replies): not even a SystemExit there may end the thread,
            # which renews every other lock on this server.
            logger.exception("celery_redislock heartbeat round failed")

    def _next_batch(self) -> tuple[list[_Renewal], list[_Pending], int | None, bool] | None:
        """With ``cond`` held: sleep until work is due; ``None`` when the thread
        should end. The batch is the locks to renew (with their registrations),
        the requests to retry, (or ``None``) the last request whose owed reply to
        read, and whether to ask the Sentinels which server is primary (see
        :meth:`watch_primary`)."""
        idle_since = self.clock()
        # Only a Sentinel-managed primary's requests wait for a switch, and a
        # cluster primary's for a move (see watch_primary()): no other lane asks
        # when to check, on every wake.
        transport = self.transport
        while True:
            if self.collected:
                self._drop_collected()
            now = self.clock()
            if self.heartbeat._stopping:
                self.thread = None
                return None
            times = [e.due for e in self.entries.values()]
            if self.pending:
                times += [p.next_try for p in self.pending]
            if self.drain_at is not None:
                times.append(self.drain_at)
            check_at = self._check_at(now) if transport.checks_primary else None
            if check_at is not None:
                times.append(check_at)
            if times:
                idle_since = now
                wait = min(times) - now
                if wait <= 0:
                    break
            elif self.transport.dropped or now - idle_since >= IDLE_EXIT:
                # Nothing to do, and nothing will be: the client is gone (see
                # client_dropped(), which wakes the thread), or has not used the
                # lane for a while. (Looked at last, past the calls that take the
                # transport's lock: a finalizer that could not take this lane's
                # lock meanwhile set ``dropped`` before it tried.)
                self.thread = None
                self._retire()
                return None
            else:
                wait = IDLE_EXIT
            self.wake_at = now + wait
            self.cond.wait(wait)
            self.wake_at = -math.inf
            self.wakeups += 1
        # Renew everything due within half an interval, so locks taken at
        # nearly the same moment share one round trip.
        renewals: list[_Renewal] = []
        for entry in self.entries.values():
            lock = entry()
            if lock is not None and entry.due - lock.renew_interval / 2 <= now:
                renewals.append((lock, entry, lock._confirmed()))
        pending = [p for p in self.pending if p.next_try <= now]
        drain = None
        if self.drain_at is not None and self.drain_at <= now:
            drain, self.drain_mark = self.drain_mark, self.transport.sends
            keep_looking = self.deferred or self.transport.owes_replies()
            self.drain_at = now + DRAIN_DELAY if keep_looking else None
            self.deferred = False
        return renewals, pending, drain, check_at is not None and check_at <= now

    def _retire(self) -> None:
        """With ``cond`` held, the lane idle and its thread ending (or gone): leave
        the heartbeat. What is handed to the lane from now on (a registration that
        found it a moment ago, say) goes to the transport's lane, made anew, so
        nothing lands where no thread runs and no flush looks."""
        self.retired = True
        beat = self.heartbeat
        with beat._guard:
            if beat._lanes.get(self.transport) is self:
                del beat._lanes[self.transport]

    def retire_if_idle(self) -> None:
        """Retire the lane if its thread has ended, its transport's client is gone
        (see :attr:`~celery_redislock.transport.Transport.dropped`) and it has
        nothing to do, and close the transport's idle connections: a lane made
        with no work for its thread (see :meth:`Heartbeat.renew`), or left by
        :meth:`Heartbeat.stop`."""
        with self.cond:
            if (
                self.retired
                or self.thread is not None
                or self.pid != _pid
                or not self.transport.dropped
                or self.entries
                or self.pending
                or self.drain_at is not None
                or self._check_at(self.clock()) is not None
            ):
                return
            self._retire()
        self.transport.close_idle()

    def client_dropped(self) -> None:
        """The transport's client was garbage-collected: wake the thread, which
        retires the lane once it has nothing left to do.

        Called from the client's finalizer, in whatever thread collected it,
        perhaps amid code that holds a lock the lane's thread waits for: the
        lane's lock is only tried, never waited for. Should another thread hold
        it now, the lane retires when its thread next wakes (by
        :data:`IDLE_EXIT` at the latest)."""
        if self.lock.acquire(blocking=False):
            try:
                if self.thread is not None:
                    self.cond.notify()
            finally:
                self.lock.release()

    def _drop_collected(self) -> None:
        while self.collected:
            entry = self.collected.popleft()
            if self.entries.get(entry.ident) is entry:
                del self.entries[entry.ident]
                logger.warning(
                    "celery_redislock: lock %s was dropped without release(); it is no "
                    "longer renewed and expires by its TTL",
                    entry.name,
                )

    # Renewal.
    def renew(self, renewals: list[_Renewal], lane_thread: bool = False) -> None:
        """Renew locks (all on this lane's server) in one bounded round trip; each
        verdict applies to the registration the renewal was sent for only.

        The round trip ends by the earliest local deadline among the locks, and
        within the longest renewal interval among them. On the lane's thread
        (``lane_thread``) it also ends by the time the lane's next other lock is
        due, a lock registered while it waits for its answer included: a
        connection gone dark holds up no other renewal on this server (the round
        fails, the connection is closed, and the renewals go out again on another).
        """
        now = self.clock()
        live: list[_Renewal] = []
        for renewal in renewals:
            lock, entry, confirmed = renewal
            if lock._expires_at() <= now:
                # Its local deadline has passed: whatever the server says now,
                # the holder could not be sure of the lock for a while.
                self._lose(lock, entry, confirmed)
            else:
                live.append(renewal)
        if not live:
            if renewals:
                signals.heartbeat_round.send(
                    sender=self.transport.name, renewed=0, failed=0, lost=len(renewals)
                )
            return
        until = min(lock._expires_at() for lock, _, _ in live)
        longest = max(lock.renew_interval for lock, _, _ in live)
        if live[0][0]._clustered:
            # A round to a Redis Cluster primary that hangs (frozen, cut off) is cut
            # short, as any request to one is, for the renewals to follow the
            # failover in time (see the failure below).
            longest = min(longest, CLUSTER_TRY)
        deadline: Deadline
        if lane_thread:
            with self.cond:
                in_round = {id(entry) for _, entry, _ in live}
                others = (e.due for e in self.entries.values() if id(e) not in in_round)
                until = min(until, min(others, default=math.inf))
                budget = min(max(until - now, MIN_ROUND_TRIP), longest)
                # A lock registered from now on brings it forward (see register()).
                deadline = self._movable(budget)
        else:
            budget = min(max(until - now, MIN_ROUND_TRIP), longest)
            deadline = Deadline.after(budget)
        # The hold's fencing token too: a copy of an earlier hold of the same owner
        # (on a primary the Sentinels promoted after the holder took the lock anew
        # on the old one) is not renewed, and the holder finds its hold lost.
        calls = [
            Call(EXTEND_SCRIPT, [lock.key], [lock.owner, lock.ttl_ms, _token(lock.token)])
            for lock, _, _ in live
        ]
        # The round trip's own failure (logged here), else none: renewals that
        # fail one by one (refused by the server) are logged after the round.
        raised: BaseException | None = None
        try:
            results = run_calls(self.transport, calls, deadline)
        except RedisError as exc:
            self._warn_renewals(len(live), exc)
            results = [exc] * len(live)
            raised = exc
            live[0][0]._redirected(exc)
        finally:
            if lane_thread:
                self._end_round()
        for at, ((lock, _entry, _), result) in enumerate(zip(live, results, strict=True)):
            redirect = getattr(lock, "_run", None)
            if isinstance(result, AskError) and redirect is not None:
                # Its slot is moving, its key already on the new primary: the
                # renewal follows it there (until the slot has moved).
                results[at] = _follow(redirect, calls[at], _follow_by(budget))
        after = self.clock()
        renewed = failed = 0
        refused: list[Exception] = []
        lost = len(renewals) - len(live)
        for (lock, entry, confirmed), result in zip(live, results, strict=True):
            if isinstance(result, Exception) and may_have_run(result):
                # It may have run all the same (its answer lost), setting the TTL
                # back from a longer extend's.
                lock._renewal_failed(now)
            if lock.transport is not self.transport and isinstance(result, Exception):
                # A cluster slot moved: the lane of the lock's new primary takes it.
                self._move(lock, entry, after)
            elif lock.transport is not self.transport and result == 1:
                # Renewed where it followed the slot: from now on there, rather than
                # here first, to meet MOVED again every round.
                renewed += 1
                lock._renewed(now)
                self._move(lock, entry, now + lock.renew_interval)
            elif result == 1:
                renewed += 1
                lock._renewed(now)
                self._reschedule(entry, now + lock.renew_interval)
            elif isinstance(result, Exception):
                failed += 1
                if result is not raised:
                    refused.append(result)
                if lock._expires_at() <= after:
                    lost += 1
                    self._lose(lock, entry, confirmed)
                else:
                    # Retried soon, and at the latest when its local deadline
                    # passes: on_lost is then called on time, not a retry late.
                    retry_at = after + min(RENEW_RETRY, lock.renew_interval / 4)
                    self._reschedule(entry, min(retry_at, lock._expires_at()))
            else:
                lost += 1
                self._lose(lock, entry, confirmed)
        if refused:
            self._warn_renewals(len(refused), refused[0])
        elif failed == 0:
            self.warned_at, self.unwarned = -math.inf, 0
        signals.heartbeat_round.send(
            sender=self.transport.name, renewed=renewed, failed=failed, lost=lost
        )

    def _warn_renewals(self, count: int, error: BaseException) -> None:
        """Log that ``count`` renewals failed with ``error``: the first failure
        after a round that renewed all it sent, then at most once every
        :data:`RENEW_WARNING_EVERY` seconds while failures go on."""
        now = self.clock()
        if now - self.warned_at < RENEW_WARNING_EVERY:
            self.unwarned += 1
            return
        since = (
            f" ({self.unwarned} more failed rounds since the last warning)" if self.unwarned else ""
        )
        self.warned_at, self.unwarned = now, 0
        logger.warning(
            "celery_redislock: could not renew %d lock(s) on %s: %s%s",
            count,
            self.transport.describe(),
            describe_error(error),
            since,
        )

    def _move(self, lock: Renewable, entry: _Entry | None, due: float) -> None:
        with self.cond:
            if entry is None or not self._is_current(entry):
                return
            del self.entries[entry.ident]
        self.heartbeat._lane(lock.transport).register(lock, due)

    def _reschedule(self, entry: _Entry | None, due: float) -> None:
        with self.cond:
            if entry is not None and self._is_current(entry):
                entry.due = due

    def _lose(self, lock: Renewable, entry: _Entry | None, confirmed: int) -> None:
        """Apply a verdict that ``lock`` is lost, reached by a round formed when it
        had confirmed ``confirmed`` holds: to the registration it was for, and only
        if no hold was confirmed since (then the verdict is not for that hold)."""
        with self.cond:
            if entry is None or not self._is_current(entry):
                return
            lost = lock._mark_lost(confirmed)
            if lost is None:
                # A hold confirmed since (a re-entry that found the lock still
                # held): it stays registered, renewed when due.
                return
            del self.entries[id(lock)]
        if lost:
            try:
                lock._report_lost()
            except Exception:
                # A failing on_lost callback must not cut the round short for the
                # other locks (or kill the thread).
                logger.exception("celery_redislock: on_lost callback for %s failed", lock.name)
            except BaseException:
                # Nor may a SystemExit from one end the lane's thread. In a caller's
                # own thread (Heartbeat.renew) it is the caller's to handle.
                if threading.current_thread() is not self.thread:
                    raise
                logger.exception("celery_redislock: on_lost callback for %s failed", lock.name)

    # Background requests.
    def _movable(self, budget: float) -> MovableDeadline:
        """The deadline, ``budget`` seconds away, of what the lane's thread does
        next: a lock registered meanwhile that is due before it brings it forward
        (see :meth:`register`), or a flush (see :func:`finish_rounds`). The
        caller ends it with :meth:`_end_round`."""
        with self.cond:
            deadline = self.round = MovableDeadline(time.monotonic() + budget)
        return deadline

    def _end_round(self) -> None:
        """The thread's round (see :meth:`_movable`) is over: a flush waiting for
        it (see :func:`finish_rounds`) goes on."""
        with self.cond:
            self.round = None
            self.cond.notify_all()

    def _budget(self) -> float:
        """How long this round's other work (background requests, reading owed
        replies) may take: until the next renewal is due, within
        [:data:`MIN_ROUND_TRIP`, ``DEFAULT_CALL_TIMEOUT``], so that a connection
        gone dark holds up no renewal on this server. (A reply not read in time
        counts as lost: a release is then sent again.)"""
        with self.cond:
            due = min((entry.due for entry in self.entries.values()), default=math.inf)
        return max(MIN_ROUND_TRIP, min(DEFAULT_CALL_TIMEOUT, due - self.clock()))

    def _send_pending(
        self, due: list[_Pending], deadline: Deadline | None = None, final: bool = False
    ) -> None:
        """Send the requests ``due`` in one round trip and settle those that landed
        or ran out of time; the others are tried again after a pause.

        From the lane's thread (no ``deadline``) the round trip takes the lane's
        budget (see :meth:`_budget`). A flush (see :func:`send_pending_now`) gives
        its own ``deadline``, and, ``final`` (the process exits), settles those
        that fail too: nothing is left to try them again. The lane's thread may
        be sending the same requests meanwhile (they are safe to send twice):
        whichever of the two settles one first logs it.
        """
        written_at = time.monotonic()
        now = self.clock()
        round_trip: Deadline
        if deadline is None:
            budget = max(MIN_ROUND_TRIP, min(self._budget(), *(p.until - now for p in due)))
            round_trip = self._movable(budget)
        else:
            # No renewal waits for a flush: the thread renews on its own meanwhile.
            budget = max(MIN_ROUND_TRIP, min(p.until - now for p in due))
            budget = min(budget, deadline.remaining())
            round_trip = Deadline(written_at + budget)
        try:
            results = run_calls(self.transport, [p.call for p in due], round_trip)
        except RedisError as exc:
            results = [exc] * len(due)
        finally:
            if deadline is None:
                self._end_round()
        # One deadline for all the requests that follow their keys, in order: a
        # failed primary with many releases waiting holds up its lane's renewals
        # no longer than one. A flush's own: no renewal waits for it.
        follow_by: Deadline | None = deadline
        for at, (item, result) in enumerate(zip(due, results, strict=True)):
            redirect = item.redirect
            if isinstance(result, _FOLLOWED) and redirect is not None:
                # A cluster slot moved, or is moving, or this lane's server failed
                # (its replica may hold the slot now, or soon): the request
                # follows the key on its own, wherever the cluster says it lives.
                if follow_by is None:
                    follow_by = _follow_by(budget)
                results[at] = _follow(redirect, item.call, follow_by)
        after = self.clock()
        landed: list[tuple[_Pending, Any]] = []
        failed: list[tuple[_Pending, Exception]] = []
        with self.cond:
            for item, result in zip(due, results, strict=True):
                if item.settled:
                    continue
                if not isinstance(result, Exception):
                    item.settled = True
                    landed.append((item, result))
                elif after >= item.until or final:
                    item.settled = True
                    failed.append((item, result))
                else:
                    item.next_try = after + item.pause
                    item.pause = min(2.0, item.pause * 2)
            if landed or failed:
                self.pending = [p for p in self.pending if not p.settled]
        freed = []
        for item, result in landed:
            if item.on_switch and result == Released.FREED:
                freed.append(item)
            if item.quiet:
                logger.debug("celery_redislock: %s: done", item.what)
            elif result == Released.NOT_OWNED:
                logger.warning(
                    "celery_redislock: %s: the lock was no longer held (it had "
                    "expired or been taken over)",
                    item.what,
                )
            else:
                logger.info("celery_redislock: %s: done", item.what)
        for item, error in failed:
            logger.warning(
                "celery_redislock: %s: gave up (%s)%s; the lock expires by its TTL",
                item.what,
                describe_error(error),
                " as the process exits" if after < item.until else "",
            )
        for item, _ in (*landed, *failed):
            if item.then is not None:
                try:
                    item.then()
                except Exception:
                    logger.exception("celery_redislock: %s: its follow-up failed", item.what)
        if freed and not final:
            self._resend_on_switch(written_at, freed)

    def _resend_on_switch(self, written_at: float, freed: list[_Pending]) -> None:
        """Releases sent from here at ``written_at`` freed their locks on a
        Sentinel-managed primary, or a cluster primary: as for those a lock's own
        thread sends, they go again, in the background, to a new primary should
        the transport learn soon that the Sentinels had replaced the one that
        answered (which may have taken them after its replica was promoted), and
        the Sentinels are asked meanwhile; or should the cluster's slot map come
        to put their keys on another primary than the one that answered (which
        may have died before its replica had them)."""
        for item in freed:
            router = item.router
            if router is not None:
                # It may have followed its key: the map names who answered.
                key = item.call.keys[0]
                what = f"{item.what} again where its key lives now"
                again = functools.partial(
                    self.heartbeat.send_where_it_lives, router, item.call, item.until, what
                )
                answered = router.transport(key)
                router.resend_on_move(answered, key, written_at, item.until, again)
                self.heartbeat.watch_primary(answered)
                continue
            if not self.transport.follows_switches:
                continue
            again = functools.partial(
                self.heartbeat.send_in_background,
                self.transport,
                item.call,
                item.until,
                f"{item.what} again on the new primary",
            )
            if self.transport.resend_on_switch(written_at, item.until, again):
                self.watch_primary()


class Heartbeat:
    """Renews registered locks from background threads, one per Redis server.

    Use :func:`get_heartbeat` for the process-wide instance; separate instances
    exist only for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lanes: dict[Transport, _Lane] = {}
        self._guard = threading.Lock()
        self._stopping = False
        #: Completed renewal rounds; each round is one round trip per server.
        self.rounds = 0

    def _lane(self, transport: Transport) -> _Lane:
        lane = self._lanes.get(transport)
        if lane is not None:
            return lane
        with self._guard:
            lane = self._lanes.get(transport)
            if lane is not None:
                return lane
            lane = self._lanes[transport] = _Lane(self, transport)
            transport.watch_switches(lane)
            # Lanes with no thread whose clients are gone, left idle (see
            # _Lane.retire_if_idle): looked at as a lane is made, which is rare.
            idle = [
                other
                for other in self._lanes.values()
                if other.thread is None and other.transport.dropped and other is not lane
            ]
        for other in idle:
            other.retire_if_idle()
        return lane

    def register(self, lock: Renewable, first: float | None = None) -> _Lane:
        """Start renewing ``lock`` every ``lock.renew_interval`` seconds (the first
        time ``first`` seconds from now, if given); return its lane, where the lock
        can unregister itself directly (see :meth:`_Lane.unregister`)."""
        self._stopping = False
        transport = lock.transport
        lane = self._lanes.get(transport) or self._lane(transport)
        return lane.register(lock, None if first is None else self._clock() + first)

    def unregister(self, lock: Renewable) -> None:
        """Stop renewing ``lock`` (no-op if it is not registered)."""
        lane = self._lanes.get(lock.transport)
        if lane is not None:
            lane.unregister(lock)

    def retry_in_background(
        self,
        lock: Renewable,
        call: Call,
        until: float,
        what: str,
        quiet: bool = False,
        on_switch: bool = False,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Send ``call`` (a request about ``lock``, safe to send twice) until it
        lands or the heartbeat's clock reaches ``until``; ``what`` names it in the
        logs, where a release that found the lock not held is a warning unless
        ``quiet``. ``then`` is called once it has landed or been given up. On a cluster it follows the lock's key: to the primary its slot
        moved to, or to the replica promoted after its primary failed (a try that
        finds the primary unreachable is sent again at once to wherever the
        cluster's refreshed slot map puts the key). With ``on_switch`` (a last
        hold's release), once it frees the lock on a Sentinel-managed primary, it
        goes again to a new primary should the process learn soon that the
        Sentinels had replaced that one (see
        :meth:`~celery_redislock.transport.Transport.resend_on_switch`); on a
        cluster, should the slot map come to put its key on another primary (see
        :meth:`~celery_redislock.transport.Router.resend_on_move`)."""
        self._stopping = False
        # A lock that can send a request wherever its key lives (RedisLock._sender,
        # on a cluster) has its background requests follow a moving cluster slot
        # or a failover, without keeping the lock alive: a lock its user dropped
        # is collected (and no longer renewed) at once, as the lane holds locks weakly.
        sender = getattr(lock, "_sender", None)
        redirect = sender() if sender is not None else None
        # A last hold's release on a cluster: sent again should its key move.
        router = getattr(lock, "_router", None) if on_switch and redirect is not None else None
        self._lane(lock.transport).add_pending(
            call, until, what, quiet, redirect, on_switch, then, router
        )

    def send_in_background(self, transport: Transport, call: Call, until: float, what: str) -> None:
        """Send ``call`` (safe to send twice) on ``transport`` until it lands or the
        heartbeat's clock reaches ``until``, quietly and for no lock object: a
        release sent again after a switch of primary (see
        :meth:`~celery_redislock.transport.Transport.resend_on_switch`), whose
        lock may be gone by then."""
        self._stopping = False
        self._lane(transport).add_pending(call, until, what, True)

    def send_where_it_lives(self, router: Router, call: Call, until: float, what: str) -> None:
        """:meth:`send_in_background` to the cluster primary whose slot holds
        ``call``'s key now, as ``router``'s slot map says: a release sent again
        after its key moved (see
        :meth:`~celery_redislock.transport.Router.resend_on_move`)."""
        self.send_in_background(router.transport(call.keys[0]), call, until, what)

    def watch_primary(self, transport: Transport) -> None:
        """Have ``transport``'s lane ask its Sentinels which server is primary while
        requests wait for a switch of primary (see
        :meth:`~celery_redislock.transport.Transport.resend_on_switch`), or ask
        the cluster primary whether it still serves the keys of requests that
        wait for a move (see
        :meth:`~celery_redislock.transport.Router.check_moves`), should no
        request of the transport ask them first: a process gone idle learns a
        switch all the same, and sends them again."""
        self._stopping = False
        self._lane(transport).watch_primary()

    def drain_later(self, transport: Transport) -> None:
        """Have ``transport``'s owed replies read soon, if no request reads them first."""
        self._lane(transport).drain_later()

    def held(self) -> list[Renewable]:
        """The locks being renewed right now."""
        with self._guard:
            lanes = list(self._lanes.values())
        return [lock for lane in lanes for lock in lane.locks()]

    def renew(self, locks: Iterable[Renewable]) -> None:
        """Renew ``locks`` now, from the calling thread: one round trip per server."""
        by_transport: dict[Transport, list[Renewable]] = {}
        for lock in locks:
            by_transport.setdefault(lock.transport, []).append(lock)
        for transport, group in by_transport.items():
            lane = self._lane(transport)
            lane.renew(lane.renewals(group))
        self.rounds += 1

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop every thread and wait for them (at most ``timeout`` seconds each).

        The locks registered now are dropped: they are no longer renewed, even once
        a later registration starts the threads again, and expire by their TTL.
        Requests being retried in the background are kept, and resume then.
        """
        self._stopping = True
        with self._guard:
            lanes = list(self._lanes.values())
        threads = [thread for lane in lanes if (thread := lane.stop()) is not None]
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout)


#: How long after its reading deadline a flush waits at most for a lane's round
#: to end (see :func:`finish_rounds`), in seconds: its reads end within a
#: :data:`~celery_redislock.transport.WATCH_STEP` of it.
ROUND_GRACE = 2 * WATCH_STEP


def finish_rounds(reading: Deadline) -> None:
    """Have the rounds this process's lanes' threads are in end by ``reading``, and
    wait for them (a little past it at most, :data:`ROUND_GRACE`): one of them
    may be reading replies owed on a connection gone dark, a release's among
    them, which a flush (see :func:`~celery_redislock.transport.flush`) must see
    counted lost, and sent again, before the process exits. (A connect or a
    write under way keeps its own deadline: it is not waited for so long.)"""
    beat = _heartbeat
    if beat is None:
        return
    with beat._guard:
        lanes = list(beat._lanes.values())
    until = max(reading.at, time.monotonic()) + ROUND_GRACE
    for lane in lanes:
        if lane.pid != _pid:
            continue
        with lane.cond:
            round_trip = lane.round
            # Only a round that reads owed replies, or may yet: one that does not
            # sends nothing that the flush does not send again itself.
            if round_trip is None or not lane.transport.reading_owed():
                continue
            round_trip.bring_forward(reading.at)
            while lane.round is round_trip and (left := until - time.monotonic()) > 0:
                lane.cond.wait(left)


def send_pending_now(deadline: Deadline, final: bool = False) -> None:
    """Send, from the calling thread and by ``deadline``, every request this
    process's heartbeat retries in the background, those whose next try is not
    due yet too (see :func:`~celery_redislock.transport.flush`, which calls it):
    one round trip per server, on a new connection (the idle ones may be the
    ones that went dark). ``final``: the process exits, so a request that fails
    is given up (and logged so) rather than tried again later.

    Only this process's own: a forked child does not send its parent's. The
    lanes' threads may be sending some of them meanwhile (see
    :meth:`_Lane._send_pending`).

    Requests handed over while it sends (releases sent again as a round trip
    learns that the Sentinels replaced the primary) go too, in another round
    trip, until none is new or ``deadline`` has passed."""
    beat = _heartbeat
    if beat is None:
        return
    _send_pending_now(beat, deadline, final)
    if final:
        # A lane's thread in a round meanwhile may hand more requests over (an
        # answer it counts lost), sent here next, or settle some, reported before
        # the process ends.
        _wait_for_lanes(beat, deadline)
        _send_pending_now(beat, deadline, final)
        _wait_for_lanes(beat, deadline)


def _wait_for_lanes(beat: Heartbeat, deadline: Deadline) -> None:
    """Wait, by ``deadline``, for this process's lanes' threads to end the rounds
    that read owed answers or send pending requests (see ``_Lane.busy``)."""
    with beat._guard:
        lanes = [lane for lane in beat._lanes.values() if lane.pid == _pid]
    for lane in lanes:
        with lane.cond:
            while lane.busy and (left := deadline.remaining()) > 0:
                lane.cond.wait(left)


def _send_pending_now(beat: Heartbeat, deadline: Deadline, final: bool) -> None:
    """:func:`send_pending_now`'s sends."""
    sent: set[_Pending] = set()
    while True:
        with beat._guard:
            lanes = list(beat._lanes.values())
        new = False
        for lane in lanes:
            if lane.pid != _pid or deadline.expired():
                continue
            with lane.cond:
                due = [p for p in lane.pending if not p.settled and p not in sent]
            if not due:
                continue
            sent.update(due)
            new = True
            try:
                lane.transport.close_idle()
                lane._send_pending(due, deadline, final)
            except Exception:
                # One server's failure keeps no other's requests from going.
                logger.exception(
                    "celery_redislock: sending the requests retried in the background to %s failed",
                    lane.transport.describe(),
                )
        if not new or deadline.expired():
            return


def _client_dropped(transport: Transport) -> None:
    """The client of ``transport`` was garbage-collected: its lane, if any, retires
    once idle (see :meth:`_Lane.client_dropped`; it never waits for a lock)."""
    beat = _heartbeat
    lane = beat._lanes.get(transport) if beat is not None else None
    if lane is not None:
        lane.client_dropped()


_transport._after_reading.append(finish_rounds)
_transport._after_drain.append(send_pending_now)
_transport._on_drop.append(_client_dropped)

_heartbeat: Heartbeat | None = None
# This process's id: a lane of the parent's, reached in a forked child through a
# lock that was registered before the fork, is left alone (its thread and its
# lock state are the parent's).
_pid = os.getpid()
_heartbeat_guard = threading.Lock()


def get_heartbeat() -> Heartbeat:
    """Return this process's heartbeat, creating it on first use."""
    global _heartbeat
    if _heartbeat is None:
        with _heartbeat_guard:
            if _heartbeat is None:
                _heartbeat = Heartbeat()
    return _heartbeat


def _reset_after_fork() -> None:
    global _heartbeat, _heartbeat_guard, _pid
    _heartbeat = None
    _heartbeat_guard = threading.Lock()
    _pid = os.getpid()


os.register_at_fork(after_in_child=_reset_after_fork)
