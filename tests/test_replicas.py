"""min_replicas: an acquire confirmed by replicas (WAIT in the same round trip)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import redis

from celery_redislock import LockBackendError, RedisLock, wakeups
from celery_redislock.scripts import OWNER_FIELD, REQUEST_FIELD, queue_entry
from celery_redislock.server import RedisServer
from celery_redislock.transport import transport_for
from tests.support import (
    REDIS_6_2,
    acquire_in_thread,
    binary_of,
    field,
    held,
    queue_entries,
    wait_for,
)


def primary_and_replica(
    redislock_server_factory: Callable[..., RedisServer], binary: str | None = None
) -> tuple[RedisServer, redis.Redis]:
    """A primary, and a client of its one replica once the replica is linked (the
    primary sends its data at once, not after the 5 s it waits by default for more
    replicas to join the transfer); both of ``binary``, if given."""
    primary = redislock_server_factory(binary, ("--repl-diskless-sync-delay", "0"))
    replica = redislock_server_factory(binary, ("--replicaof", primary.host, str(primary.port)))
    replica_client = replica.client()
    wait_for(
        lambda: replica_client.info("replication").get("master_link_status") == "up",
        what="the replica's link",
    )
    return primary, replica_client


def test_acquire_without_enough_replicas_gives_the_lock_back(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """With fewer replicas than min_replicas, acquire raises naming the shortfall and the
    hold it took on the primary is given back."""
    primary = redislock_server_factory()
    lock = RedisLock(primary.url, "unreplicated", ttl=30, min_replicas=1, replica_timeout=0.2)
    with pytest.raises(LockBackendError) as excinfo:
        lock.acquire(blocking=False)
    assert "only 0 of 1 replica(s) confirmed it" in str(excinfo.value)
    assert not lock.holding
    checker = primary.client()
    wait_for(lambda: not held(checker, lock.key), what="the hold given back")
    checker.close()


def test_acquire_confirmed_by_a_replica_is_on_the_replica(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """With min_replicas=1 and a live replica, acquire returns only once the replica has
    the lock, in the same single round trip."""
    primary, replica_client = primary_and_replica(redislock_server_factory)
    lock = RedisLock(primary.url, "replicated", ttl=30, min_replicas=1)
    assert lock.acquire()  # the script gets cached by this first acquire
    lock.release()
    before = lock.transport.sends
    assert lock.acquire(blocking=False)
    assert lock.transport.sends - before == 1
    assert field(replica_client, lock.key, OWNER_FIELD) == lock.owner
    lock.release()
    replica_client.close()


def test_a_lock_handed_to_a_waiter_is_confirmed_by_replicas(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A release hands the lock to a waiting owner with min_replicas; the waiter does
    not take the handed hold as it is, but confirms it with an acquire that waits for
    the replica, and returns once the replica has it."""
    primary, replica_client = primary_and_replica(redislock_server_factory)
    holder = RedisLock(primary.url, "replicated-handoff", ttl=30)
    assert holder.acquire()
    waiter = RedisLock(primary.url, "replicated-handoff", ttl=30, min_replicas=1)
    got, thread = acquire_in_thread(waiter, 20)
    checker = primary.client()
    wait_for(lambda: checker.zcard(waiter.queue_key) == 1, what="the waiter queued")
    holder.release()
    thread.join(30)
    assert got == [True]
    confirmed = field(replica_client, waiter.key, REQUEST_FIELD)
    assert confirmed is not None
    assert confirmed.isdigit()  # an acquire's request id, not the grant's mark
    assert field(replica_client, waiter.key, OWNER_FIELD) == waiter.owner
    waiter.release()
    checker.close()
    replica_client.close()


@pytest.mark.parametrize(
    ("value", "error"), [(-1, ValueError), (True, TypeError), (1.5, TypeError)]
)
def test_min_replicas_is_checked(value: object, error: type[Exception]) -> None:
    """min_replicas must be a non-negative int; the message names it."""
    with pytest.raises(error) as excinfo:
        RedisLock("redis://127.0.0.1:1/0", "x", min_replicas=value)  # type: ignore[arg-type]
    assert "min_replicas" in str(excinfo.value)


@pytest.mark.parametrize("wait", [True, False], ids=["waited", "not-waited"])
@pytest.mark.parametrize(
    "server", [None, pytest.param(REDIS_6_2, marks=pytest.mark.slow)], ids=["default", REDIS_6_2]
)
def test_a_release_a_replica_refuses_is_sent_again_in_the_background(
    wait: bool,
    server: str | None,
    request: pytest.FixtureRequest,
    redislock_server_factory: Callable[..., RedisServer],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A release that reaches a replica (a primary demoted by a failover answers
    READONLY) may land once the connection reaches the new primary: unlike a
    refusal, it is sent again in the background (here until the lock's local
    deadline, long past for a holder that never took it through this connection:
    one more try, then the heartbeat gives up and says so). A release that waits
    raises; one that does not (a task's) reports it once the answer is read,
    rather than leaving the lock to its TTL. So on Redis 6.2 too, which reports
    the refusal as the error of the script whose write it refused."""
    binary = binary_of(request, server)
    primary, replica_client = primary_and_replica(redislock_server_factory, binary)
    holder = RedisLock(primary.url, "demoted", ttl=30, heartbeat=False)
    assert holder.acquire(blocking=False)
    wait_for(lambda: field(replica_client, holder.key, OWNER_FIELD) == holder.owner)
    # The same holder, seen through a connection to the replica.
    stale = RedisLock(replica_client, "demoted", ttl=30, owner=holder.owner, heartbeat=False)
    outcomes: list[str] = []
    with caplog.at_level(logging.WARNING, logger="celery_redislock"):
        if wait:
            with pytest.raises(LockBackendError) as excinfo:
                stale.release()
            assert "read only replica" in str(excinfo.value)
            assert "retried in the background" in str(excinfo.value)
        else:
            stale._holds = 1  # held, as far as this object knows
            stale.release(wait=False, then=outcomes.append)
            wait_for(lambda: outcomes == ["retrying"], what="the release's answer read")
        wait_for(
            lambda: any(
                "releasing lock 'demoted': gave up" in record.getMessage()
                for record in caplog.records
            ),
            what="the release sent again in the background",
        )
    holder.release()
    replica_client.close()


def test_a_replica_promoted_without_the_last_writes_hands_out_a_higher_token(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A failover to a replica that missed the last writes to a name (Redis
    replicates asynchronously) must not hand out a token the old primary already
    gave: the stale holder and the new one would carry the same token, and a
    resource that refuses only lower tokens would take both writers."""
    primary, replica_client = primary_and_replica(redislock_server_factory)
    name = "promoted-fence"
    first = RedisLock(primary.url, name, ttl=30, heartbeat=False)
    assert first.acquire(blocking=False)
    first.release()
    # The replica has the name's counter as it is now...
    wait_for(
        lambda: field(replica_client, first.key, "f") == str(first.token),
        what="the free lock on the replica",
    )
    # ...and is promoted (a failover) before it gets what the old primary does next.
    replica_client.replicaof("NO", "ONE")
    stale = RedisLock(primary.url, name, ttl=30, heartbeat=False)
    assert stale.acquire(blocking=False)  # the write the promoted replica missed
    fresh = RedisLock(replica_client, name, ttl=30, heartbeat=False)
    assert fresh.acquire(blocking=False)
    assert stale.token is not None
    assert fresh.token is not None
    assert fresh.token > stale.token
    fresh.release()
    stale.release()
    replica_client.close()


def test_an_acquire_right_after_one_replicas_did_not_confirm_is_not_taken_unconfirmed(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """An acquire that replicas did not confirm gives its hold back before it
    raises: the caller's next try (at once, as a retry loop makes it) finds no hold
    of its own to re-enter, so it too waits for the replicas and raises, rather
    than return True for a hold no replica has (and count one hold where the
    server counts two, which its release would leave behind)."""
    primary = redislock_server_factory()
    lock = RedisLock(
        primary.url, "unreplicated-again", ttl=30, min_replicas=1, replica_timeout=0.05
    )
    with pytest.raises(LockBackendError):
        lock.acquire(blocking=False)
    with pytest.raises(LockBackendError):
        lock.acquire(blocking=False)
    checker = primary.client()
    wait_for(lambda: not held(checker, lock.key), what="the hold given back")
    checker.close()


def test_a_waiter_the_primary_counts_no_subscription_for_is_passed_over_once(
    redislock_server_factory: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter whose process's wake-up subscription is on a replica (as a server that
    switched under its address could leave it) is passed over by the release, as if
    its process had died: the primary counts no subscriber on its channel. The
    release's message to it reaches it through the replica all the same: it asks
    again at once, its process's entries no longer ask to be checked, and it takes
    the lock as soon as the one handed it instead lets it go."""
    primary, replica_client = primary_and_replica(redislock_server_factory)
    holder = RedisLock(primary.url, "unseen", ttl=30)
    assert holder.acquire()
    waiter = RedisLock(primary.url, "unseen", ttl=30)
    hub = wakeups.WakeHub(transport_for(replica_client), waiter.prefix)
    monkeypatch.setitem(wakeups._hubs, (waiter.transport, waiter.prefix), hub)
    got, thread = acquire_in_thread(waiter, 20)
    checker = primary.client()
    wait_for(lambda: checker.zcard(waiter.queue_key) == 1, what="the waiter queued")
    [(entry, score)] = queue_entries(checker, waiter.queue_key)
    assert entry.endswith(b",1]")
    # Queued behind it: a waiter of a process elsewhere, gone, with a 0.3 s TTL.
    checker.zadd(
        waiter.queue_key, {queue_entry("elsewhere.1", "other-owner", 300, "", ""): score + 1}
    )
    holder.release()
    assert field(checker, waiter.key, OWNER_FIELD) == "other-owner"
    wait_for(lambda: hub.unseen, what="the message to reach the waiter")
    thread.join(20)
    assert got == [True]
    assert waiter.owned()
    waiter.release()
    checker.close()
    replica_client.close()
