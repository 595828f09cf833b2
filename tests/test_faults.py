"""The engine under real faults: stalled and restarted servers, reset connections, lost
replies, black holes, dropped lock objects (see the fault table of docs/guarantees.md)."""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import pytest
import redis
from celery import Celery, signals
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import (
    LockBackendError,
    LockConflictError,
    LockLostError,
    RedisLock,
    SingletonTask,
    wakeups,
)
from celery_redislock import client as client_module
from celery_redislock import lock as lock_module
from celery_redislock import signals as lock_signals
from celery_redislock.admin import ForceReleased, force_release
from celery_redislock.heartbeat import Heartbeat, get_heartbeat
from celery_redislock.ids import request_id
from celery_redislock.lock import lock_keys, release_lease, wake_channel_prefix
from celery_redislock.reservations import queued_owner
from celery_redislock.scripts import (
    ACQUIRE,
    COPIES_MARK,
    COPIES_REMEMBERED,
    COPY_MARK,
    COUNT_FIELD,
    DROPS_FIELD,
    DROPS_REMEMBERED,
    EXTEND,
    EXTEND_SCRIPT,
    FENCE_FIELD,
    GRANT_MS,
    OWNER_FIELD,
    RELEASE,
    WATCHED,
    Call,
    Released,
    queue_entry,
    unwatched,
)
from celery_redislock.server import RedisServer
from celery_redislock.transport import pack, transport_for
from celery_redislock.wakeups import PROBE_AFTER, hub_for
from tests.proxy import FaultProxy
from tests.support import (
    acquire_in_thread,
    close_app,
    field,
    fields,
    held,
    in_forked_child,
    make_app,
    queue_entries,
    up_for_anyone,
    wait_for,
    wait_until,
    write_fields,
)
from tests.support import hold_count as stored_hold_count


@pytest.fixture(autouse=True)
def _url_clients_forgotten() -> Iterator[None]:
    """Forget, as the test ends, the clients its lock store URLs cached for the
    process (one per URL, on purpose: see :func:`~celery_redislock.client.get_client`).
    Each test here has a server or proxy of its own, on a port no later test uses:
    kept, every such client and the connections its locks opened would stay until
    the session ends. Forgotten, they are closed once nothing of the test needs them."""
    before = set(client_module._clients)
    yield
    for url in set(client_module._clients) - before:
        client_module._clients.pop(url, None)


@pytest.fixture
def server(redislock_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A server of this test's own (tests here pause, restart and stop it)."""
    return redislock_server_factory()


@pytest.fixture
def direct(server: RedisServer) -> Iterator[redis.Redis]:
    """A client straight to the server, for checking and for a second holder."""
    client = server.client(socket_timeout=5, socket_connect_timeout=5)
    yield client
    client.close()


@pytest.fixture
def proxy(server: RedisServer) -> Iterator[FaultProxy]:
    """A fault proxy in front of the server."""
    with FaultProxy(server.host, server.port) as fault_proxy:
        yield fault_proxy


@pytest.fixture
def via_proxy(proxy: FaultProxy) -> Iterator[redis.Redis]:
    """A client built as users build them (redis-py defaults: its own retries, no
    timeouts), connected through the proxy."""
    client = redis.Redis.from_url(proxy.url)
    yield client
    client.close()


def hold_count(client: redis.Redis, lock: RedisLock) -> int:
    """The hold count stored in Redis (0 when the lock is free)."""
    return stored_hold_count(client, lock.key)


def ends_its_two_holds_alone(client: redis.Redis, lock: RedisLock) -> None:
    """``lock``, held twice on both sides, keeps out a rival through its inner
    release, and is free after its outer one."""
    assert hold_count(client, lock) == 2
    lock.release()
    rival = RedisLock(client, lock.name, ttl=30)
    assert not rival.acquire(blocking=False)
    lock.release()
    assert not held(client, lock.key)


# Every call is bounded.


def test_acquire_on_stalled_server_is_bounded_by_its_timeout(server: RedisServer) -> None:
    """acquire(timeout=1) against a SIGSTOPped server raises LockBackendError after about
    1 s, even on a client with no socket timeouts, whose connection is fresh or pooled."""
    lock = RedisLock(redis.Redis(host=server.host, port=server.port), "stalled", ttl=10)
    assert lock.acquire(blocking=False)
    lock.release()
    other = RedisLock(redis.Redis(host=server.host, port=server.port), "stalled-2", ttl=10)
    with server.paused():
        for candidate in (lock, other):  # a pooled connection, then a fresh one
            started = time.monotonic()
            with pytest.raises(LockBackendError) as excinfo:
                candidate.acquire(timeout=1)
            elapsed = time.monotonic() - started
            assert "timed out" in str(excinfo.value)
            assert elapsed < 4.0, elapsed


def test_release_on_stalled_server_stops_renewal_and_lands_later(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A release that cannot reach Redis raises after call_timeout, takes the lock off the
    heartbeat at once, and is retried in the background until it lands."""
    lock = RedisLock(server.url, "release-stalled", ttl=30, call_timeout=0.5)
    assert lock.acquire()
    with server.paused():
        with pytest.raises(LockBackendError) as excinfo:
            lock.release()
        assert lock not in get_heartbeat().held()
        assert not lock.holding
    assert "retried in the background" in str(excinfo.value)
    wait_for(lambda: not held(direct, lock.key), what="the background release")


def test_owed_answer_from_a_stalled_server_is_a_timeout(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A request on a connection that still owes a release's answer, to a server that
    stalled, fails as a timeout (not as a broken connection); the release is told
    the same, retried in the background, and lands once the server is back."""
    client = redis.Redis(host=server.host, port=server.port)
    lock = RedisLock(client, "owed-stalled", ttl=30, call_timeout=0.5)
    other = RedisLock(client, "owed-stalled-2", ttl=30, call_timeout=0.5)
    assert lock.acquire(blocking=False)
    outcomes: list[str] = []
    with server.paused():
        lock.release(wait=False, then=outcomes.append)
        with pytest.raises(LockBackendError) as excinfo:
            other.acquire(blocking=False)
        assert "timed out" in str(excinfo.value)
    assert wait_until(lambda: bool(outcomes))
    assert outcomes == ["retrying"]
    wait_for(lambda: not held(direct, lock.key), what="the background release")
    client.close()


def test_release_that_never_lands_leaves_the_lock_to_its_ttl(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """With Redis out of reach for good, a failed release still stops renewal: the lock
    expires by its TTL, as the error says."""
    lock = RedisLock(proxy.url, "release-blackholed", ttl=1, call_timeout=0.3)
    assert lock.acquire()
    proxy.blackhole()
    proxy.refuse()
    with pytest.raises(LockBackendError) as excinfo:
        lock.release()
    assert "expires by its TTL" in str(excinfo.value)
    assert lock not in get_heartbeat().held()
    wait_for(lambda: not held(direct, lock.key), timeout=5, what="expiry by TTL")


# Transient errors are retried, and a retry never acts twice.


def test_reset_connections_are_retried(proxy: FaultProxy, via_proxy: redis.Redis) -> None:
    """After every connection was reset, the next acquire and release reconnect and succeed."""
    lock = RedisLock(via_proxy, "reset", ttl=10)
    assert lock.acquire(blocking=False)
    proxy.reset_all()
    lock.release()
    proxy.reset_all()
    assert lock.acquire(blocking=False)
    proxy.reset_all()
    lock.release()
    assert not lock.locked()


def test_retried_acquire_counts_one_hold(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """An acquire whose reply is lost after the server ran it is retried and counts once:
    one release frees the lock."""
    lock = RedisLock(via_proxy, "acquire-dropped", ttl=10)
    proxy.drop_replies(1)
    assert lock.acquire(blocking=False)
    assert hold_count(direct, lock) == 1
    lock.release()
    assert not held(direct, lock.key)


def test_a_waiter_whose_time_runs_out_far_from_the_server_returns_false(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """A blocking acquire whose timeout runs out while the lock stays held returns
    ``False``, as documented, even when the server is further away than the time
    left for its last try: that try's missing answer is no outage."""
    other = RedisLock(direct, "far", ttl=30)
    assert other.acquire(blocking=False)
    lock = RedisLock(via_proxy, "far", ttl=30)
    assert not lock.acquire(timeout=0.05)  # the subscription is in place
    proxy.set_latency(0.06)
    try:
        assert lock.acquire(timeout=1) is False
    finally:
        proxy.set_latency(0)
    wait_for(lambda: direct.zcard(lock_keys("far").queue) == 0, what="the waiter to leave")
    assert other.owned()
    other.release()


class _Interrupted(Exception):
    """Raised from a signal handler, as Celery raises SoftTimeLimitExceeded."""


@pytest.mark.parametrize("how", ["try", "written-ahead", "at once", "waiter"])
def test_an_acquire_interrupted_before_its_reply_leaves_no_hold_behind(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis, how: str
) -> None:
    """An exception raised asynchronously (a soft time limit) while an acquire waits
    for its reply, after the server ran it, leaves no hold for the lock's TTL and no
    waiter queued: what it may have done is undone in the background."""
    lock = RedisLock(via_proxy, "interrupted", ttl=30)
    # The connection is open and the server has the script before the delay.
    assert lock.acquire(blocking=False)
    lock.release()
    waits = how == "waiter"
    if waits:
        other = RedisLock(direct, "interrupted", ttl=30)
        assert other.acquire(blocking=False)
        # And the process's wake-up subscription is in place.
        assert not lock.acquire(timeout=0.05)
    proxy.set_latency(0.5)

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    def acquire() -> bool:
        if how == "written-ahead":
            ahead = lock._send_acquire()
            assert ahead is not None
            return lock._acquire_sent(ahead)
        if how == "at once":
            return bool(lock._acquire_at_once())
        return lock.acquire(blocking=waits, timeout=10 if waits else None)

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.75)  # the request ran, its reply is on its way
    try:
        with pytest.raises(_Interrupted):
            acquire()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        proxy.set_latency(0)
    if waits:
        queue = lock_keys("interrupted").queue
        wait_for(lambda: direct.zcard(queue) == 0, what="the waiter to leave the queue")
        other.release()
    else:
        wait_for(lambda: not held(direct, lock.key), what="the hold to be undone")
    assert not lock.holding


class _InterruptedBeforeTheRead(RedisLock):
    """A lock whose :meth:`_acquire_sent` is interrupted as it is entered, once the
    request has run (its reply on its way): what an exception raised
    asynchronously just after an acquire was written, before its reply is
    awaited, does. ``probe``: a client of the same server, to see it run."""

    probe: redis.Redis
    #: The connection the acquire was written on.
    link: Any = None

    def _acquire_sent(self, ahead: Any) -> bool:
        self.link = ahead.link
        wait_for(lambda: held(self.probe, self.key), what="the acquire to run")
        raise _Interrupted


def test_an_acquire_at_once_interrupted_between_its_write_and_its_read_leaves_no_hold(
    direct: redis.Redis,
) -> None:
    """The acquire a task makes as it starts when none was written ahead (a prefork
    pool process's): an exception raised asynchronously after its request was
    written, before its reply is read, has the hold it made undone in the
    background, not left for the lock's TTL."""
    warm = RedisLock(direct, "interrupted-at-once", ttl=30)
    # The server has the script: the request goes by digest, as a worker's does.
    assert warm.acquire(blocking=False)
    warm.release()
    lock = _InterruptedBeforeTheRead(direct, "interrupted-at-once", ttl=30)
    lock.probe = direct
    with pytest.raises(_Interrupted):
        lock._acquire_at_once()
    wait_for(lambda: not held(direct, lock.key), what="the hold to be undone")
    assert not lock.holding
    # The connection it was written on, its reply never to be read, is closed,
    # neither left open nor given back to be used out of step.
    assert lock.link is not None
    assert lock.link.conn._sock is None
    assert lock.link not in lock.transport._idle
    # The lock is free for the next comer at once, not after its TTL.
    other = RedisLock(direct, "interrupted-at-once", ttl=30)
    assert other.acquire(blocking=False)
    other.release()


def test_a_release_interrupted_before_its_reply_is_sent_again(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """An exception raised asynchronously (a soft time limit as ``with lock:`` exits)
    while a release waits for its reply drops the hold here, as an answer lost does,
    and the release is sent again in the background until it lands: the lock is not
    left held for its TTL, unrenewed."""
    lock = RedisLock(via_proxy, "release-interrupted", ttl=30)
    assert lock.acquire(blocking=False)
    proxy.blackhole()  # the release goes nowhere for now

    def interrupt(signum: int, frame: Any) -> None:
        raise _Interrupted

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.3)
    try:
        with pytest.raises(_Interrupted):
            lock.release()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        proxy.heal()
    assert not lock.holding
    wait_for(lambda: not held(direct, lock.key), what="the release sent again to land")


def test_a_reply_owed_on_a_connection_gone_dark_holds_up_no_renewal(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """The heartbeat thread that renews a server's locks also reads the replies owed
    to releases that did not wait (and sends background requests): one owed on a
    connection gone dark (a dropped NAT entry, a dead old primary) is waited for
    only until the next renewal is due, so a short lock on the same server is
    renewed all the same, and the release is sent again on a new connection."""
    short = RedisLock(via_proxy, "short", ttl=3)
    other = RedisLock(via_proxy, "released", ttl=30)
    assert short.acquire(blocking=False)
    assert other.acquire(blocking=False)
    assert proxy.silence_open() >= 1
    outcomes: list[str] = []
    other.release(wait=False, then=outcomes.append)

    time.sleep(4.5)  # past the short lock's TTL: only renewals keep it

    assert short.owned()
    assert not short.lost
    wait_for(lambda: not held(direct, other.key), what="the release sent again to land")
    assert outcomes == ["retrying"]
    short.release()


def assert_a_short_lock_is_renewed_meanwhile(
    via_proxy: redis.Redis, direct: redis.Redis, name: str
) -> RedisLock:
    """Take a short lock ``name`` (TTL 1.5 s, renewed every 0.2 s: a stall of the
    machine does not lose it) on a new connection to the healthy server, and check
    that past its TTL nobody else could take it, that it is still held and not
    reported lost; return it, held."""
    lost: list[RedisLock] = []
    short = RedisLock(via_proxy, name, ttl=1.5, heartbeat_interval=0.2, on_lost=lost.append)
    assert short.acquire(blocking=False)
    taken = time.monotonic()
    rival = RedisLock(direct, name, ttl=10, heartbeat=False)
    while time.monotonic() < taken + 3:  # past the short lock's TTL: only renewals keep it
        assert not rival.acquire(blocking=False)
        time.sleep(0.02)
    assert short.owned()
    assert not short.lost
    assert lost == []
    return short


def test_a_renewal_round_on_a_connection_gone_dark_holds_up_no_other_lock(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """A renewal round stuck on a connection gone dark (a dropped NAT entry) waits
    no longer than the next renewal due on that server, even one of a lock taken
    while the round waits: a short lock on the same, healthy server is renewed
    all the same (nobody else can take it, and it is not reported lost), and the
    renewals go out again on a new connection."""
    long = RedisLock(via_proxy, "long", ttl=30, heartbeat_interval=1.0)
    assert long.acquire(blocking=False)
    # The idle connection the long lock's first round will go out on goes dark.
    assert proxy.silence_open() == 1
    # That round has taken it, and waits for its answer.
    wait_for(lambda: not long.transport._idle, what="the long lock's round to start")
    short = assert_a_short_lock_is_renewed_meanwhile(via_proxy, direct, "short")
    wait_for(lambda: long.owned(), what="the long lock renewed on a new connection")
    assert not long.lost
    short.release()
    long.release()


def test_a_read_of_owed_answers_on_a_connection_gone_dark_holds_up_no_other_lock(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """The heartbeat's thread reading an answer a release that did not wait is owed,
    on a connection gone dark, waits no later than the next renewal due on that
    server, even one of a lock taken while it reads: a short lock on the same,
    healthy server is renewed all the same."""
    long = RedisLock(via_proxy, "long-owing", ttl=30)  # renewed every 10 s
    assert long.acquire(blocking=False)
    assert long.acquire(blocking=False)
    assert proxy.silence_open() == 1
    long.release(wait=False)  # the inner hold's answer is owed on the dark connection
    wait_for(lambda: not long.transport._idle, what="the heartbeat's thread to read it")
    short = assert_a_short_lock_is_renewed_meanwhile(via_proxy, direct, "short-owing")
    short.release()
    long.release()
    wait_for(lambda: not held(direct, long.key), what="the long lock's releases to land")


def test_an_answer_owed_on_a_dark_connection_costs_a_request_only_part_of_its_time(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """An inner release that did not wait, owed its answer on a connection gone dark,
    is read before the lock's next request with half of that request's time only:
    the request goes on a new connection in time, and the release, its answer
    counted lost, goes ahead of it."""
    lock = RedisLock(via_proxy, "owed-dark", ttl=30, call_timeout=3)
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    assert proxy.silence_open() >= 1
    lock.release(wait=False)

    assert lock.acquire(timeout=0.5)  # a third hold: the release went ahead of it
    lock.release()
    lock.release()

    assert not lock.holding
    wait_for(lambda: not held(direct, lock.key), what="the lock to be freed")


def _release_in_child(lock: RedisLock, calls: list[str], conn: Any) -> None:
    lock.release()
    conn.send((list(calls), lock.holding))


def test_a_forked_child_leaves_its_parents_owed_answers_to_the_parent(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """A child forked while an inner release of a lock still waits for its answer
    does not read its parent's connections before the lock's next request: the
    parent's callback does not run in the child, and the child's release goes on a
    connection of its own."""
    lock = RedisLock(via_proxy, "owed-fork", ttl=30, call_timeout=1)
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    calls: list[str] = []
    assert proxy.silence_open() >= 1
    lock.release(wait=False, then=calls.append)

    seen, holding = in_forked_child(_release_in_child, lock, calls)

    # The child dropped one of the two holds it counts; the parent's callback ran
    # in the parent only, as its next request read the answer it was owed (or, on
    # a busy machine, the heartbeat's thread, which may be reading it already).
    assert (seen, holding) == ([], True)
    assert stored_hold_count(direct, lock.key) == 2
    lock.release()
    assert wait_until(lambda: calls == ["retrying"], timeout=5), calls
    lock.release()
    assert not held(direct, lock.key)


def test_a_waiter_whose_server_goes_away_still_says_so(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """A waiter whose server refuses connections while it waits raises
    ``LockBackendError`` when its time runs out, as before: only a last try that got
    no answer in the time left is taken for the timeout it is."""
    other = RedisLock(direct, "gone-away", ttl=30)
    assert other.acquire(blocking=False)
    lock = RedisLock(via_proxy, "gone-away", ttl=30, call_timeout=5)
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(lock.acquire(timeout=1.5))
        except LockBackendError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    wait_for(lambda: direct.zcard(lock_keys("gone-away").queue) == 1, what="the waiter")
    proxy.refuse()
    proxy.reset_all()
    try:
        waiter.join(10)
        assert len(outcome) == 1
        assert isinstance(outcome[0], LockBackendError)
    finally:
        proxy.heal()
        other.release()


def test_retried_reentrant_acquire_counts_one_hold(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """A re-entrant acquire whose reply is lost counts one more hold, not two."""
    lock = RedisLock(via_proxy, "reenter-dropped", ttl=10)
    assert lock.acquire()
    proxy.drop_replies(1)
    assert lock.acquire(blocking=False)
    assert hold_count(direct, lock) == 2
    lock.release()
    lock.release()
    assert not held(direct, lock.key)


def test_retried_inner_release_drops_one_hold(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis, server: RedisServer
) -> None:
    """An inner release whose reply is lost drops one hold, not both: nobody else can take
    the lock while its holder is still inside the outer hold."""
    lock = RedisLock(via_proxy, "inner-dropped", ttl=10)
    assert lock.acquire()
    assert lock.acquire()
    proxy.drop_replies(1)
    lock.release()
    assert hold_count(direct, lock) == 1
    rival = RedisLock(server.url, "inner-dropped", ttl=10)
    assert not rival.acquire(blocking=False)
    lock.release()
    assert rival.acquire(blocking=False)
    rival.release()


def test_inner_release_sent_again_after_the_holder_reentered_drops_one_hold(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """An inner release whose answer was lost is sent again in the background; if the
    holder takes the lock once more before it lands, it still drops one hold, not two."""
    lock = RedisLock(proxy.url, "inner-again", ttl=30, call_timeout=1)
    assert lock.acquire()
    lock.release()  # the server now has both scripts
    assert lock.acquire()
    assert lock.acquire()
    proxy.drop_replies(1)
    proxy.refuse()
    with pytest.raises(LockBackendError, match="retried in the background"):
        lock.release()  # it landed: one hold left on the server
    assert hold_count(direct, lock) == 1
    proxy.heal()
    assert lock.acquire()  # two holds again, on both sides
    wait_for(lambda: not sent_in_background(lock), what="the background retry to land")
    assert hold_count(direct, lock) == 2
    lock.release()
    assert held(direct, lock.key)
    lock.release()
    assert not held(direct, lock.key)


class HeldBack(Heartbeat):
    """A heartbeat whose requests sent again in the background wait until let go,
    as on a network slow to take them: the lock's later requests go first."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[tuple[Any, ...]] = []

    def retry_in_background(
        self,
        lock: Any,
        call: Call,
        until: float,
        what: str,
        quiet: bool = False,
        on_switch: bool = False,
        then: Callable[[], None] | None = None,
    ) -> None:
        self.kept.append((lock, call, until, what, quiet, on_switch, then))

    def let_go(self) -> None:
        kept, self.kept = self.kept, []
        for args in kept:
            super().retry_in_background(*args)


@pytest.fixture
def held_back() -> Iterator[HeldBack]:
    beat = HeldBack()
    yield beat
    beat.stop()


def an_inner_release_that_never_landed(proxy: FaultProxy, lock: RedisLock) -> None:
    """Take ``lock`` twice, then release the inner hold while nothing reaches the
    server: it fails and is to be sent again."""
    assert lock.acquire()
    assert lock.acquire()
    proxy.blackhole()
    with pytest.raises(LockBackendError, match="retried in the background"):
        lock.release()
    proxy.heal()


@pytest.mark.parametrize("wait", [True, False], ids=["waited-for", "not-waited-for"])
def test_an_inner_release_still_to_be_sent_again_goes_ahead_of_the_outer_one(
    proxy: FaultProxy, direct: redis.Redis, held_back: HeldBack, wait: bool
) -> None:
    """An inner release that failed, and is to be sent again, goes ahead of the outer
    release in its round trip: the outer one frees the lock rather than drop the hold
    the inner one still had to drop, and the late resend changes nothing."""
    lock = RedisLock(proxy.url, "inner-late", ttl=30, call_timeout=0.5, _heartbeat=held_back)
    an_inner_release_that_never_landed(proxy, lock)
    assert held_back.kept
    assert hold_count(direct, lock) == 2
    lock.release(wait=wait)
    wait_for(lambda: not held(direct, lock.key), what="the outer release to free the lock")
    rival = RedisLock(direct, "inner-late", ttl=30)
    assert rival.acquire(blocking=False)
    held_back.let_go()
    wait_for(lambda: not sent_in_background(lock, held_back), what="the late resend to land")
    assert rival.owned()
    rival.release()


def test_an_inner_release_still_to_be_sent_again_goes_ahead_of_a_new_hold(
    proxy: FaultProxy, direct: redis.Redis, held_back: HeldBack
) -> None:
    """Taken once more before the failed inner release is sent again, the lock counts
    what its holder counts: the inner release goes first, in the acquire's round trip,
    and two releases free it."""
    lock = RedisLock(proxy.url, "inner-then-again", ttl=30, call_timeout=0.5, _heartbeat=held_back)
    an_inner_release_that_never_landed(proxy, lock)
    assert lock.acquire()
    assert hold_count(direct, lock) == 2
    lock.release()
    lock.release()
    assert not held(direct, lock.key)
    held_back.let_go()
    wait_for(lambda: not sent_in_background(lock, held_back), what="the late resend to land")
    assert not held(direct, lock.key)


def test_retried_final_release_reports_success(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """A release that freed the lock but lost its reply is retried and reports success,
    not LockLostError."""
    lock = RedisLock(via_proxy, "final-dropped", ttl=10)
    assert lock.acquire()
    proxy.drop_replies(1)
    lock.release()
    assert not held(direct, lock.key)
    assert not lock.holding


def release_as_sent(lock: RedisLock, request: str) -> tuple[Any, ...]:
    """The RELEASE call ``lock.release()`` sends for its current hold, with ``request``
    as its request id: KEYS and ARGV for ``EVAL``, so that the same request can be
    sent again later, as a background retry would."""
    return (
        2,
        lock.key,
        lock.queue_key,
        lock.owner,
        lock.wake_prefix,
        request,
        0,
        "",
        lock.token,
        lock._released or "",
    )


def test_release_sent_again_leaves_the_same_owners_later_hold_alone(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A release that freed the lock and is sent again (its answer was lost) after the same
    owner took the lock again answers "freed" and leaves the new hold as it is."""
    first = RedisLock(server.url, "again", ttl=30, heartbeat=False)
    assert first.acquire()
    release = release_as_sent(first, "1000000001")
    assert direct.eval(RELEASE, *release) == 1
    second = RedisLock(server.url, "again", ttl=30, heartbeat=False, owner=first.owner)
    assert second.acquire()
    assert direct.eval(RELEASE, *release) == 1
    assert hold_count(direct, second) == 1
    assert not RedisLock(server.url, "again", ttl=30).acquire(blocking=False)
    second.release()


@pytest.mark.parametrize("holds", [3, 2], ids=["count-left", "single-left"])
def test_a_release_that_dropped_an_inner_hold_is_recognised_after_later_changes(
    server: RedisServer, direct: redis.Redis, holds: int
) -> None:
    """A release that dropped one of several holds, sent again (with no last change to
    act on) after its holder took the lock again and released it, several times, is
    recognised by the hold: it drops no second hold, whether it finds several holds
    or one (which the usual one-write release would otherwise free). Once the lock is
    freed, nothing of it is left in the lock's value."""
    lock = RedisLock(server.url, "dropped-again", ttl=30, heartbeat=False)
    for _ in range(holds):
        assert lock.acquire()
    inner = release_as_sent(lock, "1000000003")
    assert direct.eval(RELEASE, *inner) == 2
    lock._holds -= 1
    for _ in range(3):
        with lock:
            pass
    assert hold_count(direct, lock) == holds - 1
    assert direct.eval(RELEASE, *inner) == 2
    assert hold_count(direct, lock) == holds - 1
    for _ in range(holds - 1):
        lock.release()
    assert not held(direct, lock.key)
    assert b"1000000003" not in cast(bytes, direct.get(lock.key) or b"")


def sent_again(release: tuple[Any, ...]) -> tuple[Any, ...]:
    """``release`` (KEYS and ARGV, see :func:`release_as_sent`) as a copy of it is
    sent again: marked as one."""
    return (*release, "", COPY_MARK)


@pytest.mark.parametrize("holds", [3, 2], ids=["count-left", "single-left"])
def test_a_release_whose_copy_dropped_an_inner_hold_is_recognised_however_late(
    server: RedisServer, direct: redis.Redis, holds: int
) -> None:
    """A copy of a release, sent again, drops one of several holds; the first send (no
    last change to act on) arrives after its holder entered and left more nested
    sections than the hold remembers releases that dropped one: it is recognised from
    the copies the hold remembers apart, and drops no second hold, whether it finds
    several holds or one (which the usual one-write release would otherwise free).
    The hold remembers the last COPIES_REMEMBERED such copies, and the last
    DROPS_REMEMBERED other releases that dropped one; once the lock is freed, nothing
    of either is left in the lock's value."""
    lock = RedisLock(server.url, "copy-first", ttl=30, heartbeat=False)
    for _ in range(holds):
        assert lock.acquire()
    first = release_as_sent(lock, "1000000004")
    assert direct.eval(RELEASE, *sent_again(first)) == 2
    lock._holds -= 1
    for _ in range(DROPS_REMEMBERED + 2):
        with lock:
            pass
    assert direct.eval(RELEASE, *first) == 2
    assert hold_count(direct, lock) == holds - 1

    for n in range(COPIES_REMEMBERED):
        assert lock.acquire()
        copy = sent_again(release_as_sent(lock, str(2000000000 + n)))
        assert direct.eval(RELEASE, *copy) == 2
        lock._holds -= 1
    drops = field(direct, lock.key, DROPS_FIELD) or ""
    recent, copies = drops.split(COPIES_MARK)
    assert len(recent.split()) == DROPS_REMEMBERED
    assert copies.split() == [str(2000000000 + n) for n in reversed(range(COPIES_REMEMBERED))]
    assert hold_count(direct, lock) == holds - 1
    for _ in range(holds - 1):
        lock.release()
    assert not held(direct, lock.key)
    assert DROPS_FIELD not in fields(direct, lock.key)


def test_release_for_an_earlier_hold_leaves_a_later_one_alone(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A release carries its hold's fencing token: the same owner's later hold (a new
    token) is left alone even once the lock no longer remembers that release."""
    first = RedisLock(server.url, "earlier", ttl=30, heartbeat=False)
    assert first.acquire()
    stale = release_as_sent(first, "1000000002")
    first.release()
    for _ in range(10):  # more releases than the lock remembers
        other = RedisLock(server.url, "earlier", ttl=30, heartbeat=False)
        assert other.acquire()
        other.release()
    second = RedisLock(server.url, "earlier", ttl=30, heartbeat=False, owner=first.owner)
    assert second.acquire()
    assert direct.eval(RELEASE, *stale) == 0
    assert hold_count(direct, second) == 1
    second.release()
    assert not held(direct, second.key)


def test_last_release_takes_the_lock_off_the_heartbeat_before_it_lands(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """While the last hold's release is on its way, the lock is no longer renewed: a
    renewal answered after the release landed cannot report a released lock lost."""
    lost: list[RedisLock] = []
    lock = RedisLock(proxy.url, "last-release", ttl=30, on_lost=lost.append, call_timeout=5)
    assert lock.acquire()
    proxy.set_latency(0.5)
    releasing = threading.Thread(target=lock.release)
    releasing.start()
    try:
        wait_for(lambda: not held(direct, lock.key), what="the release to land")
        # Landed, its answer still on the way back.
        assert lock.holding
        assert lock not in get_heartbeat().held()
    finally:
        releasing.join(10)
    assert not lock.holding
    assert not lock.lost
    assert lost == []


def test_hold_reentered_after_a_loss_is_renewed_again(direct: redis.Redis) -> None:
    """A lock the heartbeat found lost, that the server holds for this owner again by
    the time the owner re-enters it, is put back on the heartbeat and renewed."""
    lock = RedisLock(direct, "reentered", ttl=1)
    assert lock.acquire()
    value = direct.get(lock.key)
    assert value is not None
    direct.set(lock.key, b"somebody else", keepttl=True)
    wait_for(lambda: lock.lost, timeout=5, what="the heartbeat to find the lock lost")
    assert lock not in get_heartbeat().held()
    direct.set(lock.key, value, px=1000)
    assert lock.acquire(blocking=False)
    assert not lock.lost
    assert lock in get_heartbeat().held()
    # Renewed past the TTL it was re-entered with.
    time.sleep(1.5)
    assert lock.owned()
    lock.release()
    lock.release()


def test_retried_release_lease_reports_freed(proxy: FaultProxy, via_proxy: redis.Redis) -> None:
    """release_lease whose reply is lost after it freed the lock still answers True."""
    lock = RedisLock(via_proxy, "lease-dropped", ttl=10, lease="task-1", heartbeat=False)
    assert lock.acquire()
    proxy.drop_replies(1)
    assert release_lease(via_proxy, "lease-dropped", "task-1")
    assert not lock.locked()


def test_unconfirmed_acquire_is_undone(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis
) -> None:
    """An acquire whose every reply was lost raises, and the hold it made is undone in
    the background instead of blocking the name for a whole TTL."""
    client = redis.Redis.from_url(proxy.url)
    lock = RedisLock(client, "undo", ttl=60, call_timeout=1)
    assert lock.acquire()  # the server now knows the scripts by digest
    lock.release()
    proxy.drop_replies()
    with pytest.raises(LockBackendError):
        lock.acquire(blocking=False)
    proxy.heal()
    wait_for(lambda: not held(direct, lock.key), what="the undo of the unconfirmed acquire")
    # It did land: the free key keeps the fencing token it handed out.
    assert field(direct, lock.key, FENCE_FIELD)
    client.close()


def acquired_unanswered(lock: RedisLock, proxy: FaultProxy) -> None:
    """Acquire ``lock`` through ``proxy`` so that the acquire runs but its answer
    is lost, the server out of reach after it: the acquire raises. (Taken and
    released once first: the connection is open, the scripts known.)"""
    assert lock.acquire(blocking=False)
    lock.release()
    proxy.drop_replies(1, then_close_port=True)
    with pytest.raises(LockBackendError, match="could not acquire"):
        lock.acquire(blocking=False)


def test_an_acquire_made_again_before_the_undo_of_an_unanswered_one_landed_leaves_nothing(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis
) -> None:
    """An acquire that ran but whose answer was lost, the server then out of reach,
    raises and is undone in the background. Tried again as the network heals,
    before the undo's next try, the acquire must not re-enter the hold it made
    unknowingly (a count of two, of which its release drops one): the undo goes
    first, and the release frees the lock."""
    lock = RedisLock(redis.Redis.from_url(proxy.url), "undo-then-again", ttl=60, call_timeout=1)
    acquired_unanswered(lock, proxy)
    assert field(direct, lock.key, OWNER_FIELD) == lock.owner  # it ran
    proxy.heal()
    assert lock.acquire(blocking=False)
    assert field(direct, lock.key, COUNT_FIELD) is None  # one hold, not two

    lock.release()

    assert not held(direct, lock.key)
    lock.client.close()


@pytest.mark.parametrize("owner", ["another owner", "the same owner"])
def test_an_acquire_by_another_object_before_the_undo_of_an_unanswered_one_landed_sends_it_first(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis, owner: str
) -> None:
    """An acquire that ran but whose answer was lost, the server then out of reach,
    raises and is undone in the background, backing off. A new lock object of the
    same name in this process, acquiring once the server answers, before that
    undo's next try, does not find the hold nobody knows of (refused, or, of the
    same owner, re-entering it: a count of two, of which its release drops one):
    its acquire sends the undo first. The undo, tried again later, then leaves
    the new hold's release as it was."""
    client = redis.Redis.from_url(proxy.url)
    name = f"undo-other-object-{owner.replace(' ', '-')}"
    lock = RedisLock(client, name, ttl=60, call_timeout=1)
    acquired_unanswered(lock, proxy)
    assert field(direct, lock.key, OWNER_FIELD) == lock.owner  # it ran
    lane, undo = background_send_about(lock.key)
    with lane.cond:
        # Backed off past the outage.
        undo.next_try, undo.pause = lane.clock() + 3600, 3600.0
    proxy.heal()
    same = owner == "the same owner"
    other = RedisLock(client, name, ttl=60, call_timeout=1, owner=lock.owner if same else None)
    assert other.acquire(blocking=False)
    assert field(direct, lock.key, OWNER_FIELD) == other.owner
    assert field(direct, lock.key, COUNT_FIELD) is None  # one hold, not two
    assert frees_sent_ahead_of(lock.key) == 0

    other.release()

    assert not held(direct, lock.key)
    with lane.cond:
        undo.next_try, undo.pause = lane.clock(), 0.1
        lane._wake(undo.next_try)
    wait_for(lambda: background_sends_about(lock.key) == [], what="the undo")
    assert not held(direct, lock.key)
    client.close()


def sent_in_background(lock: RedisLock, beat: Heartbeat | None = None) -> list[str]:
    """What the heartbeat (the process's, unless given) is still sending about
    ``lock`` in the background."""
    return [
        p.what
        for lane in (beat or get_heartbeat())._lanes.values()
        for p in lane.pending
        if lock.key in p.call.keys
    ]


def test_an_undo_that_finds_nothing_to_undo_warns_of_nothing(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """An acquire that got no answer, because its request never reached the server,
    is undone in the background all the same; finding nothing to undo is expected,
    and logged below a warning."""
    lock = RedisLock(proxy.url, "swallowed", ttl=60, call_timeout=0.5)
    assert lock.acquire()
    lock.release()
    with heartbeat_warnings() as seen:
        proxy.blackhole()
        with pytest.raises(LockBackendError, match="could not acquire"):
            lock.acquire(blocking=False)
        assert sent_in_background(lock) != []
        proxy.heal()
        wait_for(lambda: sent_in_background(lock) == [], what="the undo to be done")
        # The heartbeat forgets it once it has logged its end: logged by then.
        wait_for(lambda: frees_sent_ahead_of(lock.key) == 0, what="the undo to be forgotten")
    assert not held(direct, lock.key)
    # (Other tests' locks may still be given up on meanwhile: only this one's count.)
    assert [warning for warning in seen if "'swallowed'" in warning] == []


def test_an_acquire_that_could_not_connect_leaves_nothing_to_undo(proxy: FaultProxy) -> None:
    """An acquire whose every try failed before it was written (no connection could
    be opened) cannot have taken the lock: nothing is sent afterwards to undo it."""
    lock = RedisLock(proxy.url, "never-sent", ttl=60, call_timeout=1)
    assert lock.acquire()
    lock.release()
    proxy.reset_all()
    proxy.close_port()
    with pytest.raises(LockBackendError, match="could not acquire"):
        lock.acquire(blocking=False)
    assert sent_in_background(lock) == []


def test_an_acquire_whose_first_try_may_have_run_is_undone_though_its_retries_could_not_connect(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """Whether an acquire may have taken the lock is decided over all its tries: the
    first ran and lost its reply, the next could not connect, and the hold the first
    made is undone."""
    lock = RedisLock(proxy.url, "sent-once", ttl=60, call_timeout=1)
    acquired_unanswered(lock, proxy)
    assert held(direct, lock.key)
    assert sent_in_background(lock) != []
    proxy.heal()
    wait_for(lambda: not held(direct, lock.key), what="the undo of the acquire that ran")


def test_a_waiter_that_never_reached_the_server_has_no_queue_to_leave(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """A waiter that gives up before any try reached the server sends nothing
    afterwards to leave the queue it never joined."""
    holder = RedisLock(server.url, "never-queued", ttl=30)
    assert holder.acquire()
    waiter = RedisLock(proxy.url, "never-queued", ttl=30, call_timeout=0.5)
    assert waiter.acquire(timeout=0.2) is False  # subscribed, scripts loaded, left
    proxy.reset_all()
    proxy.close_port()
    with pytest.raises(LockBackendError):
        waiter.acquire(timeout=1)
    assert sent_in_background(waiter) == []
    holder.release()


# One sick server never harms locks on a healthy one.


def test_stalled_server_does_not_delay_renewals_on_a_healthy_one(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """While one server is stalled for several TTLs, locks on another server keep being
    renewed; only the stalled server's locks are lost."""
    healthy, sick = redislock_server_factory(), redislock_server_factory()
    good = [RedisLock(healthy.url, f"good-{i}", ttl=1.0) for i in range(5)]
    bad = [RedisLock(sick.url, f"bad-{i}", ttl=1.0) for i in range(5)]
    for lock in good + bad:
        assert lock.acquire(blocking=False)
    checker = healthy.client()
    with sick.paused():
        wait_for(lambda: all(lock.lost for lock in bad), what="the sick server's locks lost")
        time.sleep(2.0)  # the fault: two more TTLs with the sick server stalled
        assert not any(lock.lost for lock in good)
        assert all(held(checker, lock.key) for lock in good)
    for lock in good:
        lock.release()
    checker.close()


# A lock nobody references is not kept alive.


@contextlib.contextmanager
def heartbeat_warnings() -> Iterator[list[str]]:
    """The warnings the heartbeat logs while the block runs."""
    seen: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    # A handler of the test's own on the heartbeat's logger: other tests (and the
    # Celery workers they start) may change how records reach pytest's capture.
    target = logging.getLogger("celery_redislock.heartbeat")
    handler, saved = Catch(logging.WARNING), (target.level, target.disabled)
    target.addHandler(handler)
    target.setLevel(logging.WARNING)
    target.disabled = False
    try:
        yield seen
    finally:
        target.removeHandler(handler)
        target.setLevel(saved[0])
        target.disabled = saved[1]


def test_dropped_lock_is_no_longer_renewed(direct: redis.Redis, server: RedisServer) -> None:
    """A held lock dropped without release() leaves the heartbeat, is logged, and expires
    by its TTL instead of being renewed for the life of the process."""
    with heartbeat_warnings() as seen:
        lock = RedisLock(server.url, "dropped", ttl=1.0)
        assert lock.acquire()
        key = lock.key
        del lock
        gc.collect()
        wait_for(lambda: not held(direct, key), timeout=5, what="expiry of the dropped lock")
        wait_for(
            lambda: any("dropped without release()" in message for message in seen),
            what="the log of the drop",
        )
    assert all(held_lock.key != key for held_lock in get_heartbeat().held())


def test_a_dropped_lock_with_a_request_sent_again_is_no_longer_renewed(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """A lock dropped without release() while the heartbeat still sends one of its
    requests again in the background (here an undo nobody answers) is collected all
    the same, and no longer renewed: the request does not keep it alive."""
    with heartbeat_warnings() as seen:
        lock = RedisLock(via_proxy, "dropped-pending", ttl=1.0)
        assert lock.acquire()
        key = lock.key
        proxy.blackhole()
        lock._undo("an-acquire-that-never-was", time.monotonic())  # sent again for a TTL
        dropped = weakref.ref(lock)
        del lock
        gc.collect()

        assert dropped() is None
        proxy.heal()
        wait_for(lambda: not held(direct, key), timeout=5, what="expiry of the dropped lock")
        wait_for(
            lambda: any("dropped without release()" in message for message in seen),
            what="the log of the drop",
        )


# Lost means lost, on time.


def test_cut_off_holder_knows_before_anyone_else_can_take_it(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """A holder whose connection is black-holed reports lost (lost, check(), on_lost) no
    later than the moment another client can take the lock."""
    lost_at: list[float] = []
    holder = RedisLock(
        redis.Redis.from_url(proxy.url),
        "cut-off",
        ttl=1.5,
        on_lost=lambda _lock: lost_at.append(time.monotonic()),
    )
    assert holder.acquire()
    proxy.blackhole()
    rival = RedisLock(server.url, "cut-off", ttl=10)
    assert rival.acquire(timeout=15)
    taken_at = time.monotonic()
    assert holder.lost
    with pytest.raises(LockLostError):
        holder.check()
    assert wait_until(lambda: bool(lost_at), timeout=2)
    assert lost_at[0] <= taken_at + 0.5
    rival.release()


@pytest.mark.slow
def test_a_hold_handed_to_a_waiter_is_lost_by_the_grant_when_its_first_renewal_never_lands(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis
) -> None:
    """A hold a release hands to a waiter has the grant's TTL (GRANT_MS) on the
    server until its first renewal lands, whatever the waiter's own TTL: its local
    deadline is the send time of its last try plus the grant, and a waiter whose
    renewals never reach the server knows it lost the lock before another client
    can take it."""
    holder = RedisLock(server.url, "handed-then-cut-off", ttl=30)
    assert holder.acquire()
    waiter = RedisLock(proxy.url, "handed-then-cut-off", ttl=60, call_timeout=0.5)
    began = time.monotonic()
    got, thread = acquire_in_thread(waiter, 30)
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    queued_at = time.monotonic()
    # Everything the waiter sends from now on (its renewals, on any connection) is
    # kept at the proxy; its wake-up, from the server, still reaches it.
    proxy.hold_next(10_000)
    holder.release()
    thread.join(15)
    assert got == [True]
    assert field(direct, waiter.key, OWNER_FIELD) == waiter.owner
    assert began + GRANT_MS / 1000 <= waiter._expiry <= queued_at + GRANT_MS / 1000
    rival = RedisLock(server.url, "handed-then-cut-off", ttl=10)
    assert rival.acquire(timeout=15)
    assert waiter.lost
    with pytest.raises(LockLostError):
        waiter.check()
    rival.release()
    proxy.let_held_through()


def test_holder_extended_past_its_ttl_then_cut_off_knows_before_anyone_else_can_take_it(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """extend() past the lock's TTL lasts until the next renewal, which sets the TTL
    back: the holder's local deadline comes back with it, so a holder cut off after
    that renewal still finds its lock lost before another owner can take it."""
    holder = RedisLock(proxy.url, "extended-then-cut-off", ttl=2, call_timeout=0.5)
    assert holder.acquire()
    holder.extend(60)
    direct = server.client()
    wait_for(lambda: 0 < direct.pttl(holder.key) <= 2000, what="a renewal to set the TTL back")
    proxy.blackhole()
    rival = RedisLock(server.url, "extended-then-cut-off", ttl=2)
    deadline = time.monotonic() + 10
    while True:
        was_lost = holder.lost
        if rival.acquire(blocking=False):
            break
        assert time.monotonic() < deadline, "the lock never expired"
        time.sleep(0.02)
    assert was_lost, "another owner took the lock while its holder still trusted it"
    rival.release()
    direct.close()


def _taken_by_a_rival_once_expired(holder: RedisLock, server: RedisServer) -> bool:
    """Take ``holder``'s lock with a rival as soon as it is free on the server;
    return whether the holder knew it lost the lock just before."""
    rival = RedisLock(server.url, holder.name, ttl=2)
    deadline = time.monotonic() + 10
    while True:
        was_lost = holder.lost
        if rival.acquire(blocking=False):
            rival.release()
            return was_lost
        assert time.monotonic() < deadline, "the lock never expired"
        time.sleep(0.02)


def test_a_renewal_whose_answer_is_lost_after_an_extend_brings_the_deadline_back(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """A renewal may have set the TTL back from a longer extend() even when its
    answer never came: the holder's local deadline comes back with it, so the
    holder finds its lock lost before another owner can take it."""
    holder = RedisLock(proxy.url, "extended-then-unanswered", ttl=2, call_timeout=0.5)
    assert holder.acquire()
    holder.extend(60)
    # The next renewal runs on the server; its answer is lost, and no later try
    # reaches the server.
    proxy.drop_replies(1, then_close_port=True)
    assert _taken_by_a_rival_once_expired(holder, server), (
        "another owner took the lock while its holder still trusted it"
    )


def test_renewals_that_never_reached_the_server_leave_an_extends_deadline(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """A renewal that failed before it was written (every connection refused) did
    not run: the TTL a longer extend() set still holds on the server, and the holder
    keeps trusting it."""
    holder = RedisLock(proxy.url, "extended-then-refused", ttl=2, call_timeout=0.5)
    assert holder.acquire()
    holder.extend(30)
    proxy.close_port()
    proxy.reset_all()
    direct = server.client()
    # Past the lock's own TTL from the last renewal, with renewals failing meanwhile.
    time.sleep(3)
    assert not holder.lost
    assert direct.pttl(holder.key) > 20_000
    proxy.heal()
    holder.release()
    direct.close()


def test_a_shorter_extend_that_never_reached_the_server_leaves_the_deadline(
    proxy: FaultProxy,
) -> None:
    """An extend() to a shorter TTL that failed before it was written did not run:
    the holder's local deadline stays the lock's own."""
    holder = RedisLock(proxy.url, "shortened-refused", ttl=30, call_timeout=0.5, heartbeat=False)
    assert holder.acquire()
    proxy.close_port()
    proxy.reset_all()
    with pytest.raises(LockBackendError):
        holder.extend(0.1)
    time.sleep(0.2)
    assert not holder.lost
    proxy.heal()
    holder.release()


def test_a_reentrant_acquire_whose_answer_is_lost_after_an_extend_brings_the_deadline_back(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """A re-entrant acquire sets the lock's own TTL, back from a longer extend():
    one that fails, having run with its answer lost, brings the holder's local
    deadline back with it."""
    holder = RedisLock(proxy.url, "extended-then-reentered", ttl=2, call_timeout=0.5)
    assert holder.acquire()
    holder.extend(60)
    proxy.drop_replies(1, then_close_port=True)
    with pytest.raises(LockBackendError):
        holder.acquire(blocking=False)
    assert _taken_by_a_rival_once_expired(holder, server), (
        "another owner took the lock while its holder still trusted it"
    )


def test_a_shorter_extend_whose_answer_is_lost_brings_the_deadline_back(
    proxy: FaultProxy, server: RedisServer
) -> None:
    """An extend() to a shorter TTL that fails may still have run on the server:
    the holder's local deadline is no later than the shorter TTL's."""
    holder = RedisLock(proxy.url, "shortened-unanswered", ttl=30, call_timeout=0.5, heartbeat=False)
    assert holder.acquire()
    holder.extend()  # (the server knows the script from now on)
    # The extend runs on the server; its answer is lost, and it cannot be sent again.
    proxy.drop_reply_to(EXTEND_SCRIPT.sha.encode())
    proxy.refuse()
    with pytest.raises(LockBackendError):
        holder.extend(1)
    assert proxy.marked_drops == 1
    assert _taken_by_a_rival_once_expired(holder, server), (
        "another owner took the lock while its holder still trusted it"
    )


def test_waiter_that_gives_up_unsure_whether_it_queued_leaves_the_queue(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis
) -> None:
    """A waiter whose try queued it but whose answer was lost gives up without knowing
    its place: it leaves the queue all the same (once the server can be reached), so
    the next release does not hand the lock to a waiter that is gone."""
    holder = RedisLock(server.url, "unsure-queue", ttl=30)
    assert holder.acquire()
    waiter = RedisLock(proxy.url, "unsure-queue", ttl=30, call_timeout=0.3)
    assert waiter.acquire(timeout=0.2) is False  # subscribed, scripts loaded, left
    assert direct.zcard(holder.queue_key) == 0
    proxy.drop_replies()
    with pytest.raises(LockBackendError):
        waiter.acquire(timeout=0.5)
    proxy.heal()
    wait_for(lambda: direct.zcard(holder.queue_key) == 0, timeout=10, what="the waiter to leave")
    holder.release()


def test_a_lock_handed_to_a_waiter_that_gave_up_in_the_dark_is_a_new_hold_of_its_next_acquire(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis
) -> None:
    """A waiter that gives up while the server cannot be reached cannot leave the
    queue: its entry stays, and a release hands the lock to it. The same lock object's
    next acquire takes that hold as a new one (one hold, a higher fencing token), not
    as a second hold of a lock it never had: its release frees the lock, and the
    waiter queued behind gets its turn."""
    holder = RedisLock(server.url, "gave-up-in-the-dark", ttl=30)
    assert holder.acquire()
    lock = RedisLock(proxy.url, "gave-up-in-the-dark", ttl=30, call_timeout=0.5)
    outcome: list[object] = []

    def wait_then_give_up() -> None:
        try:
            outcome.append(lock.acquire(timeout=0.5))
        except LockBackendError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait_then_give_up)
    thread.start()
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    proxy.blackhole()
    thread.join(15)
    assert len(outcome) == 1
    assert outcome[0] is not True  # gave up: False, or the server could not be reached
    wait_for(
        lambda: not any(what.startswith("leaving") for what in sent_in_background(lock)),
        what="the leave to be given up",
    )
    assert direct.zcard(holder.queue_key) == 1  # its entry stayed
    behind = RedisLock(server.url, "gave-up-in-the-dark", ttl=30)
    got, behind_thread = acquire_in_thread(behind, 30)
    wait_for(lambda: direct.zcard(holder.queue_key) == 2, what="the second waiter in the queue")
    holder.release()
    assert field(direct, lock.key, OWNER_FIELD) == lock.owner  # handed to the entry left
    # Reachable again only now: the undo of the waiter's last try (sent again in
    # the background until it lands) would otherwise list that try as undone
    # first, and a release then hands the lock to nobody, a case of its own.
    proxy.heal()
    granted = int(field(direct, lock.key, FENCE_FIELD) or 0)

    assert lock.acquire(blocking=False)
    assert stored_hold_count(direct, lock.key) == 1
    assert lock.token is not None
    assert lock.token > granted
    assert int(field(direct, lock.key, FENCE_FIELD) or 0) == lock.token
    assert direct.pttl(lock.key) > GRANT_MS
    lock.release()

    behind_thread.join(15)
    assert got == [True]
    assert field(direct, lock.key, OWNER_FIELD) == behind.owner
    behind.release()
    assert not held(direct, lock.key)


def test_local_deadline_is_seen_without_the_heartbeat(server: RedisServer) -> None:
    """With no heartbeat at all, lost turns true once the TTL has run out since the acquire
    was sent; a fresh acquire makes it false again."""
    lock = RedisLock(server.url, "deadline", ttl=0.3, heartbeat=False)
    assert lock.acquire()
    lock.check()
    wait_for(lambda: lock.lost, timeout=3, what="the local deadline")
    with pytest.raises(LockLostError):
        lock.check()
    assert lock.acquire(timeout=3)
    assert not lock.lost
    lock.release()


# No lost wake-ups.


def test_waiter_whose_subscription_is_reset_still_wakes_on_release(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis
) -> None:
    """A waiter whose pub/sub connection is reset re-subscribes, and the holder's release
    still wakes it long before the holder's TTL would have."""
    holder = RedisLock(server.url, "wake", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(redis.Redis.from_url(proxy.url), "wake", ttl=10)
    got, thread = acquire_in_thread(waiter, 30)
    channel = hub_for(waiter.transport, waiter.prefix).channel
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    wait_for(lambda: direct.pubsub_numsub(channel)[0][1] == 1, what="the wake-up subscription")
    proxy.reset_all()
    wait_for(lambda: direct.pubsub_numsub(channel)[0][1] == 1, what="the re-subscription")
    holder.release()
    thread.join(15)
    assert got == [True]
    waiter.release()


def test_a_subscription_that_went_silent_is_replaced(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A middlebox forgets the waiter's connections (nothing passes, nothing is
    closed; new connections work): the waiter's probe goes unanswered, its process
    subscribes again, and the next release reaches the next waiter by a wake-up."""
    # A probe on a healthy connection is answered in milliseconds: waiting 2 s for
    # it, not a whole call timeout, still tells a silent subscription apart.
    monkeypatch.setattr(wakeups, "PROBE_WAIT", 2.0)
    holder = RedisLock(server.url, "silent", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(redis.Redis.from_url(proxy.url), "silent", ttl=10)
    got, thread = acquire_in_thread(waiter, 60)
    hub = hub_for(waiter.transport, waiter.prefix)
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    wait_for(lambda: hub.subscribed, what="the wake-up subscription")
    subscriptions = hub.subscriptions
    assert proxy.silence_open() >= 1
    wait_for(
        lambda: hub.subscribed and hub.subscriptions > subscriptions,
        timeout=30,
        what="the new subscription",
    )
    holder.release()
    thread.join(30)
    assert got == [True]
    # Waiting again, on the new subscription: a release wakes it.
    assert holder.acquire(blocking=False) is False
    waiter.release()
    assert holder.acquire(blocking=False)
    got, thread = acquire_in_thread(waiter, 60)
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter queued again")
    received = hub.received
    holder.release()
    thread.join(30)
    assert got == [True]
    assert hub.received > received
    waiter.release()


def test_a_waiter_takes_the_lock_handed_to_it_through_a_network_blip(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis
) -> None:
    """The waiter's connections are reset and new ones go unanswered for half a
    second (a network blip) as the holder releases, handing the lock to it. Its
    process subscribes again on a new connection once the network is back, rather
    than wait a call's timeout for the answer the blip swallowed, and the waiter
    takes the lock instead of raising LockBackendError, though another owner keeps
    asking for it meanwhile. (Whether it takes the very hold handed to it depends
    on its coming back within the 2 s grant, which a loaded machine may not allow.)"""
    holder = RedisLock(server.url, "blip", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(redis.Redis.from_url(proxy.url), "blip", ttl=60)
    hub = hub_for(waiter.transport, waiter.prefix)
    outcome, waiting = outcome_in_thread(lambda: waiter.acquire(timeout=30))
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    wait_for(lambda: hub.subscribed, what="the wake-up subscription")
    other = RedisLock(direct, "blip", ttl=60)
    proxy.blackhole()
    proxy.reset_all()
    healing = threading.Timer(0.5, proxy.heal)
    healing.start()
    try:
        holder.release()
        guard = time.monotonic() + 30
        while waiting.is_alive() and time.monotonic() < guard:
            if other.acquire(blocking=False):
                other.release()
            time.sleep(0.05)
        waiting.join(5)
    finally:
        healing.join()
        proxy.heal()
    assert outcome == [True]
    assert waiter.owned()
    waiter.release()


def test_a_waiter_whose_process_cannot_subscribe_asks_for_the_lock_all_the_same(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis
) -> None:
    """A waiter's wake-up subscription is gone and cannot be made again (the
    server dropped it; new connections are refused, the waiter's open one still
    answers): that is no failure to reach Redis. Past a call's timeout the waiter
    asks for the lock without it, again every UNSUBSCRIBED_RECHECK seconds, and
    takes it once it is released, rather than raise LockBackendError."""
    holder = RedisLock(server.url, "unsubscribed", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(redis.Redis.from_url(proxy.url), "unsubscribed", ttl=60, call_timeout=1)
    hub = hub_for(waiter.transport, waiter.prefix)
    outcome, waiting = outcome_in_thread(lambda: waiter.acquire(timeout=30))
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    wait_for(lambda: hub.subscribed, what="the wake-up subscription")
    proxy.refuse()
    try:
        direct.client_kill_filter(_type="pubsub")
        wait_for(lambda: not hub.subscribed, what="the subscription to break")
        asked = direct.info("commandstats")["cmdstat_evalsha"]["calls"]
        # Asked again and again while the lock stays held (a hang guard only).
        wait_for(
            lambda: direct.info("commandstats")["cmdstat_evalsha"]["calls"] >= asked + 3,
            what="the waiter asking without a subscription",
        )
        assert outcome == []
        holder.release()
        waiting.join(30)
        assert outcome == [True]
        assert not hub.subscribed
        assert waiter.owned()
    finally:
        proxy.heal()
    waiter.release()


def test_a_waiter_passed_over_while_its_subscription_is_down_keeps_its_place(
    proxy: FaultProxy, server: RedisServer, direct: redis.Redis
) -> None:
    """A live waiter's wake-up subscription is dropped by the server (and cannot be
    made again for a while) as the lock is released: the release takes it for a
    waiter whose process died, passes it over and hands the lock to the waiter
    behind it. The waiter is not lost: it asks again (without the subscription, or
    once it is back), queued again with its first place in the queue, ahead of a
    waiter that queued after it; and while its subscription is down it asks with
    its entry unmarked, so the next release hands it the lock rather than pass it
    over again (with the subscription down for good, it would else be passed over
    at every release)."""
    holder = RedisLock(server.url, "passed-over-blip", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(redis.Redis.from_url(proxy.url), "passed-over-blip", ttl=60, call_timeout=1)
    hub = hub_for(waiter.transport, waiter.prefix)
    outcome, waiting = outcome_in_thread(lambda: waiter.acquire(timeout=30))
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    wait_for(lambda: hub.subscribed, what="the wake-up subscription")
    [(entry, score)] = queue_entries(direct, holder.queue_key)
    assert entry.decode().endswith(f",{WATCHED}]")
    # Behind it: a waiter handed the lock past it, and one that queued after it.
    handed = queue_entry("elsewhere.1", "handed-owner", 60_000, "", "")
    later = queue_entry("elsewhere.2", "later-owner", 60_000, "", "")
    direct.zadd(holder.queue_key, {handed: score + 1, later: score + 2})
    proxy.refuse()
    try:
        direct.client_kill_filter(_type="pubsub")
        wait_for(lambda: not hub.subscribed, what="the subscription to break")
        holder.release()
        assert field(direct, holder.key, OWNER_FIELD) == "handed-owner"
        assert [m for m, _ in queue_entries(direct, holder.queue_key)] == [later.encode()]
        wait_for(lambda: direct.zcard(holder.queue_key) == 2, what="the waiter to queue again")
        assert queue_entries(direct, holder.queue_key) == [
            (unwatched(entry.decode()).encode(), score),
            (later.encode(), score + 2),
        ]
        # The hold handed past it goes (an operator's release, which hands the lock
        # on as a release does): the waiter, still without its subscription, is
        # handed the lock this time.
        assert force_release(direct, "passed-over-blip") is ForceReleased.FREED
        assert field(direct, holder.key, OWNER_FIELD) == waiter.owner
        assert [m for m, _ in queue_entries(direct, holder.queue_key)] == [later.encode()]
    finally:
        proxy.heal()
    waiting.join(30)
    assert outcome == [True]
    assert waiter.owned()
    waiter.release()
    direct.delete(holder.key, holder.queue_key)


def test_a_lock_evicted_by_the_server_is_lost_and_fenced(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A server short of memory under an eviction policy drops a held lock's key:
    the holder's next renewal finds it gone (``on_lost``), its release raises
    LockLostError, and the next holder gets a larger fencing token (seeded from
    the server clock, as for an expired key)."""
    lost: list[RedisLock] = []
    holder = RedisLock(server.url, "evicted", ttl=3, on_lost=lost.append)
    assert holder.acquire()
    assert direct.exists(holder.key)
    used = int(direct.info("memory")["used_memory"])
    direct.config_set("maxmemory-policy", "allkeys-random")
    direct.config_set("maxmemory", used + 1_000_000)
    try:
        for i in range(200_000):
            direct.set(f"fill:{i}", "x" * 1000)
            if i % 100 == 0 and not direct.exists(holder.key):
                break
        assert not direct.exists(holder.key), "the lock key was never evicted"
        wait_for(lambda: lost == [holder], what="the holder told of its loss")
    finally:
        direct.config_set("maxmemory", 0)
        direct.flushall()
    with pytest.raises(LockLostError):
        holder.release()
    successor = RedisLock(server.url, "evicted", ttl=10)
    assert successor.acquire(blocking=False)
    assert successor.token is not None
    assert holder.token is not None
    assert successor.token > holder.token
    successor.release()


def test_a_server_busy_for_a_moment_keeps_the_subscription(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A server that answers nothing for longer than PROBE_AFTER but less than a call
    timeout (a slow command; here CLIENT PAUSE) is busy, not a lost subscription:
    the waiter's probe is answered late and the subscription is kept."""
    holder = RedisLock(server.url, "busy", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(server.url, "busy", ttl=10)
    got, thread = acquire_in_thread(waiter, 60)
    hub = hub_for(waiter.transport, waiter.prefix)
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    wait_for(lambda: hub.subscribed, what="the wake-up subscription")
    subscriptions = hub.subscriptions
    direct.client_pause(int((PROBE_AFTER + 2.0) * 1000), all=True)
    time.sleep(PROBE_AFTER + 2.5)
    assert hub.subscriptions == subscriptions
    holder.release()
    thread.join(30)
    assert got == [True]
    assert hub.subscriptions == subscriptions
    waiter.release()


@contextlib.contextmanager
def out_of_memory(client: redis.Redis) -> Iterator[None]:
    """The server refuses every write that needs memory (``maxmemory`` below what
    it uses, ``noeviction``), as a server that ran out does, until the block ends."""
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)
    try:
        yield
    finally:
        client.config_set("maxmemory", 0)


def test_out_of_memory_acquire_fails_saying_so_and_writes_nothing(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A server out of memory refuses a new lock: the acquire raises
    LockBackendError saying what ran out and what to do, and no key is written."""
    lock = RedisLock(server.url, "oom-new", ttl=30)
    with out_of_memory(direct), pytest.raises(LockBackendError) as raised:
        lock.acquire(blocking=False)
    message = str(raised.value)
    assert "out of memory" in message
    assert "maxmemory" in message
    assert not direct.exists(lock.key)
    assert lock.acquire(blocking=False)
    lock.release()


def test_out_of_memory_a_held_lock_is_renewed_and_released(
    server: RedisServer, direct: redis.Redis
) -> None:
    """Holds taken before the server ran out of memory are still renewed (an
    expiry needs no memory) and released: the key is deleted rather than left
    to its TTL, so the next holder need not wait; its fencing token is larger
    (seeded from the server clock, as after an expiry)."""
    lock = RedisLock(server.url, "oom-held", ttl=30)
    assert lock.acquire()
    first = lock.token
    with out_of_memory(direct):
        lock.extend()
        assert direct.pttl(lock.key) > 25_000
        lock.release()
        assert not direct.exists(lock.key)
    assert lock.acquire(blocking=False)
    assert lock.token is not None
    assert first is not None
    assert lock.token > first
    lock.release()


def test_out_of_memory_an_undo_that_finds_another_hold_leaves_it_as_it_is(
    server: RedisServer, direct: redis.Redis
) -> None:
    """The write by which the undo of an unanswered acquire lists it in another
    owner's hold is refused by a server out of memory: the undo answers all the
    same (nothing of its own to undo), and the hold is left as it was."""
    holder = RedisLock(server.url, "oom-undo", ttl=30)
    lock = RedisLock(server.url, "oom-undo", ttl=30)
    assert holder.acquire()
    before = direct.get(holder.key)
    with out_of_memory(direct):
        undo = lock._undo_call(request_id())
        assert lock._run(undo, lock._call_deadline(None)) == Released.NOT_OWNED
    assert direct.get(holder.key) == before
    holder.release()


@pytest.mark.parametrize("mode", ["fail", "run"])
def test_out_of_memory_task_follows_lock_on_redis_error(
    server: RedisServer, direct: redis.Redis, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A task whose lock the server, out of memory, refuses meets it as any lock
    store failure: ``lock_on_redis_error="fail"`` fails it without running the
    body, ``"run"`` runs the body unlocked, with a warning that says why."""
    caplog.set_level(logging.WARNING, logger="celery_redislock")
    app = make_app(server.url, f"oom-{mode}")
    # The results would go to the same server, which takes nothing.
    app.conf.task_store_eager_result = False
    ran: list[bool] = []

    @app.task(base=SingletonTask, shared=False, name=f"oom.{mode}", lock_on_redis_error=mode)
    def job() -> str:
        ran.append(True)
        return "ran"

    with out_of_memory(direct):
        result = job.apply()
    if mode == "fail":
        assert isinstance(result.result, LockBackendError)
        assert "out of memory" in str(result.result)
        assert ran == []
    else:
        assert result.get() == "ran"
        assert ran == [True]
        assert "out of memory" in caplog.text
        assert "running oom.run" in caplog.text
    close_app(app)


@pytest.mark.parametrize("waiters", [1, 3])
def test_out_of_memory_release_with_a_waiter_wakes_it(
    server: RedisServer, direct: redis.Redis, monkeypatch: pytest.MonkeyPatch, waiters: int
) -> None:
    """A release on a server out of memory cannot hand the lock to a queued waiter
    (that is a write); it frees the lock and wakes every waiter, whose own try then
    fails, saying why, long before its timeout (or its next re-check, put off here
    past the test's end)."""
    monkeypatch.setattr(lock_module, "RECHECK", 600.0)
    holder = RedisLock(server.url, "oom-wait", ttl=30)
    assert holder.acquire()
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            RedisLock(server.url, "oom-wait", ttl=30).acquire(timeout=120)
        except LockBackendError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait, daemon=True) for _ in range(waiters)]
    for thread in threads:
        thread.start()
    wait_for(lambda: direct.zcard(holder.queue_key) == waiters, what="the waiters in the queue")
    hub = hub_for(holder.transport, holder.prefix)
    received = hub.received
    with out_of_memory(direct):
        holder.release()
        assert not direct.exists(holder.key)
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()
    assert hub.received >= received + waiters
    assert len(errors) == waiters
    assert all("out of memory" in str(error) for error in errors)
    direct.delete(holder.queue_key)


@contextlib.contextmanager
def refusing_writes(client: redis.Redis, why: str) -> Iterator[None]:
    """The server refuses every write until the block ends, as one does that
    cannot save to disk (``why="disk"``: ``MISCONF``) or has fewer replicas than
    ``min-replicas-to-write`` (``why="replicas"``: ``NOREPLICAS``)."""
    if why == "replicas":
        client.config_set("min-replicas-to-write", 1)
        try:
            yield
        finally:
            client.config_set("min-replicas-to-write", 0)
        return
    # A server that must save (it has a save point) whose snapshot failed refuses
    # writes until one succeeds: its working directory removed, the next fails.
    workdir = str(client.config_get("dir")["dir"])
    client.config_set("save", "3600 1")
    os.rmdir(workdir)
    try:
        client.bgsave()
        wait_for(
            lambda: client.info("persistence")["rdb_last_bgsave_status"] == "err",
            what="a failed snapshot",
        )
        yield
    finally:
        client.config_set("save", "")
        os.mkdir(workdir)


@pytest.mark.parametrize("wait", [True, False], ids=["waited-for", "not-waited-for"])
def test_releases_a_server_refused_free_a_re_entered_lock_in_order_once_it_writes(
    server: RedisServer, direct: redis.Redis, wait: bool
) -> None:
    """Both releases of a re-entered lock refused by a server that cannot write for
    now are sent again in the background, the inner one going ahead of the outer one
    (waited for or not) even once it backs off for longer: the lock is freed when the
    server writes again, not at the end of its TTL."""
    lock = RedisLock(server.url, f"refused-twice-{wait}", ttl=60, call_timeout=1)
    assert lock.acquire()
    assert lock.acquire()
    outcomes: list[str] = []
    with refusing_writes(direct, "replicas"):
        with pytest.raises(LockBackendError, match="retried in the background"):
            lock.release()
        time.sleep(1.5)  # the fault lasts: the inner release backs off between tries
        if wait:
            with pytest.raises(LockBackendError, match="retried in the background"):
                lock.release()
        else:
            lock.release(wait=False, then=outcomes.append)
            wait_for(lambda: outcomes == ["retrying"], what="the outer release refused")
    wait_for(lambda: not held(direct, lock.key), what="the lock to be freed")


@pytest.mark.slow
def test_a_reply_refused_while_the_server_reloads_keeps_the_connection_in_step(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Any
) -> None:
    """A release written without waiting, refused while the server reloads its data
    (``LOADING``), is answered on the connection the next request takes: that
    request reads its own reply after it, as every later one does, and the refused
    release is sent again and lands."""
    server = redislock_server_factory(
        extra_args=(
            *("--enable-debug-command", "yes", "--dir", str(tmp_path), "--save", ""),
            *("--key-load-delay", "100", "--loading-process-events-interval-bytes", "1024"),
        )
    )
    admin = server.client()
    admin.execute_command("DEBUG", "POPULATE", 30_000, "filler", 10)  # type: ignore[no-untyped-call]
    client = redis.Redis.from_url(server.url)
    first = RedisLock(client, "reloaded-first", ttl=60, call_timeout=30)
    second = RedisLock(client, "reloaded-second", ttl=60, call_timeout=30)
    assert first.acquire(blocking=False)
    reloader = redis.Redis(host=server.host, port=server.port, socket_timeout=120)
    reloading = threading.Thread(
        target=lambda: reloader.execute_command("DEBUG", "RELOAD"),  # type: ignore[no-untyped-call]
        daemon=True,
    )
    reloading.start()
    wait_for(partial(answers_loading, server), what="the server reloading its data")
    first.release(wait=False)
    # On the connection that owes the release's answer: it reads that first.
    assert second.acquire(blocking=False)
    reloading.join(60)
    reloader.close()
    assert second.owned()
    second.release()
    assert not held(admin, second.key)
    wait_for(lambda: not held(admin, first.key), what="the refused release sent again")
    admin.close()
    client.close()


@pytest.mark.parametrize(
    ("why", "says"), [("disk", "cannot save its data to disk"), ("replicas", "fewer replicas")]
)
def test_a_server_refusing_writes_for_a_while_keeps_held_locks_and_frees_them_after(
    server: RedisServer,
    direct: redis.Redis,
    why: str,
    says: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A server that refuses writes for a while (it cannot save to disk, or too few
    replicas are connected) takes no new lock, saying why, and writes nothing. The
    renewals of a held lock it refuses are logged and retried, and the lock is
    renewed again, never lost, once it writes again within the TTL (one whose TTL
    runs out first is lost); a release it
    refuses is sent again in the background and lands then, long before the TTL,
    whether its caller waited for its answer or (as a task's) not."""
    caplog.set_level(logging.WARNING, logger="celery_redislock")
    renewed = RedisLock(server.url, f"refused-{why}-renewed", ttl=6)
    released = RedisLock(server.url, f"refused-{why}-released", ttl=600, heartbeat=False)
    unread = RedisLock(server.url, f"refused-{why}-unread", ttl=600, heartbeat=False)
    new = RedisLock(server.url, f"refused-{why}-new", ttl=30)
    short = RedisLock(server.url, f"refused-{why}-short", ttl=1)
    for lock in (renewed, released, unread, short):
        assert lock.acquire(blocking=False)
    with refusing_writes(direct, why):
        with pytest.raises(LockBackendError) as refused:
            new.acquire(blocking=False)
        assert says in str(refused.value)
        assert not direct.exists(new.key)
        with pytest.raises(LockBackendError, match="retried in the background"):
            released.release()
        assert hold_count(direct, released) == 1
        unread.release(wait=False)
        wait_for(lambda: "could not renew" in caplog.text, what="a refused renewal")
        assert hold_count(direct, unread) == 1
        # A lock whose TTL runs out before the server writes again is lost.
        wait_for(lambda: short.lost, what="the short lock lost")
        # Its renewal failed round after round, but was logged once: at most one
        # warning every RENEW_WARNING_EVERY seconds.
        warnings = [r for r in caplog.records if "could not renew" in r.getMessage()]
        assert len(warnings) == 1
        assert says in caplog.text
        refused_at = direct.pttl(renewed.key)
    wait_for(lambda: direct.pttl(renewed.key) > refused_at, what="the renewals resumed")
    assert not renewed.lost
    for lock in (released, unread):
        wait_for(partial(lambda one: hold_count(direct, one) == 0, lock), what="a release landed")
        assert direct.pttl(lock.key) > 500_000
    renewed.release()
    assert new.acquire(blocking=False)
    new.release()


@contextlib.contextmanager
def busy_with_a_script(server: RedisServer, direct: redis.Redis) -> Iterator[None]:
    """The server runs a script that never ends, past its busy-reply-threshold
    (``lua-time-limit``, 50 ms), so it answers BUSY to everything else, until the
    block ends and the script is stopped (``SCRIPT KILL``)."""
    direct.config_set("lua-time-limit", 50)
    spinner = server.client()

    def spin() -> None:
        with contextlib.suppress(redis.ResponseError):
            spinner.eval("while true do end", 0)

    def busy() -> bool:
        try:
            direct.exists("anything")
        except redis.ResponseError as exc:
            return str(exc).startswith("BUSY")
        return False

    spinning = threading.Thread(target=spin, daemon=True)
    spinning.start()
    try:
        wait_for(busy, what="the server busy with the script")
        yield
    finally:
        direct.script_kill()
        spinning.join(10)
        spinner.close()


def outcome_in_thread(call: Callable[[], bool]) -> tuple[list[object], threading.Thread]:
    """Start ``call`` in a thread: where its outcome (its answer, or the
    ``LockBackendError`` it raised) lands, and the thread."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(call())
        except LockBackendError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return outcome, thread


def test_a_server_busy_running_a_script_is_waited_for_within_the_deadline(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A server running a script past its busy-reply-threshold answers BUSY to all
    else until the script ends: a call asks again, within its deadline, and
    succeeds once the script is stopped, instead of failing at once; a release
    whose deadline passes first is sent again in the background, and lands then."""
    held = RedisLock(server.url, "busy-held", ttl=600, heartbeat=False, call_timeout=0.3)
    assert held.acquire(blocking=False)
    lock = RedisLock(server.url, "busy-script", ttl=30)
    with busy_with_a_script(server, direct):
        outcome, taking = outcome_in_thread(lambda: lock.acquire(blocking=False))
        with pytest.raises(LockBackendError, match="retried in the background"):
            held.release()
    taking.join(10)
    assert outcome == [True]
    lock.release()
    wait_for(lambda: hold_count(direct, held) == 0, what="the release sent again landed")
    assert direct.pttl(held.key) > 500_000


def test_a_waiter_whose_subscription_meets_a_busy_server_keeps_waiting(
    server: RedisServer, direct: redis.Redis
) -> None:
    """A waiter's subscription breaks while the server is busy with a script (it
    answers BUSY to the new subscription): the waiter keeps waiting, as after any
    break, rather than fail; once the script is stopped and the lock released, it
    takes the lock."""
    holder = RedisLock(server.url, "busy-waited", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(server.url, "busy-waited", ttl=60)
    outcome, waiting = outcome_in_thread(lambda: waiter.acquire(timeout=60))
    hub = hub_for(waiter.transport, waiter.prefix)
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    wait_for(lambda: hub.subscribed, what="the wake-up subscription")
    # (The server refuses CLIENT KILL once busy: the subscription breaks first,
    # and its new one meets the busy server.)
    direct.client_kill_filter(_type="pubsub")
    with busy_with_a_script(server, direct):
        waiting.join(1.5)
        assert outcome == []
    holder.release()
    waiting.join(30)
    assert outcome == [True]
    waiter.release()


def answers_loading(server: RedisServer) -> bool:
    """Whether ``server`` answers a request of one try with ``LOADING`` now."""
    probe = redis.Redis(
        host=server.host, port=server.port, socket_timeout=1, retry=Retry(NoBackoff(), 0)
    )
    try:
        probe.ping()
    except redis.BusyLoadingError:
        return True
    except redis.ConnectionError:
        return False
    finally:
        probe.close()
    return False


@pytest.mark.slow
def test_a_server_loading_its_data_is_waited_for_within_the_deadline(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Any
) -> None:
    """A server restarting with its data answers every request with LOADING until
    it has read it: a call waits for it, within its deadline, rather than fail
    after its few quick tries, and asks again on the connection it has. One whose
    deadline comes first raises, and sends nothing afterwards to undo what was
    refused unrun."""
    server = redislock_server_factory(
        extra_args=(
            *("--enable-debug-command", "yes", "--dir", str(tmp_path), "--save", ""),
            # Each key read slowly (in microseconds): the load lasts seconds, and
            # requests are answered (LOADING) every kilobyte read.
            *("--key-load-delay", "100", "--loading-process-events-interval-bytes", "1024"),
        )
    )
    # The load lasts seconds, longer on a busy machine: the restart may take more
    # than the usual startup time to answer a PING.
    server.startup_timeout = 60
    admin = server.client()
    admin.execute_command("DEBUG", "POPULATE", 50_000, "filler", 10)  # type: ignore[no-untyped-call]
    admin.save()
    admin.close()
    restarting = threading.Thread(target=server.restart, daemon=True)
    restarting.start()

    wait_for(partial(answers_loading, server), what="the server loading its data")
    with FaultProxy(server.host, server.port) as proxy:
        hasty = RedisLock(proxy.url, "loading", ttl=10, call_timeout=0.5)
        with pytest.raises(LockBackendError, match="loading"):
            hasty.acquire(blocking=False)
        assert proxy.connections_accepted == 1
        assert sent_in_background(hasty) == []
        lock = RedisLock(server.url, "loading", ttl=10, call_timeout=60)
        assert lock.acquire(blocking=False)
        restarting.join(60)
        lock.release()


def test_restart_while_held_and_waited_for(server: RedisServer, direct: redis.Redis) -> None:
    """A server restart (all data lost) while a lock is held and waited for: the holder
    finds its lock lost, the waiter gets it with a larger fencing token."""
    holder = RedisLock(server.url, "restart", ttl=1.5)
    assert holder.acquire()
    waiter = RedisLock(server.url, "restart", ttl=10)
    got, thread = acquire_in_thread(waiter, 30)
    wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter in the queue")
    server.restart()
    thread.join(20)
    assert got == [True]
    wait_for(lambda: holder.lost, what="the holder's loss")
    assert waiter.token is not None
    assert holder.token is not None
    assert waiter.token > holder.token
    with pytest.raises(LockLostError):
        holder.release()
    waiter.release()


# TTLs are range-checked inside the scripts too.


@pytest.mark.parametrize("bad_ttl", ["100000000000000000", "0", "-5", "1.5", "abc"])
def test_scripts_refuse_bad_ttls_before_writing(direct: redis.Redis, bad_ttl: str) -> None:
    """Each script refuses a TTL Redis cannot store before its first write: no key is left
    without an expiry, and a held lock is left as it was."""
    key, queue = lock_keys("guarded")
    wake = wake_channel_prefix()
    with pytest.raises(redis.ResponseError) as excinfo:
        direct.eval(ACQUIRE, 2, key, queue, "me", bad_ttl, "", "r1", "", "")
    assert "TTL out of range" in str(excinfo.value)
    assert direct.dbsize() == 0

    direct.eval(ACQUIRE, 2, key, queue, "me", 10_000, "", "r2", "", "")
    before = direct.get(key)
    with pytest.raises(redis.ResponseError):
        direct.eval(EXTEND, 1, key, "me", bad_ttl)
    if bad_ttl != "0":  # for RELEASE, "0" asks to keep the expiry the key has
        with pytest.raises(redis.ResponseError):
            direct.eval(RELEASE, 2, key, queue, "me", wake, "r3", bad_ttl, "")
    assert direct.get(key) == before
    assert 0 < direct.pttl(key) <= 10_000


def test_release_keeps_the_lock_expiry_when_enough_is_left(direct: redis.Redis) -> None:
    """A release made while plenty of the lock's TTL is left leaves the free key's
    expiry as it was; one made near the end keeps the key, and
    its fence, for FENCE_TTL. Either way the next holder's token is higher."""
    long = RedisLock(direct, "keep", ttl=60)
    assert long.acquire()
    first = long.token
    long.release()
    assert 50_000 < direct.pttl(long.key) <= 60_000
    short = RedisLock(direct, "keep", ttl=2)
    assert short.acquire()
    assert short.token is not None
    assert first is not None
    assert short.token > first
    short.release()
    assert direct.pttl(long.key) > 3_000_000


def test_fault_handling_adds_no_round_trips(server: RedisServer) -> None:
    """An uncontended acquire + release is still two round trips."""
    client = server.client()
    lock = RedisLock(client, "trips", ttl=10)
    lock.acquire()
    lock.release()  # the scripts are now cached on the server
    transport = transport_for(client)
    before = transport.sends
    for _ in range(10):
        assert lock.acquire(blocking=False)
        lock.release()
    assert transport.sends - before == 20


def test_requests_are_encoded_as_resp() -> None:
    """The engine's own request encoder writes the RESP redis-py would, for the argument
    types the engine sends, and refuses any other."""
    commands = [("EVALSHA", "ab", 2, "k", "é", b"\x00raw"), ("PING",)]
    packer: Any = redis.Connection().pack_commands  # type: ignore[no-untyped-call]
    assert pack(commands) == b"".join(packer(commands))
    with pytest.raises(TypeError):
        pack([("SET", "k", 1.5)])


def test_a_waiter_whose_subscription_breaks_as_its_time_runs_out_returns_false(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """The waiter's wake-up subscription breaks (here: killed by the server) a few
    milliseconds before its timeout, while the lock stays held and the server answers
    its requests: it has no time left to wait for a wake-up, so it needs no new
    subscription for its last try, and returns ``False`` as any waiter whose time
    runs out with the lock held, rather than raise ``LockBackendError``."""
    other = RedisLock(direct, "sub-breaks-late", ttl=30)
    assert other.acquire(blocking=False)
    lock = RedisLock(via_proxy, "sub-breaks-late", ttl=30)
    assert not lock.acquire(timeout=0.05)  # the subscription is in place
    hub = hub_for(lock.transport, lock.prefix)
    wait_for(lambda: hub.subscribed, what="the wake-up subscription")
    # A few round trips of latency: subscribing again takes longer than the 50 ms
    # (MIN_CALL) a last try is always given.
    proxy.set_latency(0.03)
    try:
        timeout = 1.0
        started = time.monotonic()
        outcome, waiting = outcome_in_thread(lambda: lock.acquire(timeout=timeout))
        wait_for(lambda: direct.zcard(lock_keys("sub-breaks-late").queue) == 1, what="queued")
        time.sleep(max(0.0, started + timeout - 0.04 - time.monotonic()))
        direct.client_kill_filter(_type="pubsub")
        waiting.join(10)
    finally:
        proxy.set_latency(0)
    assert outcome == [False]
    wait_for(lambda: direct.zcard(lock_keys("sub-breaks-late").queue) == 0, what="left")
    assert other.owned()
    other.release()


def test_a_lost_answer_read_after_the_next_hold_leaves_that_hold_alone(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """A release(wait=False) whose answer says the old hold was lost, read by the
    heartbeat thread only after the same object took the lock anew, must not mark
    the new, healthy hold lost."""
    client = redis.Redis.from_url(proxy.url)
    # The next acquire waits for the answer the heartbeat thread reads for half
    # its time (0.5 s) only, and then goes (with the release ahead of it).
    lock = RedisLock(client, "late-answer", ttl=30, call_timeout=1)
    assert lock.acquire(blocking=False)
    direct.delete(lock.key)  # the hold is lost (an operator, an eviction)
    transport = transport_for(client)
    outcomes: list[str] = []
    answered = threading.Event()

    def then(outcome: str) -> None:
        outcomes.append(outcome)
        answered.set()

    proxy.set_latency(2.0)  # the release's request reaches the server 2 s late
    lock.release(wait=False, then=then)
    # The heartbeat thread takes the connection to read the answer (after
    # DRAIN_DELAY) and waits for it there.
    wait_for(lambda: not transport._idle, what="the heartbeat thread to take the owing connection")
    proxy.set_latency(0)  # the new acquire's round trip, and the answer, come at once
    assert lock.acquire(blocking=False)  # a new hold, on another connection
    assert not answered.is_set()  # the old answer is still on its way
    assert answered.wait(10)
    assert outcomes == ["lost"]

    assert held(direct, lock.key)
    assert lock.owned()
    assert not lock.lost  # the new hold is healthy
    lock.check()
    lock.release()
    client.close()


def test_a_hold_whose_answer_comes_after_its_ttl_is_reported_lost(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """An acquire whose answer is read only once the hold's TTL (counted from when
    the request was sent) has run out takes the lock on the server, but the hold is
    lost as it is recorded: ``acquire()`` says it took it, ``lost`` is true at once
    and ``check()`` raises. The heartbeat reports it lost as for any hold whose
    local deadline passes: ``on_lost`` is called once, from the heartbeat thread,
    and the hold is never renewed (its key expires on the server by its TTL)."""
    client = redis.Redis.from_url(proxy.url)
    beat = Heartbeat()
    reported: list[tuple[RedisLock, threading.Thread]] = []

    def on_lost(lost: RedisLock) -> None:
        reported.append((lost, threading.current_thread()))

    lock = RedisLock(client, "answered-late", ttl=0.3, on_lost=on_lost, _heartbeat=beat)
    # A second lock on the same lane, renewed often: its renewals are rounds that
    # come after any the late hold was due in.
    witness = RedisLock(
        client, "answered-late:witness", ttl=30, heartbeat_interval=0.05, _heartbeat=beat
    )
    try:
        assert lock.acquire(blocking=False)  # the connection made, the script loaded
        lock.release()
        # 0.2 s each way: the answer is read 0.4 s after the request was sent.
        proxy.set_latency(0.2)
        try:
            assert lock.acquire(blocking=False)
        finally:
            proxy.set_latency(0)
        assert lock.lost
        with pytest.raises(LockLostError):
            lock.check()
        wait_for(lambda: reported, what="on_lost for the hold answered after its TTL")
        assert [lost for lost, _ in reported] == [lock]
        assert reported[0][1] is not threading.current_thread()
        assert lock not in beat.held()
        assert witness.acquire(blocking=False)
        first = witness._expiry
        wait_for(lambda: witness._expiry > first, what="the witness lock's first renewal")
        # Nothing renews it: the key expires on the server by its TTL.
        wait_for(lambda: not held(direct, lock.key), what="the late hold's key to expire")
        with pytest.raises(LockLostError):
            lock.release()
        assert len(reported) == 1
    finally:
        if witness.owned():
            witness.release()
        beat.stop()
        client.close()


#: Keeps the server busy for about a second (a slow script).
_BUSY = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
while true do
    t = redis.call('TIME')
    if t[1] * 1000000 + t[2] - start > 1000000 then return 1 end
end
"""


def test_a_renewal_landing_after_a_longer_extend_cuts_the_local_deadline_too(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """extend(30) and a renewal race: the server runs the extend first and the
    renewal (PEXPIRE to the lock's own 3 s TTL) after it, and the renewal's answer
    is read first. The server's expiry is then the renewal's: the holder must not
    keep trusting the extend's 30 s once the key has gone."""
    client = redis.Redis.from_url(proxy.url)
    lock = RedisLock(client, "extend-race", ttl=3, heartbeat=False, heartbeat_interval=2.5)
    beat = Heartbeat()
    assert lock.acquire(blocking=False)
    lock.extend()  # the server has the EXTEND script: both go by digest below
    done: list[str] = []

    def extend() -> None:
        lock.extend(30)
        done.append("extend")

    def renew() -> None:
        beat.renew([lock])
        done.append("renewal")

    def delivered(start: threading.Thread, what: str) -> None:
        before = proxy.bytes_to_server
        start.start()
        wait_for(lambda: proxy.bytes_to_server > before, what=what)

    busy = threading.Thread(target=client.eval, args=(_BUSY, 0))
    extending = threading.Thread(target=extend)
    renewing = threading.Thread(target=renew)
    delivered(busy, "the busy script to reach the server")
    time.sleep(0.1)  # the server is in the script (1 s)
    delivered(extending, "the extend to reach the server")  # runs once the script ends
    proxy.set_latency(2.0)
    renewing.start()  # reaches the server 2 s late: after the extend ran
    direct.ping()  # answered once the script has ended
    time.sleep(0.1)  # the extend ran, its answer is held up by the latency
    proxy.set_latency(0)  # the renewal's answer comes back at once
    for thread in (busy, extending, renewing):
        thread.join(10)
    assert done == ["renewal", "extend"]  # the race as described
    assert 0 < direct.pttl(lock.key) <= 3000  # the renewal landed last

    wait_for(lambda: not held(direct, lock.key), what="the key to expire on the server")
    other = RedisLock(direct, "extend-race", ttl=30, heartbeat=False)
    assert other.acquire(blocking=False)  # another owner holds it now...
    assert lock.lost  # ...and the old holder must know
    other.release()
    client.close()


@pytest.mark.parametrize("sections", [1, DROPS_REMEMBERED + 2], ids=["one", "many"])
def test_an_inner_release_sent_again_with_no_known_last_change_drops_no_second_hold(
    proxy: FaultProxy, direct: redis.Redis, held_back: HeldBack, sections: int
) -> None:
    """Two inner releases in a row lose their answers (both ran): the second one, sent
    while the lock's last change was unknown, is sent again in the background. The
    holder enters nested sections (more of them than the lock remembers releases
    that dropped a hold, for ``many``) before that copy lands: it is recognised as
    the release that already ran, or acts only behind the first one, and drops no
    hold of the last section, so the lock stays held until the holder's last release
    and nobody else takes it meanwhile."""
    lock = RedisLock(proxy.url, "inner-unknown", ttl=30, call_timeout=0.5, _heartbeat=held_back)
    assert lock.acquire()
    lock.release()  # the server now has both scripts
    for _ in range(3):
        assert lock.acquire()
    for _ in range(2):
        assert lock.owned()  # a connection open before the fault, for the release
        proxy.drop_replies(1)
        proxy.refuse()
        with pytest.raises(LockBackendError, match="retried in the background"):
            lock.release()  # it ran: one hold less on the server
        proxy.heal()
    assert hold_count(direct, lock) == 1
    for _ in range(sections - 1):
        with lock:
            pass
    assert lock.acquire()  # a nested section: two holds on both sides
    assert hold_count(direct, lock) == 2
    held_back.let_go()
    wait_for(lambda: not sent_in_background(lock, held_back), what="the late resends to land")
    ends_its_two_holds_alone(direct, lock)


def test_an_inner_release_whose_answer_the_heartbeat_reads_goes_ahead_of_the_outer_one(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """An inner release that did not wait, owed its answer on a connection gone dark
    that the heartbeat's thread is reading when the outer release goes: the outer
    release does not go without it (it would drop one hold of two and leave the
    lock held, renewed by nobody, until its TTL). The inner one goes ahead of it,
    in its round trip, and the lock is free as the outer release returns."""
    lock = RedisLock(via_proxy, "owed-read-by-heartbeat", ttl=3, call_timeout=1)
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    lock.release()  # the server now has both scripts
    assert lock.acquire(blocking=False)
    assert proxy.silence_open() == 1
    outcomes: list[str] = []
    lock.release(wait=False, then=outcomes.append)
    wait_for(lambda: not lock.transport._idle, what="the heartbeat's thread to read its answer")

    lock.release()

    assert not lock.holding
    assert not held(direct, lock.key)
    wait_for(lambda: outcomes == ["retrying"], what="the inner release's answer to be lost")
    wait_for(lambda: not sent_in_background(lock), what="its copy sent again to land")
    assert not held(direct, lock.key)


def test_an_inner_release_whose_answer_the_heartbeat_reads_in_time_is_not_sent_twice(
    proxy: FaultProxy, via_proxy: redis.Redis, direct: redis.Redis
) -> None:
    """On a slow network, the heartbeat's thread reads the answer an inner release
    that did not wait is owed when the outer release goes: the outer release waits
    for that answer (within half its time) rather than send the inner one again
    ahead of it, and frees the lock."""
    lock = RedisLock(via_proxy, "owed-read-in-time", ttl=30, call_timeout=4)
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    lock.release()  # the server now has both scripts
    assert lock.acquire(blocking=False)
    direct.config_resetstat()
    proxy.set_latency(0.2)
    outcomes: list[str] = []
    lock.release(wait=False, then=outcomes.append)
    wait_for(lambda: not lock.transport._idle, what="the heartbeat's thread to read its answer")

    lock.release()

    assert outcomes == ["released"]
    assert not held(direct, lock.key)
    stats = direct.info("commandstats")
    assert sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("eval", "evalsha")) == 2


def an_inner_release_held_up(proxy: FaultProxy, lock: RedisLock) -> list[str]:
    """Take ``lock`` twice (through ``proxy``, the server knowing its scripts), and
    release the inner hold without waiting, that request held up at the proxy until
    let through: where the release's outcome lands."""
    assert lock.acquire(blocking=False)
    lock.release()  # the server now has both scripts
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    proxy.hold_next()
    outcomes: list[str] = []
    lock.release(wait=False, then=outcomes.append)
    wait_for(lambda: proxy.held == 1, what="the inner release to be held up")
    return outcomes


def script_runs(client: redis.Redis) -> int:
    """How many scripts the server has run so far (by digest or by text)."""
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("eval", "evalsha"))


def test_an_inner_release_that_reaches_the_server_after_its_copy_drops_no_second_hold(
    proxy: FaultProxy, direct: redis.Redis, held_back: HeldBack
) -> None:
    """An inner release that did not wait is held up on its way to the server (a slow
    path); its answer does not come in time, so a copy goes ahead of the next request
    and drops the inner hold. The holder then enters and leaves more nested sections
    than the hold remembers releases that dropped one: when the first send finally
    arrives, it is recognised as the copy's, and drops no second hold. The lock
    stays held until the holder's last release, and nobody else takes it meanwhile."""
    lock = RedisLock(proxy.url, "late-first-send", ttl=60, call_timeout=0.2, _heartbeat=held_back)
    outcomes = an_inner_release_held_up(proxy, lock)
    for _ in range(DROPS_REMEMBERED + 1):
        with lock:
            pass
    assert outcomes == ["retrying"]
    assert lock.acquire(blocking=False)  # a nested section: two holds on both sides
    assert hold_count(direct, lock) == 2
    ran = script_runs(direct)

    proxy.let_held_through()
    wait_for(lambda: script_runs(direct) > ran, what="the first send to reach the server")

    ends_its_two_holds_alone(direct, lock)


def test_an_owed_answer_the_heartbeat_reads_is_waited_for_once(
    proxy: FaultProxy, direct: redis.Redis, held_back: HeldBack
) -> None:
    """An inner release that did not wait is held up on its way to the server while the
    heartbeat's thread reads its answer: the next request waits for it (within half
    its time), then sends a copy ahead of it, which drops the inner hold. The requests
    after it neither wait for that answer again nor send another copy. When the first
    send arrives, it drops no second hold."""
    lock = RedisLock(proxy.url, "owed-once", ttl=60, call_timeout=30, _heartbeat=held_back)
    outcomes = an_inner_release_held_up(proxy, lock)  # its answer is read for 30 s
    wait_for(lambda: not lock.transport._idle, what="the heartbeat's thread to read its answer")
    lock.call_timeout = 0.4  # the requests from now on
    direct.config_resetstat()
    for _ in range(5):
        with lock:
            pass
    stats = direct.info("commandstats")
    assert stats["cmdstat_eval"]["calls"] == 1  # one copy, sent by text ahead of the first
    assert outcomes == []
    assert hold_count(direct, lock) == 1

    proxy.let_held_through()
    wait_for(lambda: outcomes == ["released"], what="the first send's answer")
    assert hold_count(direct, lock) == 1
    lock.release()
    assert not held(direct, lock.key)


def test_an_acquire_that_reaches_the_server_after_its_undo_takes_nothing(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """An acquire held up on its way to the server (a slow path) past its deadline
    raises; its undo, sent on another connection, arrives first and finds nothing
    to undo. It leaves word in the lock's free value, so that the acquire, arriving
    at last, takes nothing, rather than hold the lock for a TTL for an owner that
    neither renews nor releases it. Another owner takes the lock at once."""
    lock = RedisLock(proxy.url, "late-to-its-undo", ttl=30, call_timeout=0.5)
    assert lock.acquire(blocking=False)  # the connection is open, the scripts known
    lock.release()
    held_up_past_its_undo(proxy, lock)
    assert proxy.held == 1
    ran = script_runs(direct)

    proxy.let_held_through()
    wait_for(lambda: script_runs(direct) > ran, what="the acquire to reach the server")

    assert not held(direct, lock.key)
    rival = RedisLock(direct, "late-to-its-undo", ttl=30)
    assert rival.acquire(blocking=False)
    assert rival.token is not None
    assert rival.token > 0
    rival.release()


def held_up_past_its_undo(proxy: FaultProxy, lock: RedisLock) -> None:
    """Acquire ``lock`` through ``proxy`` (the connection open, the scripts known),
    the request held up at the proxy past the acquire's deadline: the acquire
    raises, and its undo, sent on another connection, lands first."""
    proxy.hold_next(1)
    with pytest.raises(LockBackendError):
        lock.acquire(blocking=False)
    wait_for(lambda: sent_in_background(lock) == [], what="the undo")


@pytest.mark.parametrize(
    "between",
    [
        "another acquire undone so",
        "another owner's hold and release",
        "another owner's hold the undo finds",
        "another owner's hold the undo finds, released to a waiter gone since it queued",
    ],
)
def test_acquires_that_reach_the_server_after_their_undos_and_later_holds_take_nothing(
    proxy: FaultProxy, direct: redis.Redis, between: str
) -> None:
    """Acquires held up on their way to the server (a slow path) past their
    deadline, each undone on another connection, reach it only after later changes
    of their name: a second acquire of the name undone so; another owner's hold,
    taken and released after the undo; another owner's hold the undo finds, and
    its release; the same, with a waiter queued first whose process is gone
    (killed where a release cannot tell, or frozen): the release wakes it to ask
    rather than hand it the lock, which would take the list of undone acquires
    along as the grant nobody confirms runs out. Each takes nothing when it
    arrives, so nobody is left holding the lock for a TTL for an owner that
    neither renews nor releases it."""
    name = "late-past-" + between.replace(" ", "-").replace("'", "").replace(",", "")
    lock = RedisLock(proxy.url, name, ttl=30, call_timeout=0.5)
    rival = RedisLock(direct, name, ttl=30)
    assert lock.acquire(blocking=False)  # the connection is open, the scripts known
    lock.release()
    late = [lock]
    gone_waiter = between.endswith("gone since it queued")
    if between.startswith("another owner's hold the undo finds"):
        assert rival.acquire(blocking=False)
    if gone_waiter:
        # (Handed over, the lock would be the gone waiter's for its TTL of 0.1 s.)
        gone = queue_entry("gone-process.1", "gone-owner", 100, "", "")
        direct.zadd(rival.queue_key, {gone: 1})
        write_fields(direct, rival.key, q="1")
    held_up_past_its_undo(proxy, lock)
    if between == "another acquire undone so":
        late.append(RedisLock(proxy.url, name, ttl=30, call_timeout=0.5))
        held_up_past_its_undo(proxy, late[-1])
    elif between == "another owner's hold and release":
        assert rival.acquire(blocking=False)
    if between != "another acquire undone so":
        rival.release()
    if gone_waiter:
        wait_for(lambda: up_for_anyone(direct, lock.key), what="the gone waiter's turn to pass")
    assert proxy.held == len(late)
    ran = script_runs(direct)

    proxy.let_held_through()
    wait_for(lambda: script_runs(direct) >= ran + len(late), what="the acquires to arrive")

    assert not held(direct, lock.key)
    assert rival.acquire(blocking=False)
    rival.release()


def acquire_through_a_cut(proxy: FaultProxy, lock: RedisLock, **kwargs: Any) -> bool:
    """``lock.acquire(**kwargs)`` through ``proxy`` (the connection open, the
    scripts known), its first try held up at the proxy as its connection breaks:
    the acquire sends it again on a new connection, and returns what that copy
    is answered. The first copy stays held up until let through."""
    proxy.hold_next(1)
    got: list[bool] = []
    thread = threading.Thread(target=lambda: got.append(lock.acquire(**kwargs)))
    thread.start()
    wait_for(lambda: proxy.held == 1, what="the first try to be held up")
    assert proxy.cut_held() == 1
    thread.join(15)
    assert len(got) == 1
    return got[0]


def reaches_the_server(proxy: FaultProxy, direct: redis.Redis) -> None:
    """Let what ``proxy`` held up through, and wait for it to run."""
    ran = script_runs(direct)
    proxy.let_held_through()
    wait_for(lambda: script_runs(direct) > ran, what="the first try to reach the server")


@pytest.mark.parametrize("waits", [False, True])
def test_an_acquire_that_gave_up_after_its_retry_found_the_lock_held_leaves_its_first_try_nothing(
    proxy: FaultProxy, direct: redis.Redis, waits: bool
) -> None:
    """An acquire's first try is held up on its way to the server as its connection
    breaks; sent again on a new connection, it finds the lock held by another owner,
    and the acquire gives up (at once, or once its time to wait is up). That answer
    does not say the first try has arrived: the acquire is undone as it gives up,
    and the first try, reaching the server after the holder released the lock,
    takes nothing, rather than hold it for a TTL for an owner that neither renews
    nor releases it."""
    name = f"late-first-try-{'waiting' if waits else 'at-once'}"
    lock = RedisLock(proxy.url, name, ttl=30, call_timeout=2)
    rival = RedisLock(direct, name, ttl=30)
    assert rival.acquire(blocking=False)
    assert not lock.acquire(timeout=0.1)  # the connection open, the scripts known, subscribed
    assert not acquire_through_a_cut(proxy, lock, blocking=waits, timeout=0.3 if waits else None)
    wait_for(lambda: sent_in_background(lock) == [], what="the undo")
    rival.release()

    reaches_the_server(proxy, direct)

    assert not held(direct, lock.key)
    assert direct.zcard(lock.queue_key) == 0
    assert rival.acquire(blocking=False)
    rival.release()


@pytest.mark.parametrize(
    "between", ["an inner hold taken and dropped", "its release", "a renewal (safe as it was)"]
)
def test_an_acquire_taken_by_its_retry_leaves_its_late_first_try_nothing(
    proxy: FaultProxy, direct: redis.Redis, between: str
) -> None:
    """An acquire's first try is held up on its way to the server as its connection
    breaks; sent again on a new connection, it takes the lock. The first try
    arrives later: after the holder took an inner hold and dropped it (the last
    change to the hold is no longer the acquire, so the copy, unrecognised, would
    count a second hold, which the holder's release leaves held for a TTL), after
    the holder's release (it would take the lock anew, for an owner that neither
    renews nor releases it), or after a renewal (the acquire is still the last
    change: recognised, it only renews the hold). It takes nothing in each case,
    and the holder's release frees the lock."""
    name = "late-first-try-after-" + between.split(" (")[0].replace(" ", "-")
    lock = RedisLock(proxy.url, name, ttl=30, call_timeout=2)
    assert lock.acquire(blocking=False)  # the connection open, the scripts known
    lock.release()
    assert acquire_through_a_cut(proxy, lock, blocking=False)
    assert hold_count(direct, lock) == 1
    if between == "an inner hold taken and dropped":
        with lock:
            pass
    elif between == "its release":
        lock.release()
    else:
        lock.extend()

    reaches_the_server(proxy, direct)

    if between != "its release":
        assert hold_count(direct, lock) == 1
        lock.release()
    assert not held(direct, lock.key)


def test_an_extend_beyond_the_ttl_goes_after_the_listing_of_a_late_first_try(
    proxy: FaultProxy, direct: redis.Redis, held_back: HeldBack
) -> None:
    """An acquire's first try is held up on its way as its connection breaks, and
    its retry takes the lock; the listing of that try as undone is still to be sent
    in the background when the holder extends the hold well beyond the lock's TTL.
    The extend sends the listing first: the copy that arrives after it takes
    nothing, and leaves the hold the time the extend gave it (recognised as the
    hold's last change, it would renew the hold to the lock's TTL from its arrival,
    earlier than the holder's local deadline)."""
    lock = RedisLock(
        proxy.url,
        "late-first-try-after-a-long-extend",
        ttl=30,
        call_timeout=2,
        _heartbeat=held_back,
    )
    assert lock.acquire(blocking=False)  # the connection open, the scripts known
    lock.release()
    assert acquire_through_a_cut(proxy, lock, blocking=False)
    assert held_back.kept  # the listing, not sent yet
    lock.extend(600)

    reaches_the_server(proxy, direct)

    assert direct.pttl(lock.key) > 300_000
    held_back.let_go()
    wait_for(lambda: not sent_in_background(lock, held_back), what="the listing to land again")
    assert hold_count(direct, lock) == 1
    lock.release()
    assert not held(direct, lock.key)


def handed_after_a_cut(
    proxy: FaultProxy, direct: redis.Redis, lock: RedisLock, held_for: float = 0.0
) -> None:
    """``lock`` (reaching its server through ``proxy``) waits for another owner's
    hold: its first try is held up at the proxy as its connection breaks, and its
    retry, sent on a new connection, queues it; ``held_for`` seconds later the
    other owner's release hands it the lock. Its first try stays held at the proxy."""
    rival = RedisLock(direct, lock.name, ttl=30)
    assert rival.acquire(blocking=False)
    assert not lock.acquire(timeout=0.1)  # the connection open, the scripts known, subscribed
    proxy.hold_next(1)
    got, thread = acquire_in_thread(lock, 15)
    wait_for(lambda: proxy.held == 1, what="the first try to be held up")
    assert proxy.cut_held() == 1
    wait_for(lambda: direct.zcard(lock.queue_key) == 1, what="the retry to queue the waiter")
    time.sleep(held_for)
    rival.release()
    thread.join(15)
    assert got == [True]


def test_a_waiter_handed_the_lock_after_its_retry_queued_leaves_its_late_first_try_nothing(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """A waiter's first try is held up on its way to the server as its connection
    breaks; sent again on a new connection, it queues the waiter, and the holder's
    release hands it the lock. The first try arrives after the waiter took an
    inner hold and dropped it: it counts no second hold (which the waiter's
    release would leave held for a TTL), and the release frees the lock."""
    lock = RedisLock(proxy.url, "late-first-try-handed", ttl=30, call_timeout=2)
    handed_after_a_cut(proxy, direct, lock)
    with lock:
        pass

    reaches_the_server(proxy, direct)

    assert hold_count(direct, lock) == 1
    lock.release()
    assert not held(direct, lock.key)


@pytest.mark.slow
def test_a_waiter_handed_the_lock_a_ttl_after_its_lost_try_holds_it(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """A waiter's first try is held up as its connection breaks, and its retry
    queues it; the lock is handed to it more than its TTL later. That try still
    counts as unconfirmed (its copy may arrive yet), but the hold the waiter got is
    its own, with the full TTL from the hand-over: not lost as the acquire
    returns, and renewed past its TTL like any other."""
    lock = RedisLock(proxy.url, "late-first-try-long-wait", ttl=1, call_timeout=2)
    handed_after_a_cut(proxy, direct, lock, held_for=lock.ttl * 1.5)
    assert not lock.lost
    time.sleep(lock.ttl * 1.5)
    assert not lock.lost
    assert hold_count(direct, lock) == 1

    reaches_the_server(proxy, direct)

    assert hold_count(direct, lock) == 1
    lock.release()
    assert not held(direct, lock.key)


def test_an_acquire_written_ahead_and_taken_by_its_retry_leaves_its_late_first_send_nothing(
    proxy: FaultProxy, direct: redis.Redis
) -> None:
    """An acquire a worker writes ahead of its task (read later) is held up on its
    way to the server as its connection breaks; read, it is sent again on a new
    connection, and takes the lock. The first send, arriving after the holder's
    release, takes nothing."""
    lock = RedisLock(proxy.url, "late-first-send-written-ahead", ttl=30, call_timeout=2)
    assert lock.acquire(blocking=False)  # the connection open, the scripts known
    lock.release()
    proxy.hold_next(1)
    ahead = lock._send_acquire()
    assert ahead is not None
    wait_for(lambda: proxy.held == 1, what="the first send to be held up")
    assert proxy.cut_held() == 1
    assert lock._acquire_sent(ahead)
    lock.release()

    reaches_the_server(proxy, direct)

    assert not held(direct, lock.key)


@pytest.mark.slow
@pytest.mark.parametrize("on_conflict", ["skip", "wait"])
def test_a_task_whose_acquire_is_answered_after_its_ttl_asks_again_before_its_body_runs(
    server: RedisServer, proxy: FaultProxy, on_conflict: str
) -> None:
    """A task's acquire is held up on its way to the lock store for longer than the
    lock's TTL (a stalled path; a process frozen meanwhile reads it as late): the
    hold it made has run out by the time its answer is read. The task gives it back
    and asks again before its body runs, which then holds a live lock; nothing
    reports a loss. (A worker's acquire written ahead as it accepts the task is
    handled so too: see test_early.py.)"""
    app = Celery(f"late-answer-{on_conflict}", set_as_current=False)
    app.conf.update(redislock_url=proxy.url_for(0))
    seen: list[bool] = []

    @app.task(base=SingletonTask, shared=False, bind=True, lock_ttl=1, on_conflict=on_conflict)
    def job(self: Any, n: int) -> None:
        seen.append(self.lock.lost)

    lost: list[Any] = []

    def on_lost(sender: Any = None, **fields: Any) -> None:
        lost.append(fields)

    job.apply((0,))  # the connection open, the scripts known
    lock_signals.lock_lost.connect(on_lost, weak=False, dispatch_uid="late-answer")
    try:
        proxy.hold_next(1)
        ran = threading.Thread(target=job.apply, args=((1,),))
        ran.start()
        wait_for(lambda: proxy.held == 1, what="the acquire to be held up")
        time.sleep(1.5)
        proxy.let_held_through()
        ran.join(15)
    finally:
        lock_signals.lock_lost.disconnect(on_lost, dispatch_uid="late-answer")
    assert seen == [False, False]
    assert lost == []


@pytest.mark.slow
def test_a_waiting_task_that_asks_again_after_a_late_answer_reports_its_wait_once(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiting task (``on_conflict="wait"``) finds its lock held and waits; the
    try that takes it is held up on its way to the store past the task's TTL, so
    the task gives that hold back and asks again, and finds the lock held by
    another owner once more (the waiter queued behind it, handed the lock by that
    give-back). It waits again, and runs once the other owner releases: the
    delivery sends ``lock_conflict`` once and logs its wait once."""
    app = Celery("late-answer-wait-again", set_as_current=False)
    app.conf.update(redislock_url=proxy.url_for(0))
    seen: list[bool] = []

    @app.task(
        base=SingletonTask, shared=False, bind=True, lock_ttl=1, lock_wait=15, on_conflict="wait"
    )
    def job(self: Any, n: int) -> None:
        seen.append(self.lock.lost)

    conflicts: list[str] = []

    def on_conflict(sender: Any = None, action: str = "", **fields: Any) -> None:
        conflicts.append(action)

    job.apply((0,))  # the connection open, the scripts known
    name = job.lock_name((1,), {})
    # The first holder, and a waiter queued behind the task whose TTL is longer
    # than the task's: woken second as the holder releases (the task is handed
    # the lock), it waits out a grant of that longer TTL before it asks.
    holder = RedisLock(direct, name, ttl=30)
    other = RedisLock(direct, name, ttl=30)
    assert holder.acquire(blocking=False)
    caplog.set_level(logging.INFO, logger="celery_redislock")
    lock_signals.lock_conflict.connect(on_conflict, weak=False, dispatch_uid="late-wait-again")
    try:
        ran = threading.Thread(target=job.apply, args=((1,),))
        ran.start()
        wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the task to queue")
        got, waits = acquire_in_thread(other, 15)
        wait_for(lambda: direct.zcard(holder.queue_key) == 2, what="the other waiter to queue")
        # Long enough after the task's try that it does not keep the handed hold
        # unconfirmed: its next try confirms it, and is held up.
        time.sleep(0.6)
        proxy.hold_next(1)
        holder.release()
        wait_for(lambda: proxy.held == 1, what="the task's try to be held up")
        time.sleep(1.2)  # past the task's TTL (and the grant it was handed)
        proxy.let_held_through()
        wait_until(lambda: got == [True] or not ran.is_alive())
        if got == [True]:
            other.release()
        ran.join(15)
        waits.join(15)
    finally:
        lock_signals.lock_conflict.disconnect(on_conflict, dispatch_uid="late-wait-again")
        proxy.heal()
        close_app(app)
    assert got == [True]
    assert seen == [False, False]
    assert conflicts == ["wait"]
    logged = [r for r in caplog.records if "waits up to" in r.getMessage()]
    assert len(logged) == 1


def close_with_its_broker_connections(app: Celery) -> None:
    """Close ``app`` (see :func:`~tests.support.close_app`) and the broker connections
    Celery keeps for its broker URL in kombu's pools, one pool per URL for the whole
    process: the URL is this test's own (its server's or proxy's), which no later
    test uses, so they would otherwise stay open until the session ends."""
    app.amqp.producer_pool.force_close_all(close_pool=False)
    app.pool.force_close_all(close_pool=False)
    close_app(app)


def locks_behind(proxy: FaultProxy, server: RedisServer, name: str) -> tuple[Celery, Any]:
    """An app whose lock store is ``server`` behind ``proxy`` (its broker reached
    directly, db 1), and its ``until_executed`` task ``name``."""
    app = Celery(name, broker=f"redis://{server.host}:{server.port}/1", set_as_current=False)
    app.conf.update(
        redislock_url=proxy.url_for(0),
        task_default_queue=f"{name}-queue",
        broker_connection_retry_on_startup=True,
    )

    @app.task(base=SingletonTask, shared=False, name=name, lock_strategy="until_executed")
    def job(n: int) -> None: ...

    return app, job


@pytest.mark.parametrize("task_id", ["the same id", "a new id"])
def test_a_send_whose_reservation_reaches_the_server_after_its_undo_is_made_again(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis, task_id: str
) -> None:
    """A send's reservation acquire is held up on its way to the store past its
    deadline: the send raises and publishes nothing, and the acquire's undo,
    sent on another connection, arrives first and finds nothing. When the acquire
    arrives at last it reserves nothing, so the same call sent again is published
    (under the same task id or another) rather than deduplicated to the message
    that was never sent, for the reservation's TTL (``lock_enqueue_ttl``)."""
    name = f"late-reservation-{task_id.replace(' ', '-')}"
    app, job = locks_behind(proxy, server, name)

    new_lock = job._new_lock

    def quick(*args: Any, **kwargs: Any) -> RedisLock:
        lock: RedisLock = new_lock(*args, **kwargs)
        lock.call_timeout = 0.5  # the held acquire gives up sooner
        return lock

    job._new_lock = quick
    queue = server.client(db=1, socket_timeout=5)
    try:
        job.delay(0)  # both connections open, the scripts known
        key = lock_keys(job.lock_name((1,), {}))[0]
        proxy.hold_next(1)
        with pytest.raises(LockBackendError):
            job.apply_async((1,), task_id="sent-1")
        wait_for(lambda: background_sends_about(key) == [], what="the undo")
        ran = script_runs(direct)
        proxy.let_held_through()
        wait_for(lambda: script_runs(direct) > ran, what="the acquire to reach the store")
        assert not held(direct, key)

        again = job.apply_async((1,), task_id="sent-1" if task_id == "the same id" else None)

        queued = [json.loads(m)["headers"]["id"] for m in queue.lrange(f"{name}-queue", 0, -1)]
        assert len(queued) == 2
        assert again.id in queued
        assert fields(direct, key)[OWNER_FIELD] == queued_owner(again.id)
    finally:
        proxy.heal()
        queue.close()
        close_with_its_broker_connections(app)


def background_sends_about(key: str) -> list[str]:
    """What the process's heartbeat is still sending about lock key ``key``."""
    return [
        p.what
        for lane in get_heartbeat()._lanes.values()
        for p in lane.pending
        if key in p.call.keys
    ]


def background_send_about(key: str) -> tuple[Any, Any]:
    """The one request the process's heartbeat is still sending about lock key
    ``key``, with the heartbeat lane that sends it."""
    [(lane, pending)] = [
        (lane, p)
        for lane in get_heartbeat()._lanes.values()
        for p in lane.pending
        if key in p.call.keys
    ]
    return lane, pending


@contextlib.contextmanager
def store_gone_as_it_publishes(
    proxy: FaultProxy, name: str
) -> Iterator[tuple[Any, Callable[..., BaseException]]]:
    """An app whose broker and lock store are one server behind ``proxy``, and its
    ``until_executed`` task (connected to both once); with it, a function that
    sends the task (``apply_async``'s arguments) while the server goes away as the
    message is published (the proxy refuses and resets every connection), and
    returns what the send raised, which is not a conflict."""
    app = Celery(name, broker=proxy.url_for(1), set_as_current=False)
    app.conf.update(
        redislock_url=proxy.url_for(0),
        task_default_queue=f"{name}-queue",
        task_publish_retry=False,
        broker_connection_retry_on_startup=True,
    )

    @app.task(base=SingletonTask, shared=False, name=name, lock_strategy="until_executed")
    def job(n: int) -> None: ...

    outage = threading.Event()

    def server_goes_away(**_: Any) -> None:
        if outage.is_set():
            outage.clear()
            proxy.refuse()
            proxy.reset_all()

    def send_failing(*args: Any, **options: Any) -> BaseException:
        outage.set()
        with pytest.raises(Exception) as failed:
            job.apply_async(*args, **options)
        assert not isinstance(failed.value, LockConflictError)
        return failed.value

    signals.before_task_publish.connect(server_goes_away, weak=False)
    try:
        job.delay(0)  # Both connections open.
        yield job, send_failing
    finally:
        signals.before_task_publish.disconnect(server_goes_away)
        close_with_its_broker_connections(app)


@pytest.mark.parametrize("meanwhile", ["nothing", "taken by another"])
def test_a_send_that_fails_with_its_store_unreachable_frees_its_reservation_once_it_answers(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis, meanwhile: str
) -> None:
    """The broker and the lock store, one server behind the proxy, go away as an
    ``until_executed`` message is published: the send fails, and so does the free of
    the reservation it took. Once the store answers again, the reservation is freed
    in the background, and the same call sent again is published. Freed by its owner
    token only: a hold another owner took meanwhile stays."""
    name = f"failed-send-{meanwhile.replace(' ', '-')}"
    queue = server.client(db=1, socket_timeout=5)
    with store_gone_as_it_publishes(proxy, name) as (job, send_failing):
        key = lock_keys(job.lock_name((1,), {}))[0]
        send_failing((1,))
        assert queue.llen(f"{name}-queue") == 1
        assert held(direct, key)
        assert background_sends_about(key) != []
        other = RedisLock(server.url, job.lock_name((1,), {}), ttl=60)
        if meanwhile == "taken by another":
            # Freed (its TTL ran out, say), then taken by another owner.
            direct.delete(key)
            assert other.acquire(blocking=False)
        proxy.heal()
        if meanwhile == "nothing":
            wait_for(lambda: not held(direct, key), timeout=10, what="the reservation to go")
            again = job.delay(1)
            assert queue.llen(f"{name}-queue") == 2
            assert fields(direct, key)[OWNER_FIELD] == queued_owner(again.id)
        else:
            wait_for(lambda: background_sends_about(key) == [], timeout=10, what="the free")
            assert fields(direct, key)[OWNER_FIELD] == other.owner
            other.release()
    queue.close()


def sent_again_before_its_background_send(
    job: Any, key: str, task_id: str, proxy: FaultProxy, direct: redis.Redis, queue: redis.Redis
) -> None:
    """Send ``job``'s call ``(1,)`` again (under the id ``sent-1`` of the send that
    failed, or a new one for ``task_id`` "a new id") while the background send
    about lock key ``key`` that failed send left is backed off past the outage:
    it is published beside the first, its reservation made; then the background
    send goes, and leaves that reservation alone."""
    lane, pending = background_send_about(key)
    with lane.cond:
        # Backed off past the outage (a try under way when this is set goes
        # after the same pause once it fails).
        pending.next_try, pending.pause = lane.clock() + 3600, 3600.0
    proxy.heal()
    again = job.apply_async((1,), task_id="sent-1" if task_id == "the same id" else None)
    queued = [
        json.loads(m)["headers"]["id"] for m in queue.lrange(job.app.conf.task_default_queue, 0, -1)
    ]
    assert len(queued) == 2
    assert again.id in queued
    assert fields(direct, key)[OWNER_FIELD] == queued_owner(again.id)
    with lane.cond:
        pending.next_try, pending.pause = lane.clock(), 0.1
        lane._wake(pending.next_try)
    wait_for(lambda: background_sends_about(key) == [], timeout=10, what="the background send")
    assert fields(direct, key)[OWNER_FIELD] == queued_owner(again.id)


@pytest.mark.parametrize("task_id", ["the same id", "a new id"])
def test_a_send_made_again_before_the_undo_of_a_sends_unanswered_reservation_is_published(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis, task_id: str
) -> None:
    """A send's reservation acquire runs but its answer is lost, the lock store
    then out of reach: the send raises, publishes nothing, and the acquire is
    undone in the background, backing off. The same call, sent again from this
    process once the store answers, before that undo has gone, is published
    (under the same task id or another), not deduplicated to the message never
    sent: its acquire sends the undo first. The undo, tried again later, acts
    only on the acquire it undoes, and leaves the new reservation alone."""
    name = f"unanswered-send-again-{task_id.replace(' ', '-')}"
    app, job = locks_behind(proxy, server, name)

    queue = server.client(db=1, socket_timeout=5)
    try:
        job.delay(0)  # both connections open, the scripts known
        key = lock_keys(job.lock_name((1,), {}))[0]
        proxy.drop_replies(1, then_close_port=True)
        with pytest.raises(LockBackendError):
            job.apply_async((1,), task_id="sent-1")
        assert fields(direct, key)[OWNER_FIELD] == queued_owner("sent-1")  # it ran
        assert queue.llen(f"{name}-queue") == 1
        sent_again_before_its_background_send(job, key, task_id, proxy, direct, queue)
    finally:
        proxy.heal()
        queue.close()
        close_with_its_broker_connections(app)


def frees_sent_ahead_of(key: str) -> int:
    """How many background frees the next acquire of lock key ``key`` in this
    process would send ahead of it."""
    with lock_module._frees_guard:
        return sum(len(by_key.get(key, ())) for by_key in lock_module._frees_pending.values())


@pytest.mark.parametrize("end", ["landed", "given up"])
def test_a_background_free_is_no_longer_sent_ahead_once_its_tries_end(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis, end: str
) -> None:
    """A send fails while the broker and the lock store are unreachable, and the
    free of its reservation goes to the background, to be sent ahead of the next
    acquire of that lock in this process until it lands. Once the heartbeat's
    tries of it end (it landed, or it was given up), it is forgotten: the next
    send of the call sends no spent free ahead, and the frees of an outage are
    not kept in memory."""
    name = f"free-forgotten-{end.replace(' ', '-')}"
    try:
        with store_gone_as_it_publishes(proxy, name) as (job, send_failing):
            key = lock_keys(job.lock_name((1,), {}))[0]
            send_failing((1,), task_id="sent-1")
            assert frees_sent_ahead_of(key) == 1
            if end == "given up":
                lane, free = background_send_about(key)
                with lane.cond:
                    free.until = free.next_try = lane.clock()
                    lane._wake(free.next_try)
            else:
                proxy.heal()
            wait_for(lambda: background_sends_about(key) == [], timeout=10, what="the free")
            # Forgotten as the heartbeat ends its tries: just after it drops the send.
            wait_for(lambda: frees_sent_ahead_of(key) == 0, what="the free to be forgotten")
            if end == "given up":
                assert held(direct, key)
                direct.delete(key)
                proxy.heal()
            else:
                assert not held(direct, key)
    finally:
        proxy.heal()


@pytest.mark.parametrize("task_id", ["the same id", "a new id"])
def test_a_send_made_again_before_a_failed_sends_reservation_is_freed_is_published(
    server: RedisServer, proxy: FaultProxy, direct: redis.Redis, task_id: str
) -> None:
    """A send fails while the broker and the lock store are unreachable, and the
    free of its reservation goes to the background, backing off. The same call,
    sent again from this process once the store answers, before that free has
    gone, is published (under the same task id or another), not deduplicated to
    the message never sent: its acquire sends the free first. The background free,
    tied to the failed reservation's fencing token, then leaves the new
    reservation alone, though under the same id it has the same owner token."""
    name = f"failed-send-again-{task_id.replace(' ', '-')}"
    queue = server.client(db=1, socket_timeout=5)
    with store_gone_as_it_publishes(proxy, name) as (job, send_failing):
        key = lock_keys(job.lock_name((1,), {}))[0]
        send_failing((1,), task_id="sent-1")
        assert held(direct, key)
        sent_again_before_its_background_send(job, key, task_id, proxy, direct, queue)
    queue.close()
