"""The lock engine's contract on real deployments: Redis Cluster, Sentinel (a
``master_for`` client and a ``sentinel://`` URL), TLS and an ACL user with the
minimal permissions — plus what is particular to each: one renewal round trip per
Cluster primary, recovery after a Cluster or Sentinel failover, and what a user
lacking a permission is told (and that nothing is written)."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import logging
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from celery import Celery
from packaging.version import Version
from redis.cluster import PRIMARY, RedisCluster
from redis.exceptions import ClusterDownError, MovedError, NoPermissionError, TryAgainError
from redis.sentinel import Sentinel

from celery_redislock import (
    LockBackendError,
    LockLostError,
    RedisLock,
    SingletonTask,
    signals,
    wakeups,
)
from celery_redislock import lock as lock_module
from celery_redislock import transport as transport_module
from celery_redislock.admin import force_release, list_locks, read_lock
from celery_redislock.client import get_client
from celery_redislock.deployments import (
    AclUser,
    ClusterDeployment,
    SentinelDeployment,
    TLSServer,
    create_acl_user,
)
from celery_redislock.heartbeat import Heartbeat, get_heartbeat, send_pending_now
from celery_redislock.ids import request_id
from celery_redislock.lock import lock_keys, release_lease
from celery_redislock.reservations import free_queued, queued_owner
from celery_redislock.revoke import find_and_free_queued
from celery_redislock.scripts import COUNT_FIELD, OWNER_FIELD, QUEUED_FIELD, queue_entry
from celery_redislock.server import RedisServer
from celery_redislock.transport import (
    Client,
    Deadline,
    Router,
    Transport,
    move_slot,
    transport_for,
)
from celery_redislock.wakeups import PROBE_AFTER, hub_for
from tests.proxy import FaultProxy
from tests.support import (
    acquire_in_thread,
    child_environment,
    fields,
    handed_to_a_waiter,
    hold_count,
    migrate_keys,
    migrating,
    node_command,
    queue_entries,
    settle,
    wait_for,
    wait_until,
    write_fields,
)

#: The smallest ACL a lock user needs, as ``ACL SETUSER locker on >password …`` rules
#: (for the default prefix ``redislock``; the patterns follow the prefix):
#:
#: * ``~redislock:*`` the lock key ``redislock:{name}`` and the waiter queue
#:   ``redislock:{name}:waiters`` (both are a script's KEYS, checked before it runs);
#: * ``resetchannels`` then ``&redislock:*`` the wake channels
#:   ``redislock:wake:<process>``: PUBLISH in the release scripts when someone
#:   waits, SUBSCRIBE by a waiting process (a new user has no channel on Redis 7,
#:   every channel on Redis 6.2, which then refuses a channel pattern: the first
#:   rule makes the user alike on both, and is needed on 6.2 only);
#: * ``+evalsha`` every operation, ``+eval`` the first use of a script on a server;
#: * the commands the scripts run (one that follows a first write is checked before it):
#:   GET SET PEXPIRE PTTL TIME ZADD ZRANGE ZREM PUBLISH;
#: * ``+subscribe`` to wait for a release.
#:
#: Nothing else. The engine's connections authenticate with ``AUTH`` (RESP2), which
#: every user may send, and send no ``HELLO``, ``PING``, ``CLIENT SETINFO`` or
#: ``SELECT`` — except ``SELECT`` for a database other than 0, which then needs
#: ``+select``. A redis-py client's own connections send ``CLIENT SETINFO`` (library
#: name and version) and ignore a refusal; on Redis 7.2+ and Valkey each refusal is
#: an entry in ``ACL LOG``, which ``+client|setinfo`` avoids (Redis 7.0 has no such
#: subcommand). :func:`refusals` leaves those entries out.
MINIMAL_ACL: tuple[str, ...] = (
    "~redislock:*",
    "resetchannels",
    "&redislock:*",
    "-@all",
    "+evalsha",
    "+eval",
    "+get",
    "+set",
    "+pexpire",
    "+pttl",
    "+time",
    "+zadd",
    "+zrange",
    "+zrem",
    "+publish",
    "+subscribe",
)

#: Seconds within which a waiter must get a lock after its release (generous: the
#: holder's TTL, which would also free it, is far longer).
WOKEN_WITHIN = 5.0


# The deployments, as the contract sees them.


@dataclass
class Store:
    """A deployment as the lock contract sees it.

    ``target`` is what ``RedisLock`` and ``release_lease`` are given (a client or a
    URL); ``admin_for(key)`` is a default-user client of the primary that holds
    ``key`` now and ``admins()`` one per primary, to look behind the engine.
    """

    kind: str
    target: Client | str
    primary_for: Callable[[str], RedisServer]
    primaries: Callable[[], list[RedisServer]]
    _clients: dict[int, redis.Redis] = field(default_factory=dict)

    def admin_for(self, key: str) -> redis.Redis:
        """A client (default user, every permission) of the primary serving ``key``."""
        return self._admin(self.primary_for(key))

    def admins(self) -> list[redis.Redis]:
        """A client (default user) of every primary."""
        return [self._admin(server) for server in self.primaries()]

    def _admin(self, server: RedisServer) -> redis.Redis:
        client = self._clients.get(server.port)
        if client is None:
            client = self._clients[server.port] = server.client(socket_timeout=5)
        return client

    def close(self) -> None:
        """Close the admin clients."""
        for client in self._clients.values():
            client.close()
        self._clients.clear()


STORES = ("cluster", "sentinel-client", "sentinel-url", "tls", "acl")


@pytest.fixture(scope="module", params=STORES)
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    """Each deployment in turn (the shared session deployments, and an ACL server of
    this module's own with a user that has exactly :data:`MINIMAL_ACL`)."""
    kind: str = request.param
    closers: list[Callable[[], None]] = []
    if kind == "cluster":
        cluster: ClusterDeployment = request.getfixturevalue("redislock_cluster")
        client = cluster.client()
        closers.append(client.close)
        result = Store(kind, client, cluster.primary_for_key, cluster.primaries)
    elif kind.startswith("sentinel"):
        sentinels: SentinelDeployment = request.getfixturevalue("redislock_sentinel")
        target: Client | str
        if kind == "sentinel-client":
            target = sentinels.client(socket_timeout=5)
        else:
            target = get_client(sentinels.sentinel_url, sentinels.transport_options)
        result = Store(kind, target, lambda _key: sentinels.master(), lambda: [sentinels.master()])
    elif kind == "tls":
        tls: TLSServer = request.getfixturevalue("redislock_tls_server")
        result = Store(kind, tls.url, lambda _key: tls, lambda: [tls])
    else:
        server = RedisServer().start()
        closers.append(server.stop)
        user = create_acl_user(server, "locker", "locker-password", MINIMAL_ACL)
        result = Store(kind, user.url, lambda _key: server, lambda: [server])
    yield result
    result.close()
    for close in closers:
        close()


def held_lock_keys(store: Store) -> list[str]:
    """Held locks on every primary (a free lock's key, which keeps its fencing counter
    a while, left out)."""
    found = []
    for admin in store.admins():
        found += [
            k.decode()
            for k in admin.scan_iter("redislock:{*}")
            if k.endswith(b"}") and OWNER_FIELD in fields(admin, k.decode())
        ]
    return found


def keys_without_expiry(store: Store) -> list[str]:
    """Lock keys (free lock keys and waiter queues included) that would never expire."""
    return [
        key.decode()
        for admin in store.admins()
        for key in admin.scan_iter("redislock:*")
        if admin.pttl(key) == -1
    ]


@pytest.fixture
def locks(store: Store) -> Iterator[Store]:
    """The deployment under test; afterwards no lock is left on any primary and
    every remaining key (free lock keys, waiter queues) expires."""
    yield store
    wait_for(lambda: not held_lock_keys(store), timeout=10, what="no lock left")
    assert keys_without_expiry(store) == []


def in_thread(action: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    """Run ``action`` in a thread; its result or exception lands in the returned dict
    with the monotonic time it ended."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = action()
        except BaseException as exc:
            outcome["error"] = exc
        outcome["ended"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


# The contract, on every deployment.


def test_acquire_non_blocking_and_blocking(locks: Store) -> None:
    """A second owner is refused at once, gives up after a blocking timeout, and gets
    the lock with a blocking acquire once the holder released it."""
    name = f"{locks.kind}:acquire"
    first = RedisLock(locks.target, name, ttl=30)
    second = RedisLock(locks.target, name, ttl=30)
    assert first.acquire(blocking=False)
    assert first.locked()
    assert first.owned()
    assert not second.owned()
    assert not second.acquire(blocking=False)
    assert not second.acquire(timeout=0.2)
    first.release()
    assert second.acquire(timeout=5)
    second.release()
    assert not second.locked()


def test_acquire_written_ahead(locks: Store) -> None:
    """An acquire written ahead of its caller (a task's, as the worker accepts it) is
    read and kept later on a single server; on a cluster, where a redirection needs
    the answer, none is written and the caller acquires as usual."""
    lock = RedisLock(locks.target, f"{locks.kind}:ahead", ttl=30)
    ahead = lock._send_acquire()
    if locks.kind == "cluster":
        assert ahead is None
        return
    assert ahead is not None
    assert lock._acquire_sent(ahead)
    assert lock.owned()
    lock.release()
    assert not lock.locked()


def test_reentry_counts_holds(locks: Store) -> None:
    """Acquiring twice counts two holds under one fencing token; the lock stays held
    (and closed to others) until the second release."""
    name = f"{locks.kind}:reentry"
    lock = RedisLock(locks.target, name, ttl=30)
    rival = RedisLock(locks.target, name, ttl=30)
    assert lock.acquire(blocking=False)
    token = lock.token
    assert lock.acquire(blocking=False)
    assert lock.token == token
    admin = locks.admin_for(lock.key)
    assert fields(admin, lock.key).get(COUNT_FIELD) == "2"
    lock.release()
    assert fields(admin, lock.key).get(COUNT_FIELD) is None  # one hold: no count stored
    assert lock.owned()
    assert not rival.acquire(blocking=False)
    lock.release()
    assert not lock.locked()
    assert rival.acquire(blocking=False)
    rival.release()


def test_waiter_is_woken_by_the_release(locks: Store) -> None:
    """A blocked waiter subscribed to the release channel gets the lock right after the
    holder releases it — long before the holder's 60 s TTL would have freed it. Its
    queue entry asks a release to check that its process is still subscribed, on
    every deployment: its subscription is on the server of the queue (on a
    cluster, with a mark of its own: a node counts only for a slot it serves)."""
    name = f"{locks.kind}:waiter"
    holder = RedisLock(locks.target, name, ttl=60)
    waiter = RedisLock(locks.target, name, ttl=30)
    assert holder.acquire(blocking=False)
    thread, outcome = in_thread(lambda: waiter.acquire(timeout=30))
    admin = locks.admin_for(holder.key)
    wait_for(lambda: admin.zcard(holder.queue_key) >= 1, what="the waiter in the queue")
    [(entry, _)] = queue_entries(admin, holder.queue_key)
    assert entry.endswith(b",2]" if locks.kind == "cluster" else b",1]")
    released = time.monotonic()
    holder.release()
    thread.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"] is True
    assert outcome["ended"] - released < WOKEN_WITHIN
    assert waiter.owned()
    waiter.release()


#: A process whose two threads wait for a lock (argv: the lock's name, then a
#: Sentinel URL and the master's name, or a cluster node's port), until killed.
_WAITS = """
import sys, threading
from redis.cluster import RedisCluster
from celery_redislock import RedisLock
from celery_redislock.client import get_client
name, *store = sys.argv[1:]
if len(store) == 2:
    client = get_client(store[0], {"master_name": store[1]})
else:
    client = RedisCluster(host="127.0.0.1", port=int(store[0]))
threads = [
    threading.Thread(target=lambda: RedisLock(client, name, ttl=60).acquire(timeout=120))
    for _ in range(2)
]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
"""


@pytest.mark.parametrize("kind", ["sentinel", "cluster"])
def test_waiters_of_a_killed_process_are_passed_over_on_sentinel_and_cluster(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """On a Sentinel-managed primary or a cluster, as on a single server: a process
    waiting for a lock (two threads) subscribes for its wake-ups on the primary
    that holds the queue; killed, its subscription goes with its connection, and
    the next release takes its waiters out of the queue and hands the lock at
    once to the live waiter behind them, rather than to each dead one for its
    grant."""
    name = f"{kind}-handed-killed"
    client: Client
    if kind == "sentinel":
        sentinels: SentinelDeployment = request.getfixturevalue("redislock_sentinel")
        client = get_client(sentinels.sentinel_url, sentinels.transport_options)
        store = [sentinels.sentinel_url, sentinels.master_name]
        admin = sentinels.master().client()
    else:
        cluster: ClusterDeployment = request.getfixturevalue("redislock_cluster")
        client = request.getfixturevalue("cluster_client")
        store = [str(cluster.primaries()[0].port)]
        admin = cluster.primary_for_key(lock_keys(name)[0]).client()
    holder = RedisLock(client, name, ttl=60)
    assert holder.acquire(blocking=False)
    child = subprocess.Popen(
        [sys.executable, "-c", _WAITS, holder.name, *store], env=child_environment()
    )
    try:
        wait_for(lambda: admin.zcard(holder.queue_key) == 2, timeout=30, what="the child to queue")
        entries = [entry for entry, _ in queue_entries(admin, holder.queue_key)]
        mark = b",2]" if kind == "cluster" else b",1]"
        assert all(entry.endswith(mark) for entry in entries)
        (process,) = {json.loads(entry)[0].split(".")[0] for entry in entries}
        channel = f"{holder.wake_prefix}{process}"
        assert admin.pubsub_numsub(channel) == [(channel.encode(), 1)]
        child.kill()
        child.wait(10)
        wait_for(lambda: admin.pubsub_numsub(channel) == [(channel.encode(), 0)])
        live = RedisLock(client, holder.name, ttl=60)
        got, thread = acquire_in_thread(live, 30)
        wait_for(lambda: admin.zcard(holder.queue_key) == 3, what="the live waiter to queue")
        holder.release()
        assert fields(admin, holder.key).get(OWNER_FIELD) == live.owner
        assert admin.zcard(holder.queue_key) == 0
        thread.join(30)
        assert got == [True]
        live.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(10)
        admin.close()


def test_a_cluster_user_that_may_not_ask_which_slots_a_node_serves_passes_nobody_over(
    redislock_cluster: ClusterDeployment,
) -> None:
    """On a cluster, a release counts the subscribers of a waiter's process only
    once it has read that its node serves the lock's slot (``CLUSTER MYID``,
    ``KEYSLOT`` and ``SLOTS``): one half-way moved to it does not, and the
    waiters there are alive all the same. A user whom the ACL refuses ``CLUSTER
    MYID`` passes nobody over, not even the waiters of a killed process: the
    first is handed the lock, for its grant, as where the release cannot tell.
    Nothing is refused (the release asks the ACL first)."""
    name = "cluster-acl-no-myid"
    rules = ("~*", "&*", "+@all", "-cluster|myid")
    for node in redislock_cluster.nodes:
        node.add_user("no-myid", "no-myid-password", rules)
    client = redislock_cluster.client(username="no-myid", password="no-myid-password")
    holder = RedisLock(client, name, ttl=60)
    admin = redislock_cluster.primary_for_key(holder.key).client()
    child = None
    try:
        admin.execute_command("ACL", "LOG", "RESET")  # type: ignore[no-untyped-call]
        assert holder.acquire(blocking=False)
        child = subprocess.Popen(
            [sys.executable, "-c", _WAITS, holder.name, str(redislock_cluster.nodes[0].port)],
            env=child_environment(),
        )
        wait_for(lambda: admin.zcard(holder.queue_key) == 2, timeout=30, what="the child to queue")
        entries = [entry for entry, _ in queue_entries(admin, holder.queue_key)]
        assert all(entry.endswith(b",2]") for entry in entries)
        (process,) = {json.loads(entry)[0].split(".")[0] for entry in entries}
        channel = f"{holder.wake_prefix}{process}"
        child.kill()
        child.wait(10)
        wait_for(lambda: admin.pubsub_numsub(channel) == [(channel.encode(), 0)])
        holder.release()
        # Handed to the first of the dead waiters; the second is still queued.
        owner = fields(admin, holder.key).get(OWNER_FIELD)
        assert owner not in (None, holder.owner)
        assert admin.zcard(holder.queue_key) == 1
        assert admin.execute_command("ACL", "LOG") == []  # type: ignore[no-untyped-call]
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait(10)
        admin.delete(holder.key, holder.queue_key)
        admin.close()
        client.close()
        for node in redislock_cluster.nodes:
            direct = node.client()
            direct.execute_command("ACL", "DELUSER", "no-myid")  # type: ignore[no-untyped-call]
            direct.close()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["operator", "kill"])
def test_a_sentinel_waiter_through_a_failover_takes_the_lock_on_the_new_primary(
    redislock_sentinel_factory: Callable[..., SentinelDeployment], how: str
) -> None:
    """A waiter queued on a Sentinel-managed primary asks a release to check that its
    process is subscribed there. The primary is failed over with the holder's hold
    and the waiter's entry replicated: killed, the waiter's subscription breaks;
    failed over by an operator's ``SENTINEL FAILOVER``, the old primary, a replica
    now, keeps it, and the process drops it as it learns the switch (here as the
    holder's release is refused there). Either way the waiter asks again, its
    process subscribes on the new primary, and it takes the lock. What the hub
    heard before the switch (a release that passed a waiter of the process over
    on a server that did not count its subscription) no longer keeps its waiters
    from asking to be checked: it subscribes on the primary itself now."""
    deployment = redislock_sentinel_factory(replicas=1, sentinels=3)
    client = get_client(deployment.sentinel_url, deployment.transport_options)
    old = deployment.master()
    direct = old.client()
    holder = RedisLock(client, "sentinel-waiter-failover", ttl=60)
    waiter = RedisLock(client, holder.name, ttl=60)
    try:
        assert holder.acquire(blocking=False)
        hub = hub_for(waiter.transport, waiter.prefix)
        got, thread = acquire_in_thread(waiter, 60)
        wait_for(lambda: direct.zcard(holder.queue_key) == 1, what="the waiter to queue")
        [(entry, _)] = queue_entries(direct, holder.queue_key)
        assert entry.endswith(b",1]")
        # As if a release had passed a waiter of this process over on a server
        # that does not count its subscription.
        hub.unseen = True
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        if how == "operator":
            assert _ask_sentinel(deployment, "FAILOVER", deployment.master_name) == b"OK"
            new = deployment.wait_for_failover(timeout=30, old=old)
        else:
            deployment.kill_master()
            new = deployment.wait_for_failover(timeout=60, old=old)
        admin = new.client()
        try:
            wait_for(
                lambda: fields(admin, holder.key).get(OWNER_FIELD) == holder.owner,
                what="the hold on the new primary",
            )
            holder.release()
            thread.join(30)
            assert got == [True]
            assert fields(admin, holder.key).get(OWNER_FIELD) == waiter.owner
            waiter.release()
            # Subscribed on the new primary (the switch, learnt by the release,
            # dropped a subscription left on the old one), and counted there
            # whatever the hub heard before.
            assert admin.pubsub_numsub(hub.channel) == [(hub.channel.encode(), 1)]
            assert not hub.unseen
        finally:
            admin.close()
    finally:
        direct.close()


def test_fencing_tokens_increase(locks: Store) -> None:
    """Each new holder of a name gets a larger fencing token than every holder before."""
    name = f"{locks.kind}:fence"
    tokens: list[int] = []
    for _ in range(4):
        lock = RedisLock(locks.target, name, ttl=30)
        assert lock.acquire(blocking=False)
        assert isinstance(lock.token, int)
        tokens.append(lock.token)
        lock.release()
    assert tokens == sorted(set(tokens)), tokens


def test_release_lease_frees_the_lock_of_that_lease_only(locks: Store) -> None:
    """release_lease frees a lock held under the given lease (whatever its hold count)
    and nothing else; the holder then finds its lock lost."""
    name = f"{locks.kind}:lease"
    lock = RedisLock(locks.target, name, ttl=30, lease="task-1")
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    assert lock.holder_lease() == "task-1"
    assert not release_lease(locks.target, name, "task-2")
    assert lock.owned()
    assert release_lease(locks.target, name, "task-1")
    assert not lock.locked()
    assert not release_lease(locks.target, name, "task-1")
    with pytest.raises(LockLostError):
        lock.release()


def test_undone_acquires_arriving_after_later_holds_take_nothing(locks: Store) -> None:
    """Two acquires of a name whose callers gave up on them are undone before they
    arrive, the second undo finding another owner's hold, which is then released
    with a waiter queued: the release wakes it to ask rather than hand it the
    lock, and it takes the lock. Both acquires, arriving at last (held up on the
    network), take nothing, and every key the undos wrote keeps an expiry."""
    name = f"{locks.kind}:undone"
    late = [RedisLock(locks.target, name, ttl=30) for _ in range(2)]
    rival = RedisLock(locks.target, name, ttl=30)
    waiter = RedisLock(locks.target, name, ttl=30)
    requests = [request_id() for _ in late]
    late[0]._run(late[0]._undo_call(requests[0]), late[0]._call_deadline(None))
    assert rival.acquire(blocking=False)
    late[1]._run(late[1]._undo_call(requests[1]), late[1]._call_deadline(None))
    thread, outcome = in_thread(lambda: waiter.acquire(timeout=30))
    admin = locks.admin_for(rival.key)
    wait_for(lambda: admin.zcard(rival.queue_key) >= 1, what="the waiter in the queue")
    rival.release()
    thread.join(30)
    assert "error" not in outcome, outcome.get("error")
    assert outcome["result"] is True
    waiter.release()

    for lock, request in zip(late, requests, strict=True):
        lock._run(lock._acquire_call(request), lock._call_deadline(None))

    assert not rival.locked()
    assert rival.acquire(blocking=False)
    rival.release()


def test_an_acquire_listed_as_undone_while_held_keeps_its_hold_and_its_copies_take_nothing(
    locks: Store,
) -> None:
    """An acquire whose caller holds what it took (a later try of it did) is listed
    as undone, its hold left as it is: a copy of it arriving after an inner hold
    of its owner counts no second hold, the holder's release frees the lock, and a
    copy arriving after that takes nothing."""
    name = f"{locks.kind}:listed-while-held"
    lock = RedisLock(locks.target, name, ttl=30)
    request = request_id()
    assert lock._try_acquire(lock._call_deadline(None), request)
    lock._run(lock._undo_call(request, kept=True), lock._call_deadline(None))
    assert lock.locked()
    with lock:
        pass
    lock._run(lock._acquire_call(request), lock._call_deadline(None))
    lock.release()
    assert not lock.locked()

    lock._run(lock._acquire_call(request), lock._call_deadline(None))

    assert not lock.locked()


@pytest.mark.slow
def test_heartbeat_keeps_many_locks_alive_past_several_ttls(locks: Store) -> None:
    """Thirty 1-second locks (on a cluster, spread over every primary) stay held for
    3.5 TTLs by the heartbeat alone, and are freed by their releases."""
    held = [RedisLock(locks.target, f"{locks.kind}:beat:{i}", ttl=1.0) for i in range(30)]
    for lock in held:
        assert lock.acquire(blocking=False)
    primaries = locks.admins()
    pattern = f"redislock:{{{locks.kind}:beat:*}}"  # the lock keys
    per_primary = [sum(1 for _ in admin.scan_iter(pattern)) for admin in primaries]
    assert all(count > 0 for count in per_primary), per_primary
    assert sum(per_primary) == len(held)
    until = time.monotonic() + 3.5
    while time.monotonic() < until:
        lost = [lock.name for lock in held if lock.lost]
        assert not lost, f"lost while held: {lost}"
        time.sleep(0.05)
    assert all(lock.owned() for lock in held)
    rival = RedisLock(locks.target, held[0].name, ttl=1.0)
    assert not rival.acquire(blocking=False)
    for lock in held:
        lock.release()


# Cluster: one renewal round trip per primary, and a failover.


@pytest.fixture(scope="module")
def cluster_client(redislock_cluster: ClusterDeployment) -> Iterator[RedisCluster]:
    """A cluster client for the session cluster."""
    client = redislock_cluster.client()
    yield client
    client.close()


def test_cluster_moved_reply_naming_the_slots_primary_leaves_the_slot_map_as_it_was(
    cluster_client: RedisCluster,
) -> None:
    """A ``MOVED`` that names the slot's primary already changes nothing in the slot
    map, on every redis-py the package admits (before 7.2 it is applied by the
    package's own code, see :func:`~celery_redislock.transport.move_slot`): the
    primary stays first, and a primary."""
    manager = cluster_client.nodes_manager
    slot = cluster_client.keyslot("moved-to-itself")  # type: ignore[no-untyped-call]
    before = list(manager.slots_cache[slot])
    primary = before[0]
    move_slot(manager, MovedError(f"{slot} {primary.host}:{primary.port}"))
    assert manager.slots_cache[slot] == before
    assert primary.server_type == PRIMARY


def test_releases_another_primary_answered_beside_a_failing_one_are_not_kept_past_their_window(
    cluster_client: RedisCluster,
) -> None:
    """While a cluster primary is counted as failing, the releases it answered
    just before wait for its failover until their hold would expire (see
    ``test_cluster_release_waits_for_a_failover_learnt_long_after_it``). The
    releases other primaries answer meanwhile (a cluster that serves its other
    slots, ``cluster-require-full-coverage no``) wait only ``SWITCH_RESEND``, and
    the router's list of them does not keep them past it, though they sit
    behind the one that waits: it holds what waits, not every release since."""
    router = Router(cluster_client)
    failing, other = router.transports()[:2]
    keys = (f"beside-a-failing-primary-{n}" for n in itertools.count())
    failing_key = next(key for key in keys if router.transport(key) is failing)
    other_key = next(key for key in keys if router.transport(key) is other)
    now = time.monotonic()
    router.resend_on_move(failing, failing_key, now, now + 3600, lambda: None)
    # A request to it fails: it is counted as failing (the other nodes, asked
    # where its slots live, name it still).
    assert not router.relocate(failing_key, failing, Deadline(now))
    assert failing in router._failed_at
    aged = now - transport_module.SWITCH_RESEND - 1
    for _ in range(1000):
        router.resend_on_move(other, other_key, aged, now + 3600, lambda: None)
    assert len(router._answered) <= 2 * transport_module._PRUNE_FLOOR
    assert router._answered[0][2] is failing


def test_a_router_whose_cluster_client_was_dropped_asks_its_primaries_nothing(
    redislock_cluster: ClusterDeployment,
) -> None:
    """A release answered lately waits to be sent again should its key move, and
    has the heartbeat ask its primary whether it still serves the key. Once the
    cluster client is garbage-collected, nothing can be sent through it: the
    primary is asked nothing more (rather than the heartbeat failing each time
    it would ask, until the release's hold would have expired)."""
    client = redislock_cluster.client()
    router = Router(client)
    [transport, *_] = router.transports()
    now = time.monotonic()
    router.resend_on_move(transport, "dropped-client", now, now + 3600, lambda: None)
    assert router.move_check_at(transport) is not None
    client.close()
    del client
    gc.collect()
    assert router.move_check_at(transport) is None
    assert transport not in router._latest


def test_cluster_renewal_is_one_round_trip_per_primary(
    redislock_cluster: ClusterDeployment, cluster_client: RedisCluster
) -> None:
    """Renewing thirty locks spread over three primaries writes exactly one request
    (one pipelined round trip) to each primary, and renews every lock."""
    held = [
        RedisLock(cluster_client, f"cluster:round-trip:{i}", ttl=30, heartbeat=False)
        for i in range(30)
    ]
    for lock in held:
        assert lock.acquire(blocking=False)
    nodes = cluster_client.get_primaries()  # type: ignore[no-untyped-call]
    transports = {
        node.port: transport_for(cluster_client.get_redis_connection(node)) for node in nodes
    }
    assert len(transports) == 3
    assert {lock.transport for lock in held} == set(transports.values())
    heartbeat = Heartbeat()
    try:
        heartbeat.renew(held)  # loads the renewal script where it is missing
        admins = {lock.name: redislock_cluster.primary_for_key(lock.key).client() for lock in held}
        for lock in held:
            admins[lock.name].pexpire(lock.key, 5000)
        before = {port: transport.sends for port, transport in transports.items()}
        heartbeat.renew(held)
        after = {port: transport.sends for port, transport in transports.items()}
        assert {port: after[port] - before[port] for port in transports} == dict.fromkeys(
            transports, 1
        )
        for lock in held:
            assert admins[lock.name].pttl(lock.key) > 20_000
        for admin in admins.values():
            admin.close()
    finally:
        heartbeat.stop()
        for lock in held:
            lock.release()


def _cluster_job(cluster: ClusterDeployment, job: int) -> None:
    """A job of an application that makes a cluster client per job: a lock taken
    and released on it, every other one waited for; the client closed and dropped."""
    own = cluster.client()
    holder = RedisLock(own, f"cluster:per-job:{job}", ttl=10)
    assert holder.acquire(blocking=False)
    if job % 2:
        handed_to_a_waiter(own, holder, RedisLock(own, holder.name, ttl=10))
    else:
        holder.release()
    own.close()


def test_cluster_clients_made_per_job_leave_nothing_behind(
    redislock_cluster: ClusterDeployment,
) -> None:
    """An application that makes a cluster client per job leaves nothing behind once
    it drops it: each node's client hands its connections the cluster's own connect
    hook, which the locks' connections hold weakly, so the clients are collected and
    the connections and threads the locks made for them go (a lock waited for
    included: its wake-up subscription)."""
    admins = [server.client() for server in redislock_cluster.primaries()]

    def left() -> tuple[int, int]:
        gc.collect()
        connected = sum(int(admin.info("clients")["connected_clients"]) for admin in admins)
        threads = sum(1 for t in threading.enumerate() if t.name.startswith("celery-redislock"))
        return connected, threads

    before = left()
    for job in range(4):
        _cluster_job(redislock_cluster, job)
    # (Fewer than before, should another test's idle threads end meanwhile.)
    assert wait_until(
        lambda: all(a <= b for a, b in zip(left(), before, strict=True)), timeout=10
    ), (
        left(),
        before,
    )
    for admin in admins:
        admin.close()


@pytest.mark.skipif(
    Version(redis.__version__) < Version("8.2"),
    reason="before redis-py 8.2, a cluster client that knows its nodes only through a "
    "proxy learns their own addresses as it refreshes its slot map, reaches the key's "
    "primary, and the release this test means to fail succeeds",
)
def test_cluster_release_whose_slot_map_cannot_be_refreshed_fails_like_any_release(
    redislock_cluster: ClusterDeployment,
) -> None:
    """A release that finds its primary unreachable, and no node to refresh the slot
    map from (redis-py raises RedisClusterException there, not a RedisError), raises
    LockBackendError as any failed release does: the hold is dropped and the
    heartbeat stops renewing the lock, which is free within a few TTLs (by its
    release, retried in the background, or by its expiry)."""
    name = "cluster:refresh-fails"
    key = lock_keys(name)[0]
    server = redislock_cluster.primary_for_key(key)
    admin = server.client()
    with FaultProxy(server.host, server.port) as proxy:
        # The client knows only the proxy, and reaches the key's primary through it.
        client = RedisCluster(
            host=proxy.host,
            port=proxy.port,
            dynamic_startup_nodes=False,
            address_remap=lambda at: (proxy.host, proxy.port) if at[1] == server.port else at,
        )
        try:
            lock = RedisLock(client, name, ttl=2, call_timeout=1.0)
            assert lock.acquire(blocking=False)
            assert lock in get_heartbeat().held()
            proxy.refuse()
            proxy.reset_all()
            with pytest.raises(LockBackendError, match="could not release") as excinfo:
                lock.release()
            assert isinstance(excinfo.value.__cause__, redis.ConnectionError)
            proxy.heal()
            assert not lock.holding
            assert lock not in get_heartbeat().held()
            wait_for(
                lambda: OWNER_FIELD not in fields(admin, key),
                timeout=10 * lock.ttl,
                what="the lock freed",
            )
        finally:
            client.close()
            admin.delete(key)
            admin.close()


def assert_renewed_there(admin: redis.Redis, lock: RedisLock) -> None:
    """Assert that ``lock`` is on ``admin``'s server under its owner, that the heartbeat
    renews it there (its remaining TTL grows again), and that it is not lost."""
    assert fields(admin, lock.key).get(OWNER_FIELD) == lock.owner
    # The lowest remaining TTL seen: a renewal made just before (one the switch
    # set off) left it near the full TTL, the next one raises it again.
    lowest = [admin.pttl(lock.key)]
    assert lowest[0] > 0

    def renewed() -> bool:
        remaining = admin.pttl(lock.key)
        lowest[0] = min(lowest[0], remaining)
        return lock.lost or remaining > lowest[0] + 300

    wait_for(renewed, timeout=lock.ttl, what=f"a renewal of {lock.name!r} on the new primary")
    assert not lock.lost


def _until_acquired(lock: RedisLock, timeout: float) -> float:
    """Try ``lock.acquire(blocking=False)`` until it succeeds (errors are expected while
    a failover is under way); return how long it took.

    Raises:
        AssertionError: not acquired within ``timeout`` seconds (with the last error).
    """
    started = time.monotonic()
    last: BaseException | None = None
    while time.monotonic() - started < timeout:
        try:
            if lock.acquire(blocking=False):
                return time.monotonic() - started
        except LockBackendError as exc:
            last = exc
        time.sleep(0.1)
    raise AssertionError(f"{lock.name!r} not acquired within {timeout} s; last error: {last}")


def _names_on(
    cluster: ClusterDeployment,
    client: RedisCluster,
    primary: RedisServer,
    prefix: str,
    count: int = 2,
) -> list[str]:
    """``count`` lock names ``<prefix>:<n>`` whose keys live on ``primary``."""
    return [
        name
        for name in (f"{prefix}:{i}" for i in range(150 * count))
        if cluster.primary_for_slot(client.keyslot(lock_keys(name)[0])) is primary  # type: ignore[no-untyped-call]
    ][:count]


@pytest.mark.slow
def test_cluster_locks_keep_working_after_a_primary_fails(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
) -> None:
    """After a primary is killed and its replica promoted, the same RedisCluster client
    takes new locks on the failed-over slots without a restart. Observed for a lock
    held across the failover (replicated with WAIT first, TTL 30 s, renewed every
    3 s): the heartbeat follows its slot to the promoted replica and it stays held,
    renewed there."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    try:
        victim = cluster.primaries()[0]
        on_victim = _names_on(cluster, client, victim, "cluster-failover")
        elsewhere = next(
            name
            for name in (f"cluster-elsewhere:{i}" for i in range(300))
            if cluster.primary_for_slot(client.keyslot(lock_keys(name)[0])) is not victim  # type: ignore[no-untyped-call]
        )
        held = RedisLock(client, on_victim[0], ttl=30, heartbeat_interval=3)
        assert held.acquire(blocking=False)
        direct = victim.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()

        cluster.kill(victim)
        heir = cluster.wait_for_failover(victim, timeout=30)

        fresh = RedisLock(client, on_victim[1], ttl=10)
        _until_acquired(fresh, timeout=20)
        other = RedisLock(client, elsewhere, ttl=10)
        _until_acquired(other, timeout=20)
        admin = heir.client()
        assert held.transport is fresh.transport
        assert_renewed_there(admin, held)
        admin.close()
        for lock in (held, fresh, other):
            lock.release()
        # The one that moved lanes with its slot is off the heartbeat too.
        renewed = get_heartbeat().held()
        assert not [lock for lock in (held, fresh, other) if lock in renewed]
    finally:
        client.close()


def _fail(cluster: ClusterDeployment, node: RedisServer, fault: str) -> None:
    """Make the primary ``node`` fail: killed (SIGKILL), or hung (SIGSTOP: it
    answers nothing, not even a refusal, as behind a network partition)."""
    if fault == "kill":
        cluster.kill(node)
    else:
        cluster.pause(node)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_cluster_held_locks_are_renewed_on_the_replica_promoted_for_their_failed_primary(
    redislock_cluster_factory: Callable[..., ClusterDeployment], fault: str
) -> None:
    """Locks held (and replicated) on a primary that is killed (SIGKILL) or hangs
    (SIGSTOP), with nothing else sent to its slots: the heartbeat's rounds to it
    fail (a hung one's cut short), the other nodes are asked which primary serves
    its slots now, and the renewals follow to the promoted replica before the
    holds expire: none is lost."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    victim = cluster.primaries()[0]
    lost: list[RedisLock] = []
    locks = [
        RedisLock(client, name, ttl=30, heartbeat_interval=2, on_lost=lost.append)
        for name in _names_on(cluster, client, victim, "cluster-renewed")
    ]
    try:
        for lock in locks:
            assert lock.acquire(blocking=False)
        direct = victim.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        _fail(cluster, victim, fault)
        heir = cluster.wait_for_failover(victim, timeout=30)
        admin = heir.client()
        for lock in locks:
            assert_renewed_there(admin, lock)
        admin.close()
        assert lost == []
        for lock in locks:
            lock.release()
    finally:
        if victim.is_paused:
            victim.resume()
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_cluster_delay_just_after_its_primary_died_waits_for_the_failover(
    redislock_cluster_factory: Callable[..., ClusterDeployment], fault: str
) -> None:
    """An ``until_executed`` task sent just after the primary of its lock's slot was
    killed (SIGKILL) or froze (SIGSTOP), while the slot map still names it, is not
    refused: its reservation is asked for again within its call's deadline (5 s,
    longer than the failover: ``cluster-node-timeout`` is 1 s), each try to a
    frozen node cut short (``CLUSTER_TRY``) and the other nodes asked where the
    slot lives now, and is taken once on the promoted replica. The task is sent,
    and a second send is deduplicated to it."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    app = Celery("cluster-failover-send", broker="memory://", set_as_current=False)
    app.conf.update(redislock_client=client)
    victim = cluster.primaries()[0]
    [warm, _] = _names_on(cluster, client, victim, "cluster-failover-send")

    @app.task(
        base=SingletonTask,
        shared=False,
        name="cluster.failover_send",
        lock_strategy="until_executed",
    )
    def reserve(n: int) -> None: ...

    def home(n: int) -> RedisServer:
        slot = client.keyslot(lock_keys(reserve.lock_name((n,), {}))[0])  # type: ignore[no-untyped-call]
        return cluster.primary_for_slot(slot)

    n = next(n for n in range(300) if home(n) is victim)
    name = reserve.lock_name((n,), {})
    try:
        # The connections and scripts in place first, as in a process that has sent before.
        first = RedisLock(client, warm, ttl=10)
        assert first.acquire(blocking=False)
        first.release()
        _fail(cluster, victim, fault)
        sent = reserve.delay(n)
        heir = cluster.wait_for_failover(victim, timeout=30)
        admin = heir.client()
        key = lock_keys(name)[0]
        assert fields(admin, key).get(OWNER_FIELD) == queued_owner(sent.id)
        assert hold_count(admin, key) == 1
        admin.close()
        assert reserve.delay(n).id == sent.id
        assert free_queued(client, name, sent.id, "redislock")
    finally:
        if victim.is_paused:
            victim.resume()
        app.close()
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_cluster_waiter_through_a_failover_is_woken_on_the_promoted_replica(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """A waiter whose wait spans its primary's death (SIGKILL) or hang (SIGSTOP)
    and its replica's promotion moves its wake-up subscription to the promoted
    replica: it leaves the failed node's hub, which (for a dead node) stops
    reconnecting there (no warning each second) while the waiter still waits;
    once it has asked for the lock on the promoted replica, subscribed there,
    and waits again, the holder's release wakes it by a wake-up message, not by
    a re-check (made far longer than the test here). A hung node's
    subscription, whose probe goes unanswered, has the waiter ask the other
    nodes where its key lives now long before the probe gives up."""
    monkeypatch.setattr(lock_module, "RECHECK", 600.0)
    monkeypatch.setattr(lock_module, "UNSUBSCRIBED_RECHECK", 600.0)
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    thread: threading.Thread | None = None
    try:
        victim = cluster.primaries()[0]
        [name, _] = _names_on(cluster, client, victim, "cluster-failover-wait")
        holder = RedisLock(client, name, ttl=30, heartbeat_interval=3)
        assert holder.acquire(blocking=False)
        waiter = RedisLock(client, name, ttl=10, call_timeout=20)
        dead = hub_for(waiter.transport, waiter.prefix)
        thread, outcome = in_thread(lambda: waiter.acquire(timeout=60))
        direct = victim.client()
        wait_for(
            lambda: direct.zcard(waiter.queue_key) == 1,
            timeout=10,
            what="the waiter to queue",
        )
        # The hold and the queued waiter are on the replica before the primary dies.
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()

        _fail(cluster, victim, fault)
        heir = cluster.wait_for_failover(victim, timeout=30)
        wait_for(
            lambda: not dead._waiters or "ended" in outcome,
            timeout=30,
            what="the waiter to leave the failed node's hub",
        )
        if fault == "kill":
            # (A frozen node's hub keeps its silent subscription, idle, for
            # IDLE_EXIT: it does not reconnect either.)
            wait_for(
                lambda: dead._thread is None or "ended" in outcome,
                timeout=30,
                what="the dead node's hub to stop reconnecting",
            )
        assert "ended" not in outcome, outcome.get("error")
        live = hub_for(waiter.transport, waiter.prefix)
        assert live is not dead
        # Subscribed there is not enough: the waiter then asks for the lock on the
        # promoted replica, and only after that reads the subscription. A release
        # before that ask hands the lock to the queued waiter, the ask takes it,
        # and the wake-up is never read. Reading, it has asked and found the lock
        # held: the release comes after that.
        wait_for(
            lambda: (live.subscribed and live._reading.locked()) or "ended" in outcome,
            timeout=30,
            what="the waiter to wait on its new subscription",
        )
        assert "ended" not in outcome, outcome.get("error")
        admin = heir.client()
        assert admin.pubsub_numsub(live.channel) == [(live.channel.encode(), 1)]
        admin.close()
        received = live.received
        holder.release()
        thread.join(30)
        assert outcome.get("result") is True, outcome.get("error")
        assert live.received > received
        assert dead.received == 0
        waiter.release()
    finally:
        if victim.is_paused:
            victim.resume()
        client.close()
        if thread is not None:
            thread.join(60)


def _freed(admin: redis.Redis, key: str) -> bool:
    """Whether no owner holds the lock at ``key`` on ``admin``'s server."""
    return OWNER_FIELD not in fields(admin, key)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["another primary", "the failed primary"])
def test_the_revoke_search_frees_a_reservation_after_a_primary_failed_over(
    redislock_cluster_factory: Callable[..., ClusterDeployment], where: str
) -> None:
    """The search for the locks of revoked tasks (a message still in the broker)
    scans every primary: one that died since the client's slot map was made (its
    replica promoted) does not keep the others from being scanned, and the
    promoted replica is scanned once the map is refreshed. The reservation is
    freed, on a healthy primary or on the promoted one."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    try:
        victim, healthy = cluster.primaries()[:2]
        on = victim if where == "the failed primary" else healthy
        [name, _] = _names_on(cluster, client, on, "revoke-search-failover")
        task_id = f"id-{uuid.uuid4().hex}"
        reservation = RedisLock(
            client, name, ttl=600, owner=queued_owner(task_id), lease=task_id, heartbeat=False
        )
        assert reservation.acquire(blocking=False)
        direct = victim.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        cluster.kill(victim)
        cluster.wait_for_failover(victim, timeout=30)
        wanted = {task_id}
        find_and_free_queued(client, "redislock", wanted)
        assert wanted == set()
        assert not reservation.locked()
    finally:
        client.close()


@pytest.mark.slow
def test_cluster_release_retried_in_the_background_follows_a_failover(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
) -> None:
    """Releases that find their primary dead (SIGKILLed) are retried in the
    background: ``release(wait=False)`` (a task's path: its outcome is then
    ``"retrying"``, or it raises, finding no server to write to) and ``release()``
    (which raises). Once the replica is promoted they
    follow the keys to it and free both locks there, long before their TTL (60 s)
    runs out: they are not retried against the dead node until they give up. So
    does one sent as the process exits (its flush), after the failover.

    A third is an ``until_executed`` execution's, which took its message's
    reservation over; the store then lost the take-over (as a replica that it had
    not reached would: here the reservation is put back, and replicated). Its
    release, retried, finds the reservation there instead of its hold, and the
    reservation's free, sent behind it, frees it too."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    try:
        victim = cluster.primaries()[0]
        names = _names_on(cluster, client, victim, "cluster-dead-release")
        waited, unwaited = (RedisLock(client, name, ttl=60, call_timeout=0.5) for name in names)
        for lock in (waited, unwaited):
            assert lock.acquire(blocking=False)
        [name, _] = _names_on(cluster, client, victim, "cluster-dead-reserved")
        task_id = f"id-{uuid.uuid4().hex}"
        reservation = RedisLock(
            client, name, ttl=60, owner=queued_owner(task_id), lease=task_id, heartbeat=False
        )
        assert reservation.acquire(blocking=False)
        reserved = client.dump(reservation.key)
        assert isinstance(reserved, bytes)
        executed = RedisLock(client, name, ttl=60, lease=task_id, call_timeout=0.5)
        executed._reserved_by = (reservation.owner, reservation.token)
        assert executed.acquire(blocking=False)
        direct = victim.client()
        assert fields(direct, executed.key)[OWNER_FIELD] == executed.owner
        direct.restore(executed.key, 60_000, reserved, replace=True)
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()

        cluster.kill(victim)
        outcomes: list[str] = []
        try:
            # The connection the acquire left open is found closed before the
            # write (its server is gone) and a new one is refused: it raises. Had
            # it been written there, its answer would never come: "retrying".
            unwaited.release(wait=False, then=outcomes.append)
        except LockBackendError as exc:
            outcomes.append(str(exc))
        wait_for(lambda: bool(outcomes), timeout=10, what="the release's outcome")
        assert outcomes[0] == "retrying" or "retried in the background" in outcomes[0]
        for lock in (waited, executed):
            with pytest.raises(LockBackendError, match="retried in the background"):
                lock.release()
        heir = cluster.wait_for_failover(victim, timeout=30)

        admin = heir.client()
        try:
            for lock in (waited, unwaited, executed):
                wait_for(
                    functools.partial(_freed, admin, lock.key),
                    timeout=30,
                    what=f"{lock.name!r} freed on the promoted primary",
                )
                rival = RedisLock(client, lock.name, ttl=10)
                _until_acquired(rival, timeout=10)
                rival.release()
        finally:
            admin.close()

        # Another shard's primary fails: a release retried in the background, left
        # to the process's exit (no background try meanwhile), follows its key too.
        second = next(node for node in cluster.primaries() if node is not heir)
        name = next(
            name
            for name in (f"cluster-dead-exit:{i}" for i in range(300))
            if cluster.primary_for_slot(client.keyslot(lock_keys(name)[0])) is second  # type: ignore[no-untyped-call]
        )
        at_exit = RedisLock(client, name, ttl=60, call_timeout=0.5)
        assert at_exit.acquire(blocking=False)
        direct = second.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        cluster.kill(second)
        with pytest.raises(LockBackendError, match="retried in the background"):
            at_exit.release()
        get_heartbeat().stop()
        admin = cluster.wait_for_failover(second, timeout=30).client()
        try:
            assert not _freed(admin, at_exit.key)
            # What the flush at exit sends (its reading of owed replies left out:
            # what earlier tests left owed in this process is not this test's).
            send_pending_now(Deadline.after(10), final=True)
            assert _freed(admin, at_exit.key)
        finally:
            admin.close()
    finally:
        client.close()


@pytest.mark.slow
def test_cluster_releases_a_primary_lost_in_its_crash_go_again_to_the_promoted_replica(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A primary answers releases and dies before its replica has them (a replica
    is sent writes once they have run): promoted, the replica still has the holds.
    Here the releases reach it, and the holds are put back on it once promoted.
    The next request of the process that finds the primary gone (an acquire of
    another lock of its slots) learns where its slots live now, and the releases
    answered within ``SWITCH_RESEND`` go again there: a ``release()``, a
    ``release(wait=False)``, an ``until_executed`` execution's (with the free of
    its message's reservation, which the replica has in place of the take-over),
    and a ``release_lease``. A release whose key stayed on its primary is not
    sent again: a hold put back there stays. (The heartbeat's own question, which
    could learn the failover before the holds are put back, is shown by
    ``test_cluster_releases_go_again_after_a_failover_an_idle_process_learns_by_itself``.)"""
    # The acquire learns the failover, not the heartbeat: no question is due
    # while the releases wait, however long the failover takes on a loaded machine.
    monkeypatch.setattr(transport_module, "MOVE_RECHECK", 3600.0)
    monkeypatch.setattr(transport_module, "SWITCH_RESEND", 60.0)
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    try:
        victim, healthy = cluster.primaries()[:2]
        names = _names_on(cluster, client, victim, "cluster-crash-release", 5)
        waited, unwaited, other = (RedisLock(client, names[at], ttl=60) for at in (0, 1, 4))
        [kept_name] = _names_on(cluster, client, healthy, "cluster-crash-kept", 1)
        kept = RedisLock(client, kept_name, ttl=60)
        task_id = f"id-{uuid.uuid4().hex}"
        reservation = RedisLock(
            client, names[2], ttl=60, owner=queued_owner(task_id), lease=task_id, heartbeat=False
        )
        assert reservation.acquire(blocking=False)
        reserved = client.dump(reservation.key)
        executed = RedisLock(client, names[2], ttl=60, lease=task_id)
        executed._reserved_by = (reservation.owner, reservation.token)
        leased = RedisLock(client, names[3], ttl=60, lease="a-lease", heartbeat=False)
        for lock in (waited, unwaited, executed, leased, kept):
            assert lock.acquire(blocking=False)
        dumps = {lock.key: client.dump(lock.key) for lock in (waited, unwaited, leased, kept)}
        dumps[executed.key] = reserved

        outcomes: list[str] = []
        waited.release()
        unwaited.release(wait=False, then=outcomes.append)
        executed.release(wait=False, then=outcomes.append)
        assert release_lease(client, leased.name, "a-lease")
        kept.release()
        wait_for(lambda: len(outcomes) == 2, what="the releases' answers")
        assert outcomes == ["released", "released"]
        for server in (victim, healthy):
            direct = server.client()
            assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
            direct.close()

        cluster.kill(victim)
        heir = cluster.wait_for_failover(victim, timeout=30)
        # What the promoted replica would have, had the releases died with the
        # primary; and a hold of a key that did not move.
        for server in (heir, healthy):
            direct = server.client()
            for key, value in dumps.items():
                if cluster.primary_for_slot(client.keyslot(key)) is server:  # type: ignore[no-untyped-call]
                    assert isinstance(value, bytes)
                    direct.restore(key, 60_000, value, replace=True)
            direct.close()
        admin = heir.client()
        try:
            for lock in (waited, unwaited, executed, leased):
                assert not _freed(admin, lock.key)
            # The slot map still names the dead primary: this acquire finds it gone.
            _until_acquired(other, timeout=10)
            other.release()
            for lock in (waited, unwaited, executed, leased):
                wait_for(
                    functools.partial(_freed, admin, lock.key),
                    timeout=10,
                    what=f"{lock.name!r} freed on the promoted replica",
                )
        finally:
            admin.close()
        direct = healthy.client()
        try:
            assert fields(direct, kept.key)[OWNER_FIELD] == kept.owner
        finally:
            direct.close()
    finally:
        client.close()


@pytest.mark.slow
def test_cluster_releases_go_again_after_a_failover_an_idle_process_learns_by_itself(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process that makes no request after its releases (no lock held, nothing
    sent) learns all the same, within ``SWITCH_RESEND``, that their primary failed
    over: the heartbeat's lane of that primary asks it about their keys once a
    ``MOVE_RECHECK`` has passed since the last, and, finding it gone, has the other
    nodes asked where its slots live now. The release is then sent again to the
    promoted replica (what it does there is shown by
    ``test_cluster_releases_a_primary_lost_in_its_crash_go_again_to_the_promoted_replica``;
    here the failover may be learnt before the test could put a hold back in
    place of a lost release). A release on another primary is not sent again."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    sent_again: list[str] = []
    beat = get_heartbeat()
    send_where_it_lives = beat.send_where_it_lives

    def noted(router: Any, call: Any, until: float, what: str) -> None:
        sent_again.append(call.keys[0])
        send_where_it_lives(router, call, until, what)

    monkeypatch.setattr(beat, "send_where_it_lives", noted)
    # However long the failover takes on a loaded machine.
    monkeypatch.setattr(transport_module, "SWITCH_RESEND", 60.0)
    try:
        victim, healthy = cluster.primaries()[:2]
        [name] = _names_on(cluster, client, victim, "cluster-idle-release", 1)
        [kept_name] = _names_on(cluster, client, healthy, "cluster-idle-kept", 1)
        released, kept = (RedisLock(client, n, ttl=60) for n in (name, kept_name))
        for lock in (released, kept):
            assert lock.acquire(blocking=False)
            lock.release()
        cluster.kill(victim)
        heir = cluster.wait_for_failover(victim, timeout=30)
        wait_for(lambda: released.key in sent_again, timeout=10, what="the release sent again")
        assert released.transport is transport_for(
            client.get_redis_connection(client.get_node(host=heir.host, port=heir.port))  # type: ignore[no-untyped-call]
        )
        assert kept.key not in sent_again
    finally:
        client.close()


#: A process that takes a lock on a cluster, releases it once told on its stdin,
#: and exits once told again; while it runs, nothing asks the key's primary
#: whether it still serves the key (``MOVE_RECHECK`` raised). Arguments: a node's
#: port, the lock's name.
_RELEASES_ON_A_CLUSTER_AND_EXITS = """
import atexit, logging, sys, threading
from redis.cluster import RedisCluster
from celery_redislock import RedisLock, transport
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

def refuse_threads():
    # As Python 3.12 and later do at exit (this runs before the flush: last in, first out).
    def refused(thread):
        raise RuntimeError("can't create new thread at interpreter shutdown")
    threading.Thread.start = refused

atexit.register(refuse_threads)
transport.MOVE_RECHECK = 3600.0
# However long the failover takes on a loaded machine.
transport.SWITCH_RESEND = 600.0
port, name = sys.argv[1:]
client = RedisCluster(host="127.0.0.1", port=int(port))
lock = RedisLock(client, name, ttl=60)
assert lock.acquire(blocking=False)
print("acquired", flush=True)
sys.stdin.readline()
lock.release()
print("released", flush=True)
sys.stdin.readline()
"""


@pytest.mark.slow
def test_a_process_that_exits_after_a_cluster_primary_lost_its_release_frees_the_lock_there(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
) -> None:
    """A cluster primary answers a process's release and dies before its replica
    has it: promoted, the replica still has the hold. The process, idle, exits
    before it would have learnt so (the heartbeat asks the primary a
    ``MOVE_RECHECK`` after the release, raised here): as it flushes, it asks the
    primary whether it still serves the key, finds it gone, learns from the
    other nodes where its slots live now, and sends the release there before it
    ends, in its own thread (a process at exit may start none). The lock is not
    left held on the promoted replica until its TTL."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    victim = cluster.primaries()[0]
    [name] = _names_on(cluster, client, victim, "cluster-exit-release", 1)
    key = lock_keys(name)[0]
    child = subprocess.Popen(
        [sys.executable, "-c", _RELEASES_ON_A_CLUSTER_AND_EXITS, str(victim.port), name],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_environment(),
    )
    admin: redis.Redis | None = None
    try:
        assert child.stdin is not None
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "acquired"
        held = client.dump(key)
        assert isinstance(held, bytes)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "released"
        direct = victim.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        cluster.kill(victim)
        heir = cluster.wait_for_failover(victim, timeout=30)
        admin = heir.client()
        # What the promoted replica would have, had the release died with the primary.
        admin.restore(key, 60_000, held, replace=True)
        assert not _freed(admin, key)
        out, _ = child.communicate("\n", timeout=60)
        assert child.returncode == 0, out
        assert _freed(admin, key), out
        assert "answered lately to another primary: sending them again there" in out
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        if admin is not None:
            admin.close()
        client.close()


@dataclass
class _Released:
    """Holds released before their primary fails (see :func:`_release_early_and_late`)."""

    early: RedisLock
    late: RedisLock
    executed: RedisLock
    #: What the store had of each before the releases, by key (for the
    #: execution's key: its message's reservation, which it took over).
    dumps: dict[str, bytes]
    released_at: float


def _release_early_and_late(
    client: Client, early_name: str, late_name: str, executed_name: str, executed_ttl: float
) -> _Released:
    """Take three locks, then release ``early``, and ``late`` 2.5 s later (past a
    ``SWITCH_RESEND`` of 2 s) with an ``until_executed`` execution of
    ``executed_ttl`` that took its message's reservation over (released as a
    task's execution releases: the reservation's free goes with it)."""
    task_id = f"id-{uuid.uuid4().hex}"
    reservation = RedisLock(
        client, executed_name, ttl=60, owner=queued_owner(task_id), lease=task_id, heartbeat=False
    )
    assert reservation.acquire(blocking=False)
    reserved = client.dump(reservation.key)
    executed = RedisLock(client, executed_name, ttl=executed_ttl, lease=task_id)
    executed._reserved_by = (reservation.owner, reservation.token)
    early, late = (RedisLock(client, name, ttl=60) for name in (early_name, late_name))
    for lock in (early, late, executed):
        assert lock.acquire(blocking=False)
    dumps: dict[str, bytes] = {}
    for key, value in (
        (reservation.key, reserved),
        *((lock.key, client.dump(lock.key)) for lock in (early, late)),
    ):
        assert isinstance(value, bytes)
        dumps[key] = value
    early.release()
    time.sleep(2.5)
    late.release()
    outcomes: list[str] = []
    executed.release(wait=False, then=outcomes.append)
    released_at = time.monotonic()
    wait_for(lambda: outcomes == ["released"], what="the execution's release answered")
    return _Released(early, late, executed, dumps, released_at)


@pytest.mark.slow
def test_cluster_release_waits_for_a_failover_learnt_long_after_it(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A failover is learnt a ``cluster-node-timeout`` and an election after the
    primary failed (15 s and more by default), later than ``SWITCH_RESEND``
    after the releases it lost. A release the primary answered within
    ``SWITCH_RESEND`` before a request of the process first found it failing
    (here the heartbeat's question about the key) waits for the failover all the
    same (until its hold would have expired, or ``FAILOVER_WAIT`` for a
    reservation's free): here ``SWITCH_RESEND`` is 2 s, the failover is learnt
    later than that (by an acquire), and the hold put back on the
    promoted replica is freed, and so is the reservation an ``until_executed``
    execution's take-over left there. A release answered more than
    ``SWITCH_RESEND`` before the primary failed is not sent again."""
    monkeypatch.setattr(transport_module, "SWITCH_RESEND", 2.0)
    monkeypatch.setattr(transport_module, "MOVE_RECHECK", 0.2)
    sent_again: list[tuple[str, float]] = []
    beat = get_heartbeat()
    send_where_it_lives = beat.send_where_it_lives

    def noted(router: Any, call: Any, until: float, what: str) -> None:
        sent_again.append((call.keys[0], until))
        send_where_it_lives(router, call, until, what)

    monkeypatch.setattr(beat, "send_where_it_lives", noted)
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    try:
        victim = cluster.primaries()[0]
        names = _names_on(cluster, client, victim, "cluster-late-failover", 4)
        other = RedisLock(client, names[2], ttl=60)
        # The execution's hold outlives the failover by less than FAILOVER_WAIT:
        # the reservation's free waits longer.
        released = _release_early_and_late(client, names[0], names[1], names[3], executed_ttl=20)
        early, late, executed = released.early, released.late, released.executed
        direct = victim.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        cluster.kill(victim)
        # The heartbeat asks the primary about the late release's key, finds it
        # gone, and is then kept from asking again: an acquire learns the
        # failover here, once the holds are put back.
        router = late._router
        wait_for(lambda: router._failed_at, timeout=5, what="the primary found gone")
        monkeypatch.setattr(transport_module, "MOVE_RECHECK", 3600.0)
        heir = cluster.wait_for_failover(victim, timeout=30)
        admin = heir.client()
        try:
            # What the promoted replica would have, had the releases died with
            # the primary.
            for key, value in released.dumps.items():
                admin.restore(key, 60_000, value, replace=True)
            assert not sent_again
            time.sleep(max(0.0, released.released_at + 2.2 - time.monotonic()))
            _until_acquired(other, timeout=10)
            other.release()
            for lock in (late, executed):
                wait_for(
                    functools.partial(_freed, admin, lock.key),
                    timeout=10,
                    what=f"{lock.name!r} freed on the promoted replica",
                )
            assert sorted(key for key, _ in sent_again) == sorted([late.key, *[executed.key] * 2])
            assert not _freed(admin, early.key)
            # The reservation's free may go until FAILOVER_WAIT after the release.
            assert max(until for key, until in sent_again if key == executed.key) >= (
                released.released_at + transport_module.FAILOVER_WAIT - 1.0
            )
        finally:
            admin.close()
    finally:
        client.close()


@pytest.mark.slow
@pytest.mark.parametrize("learnt_by", ["a request", "the heartbeat"])
def test_cluster_release_goes_again_where_a_moved_answer_puts_its_key(
    redislock_cluster_factory: Callable[..., ClusterDeployment], learnt_by: str
) -> None:
    """A ``MOVED`` answer that puts the key of a release answered lately on
    another primary sends the release again there: what follows when a primary
    frozen through a failover comes back, answers a release before it learns
    that its replica replaced it, and then answers ``MOVED``. Here the slot is
    moved on purpose, the holds put back on the primary it moves to before the
    move ends, and the move is learnt by the next acquire of the key, or, in a
    process that sends nothing, by the heartbeat asking the old primary about
    the key: the releases sent again free the holds, and that acquire takes the
    lock. Sent again so: a release answered at once, and one retried in the
    background (its primary frozen as it was sent) that freed its lock once it
    came back."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    client = cluster.client()
    try:
        name = "cluster-moved-release"
        # Another prefix, the same hash tag: the same slot.
        released, retried = (
            RedisLock(client, name, ttl=60, call_timeout=0.3, prefix=prefix)
            for prefix in ("redislock", "retried")
        )
        slot = client.keyslot(released.key)  # type: ignore[no-untyped-call]
        source = cluster.primary_for_slot(slot)
        holds = {}
        for lock in (released, retried):
            assert lock.acquire(blocking=False)
            holds[lock.key] = client.dump(lock.key)
        released.release()
        with (
            source.paused(),
            pytest.raises(LockBackendError, match="retried in the background"),
        ):
            retried.release()
        admin = source.client()
        try:
            wait_for(
                functools.partial(_freed, admin, retried.key),
                what="the release retried in the background to land",
            )
        finally:
            admin.close()
        source, target = migrating(cluster, slot)
        migrate_keys(source, target, slot)
        direct = target.client()
        try:
            # Before the move ends (the source answers ASK, not MOVED, meanwhile),
            # so that no check of the heartbeat learns it first.
            pipe = direct.pipeline(transaction=False)
            for key, held in holds.items():
                assert isinstance(held, bytes)
                pipe.execute_command("ASKING")  # type: ignore[no-untyped-call]
                pipe.restore(key, 60_000, held, replace=True)
            pipe.execute()
            settle(cluster, slot, target)
            if learnt_by == "the heartbeat":
                for key in holds:
                    wait_for(
                        functools.partial(_freed, direct, key), timeout=10, what=f"{key} freed"
                    )
            # Sent to the source first (the map names it): MOVED.
            for lock in (released, retried):
                rival = RedisLock(client, name, ttl=10, prefix=lock.prefix)
                _until_acquired(rival, timeout=10)
                assert fields(direct, lock.key)[OWNER_FIELD] == rival.owner
                rival.release()
        finally:
            direct.close()
    finally:
        client.close()


def _held_then_moved(cluster: ClusterDeployment, held: RedisLock) -> tuple[Transport, RedisServer]:
    """Take ``held``, then move its slot whole to another primary; return the
    lock's transport before the move and the slot's new primary."""
    assert held.acquire(blocking=False)
    old = held.transport
    slot = held.client.keyslot(held.key)  # type: ignore[union-attr]
    source, target = migrating(cluster, slot)
    migrate_keys(source, target, slot)
    settle(cluster, slot, target)
    return old, target


def _held_half_moved(
    cluster: ClusterDeployment, client: RedisCluster, name: str, ttl: float
) -> tuple[RedisLock, int, RedisServer]:
    """A lock taken, then its slot half-way moved to another primary: its keys are
    there, the slot is not yet. Returns the lock, its slot and the new primary."""
    held = RedisLock(client, name, ttl=ttl)
    assert held.acquire(blocking=False)
    slot = client.keyslot(held.key)  # type: ignore[no-untyped-call]
    source, target = migrating(cluster, slot)
    migrate_keys(source, target, slot)
    return held, slot, target


def test_cluster_locks_follow_their_slot_through_a_migration(
    resharding_cluster: ClusterDeployment,
) -> None:
    """A slot moved to another primary while its lock is held (resharding): half-way
    (the key moved, the slot not yet: ASK), the holder's calls follow the key to
    its new primary, and a request about both of the name's keys waits for the
    slot to settle (TRYAGAIN); once the slot has moved (MOVED), the heartbeat
    renews the held lock there, and it is released there. Nothing is reported
    lost."""
    cluster = resharding_cluster
    client = cluster.client()
    try:
        held, slot, target = _held_half_moved(cluster, client, "migrating", ttl=3)
        held.extend()
        assert held.locked()
        # A request about both of the name's keys (the lock and its waiter queue)
        # meets TRYAGAIN while they may be split between the two primaries: it is
        # sent again until the slot has moved.
        other = RedisLock(client, "migrating", ttl=3)
        taken: list[bool] = []
        trying = threading.Thread(target=lambda: taken.append(other.acquire(blocking=False)))
        trying.start()
        time.sleep(0.3)
        settle(cluster, slot, target)
        trying.join(10)
        assert taken == [False]
        admin = target.client()
        assert_renewed_there(admin, held)
        admin.close()
        held.release()
        assert other.acquire(blocking=False)
        assert other.token is not None
        assert held.token is not None
        assert other.token > held.token
        other.release()
        assert not held.lost
    finally:
        client.close()


def test_a_cluster_waiter_whose_slot_moves_takes_the_lock_on_its_new_primary(
    resharding_cluster: ClusterDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter queued on a cluster primary asks a release to check that its
    process is subscribed there. Its slot then moves to another primary
    (resharding), the queue with it, while its process stays subscribed on the
    first. The holder's release on the new primary passes it over if it counts
    no subscriber of the process there (the message that says so reaches every
    node of a cluster, the waiter's hub among them, which no longer has its
    waiters checked; the process's hub on a third node hears it too, and still
    has its own checked), or hands it the lock: either way the waiter takes the
    lock, its re-checks put off so that nothing else can bring it. The first
    primary still counts the process's hub there: the next waiter of a key that
    lives there asks to be checked."""
    monkeypatch.setattr(lock_module, "RECHECK", 600.0)
    monkeypatch.setattr(lock_module, "UNSUBSCRIBED_RECHECK", 600.0)
    cluster = resharding_cluster
    client = cluster.client()
    try:
        holder = RedisLock(client, "slot-moves-under-a-waiter", ttl=30)
        assert holder.acquire(blocking=False)
        waiter = RedisLock(client, holder.name, ttl=30)
        hub = hub_for(waiter.transport, waiter.prefix)
        got, thread = acquire_in_thread(waiter, 60)
        slot = client.keyslot(holder.key)  # type: ignore[no-untyped-call]
        source = cluster.primary_for_slot(slot)
        admin = source.client()
        wait_for(lambda: admin.zcard(holder.queue_key) == 1, what="the waiter to queue")
        [(entry, _)] = queue_entries(admin, holder.queue_key)
        assert entry.endswith(b",2]")
        admin.close()
        source, target = migrating(cluster, slot)
        migrate_keys(source, target, slot)
        settle(cluster, slot, target)
        admin = target.client()
        [(_, seen)] = admin.pubsub_numsub(hub.channel)
        admin.close()
        # The process's hub on the third primary, read by a waiter of its own
        # that nothing wakes: it hears what the release publishes too.
        [third] = [node for node in cluster.primaries() if node not in (source, target)]
        node = client.get_node(host=third.host, port=third.port)  # type: ignore[no-untyped-call]
        bystander = hub_for(transport_for(client.get_redis_connection(node)), waiter.prefix)
        idle = bystander.join()
        assert bystander.wait_ready(Deadline.after(10))
        heard = bystander.received
        reading = threading.Thread(target=bystander.wait, args=(idle, 3.0))
        reading.start()
        holder.release()
        thread.join(30)
        reading.join(10)
        bystander.leave(idle)
        assert got == [True]
        assert hub.unseen == (seen == 0)
        assert bystander.received > heard
        assert not bystander.unseen
        waiter.release()
        # The first primary counts its hub all the same: a waiter of a key that
        # lives there still asks to be checked.
        [name] = _names_on(cluster, client, source, "still-on-the-first-primary", 1)
        holder = RedisLock(client, name, ttl=30)
        assert holder.acquire(blocking=False)
        waiter = RedisLock(client, name, ttl=30)
        assert hub_for(waiter.transport, waiter.prefix) is hub
        got, thread = acquire_in_thread(waiter, 30)
        admin = source.client()
        wait_for(lambda: admin.zcard(holder.queue_key) == 1, what="the second waiter to queue")
        [(entry, _)] = queue_entries(admin, holder.queue_key)
        admin.close()
        assert entry.endswith(b",2]")
        holder.release()
        thread.join(30)
        assert got == [True]
        waiter.release()
    finally:
        client.close()


def test_a_cluster_release_on_a_slot_half_moved_hands_the_lock_to_its_live_waiter(
    resharding_cluster: ClusterDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter queued on a cluster primary asks a release to check that its
    process is subscribed there. The slot then starts to move to another
    primary, and the lock's keys move before the slot does (resharding under
    way): the holder's release runs on the new primary (``ASK``), which counts no
    subscriber of the waiter's process (it subscribes on the first, which still
    serves the slot). The release hands the waiter the lock all the same rather
    than pass it over: passed over, it would ask again, and a request about both
    of the lock's keys is refused (``TRYAGAIN``) until the move ends. Its
    re-checks are put off, so that nothing else can bring it the lock."""
    monkeypatch.setattr(lock_module, "RECHECK", 600.0)
    monkeypatch.setattr(lock_module, "UNSUBSCRIBED_RECHECK", 600.0)
    cluster = resharding_cluster
    client = cluster.client()
    try:
        # A prefix of its own: no hub of this process on the new primary.
        holder = RedisLock(client, "half-moved-under-a-waiter", ttl=30, prefix="half-moved")
        assert holder.acquire(blocking=False)
        waiter = RedisLock(client, holder.name, ttl=30, prefix=holder.prefix)
        hub = hub_for(waiter.transport, waiter.prefix)
        got, thread = acquire_in_thread(waiter, 20)
        slot = client.keyslot(holder.key)  # type: ignore[no-untyped-call]
        admin = cluster.primary_for_slot(slot).client()
        wait_for(lambda: admin.zcard(holder.queue_key) == 1, what="the waiter to queue")
        [(entry, _)] = queue_entries(admin, holder.queue_key)
        admin.close()
        assert entry.endswith(b",2]")
        source, target = migrating(cluster, slot)
        migrate_keys(source, target, slot)
        admin = target.client()
        [(_, seen)] = admin.pubsub_numsub(hub.channel)
        admin.close()
        assert seen == 0
        holder.release()
        thread.join(30)
        assert got == [True]
        assert not hub.unseen
        settle(cluster, slot, target)
        waiter.release()
    finally:
        client.close()


def test_cluster_renewals_follow_a_key_whose_slot_is_moving(
    resharding_cluster: ClusterDeployment,
) -> None:
    """While its slot is half-way moved (the key on the new primary, the slot not
    yet: ASK), the heartbeat renews the lock there: held through several TTLs of
    the move, it is not lost."""
    cluster = resharding_cluster
    client = cluster.client()
    try:
        held, slot, target = _held_half_moved(cluster, client, "migrating-renewed", ttl=1.5)
        time.sleep(3 * held.ttl)
        assert not held.lost
        settle(cluster, slot, target)
        admin = target.client()
        assert fields(admin, held.key).get(OWNER_FIELD) == held.owner
        admin.close()
        held.release()
    finally:
        client.close()


@pytest.mark.parametrize("dropped", [False, True], ids=["kept", "dropped"])
def test_cluster_release_read_later_follows_its_moving_slot(
    resharding_cluster: ClusterDeployment, dropped: bool
) -> None:
    """A release whose answer is read later (a task's), written to the old primary
    while its slot moves (ASK), is sent again in the background and lands where
    the key is now, freeing the lock, rather than leave it to its TTL; even once
    the lock object is gone, as a task's is when the task has ended."""
    cluster = resharding_cluster
    client = cluster.client()
    try:
        held, slot, target = _held_half_moved(cluster, client, "migrating-release", ttl=60)
        key = held.key
        held.release(wait=False)
        if dropped:
            del held
            gc.collect()
        time.sleep(0.3)
        settle(cluster, slot, target)
        admin = target.client()
        wait_for(
            lambda: OWNER_FIELD not in fields(admin, key),
            timeout=20,
            what="the release to land on the new primary",
        )
        admin.close()
        again = RedisLock(client, "migrating-release", ttl=10)
        assert again.acquire(blocking=False)
        again.release()
    finally:
        client.close()


def test_cluster_release_refused_before_any_key_of_its_moving_slot_moved_says_why(
    redislock_cluster: ClusterDeployment,
) -> None:
    """While a held lock's slot is being moved, before any of its keys has, Redis
    refuses a request about both of its keys (TRYAGAIN) as the lock has no waiter
    queue: only one of the two keys is there. A release() that cannot wait for the
    move says so, not that the keys are split between two primaries, and what to
    do; sent again in the background, it lands once the move is called off."""
    client = redislock_cluster.client()
    lock = RedisLock(client, "moving-unmoved", ttl=30, call_timeout=0.3)
    assert lock.acquire(blocking=False)
    slot = client.keyslot(lock.key)  # type: ignore[no-untyped-call]
    source, target = migrating(redislock_cluster, slot)
    admin = source.client()
    try:
        with pytest.raises(LockBackendError, match="could not release") as excinfo:
            lock.release()
        assert isinstance(excinfo.value.__cause__, TryAgainError)
        said = str(excinfo.value)
        assert "only one of the two keys is on the primary it reaches" in said
        assert "not existing at all (a lock with no waiters has no queue" in said
        assert "split between" not in said
        assert "redis-cli --cluster fix" in said
        assert "retried in the background" in said
    finally:
        for node in (target, source):
            node_command(node, "CLUSTER", "SETSLOT", slot, "STABLE")
    try:
        wait_for(
            lambda: OWNER_FIELD not in fields(admin, lock.key),
            timeout=30,
            what="the release to land once the move is called off",
        )
    finally:
        admin.delete(lock.key)
        admin.close()
        client.close()


# Cluster: a shard's failover, during which every node answers CLUSTERDOWN.


@pytest.fixture(scope="module")
def failover_cluster() -> Iterator[ClusterDeployment]:
    """Three primaries with a replica each, for the failovers of this module's tests
    (each one fails over a shard and leaves the cluster settled again)."""
    with ClusterDeployment(masters=3, replicas_per_master=1) as cluster:
        yield cluster


def _names_elsewhere(
    cluster: ClusterDeployment,
    client: RedisCluster,
    victim: RedisServer,
    prefix: str,
    count: int = 2,
) -> list[str]:
    """``count`` lock names whose keys live on one primary other than ``victim``."""
    homes: dict[int, list[str]] = {}
    for name in (f"{prefix}:{i}" for i in range(1000)):
        home = cluster.primary_for_slot(client.keyslot(lock_keys(name)[0]))  # type: ignore[no-untyped-call]
        if home is not victim:
            homes.setdefault(home.port, []).append(name)
            if len(homes[home.port]) == count:
                return homes[home.port]
    raise AssertionError(f"no {count} names on one healthy primary")


def _cluster_state(node: RedisServer) -> str:
    info = node_command(node, "CLUSTER", "INFO")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return next(line for line in text.splitlines() if line.startswith("cluster_state:"))


def _replica_of(node: RedisServer) -> int | None:
    """The port of the primary ``node`` replicates (``None`` for a primary)."""
    role = node_command(node, "ROLE")
    return int(role[2]) if role[0] in (b"slave", "slave") else None


@contextlib.contextmanager
def _shard_failing_over(
    cluster: ClusterDeployment, victim: RedisServer, healthy: RedisServer
) -> Iterator[Callable[[], None]]:
    """Freeze ``victim`` (SIGSTOP), a primary, and hold its failover back (its
    replica's ``cluster-replica-no-failover``) until the block calls what this
    yields: meanwhile the cluster is down, and ``healthy`` (another primary)
    answers ``CLUSTERDOWN`` to every request about a key. The call lets the
    replica take over and waits for the cluster to be up again. The frozen node
    goes on afterwards and rejoins as a replica; the cluster is left settled."""
    replica = next(node for node in cluster.nodes if _replica_of(node) == victim.port)

    def fail_over() -> None:
        node_command(replica, "CONFIG", "SET", "cluster-replica-no-failover", "no")
        wait_for(
            lambda: _cluster_state(healthy) == "cluster_state:ok",
            timeout=30,
            what="the replica's take-over",
        )

    node_command(replica, "CONFIG", "SET", "cluster-replica-no-failover", "yes")
    try:
        victim.pause()
        try:
            wait_for(
                lambda: _cluster_state(healthy) == "cluster_state:fail",
                timeout=30,
                what="the cluster to find the frozen primary failed",
            )
            yield fail_over
        finally:
            node_command(replica, "CONFIG", "SET", "cluster-replica-no-failover", "no")
            victim.resume()
    finally:
        cluster.wait_until_ok(30)


@pytest.mark.slow
def test_cluster_releases_refused_while_a_shard_fails_over_land_once_it_is_up(
    failover_cluster: ClusterDeployment,
) -> None:
    """While another shard fails over, the cluster is down and a healthy primary
    answers CLUSTERDOWN (refused unrun). A release() there that cannot wait for the
    failover in its call_timeout raises, saying why, and a release(wait=False) (a
    task's) learns the same from its answer; both are sent again in the background
    and free their locks once the cluster is up, rather than leave them to their
    TTL: another caller takes them. A lock held through the failover there is
    renewed again after it, not lost."""
    cluster = failover_cluster
    client = cluster.client()
    try:
        victim = cluster.primaries()[0]
        *names, kept_name = _names_elsewhere(cluster, client, victim, "clusterdown-release", 3)
        healthy = cluster.primary_for_slot(client.keyslot(lock_keys(kept_name)[0]))  # type: ignore[no-untyped-call]
        waited = RedisLock(client, names[0], ttl=60, call_timeout=0.5)
        later = RedisLock(client, names[1], ttl=60)
        kept = RedisLock(client, kept_name, ttl=30, heartbeat_interval=3)
        for lock in (waited, later, kept):
            assert lock.acquire(blocking=False)
        admin = healthy.client()
        outcomes: list[str] = []
        with _shard_failing_over(cluster, victim, healthy) as fail_over:
            with pytest.raises(LockBackendError, match="CLUSTERDOWN") as excinfo:
                waited.release()
            assert isinstance(excinfo.value.__cause__, ClusterDownError)
            assert "retried in the background" in str(excinfo.value)
            later.release(wait=False, then=outcomes.append)
            # Its answer, read now rather than by the heartbeat's thread (which may
            # be busy asking the refusing server again meanwhile).
            later.transport.drain(Deadline.after(5))
            wait_for(lambda: outcomes, timeout=30, what="the answer to the release")
            assert outcomes == ["retrying"]
            fail_over()
            for lock in (waited, later):
                wait_for(
                    lambda lock=lock: OWNER_FIELD not in fields(admin, lock.key),  # type: ignore[misc]
                    timeout=30,
                    what=f"the release of {lock.name!r} to land",
                )
        remaining = admin.pttl(kept.key)
        wait_for(
            lambda: kept.lost or admin.pttl(kept.key) > remaining,
            timeout=kept.ttl,
            what="a renewal of the lock held through the failover",
        )
        assert not kept.lost
        assert fields(admin, kept.key).get(OWNER_FIELD) == kept.owner
        kept.release()
        admin.close()
        for name in names:
            rival = RedisLock(client, name, ttl=10)
            assert rival.acquire(blocking=False)
            rival.release()
    finally:
        client.close()


@pytest.mark.slow
def test_cluster_acquire_while_a_shard_fails_over_waits_for_it_within_its_deadline(
    failover_cluster: ClusterDeployment,
) -> None:
    """An acquire on a healthy primary while another shard fails over (CLUSTERDOWN,
    refused unrun) is asked again within its call_timeout rather than failing at
    once, and takes the lock once the cluster is up: held once, with a fencing
    token above the last holder's."""
    cluster = failover_cluster
    client = cluster.client()
    try:
        victim = cluster.primaries()[0]
        name, _ = _names_elsewhere(cluster, client, victim, "clusterdown-acquire")
        healthy = cluster.primary_for_slot(client.keyslot(lock_keys(name)[0]))  # type: ignore[no-untyped-call]
        first = RedisLock(client, name, ttl=10)
        assert first.acquire(blocking=False)
        first.release()
        lock = RedisLock(client, name, ttl=30, call_timeout=60)
        transport = lock.transport
        with _shard_failing_over(cluster, victim, healthy) as fail_over:
            before = transport.sends
            thread, outcome = in_thread(lambda: lock.acquire(blocking=False))
            wait_for(
                lambda: transport.sends >= before + 3 or "ended" in outcome,
                timeout=30,
                what="the acquire to be refused and asked again",
            )
            assert "ended" not in outcome, outcome.get("error")
            fail_over()
            thread.join(60)
        assert outcome.get("result") is True, outcome.get("error")
        assert first.token is not None
        assert lock.token is not None
        assert lock.token > first.token
        admin = healthy.client()
        assert fields(admin, lock.key).get(OWNER_FIELD) == lock.owner
        assert hold_count(admin, lock.key) == 1
        admin.close()
        lock.release()
    finally:
        client.close()


# Sentinel: a Sentinel that does not answer.


def test_sentinel_that_never_answers_holds_up_no_call(
    redislock_sentinel: SentinelDeployment,
) -> None:
    """A Sentinel that takes connections and never answers, first in the list and
    with no timeout of its own (redis-py would wait for it for ever), gets only a
    share of the call's deadline: the next Sentinel names the primary and the lock
    is taken and released."""
    stalled = socket.create_server(("127.0.0.1", 0))  # it never accepts a connection
    hosts = [stalled.getsockname()[:2], *redislock_sentinel.sentinel_hosts]
    sentinel = Sentinel(hosts, sentinel_kwargs={"socket_timeout": None})  # type: ignore[no-untyped-call,unused-ignore]
    client: redis.Redis = sentinel.master_for(redislock_sentinel.master_name)  # type: ignore[no-untyped-call,unused-ignore]
    lock = RedisLock(client, "sentinel:stalled-first", ttl=30, call_timeout=3.0, heartbeat=False)
    thread, outcome = in_thread(lambda: lock.acquire(blocking=False))
    try:
        wait_for(lambda: "ended" in outcome, timeout=30, what="the acquire to return")
        assert outcome.get("result") is True, outcome.get("error")
        lock.release()
    finally:
        stalled.close()
        thread.join(5)
        client.close()


# Sentinel: a failover.


@pytest.mark.slow
def test_sentinel_locks_keep_working_after_a_failover(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
) -> None:
    """After the primary is killed and a replica promoted, the same master_for client
    and the same sentinel:// URL client take new locks on the new primary without a
    restart. Observed for a lock held across the failover (replicated with WAIT
    first, TTL 30 s, renewed every 3 s): the promoted replica has it, the heartbeat
    renews it there once the Sentinels name the new primary, and it stays held."""
    deployment = redislock_sentinel_factory(replicas=1, sentinels=3)
    by_client = deployment.client(socket_timeout=5)
    by_url = get_client(deployment.sentinel_url, deployment.transport_options)
    held = RedisLock(by_client, "sentinel-failover:held", ttl=30, heartbeat_interval=3)
    assert held.acquire(blocking=False)
    direct = deployment.master().client()
    assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
    direct.close()

    old = deployment.kill_master()
    new = deployment.wait_for_failover(timeout=30, old=old)

    taken = []
    for target, name in (
        (by_client, "sentinel-failover:client"),
        (by_url, "sentinel-failover:url"),
    ):
        lock = RedisLock(target, name, ttl=10)
        _until_acquired(lock, timeout=20)
        taken.append(lock)
    admin = new.client()
    assert_renewed_there(admin, held)
    assert {key.decode() for key in admin.scan_iter("redislock:{*}")} >= {
        held.key,
        *(lock.key for lock in taken),
    }
    admin.close()
    for lock in (held, *taken):
        lock.release()
    by_client.close()


@pytest.mark.slow
def test_a_primary_frozen_through_a_failover_gives_no_second_hold_when_it_comes_back(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
) -> None:
    """A primary frozen (SIGSTOP) through a failover comes back still answering as a
    primary, its copy of a lock expired, while the holder renews the lock on the new
    primary. Another client, whose idle connection from before the freeze points at
    the old primary, asks the Sentinels before reusing it: its acquire goes to the
    new primary and is refused, and it never gets a second hold renewed beside the
    first. The heartbeat reports every round under the same ``sentinel:<service>``
    whichever server is primary."""
    deployment = redislock_sentinel_factory(replicas=1, sentinels=3)
    senders: list[Any] = []

    def on_round(sender: Any = None, **_: Any) -> None:
        senders.append(sender)

    signals.heartbeat_round.connect(on_round, weak=False, dispatch_uid="frozen-primary")
    holder_client, other_client = deployment.client(), deployment.client()
    held = RedisLock(holder_client, "sentinel-frozen:held", ttl=8)
    second = RedisLock(other_client, held.name, ttl=8)
    old = deployment.master()
    try:
        assert held.acquire(blocking=False)
        probe = RedisLock(other_client, "sentinel-frozen:probe", ttl=3, heartbeat=False)
        assert probe.acquire(blocking=False)
        probe.release()  # the other client keeps an idle connection to this primary
        direct = old.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        frozen_at = time.monotonic()
        with old.paused():
            new = deployment.wait_for_failover(timeout=30, old=old)
            admin = new.client()
            assert_renewed_there(admin, held)
            # The old primary's copy of the lock expires while it is frozen.
            time.sleep(max(0.0, frozen_at + held.ttl + 0.5 - time.monotonic()))
        assert not second.acquire(blocking=False)
        assert second.transport.primary == (new.host, new.port)
        assert fields(admin, held.key).get(OWNER_FIELD) == held.owner
        assert not held.lost
        stale = old.client()
        assert stale.exists(held.key) == 0
        stale.close()
        admin.close()
        held.release()
    finally:
        signals.heartbeat_round.disconnect(on_round, dispatch_uid="frozen-primary")
        if second.owned():
            second.release()
        holder_client.close()
        other_client.close()
    name = f"sentinel:{deployment.master_name}"
    assert name in senders
    ports = {str(server.port) for server in deployment.servers}
    assert not [s for s in senders if str(s).rpartition(":")[2] in ports]


@pytest.mark.slow
def test_a_release_that_does_not_wait_after_a_frozen_primary_comes_back_frees_the_lock_on_the_new_one(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
) -> None:
    """A primary frozen (SIGSTOP) through a failover comes back still answering as
    a primary. A release that does not wait (how a task releases), sent on the
    connection idle since before the freeze, asks the Sentinels first like any
    request: it frees the lock on the new primary, where it was held, not the old
    primary's stale copy. Its answer does not make the connection to the old
    primary look sound: the next acquire on the same client takes its lock on the
    new primary, and a fresh client is refused that lock (no two holders)."""
    deployment = redislock_sentinel_factory(replicas=1, sentinels=3)
    client, rival_client = deployment.client(), deployment.client()
    held = RedisLock(client, "sentinel-deferred:held", ttl=30, heartbeat=False)
    after = RedisLock(client, "sentinel-deferred:after", ttl=30, heartbeat=False)
    rival = RedisLock(rival_client, after.name, ttl=30, heartbeat=False)
    old = deployment.master()
    outcomes: list[object] = []
    try:
        assert held.acquire(blocking=False)
        direct = old.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        with old.paused():
            new = deployment.wait_for_failover(timeout=30, old=old)
        admin = new.client()
        assert fields(admin, held.key).get(OWNER_FIELD) == held.owner
        held.release(wait=False, then=outcomes.append)
        held.transport.drain(Deadline.after(5))
        assert outcomes == ["released"]
        assert OWNER_FIELD not in fields(admin, held.key)
        assert after.acquire(blocking=False)
        assert after.transport.primary == (new.host, new.port)
        assert fields(admin, after.key).get(OWNER_FIELD) == after.owner
        assert not rival.acquire(blocking=False)
        admin.close()
    finally:
        for lock in (after, rival):
            if lock.owned():
                lock.release()
        client.close()
        rival_client.close()


@contextlib.contextmanager
def _kept_busy(client: redis.Redis) -> Iterator[None]:
    """Keep ``client``'s connections in constant use (a lock taken and released
    every 50 ms from a thread), as a busy worker's are: none is ever idle for
    ``PRIMARY_RECHECK``."""
    stop = threading.Event()
    side = RedisLock(client, "sentinel-busy:side", ttl=5, call_timeout=1.0, heartbeat=False)

    def keep_busy() -> None:
        while not stop.is_set():
            with contextlib.suppress(LockBackendError):
                if side.acquire(blocking=False):
                    side.release()
            stop.wait(0.05)

    thread = threading.Thread(target=keep_busy, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)


@pytest.mark.slow
def test_a_busy_client_follows_an_operators_failover_while_the_old_primary_takes_writes(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An operator's ``SENTINEL FAILOVER`` leaves the old primary up and taking
    writes (here for good: it refuses ``REPLICAOF``, so the Sentinels cannot demote
    it). A client whose connections are in constant use still learns the switch,
    as one of its requests asks the Sentinels once a ``PRIMARY_RECHECK``:

    * its next locks go to the new primary, where a rival is refused (no two holders);
    * a lock it took on the old primary before it learnt the switch (held there and
      by a rival on the new one: the window) is renewed at once on the new
      primary, and found lost;
    * a release answered by the old primary before it learnt the switch is sent
      again to the new primary, where the lock was held: it is freed there, not
      left until its TTL. So is one of a hold its object never took (a message's
      reservation, ``free_queued``), one by lease (``release_lease``), and one that
      the old primary first refused (it had no replica left for
      ``min-replicas-to-write``) and then took from the heartbeat, which retried it
      in the background; and so is one by a client that makes no request after it
      (an idle process), whose heartbeat asks the Sentinels meanwhile;
    * a message's reservation that an execution took over on the old primary,
      and released there, is freed on the new primary too, where the take-over
      never came: not left there for ``lock_enqueue_ttl``; so is one made on the
      new primary (by a producer that asked the Sentinels) whose execution found
      the lock held by another on the old one;
    * a lock released and taken again on the old primary (a new fencing token)
      is not renewed on the new one, whose copy is of the hold released: it is
      found lost as the switch is learnt (not renewed there and freed by the
      release sent again, while its holder goes on);
    * a release that dropped an inner hold, of another object of the same owner,
      is not sent again: it would drop the other's hold on the new primary.

    Until the switch is learnt is held open by a ``PRIMARY_RECHECK`` raised for the
    time being."""
    deployment = redislock_sentinel_factory(replicas=1, sentinels=1, quorum=1)
    client, rival_client = deployment.client(), deployment.client()
    idle_client = deployment.client()
    transport = transport_for(client)
    old = deployment.master()
    old_admin = old.client()
    # The Sentinels cannot make it a replica: it stays a writable primary.
    old_admin.execute_command("ACL", "SETUSER", "default", "-slaveof", "-replicaof")  # type: ignore[no-untyped-call]
    released = RedisLock(client, "manual-failover:released", ttl=30, heartbeat=False)
    assert released.acquire(blocking=False)
    # Their renewals are due every 20 s: they are found lost long before that.
    again = RedisLock(client, "manual-failover:again", ttl=60)
    assert again.acquire(blocking=False)
    anew = RedisLock(client, "manual-failover:anew", ttl=60)
    assert anew.acquire(blocking=False)
    # Two objects of one owner: ``inner`` re-enters ``kept``'s hold.
    kept = RedisLock(client, "manual-failover:shared", ttl=60, owner="manual-failover-owner")
    inner = RedisLock(client, kept.name, ttl=60, owner=kept.owner, heartbeat=False)
    assert kept.acquire(blocking=False)

    def reservation(client: redis.Redis, name: str, task_id: str) -> RedisLock:
        """The reservation a send of task ``task_id`` makes, taken."""
        lock = RedisLock(
            client, name, ttl=60, owner=queued_owner(task_id), lease=task_id, heartbeat=False
        )
        assert lock.acquire(blocking=False)
        return lock

    reserved = reservation(client, "manual-failover:reserved", "queued-task")
    leased = RedisLock(client, "manual-failover:lease", ttl=60, lease="lease-task", heartbeat=False)
    assert leased.acquire(blocking=False)
    sent = reservation(client, "manual-failover:taken-over", "sent-task")
    idle = RedisLock(idle_client, "manual-failover:idle", ttl=60, heartbeat=False)
    assert idle.acquire(blocking=False)
    retried = RedisLock(client, "manual-failover:retried", ttl=60, heartbeat=False)
    assert retried.acquire(blocking=False)
    # Every hold replicated before the failover (a WAIT of another connection
    # does not wait for these clients' writes).
    replica = deployment.replicas()[0].client()
    for lock in (released, again, anew, kept, reserved, leased, idle, retried, sent):

        def replicated(lock: RedisLock = lock) -> bool:
            return fields(replica, lock.key).get(OWNER_FIELD) == lock.owner

        wait_for(replicated, timeout=10, what=f"{lock.name} to reach the replica")
    replica.close()
    # Idle connections enough that no request below needs a new one (which would
    # ask the Sentinels as it connects).
    deadline = Deadline.after(5)
    links = [transport.write([("PING",)], deadline) for _ in range(4)]
    for link in links:
        assert transport.finish(link, 1, deadline) == [b"PONG"]
    locks: list[RedisLock] = [released, again, anew, kept]
    try:
        with _kept_busy(client):
            monkeypatch.setattr(transport_module, "PRIMARY_RECHECK", 3600.0)
            assert _ask_sentinel(deployment, "FAILOVER", deployment.master_name) == b"OK"
            new = deployment.wait_for_failover(timeout=30, old=old)
            # Announced (+switch-master): what SENTINEL MASTERS, which clients ask,
            # says a moment after the promotion.
            wait_for(
                lambda: _announced(deployment) == (new.host, new.port),
                timeout=30,
                what="the Sentinels to announce the switch",
            )
            new_admin = new.client()
            for lock in (released, again, anew, kept, reserved, leased, idle, retried, sent):
                assert fields(new_admin, lock.key).get(OWNER_FIELD) == lock.owner
            # The switch not learnt yet: all go to the old primary.
            assert inner.acquire(blocking=False)
            inner.release()  # it drops its own hold; kept's remains
            again.release()
            assert again.acquire(blocking=False)  # a new fencing token
            # Its copy on the old primary runs out (made to), and it takes it anew
            # there (a new token); nothing is sent again that frees the other copy.
            old_admin.pexpire(anew.key, 1)
            wait_for(lambda: not old_admin.exists(anew.key), timeout=5, what="the copy to run out")
            assert anew.acquire(blocking=False)
            assert free_queued(client, reserved.name, "queued-task", reserved.prefix)
            assert release_lease(client, leased.name, "lease-task")
            idle.release(wait=False)
            idle.transport.drain(Deadline.after(5))
            # Refused at first (the old primary has no replica left), then taken
            # from the heartbeat's background retry.
            old_admin.config_set("min-replicas-to-write", 1)
            with pytest.raises(LockBackendError, match="retried in the background"):
                retried.release()
            old_admin.config_set("min-replicas-to-write", 0)
            wait_for(
                lambda: OWNER_FIELD not in fields(old_admin, retried.key),
                timeout=10,
                what="the release retried in the background to land",
            )
            for lock in (reserved, leased, idle, retried):
                assert OWNER_FIELD not in fields(old_admin, lock.key)
                assert fields(new_admin, lock.key).get(OWNER_FIELD) == lock.owner
            # Its renewals are due every 20 s: it is found lost long before that.
            early = RedisLock(client, "manual-failover:early", ttl=60)
            rival = RedisLock(rival_client, early.name, ttl=30)
            locks += [early, rival]
            assert early.acquire(blocking=False)
            outcomes: list[object] = []
            released.release(wait=False, then=outcomes.append)
            # An until_* execution: it takes the message's reservation over.
            execution = RedisLock(client, sent.name, ttl=60, lease="sent-task", heartbeat=False)
            execution._reserved_by = (sent.owner, sent.token)
            assert execution.acquire(blocking=False)
            execution.release(wait=False, then=outcomes.append)
            transport.drain(Deadline.after(5))
            assert outcomes == ["released", "released"]
            assert OWNER_FIELD not in fields(old_admin, sent.key)
            assert fields(new_admin, sent.key).get(OWNER_FIELD) == sent.owner
            # Sent by a producer that asks the Sentinels (the new primary); its
            # execution asks the old one, where another holds the lock.
            other_sent = reservation(rival_client, "manual-failover:other-holds", "other-task")
            holder = RedisLock(client, other_sent.name, ttl=60, heartbeat=False)
            locks.append(holder)
            assert holder.acquire(blocking=False)
            refused = RedisLock(client, other_sent.name, ttl=60, lease="other-task")
            refused._reserved_by = (other_sent.owner, other_sent.token)
            asked = time.monotonic()
            assert not refused.acquire(blocking=False)
            refused._free_reservation(asked, at_once=False)  # as the task does
            assert fields(new_admin, other_sent.key).get(OWNER_FIELD) == other_sent.owner
            assert fields(old_admin, early.key).get(OWNER_FIELD) == early.owner
            assert OWNER_FIELD not in fields(old_admin, released.key)
            assert fields(new_admin, released.key).get(OWNER_FIELD) == released.owner
            # A fresh client asks the Sentinels as it connects: the new primary.
            assert rival.acquire(blocking=False)
            assert fields(new_admin, early.key).get(OWNER_FIELD) == rival.owner

            monkeypatch.setattr(transport_module, "PRIMARY_RECHECK", 1.0)
            # The idle client's heartbeat looks again now (as it would within
            # PRIMARY_RECHECK, had it not been raised).
            get_heartbeat().watch_primary(idle.transport)
            wait_for(
                lambda: transport.primary == (new.host, new.port),
                timeout=15,
                what="the busy client to learn the switch",
            )
            wait_for(lambda: early.lost, timeout=10, what="the early hold to be found lost")
            wait_for(lambda: again.lost, timeout=10, what="the hold taken again to be found lost")
            wait_for(lambda: anew.lost, timeout=10, what="the hold taken anew to be found lost")
            wait_for(
                lambda: OWNER_FIELD not in fields(new_admin, released.key),
                timeout=10,
                what="the release to be sent again to the new primary",
            )
            # Sent again with the others (after inner's release, had it been).
            assert fields(new_admin, kept.key).get(OWNER_FIELD) == kept.owner
            assert not kept.lost
            for key in (reserved.key, leased.key, idle.key, retried.key, sent.key, other_sent.key):

                def freed(key: str = key) -> bool:
                    return OWNER_FIELD not in fields(new_admin, key)

                wait_for(freed, timeout=10, what=f"{key} to be freed on the new primary")
            assert idle.transport.primary == (new.host, new.port)
            later = RedisLock(client, "manual-failover:later", ttl=30)
            later_rival = RedisLock(rival_client, later.name, ttl=30)
            locks += [later, later_rival]
            assert later.acquire(blocking=False)
            assert not later_rival.acquire(blocking=False)
            assert fields(new_admin, later.key).get(OWNER_FIELD) == later.owner
            assert not old_admin.exists(later.key)
            later.release(wait=False)
            transport.drain(Deadline.after(5))
            assert OWNER_FIELD not in fields(new_admin, later.key)
            assert later_rival.acquire(blocking=False)
            # The old primary took writes all along.
            assert old_admin.execute_command("ROLE")[0] == b"master"  # type: ignore[no-untyped-call]
            new_admin.close()
    finally:
        for lock in locks:
            with contextlib.suppress(LockBackendError, LockLostError):
                if lock.owned():
                    lock.release()
        old_admin.close()
        client.close()
        rival_client.close()
        idle_client.close()


#: A process that holds two locks on a Sentinel-managed primary, releases them
#: (one without waiting) on the old primary after an operator's failover, before
#: it learns the switch, and exits. Arguments: the Sentinel's port, the service,
#: the replica's port, and ``announced`` (it releases once told on its stdin,
#: the switch announced meanwhile: until it would learn it is held open by a
#: ``PRIMARY_RECHECK`` raised) or ``under-way`` (it releases as soon as the
#: replica has been promoted, before the Sentinels announce it).
_RELEASES_AND_EXITS = """
import logging, sys, time
import redis
from redis.sentinel import Sentinel
from celery_redislock import RedisLock, transport
from celery_redislock.transport import Deadline, transport_for
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
sentinel_port, service, replica_port, when = sys.argv[1:]
client = Sentinel([("127.0.0.1", int(sentinel_port))]).master_for(service)
lock = RedisLock(client, "exit-after-switch", ttl=60)
other = RedisLock(client, "exit-after-switch-other", ttl=60)
assert lock.acquire(blocking=False) and other.acquire(blocking=False)
if when == "announced":
    # Idle connections enough for the releases: a new one would ask the Sentinels.
    deadline = Deadline.after(5)
    links = [transport_for(client).write([("PING",)], deadline) for _ in range(2)]
    for link in links:
        transport_for(client).finish(link, 1, deadline)
    transport.PRIMARY_RECHECK = 3600.0
print("acquired", flush=True)
if when == "announced":
    sys.stdin.readline()
else:
    replica = redis.Redis(port=int(replica_port), socket_timeout=5)
    while replica.execute_command("ROLE")[0] not in (b"master", "master"):
        time.sleep(0.01)
lock.release()
other.release(wait=False)
print("released", flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["announced", "under-way"])
def test_a_process_that_exits_after_releasing_on_a_replaced_primary_frees_its_locks_there(
    redislock_sentinel_factory: Callable[..., SentinelDeployment], when: str
) -> None:
    """An operator's ``SENTINEL FAILOVER`` leaves the old primary taking writes (it
    refuses ``REPLICAOF`` here). A process releases its locks there before it
    learns the switch, and exits at once: a running process would learn it within
    a ``PRIMARY_RECHECK`` and send the releases again to the new primary; the
    exiting one asks the Sentinels as it flushes, and sends them there before it
    ends, whether the switch was announced already (``announced``) or is
    announced a moment later (``under-way``: the Sentinels answer that they are
    failing the primary over, and are asked again until they name the new one).
    Neither lock is left held on the new primary until its TTL."""
    deployment = redislock_sentinel_factory(replicas=1, sentinels=1, quorum=1)
    old = deployment.master()
    old_admin = old.client()
    old_admin.execute_command("ACL", "SETUSER", "default", "-slaveof", "-replicaof")  # type: ignore[no-untyped-call]
    replica = deployment.replicas()[0]
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _RELEASES_AND_EXITS,
            str(deployment.sentinel_servers[0].port),
            deployment.master_name,
            str(replica.port),
            when,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    keys = [lock_keys(name)[0] for name in ("exit-after-switch", "exit-after-switch-other")]
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "acquired"
        replica_client = replica.client()
        for key in keys:

            def replicated(key: str = key) -> bool:
                return bool(fields(replica_client, key).get(OWNER_FIELD))

            wait_for(replicated, timeout=10, what=f"{key} to reach the replica")
        replica_client.close()
        assert _ask_sentinel(deployment, "FAILOVER", deployment.master_name) == b"OK"
        new = deployment.wait_for_failover(timeout=30, old=old)
        if when == "announced":
            wait_for(
                lambda: _announced(deployment) == (new.host, new.port),
                timeout=30,
                what="the Sentinels to announce the new primary",
            )
        out, _ = child.communicate("\n", timeout=60)
        assert child.returncode == 0, out
        new_client = new.client()
        try:
            for key in keys:
                # Released on the old primary, which still holds what it was told.
                assert not fields(old_admin, key).get(OWNER_FIELD), out
                assert not fields(new_client, key).get(OWNER_FIELD), out
        finally:
            new_client.close()
        # Learnt as the process flushed before it exited.
        assert "the new primary of 'mymaster': sending again 2 release(s)" in out
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
        old_admin.close()


@pytest.mark.slow
def test_a_release_a_sentinel_managed_primary_lost_in_its_crash_waits_for_the_switch(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Sentinels announce a failover a ``down-after-milliseconds`` (30 s by
    default) and an election after the primary failed, later than
    ``SWITCH_RESEND`` after the releases it may have lost (answered, and not yet
    passed on to its replica). A process that sends nothing after its releases
    finds the primary gone all the same: while they wait, the heartbeat sends it
    a ``PING`` as it asks the Sentinels. The releases answered within
    ``SWITCH_RESEND`` before then wait for the switch however long it takes:
    here ``SWITCH_RESEND`` is 2 s and the switch is learnt later than that (as
    the process flushes); the hold put back on the new primary is freed, and so
    is the reservation an ``until_executed`` execution's take-over left there. A
    release answered more than ``SWITCH_RESEND`` before is not sent again."""
    monkeypatch.setattr(transport_module, "SWITCH_RESEND", 2.0)
    deployment = redislock_sentinel_factory(replicas=1, sentinels=3)
    client = deployment.client()
    try:
        released = _release_early_and_late(
            client, "sentinel-crash:early", "sentinel-crash:late", "sentinel-crash:exec", 60
        )
        early, late, executed = released.early, released.late, released.executed
        old = deployment.master()
        direct = old.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        transport = late.transport
        old.kill()
        wait_for(lambda: transport._failed_at is not None, timeout=5, what="the primary found gone")
        # The Sentinels are asked no more: the switch is learnt once the holds
        # are put back.
        monkeypatch.setattr(transport_module, "PRIMARY_RECHECK", 3600.0)
        new = deployment.wait_for_failover(timeout=30, old=old)
        admin = new.client()
        try:
            # What the new primary would have, had the releases died with the old one.
            for key, value in released.dumps.items():
                admin.restore(key, 60_000, value, replace=True)
            time.sleep(max(0.0, released.released_at + 2.2 - time.monotonic()))
            transport_module.flush(timeout=5)
            for lock in (late, executed):
                wait_for(
                    functools.partial(_freed, admin, lock.key),
                    timeout=10,
                    what=f"{lock.name!r} freed on the new primary",
                )
            assert not _freed(admin, early.key)
        finally:
            admin.close()
    finally:
        client.close()


def _announced(deployment: SentinelDeployment) -> tuple[str, int]:
    """The primary's address in the first Sentinel's ``SENTINEL MASTER`` reply."""
    reply = _ask_sentinel(deployment, "MASTER", deployment.master_name)
    state = reply if isinstance(reply, dict) else dict(zip(reply[::2], reply[1::2], strict=True))
    state = {(k.decode() if isinstance(k, bytes) else k): v for k, v in state.items()}
    ip = state["ip"]
    return (ip.decode() if isinstance(ip, bytes) else str(ip)), int(state["port"])


def _ask_sentinel(deployment: SentinelDeployment, *command: Any) -> Any:
    """``SENTINEL <command>`` asked of the deployment's first Sentinel."""
    sentinel = deployment.sentinel_servers[0].client()
    try:
        return sentinel.execute_command("SENTINEL", *command)  # type: ignore[no-untyped-call]
    finally:
        sentinel.close()


def test_a_new_connection_goes_to_the_known_primary_while_the_sentinels_do_not_answer(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With every Sentinel frozen and the primary fine, a request that needs a new
    connection asks them for ``PRIMARY_QUESTION`` at most, then connects to the
    primary they named last; while they are left alone (``SENTINELS_REST``) the
    next one does not ask at all. Their outage alone does not stop the locks."""
    deployment = redislock_sentinel_factory(replicas=0, sentinels=1, down_after_ms=60000)
    master = deployment.master()
    client = deployment.client()
    lock = RedisLock(client, "sentinels-frozen", ttl=5, call_timeout=2.0, heartbeat=False)
    assert lock.acquire(blocking=False)
    lock.release()
    transport = lock.transport
    questions: list[object] = []
    discover = transport_module._discover_master

    def counted(pool: Any, *args: Any) -> Any:
        # This transport's questions only: another test's transport may still
        # ask its own Sentinels for releases it would send again on a switch.
        if pool is transport._sentinel:
            questions.append(args)
        return discover(pool, *args)

    monkeypatch.setattr(transport_module, "_discover_master", counted)
    with deployment.sentinel_servers[0].paused():
        for _ in range(2):
            transport.close_idle()  # the next request needs a new connection
            assert lock.acquire(blocking=False)
            lock.release()
    assert len(questions) == 1
    assert transport.primary == (master.host, master.port)
    client.close()


def test_a_timeout_on_a_sentinel_managed_primary_closes_every_idle_connection(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
) -> None:
    """A request that times out on a Sentinel-managed primary closes the transport's
    idle connections too, not only its own: the primary may be stalled while the
    Sentinels fail over, and the next request then asks them which server is primary
    rather than reuse a connection to it."""
    deployment = redislock_sentinel_factory(replicas=0, sentinels=1, down_after_ms=60000)
    client = deployment.client()
    transport = transport_for(client)
    deadline = Deadline.after(5)
    links = [transport.write([("PING",)], deadline) for _ in range(3)]
    for link in links:
        assert transport.finish(link, 1, deadline) == [b"PONG"]
    lock = RedisLock(client, "sentinel-timeout", ttl=5, call_timeout=0.5, heartbeat=False)
    with deployment.master().paused(), pytest.raises(LockBackendError) as excinfo:
        lock.acquire(blocking=False)
    assert "timed out" in str(excinfo.value)
    assert [link.conn._sock for link in links] == [None, None, None]
    client.close()


def test_a_deadline_passed_before_a_read_on_a_sentinel_managed_primary_closes_every_idle_connection(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
) -> None:
    """A read whose deadline has already passed as it begins (the caller's time ran
    out between writing a request and reading its answer) fails as a timeout and,
    on a Sentinel-managed primary, closes the transport's idle connections too, as
    a read that waited its deadline out does: the next request makes a new one."""
    deployment = redislock_sentinel_factory(replicas=0, sentinels=1, down_after_ms=60000)
    client = deployment.client()
    transport = transport_for(client)
    deadline = Deadline.after(5)
    links = [transport.write([("PING",)], deadline) for _ in range(3)]
    for link in links:
        assert transport.finish(link, 1, deadline) == [b"PONG"]
    assert len(transport._idle) == 3
    link = transport.write([("PING",)], deadline)
    assert len(transport._idle) == 2
    with pytest.raises(redis.TimeoutError, match="within the deadline"):
        transport.finish(link, 1, Deadline(time.monotonic()))
    assert transport._idle == []
    assert [link.conn._sock for link in links] == [None, None, None]
    assert transport.execute([("PING",)], Deadline.after(5)) == [b"PONG"]
    assert len(transport._idle) == 1
    client.close()


def test_a_sentinel_managed_connection_idle_for_a_while_is_checked_with_the_sentinels(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before it reuses a connection idle for longer than ``PRIMARY_RECHECK``, a
    Sentinel-managed lock asks the Sentinels which server is primary. The question
    goes to them: an uncontended acquire and release are still two round trips on
    the lock's own transport. Sentinels that cannot be asked leave the connection in
    use: their outage alone does not stop the locks."""
    monkeypatch.setattr(transport_module, "PRIMARY_RECHECK", 0.0)
    # No release waits to be sent again should a switch be learnt: the heartbeat's
    # thread, which would ask the Sentinels meanwhile, leaves them alone.
    monkeypatch.setattr(transport_module, "SWITCH_RESEND", 0.0)
    deployment = redislock_sentinel_factory(replicas=0, sentinels=1, down_after_ms=60000)
    client = deployment.client()
    lock = RedisLock(client, "sentinel-recheck", ttl=5, heartbeat=False)
    assert lock.acquire(blocking=False)
    lock.release()
    sentinels = transport_for(client.connection_pool.sentinel_manager.sentinels[0])  # type: ignore[attr-defined]
    asked, sent = sentinels.sends, lock.transport.sends
    assert lock.acquire(blocking=False)
    lock.release()
    assert (lock.transport.sends - sent, sentinels.sends - asked) == (2, 2)
    # A release that does not wait asks first too: written to a server no longer
    # the primary, it would leave the lock held on the new one.
    assert lock.acquire(blocking=False)
    asked, sent = sentinels.sends, lock.transport.sends
    lock.release(wait=False)
    assert (lock.transport.sends - sent, sentinels.sends - asked) == (1, 1)
    questions: list[object] = []
    discover = transport_module._discover_master

    def counted(*args: Any) -> Any:
        questions.append(args)
        return discover(*args)

    monkeypatch.setattr(transport_module, "_discover_master", counted)
    deployment.sentinel_servers[0].kill()
    assert lock.acquire(blocking=False)
    lock.release()
    # Sentinels that did not answer are left alone for a while (SENTINELS_REST).
    assert len(questions) == 1
    client.close()


def test_a_sentinel_managed_lock_names_its_service_and_primary(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Errors and log lines about a Sentinel-managed lock store name the service and
    the primary the Sentinels named (``sentinel:mymaster at host:port``), never a
    made-up ``localhost:6379``; the heartbeat's rounds (and so the ``server`` label of
    its metric) carry the stable ``sentinel:mymaster``."""
    deployment = redislock_sentinel_factory(replicas=0, sentinels=1, down_after_ms=60000)
    master = deployment.master()
    service = f"sentinel:{deployment.master_name}"
    named = f"{service} at {master.host}:{master.port}"
    senders: list[Any] = []

    def on_round(sender: Any = None, **_: Any) -> None:
        senders.append(sender)

    signals.heartbeat_round.connect(on_round, weak=False, dispatch_uid="sentinel-named")
    client = get_client(deployment.sentinel_url, deployment.transport_options)
    held = RedisLock(client, "sentinel-named", ttl=3)
    other = RedisLock(client, "sentinel-named:other", ttl=5, call_timeout=0.5, heartbeat=False)
    try:
        assert held.acquire(blocking=False)
        assert held.transport.describe() == named
        assert held.transport.name == service
        wait_for(lambda: service in senders, what="a heartbeat round")
        with caplog.at_level(logging.WARNING, logger="celery_redislock"), master.paused():
            with pytest.raises(LockBackendError) as excinfo:
                other.acquire(blocking=False)
            wait_for(
                lambda: any("could not renew" in r.getMessage() for r in caplog.records),
                timeout=5,
                what="a failed renewal's warning",
            )
    finally:
        signals.heartbeat_round.disconnect(on_round, dispatch_uid="sentinel-named")
    assert named in str(excinfo.value)
    warning = next(r.getMessage() for r in caplog.records if "could not renew" in r.getMessage())
    assert named in warning
    assert "localhost" not in str(excinfo.value) + warning
    assert set(senders) >= {service}
    assert not [s for s in senders if str(s).endswith(f":{master.port}")]
    with contextlib.suppress(LockLostError, LockBackendError):
        held.release()
    client.close()


# ACL: the minimal permissions are enough, each is needed, and a missing one is named.


def exercise(user: AclUser, name: str = "acl-exercise") -> str | None:
    """Use every part of the engine as ``user``: take a lock (first use of the scripts on
    the server, new fence counter), re-enter, read it, release a hold, give up
    waiting, wait for a release (which hands the lock over), release, and free a
    lease. Return what failed first, or ``None``."""
    url = user.url
    first = RedisLock(url, name, ttl=5, heartbeat=False)
    waiter = RedisLock(url, name, ttl=5, heartbeat=False)
    admin = user.server.client()
    try:
        if not (first.acquire(blocking=False) and first.acquire(blocking=False)):
            return "first acquire refused"
        if not (first.locked() and first.owned() and first.holder_lease() is None):
            return "reads disagree"
        first.release()
        quitter = RedisLock(url, name, ttl=5, heartbeat=False)
        if quitter.acquire(timeout=0.2):
            return "the lock was taken twice"
        if admin.exists(first.queue_key):
            return "a waiter that gave up did not leave the queue"
        done = threading.Event()

        def release_when_waited_for() -> None:
            deadline = time.monotonic() + 5
            while not done.is_set() and time.monotonic() < deadline:
                if admin.zcard(first.queue_key):
                    first.release()
                    return
                time.sleep(0.01)

        thread, outcome = in_thread(release_when_waited_for)
        try:
            got = waiter.acquire(timeout=2)
        finally:
            done.set()
            thread.join(10)
        if "error" in outcome:
            return f"release: {outcome['error']}"
        if not got:
            return "the waiter was not woken"
        waiter.release()
        leased = RedisLock(url, f"{name}:lease", ttl=5, lease="task-1", heartbeat=False)
        assert leased.acquire(blocking=False)
        if not release_lease(url, leased.name, "task-1"):
            return "release_lease did not free the lock"
        return None
    except LockBackendError as exc:
        return str(exc)
    finally:
        admin.close()


def test_minimal_acl_is_enough(redislock_acl_server_factory: Callable[..., AclUser]) -> None:
    """A user with exactly MINIMAL_ACL uses every part of the engine on a fresh server
    (script loading and a new fence counter included) without a refusal."""
    user = redislock_acl_server_factory(MINIMAL_ACL)
    assert exercise(user) is None
    assert refusals(user.server) == []


def test_the_wake_up_probe_needs_no_more_than_the_minimal_acl(
    redislock_acl_server_factory: Callable[..., AclUser], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter that hears nothing for PROBE_AFTER seconds probes its subscription
    (subscribes again, which MINIMAL_ACL allows): the server answers, nothing is
    refused, and the subscription is kept."""
    # A local server answers the probe in milliseconds: 2 s to answer, not a whole
    # call timeout, still has an unanswered probe replace the subscription.
    monkeypatch.setattr(wakeups, "PROBE_WAIT", 2.0)
    user = redislock_acl_server_factory(MINIMAL_ACL)
    holder = RedisLock(user.url, "probed", ttl=10)
    assert holder.acquire()
    waiter = RedisLock(user.url, "probed", ttl=10)
    assert not waiter.acquire(timeout=PROBE_AFTER + wakeups.PROBE_WAIT)
    admin = user.server.client()
    subscribes = admin.info("commandstats")["cmdstat_subscribe"]["calls"]
    admin.close()
    assert subscribes >= 2
    assert hub_for(waiter.transport, waiter.prefix).subscriptions == 1
    assert refusals(user.server) == []
    holder.release()


@pytest.mark.parametrize("numsub", [False, True])
def test_a_release_passes_over_dead_waiters_only_where_the_acl_allows_pubsub_numsub(
    numsub: bool, redislock_acl_server_factory: Callable[..., AclUser]
) -> None:
    """A release counts the subscribers of a queued waiter's process (to pass it over
    if it died) only if the user may run ``PUBSUB NUMSUB``, which MINIMAL_ACL leaves
    out: without it, the lock is handed to a dead waiter's entry as before (for its
    grant), and nothing is refused; with ``+pubsub|numsub`` it is passed over."""
    rules = [*MINIMAL_ACL, "+pubsub|numsub"] if numsub else list(MINIMAL_ACL)
    user = redislock_acl_server_factory(rules)
    holder = RedisLock(user.url, "numsub", ttl=10)
    assert holder.acquire()
    admin = user.server.client()
    dead = queue_entry("dead-process.1", "dead-owner", 10_000, "", "", watched=True)
    other = queue_entry("other-process.1", "other-owner", 10_000, "", "")
    admin.zadd(holder.queue_key, {dead: 1, other: 2})
    write_fields(admin, holder.key, q="1")
    holder.release()
    assert fields(admin, holder.key)[OWNER_FIELD] == ("other-owner" if numsub else "dead-owner")
    assert refusals(user.server) == []
    admin.close()


@pytest.mark.parametrize(
    "rule", [rule for rule in MINIMAL_ACL if rule not in ("-@all", "resetchannels")]
)
def test_every_rule_of_the_minimal_acl_is_needed(
    rule: str, redislock_acl_server_factory: Callable[..., AclUser]
) -> None:
    """Without any one rule of MINIMAL_ACL some part of the engine is refused, for
    exactly the permission that rule grants."""
    user = redislock_acl_server_factory([r for r in MINIMAL_ACL if r != rule])
    # What refused it refused it names exactly what that rule would have allowed: the
    # server's ACL log (a refused command) or the script's own check (a command
    # the script was about to run).
    problem = exercise(user)
    assert problem is not None
    refused = refusals(user.server)
    logged = {(entry["reason"], entry["object"]) for entry in refused}
    if rule.startswith("~"):
        assert logged == {("key", "redislock:{acl-exercise}")}
    elif rule.startswith("&"):
        assert {reason for reason, _ in logged} <= {"channel"}
        assert logged or "PUBLISH on redislock:wake:" in problem
    else:
        assert logged == {("command", rule[1:])} or (
            not logged and f"run {rule[1:].upper()}" in problem
        )


#: What the operator's reads add to MINIMAL_ACL (docs/deployments.md, ACL).
OPERATOR_ACL = ("+scan", "+zcard")


def test_operator_reads_need_scan_and_zcard(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """With MINIMAL_ACL alone, listing and reading locks fail naming the permission
    (a refused ZCARD is not taken for "no waiters"); with OPERATOR_ACL added, they
    work without a refusal, as does force_release."""
    locker = redislock_acl_server_factory(MINIMAL_ACL)
    held_lock = RedisLock(locker.url, "operated", ttl=30)
    assert held_lock.acquire()
    client = locker.client()
    with pytest.raises(LockBackendError, match="scan"):
        list_locks(client)
    with pytest.raises(LockBackendError, match="zcard"):
        read_lock(client, "operated")
    held_lock.release()
    client.close()
    operator = redislock_acl_server_factory((*MINIMAL_ACL, *OPERATOR_ACL))
    lock = RedisLock(operator.url, "operated", ttl=30)
    assert lock.acquire()
    client = operator.client()
    assert [info.name for info in list_locks(client)] == ["operated"]
    info = read_lock(client, "operated")
    assert info is not None
    assert info.waiters == 0
    assert force_release(client, "operated", fence=info.fence)
    assert refusals(operator.server) == []
    client.close()


def refusals(server: RedisServer) -> list[dict[str, Any]]:
    """The server's ``ACL LOG`` without redis-py's refused ``CLIENT SETINFO`` (harmless:
    sent on connect, a refusal is ignored)."""
    admin = server.client(decode_responses=True)
    entries: Any = admin.acl_log()
    admin.close()
    return [entry for entry in entries if entry["object"] != "client|setinfo"]


def _without(rule: str, instead: str) -> list[str]:
    """MINIMAL_ACL with ``rule`` replaced by ``instead``."""
    return [instead if r == rule else r for r in MINIMAL_ACL]


def test_user_without_the_key_pattern_gets_noperm_and_nothing_is_written(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """A user whose keys are ~other:* gets LockBackendError naming the key permission
    (redis-py's NoPermissionError, NOPERM) for acquires and release_lease, and the
    server stays empty."""
    user = redislock_acl_server_factory(_without("~redislock:*", "~other:*"))
    admin = user.server.client()
    lock = RedisLock(user.url, "no-keys", ttl=5)
    attempts: tuple[Callable[[], object], ...] = (
        lambda: lock.acquire(blocking=False),
        lambda: lock.acquire(timeout=1),
        lambda: release_lease(user.url, "no-keys", "task-1"),
    )
    for attempt in attempts:
        with pytest.raises(LockBackendError) as excinfo:
            attempt()
        message = str(excinfo.value)
        assert re.search("no permissions to access (a|one of the) key", message, re.I)
        assert "lacks a permission the locks need" in message
        assert isinstance(excinfo.value.__cause__, NoPermissionError)
    assert admin.dbsize() == 0
    admin.close()


def test_user_without_the_channel_pattern_cannot_wait_and_nothing_is_written(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """A user whose channels are &other:* gets LockBackendError naming the channel
    permission when it must wait for a holder, and writes nothing."""
    user = redislock_acl_server_factory(_without("&redislock:*", "&other:*"))
    admin = user.server.client()
    holder = RedisLock(admin, "no-channel", ttl=30)
    assert holder.acquire(blocking=False)
    keys_before = sorted(admin.keys("*"))
    waiter = RedisLock(user.url, "no-channel", ttl=5)
    with pytest.raises(LockBackendError) as excinfo:
        waiter.acquire(timeout=2)
    message = str(excinfo.value)
    assert re.search("no permissions to access (a|one of the) channel", message, re.I)
    assert "lacks a permission the locks need" in message
    assert isinstance(excinfo.value.__cause__, NoPermissionError)
    assert sorted(admin.keys("*")) == keys_before
    assert holder.owned()
    holder.release()
    admin.close()


def test_release_refused_by_the_acl_changes_nothing(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """A release the ACL refuses (no channel permission for the wake-up PUBLISH a queued
    waiter needs) raises naming the permission and leaves the lock as it was: still
    held by its owner, the waiter still queued. Refused, it is not sent again in the
    background (it would be refused again): the lock is dropped locally and left to
    its TTL."""
    user = redislock_acl_server_factory(_without("&redislock:*", "&other:*"))
    admin = user.server.client()
    lock = RedisLock(user.url, "refused-release", ttl=30, heartbeat=False)
    assert lock.acquire(blocking=False)
    admin.zadd(lock.queue_key, {"someone.1": 1})
    write_fields(admin, lock.key, **{QUEUED_FIELD: "1"})
    before = admin.get(lock.key)
    with pytest.raises(LockBackendError) as excinfo:
        lock.release()
    try:
        assert "PUBLISH on redislock:wake:" in str(excinfo.value)
        assert "expires by its TTL" in str(excinfo.value)
        assert "retried" not in str(excinfo.value)
        assert not lock.holding
        retried = [
            p for lane in get_heartbeat()._lanes.values() for p in lane.pending
            if lock.key in p.call.keys
        ]  # fmt: skip
        assert retried == []
        assert admin.get(lock.key) == before
        assert admin.zcard(lock.queue_key) == 1
    finally:
        admin.delete(lock.key, lock.queue_key)
        admin.close()


def test_command_refused_inside_a_script_is_reported_as_a_permission_error(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """An acquire refused because a command inside the script is not allowed (here
    TIME, for a new fence counter) says that the user lacks a permission."""
    user = redislock_acl_server_factory([r for r in MINIMAL_ACL if r != "+time"])
    with pytest.raises(LockBackendError) as excinfo:
        RedisLock(user.url, "refused-time", ttl=5).acquire(blocking=False)
    assert "lacks a permission the locks need" in str(excinfo.value)


def test_command_refused_inside_a_script_leaves_no_key_without_expiry(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """A waiter refused PEXPIRE (the expiry of the queue it joins) leaves no key that
    never expires: the script checks it before it queues the waiter."""
    user = redislock_acl_server_factory([r for r in MINIMAL_ACL if r != "+pexpire"])
    admin = user.server.client()
    holder = RedisLock(admin, "refused-pexpire", ttl=30, heartbeat=False)
    assert holder.acquire(blocking=False)
    with pytest.raises(LockBackendError):
        RedisLock(user.url, "refused-pexpire", ttl=5).acquire(timeout=1)
    try:
        assert admin.zcard(holder.queue_key) == 0
        assert [key for key in admin.keys("*") if admin.pttl(key) == -1] == []
    finally:
        admin.close()


def test_write_refused_before_anything_is_written_leaves_the_lock_as_it_was(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """The scripts check permissions ahead only for the writes that follow their first:
    a first write the ACL refuses (SET) fails before anything is written. An acquire
    leaves no key, and a release leaves the lock held by its owner, as it was."""
    user = redislock_acl_server_factory([r for r in MINIMAL_ACL if r != "+set"])
    admin = user.server.client()
    try:
        with pytest.raises(LockBackendError) as excinfo:
            RedisLock(user.url, "refused-set", ttl=5, heartbeat=False).acquire(blocking=False)
        assert "lacks a permission the locks need" in str(excinfo.value)
        assert admin.keys("*") == []
        held = RedisLock(admin, "refused-set", ttl=30, heartbeat=False)
        assert held.acquire(blocking=False)
        before = admin.get(held.key)
        for token in (None, held.token):  # the general path, then the one write
            releaser = RedisLock(user.url, "refused-set", ttl=30, owner=held.owner, heartbeat=False)
            releaser._holds = 1  # the same owner, as another process holding it would be
            releaser.token = token
            with pytest.raises(LockBackendError):
                releaser.release()
            assert admin.get(held.key) == before
        held.release()
    finally:
        admin.close()


def test_release_refused_after_its_one_write_leaves_the_lock_as_it_was(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """A release whose one write finds waiters queued puts the lock back before the
    general path runs: refused a command that path needs (ZREM, to hand the lock to
    the first waiter), it leaves the lock, its expiry and the queue as they were."""
    user = redislock_acl_server_factory([r for r in MINIMAL_ACL if r != "+zrem"])
    admin = user.server.client()
    try:
        holder = RedisLock(user.url, "refused-zrem", ttl=30, heartbeat=False)
        assert holder.acquire(blocking=False)
        write_fields(admin, holder.key, **{QUEUED_FIELD: "1"})
        admin.zadd(holder.queue_key, {"p.1": 1})
        admin.pexpire(holder.key, 12_345)
        before = admin.get(holder.key)
        admin.config_resetstat()
        with pytest.raises(LockBackendError, match="ZREM"):
            holder.release()
        # The one write, and the lock put back.
        assert admin.info("commandstats")["cmdstat_set"]["calls"] == 2
        assert admin.get(holder.key) == before
        assert 12_000 < admin.pttl(holder.key) <= 12_345
        assert admin.zrange(holder.queue_key, 0, -1) == [b"p.1"]
    finally:
        admin.close()


def test_a_moved_reply_updates_the_slot_map(
    resharding_cluster: ClusterDeployment,
) -> None:
    """Once a held lock's slot has moved whole to another primary (a finished
    resharding), the first request that meets MOVED updates the slot map, as
    send()'s docstring says: the lock's transport is the new primary's, and
    later requests go there directly instead of to the old primary first (where
    each would meet MOVED again, and be sent after an ASKING as if the slot were
    still migrating)."""
    cluster = resharding_cluster
    client = cluster.client()
    try:
        held = RedisLock(client, "moved-slot", ttl=30, heartbeat=False)
        old, target = _held_then_moved(cluster, held)
        held.extend()  # meets MOVED on the old primary, lands on the new one
        assert held.transport is not old
        assert held.transport.describe() == f"{target.host}:{target.port}"
        sends = old.sends
        held.extend()
        held.release()
        assert old.sends == sends
    finally:
        client.close()


def test_renewals_move_to_the_lane_of_a_slot_that_moved(
    resharding_cluster: ClusterDeployment,
) -> None:
    """Once a held lock's slot has moved whole to another primary, its renewals
    go to the new primary's lane: not every round first to the old primary (to
    meet MOVED) and then to the new one, one lock at a time."""
    cluster = resharding_cluster
    client = cluster.client()
    try:
        held = RedisLock(client, "moved-renewed", ttl=1.5)
        old, _ = _held_then_moved(cluster, held)
        wait_for(lambda: held.transport is not old, timeout=10, what="the slot map to learn")
        sends = old.sends
        wait_for(
            lambda: held in getattr(get_heartbeat()._lanes.get(held.transport), "locks", list)(),
            timeout=10,
            what="the lock to move to its new primary's lane",
        )
        time.sleep(4 * held.renew_interval)
        assert not held.lost
        # At most the round that found the slot moved went to the old primary.
        assert old.sends - sends <= 1
        held.release()
    finally:
        client.close()
