"""Tests for the lock engine (RedisLock) against a real server."""

from __future__ import annotations

import gc
import itertools
import json
import multiprocessing
import os
import queue
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, cast

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from celery_redislock import (
    LockBackendError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
    RedisLock,
    scripts,
    wakeups,
)
from celery_redislock import lock as lock_module
from celery_redislock.heartbeat import get_heartbeat
from celery_redislock.ids import REQUEST_ID_DIGITS, request_id
from celery_redislock.lock import FENCE_TTL_MS, lock_keys, name_from_key, release_lease
from celery_redislock.scripts import (
    COUNT_FIELD,
    FENCE_FIELD,
    FIELDS,
    GRANT_MARK,
    GRANT_MS,
    GRANTED_TO,
    HOLDER_FIELDS,
    LEASE_FIELD,
    OWNER_FIELD,
    QUEUED_FIELD,
    RELEASE_LEASE_SCRIPT,
    RELEASE_SCRIPT,
    RELEASED_FIELD,
    RELEASES_REMEMBERED,
    REQUEST_FIELD,
    RESERVATION_SUFFIX,
    RESERVED_FIELD,
    SEPARATOR,
    SPARE_MARK,
    UNDO_MARK,
    UNDONE_MARK,
    UNDONE_REMEMBERED,
    Acquired,
    Call,
    Released,
    queue_entry,
)
from celery_redislock.server import RedisServer, available_server_binaries, free_port
from tests.proxy import FaultProxy
from tests.support import (
    REDIS_6_2,
    acquire_in_thread,
    field,
    fields,
    handed_to_a_waiter,
    hold_count,
    queue_entries,
    server_of,
    up_for_anyone,
    wait_until,
    write_fields,
)
from tests.support import lock_keys as lock_keys_held

#: Names that exercise the ``{hash tag}`` rules and unusual characters.
TRICKY_NAMES = [
    "plain",
    "a{b}c",
    "}x{",
    "}",
    "{",
    "{}",
    "}}{{",
    "\\",
    "\\}x",
    "a:b:c",
    "with space",
    "new\nline",
    "ünïcødé ✓",
    "x" * 300,
]


def nobody_queued(client: redis.Redis, lock: RedisLock) -> bool:
    """Whether the lock's waiter queue is empty (its key gone)."""
    return not client.exists(lock.queue_key)


def queued(client: redis.Redis, lock: RedisLock) -> int:
    """How many waiters are queued for the lock."""
    return int(client.zcard(lock.queue_key))


def held(client: redis.Redis, lock: RedisLock) -> bool:
    """Whether the lock is held (its key has an owner)."""
    return OWNER_FIELD in stored(client, lock)


def stored(client: redis.Redis, lock: RedisLock) -> dict[str, str]:
    """The lock's non-empty fields, by stored name."""
    return fields(client, lock.key)


def evalsha_calls(client: redis.Redis) -> int:
    """Scripts the server ran by digest since its statistics were last reset."""
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


class Waiter:
    """Runs ``lock.acquire(timeout=...)`` in a thread and keeps the outcome."""

    def __init__(self, lock: RedisLock, timeout: float | None) -> None:
        self.lock = lock
        self.result: bool | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(timeout,), daemon=True)
        self.thread.start()

    def _run(self, timeout: float | None) -> None:
        try:
            self.result = self.lock.acquire(blocking=True, timeout=timeout)
        except BaseException as exc:
            self.error = exc

    def done(self) -> bool:
        return not self.thread.is_alive()


def wait_behind(
    holder: RedisLock, cleanup: list[RedisLock], ttl: float = 60, timeout: float = 30
) -> tuple[RedisLock, Waiter]:
    """Another owner of ``holder``'s lock, waiting for it in a thread (cleaned up after)."""
    waiter_lock = RedisLock(holder.client, holder.name, ttl=ttl)
    cleanup.append(waiter_lock)
    return waiter_lock, Waiter(waiter_lock, timeout=timeout)


def held_ahead_of_a_gone_waiter(
    client: redis.Redis, name: str, gone_ttl_ms: int = 60_000
) -> RedisLock:
    """Lock ``name``, held, with the queue entry of a waiter whose process is gone
    (with a TTL of ``gone_ttl_ms``) first in its queue: an entry that does not ask a
    release to check its process (a cluster's, say), which is handed the lock."""
    holder = RedisLock(client, name, ttl=60)
    assert holder.acquire()
    gone = scripts.queue_entry("gone-process.1", "gone-owner", gone_ttl_ms, "", "")
    client.zadd(holder.queue_key, {gone: 1})
    write_fields(client, holder.key, q="1")
    return holder


@pytest.fixture(
    scope="module",
    params=[*available_server_binaries(), pytest.param(REDIS_6_2, marks=pytest.mark.slow)],
    ids=lambda path: os.path.basename(path),
)
def redislock_server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    """The engine's tests run once on each server binary the machine offers (Redis,
    Valkey), and on Redis 6.2, the oldest release the package supports."""
    with server_of(request) as server:
        yield server


def checks_processes(client: redis.Redis) -> bool:
    """Whether a release on the server of ``client`` can tell that a queued waiter's
    process has died: scripts check the ACL first (``redis.acl_check_cmd``) from
    Redis 7 on (and on Valkey, which reports a Redis version of 7.2)."""
    return int(str(client.info("server")["redis_version"]).split(".")[0]) >= 7


@pytest.fixture(scope="module")
def redislock_url(redislock_server: RedisServer) -> str:
    """This module's server's URL."""
    return redislock_server.url


@pytest.fixture
def client(redislock_client: redis.Redis) -> redis.Redis:
    """A client to the session server, flushed for this test."""
    return redislock_client


@pytest.fixture
def cleanup() -> Iterator[list[RedisLock]]:
    """Locks appended here are released (if still held) after the test."""
    locks: list[RedisLock] = []
    yield locks
    for lock in locks:
        while True:
            try:
                lock.release()
            except LockError:
                break


# Atomic acquire, one round trip each way.


def test_acquire_sets_ttl_atomically(client: redis.Redis) -> None:
    """Right after acquire the lock key already carries its TTL (set in the same script)."""
    lock = RedisLock(client, "ttl", ttl=30)
    assert lock.acquire(blocking=False)
    pttl = client.pttl(lock.key)
    assert 0 < pttl <= 30_000
    values = stored(client, lock)
    request = values.pop(REQUEST_FIELD)
    assert values == {OWNER_FIELD: lock.owner, FENCE_FIELD: str(lock.token)}
    assert len(request) == REQUEST_ID_DIGITS  # the id of the request that took it
    lock.release()


def test_held_plain_lock_stores_three_fields(client: redis.Redis) -> None:
    """A held plain lock stores only its owner, fence and request id (no empty lease, no
    count of one), also where an earlier holder left a lease, a count and a holder's
    description: what that holder wrote is emptied, not kept."""
    lock = RedisLock(client, "three-fields", ttl=30)
    assert lock.acquire(blocking=False)
    assert set(stored(client, lock)) == {OWNER_FIELD, FENCE_FIELD, REQUEST_FIELD}
    lock.release()

    earlier = RedisLock(
        client, "three-fields", ttl=30, lease="task-1", holder_info={"task": "proj.job"}
    )
    with earlier, earlier:
        assert stored(client, earlier)[COUNT_FIELD] == "2"
        assert stored(client, earlier)[LEASE_FIELD] == "task-1"
    with lock:
        # Besides the hold, only the recent releases (for retried releases) are kept.
        assert set(stored(client, lock)) == {
            OWNER_FIELD,
            FENCE_FIELD,
            REQUEST_FIELD,
            RELEASED_FIELD,
        }
        assert lock.holder_lease() is None


def test_held_plain_lock_value_is_smaller_than_with_wider_ids(client: redis.Redis) -> None:
    """The owner token (12 characters) and the request id (10 digits) keep a held
    lock's value short enough to share one allocation with its object, and so
    smaller than the same fields with a 22-character owner token and a request id
    of 16 hex digits.

    Each is measured on five fresh keys and the least is kept: a server built
    with the C library's allocator (the Valkey wheel's) may give a key's
    allocations more room than they asked for, depending on what it freed
    before, never less."""
    held: list[int] = []
    same_fields: list[int] = []
    for attempt in range(5):
        lock = RedisLock(client, f"small-value-{attempt}", ttl=30)
        assert lock.acquire(blocking=False)
        other = lock.key[:-2] + "X}"  # a key name of the same length
        client.set(other, "o" * 22, px=30_000)
        write_fields(client, other, f=stored(client, lock)[FENCE_FIELD], r="a" * 16)
        try:
            for key, sizes in ((lock.key, held), (other, same_fields)):
                size = client.memory_usage(key, samples=0)
                assert size is not None
                sizes.append(size)
        finally:
            client.delete(other)
            lock.release()
    assert min(held) < min(same_fields)


def _server_counters(client: redis.Redis) -> tuple[int, int]:
    """(socket reads the server processed, EVALSHA calls) so far; the INFO calls
    that read them cost one read each."""
    reads = client.info("stats")["total_reads_processed"]
    evalsha = client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    return int(reads), int(evalsha)


@pytest.mark.parametrize("heartbeat", [False, True], ids=["heartbeat-off", "heartbeat-on"])
def test_acquire_release_is_two_round_trips(
    heartbeat: bool, redislock_server_factory: Callable[..., RedisServer]
) -> None:
    """Uncontended acquire + release costs two requests to the server, both EVALSHA."""
    server = redislock_server_factory()
    client = server.client()
    lock = RedisLock(client, "round-trips", ttl=60, heartbeat=heartbeat)
    # Warm up: open the connection and load the scripts.
    assert lock.acquire()
    lock.release()

    # What measuring alone costs (the two INFO calls).
    reads_0, evalsha_0 = _server_counters(client)
    reads_1, evalsha_1 = _server_counters(client)
    assert lock.acquire()
    lock.release()
    reads_2, evalsha_2 = _server_counters(client)

    measuring = reads_1 - reads_0
    assert reads_2 - reads_1 - measuring == 2
    assert evalsha_2 - evalsha_1 == 2
    assert evalsha_1 == evalsha_0


@pytest.mark.parametrize("used", [False, True], ids=["new-name", "used-name"])
def test_acquire_release_runs_at_most_six_server_commands(client: redis.Redis, used: bool) -> None:
    """An uncontended acquire + release costs the server 6 commands counting the two
    EVALSHAs (GET, TIME for its fence, SET; then one SET), whether or not the name
    was used before: a counter left by an earlier hold is not trusted to be ahead of
    every token handed out (a replica promoted without the last writes)."""
    info = {"task": "proj.job", "state": "running", "node": "w1", "pid": "7", "since": "1.5"}
    lock = RedisLock(client, f"commands-{used}", ttl=30, heartbeat=False, holder_info=info)
    with lock:  # also loads the scripts
        pass
    if not used:
        client.delete(lock.key)
    client.config_resetstat()
    with lock:
        pass
    stats = client.info("commandstats")
    calls = {
        name.removeprefix("cmdstat_"): int(stat["calls"])
        for name, stat in stats.items()
        if not name.startswith("cmdstat_config")
    }
    assert calls == {"evalsha": 2, "get": 1, "time": 1, "set": 2}
    assert sum(calls.values()) == 6


# Owner tokens and ownership.


def test_owner_tokens_are_random_72_bits(client: redis.Redis) -> None:
    """Default owners are 72 random bits in 12 URL-safe characters, and never repeat."""
    owners = {RedisLock(client, "owners", ttl=5).owner for _ in range(1000)}
    assert len(owners) == 1000
    assert all(re.fullmatch(r"[A-Za-z0-9_-]{12}", owner) for owner in owners)


def test_explicit_owner_is_kept(client: redis.Redis) -> None:
    """An owner given by the caller is used as it is."""
    assert RedisLock(client, "owners", ttl=5, owner="task-1:abc").owner == "task-1:abc"


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"owner": "a\x1fb"}, "owner"),
        ({"lease": "task\x1f1"}, "lease"),
        ({"holder_info": {"task": "proj.\x1fjob"}}, "holder_info['task']"),
    ],
)
def test_a_value_with_the_field_separator_is_refused(
    client: redis.Redis, options: dict[str, Any], named: str
) -> None:
    """An owner token, lease or holder description containing the separator of a
    lock's stored fields is refused when the lock is made, naming it."""
    with pytest.raises(ValueError, match=re.escape(named)):
        RedisLock(client, "separated", ttl=5, **options)


def test_a_string_another_program_wrote_in_a_locks_key_is_reported_and_left_alone(
    client: redis.Redis,
) -> None:
    """A lock key holding a string that is no lock of this version (a ``SET`` by a
    cron job, without expiry) is not taken for a lock held forever: an acquire,
    one that would wait included, says what it found and what to do, and writes
    nothing there (no queued flag, and still no expiry it could keep)."""
    lock = RedisLock(client, "written-by-cron", ttl=5)
    client.set(lock.key, "locked-by-cron")
    with pytest.raises(LockBackendError, match="not a lock") as excinfo:
        lock.acquire(blocking=False)
    assert "delete the key" in str(excinfo.value)
    with pytest.raises(LockBackendError, match="not a lock"):
        lock.acquire(timeout=1)
    assert client.get(lock.key) == b"locked-by-cron"
    assert client.pttl(lock.key) == -1
    assert not client.exists(lock.queue_key)
    client.delete(lock.key)
    assert lock.acquire(blocking=False)
    lock.release()


def test_a_key_of_another_layout_is_reported_with_what_to_do(client: redis.Redis) -> None:
    """A lock key written by a version with another storage layout (a hash) is left
    as it is, and an acquire says what it is and what to do; so does a renewal
    that finds one in place of the lock it holds."""
    lock = RedisLock(client, "older-layout", ttl=5)
    client.hset(lock.key, OWNER_FIELD, "someone")
    client.pexpire(lock.key, 5000)
    with pytest.raises(LockBackendError, match="not a lock of this version") as excinfo:
        lock.acquire(blocking=False)
    assert "stop the workers of other versions" in str(excinfo.value)
    assert client.hget(lock.key, OWNER_FIELD) == b"someone"
    client.delete(lock.key)

    holder = RedisLock(client, "older-layout-renewed", ttl=5, heartbeat=False)
    assert holder.acquire(blocking=False)
    client.delete(holder.key)
    client.hset(holder.key, OWNER_FIELD, holder.owner)
    client.pexpire(holder.key, 5000)
    with pytest.raises(LockBackendError, match="not a lock of this version"):
        holder.extend()
    assert client.hget(holder.key, OWNER_FIELD) == holder.owner.encode()
    assert 0 < client.pttl(holder.key) <= 5000
    client.delete(holder.key)


def test_release_by_non_owner_raises_and_deletes_nothing(client: redis.Redis) -> None:
    """Releasing another owner's lock raises LockNotOwnedError and leaves that lock intact."""
    holder = RedisLock(client, "not-mine", ttl=30)
    other = RedisLock(client, "not-mine", ttl=30)
    assert holder.acquire(blocking=False)
    before = client.get(holder.key)

    with pytest.raises(LockNotOwnedError) as excinfo:
        other.release()

    assert type(excinfo.value) is LockNotOwnedError  # never held, so not "lost"
    assert excinfo.value.name == "not-mine"
    assert client.get(holder.key) == before
    assert holder.owned()
    holder.release()


def test_release_of_free_lock_raises(client: redis.Redis) -> None:
    """Releasing a lock nobody holds raises LockNotOwnedError."""
    lock = RedisLock(client, "free", ttl=5)
    with pytest.raises(LockNotOwnedError) as excinfo:
        lock.release()
    assert type(excinfo.value) is LockNotOwnedError


def test_extend_by_non_owner_raises(client: redis.Redis) -> None:
    """Extending another owner's lock raises LockNotOwnedError and keeps its TTL."""
    holder = RedisLock(client, "extend-not-mine", ttl=5)
    assert holder.acquire()
    other = RedisLock(client, "extend-not-mine", ttl=5)
    with pytest.raises(LockNotOwnedError) as excinfo:
        other.extend(100)
    assert type(excinfo.value) is LockNotOwnedError
    assert client.pttl(holder.key) <= 5_000
    holder.release()


def test_an_owner_token_the_holders_begins_with_is_another_owner(client: redis.Redis) -> None:
    """Owner tokens are compared whole: a token that the holder's begins with
    neither renews nor frees its lock."""
    holder = RedisLock(client, "prefixed-owner", ttl=5, owner="worker-12")
    other = RedisLock(client, "prefixed-owner", ttl=5, owner="worker-1")
    assert holder.acquire(blocking=False)
    with pytest.raises(LockNotOwnedError):
        other.extend(100)
    with pytest.raises(LockNotOwnedError):
        other.release()
    assert holder.owned()
    assert client.pttl(holder.key) > 1_000
    holder.release()


def test_a_hold_of_the_same_owner_with_another_fencing_token_is_not_extended(
    client: redis.Redis,
) -> None:
    """``extend()`` and the heartbeat's renewal extend only the hold with the
    object's fencing token: a hold of its owner with another one (a copy of an
    earlier hold, on a primary promoted after the holder took the lock anew on
    the old one) is left as it is, and the object finds its hold lost. An object
    of the same owner that holds nothing extends whatever hold the owner has."""
    lock = RedisLock(client, "extend-other-token", ttl=5, heartbeat=False)
    renewed = RedisLock(client, "renew-other-token", ttl=5)
    assert lock.acquire(blocking=False)
    assert renewed.acquire(blocking=False)
    for held in (lock, renewed):
        write_fields(client, held.key, **{FENCE_FIELD: str(cast(int, held.token) - 1)})
    with pytest.raises(LockLostError):
        lock.extend(100)
    assert client.pttl(lock.key) <= 5_000
    get_heartbeat().renew([renewed])
    assert renewed.lost
    assert client.pttl(renewed.key) <= 5_000
    same_owner = RedisLock(client, lock.name, ttl=5, owner=lock.owner, heartbeat=False)
    same_owner.extend(100)
    assert client.pttl(lock.key) > 5_000
    same_owner.release()
    client.delete(renewed.key)


def test_release_lease_with_a_fencing_token_frees_only_that_hold(client: redis.Redis) -> None:
    """``RELEASE_LEASE`` says which hold it freed (its fencing token); sent again
    with it (to a primary promoted since), it leaves a later hold of the same
    lease alone, and frees the hold of that token."""
    first = RedisLock(client, "lease-token", ttl=5, lease="task-a", heartbeat=False)
    assert first.acquire(blocking=False)
    token = cast(int, first.token)
    key, queue = lock_keys(first.name)
    args: list[str | int] = ["task-a", lock_module.wake_channel_prefix(), request_id()]
    args += [FENCE_TTL_MS, token]
    write_fields(client, key, **{FENCE_FIELD: str(token + 1)})  # a later hold
    assert client.eval(RELEASE_LEASE_SCRIPT.text, 2, key, queue, *args) == 0
    assert fields(client, key).get(OWNER_FIELD) == first.owner
    write_fields(client, key, **{FENCE_FIELD: str(token)})
    reply = client.eval(RELEASE_LEASE_SCRIPT.text, 2, key, queue, *args)
    assert reply == [1, str(token).encode()]
    assert OWNER_FIELD not in fields(client, key)


def test_extend_resets_ttl(client: redis.Redis) -> None:
    """extend() sets the remaining TTL (default: the lock's TTL; or the given one)."""
    lock = RedisLock(client, "extend", ttl=5, heartbeat=False)
    assert lock.acquire()
    lock.extend(100)
    assert 5_000 < client.pttl(lock.key) <= 100_000
    lock.extend()
    assert client.pttl(lock.key) <= 5_000
    lock.release()


def test_a_renewal_answered_after_a_shorter_extend_keeps_the_extends_deadline(
    client: redis.Redis,
) -> None:
    """A renewal sent before ``extend()`` with a shorter TTL, whose answer the
    heartbeat reads only after the extend returned, may have landed before it: the
    server then expires the lock by the extend's TTL, and so does the local
    deadline (which ``lost`` trusts when the server cannot be asked)."""
    lock = RedisLock(client, "extend-race", ttl=30, heartbeat=False)
    assert lock.acquire()
    renewal_sent = time.monotonic()
    lock.extend(1)
    deadline = lock._expiry

    lock._renewed(renewal_sent)  # the heartbeat's verdict on the earlier renewal

    assert lock._expiry == deadline
    assert client.pttl(lock.key) <= 1_000
    lock._renewed(time.monotonic())  # a renewal sent after it moves it on
    assert lock._expiry > deadline + 20
    lock.release()


def test_a_renewal_landing_before_a_slower_shorter_extend_does_not_outlast_it(
    redislock_server: RedisServer,
) -> None:
    """A renewal sent after ``extend()`` with a shorter TTL was sent, but before it
    was answered, may land on the server first (the extend's request was slower to
    arrive): the server then expires the lock by the extend's TTL, and so does the
    local deadline, however late the renewal's answer is read. Otherwise a holder cut
    off then would trust a lock another owner holds."""
    name = "extend-overtaken"
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        holder = RedisLock(proxy.url, name, ttl=30, heartbeat=False)
        assert holder.acquire(blocking=False)
        holder.extend()  # its script is loaded before the latency starts
        # What the heartbeat's renewal does on the server, on a faster path.
        renewal = RedisLock(redislock_server.url, name, ttl=30, owner=holder.owner, heartbeat=False)
        renewal_sent: list[float] = []

        def renew_while_the_extend_travels() -> None:
            time.sleep(0.1)
            renewal_sent.append(time.monotonic())
            renewal.extend()

        # (A second on the way: the renewal, sent 0.1 s after it, lands first however
        # slow the thread is to start.)
        proxy.set_latency(1.0)
        renewer = threading.Thread(target=renew_while_the_extend_travels)
        renewer.start()
        holder.extend(1)
        renewer.join(5)
        proxy.set_latency(0)
        deadline = holder._expiry
        direct = redislock_server.client()
        assert direct.pttl(holder.key) <= 1_000  # the extend landed last

        holder._renewed(renewal_sent[0])  # the heartbeat's verdict, read after the extend's

        assert holder._expiry <= deadline
        rival = RedisLock(direct, name, ttl=5, heartbeat=False)
        assert wait_until(lambda: rival.acquire(blocking=False), timeout=5)
        assert holder.lost
        rival.release()
        holder.detach()
        direct.close()


def test_locked_owned_and_holder_lease(client: redis.Redis) -> None:
    """locked() sees any holder, owned() only this owner, holder_lease() the holder's lease."""
    mine = RedisLock(client, "query", ttl=5, lease="task-9")
    other = RedisLock(client, "query", ttl=5)
    assert not mine.locked()
    assert not mine.owned()
    assert mine.holder_lease() is None
    assert mine.acquire()
    assert mine.locked()
    assert other.locked()
    assert mine.owned()
    assert not other.owned()
    assert other.holder_lease() == "task-9"
    mine.release()
    assert not other.locked()


# Re-entrancy and thread independence.


def test_reentrant_same_object(client: redis.Redis) -> None:
    """The same object acquires twice; only the second release frees the lock."""
    lock = RedisLock(client, "reentrant", ttl=30)
    assert lock.acquire(blocking=False)
    token = lock.token
    assert lock.acquire(blocking=False)
    assert lock.token == token
    lock.release()
    assert lock.owned()
    assert field(client, lock.key, COUNT_FIELD) is None  # one hold: no count stored
    lock.release()
    assert not lock.locked()


def test_reentrant_same_owner_other_object(client: redis.Redis) -> None:
    """A second object with the same ``owner=`` is the same holder: re-entrant, same token."""
    first = RedisLock(client, "reentrant-owner", ttl=30, owner="job-1")
    second = RedisLock(client, "reentrant-owner", ttl=30, owner="job-1")
    assert first.acquire(blocking=False)
    assert second.acquire(blocking=False)
    assert second.token == first.token
    second.release()
    assert first.owned()
    first.release()
    assert not first.locked()


def test_inner_release_after_another_object_of_the_same_owner_changed_the_hold(
    client: redis.Redis,
) -> None:
    """An inner release drops its hold even when another object of the same owner
    changed the hold after this one last did."""
    first = RedisLock(client, "same-owner-inner", ttl=30, owner="job-2")
    second = RedisLock(client, "same-owner-inner", ttl=30, owner="job-2")
    assert first.acquire(blocking=False)
    assert first.acquire(blocking=False)
    assert second.acquire(blocking=False)
    second.release()
    first.release()
    assert first.holding
    assert not first.lost
    assert hold_count(client, first.key) == 1
    first.release()
    assert not first.locked()


def test_hold_taken_again_while_the_last_release_goes_is_renewed(client: redis.Redis) -> None:
    """Another thread sharing the object takes the lock again while what was its last
    hold's release is on its way (off the heartbeat): the hold left is renewed."""
    lock = RedisLock(client, "again-while-releasing", ttl=1)
    assert lock.acquire(blocking=False)
    run = lock._run

    def reenter_first(call: Any, deadline: Any, then: Any = (), before: Any = ()) -> Any:
        if getattr(call, "script", None) is RELEASE_SCRIPT:
            other = threading.Thread(target=lambda: lock.acquire(blocking=False))
            other.start()
            other.join(10)
        return run(call, deadline, then, before)

    lock._run = reenter_first  # type: ignore[method-assign]
    lock.release()
    lock._run = run  # type: ignore[method-assign]
    assert lock.holding
    assert lock in get_heartbeat().held()
    time.sleep(1.5)
    assert lock.owned()
    lock.release()


def test_extend_of_a_lock_not_held_puts_nothing_on_the_heartbeat(client: redis.Redis) -> None:
    """extend() to less than the TTL re-registers only a hold this object has: after
    detach(), the lock is not renewed, and expires by its TTL."""
    lock = RedisLock(client, "extend-detached", ttl=3)
    assert lock.acquire(blocking=False)
    lock.detach()
    lock.extend(0.5)
    assert lock not in get_heartbeat().held()
    assert wait_until(lambda: not lock.locked(), timeout=5)


def test_reentrant_with_statement(client: redis.Redis) -> None:
    """Nested ``with`` blocks on one lock hold it until the outer block ends."""
    lock = RedisLock(client, "nested", ttl=30)
    with lock:
        with lock:
            assert field(client, lock.key, COUNT_FIELD) == "2"
        assert lock.owned()
    assert not lock.locked()


def test_another_thread_can_release(client: redis.Redis) -> None:
    """Ownership belongs to the owner token, not the thread: any thread may release."""
    lock = RedisLock(client, "cross-thread", ttl=30)
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(lock.acquire(timeout=10)))
    thread.start()
    thread.join(10)
    assert results == [True]
    assert lock.owned()
    lock.release()
    assert not lock.locked()


# Lease takeover.


def test_lease_takeover(client: redis.Redis, cleanup: list[RedisLock]) -> None:
    """A hold reserved for a lease (owner ``<lease>:queued``) is taken over by another
    owner of the lease with a larger token; the old owner's release raises
    LockLostError (a LockNotOwnedError) and frees nothing."""
    old = RedisLock(client, "lease", ttl=30, owner="task-1" + RESERVATION_SUFFIX, lease="task-1")
    assert old.acquire(blocking=False)
    new = RedisLock(client, "lease", ttl=30, lease="task-1")
    cleanup.append(new)
    assert new.acquire(blocking=False)
    assert old.token is not None
    assert new.token is not None
    assert new.token > old.token

    with pytest.raises(LockNotOwnedError) as excinfo:
        old.release()

    assert isinstance(excinfo.value, LockLostError)
    assert old.lost
    assert new.owned()
    assert new.holder_lease() == "task-1"
    assert field(client, new.key, FENCE_FIELD) == str(new.token)


def test_two_owners_of_one_lease_exclude_each_other(client: redis.Redis) -> None:
    """Two owners of the same lease, neither its reservation, exclude each other like
    any two owners: a message delivered twice never holds its lock twice at once."""
    first = RedisLock(client, "lease-twice", ttl=30, lease="task-1")
    assert first.acquire(blocking=False)
    second = RedisLock(client, "lease-twice", ttl=30, lease="task-1")

    assert not second.acquire(blocking=False)

    assert second.blocked_by == "task-1"
    assert first.owned()
    first.release()
    assert second.acquire(blocking=False)
    second.release()


def test_a_hold_is_handed_over_only_in_its_holders_name(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A hold of a lease goes to another owner of it (the reservation a task hands
    its lock to as it sends its own retry) only if the acquire names the holder's
    owner token; the lease's next owner takes it from the reservation."""
    running = RedisLock(client, "handed", ttl=30, lease="task-1", holder_info={"state": "running"})
    assert running.acquire(blocking=False)
    owner = "task-1" + RESERVATION_SUFFIX
    reservation = RedisLock(
        client, "handed", ttl=30, owner=owner, lease="task-1", holder_info={"state": "queued"}
    )
    cleanup += [running, reservation]
    assert not reservation.acquire(blocking=False)
    reservation._handed_from = "somebody-else"
    assert not reservation.acquire(blocking=False)
    other_lease = RedisLock(client, "handed", ttl=30, lease="task-2", holder_info={"state": "x"})
    other_lease._handed_from = running.owner
    assert not other_lease.acquire(blocking=False)
    assert running.owned()

    reservation._handed_from = running.owner
    assert reservation.acquire(blocking=False)

    assert not running.owned()
    retry = RedisLock(client, "handed", ttl=30, lease="task-1")
    cleanup.append(retry)
    assert retry.acquire(blocking=False)
    assert not reservation.owned()
    assert not RedisLock(client, "handed", ttl=30, lease="task-2").acquire(blocking=False)


def test_a_retrys_reservation_goes_only_to_an_acquire_that_names_it(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A retry's reservation (owner ``<lease>:<retries>:queued``) is not taken over by
    any owner of the lease, as the message's first reservation is: only by one that
    names it. The holder's owner token is told to owners of its lease that find it
    held, and to nobody else; a second hold of the reservation is a duplicate."""
    owner = "task-1:1" + RESERVATION_SUFFIX
    reservation = RedisLock(client, "retried", ttl=30, owner=owner, lease="task-1")
    cleanup.append(reservation)
    assert reservation.acquire(blocking=False)
    assert not RedisLock(client, "retried", ttl=30, owner=owner, lease="task-1").acquire(
        blocking=False
    )
    assert field(client, reservation.key, "n") is None  # one hold, not two
    copy = RedisLock(client, "retried", ttl=30, lease="task-1")
    stranger = RedisLock(client, "retried", ttl=30, lease="task-2")

    assert not copy.acquire(blocking=False)
    assert not stranger.acquire(blocking=False)

    assert (copy.blocked_by, copy._blocked_owner) == ("task-1", owner)
    assert (stranger.blocked_by, stranger._blocked_owner) == ("task-1", None)
    retry = RedisLock(client, "retried", ttl=30, lease="task-1")
    cleanup.append(retry)
    retry._handed_from = owner
    assert retry.acquire(blocking=False)
    assert not reservation.owned()
    assert reservation.token is not None
    assert retry.token is not None
    assert retry.token > reservation.token


def test_a_hold_that_could_not_be_handed_over_is_renewed_still(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A hand-over takes the hold off the heartbeat while it is under way; one that
    did not move the hold (refused, or failed to reach the server) puts it back, so
    the hold outlives its TTL, and one that moved it leaves it off."""
    running = RedisLock(client, "handing", ttl=1, lease="task-1")
    cleanup.append(running)
    assert running.acquire(blocking=False)
    other_lease = RedisLock(client, "handing", ttl=30, owner="task-2:1:queued", lease="task-2")
    unreachable = RedisLock(
        redis.Redis(port=free_port()), "handing", ttl=30, lease="task-1", call_timeout=0.3
    )

    assert not running._hand_over(other_lease)
    with pytest.raises(LockBackendError):
        running._hand_over(unreachable)
    time.sleep(1.5)  # past the TTL: only renewals keep it

    assert running.owned()
    assert not running.lost
    reservation = RedisLock(client, "handing", ttl=30, owner="task-1:1:queued", lease="task-1")
    cleanup.append(reservation)
    assert running._hand_over(reservation)
    assert not running.holding
    assert reservation.owned()


def test_a_hold_moved_to_a_reservation_wakes_the_waiters_of_its_lease(
    client: redis.Redis, cleanup: list[RedisLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hold moved to a reservation of its lease (how a task hands its lock to its
    retry as it ends) wakes the waiters of that lease queued behind it (the retry,
    started meanwhile), which take the reservation over at once rather than at
    their next re-check; a waiter of another lease is not woken."""
    monkeypatch.setattr(lock_module, "RECHECK", 60.0)
    running = RedisLock(client, "moved", ttl=30, lease="task-1")
    cleanup.append(running)
    assert running.acquire(blocking=False)
    retry = RedisLock(client, "moved", ttl=30, owner="retry-exec:1", lease="task-1")
    retry._handed_from = "task-1:1:queued"
    other = RedisLock(client, "moved", ttl=30, lease="task-2")
    cleanup += [retry, other]
    got, thread = acquire_in_thread(retry, 20)
    other_got, other_thread = acquire_in_thread(other, 20)
    assert wait_until(lambda: client.zcard(running.queue_key) == 2)
    hub = wakeups.hub_for(retry.transport, retry.prefix)
    before = hub.received

    reservation = RedisLock(client, "moved", ttl=30, owner="task-1:1:queued", lease="task-1")
    cleanup.append(reservation)
    reservation._handed_from = running.owner
    reservation._move_only = True
    assert reservation.acquire(blocking=False)
    thread.join(15)

    assert got == [True]
    assert retry.owned()
    assert hub.received - before == 1
    assert not other_got
    retry.release()
    other_thread.join(15)
    assert other_got == [True]
    other.release()


def test_other_lease_cannot_take_over(client: redis.Redis) -> None:
    """Another lease, or none, never takes a held lock over: it has to wait."""
    holder = RedisLock(client, "lease-only", ttl=30, lease="task-1")
    assert holder.acquire(blocking=False)
    assert not RedisLock(client, "lease-only", ttl=30, lease="task-2").acquire(blocking=False)
    assert not RedisLock(client, "lease-only", ttl=30).acquire(blocking=False)
    assert holder.owned()
    holder.release()


def test_no_lease_never_takes_over(client: redis.Redis) -> None:
    """Two lease-less owners exclude each other (an empty lease matches nothing)."""
    holder = RedisLock(client, "no-lease", ttl=30)
    assert holder.acquire(blocking=False)
    assert not RedisLock(client, "no-lease", ttl=30).acquire(blocking=False)
    holder.release()


def test_release_lease(client: redis.Redis) -> None:
    """release_lease frees the lock whatever its hold count, only for the holding lease."""
    lock = RedisLock(client, "by-lease", ttl=30, lease="task-3")
    assert lock.acquire()
    assert lock.acquire()
    assert not release_lease(client, "by-lease", "task-4")
    assert not release_lease(client, "by-lease", "")
    assert lock.locked()
    assert release_lease(client, "by-lease", "task-3")
    assert not lock.locked()
    assert not release_lease(client, "by-lease", "task-3")


# Blocking, timeouts and wake-ups.


def test_non_blocking_returns_false_when_held(client: redis.Redis) -> None:
    """acquire(blocking=False) on a held lock returns False and changes nothing."""
    holder = RedisLock(client, "busy", ttl=30)
    assert holder.acquire()
    before = client.get(holder.key)
    other = RedisLock(client, "busy", ttl=30)
    assert other.acquire(blocking=False) is False
    assert other.acquire(timeout=0) is False
    assert other.token is None
    assert client.get(holder.key) == before
    holder.release()


def test_blocking_timeout_returns_false(client: redis.Redis) -> None:
    """A blocking acquire that times out returns False; the first owner still holds it."""
    holder = RedisLock(client, "timeout", ttl=30)
    assert holder.acquire()
    other = RedisLock(client, "timeout", ttl=30)
    assert other.acquire(timeout=0.3) is False
    assert holder.owned()
    assert not other.owned()
    assert wait_until(lambda: nobody_queued(client, other))
    holder.release()


@pytest.mark.parametrize("subscribed", [False, True])
def test_waiting_does_not_poll(client: redis.Redis, subscribed: bool) -> None:
    """A waiter on a long-lived lock tries at the start, once subscribed and at its deadline,
    then leaves the queue: four requests in a second, however long it waits, where a
    poller would make dozens. In a process whose wake-up subscription is in place
    already, its first try queues it: three requests."""
    holder = RedisLock(client, "no-poll", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(client, "no-poll", ttl=60)
    hub = wakeups.hub_for(waiter.transport, waiter.prefix)
    if subscribed:
        kept = hub.join()  # another waiter of the process keeps the subscription
        assert wait_until(lambda: hub.subscribed)
    else:
        assert wait_until(lambda: not hub.subscribed, timeout=wakeups.IDLE_EXIT + 5)
    client.config_resetstat()
    assert waiter.acquire(timeout=1.0) is False
    if subscribed:
        hub.leave(kept)
    assert evalsha_calls(client) == (3 if subscribed else 4)
    assert not client.exists(waiter.queue_key)
    holder.release()


@pytest.mark.parametrize("timeout", [0.2, 0])
def test_with_statement_times_out(client: redis.Redis, timeout: float) -> None:
    """``with lock:`` raises LockTimeoutError once ``blocking_timeout`` runs out; with
    0, after one try."""
    holder = RedisLock(client, "with-timeout", ttl=30)
    assert holder.acquire()
    other = RedisLock(client, "with-timeout", ttl=30, blocking_timeout=timeout)
    with pytest.raises(LockTimeoutError) as excinfo, other:
        pytest.fail("the body must not run")
    assert excinfo.value.name == "with-timeout"
    assert excinfo.value.timeout == timeout
    assert holder.owned()
    holder.release()


def test_release_wakes_waiter(client: redis.Redis, cleanup: list[RedisLock]) -> None:
    """A waiter blocked on a long-TTL lock gets it as soon as the holder releases it."""
    holder = RedisLock(client, "wake", ttl=60)
    assert holder.acquire()
    waiter_lock, waiter = wait_behind(holder, cleanup)
    # The waiter is queued before the release happens.
    assert wait_until(lambda: queued(client, holder) == 1)
    assert not waiter.done()

    holder.release()

    # Well before the 30 s timeout and the 60 s TTL.
    assert wait_until(waiter.done, timeout=10)
    assert waiter.error is None
    assert waiter.result is True
    assert waiter_lock.owned()
    assert waiter_lock.token is not None
    assert holder.token is not None
    assert waiter_lock.token > holder.token
    assert wait_until(lambda: nobody_queued(client, waiter_lock))


def test_expiry_wakes_waiter_and_old_holder_lost_it(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A holder without heartbeat loses the lock after its TTL, a blocked waiter gets it,
    and the old holder's release raises LockNotOwnedError (LockLostError)."""
    holder = RedisLock(client, "expiry", ttl=1, heartbeat=False)
    assert holder.acquire()
    waiter_lock, waiter = wait_behind(holder, cleanup, ttl=30)

    assert wait_until(waiter.done, timeout=15)
    assert waiter.error is None
    assert waiter.result is True
    assert waiter_lock.owned()
    assert not holder.owned()

    with pytest.raises(LockNotOwnedError) as excinfo:
        holder.release()

    assert isinstance(excinfo.value, LockLostError)
    assert holder.lost
    assert waiter_lock.owned()
    assert wait_until(lambda: nobody_queued(client, waiter_lock))


def test_release_wakes_the_first_two_and_marks_the_spare(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A release wakes the two oldest waiters, each on its own process's channel; the
    second's message carries the spare mark, and the spare keeps its place at the
    front of the queue (it leaves it only by taking the lock)."""
    holder = RedisLock(client, "spare-mark", ttl=60)
    assert holder.acquire()
    cleanup.append(holder)
    for position, waiter_id in enumerate(("proc-a.1", "proc-b.7", "proc-c.3"), start=1):
        client.zadd(holder.queue_key, {waiter_id: position})
    write_fields(client, holder.key, q="1")
    pubsub = client.pubsub()  # type: ignore[no-untyped-call,unused-ignore]
    pubsub.psubscribe(f"{holder.wake_prefix}*")
    assert pubsub.get_message(timeout=5) is not None  # the subscription's confirmation
    holder.release()
    got: list[tuple[str, str]] = []
    while len(got) < 2:
        message = pubsub.get_message(timeout=5)
        assert message is not None
        got.append((message["channel"].decode(), message["data"].decode()))
    pubsub.close()
    assert got == [
        (f"{holder.wake_prefix}proc-a", "proc-a.1"),
        (f"{holder.wake_prefix}proc-b", f"proc-b.7{SPARE_MARK}"),
    ]
    assert client.zrange(holder.queue_key, 0, -1) == [b"proc-b.7", b"proc-c.3"]


def test_the_spare_stays_queued_and_the_queue_keeps_its_expiry(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """With exactly two waiters queued, a release takes the first out of the queue and
    leaves the spare in it: the queue expires when it would have."""
    holder = RedisLock(client, "spare-expiry", ttl=60)
    assert holder.acquire()
    cleanup.append(holder)
    client.zadd(holder.queue_key, {"proc-a.1": 1, "proc-b.2": 2})
    client.pexpire(holder.queue_key, 90_000)
    write_fields(client, holder.key, q="1")
    holder.release()
    assert client.zrange(holder.queue_key, 0, -1) == [b"proc-b.2"]
    assert 0 < client.pttl(holder.queue_key) <= 90_000


def test_spare_takes_the_lock_when_the_first_woken_waiter_is_gone(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """The second waiter woken (the spare) lets the first go ahead, but takes the lock
    after its head start when the first never comes: well before the holder's TTL."""
    holder = RedisLock(client, "spare-gone", ttl=60)
    assert holder.acquire()
    # A waiter of a process that died while queued, ahead of the live one.
    client.zadd(holder.queue_key, {"gone-process.1": 1})
    write_fields(client, holder.key, q="1")
    waiter_lock, waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    holder.release()
    assert wait_until(waiter.done, timeout=10)
    assert waiter.error is None
    assert waiter.result is True
    assert waiter_lock.owned()


def test_spare_woken_again_during_its_head_start_asks_at_once(
    client: redis.Redis, cleanup: list[RedisLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spare stays at the front of the queue while it gives the first woken waiter
    its head start; a wake-up that names it meanwhile (the next release's, here sent
    by hand) ends the head start, and it takes the lock kept for it."""
    monkeypatch.setattr(lock_module, "SPARE_HEAD_START", 120.0)
    holder = RedisLock(client, "spare-again", ttl=60)
    assert holder.acquire()
    waiter_lock, waiter = wait_behind(holder, cleanup, timeout=300)
    assert wait_until(lambda: queued(client, holder) == 1)
    (entry,) = cast(list[bytes], client.zrange(holder.queue_key, 0, -1))
    # A waiter of a process that died while queued, ahead of the live one.
    client.zadd(holder.queue_key, {"gone-process.1": 1})
    hub = wakeups.hub_for(waiter_lock.transport, waiter_lock.prefix)
    holder.release()  # wakes the gone one first, the live one as the spare
    assert client.zrange(holder.queue_key, 0, -1) == [entry]
    assert wait_until(lambda: hub.received == 1)  # the spare's wake-up, read
    assert not waiter.done()
    client.publish(holder.wake_prefix + wakeups.process_token(), json.loads(entry)[0])
    assert wait_until(waiter.done, timeout=30)
    assert (waiter.error, waiter.result) == (None, True)
    assert waiter_lock.owned()


def handed_over(client: redis.Redis, holder: RedisLock, waiter_lock: RedisLock) -> None:
    """``waiter_lock`` waits for ``holder``'s lock, in a thread; the server's statistics
    are reset once it is queued, and ``holder`` releases: the waiter gets the lock."""
    waiter = Waiter(waiter_lock, timeout=30)
    assert wait_until(lambda: queued(client, holder) == 1)
    client.config_resetstat()
    holder.release()
    assert wait_until(waiter.done, timeout=10)
    assert (waiter.error, waiter.result) == (None, True)


def test_release_hands_the_lock_to_the_first_waiter(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A release hands the lock to the first queued waiter, with its lease, its holder
    description and the next fencing token: the waiter holds it when its wake-up
    arrives, without a round trip of its own. Its heartbeat renews the short hold a
    release grants to the waiter's full TTL a third of the way through the grant."""
    holder = RedisLock(client, "handed", ttl=60)
    assert holder.acquire()
    waiter_lock = RedisLock(
        client,
        "handed",
        ttl=60,
        lease="task-2",
        holder_info={"task": "tasks.buy", "state": "running", "node": "w1", "pid": "7"},
    )
    cleanup.append(waiter_lock)
    handed_over(client, holder, waiter_lock)
    assert holder.token is not None
    assert waiter_lock.token is not None
    assert waiter_lock.token > holder.token
    fields = stored(client, waiter_lock)
    assert fields[OWNER_FIELD] == waiter_lock.owner
    assert fields[LEASE_FIELD] == "task-2"
    assert fields["t"] == "tasks.buy"
    assert fields["h"] == "w1"
    assert int(fields[FENCE_FIELD]) == waiter_lock.token
    # Not confirmed by an acquire: the request field still names the grant.
    assert fields[REQUEST_FIELD].startswith("g:")
    # Renewed to the full TTL by the heartbeat (EXTEND), well past the handed hold's.
    assert wait_until(lambda: client.pttl(waiter_lock.key) > GRANT_MS)
    # The release and the renewal: the waiter sent no acquire after its wake-up.
    assert evalsha_calls(client) == 2
    waiter_lock.release()
    assert not held(client, waiter_lock)


@pytest.mark.parametrize("handed", [True, False], ids=["handed", "asked"])
def test_a_hold_taken_after_waiting_is_released_by_reading_first(
    client: redis.Redis, cleanup: list[RedisLock], handed: bool
) -> None:
    """A hold that came after waiting (handed over, or taken by a try after the wait)
    is released by the script's general path, a read and then a write: others are
    likely queued still, and the one write would have to be put back. A hold taken
    at once is released by the one write."""
    holder = RedisLock(client, "waited-for", ttl=60, heartbeat=False)
    assert holder.acquire()
    waiter_lock = RedisLock(client, "waited-for", ttl=60, heartbeat=handed)
    cleanup.append(waiter_lock)
    if handed:
        handed_over(client, holder, waiter_lock)
        assert stored(client, waiter_lock)[REQUEST_FIELD].startswith("g:")
    else:
        # Taken by the waiter's next try, once the holder's TTL (cut to a second
        # once the waiter queued) ran out.
        waiter = Waiter(waiter_lock, timeout=30)
        assert wait_until(lambda: queued(client, holder) == 1)
        holder.extend(1)
        assert wait_until(waiter.done, timeout=20)
        assert (waiter.error, waiter.result) == (None, True)
        assert not stored(client, waiter_lock)[REQUEST_FIELD].startswith("g:")
        holder._forget()
    client.config_resetstat()
    waiter_lock.release()
    assert writes_and_reads(client) == (1, 1)
    assert not held(client, waiter_lock)
    assert waiter_lock.acquire(blocking=False)
    client.config_resetstat()
    waiter_lock.release()
    assert writes_and_reads(client) == (1, 0)


def test_the_spare_behind_a_handed_lock_does_not_ask_for_it(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """The spare a release wakes behind a waiter it handed the lock to knows the lock is
    held: it asks only if the grant runs out (2 s) before the next release, and here
    the next release hands the lock to it first, so it never asks again."""
    holder = RedisLock(client, "handed-spare", ttl=60)
    assert holder.acquire()
    first_lock, first = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 1)
    spare_lock, spare = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    tried = spare_lock._tried
    hub = wakeups.hub_for(spare_lock.transport, spare_lock.prefix)
    received = hub.received
    holder.release()
    assert wait_until(first.done, timeout=10)
    assert (first.error, first.result) == (None, True)
    assert wait_until(lambda: hub.received == received + 2)  # both wake-ups read
    first_lock.release()
    assert wait_until(spare.done, timeout=10)
    assert (spare.error, spare.result) == (None, True)
    assert spare_lock._tried == tried  # no try since it queued
    assert stored(client, spare_lock)[REQUEST_FIELD].startswith("g:")


def test_a_handed_lock_is_confirmed_by_a_round_trip_without_heartbeat(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A waiter that cannot renew the handed hold in the background (no heartbeat)
    confirms it with an acquire, which gives it the full TTL and counts no second hold."""
    holder = RedisLock(client, "handed-confirmed", ttl=60)
    assert holder.acquire()
    waiter_lock = RedisLock(client, "handed-confirmed", ttl=60, heartbeat=False)
    cleanup.append(waiter_lock)
    handed_over(client, holder, waiter_lock)
    assert evalsha_calls(client) == 2  # the release and the confirming acquire
    assert client.pttl(waiter_lock.key) > GRANT_MS
    fields = stored(client, waiter_lock)
    assert COUNT_FIELD not in fields
    assert len(fields[REQUEST_FIELD]) == REQUEST_ID_DIGITS
    assert waiter_lock.token == int(fields[FENCE_FIELD])
    waiter_lock.release()
    assert not held(client, waiter_lock)


def test_a_handed_hold_kept_without_a_round_trip_is_re_entered_by_its_owner(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A waiter holds the lock a release hands it as it reads its wake-up, while the
    server still marks the hold as handed to that waiter: an acquire of the same owner
    then (the same object, one of whose earlier waits gave up, or another object)
    re-enters it, as any hold of its owner, and only the last release frees it."""
    holder = RedisLock(client, "kept-handed", ttl=60)
    assert holder.acquire()
    lock = RedisLock(client, "kept-handed", ttl=60, owner="kept-owner")
    cleanup.append(lock)
    assert lock.acquire(timeout=0.1) is False  # a wait given up
    assert queued(client, holder) == 0
    handed_over(client, holder, lock)
    assert stored(client, lock)[REQUEST_FIELD].startswith(GRANTED_TO)  # not confirmed
    other = RedisLock(client, "kept-handed", ttl=60, owner="kept-owner")

    assert lock.acquire(blocking=False)
    assert other.acquire(blocking=False)

    assert hold_count(client, lock.key) == 3
    assert other.token == lock.token
    other.release()
    lock.release()
    assert held(client, lock)
    lock.release()
    assert not held(client, lock)


def test_a_waiter_gone_since_it_queued_keeps_the_lock_only_for_the_grant(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """The first waiter's process died while it was queued, where a release cannot tell
    (its entry does not ask to be checked): the release hands it the lock all the
    same, for GRANT_MS at most. The live waiter behind it (woken as the
    spare) gets the lock once that runs out, long before the holder's 60 s TTL."""
    holder = held_ahead_of_a_gone_waiter(client, "handed-gone")
    waiter_lock, waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    holder.release()
    assert field(client, holder.key, OWNER_FIELD) == "gone-owner"
    assert 0 < client.pttl(holder.key) <= GRANT_MS
    assert wait_until(waiter.done, timeout=20)
    assert (waiter.error, waiter.result) == (None, True)
    assert waiter_lock.owned()
    assert holder.token is not None
    assert waiter_lock.token is not None
    assert waiter_lock.token > holder.token + 1


def test_a_waiter_taking_the_lock_after_a_grant_ran_out_keeps_the_others_woken(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A grant that nobody confirmed runs out with its key, and with it the flag that
    says waiters are queued: the waiter that takes the lock then sets the flag again
    while others are queued behind it, so its release wakes the next one rather than
    leaving it asleep until its re-check."""
    holder = held_ahead_of_a_gone_waiter(client, "grant-ran-out")
    second, first_waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    third, second_waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 3)
    holder.release()  # handed to the process that is gone, for GRANT_MS

    assert wait_until(first_waiter.done, timeout=20)
    assert (first_waiter.error, first_waiter.result) == (None, True)
    assert stored(client, second).get(QUEUED_FIELD) == "1"
    second.release()
    assert field(client, holder.key, OWNER_FIELD) == third.owner  # handed on at once
    assert wait_until(second_waiter.done, timeout=20)
    assert second_waiter.result


def test_a_lock_taken_without_waiting_after_a_grant_ran_out_is_handed_on_at_its_release(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A caller that does not wait can take the lock once a grant nobody confirmed has
    run out (its key gone, with the queued flag), before the spare woken behind it
    asks. The spare's question finds the lock held and sets the flag again, so the
    release of that hold hands the lock to it rather than leaving it asleep until its
    re-check."""
    # A 0.3 s grant, and a spare that waits out a 2 s one (its own TTL's).
    holder = held_ahead_of_a_gone_waiter(client, "grant-ran-out-taken", gone_ttl_ms=300)
    spare, waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    holder.release()
    assert wait_until(lambda: not client.exists(holder.key))  # the grant ran out
    taker = RedisLock(client, holder.name, ttl=60)
    cleanup.append(taker)
    assert taker.acquire(blocking=False)
    assert QUEUED_FIELD not in stored(client, taker)

    assert wait_until(lambda: stored(client, taker).get(QUEUED_FIELD) == "1")
    assert not waiter.done()
    taker.release()
    assert field(client, holder.key, OWNER_FIELD) == spare.owner  # handed on at once
    assert wait_until(waiter.done)
    assert (waiter.error, waiter.result) == (None, True)


def test_a_spare_behind_a_grant_shorter_than_grant_ms_waits_only_that_long(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A grant lasts the first waiter's TTL when that is shorter than GRANT_MS: the
    spare woken behind it asks once that has run out, not after the full GRANT_MS."""
    holder = held_ahead_of_a_gone_waiter(client, "short-grant", gone_ttl_ms=300)
    _spare, waiter = wait_behind(holder, cleanup, ttl=0.3)
    assert wait_until(lambda: queued(client, holder) == 2)
    holder.release()
    remaining = client.pttl(holder.key)
    assert remaining == -2 or 0 < remaining <= 300  # (-2: gone, had the machine stalled)

    # Well before GRANT_MS (2 s), but after the 0.3 s grant.
    assert wait_until(waiter.done, timeout=GRANT_MS / 1000 * 0.75)
    assert (waiter.error, waiter.result) == (None, True)


def test_a_waiter_that_leaves_gives_back_a_lock_handed_to_it(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """A waiter that gives up just as a release hands it the lock (its wake-up not read)
    gives the lock back as it leaves the queue, and the next waiter is handed it."""
    holder = RedisLock(client, "handed-left", ttl=60)
    assert holder.acquire()
    leaving = RedisLock(client, "handed-left", ttl=60)
    entry = scripts.queue_entry("left-process.1", leaving.owner, 60_000, "", "")
    after = scripts.queue_entry("next-process.2", "next-owner", 60_000, "", "")
    client.zadd(holder.queue_key, {entry: 1, after: 2})
    write_fields(client, holder.key, q="1")
    holder.release()
    assert field(client, holder.key, OWNER_FIELD) == leaving.owner
    leaving._position = "1"
    leaving._leave_queue(entry)
    assert field(client, holder.key, OWNER_FIELD) == "next-owner"
    assert client.zcard(holder.queue_key) == 0


def test_waiters_gone_ahead_of_a_live_one_hold_it_up_only_until_it_asks_again(
    client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first two queued waiters are gone (a worker killed with them), where a
    release cannot tell (their entries do not ask to be checked): the release hands
    the lock to the first and wakes the second, neither of which answers. The
    live waiter behind them, asleep until the holder's TTL it saw, asks again after
    RECHECK at the latest and takes the lock, long before that TTL."""
    monkeypatch.setattr(lock_module, "RECHECK", 0.5)
    holder = RedisLock(client, "ghosts-ahead", ttl=60)
    assert holder.acquire()
    ghosts = {queue_entry(f"gone{n}.1", f"gone-owner-{n}", 30_000, "", ""): n + 1 for n in range(2)}
    client.zadd(holder.queue_key, ghosts)
    live = RedisLock(client, "ghosts-ahead", ttl=60)
    got, thread = acquire_in_thread(live, None)  # no deadline: it asks only when it must
    assert wait_until(lambda: queued(client, holder) == 3)
    holder.release()
    thread.join(20)
    assert got == [True]
    live.release()
    client.delete(holder.queue_key)


def dead_entries(count: int, watched: bool = True, start: int = 0) -> dict[str, int]:
    """Queue entries (with their scores) of ``count`` waiters of a process that has no
    wake-up subscription, that ask to be checked (``watched``) or not."""
    return {
        queue_entry(f"dead-process.{n}", f"dead-owner-{n}", 30_000, "", "", watched): n + 1
        for n in range(start, start + count)
    }


def test_waiters_of_a_process_without_a_subscription_are_passed_over(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """Queued first, three waiters of a process whose wake channel has no subscriber on
    the server (it died) and whose entries say its subscription would be there: the
    release takes them out of the queue and hands the lock to the live waiter behind
    them at once."""
    if not checks_processes(client):
        pytest.skip("Redis 6.2 cannot tell that a waiter's process has died")
    holder = RedisLock(client, "passed-over", ttl=60)
    assert holder.acquire()
    client.zadd(holder.queue_key, dead_entries(3))
    waiter_lock, waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 4)
    entry = queue_entries(client, holder.queue_key)[3][0]
    assert entry.endswith(b",1]")  # a waiter on a single server asks to be checked
    holder.release()
    assert field(client, holder.key, OWNER_FIELD) == waiter_lock.owner
    assert queued(client, holder) == 0
    assert wait_until(waiter.done)
    assert (waiter.error, waiter.result) == (None, True)


def test_waiters_whose_entries_do_not_ask_to_be_checked_are_handed_the_lock(
    client: redis.Redis,
) -> None:
    """Entries that do not say where their process is subscribed (a cluster's, a
    Sentinel-managed server's) are handed the lock as before, whether or not their
    channel has a subscriber here: their process may be subscribed elsewhere."""
    hand_to_the_first_of_two_dead_waiters(client, "not-watched", watched=False)


def hand_to_the_first_of_two_dead_waiters(client: redis.Redis, name: str, watched: bool) -> None:
    """Queue two waiters of a process that has no wake-up subscription (their entries
    ask to be checked or not: ``watched``) behind a holder of lock ``name``, and
    release it: the first must be handed the lock, and the second stay queued."""
    holder = RedisLock(client, name, ttl=60)
    assert holder.acquire()
    client.zadd(holder.queue_key, dead_entries(2, watched=watched))
    write_fields(client, holder.key, q="1")
    holder.release()
    assert field(client, holder.key, OWNER_FIELD) == "dead-owner-0"
    assert queued(client, holder) == 1
    client.delete(holder.key, holder.queue_key)


def test_on_redis_6_2_dead_waiters_are_handed_the_lock_all_the_same(
    client: redis.Redis,
) -> None:
    """On Redis 6.2, whose scripts cannot check the ACL first, a release does not ask
    whether a queued waiter's process is alive: entries that ask for the check are
    handed the lock as those that do not (the grant bounds what a dead one costs)."""
    if checks_processes(client):
        pytest.skip("this server tells dead waiters apart")
    hand_to_the_first_of_two_dead_waiters(client, "not-checked", watched=True)


def test_on_redis_6_2_a_command_refused_after_a_scripts_first_write_leaves_that_write(
    client: redis.Redis, redislock_server: RedisServer
) -> None:
    """On Redis 6.2, whose scripts cannot ask before they write whether the user may
    run a command, a user without the wake channels' permission (the minimal ACL
    less ``&redislock:*``) whose release must wake a waiter is refused the PUBLISH
    after the release freed the lock and took the waiter out of the queue: the
    release raises naming it, and those writes stay (on Redis 7 and Valkey it is
    refused before any write: ``test_release_refused_by_the_acl_changes_nothing``)."""
    from tests.test_deployments_engine import MINIMAL_ACL

    if checks_processes(client):
        pytest.skip("this server checks a script's commands before its first write")
    rules = [rule for rule in MINIMAL_ACL if rule != "&redislock:*"]
    url = redislock_server.add_user("no-channels", "no-channels-password", rules)
    lock = RedisLock(url, "refused-after-its-write", ttl=30, heartbeat=False)
    assert lock.acquire(blocking=False)
    client.zadd(lock.queue_key, {"someone.1": 1})
    write_fields(client, lock.key, q="1")
    with pytest.raises(LockBackendError, match="publish"):
        lock.release()
    assert not held(client, lock)
    assert queued(client, lock) == 0
    client.delete(lock.key, lock.queue_key)


def test_a_release_passes_over_at_most_passed_over_limit_dead_waiters(
    client: redis.Redis,
) -> None:
    """One release takes at most PASSED_OVER_LIMIT dead waiters out of the queue: the
    next one is handed the lock (for its grant), and the one after it woken as the spare."""
    if not checks_processes(client):
        pytest.skip("Redis 6.2 cannot tell that a waiter's process has died")
    holder = RedisLock(client, "passed-over-limit", ttl=60)
    assert holder.acquire()
    client.zadd(holder.queue_key, dead_entries(scripts.PASSED_OVER_LIMIT + 2))
    write_fields(client, holder.key, q="1")
    holder.release()
    limit = scripts.PASSED_OVER_LIMIT
    assert field(client, holder.key, OWNER_FIELD) == f"dead-owner-{limit}"
    assert [entry for entry, _ in queue_entries(client, holder.queue_key)] == [
        queue_entry(
            f"dead-process.{limit + 1}", f"dead-owner-{limit + 1}", 30_000, "", "", True
        ).encode()
    ]
    client.delete(holder.key, holder.queue_key)


def test_a_waiter_passed_over_is_woken_and_queues_again_in_its_place(
    client: redis.Redis, cleanup: list[RedisLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The message a release sends a waiter it passed over as dead, should it reach it
    all the same (its subscription where the server does not count it), wakes it: it
    asks again at once, queued in the place it had, with an entry that no longer asks
    to be checked; and so do the process's later waiters."""
    holder = RedisLock(client, "passed-over-told", ttl=60)
    assert holder.acquire()
    waiter_lock, waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 1)
    [(entry, score)] = queue_entries(client, holder.queue_key)
    hub = wakeups.hub_for(waiter_lock.transport, waiter_lock.prefix)
    monkeypatch.setattr(hub, "unseen", False)  # and back to it after the test
    wait_id = json.loads(entry)[0]
    # As a release that passed it over would, after taking its entry out.
    client.zrem(holder.queue_key, entry)
    client.publish(
        f"{holder.wake_prefix}{wait_id.split('.')[0]}", f"{wait_id}{scripts.PASSED_MARK}"
    )
    assert wait_until(lambda: queued(client, holder) == 1)
    [(again, again_score)] = queue_entries(client, holder.queue_key)
    assert again_score == score
    assert json.loads(again)[0] == wait_id
    assert not again.endswith(b",1]")
    assert hub.unseen
    later_lock, later = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    assert not any(m.endswith(b",1]") for m, _ in queue_entries(client, holder.queue_key))
    holder.release()
    assert field(client, holder.key, OWNER_FIELD) == waiter_lock.owner
    assert wait_until(waiter.done)
    assert waiter.result
    waiter_lock.release()
    assert wait_until(later.done)
    assert later.result
    later_lock.release()


def test_a_waiter_that_switches_its_entry_form_keeps_one_entry_in_its_place(
    client: redis.Redis,
) -> None:
    """A waiter sends its queue entry marked for the check that its process lives,
    or unmarked (while its wake-up subscription is down): either form takes the
    other out of the queue, so the waiter has one entry, which keeps its place even
    when the try does not know its position (the answer that gave it was lost);
    and a leave in either form takes both."""
    key, queue = "redislock:{entry-forms}", "redislock:{entry-forms}:queue"

    def ask(owner: str, entry: str, position: str = "") -> Any:
        return client.eval(
            scripts.ACQUIRE_SCRIPT.text, 2, key, queue, owner, 30_000, "", f"r-{owner}-{entry[-3:]}",
            entry, position,
        )  # fmt: skip

    assert ask("holder", "")[0] == 1
    first = scripts.queue_entry("p1.1", "first", 30_000, "", "", True)
    second = scripts.queue_entry("p2.1", "second", 30_000, "", "", True)
    assert ask("first", first)[0] == 0
    assert ask("second", second)[0] == 0
    [(_, place), _] = queue_entries(client, queue)
    reply = ask("first", scripts.unwatched(first))
    assert [m for m, _ in queue_entries(client, queue)] == [
        scripts.unwatched(first).encode(),
        second.encode(),
    ]
    assert queue_entries(client, queue)[0][1] == place
    assert float(reply[3]) == place
    assert ask("first", first, reply[3].decode())[0] == 0
    assert [m for m, _ in queue_entries(client, queue)] == [first.encode(), second.encode()]
    assert client.eval(
        scripts.LEAVE_SCRIPT.text, 2, key, queue, "first", "wake:", "r-leave", 1000,
        scripts.unwatched(first),
    ) == 1  # fmt: skip
    assert [m for m, _ in queue_entries(client, queue)] == [second.encode()]
    client.delete(key, queue)


def test_a_spare_handed_the_lock_before_it_pauses_keeps_the_hand_over(
    client: redis.Redis,
) -> None:
    """A spare about to let the first woken waiter go ahead, handed the lock by the
    next release meanwhile, keeps that hand-over rather than forget it and pause."""
    lock = RedisLock(client, "spare-handed", ttl=30)
    hub = wakeups.hub_for(lock.transport, lock.prefix)
    waiter = hub.join()
    try:
        hub._deliver(f"{waiter.id}{SPARE_MARK}")
        assert waiter.spare
        assert not hub.rearm_spare(waiter)  # nothing handed: the spare pauses
        assert not waiter.woken
        hub._deliver(f"{waiter.id}{SPARE_MARK}")
        hub._deliver(f"{waiter.id}{GRANT_MARK}42")
        assert hub.rearm_spare(waiter)
        assert waiter.fence == 42
        assert waiter.woken
    finally:
        hub.leave(waiter)


def test_a_spare_whose_subscription_broke_before_it_pauses_keeps_the_wake_up(
    client: redis.Redis,
) -> None:
    """The subscription breaks (noticed by another reader) right after a spare's
    wake-up is read, before the spare starts its pause: every waiter was woken to
    re-check the lock once subscribed again, and the spare keeps that wake-up rather
    than forget it with its own. (Forgotten, it would pause reading a subscription
    that is gone, holding the reading the hub's thread needs to subscribe again.)"""
    lock = RedisLock(client, "spare-broke", ttl=30)
    hub = wakeups.hub_for(lock.transport, lock.prefix)
    waiter = hub.join()
    try:
        assert wait_until(lambda: hub.subscribed)
        subscriptions = hub.subscriptions
        hub._deliver(f"{waiter.id}{SPARE_MARK}")
        hub._broke(hub._conn, redis.ConnectionError("the wake-up subscription broke"))
        assert not hub.rearm_spare(waiter)
        assert waiter.woken
        assert wait_until(lambda: hub.subscribed and hub.subscriptions > subscriptions)
    finally:
        hub.leave(waiter)


def test_a_wake_up_read_after_a_later_try_does_not_hand_over_the_lock(
    client: redis.Redis,
) -> None:
    """A waiter whose process stalled with a wake-up unread: the hold it handed over
    ran out, another owner took the lock, and the waiter tried again and queued before
    it read the wake-up. Its last try is recent, but the wake-up is older than that try
    (its token is not above the one the try found), so the waiter does not take it."""
    holder = RedisLock(client, "handed-stale", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(client, "handed-stale", ttl=60)
    entry = scripts.queue_entry("stale-process.1", waiter.owner, 60_000, "", "")
    assert not waiter._try_acquire(waiter._call_deadline(None), "1000000002", entry)
    holder.release()  # handed to the waiter, whose wake-up goes unread
    assert holder.token is not None
    handed = int(field(client, holder.key, FENCE_FIELD) or 0)
    assert handed > holder.token
    client.pexpire(holder.key, 1)  # the grant runs out
    assert wait_until(lambda: not client.exists(holder.key))
    other = RedisLock(client, "handed-stale", ttl=60)
    assert other.acquire()
    assert not waiter._try_acquire(waiter._call_deadline(None), "1000000003", entry)
    assert not waiter._keep_handed(handed)
    assert not waiter.holding
    other.release()


def test_a_handed_lock_whose_wake_up_was_lost_is_confirmed_by_the_next_try(
    client: redis.Redis,
) -> None:
    """A waiter that never read the wake-up handing it the lock (the subscription
    broke) finds the hold its own at its next try: taken once, with the handed
    fencing token, and one release frees it."""
    holder = RedisLock(client, "handed-lost", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(client, "handed-lost", ttl=60)
    entry = scripts.queue_entry("lost-process.1", waiter.owner, 60_000, "", "")
    client.zadd(holder.queue_key, {entry: 1})
    write_fields(client, holder.key, q="1")
    holder.release()
    assert waiter._try_acquire(waiter._call_deadline(None), "1000000001", entry)
    assert holder.token is not None
    assert waiter.token is not None
    assert waiter.token > holder.token
    assert COUNT_FIELD not in stored(client, waiter)
    waiter.release()
    assert not held(client, waiter)


def test_lone_waiter_reads_its_wake_up_itself(
    client: redis.Redis, cleanup: list[RedisLock], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only waiter of a process reads the wake-up subscription in its own thread:
    the wake-up that names it is delivered there, with no hand-off from another."""
    delivered_in: list[threading.Thread] = []
    deliver = wakeups.WakeHub._deliver

    def recording(hub: wakeups.WakeHub, message: str) -> None:
        delivered_in.append(threading.current_thread())
        deliver(hub, message)

    monkeypatch.setattr(wakeups.WakeHub, "_deliver", recording)
    holder = RedisLock(client, "lone-reader", ttl=60)
    assert holder.acquire()
    _, waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 1)
    holder.release()
    assert wait_until(waiter.done, timeout=10)
    assert waiter.result is True
    assert delivered_in
    assert set(delivered_in) == {waiter.thread}


class _Interrupted(BaseException):
    """Raised in a waiter's thread as a soft time limit would be."""


@pytest.mark.parametrize(
    "interruption",
    [
        pytest.param(_Interrupted, id="base-exception"),
        # Celery's soft time limit: an Exception, not a reply that makes no sense.
        pytest.param(SoftTimeLimitExceeded, id="soft-time-limit"),
    ],
)
def test_a_waiter_interrupted_while_reading_its_wake_up_has_the_hub_subscribe_again(
    client: redis.Redis,
    cleanup: list[RedisLock],
    monkeypatch: pytest.MonkeyPatch,
    interruption: type[BaseException],
) -> None:
    """A waiter interrupted (a soft time limit) right after it read wake-ups off
    the subscription, before it delivered them: the interruption reaches its
    caller, and the bytes it read are gone, so the hub does not trust the stream
    again. It subscribes anew and wakes every other waiter of the process to
    re-check the lock: the other waiter, whose wake-up may have been among the
    lost bytes, still gets the lock."""
    holder = RedisLock(client, "interrupted-read", ttl=60)
    assert holder.acquire()
    _, first = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 1)
    _, second = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    hub = wakeups.hub_for(holder.transport, holder.prefix)
    subscriptions = hub.subscriptions
    receive = wakeups._receive
    interrupted_in: list[threading.Thread] = []

    def interrupted(conn: Any) -> bytes:
        data = receive(conn)
        if not interrupted_in:
            interrupted_in.append(threading.current_thread())
            raise interruption
        return data

    # No probe of a silent subscription: only the interruption may replace it.
    monkeypatch.setattr(wakeups, "PROBE_AFTER", 3600.0)
    monkeypatch.setattr(wakeups, "_receive", interrupted)
    assert wait_until(lambda: hub.subscribed and hub._reading.locked())
    # Read by whichever waiter reads (again, should a read begun before the
    # patch take the first).
    assert wait_until(lambda: client.publish(hub.channel, "nobody") > 0 and bool(interrupted_in))
    assert wait_until(lambda: first.done() or second.done())
    monkeypatch.setattr(wakeups, "_receive", receive)
    gone, left = (first, second) if first.done() else (second, first)
    assert interrupted_in == [gone.thread]
    assert isinstance(gone.error, interruption)
    assert wait_until(lambda: hub.subscriptions > subscriptions and hub.subscribed)
    holder.release()
    assert wait_until(left.done, timeout=20)
    assert left.result is True


def test_waiter_takes_over_the_reading_from_one_that_gave_up(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """Two waiters of one process: the one reading the subscription gives up (its
    timeout), the other takes over the reading and is still woken by the release,
    well before the holder's TTL."""
    holder = RedisLock(client, "reader-leaves", ttl=60)
    assert holder.acquire()
    quitter = Waiter(RedisLock(client, "reader-leaves", ttl=60), timeout=2)
    assert wait_until(lambda: queued(client, holder) == 1)
    stayer_lock = RedisLock(client, "reader-leaves", ttl=60)
    cleanup.append(stayer_lock)
    stayer = Waiter(stayer_lock, timeout=30)
    assert wait_until(lambda: queued(client, holder) == 2)
    assert wait_until(quitter.done, timeout=10)
    assert quitter.result is False
    assert wait_until(lambda: queued(client, holder) == 1)
    holder.release()
    assert wait_until(stayer.done, timeout=10)
    assert stayer.error is None
    assert stayer.result is True


def serve_waiters(
    client: redis.Redis, holder: RedisLock, count: int, one_by_one: bool
) -> tuple[list[int], list[BaseException]]:
    """Queue ``count`` waiters behind ``holder`` (``one_by_one``: each queued before
    the next starts), release it, and let each take the lock and release it in turn:
    the order they took it in, and what they raised."""
    locks = [RedisLock(client, holder.name, ttl=60) for _ in range(count)]
    order: list[int] = []
    errors: list[BaseException] = []

    def wait_then_release(index: int) -> None:
        try:
            if locks[index].acquire(timeout=30):
                order.append(index)
                time.sleep(0.02)
                locks[index].release()
        except BaseException as exc:
            errors.append(exc)

    threads = []
    for index in range(count):
        thread = threading.Thread(target=wait_then_release, args=(index,))
        thread.start()
        threads.append(thread)
        if one_by_one:
            assert wait_until(partial(lambda waiting: queued(client, holder) == waiting, index + 1))
    assert wait_until(lambda: queued(client, holder) == count)
    holder.release()
    if one_by_one:
        newcomer = RedisLock(client, holder.name, ttl=60)
        assert not newcomer.acquire(blocking=False)
    for thread in threads:
        thread.join(30)
    return order, errors


def test_waiters_are_served_in_the_order_they_queued(client: redis.Redis) -> None:
    """Waiters get the lock first come, first served, and a newcomer asking as the
    lock is released does not jump the queue."""
    holder = RedisLock(client, "fifo", ttl=60)
    assert holder.acquire()
    order, errors = serve_waiters(client, holder, 5, one_by_one=True)
    assert errors == []
    assert order == list(range(5))


def test_many_waiters_each_get_it_once(client: redis.Redis) -> None:
    """Several blocked waiters are served one after another as each releases."""
    holder = RedisLock(client, "queue", ttl=60)
    assert holder.acquire()
    order, errors = serve_waiters(client, holder, 5, one_by_one=False)
    assert errors == []
    assert sorted(order) == list(range(5))
    assert not holder.locked()
    assert wait_until(lambda: nobody_queued(client, holder))


# Fencing tokens.


def test_tokens_increase_across_cycles_and_owners(client: redis.Redis) -> None:
    """Tokens strictly increase over acquire/release cycles, whoever the owner is."""
    locks = [RedisLock(client, "fence", ttl=30) for _ in range(3)]
    tokens: list[int] = []
    for i in range(30):
        lock = locks[i % 3]
        assert lock.acquire(blocking=False)
        assert lock.token is not None
        tokens.append(lock.token)
        lock.release()
    assert all(a < b for a, b in itertools.pairwise(tokens))


def test_token_unchanged_on_reentry(client: redis.Redis) -> None:
    """A re-entrant acquire keeps the current token."""
    lock = RedisLock(client, "fence-reentry", ttl=30)
    assert lock.acquire()
    token = lock.token
    assert lock.acquire()
    assert lock.token == token
    lock.release()
    lock.release()


def test_token_increases_after_fence_counter_expired(client: redis.Redis) -> None:
    """When the free lock's key (and its fence counter) is gone, the next token is
    still larger."""
    lock = RedisLock(client, "fence-expired", ttl=30)
    tokens: list[int] = []
    for _ in range(3):
        assert lock.acquire()
        assert lock.token is not None
        tokens.append(lock.token)
        lock.release()
        assert client.delete(lock.key) == 1
    assert tokens[0] < tokens[1] < tokens[2]


def test_free_lock_keeps_its_fence_for_fence_ttl(client: redis.Redis) -> None:
    """A released lock's key stays, free, for FENCE_TTL_MS: it carries the fence
    counter and nothing else of the holder's."""
    lock = RedisLock(client, "fence-ttl", ttl=30)
    assert lock.acquire()
    lock.release()
    assert 0 < client.pttl(lock.key) <= FENCE_TTL_MS
    assert field(client, lock.key, OWNER_FIELD) is None
    assert field(client, lock.key, FENCE_FIELD) == str(lock.token)
    assert set(stored(client, lock)) == {FENCE_FIELD, RELEASED_FIELD}
    assert not lock.locked()


# Bounded memory.


def test_many_names_leave_only_expiring_free_hashes(client: redis.Redis) -> None:
    """10,000 distinct names leave one free, expiring key each (their fence counters):
    nothing held, no queues, no channels."""
    count = 10_000
    for i in range(count):
        lock = RedisLock(client, f"bounded-{i}", ttl=30, heartbeat=False)
        assert lock.acquire(blocking=False)
        lock.release()
    keys = sorted(key.decode() for key in client.scan_iter(count=1000))
    assert keys == sorted(lock_keys(f"bounded-{i}").lock for i in range(count))
    assert lock_keys_held(client) == []
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.pttl(key)
    ttls = pipe.execute()
    assert all(0 < ttl <= FENCE_TTL_MS for ttl in ttls)
    # Only process wake channels (one per process, kept a while after the last wait).
    channels = [c.decode() if isinstance(c, bytes) else c for c in client.pubsub_channels()]
    assert all(c.startswith("redislock:wake:") for c in channels)


def test_locks_of_one_client_share_its_router(redislock_server: RedisServer) -> None:
    """Every lock of a client finds its server through the same router, built once
    (its checks of the client's kind cost more than the rest of a lock's setup)."""
    client = redislock_server.client()
    first, second = RedisLock(client, "shared-a", ttl=5), RedisLock(client, "shared-b", ttl=5)
    assert first._router is second._router
    assert first._router.client is client
    other = RedisLock(redislock_server.client(), "shared-a", ttl=5)
    assert other._router is not first._router


def test_client_is_not_kept_alive(redislock_server: RedisServer) -> None:
    """Once the last lock using a client is gone, nothing in the package keeps the client
    (and its connections) alive."""
    client = redislock_server.client()
    lock = RedisLock(client, "client-lifetime", ttl=5)
    assert lock.acquire()
    lock.release()
    ref = weakref.ref(client)
    del client, lock
    gc.collect()
    assert ref() is None


# Cluster-safe keys.


@pytest.mark.parametrize("name", TRICKY_NAMES)
def test_lock_and_queue_keys_share_a_slot(name: str) -> None:
    """The lock key and its waiter queue hash to the same cluster slot (one script
    touches both)."""
    key, queue = lock_keys(name)
    assert key_slot(key.encode()) == key_slot(queue.encode())
    assert key != queue


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.text(min_size=1), prefix=st.sampled_from(["redislock", "app", "a{b}", "x}"]))
def test_keys_share_a_slot_for_any_name(name: str, prefix: str) -> None:
    """For any name and prefix, the lock key and queue key share a slot."""
    key, queue = lock_keys(name, prefix)
    assert key_slot(key.encode()) == key_slot(queue.encode())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.text(min_size=1), second=st.text(min_size=1))
def test_distinct_names_get_distinct_keys(first: str, second: str) -> None:
    """Two different names never share a lock key or queue key."""
    if first != second:
        assert set(lock_keys(first)).isdisjoint(lock_keys(second))


def test_escaped_names_do_not_collide() -> None:
    """Names that need escaping never land on another name's keys."""
    keys = [lock_keys(name) for name in TRICKY_NAMES]
    flat = [key for pair in keys for key in pair]
    assert len(flat) == len(set(flat))


@pytest.mark.parametrize("name", TRICKY_NAMES)
def test_tricky_names_lock_and_exclude(client: redis.Redis, name: str) -> None:
    """Unusual names lock, exclude each other and release like any other."""
    lock = RedisLock(client, name, ttl=30)
    assert lock.acquire(blocking=False)
    assert not RedisLock(client, name, ttl=30).acquire(blocking=False)
    lock.release()
    assert not lock.locked()


# Bad arguments.


@pytest.mark.parametrize(
    ("kwargs", "error", "argument"),
    [
        ({"name": ""}, ValueError, "name"),
        ({"name": 42}, TypeError, "name"),
        ({"name": None}, TypeError, "name"),
        ({"ttl": 0}, ValueError, "ttl"),
        ({"ttl": -1}, ValueError, "ttl"),
        ({"ttl": float("nan")}, ValueError, "ttl"),
        ({"ttl": float("inf")}, ValueError, "ttl"),
        ({"ttl": True}, TypeError, "ttl"),
        ({"ttl": "1"}, TypeError, "ttl"),
        ({"ttl": None}, TypeError, "ttl"),
        ({"ttl": 10, "heartbeat_interval": 10}, ValueError, "heartbeat_interval"),
        ({"ttl": 10, "heartbeat_interval": 11}, ValueError, "heartbeat_interval"),
        ({"ttl": 10, "heartbeat_interval": 0}, ValueError, "heartbeat_interval"),
        ({"ttl": 10, "heartbeat_interval": "1"}, TypeError, "heartbeat_interval"),
        ({"blocking_timeout": -1}, ValueError, "blocking_timeout"),
        ({"blocking_timeout": "5"}, TypeError, "blocking_timeout"),
        ({"owner": ""}, ValueError, "owner"),
        ({"lease": 5}, TypeError, "lease"),
        ({"client_or_url": None}, TypeError, "client_or_url"),
        ({"client_or_url": ""}, ValueError, "client_or_url"),
        ({"prefix": "app{}"}, ValueError, "prefix"),
    ],
)
def test_bad_constructor_arguments(
    client: redis.Redis, kwargs: dict[str, Any], error: type[Exception], argument: str
) -> None:
    """Invalid constructor arguments raise ValueError/TypeError whose message names them."""
    arguments: dict[str, Any] = {"client_or_url": client, "name": "bad", "ttl": 5, **kwargs}
    with pytest.raises(error) as excinfo:
        RedisLock(**arguments)
    assert type(excinfo.value) is error
    assert str(excinfo.value).startswith(argument)


@pytest.mark.parametrize(
    ("timeout", "error"), [(-1, ValueError), (-0.001, ValueError), ("1", TypeError)]
)
def test_bad_acquire_timeout(client: redis.Redis, timeout: Any, error: type[Exception]) -> None:
    """acquire() rejects a negative or non-numeric timeout, naming it."""
    lock = RedisLock(client, "bad-timeout", ttl=5)
    with pytest.raises(error) as excinfo:
        lock.acquire(timeout=timeout)
    assert str(excinfo.value).startswith("timeout")
    assert not lock.locked()


@pytest.mark.parametrize(("ttl", "error"), [(0, ValueError), (-5, ValueError), ("9", TypeError)])
def test_bad_extend_ttl(client: redis.Redis, ttl: Any, error: type[Exception]) -> None:
    """extend() rejects a bad TTL, naming it, and leaves the lock as it was."""
    lock = RedisLock(client, "bad-extend", ttl=5)
    assert lock.acquire()
    with pytest.raises(error) as excinfo:
        lock.extend(ttl)
    assert str(excinfo.value).startswith("ttl")
    assert lock.owned()
    lock.release()


# Redis down.


def test_unreachable_server_raises_backend_error(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """Every call against a stopped server raises LockBackendError (a LockError)."""
    server = redislock_server_factory()
    # No client-side retries: each call fails on its first refused connection.
    client = server.client(retry=Retry(NoBackoff(), 0))
    held = RedisLock(client, "down", ttl=30, heartbeat=False)
    assert held.acquire()
    fresh = RedisLock(client, "down", ttl=30, heartbeat=False)
    server.stop()

    calls: list[Callable[[], object]] = [
        fresh.acquire,
        lambda: fresh.acquire(blocking=False),
        held.release,
        held.extend,
        held.locked,
        held.owned,
        held.holder_lease,
        lambda: release_lease(client, "down", "task"),
    ]
    for call in calls:
        with pytest.raises(LockBackendError) as excinfo:
            call()
        assert isinstance(excinfo.value, LockError)
        assert isinstance(excinfo.value.__cause__, redis.ConnectionError)
        assert "'down'" in str(excinfo.value)


def test_unreachable_url_raises_backend_error(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A lock built from the URL of a stopped server raises LockBackendError on acquire."""
    server = redislock_server_factory()
    url = server.url
    server.stop()
    lock = RedisLock(url, "down-url", ttl=5)
    with pytest.raises(LockBackendError) as excinfo:
        lock.acquire(blocking=False)
    assert "down-url" in str(excinfo.value)
    assert lock not in get_heartbeat().held()


# Mutual exclusion under real contention, checked from the recorded history.


def _history_worker(
    url: str,
    name: str,
    counter_key: str,
    threads: int,
    sections: int,
    start: Any,
    out: Any,
) -> None:
    """One process of the mutual-exclusion test: ``threads`` threads, each doing
    ``sections`` critical sections with its own RedisLock object."""
    client = redis.Redis.from_url(url)

    def run() -> None:
        try:
            lock = RedisLock(url, name, ttl=30)
            records: list[tuple[float, float, int]] = []
            start.wait(60)
            for _ in range(sections):
                if not lock.acquire(timeout=60):
                    raise RuntimeError("acquire timed out")
                acquired = time.time()
                token = lock.token
                assert token is not None
                # A deliberately non-atomic read-modify-write.
                value = int(client.get(counter_key) or 0)
                client.set(counter_key, value + 1)
                released = time.time()
                lock.release()
                records.append((acquired, released, token))
            out.put(("ok", records))
        except BaseException as exc:
            out.put(("error", repr(exc)))

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


@pytest.mark.slow
def test_mutual_exclusion_history(redislock_url: str, client: redis.Redis) -> None:
    """8 processes x 3 threads contend for one lock: no two critical sections overlap,
    no increment is lost, and tokens increase in the order the lock was taken."""
    processes, threads, sections = 8, 3, 8
    # Fresh processes, forked from a server that has imported this module once
    # (rather than each importing it again, a second or so apiece).
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    start = ctx.Barrier(processes * threads)
    out = ctx.Queue()
    workers = [
        ctx.Process(
            target=_history_worker,
            args=(redislock_url, "contended", "counter", threads, sections, start, out),
        )
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        results = [out.get(timeout=60) for _ in range(processes * threads)]
    except queue.Empty:
        pytest.fail("a worker thread did not report within 60 s")
    finally:
        for worker in workers:
            worker.join(30)
            if worker.is_alive():
                worker.kill()

    assert [error for status, error in results if status == "error"] == []
    history = sorted(record for _status, records in results for record in records)
    assert len(history) == processes * threads * sections
    assert int(client.get("counter") or 0) == len(history)
    for (_, prev_released, prev_token), (acquired, _, token) in itertools.pairwise(history):
        assert acquired >= prev_released, "two critical sections overlapped"
        assert token > prev_token, "tokens did not increase in acquisition order"
    assert all(worker.exitcode == 0 for worker in workers)
    assert not client.exists(lock_keys("contended").queue)
    assert field(client, lock_keys("contended").lock, OWNER_FIELD) is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.text(min_size=1), prefix=st.sampled_from(["redislock", "app", "x}"]))
def test_name_from_key_inverts_lock_keys(name: str, prefix: str) -> None:
    """name_from_key gives back the name of any lock key, escaped names included."""
    assert name_from_key(lock_keys(name, prefix)[0], prefix) == name


# The holder's description.


def test_holder_info_is_stored_with_the_hold(client: redis.Redis) -> None:
    """holder_info is written with the hold, in the same round trip, and a later holder
    without one blanks it."""
    described = RedisLock(
        client, "described", ttl=30, holder_info={"task": "proj.rebuild", "state": "running"}
    )
    before = described.transport.sends
    assert described.acquire()
    assert described.transport.sends - before <= 2  # one, or two on the script's first use
    values = stored(client, described)
    assert (values[FIELDS["task"]], values[FIELDS["state"]]) == ("proj.rebuild", "running")
    assert FIELDS["node"] not in values  # an empty value is not stored
    described.release()
    plain = RedisLock(client, "described", ttl=30)
    assert plain.acquire()
    assert FIELDS["task"] not in stored(client, plain)
    plain.release()


#: Locks of each shape the acquire script writes: plain, with a lease, described.
SHAPES = pytest.mark.parametrize(
    "options",
    [{}, {"lease": "task-1"}, {"holder_info": {"task": "proj.job", "node": "w1"}}],
    ids=["plain", "lease", "described"],
)


def take_both_ways(client: redis.Redis, locks: list[RedisLock]) -> list[tuple[int, dict[str, str]]]:
    """Take the first of ``locks`` with an acquire that does not wait, the second as
    a waiter would (the script's general path), and assert that both store the same
    fields (ids, tokens and the releases remembered aside), the empty ones at the
    end left out. Returns each one's token and fields as stored, then frees both."""
    quick, waiting = locks
    assert quick.acquire(blocking=False)
    entry = queue_entry("p.1", waiting.owner, 30_000, waiting.lease, waiting._info)
    reply = waiting._run(waiting._acquire_call("1000000001", entry), waiting._call_deadline(None))
    assert reply[0] == Acquired.TAKEN
    raw = [cast(bytes, client.get(lock.key)) for lock in locks]
    assert not raw[0].endswith(b"\x1f")
    assert raw[0].count(b"\x1f") == raw[1].count(b"\x1f")
    taken = [stored(client, lock) for lock in locks]
    aside = {OWNER_FIELD: "", FENCE_FIELD: "", REQUEST_FIELD: "", RELEASED_FIELD: ""}
    assert {**taken[0], **aside} == {**taken[1], **aside}
    quick.release()
    client.delete(waiting.key)
    return [(cast(int, quick.token), taken[0]), (int(reply[1]), taken[1])]


@SHAPES
def test_a_new_name_is_stored_alike_by_either_path_of_the_acquire(
    client: redis.Redis, options: dict[str, Any]
) -> None:
    """A name without a key is written at once by an acquire that does not wait (the
    script's first lines), and by the script's general path for a waiter: both store
    the same fields, the empty ones at the end left out."""
    take_both_ways(client, [RedisLock(client, f"new-{n}", ttl=30, **options) for n in "ab"])


@SHAPES
@pytest.mark.parametrize("queued", [False, True], ids=["alone", "queued"])
def test_a_free_lock_is_taken_alike_by_either_path_of_the_acquire(
    client: redis.Redis, options: dict[str, Any], queued: bool
) -> None:
    """A free lock as a release leaves it when it wakes nobody (its fence, the
    releases it remembers and, while waiters may be queued, the queued flag) is
    also taken at once by an acquire that does not wait: both paths keep the flag
    and the releases, and hand out the next token."""
    locks = [RedisLock(client, f"used-{n}", ttl=30, **options) for n in "ab"]
    before = []
    for lock in locks:
        with lock:
            pass
        if queued:
            write_fields(client, lock.key, **{QUEUED_FIELD: "1"})
        before.append(stored(client, lock))
    for (token, taken), free in zip(take_both_ways(client, locks), before, strict=True):
        assert token > int(free[FENCE_FIELD])
        assert taken[RELEASED_FIELD] == free[RELEASED_FIELD]
        assert taken.get(QUEUED_FIELD) == ("1" if queued else None)


def release_call(lock: RedisLock, token: str) -> Call:
    """The RELEASE call of ``lock``'s usual release (the free key keeps the lock's
    expiry), with the fencing token given as ``token`` (``""``: unknown, so the
    script reads the lock before it writes), and no releases remembered."""
    return Call(
        RELEASE_SCRIPT,
        (lock.key, lock.queue_key),
        (lock.owner, lock.wake_prefix, request_id(), 0, "", token),
    )


def run_call(lock: RedisLock, call: Call) -> Any:
    """Send ``call`` with ``lock``'s transport and return the script's reply."""
    return lock._run(call, lock._call_deadline(None))


def test_a_release_sent_again_after_the_grant_it_made_ran_out_reads_as_not_held(
    client: redis.Redis,
) -> None:
    """The limit of the releases a lock remembers: they live in its key, which,
    once a release handed the lock to a waiter that never confirms it, lives only
    for the grant. The same release sent again within the grant is recognised;
    after it, it answers that the lock was not held, and changes nothing."""
    holder = held_ahead_of_a_gone_waiter(client, "grant-ran-out", gone_ttl_ms=1_000)
    call = release_call(holder, "")
    assert run_call(holder, call) == Released.FREED
    assert run_call(holder, call) == Released.FREED  # recognised: the grant's key remembers it
    assert wait_until(lambda: not client.exists(holder.key), timeout=5)

    assert run_call(holder, call) == Released.NOT_OWNED
    assert not client.exists(holder.key)
    holder.detach()


@pytest.mark.parametrize("ttl", [30.0, 2 * FENCE_TTL_MS / 1000])
@pytest.mark.parametrize("before", ["no key", "a free key", "the hold it undoes"])
def test_an_acquire_arriving_after_its_undo_takes_nothing(
    client: redis.Redis, before: str, ttl: float
) -> None:
    """The undo of an acquire its caller gave up on leaves that acquire's request
    id in the lock's free value, whether it freed the hold the acquire made or
    found the lock free (no key yet, or the free key of an earlier hold): a try of
    the acquire arriving after it (held up on its way) takes nothing. The free
    value lives for the acquire's TTL, and at least the hour a free value keeps
    its fence; any other request takes the lock as usual, with a higher fencing
    token."""
    lock = RedisLock(client, f"undone-{before.replace(' ', '-')}-{ttl:.0f}", ttl=ttl)
    if before == "a free key":
        with lock:
            pass
    request = request_id()
    undo = lock._undo_call(request)
    if before == "the hold it undoes":
        run_call(lock, lock._acquire_call(request))
        assert held(client, lock)
        assert run_call(lock, undo) == Released.FREED
    else:
        assert run_call(lock, undo) == Released.NOT_OWNED
    assert not held(client, lock)
    # (A minute off for the test's own time.)
    assert client.pttl(lock.key) > max(FENCE_TTL_MS, ttl * 1000) - 60_000

    run_call(lock, lock._acquire_call(request))

    assert not held(client, lock)
    fence = int(stored(client, lock)[FENCE_FIELD])
    assert lock.acquire(blocking=False)
    assert lock.token is not None
    assert lock.token > fence
    lock.release()
    assert not held(client, lock)


def test_an_undone_request_id_refuses_no_other_owner(client: redis.Redis) -> None:
    """The undo's mark names the undone acquire's owner too: another owner's
    acquire carrying the same request id (ids are counted per process) takes the
    free lock."""
    lock = RedisLock(client, "undone-other-owner", ttl=30)
    other = RedisLock(client, lock.name, ttl=30)
    request = request_id()
    assert run_call(lock, lock._undo_call(request)) == Released.NOT_OWNED
    run_call(other, other._acquire_call(request))
    assert stored(client, lock)[OWNER_FIELD] == other.owner
    client.delete(lock.key)


def undone_unanswered(lock: RedisLock) -> str:
    """The request id of an acquire of ``lock`` its caller gave up on, undone
    before it reaches the server (it is sent later, as a held-up try would be)."""
    request = request_id()
    run_call(lock, lock._undo_call(request))
    return request


def arrives(lock: RedisLock, request: str) -> None:
    """Acquire ``request`` of ``lock``, reaching the server at last."""
    run_call(lock, lock._acquire_call(request))


@pytest.mark.parametrize("owners", ["one owner", "an owner each"])
def test_each_of_the_last_few_undone_acquires_takes_nothing(
    client: redis.Redis, owners: str
) -> None:
    """Each of the last ``UNDONE_REMEMBERED`` undos of a name leaves its acquire
    listed, not only the last: every one of those acquires, arriving after the
    undos in any order, takes nothing. One more undo pushes the oldest out, and
    that acquire (the limit) then takes the lock."""
    name = f"undone-several-{owners.replace(' ', '-')}"
    first = RedisLock(client, name, ttl=30)
    locks = [
        first if owners == "one owner" else RedisLock(client, name, ttl=30)
        for _ in range(UNDONE_REMEMBERED + 1)
    ]
    requests = [undone_unanswered(lock) for lock in locks]

    for lock, request in reversed(list(zip(locks, requests, strict=True))[1:]):
        arrives(lock, request)
        assert not held(client, lock)
    arrives(locks[0], requests[0])
    assert stored(client, first)[OWNER_FIELD] == locks[0].owner
    client.delete(first.key)


@pytest.mark.parametrize(
    "between",
    [
        "another owner's hold and release",
        "more holds and releases than a lock remembers",
        "another owner's hold the undo finds",
        "a release that woke a waiter gone since it queued",
    ],
)
def test_an_undone_acquire_takes_nothing_after_later_holds_of_its_name(
    client: redis.Redis, between: str
) -> None:
    """The acquires undone are carried through the holds and frees of their name
    that follow (whichever way a hold is taken or freed), and an undo that finds
    the lock held by another owner leaves its acquire listed in that hold: the
    acquire, arriving after them, takes nothing. The free value lives as long as
    it lists undone acquires (the hour an undo keeps them at least), whatever the
    expiry the releasing hold had left, and so does one whose release woke a
    waiter that has gone: the release does not hand it the lock (a grant nobody
    confirms would take the list along as it runs out) but wakes it to ask,
    keeping the free lock for it a moment. Another request takes the lock as
    usual."""
    name = f"undone-then-{between.replace(' ', '-').replace(chr(39), '')}"
    lock = RedisLock(client, name, ttl=30)
    rival = RedisLock(client, name, ttl=30)
    if between == "another owner's hold the undo finds":
        assert rival.acquire(blocking=False)
        request = undone_unanswered(lock)
        assert held(client, rival)
        rival.release()
    elif between.startswith("a release that woke"):
        request = undone_unanswered(lock)
        # (Handed over, the lock would be the gone waiter's for its TTL of 0.1 s.)
        holder = held_ahead_of_a_gone_waiter(client, name, gone_ttl_ms=100)
        holder.release()  # the waiter it wakes never asks, nor confirms a hold
        assert nobody_queued(client, lock)
        assert wait_until(lambda: up_for_anyone(client, lock.key))
    else:
        request = undone_unanswered(lock)
        cycles = RELEASES_REMEMBERED + 1 if between.startswith("more") else 1
        for _ in range(cycles):
            assert rival.acquire(blocking=False)
            rival.release()
    assert not held(client, lock)

    arrives(lock, request)

    assert not held(client, lock)
    assert client.pttl(lock.key) > FENCE_TTL_MS - 60_000
    assert lock.acquire(blocking=False)
    lock.release()


def test_waiters_take_a_lock_whose_name_lists_undone_acquires_in_turn(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """While the lock's value lists undone acquires, a release hands the lock to
    no waiter: it wakes the first queued one to ask, keeping the free lock (and the
    list) for it alone, ahead of the spare woken behind it. The waiters so take it
    one after the other, in the order they queued, each with a higher fencing
    token; a task's waiter (whose description says when its hold began) says
    since when it holds it, not since when it waited. The undone acquire, arriving
    then, takes nothing."""
    holder = RedisLock(client, "undone-waiters", ttl=60)
    request = undone_unanswered(holder)
    assert holder.acquire()
    described = {"task": "t.wait", "state": "running", "node": "w@host", "pid": "42"}
    first_lock = RedisLock(
        client, holder.name, ttl=60, holder_info={**described, "since": lock_module.since_now()}
    )
    first_lock._since_kept = True  # as a SingletonTask's lock
    cleanup.append(first_lock)
    first = Waiter(first_lock, timeout=30)
    assert wait_until(lambda: queued(client, holder) == 1)
    second_lock, second = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)
    began = float(lock_module.since_now())
    assert holder.token is not None

    holder.release()

    assert wait_until(first.done)
    assert (first.error, first.result) == (None, True)
    assert stored(client, holder)[OWNER_FIELD] == first_lock.owner
    assert float(stored(client, holder)[FIELDS["since"]]) >= began
    assert not second.done()
    assert first_lock.token is not None
    assert first_lock.token > holder.token
    first_token = first_lock.token
    first_lock.release()
    assert wait_until(second.done)
    assert (second.error, second.result) == (None, True)
    assert second_lock.token is not None
    assert second_lock.token > first_token
    assert UNDONE_MARK in stored(client, holder)[RELEASED_FIELD]
    second_lock.release()
    arrives(holder, request)
    assert not held(client, holder)


def test_a_waiter_behind_one_gone_takes_a_lock_whose_name_lists_undone_acquires(
    client: redis.Redis, cleanup: list[RedisLock]
) -> None:
    """While the lock's value lists undone acquires, a release wakes the first
    waiter to ask rather than hand it the lock, and keeps the free lock for it
    alone for ``RESERVE_MS``: a first waiter gone since it queued (where a release
    cannot tell) holds the lock up only that long, and the live waiter behind it,
    woken as the spare, takes it then. The undone acquire takes nothing."""
    holder = held_ahead_of_a_gone_waiter(client, "undone-gone-waiter")
    late = RedisLock(client, holder.name, ttl=30)
    request = undone_unanswered(late)
    waiter_lock, waiter = wait_behind(holder, cleanup)
    assert wait_until(lambda: queued(client, holder) == 2)

    holder.release()

    assert OWNER_FIELD not in stored(client, holder)
    assert stored(client, holder)[RESERVED_FIELD] == "gone-process.1"
    assert wait_until(waiter.done, timeout=20)
    assert (waiter.error, waiter.result) == (None, True)
    assert holder.token is not None
    assert waiter_lock.token is not None
    assert waiter_lock.token > holder.token
    arrives(late, request)
    assert stored(client, holder)[OWNER_FIELD] == waiter_lock.owner
    waiter_lock.release()
    arrives(late, request)
    assert not held(client, holder)


@pytest.mark.parametrize("found", ["a hold it did not make", "its re-entry"])
def test_an_undone_acquire_does_not_re_enter_a_later_hold_of_its_owner(
    client: redis.Redis, found: str
) -> None:
    """An undo that finds a hold of its own owner leaves the acquire listed in it,
    whether the acquire did not make that hold (the owner's next acquire took the
    lock) or re-entered it (the undo drops that hold): the acquire, arriving
    (again) during that hold, does not re-enter it (a count the holder's release
    would leave at one), nor takes the lock once it is freed."""
    lock = RedisLock(client, f"undone-own-{found.replace(' ', '-')}", ttl=30)
    request = request_id()
    assert lock.acquire(blocking=False)
    if found == "its re-entry":
        arrives(lock, request)
        assert hold_count(client, lock.key) == 2
    run_call(lock, lock._undo_call(request))
    assert hold_count(client, lock.key) == 1

    arrives(lock, request)
    assert hold_count(client, lock.key) == 1
    lock.release()
    arrives(lock, request)

    assert not held(client, lock)


def test_undone_acquires_go_with_a_hold_that_expires(client: redis.Redis) -> None:
    """The limit of the list of undone acquires: it lives in the lock's key, and
    a hold that ends by its TTL rather than a release takes it along. An undone
    acquire arriving after that takes the lock."""
    lock = RedisLock(client, "undone-then-expired", ttl=30)
    request = undone_unanswered(lock)
    rival = RedisLock(client, lock.name, ttl=0.2, heartbeat=False)
    assert rival.acquire(blocking=False)
    assert wait_until(lambda: not client.exists(lock.key), timeout=5)

    arrives(lock, request)

    assert stored(client, lock)[OWNER_FIELD] == lock.owner
    client.delete(lock.key)
    rival.detach()


def test_undone_acquires_are_kept_only_for_their_time(client: redis.Redis) -> None:
    """A lock that never saw an undo stores no list of undone acquires; one that
    did keeps it for the time the undos asked (the acquire's TTL, an hour at
    least), and the first write after that leaves it out."""
    lock = RedisLock(client, "undone-for-a-time", ttl=30)
    with lock:
        pass
    assert UNDONE_MARK not in stored(client, lock)[RELEASED_FIELD]
    request = request_id()
    brief = Call(
        RELEASE_SCRIPT,
        (lock.key, lock.queue_key),
        (lock.owner, lock.wake_prefix, request_id(), 50, request, "", "", "", "", UNDO_MARK),
    )
    run_call(lock, brief)
    assert UNDONE_MARK in stored(client, lock)[RELEASED_FIELD]
    time.sleep(0.1)

    with lock:
        pass

    assert UNDONE_MARK not in stored(client, lock)[RELEASED_FIELD]
    arrives(lock, request)
    assert held(client, lock)  # no longer refused: its time has passed
    client.delete(lock.key)


def test_a_free_value_of_an_earlier_version_still_refuses_its_undone_acquire(
    client: redis.Redis,
) -> None:
    """A free value an earlier version's undo wrote names the undone acquire in
    its request field (``<request id> <owner>``) alone: that acquire still takes
    nothing, and any other takes the lock."""
    lock = RedisLock(client, "undone-earlier-version", ttl=30)
    request = request_id()
    old = SEPARATOR.join(["", "7", f"{request} {lock.owner}"])
    client.set(lock.key, old, px=FENCE_TTL_MS)

    arrives(lock, request)
    assert not held(client, lock)
    assert lock.acquire(blocking=False)
    assert lock.token is not None
    assert lock.token > 7
    lock.release()


def writes_and_reads(client: redis.Redis) -> tuple[int, int]:
    """(``SET``, ``GET``) calls since the server's statistics were last reset."""
    stats = client.info("commandstats")
    writes, reads = (
        int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in ("set", "get")
    )
    return writes, reads


@SHAPES
@pytest.mark.parametrize("used", [False, True], ids=["new", "used"])
def test_a_lock_is_freed_alike_by_either_path_of_the_release(
    client: redis.Redis, options: dict[str, Any], used: bool
) -> None:
    """The usual release (the last hold, nobody queued, the free key keeping the
    lock's expiry) is one write, which returns the lock as it was, also where the
    lock remembers earlier releases (the acquire returned them). It stores what
    the script's general path (read, then write) stores, and keeps the key's
    expiry."""
    locks = [RedisLock(client, f"freed-{n}", ttl=30, heartbeat=False, **options) for n in "ab"]
    for lock in locks:
        if used:
            with lock:
                pass
        assert lock.acquire(blocking=False)
        client.pexpire(lock.key, 20_000)
    before = [stored(client, lock) for lock in locks]
    client.config_resetstat()
    locks[0].release()
    assert writes_and_reads(client) == (1, 0)
    assert run_call(locks[1], release_call(locks[1], "")) == Released.FREED
    locks[1]._forget()
    raw = [cast(bytes, client.get(lock.key)) for lock in locks]
    assert raw[0].count(b"\x1f") == raw[1].count(b"\x1f")
    for lock, held_as in zip(locks, before, strict=True):
        freed = stored(client, lock)
        assert set(freed) == {FENCE_FIELD, RELEASED_FIELD}
        assert freed[FENCE_FIELD] == held_as[FENCE_FIELD] == str(lock.token)
        released = freed[RELEASED_FIELD].split()
        assert len(released) == (2 if used else 1)
        if used:
            assert released[1] == held_as[RELEASED_FIELD]
        assert 19_000 < client.pttl(lock.key) <= 20_000


def test_a_release_the_one_write_does_not_fit_leaves_the_lock_as_it_was(
    client: redis.Redis,
) -> None:
    """A release whose one write finds something else than its own single hold
    puts back what it found, value and expiry, and answers as the general path
    does: a lock another owner took meanwhile, a lock whose key expired (no key is
    left behind, nor one without expiry), a second hold, a retried release; and
    where only the releases the lock remembers differ from what the caller said,
    it keeps them."""
    lock = RedisLock(client, "put-back", ttl=30, heartbeat=False)
    other = RedisLock(client, "put-back", ttl=30, heartbeat=False)

    # Taken over: the other owner's hold stays as it was.
    assert lock.acquire(blocking=False)
    client.delete(lock.key)
    assert other.acquire(blocking=False)
    client.pexpire(other.key, 12_345)
    before = client.get(other.key)
    with pytest.raises(LockLostError):
        lock.release()
    assert client.get(other.key) == before
    assert 12_000 < client.pttl(other.key) <= 12_345
    other.release()

    # Expired: nothing is left.
    assert lock.acquire(blocking=False)
    client.delete(lock.key)
    with pytest.raises(LockLostError):
        lock.release()
    assert not client.exists(lock.key)

    # A second hold: one is dropped by the general path, the other stays.
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    client.pexpire(lock.key, 12_345)
    lock.release()
    assert stored(client, lock).get(OWNER_FIELD) == lock.owner
    assert COUNT_FIELD not in stored(client, lock)  # one hold: no count stored
    assert 12_000 < client.pttl(lock.key) <= 12_345

    # Retried: the second arrival is recognised and changes nothing.
    retried = release_call(lock, str(lock.token))
    assert run_call(lock, retried) == Released.FREED
    lock._forget()
    after = client.get(lock.key)
    assert run_call(lock, retried) == Released.FREED
    assert client.get(lock.key) == after

    # Releases the lock remembers that the caller did not name: a second write keeps them.
    assert lock.acquire(blocking=False)
    remembered = stored(client, lock)[RELEASED_FIELD]
    call = release_call(lock, str(lock.token))
    client.config_resetstat()
    assert run_call(lock, call) == Released.FREED
    lock._forget()
    assert writes_and_reads(client) == (2, 0)
    assert stored(client, lock)[RELEASED_FIELD] == f"{call.args[2]} {remembered}"


def test_a_release_finding_a_key_of_another_layout_leaves_it_as_it_was(
    client: redis.Redis,
) -> None:
    """The one write of a release is refused by a key of another layout (a hash):
    the release reports it as an acquire does, and the key stays as it was."""
    lock = RedisLock(client, "older-layout-release", ttl=5, heartbeat=False)
    client.hset(lock.key, OWNER_FIELD, lock.owner)
    client.pexpire(lock.key, 5000)
    with pytest.raises(redis.ResponseError, match="not a lock of this version"):
        run_call(lock, release_call(lock, "123"))
    assert client.hgetall(lock.key) == {OWNER_FIELD.encode(): lock.owner.encode()}
    client.delete(lock.key)


def test_holder_info_is_kept_through_changes_to_the_hold(client: redis.Redis) -> None:
    """The scripts keep a holder's description as written (they parse the fields
    before it, not the description itself) while the hold changes: a second hold,
    a waiter queueing, a hold dropped."""
    info = {"task": "proj.rebuild", "state": "running", "node": "w1", "pid": "7", "since": "1.5"}
    described = RedisLock(client, "kept-info", ttl=30, holder_info=info)
    waiter = RedisLock(client, "kept-info", ttl=30)
    assert described.acquire(blocking=False)
    assert described.acquire(blocking=False)
    got, thread = acquire_in_thread(waiter, timeout=5)
    wait_until(lambda: queued(client, described) == 1)
    values = stored(client, described)
    assert {name: values[FIELDS[name]] for name in info} == info
    assert (values[COUNT_FIELD], values[FIELDS["queued"]]) == ("2", "1")
    described.release()
    values = stored(client, described)
    assert {name: values[FIELDS[name]] for name in info} == info
    assert COUNT_FIELD not in values
    described.release()
    thread.join(10)
    assert got == [True]
    assert FIELDS["task"] not in stored(client, waiter)
    waiter.release()


@pytest.mark.parametrize(
    "info",
    [
        {"task": "proj.rebuild", "state": "running", "node": "w1", "pid": "7", "since": "1.5"},
        {"task": "proj.rebuild", "since": "yesterday"},
        {"task": "proj.rebuild"},
    ],
    ids=["all", "some", "no-since"],
)
def test_a_holder_info_given_is_handed_to_a_waiter_as_given(
    client: redis.Redis, cleanup: list[RedisLock], info: dict[str, str]
) -> None:
    """The description a lock is given is stored as given with a hold a release hands
    to it after it waited, its ``since`` too (only a SingletonTask's is made when its
    hold began): no field is added, dropped or rewritten."""
    holder = RedisLock(client, "handed-info", ttl=60)
    assert holder.acquire()
    waiter_lock = RedisLock(client, "handed-info", ttl=60, holder_info=info)
    cleanup.append(waiter_lock)
    handed_over(client, holder, waiter_lock)
    values = stored(client, waiter_lock)
    assert values[REQUEST_FIELD].startswith("g:")  # handed over, not taken by a try
    assert {
        name: values[stored_as]
        for name, stored_as in FIELDS.items()
        if stored_as in values and name in HOLDER_FIELDS
    } == info
    waiter_lock.release()


@pytest.mark.parametrize(
    "info",
    [{"colour": "red"}, {"task": 5}, {"task": "x" * 201}, ["task"]],
    ids=["unknown-field", "not-a-str", "too-long", "not-a-mapping"],
)
def test_holder_info_is_checked(client: redis.Redis, info: object) -> None:
    """A holder description with an unknown field, a non-str or over-long value, or that
    is no mapping, raises naming holder_info."""
    with pytest.raises((TypeError, ValueError)) as excinfo:
        RedisLock(client, "bad-info", ttl=5, holder_info=info)  # type: ignore[arg-type]
    assert "holder_info" in str(excinfo.value)


def test_threads_sharing_one_object_do_not_exclude_each_other(client: redis.Redis) -> None:
    """Two threads sharing one RedisLock share its holds (re-entrant by owner, not by
    thread); each thread with its own object is excluded."""
    shared = RedisLock(client, "shared-object", ttl=10)
    assert shared.acquire()
    results: list[bool] = []
    thread = threading.Thread(target=lambda: results.append(shared.acquire(blocking=False)))
    thread.start()
    thread.join(10)
    assert results == [True]
    own = RedisLock(client, "shared-object", ttl=10)
    thread = threading.Thread(target=lambda: results.append(own.acquire(blocking=False)))
    thread.start()
    thread.join(10)
    assert results == [True, False]
    shared.release()
    shared.release()


def test_contenders_take_turns(client: redis.Redis) -> None:
    """Four threads taking one lock over and over, each asking again at once after its
    release, take turns: a freed lock goes to the waiters it woke, not to the releaser
    coming straight back, so the hold counts stay within a factor of two."""
    counts = [0, 0, 0, 0]
    total = threading.Semaphore(200)
    errors: list[BaseException] = []

    def contend(index: int) -> None:
        lock = RedisLock(client, "turns", ttl=10)
        try:
            while total.acquire(blocking=False):
                assert lock.acquire(timeout=20)
                counts[index] += 1
                time.sleep(0.001)  # the critical section
                lock.release()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert sum(counts) == 200
    assert max(counts) <= 2 * min(counts), counts


def _package_threads() -> int:
    """This process's threads of the package (heartbeat lanes, wake-up hubs)."""
    return sum(1 for thread in threading.enumerate() if thread.name.startswith("celery-redislock"))


def _connected(client: redis.Redis) -> int:
    """How many clients the server has connected."""
    return int(client.info("clients")["connected_clients"])


def _left_behind(client: redis.Redis, connected: int, threads: int) -> tuple[int, int]:
    """Connections to the server and threads of the package above ``connected`` and
    ``threads``, once they are back there (within a bounded wait) or the wait is over."""

    def more() -> tuple[int, int]:
        gc.collect()
        return (max(0, _connected(client) - connected), max(0, _package_threads() - threads))

    wait_until(lambda: more() == (0, 0), timeout=10)
    return more()


def _one_job(url: str, job: int, outcomes: list[str]) -> None:
    """A job of an application that makes a client per job, takes a lock on it and
    releases it: a free lock, one waited for (held by the job's other lock), or one
    released without waiting for the answer (whose outcome goes to ``outcomes``).
    Every other job closes its client; all drop it as they end."""
    own = redis.Redis.from_url(url)
    lock = RedisLock(own, f"per-job-{job}", ttl=10)
    kind = job % 3
    if kind == 0:
        assert lock.acquire(blocking=False)
        lock.release()
    elif kind == 1:
        holder = RedisLock(own, lock.name, ttl=10)
        assert holder.acquire()
        handed_to_a_waiter(own, holder, lock)
    else:
        assert lock.acquire()
        lock.release(wait=False, then=outcomes.append)
    if job % 2:
        own.close()


def test_short_lived_clients_leave_nothing_behind(client: redis.Redis, redislock_url: str) -> None:
    """An application that makes a client per job (a lock taken and released on it,
    the client dropped) leaves nothing behind once it has dropped it: whether the lock
    was free, waited for, or released without waiting for the answer, the
    connections the locks made for the client are closed (their heartbeat lane's,
    and the wake-up subscription's) and the threads made for it end, once the
    answers of the releases that did not wait have been read."""
    gc.collect()
    connected, threads = _connected(client), _package_threads()
    outcomes: list[str] = []
    for job in range(30):
        _one_job(redislock_url, job, outcomes)
    assert _left_behind(client, connected, threads) == (0, 0)
    # The answers owed were read all the same.
    assert outcomes == ["released"] * 10


def test_a_lock_held_after_its_client_is_dropped_is_renewed_and_released(
    client: redis.Redis, redislock_url: str
) -> None:
    """A lock holds on to what it needs: held on a client its user dropped, it is still
    renewed, and releases; once the lock is dropped too, nothing is left behind."""
    gc.collect()
    connected, threads = _connected(client), _package_threads()
    own = redis.Redis.from_url(redislock_url)
    lock = RedisLock(own, "outlives-its-client", ttl=2)
    key = lock.key
    assert lock.acquire()
    del own
    gc.collect()
    for _ in range(2):
        # Renewals set the key's TTL back to the lock's, 2 s, every 2/3 s.
        client.pexpire(key, 1500)
        assert wait_until(lambda: client.pttl(key) > 1600)
    lock.release()
    assert hold_count(client, key) == 0
    del lock
    assert _left_behind(client, connected, threads) == (0, 0)
