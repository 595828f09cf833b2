"""Tests for the heartbeat: background renewal of held locks, against a real server."""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import LockBackendError, LockLostError, RedisLock
from celery_redislock import client as client_module
from celery_redislock import heartbeat as heartbeat_module
from celery_redislock import lock as lock_module
from celery_redislock.heartbeat import Heartbeat, get_heartbeat
from celery_redislock.scripts import EXTEND, EXTEND_SCRIPT, OWNER_FIELD, Call
from celery_redislock.scripts import run_calls as real_run_calls
from celery_redislock.server import RedisServer, free_port
from celery_redislock.transport import Deadline, Transport, flush, transport_for
from tests.proxy import FaultProxy
from tests.support import field, held, in_forked_child, wait_until

#: Forking a process that runs threads warns on Python >= 3.12; the fork test
#: below does it on purpose, as Celery's prefork pool does.
FORK_WARNING = "ignore:This process .* is multi-threaded:DeprecationWarning"


def stays_true(predicate: Callable[[], bool], seconds: float) -> bool:
    """Check ``predicate`` over and over for ``seconds``; False as soon as it fails once."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not predicate():
            return False
        time.sleep(0.02)
    return predicate()


class LostCalls:
    """An ``on_lost`` callback that records the locks it was called with."""

    def __init__(self) -> None:
        self.locks: list[RedisLock] = []

    def __call__(self, lock: RedisLock) -> None:
        self.locks.append(lock)


class _CountingSocket:
    """A connected socket whose writes are counted in ``sends[0]``."""

    def __init__(self, sock: Any, sends: list[int]) -> None:
        self._sock = sock
        self._sends = sends

    def sendall(self, data: bytes) -> None:
        self._sends[0] += 1
        self._sock.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def counting_client(server: RedisServer) -> tuple[redis.Redis, list[int]]:
    """A client whose connections count the writes they make once connected (one
    per round trip; a pipeline writes all its commands at once)."""
    sends = [0]

    class CountingConnection(redis.Connection):
        def connect(self) -> None:
            super().connect()  # type: ignore[no-untyped-call]
            if not isinstance(self._sock, _CountingSocket):
                self._sock = _CountingSocket(self._sock, sends)  # type: ignore[assignment]

    pool = redis.ConnectionPool(
        host=server.host, port=server.port, connection_class=CountingConnection
    )
    client = redis.Redis(connection_pool=pool)
    return client, sends


@pytest.fixture
def client(redislock_client: redis.Redis) -> redis.Redis:
    """A client to the session server, flushed for this test."""
    return redislock_client


@pytest.fixture
def private_heartbeat() -> Iterator[Heartbeat]:
    """A heartbeat of this test's own, stopped afterwards."""
    heartbeat = Heartbeat()
    yield heartbeat
    heartbeat.stop()


def test_held_lock_outlives_its_ttl(client: redis.Redis) -> None:
    """A lock with a 1 s TTL stays held for 3 s while its owner holds it."""
    lock = RedisLock(client, "kept-alive", ttl=1)
    assert lock.acquire()
    assert lock in get_heartbeat().held()
    assert stays_true(lock.owned, 3.0)
    assert not lock.lost
    assert 0 < client.pttl(lock.key) <= 1000
    lock.release()
    assert lock not in get_heartbeat().held()


def test_release_unregisters(client: redis.Redis) -> None:
    """Only the last release of a re-entrant hold stops the renewal."""
    lock = RedisLock(client, "unregister", ttl=5)
    assert lock.acquire()
    assert lock.acquire()
    lock.release()
    assert lock in get_heartbeat().held()
    lock.release()
    assert lock not in get_heartbeat().held()


def test_heartbeat_off_is_not_registered(client: redis.Redis) -> None:
    """A lock taken with heartbeat=False is never handed to the heartbeat."""
    lock = RedisLock(client, "no-heartbeat", ttl=5, heartbeat=False)
    assert lock.acquire()
    assert lock not in get_heartbeat().held()
    lock.release()


def test_renew_is_one_round_trip_for_many_locks(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """Renewing 50 locks on one server is one pipelined write: 50 EVALSHAs, one round trip."""
    server = redislock_server_factory()
    client, sends = counting_client(server)
    locks = [RedisLock(client, f"many-{i}", ttl=30, heartbeat=False) for i in range(50)]
    for lock in locks:
        assert lock.acquire()
    for lock in locks:
        client.pexpire(lock.key, 5_000)
    heartbeat = Heartbeat()
    heartbeat.renew(locks)  # loads the script once; not counted below

    for lock in locks:
        client.pexpire(lock.key, 5_000)
    evalsha_before = client.info("commandstats")["cmdstat_evalsha"]["calls"]
    rounds_before, sends_before = heartbeat.rounds, sends[0]
    heartbeat.renew(locks)
    rounds_after, sends_after = heartbeat.rounds, sends[0]
    evalsha_after = client.info("commandstats")["cmdstat_evalsha"]["calls"]

    assert sends_after - sends_before == 1
    assert rounds_after - rounds_before == 1
    assert evalsha_after - evalsha_before == 50
    assert all(client.pttl(lock.key) > 5_000 for lock in locks)
    assert not any(lock.lost for lock in locks)
    for lock in locks:
        lock.release()


def test_renew_reloads_flushed_script(client: redis.Redis) -> None:
    """After SCRIPT FLUSH (a restarted server) renewal loads the script again and succeeds."""
    lock = RedisLock(client, "flushed", ttl=30, heartbeat=False)
    assert lock.acquire()
    client.pexpire(lock.key, 5_000)
    client.script_flush()
    Heartbeat().renew([lock])
    assert client.pttl(lock.key) > 5_000
    assert not lock.lost
    lock.release()


def test_renew_groups_by_client(redislock_server_factory: Callable[..., RedisServer]) -> None:
    """Locks on two servers are renewed with one round trip to each."""
    first, second = redislock_server_factory(), redislock_server_factory()
    (client_a, sends_a), (client_b, sends_b) = counting_client(first), counting_client(second)
    locks = [
        RedisLock(client, f"group-{i}", ttl=30, heartbeat=False)
        for client in (client_a, client_b)
        for i in range(10)
    ]
    for lock in locks:
        assert lock.acquire()
    heartbeat = Heartbeat()
    heartbeat.renew(locks)  # script loads
    before = (sends_a[0], sends_b[0], heartbeat.rounds)
    heartbeat.renew(locks)
    assert (sends_a[0] - before[0], sends_b[0] - before[1], heartbeat.rounds - before[2]) == (
        1,
        1,
        1,
    )
    for lock in locks:
        lock.release()


def test_thread_batches_locks_into_rounds(
    redislock_server_factory: Callable[..., RedisServer], private_heartbeat: Heartbeat
) -> None:
    """The background thread keeps 50 short-TTL locks alive with one round trip per round."""
    server = redislock_server_factory()
    client, sends = counting_client(server)
    observer = server.client()
    client.script_load(EXTEND)
    locks = [
        RedisLock(client, f"batch-{i}", ttl=1.5, _heartbeat=private_heartbeat) for i in range(50)
    ]
    for lock in locks:
        assert lock.acquire()
    # The first round is due one interval (0.5 s) after the first registration.
    rounds_before, sends_before = private_heartbeat.rounds, sends[0]
    assert rounds_before == 0

    deadline = time.monotonic() + 30
    while private_heartbeat.rounds < 4 and time.monotonic() < deadline:
        assert observer.exists(*(lock.key for lock in locks)) == 50
        time.sleep(0.02)
    private_heartbeat.stop()  # waits for a round in flight

    rounds = private_heartbeat.rounds - rounds_before
    assert rounds >= 4
    assert sends[0] - sends_before == rounds
    assert observer.exists(*(lock.key for lock in locks)) == 50
    assert not any(lock.lost for lock in locks)
    for lock in locks:
        lock.release()


def test_lost_when_key_deleted(client: redis.Redis, private_heartbeat: Heartbeat) -> None:
    """A lock deleted behind its back is marked lost, reported once and never renewed again."""
    on_lost = LostCalls()
    lock = RedisLock(client, "deleted", ttl=1, on_lost=on_lost, _heartbeat=private_heartbeat)
    keeper = RedisLock(client, "keeper", ttl=1, _heartbeat=private_heartbeat)
    assert lock.acquire()
    assert keeper.acquire()
    client.delete(lock.key)

    assert wait_until(lambda: lock.lost, timeout=5)
    assert on_lost.locks == [lock]
    assert lock not in private_heartbeat.held()
    assert keeper in private_heartbeat.held()
    # A few more rounds (the keeper keeps them coming) change nothing for the lost lock.
    rounds = private_heartbeat.rounds
    assert wait_until(lambda: private_heartbeat.rounds >= rounds + 3, timeout=10)
    assert on_lost.locks == [lock]
    assert not client.exists(lock.key)
    assert keeper.owned()

    with pytest.raises(LockLostError) as excinfo:
        lock.release()
    assert excinfo.value.name == "deleted"
    keeper.release()


def test_lost_when_taken_over(client: redis.Redis, private_heartbeat: Heartbeat) -> None:
    """When the lock is taken over (handed to another owner of its lease in the
    holder's name), the old holder's heartbeat marks it lost; the new holder keeps it."""
    on_lost = LostCalls()
    old = RedisLock(
        client, "taken", ttl=1, lease="task-1", on_lost=on_lost, _heartbeat=private_heartbeat
    )
    assert old.acquire()
    new = RedisLock(client, "taken", ttl=30, lease="task-1", heartbeat=False)
    new._handed_from = old.owner
    assert new.acquire(blocking=False)

    assert wait_until(lambda: old.lost, timeout=5)
    assert on_lost.locks == [old]
    assert old not in private_heartbeat.held()
    assert new.owned()
    new.release()


def test_extend_to_less_than_the_ttl_brings_the_next_renewal_forward(
    client: redis.Redis, private_heartbeat: Heartbeat
) -> None:
    """A lock extended to less than its TTL is renewed before that runs out: the
    heartbeat's next renewal, due a third of the TTL later, does not come too late."""
    lock = RedisLock(client, "shortened", ttl=3, _heartbeat=private_heartbeat)
    assert lock.acquire()
    lock.extend(0.5)
    assert stays_true(lambda: lock.owned() and not lock.lost, 1.5)
    assert client.pttl(lock.key) > 1000  # renewed to the lock's own TTL
    lock.release()


def test_reacquired_after_loss_is_renewed_again(
    client: redis.Redis, private_heartbeat: Heartbeat
) -> None:
    """A lock object that lost its lock and takes it again is renewed again."""
    lock = RedisLock(client, "again", ttl=1, _heartbeat=private_heartbeat)
    assert lock.acquire()
    client.delete(lock.key)
    assert wait_until(lambda: lock.lost, timeout=5)

    assert lock.acquire()

    assert not lock.lost
    assert lock in private_heartbeat.held()
    assert stays_true(lock.owned, 2.5)
    lock.release()


def test_stale_verdict_leaves_the_next_hold_alone(
    client: redis.Redis, private_heartbeat: Heartbeat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal sent for one hold and answered after the same object released it and
    took the lock again is not applied to the new hold: the server's 0 (the renewal
    landed between the release and the acquire) does not mark the new hold lost,
    which stays registered and renewed."""
    sending, released, answered, reacquired = (threading.Event() for _ in range(4))
    armed = [True]
    verdicts: list[list[Any]] = []

    def scripted(
        transport: Transport,
        calls: Sequence[Call],
        deadline: Deadline,
        then: Sequence[Sequence[Any]] = (),
    ) -> list[Any]:
        # Only this test's renewal: other lanes (requests other tests left to be
        # retried in the background) go through as they are.
        if not armed[0] or not any(list(call.keys[:1]) == [key] for call in calls):
            return real_run_calls(transport, calls, deadline, then)
        armed[0] = False
        # The renewal reaches the server after the release, and its verdict is
        # applied after the next acquire.
        sending.set()
        assert released.wait(10)
        results = real_run_calls(transport, calls, deadline, then)
        verdicts.append(results)
        answered.set()
        assert reacquired.wait(10)
        return results

    monkeypatch.setattr(heartbeat_module, "run_calls", scripted)
    on_lost = LostCalls()
    lock = RedisLock(client, "stale-verdict", ttl=1, on_lost=on_lost, _heartbeat=private_heartbeat)
    key = lock.key
    assert lock.acquire()
    assert sending.wait(10)
    lock.release()
    released.set()
    assert answered.wait(10)
    assert lock.acquire(blocking=False)
    reacquired.set()

    assert wait_until(lambda: private_heartbeat.rounds >= 1)
    assert verdicts == [[0]]
    assert not lock.lost
    assert on_lost.locks == []
    assert lock in private_heartbeat.held()
    assert stays_true(lock.owned, 2.5)
    lock.release()


def test_a_round_waits_for_its_answer_no_later_than_the_lanes_next_renewal(
    client: redis.Redis, private_heartbeat: Heartbeat, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round on the lane's thread that renews a long lock only waits for its answer
    no later than another lock on the lane is due, not for the long lock's whole
    renewal interval: an answer that does not come (a connection gone dark) holds
    up no other renewal on that server."""
    deadlines: list[float] = []

    def recorded(transport: Transport, calls: Sequence[Call], deadline: Deadline) -> Any:
        deadlines.append(deadline.at)
        return real_run_calls(transport, calls, deadline)

    monkeypatch.setattr(heartbeat_module, "run_calls", recorded)
    long = RedisLock(client, "round-long", ttl=60, _heartbeat=private_heartbeat)
    short = RedisLock(client, "round-short", ttl=30, _heartbeat=private_heartbeat)
    assert long.acquire()
    assert short.acquire()
    lane = private_heartbeat._lane(long.transport)
    due = time.monotonic() + 1.0
    private_heartbeat.register(short, first=1.0)

    lane.renew(lane.renewals([long]), lane_thread=True)

    assert len(deadlines) == 1
    assert deadlines[0] <= due + 0.05
    assert not long.lost
    short.release()
    long.release()


def test_on_lost_error_does_not_stop_the_round(
    client: redis.Redis, private_heartbeat: Heartbeat, caplog: pytest.LogCaptureFixture
) -> None:
    """An ``on_lost`` callback that raises is logged; the round still renews the other
    locks and completes."""

    def broken(lock: RedisLock) -> None:
        raise RuntimeError("callback bug")

    doomed = RedisLock(client, "doomed", ttl=30, on_lost=broken, _heartbeat=private_heartbeat)
    survivor = RedisLock(client, "survivor", ttl=30, _heartbeat=private_heartbeat)
    assert doomed.acquire()
    assert survivor.acquire()
    client.delete(doomed.key)
    client.pexpire(survivor.key, 5_000)
    rounds = private_heartbeat.rounds

    private_heartbeat.renew([doomed, survivor])

    assert doomed.lost
    assert doomed not in private_heartbeat.held()
    assert client.pttl(survivor.key) > 5_000
    assert survivor in private_heartbeat.held()
    assert private_heartbeat.rounds == rounds + 1
    assert "callback bug" in caplog.text
    survivor.release()


def test_on_lost_raising_system_exit_leaves_the_thread_running(
    client: redis.Redis, private_heartbeat: Heartbeat, caplog: pytest.LogCaptureFixture
) -> None:
    """An ``on_lost`` callback that raises SystemExit (a holder that aborts when its
    lock is lost) is logged, and the heartbeat thread lives on: it keeps renewing
    the other locks on that server past their TTL."""
    on_lost = LostCalls()

    def abort(lock: RedisLock) -> None:
        on_lost(lock)
        raise SystemExit("lock lost, aborting")

    doomed = RedisLock(client, "exit-doomed", ttl=1, on_lost=abort, _heartbeat=private_heartbeat)
    survivor = RedisLock(client, "exit-survivor", ttl=1, _heartbeat=private_heartbeat)
    assert doomed.acquire()
    assert survivor.acquire()
    client.delete(doomed.key)

    assert wait_until(lambda: on_lost.locks == [doomed], timeout=5)
    rounds = private_heartbeat.rounds
    assert wait_until(lambda: private_heartbeat.rounds >= rounds + 3, timeout=10)
    assert stays_true(survivor.owned, 2.5)
    assert not survivor.lost
    assert survivor in private_heartbeat.held()
    assert "lock lost, aborting" in caplog.text
    survivor.release()


def test_reply_handler_raising_system_exit_leaves_the_thread_running(
    client: redis.Redis, private_heartbeat: Heartbeat, caplog: pytest.LogCaptureFixture
) -> None:
    """A handler of a release's deferred answer that raises SystemExit, called from
    the heartbeat thread (which reads the answer), is logged, and the thread lives
    on: it keeps renewing the other locks on that server past their TTL."""
    keeper = RedisLock(client, "exit-keeper", ttl=1, _heartbeat=private_heartbeat)
    released = RedisLock(client, "exit-released", ttl=30, _heartbeat=private_heartbeat)
    assert keeper.acquire()
    assert released.acquire()
    outcomes: list[str] = []

    def abort(outcome: str) -> None:
        outcomes.append(outcome)
        raise SystemExit("release answered, aborting")

    # Nothing else in this thread uses the locks' connections until the answer is
    # read: the heartbeat thread reads it.
    released.release(wait=False, then=abort)
    assert wait_until(lambda: outcomes == ["released"], timeout=5)
    rounds = private_heartbeat.rounds
    assert wait_until(lambda: private_heartbeat.rounds >= rounds + 3, timeout=10)
    assert stays_true(keeper.owned, 2.5)
    assert not keeper.lost
    assert "release answered, aborting" in caplog.text
    keeper.release()


def test_stopped_heartbeat_lets_lock_expire(
    client: redis.Redis, private_heartbeat: Heartbeat
) -> None:
    """With its heartbeat stopped a lock expires by its TTL, a waiter gets it, and the old
    holder's release raises LockLostError."""
    holder = RedisLock(client, "stopped", ttl=1, _heartbeat=private_heartbeat)
    assert holder.acquire()
    private_heartbeat.stop()

    waiter = RedisLock(client, "stopped", ttl=30, heartbeat=False)
    assert waiter.acquire(timeout=15)
    with pytest.raises(LockLostError) as excinfo:
        holder.release()
    assert excinfo.value.name == "stopped"
    assert waiter.owned()
    waiter.release()


def test_stopped_heartbeat_restarted_leaves_earlier_locks_alone(
    client: redis.Redis, private_heartbeat: Heartbeat
) -> None:
    """A lock registered when its heartbeat stopped is not renewed once a later lock
    starts the heartbeat again: it expires by its TTL, while the later lock is kept."""
    earlier = RedisLock(client, "stopped-earlier", ttl=1, _heartbeat=private_heartbeat)
    assert earlier.acquire()
    private_heartbeat.stop()
    assert earlier not in private_heartbeat.held()

    later = RedisLock(client, "stopped-later", ttl=1, _heartbeat=private_heartbeat)
    assert later.acquire()
    assert private_heartbeat.held() == [later]

    assert wait_until(lambda: not held(client, earlier.key), timeout=15)
    assert later.owned()
    assert not later.lost
    with pytest.raises(LockLostError):
        earlier.release()
    later.release()


def _held_on_a_stopped_server(
    server: RedisServer, name: str
) -> tuple[RedisLock, Heartbeat, list[float], LostCalls]:
    """A lock taken on ``server``, which is then stopped; its heartbeat's clock
    runs ``offset[0]`` seconds ahead of the monotonic clock."""
    offset = [0.0]
    heartbeat = Heartbeat(clock=lambda: time.monotonic() + offset[0])
    on_lost = LostCalls()
    lock = RedisLock(
        server.client(retry=Retry(NoBackoff(), 0)),
        name,
        ttl=30,
        on_lost=on_lost,
        _heartbeat=heartbeat,
    )
    assert lock.acquire()
    server.stop()
    return lock, heartbeat, offset, on_lost


def test_unreachable_server_loses_lock_only_after_ttl(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """While Redis is unreachable a lock is kept (retried) until its TTL has passed on the
    client's clock; then it is marked lost, once."""
    lock, heartbeat, offset, on_lost = _held_on_a_stopped_server(
        redislock_server_factory(), "unreachable"
    )
    try:
        heartbeat.renew([lock])
        assert not lock.lost
        assert lock in heartbeat.held()

        offset[0] = 31.0
        heartbeat.renew([lock])
        assert wait_until(lambda: lock.lost)
        assert on_lost.locks == [lock]
        assert lock not in heartbeat.held()
    finally:
        heartbeat.stop()


def test_a_renewal_failing_near_the_deadline_is_retried_no_later_than_the_deadline(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A renewal that fails with less than a retry's pause left before the local
    deadline is due again at the deadline, not after it: on_lost is called when
    the lock is lost, not a retry late."""
    lock, heartbeat, offset, on_lost = _held_on_a_stopped_server(
        redislock_server_factory(), "near-deadline"
    )
    try:
        offset[0] = lock._expires_at() - time.monotonic() - heartbeat_module.RENEW_RETRY / 5
        heartbeat.renew([lock])
        assert not lock.lost
        entry = heartbeat._lane(lock.transport).entries[id(lock)]
        assert entry.due <= lock._expires_at()

        offset[0] += heartbeat_module.RENEW_RETRY / 5
        heartbeat.renew([lock])
        assert on_lost.locks == [lock]
    finally:
        heartbeat.stop()


def test_a_verdict_reached_before_a_new_hold_was_confirmed_leaves_it_alone(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A renewal answered "not held" before an acquire of the same object took
    the lock anew, whose answer is applied only between that acquire's reply and
    its registration, was about the old hold: the new one is not marked lost,
    stays on the heartbeat and is renewed."""
    heartbeat = Heartbeat()
    on_lost = LostCalls()
    lock = RedisLock(client, "verdict-before-hold", ttl=30, on_lost=on_lost, _heartbeat=heartbeat)
    answered, apply = threading.Event(), threading.Event()

    def answer_held_back(*args: Any, **kwargs: Any) -> Any:
        results = real_run_calls(*args, **kwargs)
        answered.set()
        apply.wait(5)
        return results

    try:
        assert lock.acquire()
        lane = heartbeat._lane(lock.transport)
        client.delete(lock.key)  # the old hold is gone (as if evicted)
        monkeypatch.setattr(heartbeat_module, "run_calls", answer_held_back)
        old_round = threading.Thread(target=lane.renew, args=(lane.renewals([lock]),))
        old_round.start()
        assert answered.wait(5)
        monkeypatch.undo()
        register = heartbeat.register

        def verdict_lands_first(renewable: Any, first: float | None = None) -> Any:
            apply.set()
            old_round.join(5)
            return register(renewable, first)

        monkeypatch.setattr(heartbeat, "register", verdict_lands_first)
        assert lock.acquire()  # taken anew: the key was gone
        monkeypatch.undo()
        assert not old_round.is_alive()
        assert not lock.lost
        assert on_lost.locks == []
        assert lock in heartbeat.held()
        heartbeat.renew([lock])
        assert not lock.lost
        assert held(client, lock.key)
    finally:
        apply.set()
        heartbeat.stop()
        lock.release()


def test_concurrent_registration(client: redis.Redis) -> None:
    """Locks taken from many threads at once are all registered and all renewed."""
    locks = [RedisLock(client, f"threaded-{i}", ttl=1) for i in range(20)]
    start = threading.Barrier(len(locks))

    def take(lock: RedisLock) -> None:
        start.wait()
        lock.acquire()

    threads = [threading.Thread(target=take, args=(lock,)) for lock in locks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    held = get_heartbeat().held()
    assert all(lock in held for lock in locks)
    assert stays_true(lambda: all(lock.owned() for lock in locks), 2.5)
    for lock in locks:
        lock.release()


def _forked_child(
    url: str, parent_heartbeat: Heartbeat, parent_client: redis.Redis, conn: Connection
) -> None:
    report: dict[str, Any] = {
        "fresh_heartbeat": get_heartbeat() is not parent_heartbeat,
        "held_in_child": len(get_heartbeat().held()),
        "cached_clients": len(client_module._clients),
    }
    lock = RedisLock(url, "forked", ttl=1)
    report["fresh_client"] = lock.client is not parent_client
    report["acquired"] = lock.acquire(timeout=10)
    report["owner"] = lock.owner
    report["registered"] = lock in get_heartbeat().held()
    conn.send(report)
    if conn.poll(60):
        conn.recv()
    report = {"owned": lock.owned(), "lost": lock.lost}
    lock.release()
    conn.send(report)
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
@pytest.mark.filterwarnings(FORK_WARNING)
def test_forked_child_has_its_own_heartbeat(client: redis.Redis, redislock_url: str) -> None:
    """A forked child starts with a fresh heartbeat and client cache, and its own thread
    keeps the child's lock alive past its TTL."""
    parent_lock = RedisLock(redislock_url, "parent", ttl=30)
    assert parent_lock.acquire()
    parent_heartbeat = get_heartbeat()
    assert parent_lock in parent_heartbeat.held()

    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    process = ctx.Process(
        target=_forked_child,
        args=(redislock_url, parent_heartbeat, parent_lock.client, child_end),
    )
    process.start()
    child_end.close()
    try:
        assert parent_end.poll(30), "the child did not report"
        report = parent_end.recv()
        assert report == {
            "fresh_heartbeat": True,
            "held_in_child": 0,
            "cached_clients": 0,
            "fresh_client": True,
            "acquired": True,
            "owner": report["owner"],
            "registered": True,
        }
        child_owner = report["owner"]
        key = RedisLock(client, "forked", ttl=1).key

        # Seen from the parent, the child's 1 s lock lives on for 3 s.
        assert stays_true(lambda: field(client, key, OWNER_FIELD) == child_owner, 3.0)

        parent_end.send("release")
        assert parent_end.poll(30), "the child did not release"
        assert parent_end.recv() == {"owned": True, "lost": False}
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0
    assert wait_until(lambda: not held(client, key))
    # The parent's own lock and heartbeat are untouched by the child.
    assert parent_lock in get_heartbeat().held()
    assert get_heartbeat() is parent_heartbeat
    assert parent_lock.owned()
    parent_lock.release()


def test_flushed_script_is_sent_by_text_once_per_round(client: redis.Redis) -> None:
    """After SCRIPT FLUSH, renewing many locks sends the script's text once, not once
    per lock: one EVAL, the rest by digest."""
    locks = [RedisLock(client, f"flushed-many-{i}", ttl=30, heartbeat=False) for i in range(20)]
    for lock in locks:
        assert lock.acquire()
    client.script_flush()
    client.config_resetstat()
    Heartbeat().renew(locks)
    stats = client.info("commandstats")
    assert stats["cmdstat_eval"]["calls"] == 1
    assert stats["cmdstat_evalsha"]["calls"] == 20 + 19  # the first try, then the rest again
    assert not any(lock.lost for lock in locks)
    for lock in locks:
        lock.release()


def forked_while_held(
    guard: AbstractContextManager[Any], target: Callable[..., None], *args: Any
) -> Any:
    """:func:`in_forked_child`, forked while another thread holds ``guard``."""
    holding, done = threading.Event(), threading.Event()

    def hold() -> None:
        with guard:
            holding.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert holding.wait(10)
        return in_forked_child(target, *args)
    finally:
        done.set()
        holder.join(10)


def _detach_inherited(lock: RedisLock, conn: Connection) -> None:
    lock.detach()
    conn.send("detached")
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
@pytest.mark.filterwarnings(FORK_WARNING)
def test_lock_inherited_by_a_forked_child_leaves_the_parents_lane_alone(
    client: redis.Redis,
) -> None:
    """A lock registered before a fork and dropped in the child does not touch the
    lane it was registered on: that lane (its thread, its lock, here held by another
    thread at the moment of the fork) is the parent's. The parent keeps renewing it."""
    lock = RedisLock(client, "inherited", ttl=30)
    assert lock.acquire()
    lane = get_heartbeat()._lanes[lock.transport]
    assert forked_while_held(lane.lock, _detach_inherited, lock) == "detached"
    assert lock in get_heartbeat().held()
    lock.release()


def _acquire_in_child(url: str, conn: Connection) -> None:
    lock = RedisLock(url, "taken-in-a-child", ttl=5, heartbeat=False)
    conn.send(lock.acquire(blocking=False))
    lock.release()
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
@pytest.mark.filterwarnings(FORK_WARNING)
def test_a_child_forked_as_a_thread_keeps_the_background_frees_takes_its_locks(
    redislock_url: str,
) -> None:
    """A child forked while a thread of the parent keeps the background frees of
    failed sends (their guard held) takes its own locks: the guard and the frees,
    which the parent sends, are not the child's."""
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    failed = RedisLock(unreachable, "sent-in-an-outage", ttl=5, call_timeout=0.2)
    failed._free_later(time.monotonic() + 1, "freeing after a failed send", fence=1)
    assert lock_module._frees_pending
    assert forked_while_held(lock_module._frees_guard, _acquire_in_child, redislock_url) is True


def _release_inherited(lock: RedisLock, conn: Connection) -> None:
    outcomes: list[str] = []
    lock.release(wait=False, then=outcomes.append)
    deadline = time.monotonic() + 20
    while not outcomes and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.send(outcomes)
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
@pytest.mark.filterwarnings(FORK_WARNING)
def test_release_without_waiting_in_a_forked_child_still_reads_its_answer(
    client: redis.Redis,
) -> None:
    """A lock taken before a fork and released without waiting in the child: the
    child's own heartbeat reads the answer (the parent's lane is not the child's),
    so the outcome is still reported."""
    lock = RedisLock(client, "inherited-release", ttl=30)
    assert lock.acquire()
    assert in_forked_child(_release_inherited, lock) == ["released"]
    assert not held(client, lock.key)
    lock.detach()


def test_renewal_failures_going_on_are_warned_about_once_every_interval(
    redislock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """While renewals keep failing, a lane warns at the first failure, then once every
    RENEW_WARNING_EVERY seconds, counting the failed rounds it did not warn about."""
    now = [0.0]
    lane = Heartbeat(clock=lambda: now[0])._lane(transport_for(redislock_client))
    caplog.set_level("WARNING", logger="celery_redislock")
    for at in (0.0, 1.0, 2.0, heartbeat_module.RENEW_WARNING_EVERY + 0.5):
        now[0] = at
        lane._warn_renewals(3, redis.TimeoutError("stalled"))
    warnings = [r.getMessage() for r in caplog.records if "could not renew" in r.getMessage()]
    assert len(warnings) == 2
    assert "could not renew 3 lock(s)" in warnings[0]
    assert "2 more failed rounds since the last warning" in warnings[1]


def test_a_request_that_a_flush_and_the_lane_both_send_is_logged_once(
    redislock_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A release retried in the background is sent by a flush (as at exit) from the
    calling thread, whatever its next try's time; the lane's thread may send it too
    (it is safe to send twice), and a round of the lane's formed before the flush
    ends quietly: whichever settles it first logs it, and it leaves the lane."""
    direct = redislock_server.client()
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        client = redis.Redis.from_url(proxy.url)
        lock = RedisLock(client, "flush-once", ttl=30, call_timeout=0.5)
        assert lock.acquire(blocking=False)
        proxy.silence_open()
        proxy.refuse()
        with pytest.raises(LockBackendError):
            lock.release()
        lane = get_heartbeat()._lanes[lock.transport]
        with lane.cond:
            [item] = lane.pending
        proxy.heal()
        with caplog.at_level(logging.INFO, logger="celery_redislock"):
            flush()
            assert not held(direct, lock.key)
            assert item.settled
            assert item not in lane.pending
            # A round of the lane's thread that took the request before the flush.
            lane._send_pending([item])
        done = [r for r in caplog.records if "releasing lock 'flush-once': done" in r.getMessage()]
        assert len(done) == 1
        assert item not in lane.pending
        client.close()
    direct.close()


def test_work_handed_to_a_retired_lane_goes_to_the_transports_lane(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane retires with its thread once it has had nothing to do for ``IDLE_EXIT``
    (the next lock of its server makes another). A registration, or a request to send
    in the background, that found it just before lands on the transport's lane made
    anew, whose thread renews it, or sends it, and where a flush at exit looks."""
    monkeypatch.setattr(heartbeat_module, "IDLE_EXIT", 0.1)
    beat = get_heartbeat()
    lock = RedisLock(client, "retired-lane", ttl=30, heartbeat_interval=0.5, heartbeat=False)
    assert lock.acquire()
    transport = lock.transport
    stale = beat.register(lock)
    beat.unregister(lock)
    assert wait_until(lambda: stale.retired and stale.thread is None)
    assert beat._lanes.get(transport) is not stale

    landed = stale.register(lock)
    assert landed is not stale
    assert beat._lanes[transport] is landed
    # Renewals set the key's TTL back to the lock's, 30 s, every 0.5 s.
    client.pexpire(lock.key, 1500)
    assert wait_until(lambda: client.pttl(lock.key) > 1600)
    landed.unregister(lock)

    client.pexpire(lock.key, 1500)
    extend = Call(EXTEND_SCRIPT, [lock.key], [lock.owner, 2000, ""])
    stale.add_pending(extend, time.monotonic() + 5, "extending lock 'retired-lane'", quiet=True)
    assert wait_until(lambda: client.pttl(lock.key) > 1600)
    assert stale.pending == []
    lock.release()
