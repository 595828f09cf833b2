"""The ``celery redislock`` command, run through Celery's own command line, and the
``celery_redislock.admin`` functions behind it."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import redis
from celery import Celery
from celery.bin.celery import celery as celery_command
from click.testing import CliRunner
from redis.cluster import RedisCluster
from redis.exceptions import MovedError

from celery_redislock import LockBackendError, RedisLock, SingletonTask
from celery_redislock.admin import (
    HOLDER_SCHEMA,
    LIST_SCHEMA,
    LOCK_SCHEMA,
    SHOW_SCHEMA,
    STATS_SCHEMA,
    WAITER_SCHEMA,
    ForceReleased,
    LockInfo,
    check_pattern,
    clear_locks,
    find_locks,
    force_release,
    list_locks,
    lock_stats,
    purge_locks,
    read_lock,
    read_waiters,
    server_versions,
    short_reason,
)
from celery_redislock.deployments import ClusterDeployment
from celery_redislock.ids import request_id
from celery_redislock.lock import DEFAULT_PREFIX, FENCE_TTL_MS, lock_keys, wake_channel_prefix
from celery_redislock.scripts import FORCE_RELEASE_SCRIPT
from celery_redislock.server import RedisServer, free_port
from celery_redislock.testing import hold_lock, leave_stale_lock, run_worker
from celery_redislock.transport import Deadline, backend_errors, run, transport_for
from tests import cli_app
from tests.support import (
    acquire_in_thread,
    close_app,
    fields,
    make_app,
    migrate_keys,
    migrating,
    settle,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent


def command_environment(url: str, **env: str) -> dict[str, str]:
    """The environment of a ``celery … redislock`` process against the server at
    ``url``: it imports this checkout's package and tests, whatever is installed."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
    return dict(os.environ, REDISLOCK_TEST_URL=url, PYTHONPATH=path, **env)


def celery(
    url: str,
    *args: str,
    app: str | None = "tests.cli_app",
    stdin: str | None = None,
    cwd: Path = ROOT,
    **env: str,
) -> subprocess.CompletedProcess[str]:
    """Run ``celery [-A app] redislock ARGS`` against the server at ``url``."""
    environment = command_environment(url, **env)
    command = [sys.executable, "-m", "celery", *(["-A", app] if app else []), "redislock", *args]
    return subprocess.run(
        command,
        cwd=cwd,
        env=environment,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def celery_together(
    url: str, *commands: tuple[str, ...], **env: str
) -> list[subprocess.CompletedProcess[str]]:
    """Run each of ``commands`` as :func:`celery` would, all at once (for commands
    that each wait out a timeout and leave the store alone): their results, in order."""
    with ThreadPoolExecutor(max_workers=len(commands)) as pool:
        return list(
            pool.map(
                lambda args: celery(url, *args, app="tests.cli_app", stdin=None, cwd=ROOT, **env),
                commands,
            )
        )


def celery_here(
    app: Celery, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``celery -A tests.cli_app redislock ARGS`` in this process, through Celery's
    own command line: the same command as :func:`celery`, for checks that need no
    other configuration than this process's ``app`` (which ``-A`` finds), without
    a new interpreter's start (a second or so each). ``stdin`` is what the command
    reads as its answers."""
    assert app is cli_app.app
    try:
        runner = CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:  # click 8.2 and later keep stderr apart anyway
        runner = CliRunner()
    result = runner.invoke(celery_command, ["-A", "tests.cli_app", "redislock", *args], input=stdin)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(
        ["celery", "redislock", *args], result.exit_code, result.stdout, result.stderr
    )


#: For a command whose holders run on no live worker (stale locks, or held by this
#: process): nobody answers the question, however long it waits, so waiting the
#: default second for answers proves nothing more.
NO_WORKER_WAIT = ("--timeout", "0.1")


def one_line_failure(result: subprocess.CompletedProcess[str]) -> str:
    """The single stderr line of a failed command (asserting there is exactly one)."""
    assert result.returncode != 0, result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """tests.cli_app's app on the session server (the command under test uses the same)."""
    cli_app.use(redislock_server.url)
    yield cli_app.app
    close_app(cli_app.app)


@pytest.fixture(scope="module")
def worker(app: Celery) -> Iterator[Any]:
    """An in-process worker running tests.cli_app's tasks and answering inspect."""
    with run_worker(app, concurrency=4, hostname="cli-worker@test") as worker:
        yield worker


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """The lock database, emptied before the test (the broker's database is left
    alone: the module's worker consumes from it)."""
    client = redislock_server.client()
    client.flushdb()
    yield client
    client.close()


def running_report(app: Celery, locks: redis.Redis, account: int) -> Any:
    """Send cliapp.report(account) and wait until its body holds the lock."""
    result = cli_app.report.delay(account)
    name = cli_app.report.lock_name((account,), {})
    wait_for(
        lambda: (info := read_lock(locks, name)) is not None and info.state == "running",
        what="the report task to hold its lock",
    )
    return result


def finish_report(locks: redis.Redis, account: int, result: Any) -> Any:
    """Let a running report end and return its result."""
    locks.set(f"go:{account}", 1)
    return result.get(timeout=30)


# The admin functions.
def test_list_locks_filters_by_pattern(locks: redis.Redis) -> None:
    """list_locks matches names by glob and reports hold count and fence."""
    a = RedisLock(locks, "a.task:1", ttl=30)
    b = RedisLock(locks, "b.task:1", ttl=30)
    assert a.acquire()
    assert a.acquire()
    assert b.acquire()
    infos = list_locks(locks, "a.*")
    assert [(i.name, i.count, i.fence) for i in infos] == [("a.task:1", 2, a.token)]
    assert force_release(locks, "b.task:1")
    assert not force_release(locks, "b.task:1")
    a.release()
    a.release()
    b.detach()


def test_force_release_hands_the_lock_to_its_next_waiter(locks: redis.Redis) -> None:
    """force_release frees a lock whoever holds it and hands it to the first waiter,
    who gets it at once (long before the holder's TTL) with the next fencing token."""
    holder = RedisLock(locks, "c.task:1", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(locks, "c.task:1", ttl=60)
    got, thread = acquire_in_thread(waiter, 30)
    wait_for(lambda: locks.zcard(holder.queue_key) == 1, what="the waiter to queue")
    assert force_release(locks, "c.task:1")
    thread.join(30)
    assert got == [True]
    assert holder.token is not None
    assert waiter.token is not None
    assert waiter.token > holder.token
    assert waiter.owned()
    waiter.release()
    holder.detach()


def test_force_release_of_a_listed_hold_leaves_the_next_holder_alone(
    locks: redis.Redis,
) -> None:
    """force_release with the fencing token of the hold that was read frees that hold
    only: once the lock went to a waiter, it answers CHANGED_HANDS and the waiter keeps
    it; without a token it frees whatever holds the lock."""
    first = RedisLock(locks, "d.task:1", ttl=60, lease="task-A")
    assert first.acquire()
    listed = read_lock(locks, "d.task:1")
    assert listed is not None
    second = RedisLock(locks, "d.task:1", ttl=60, lease="task-B")
    got, thread = acquire_in_thread(second, 30)
    wait_for(lambda: locks.zcard(first.queue_key) == 1, what="the waiter to queue")
    first.release()
    thread.join(30)
    assert got == [True]
    outcome = force_release(locks, "d.task:1", fence=listed.fence)
    assert outcome is ForceReleased.CHANGED_HANDS
    assert not outcome
    second.check()
    now = read_lock(locks, "d.task:1")
    assert now is not None
    assert now.holder == "task-B"
    assert force_release(locks, "d.task:1", fence=now.fence) is ForceReleased.FREED
    assert force_release(locks, "d.task:1", fence=now.fence) is ForceReleased.NOT_HELD
    second.detach()


@pytest.mark.parametrize("with_fence", [True, False])
def test_force_release_sent_again_leaves_the_waiter_it_handed_to_alone(
    locks: redis.Redis, with_fence: bool
) -> None:
    """A FORCE_RELEASE whose reply was lost is sent again with the same request id: the
    second arrival answers "freed" and does not free the waiter the first handed the
    lock to (with or without a fencing token)."""
    holder = RedisLock(locks, "e.task:1", ttl=60)
    assert holder.acquire()
    waiter = RedisLock(locks, "e.task:1", ttl=60)
    got, thread = acquire_in_thread(waiter, 30)
    wait_for(lambda: locks.zcard(holder.queue_key) == 1, what="the waiter to queue")
    key, queue = lock_keys("e.task:1", DEFAULT_PREFIX)
    args: list[str | int] = [
        str(holder.token) if with_fence else "",
        wake_channel_prefix(DEFAULT_PREFIX),
        request_id(),
        FENCE_TTL_MS,
    ]
    script = FORCE_RELEASE_SCRIPT.text
    assert locks.eval(script, 2, key, queue, *args) == 1
    thread.join(30)
    assert got == [True]
    assert locks.eval(script, 2, key, queue, *args) == 1
    waiter.check()
    waiter.release()
    holder.detach()


def test_list_locks_round_trips_escaped_names(locks: redis.Redis) -> None:
    """Names that lock_keys escapes (leading '}' or backslash) are listed as given."""
    names = ["}odd{", "\\back", "plain"]
    held = [RedisLock(locks, name, ttl=30) for name in names]
    for lock in held:
        assert lock.acquire()
    assert sorted(info.name for info in list_locks(locks)) == sorted(names)
    for lock in held:
        lock.release()


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("*", ["\\x", "ab", "a}", "xx", "}x"]),
        ("}*", ["}x"]),
        ("\\\\*", ["\\x"]),
        ("\\}x", ["}x"]),
        ("?x", ["\\x", "xx", "}x"]),
        ("??", ["\\x", "ab", "a}", "xx", "}x"]),
        ("[}]*", ["}x"]),
        ("[\\\\]*", ["\\x"]),
        ("[^a]?", ["\\x", "xx", "}x"]),
        ("*}", ["a}"]),
        ("*\\}x", ["}x"]),
    ],
)
def test_list_locks_matches_names_not_their_escaped_keys(
    locks: redis.Redis, pattern: str, expected: list[str]
) -> None:
    """A pattern is matched against lock names, as Redis matches globs: a name
    starting with '}' or a backslash, stored escaped, is found by the patterns its
    name matches, and only by those."""
    held = [RedisLock(locks, name, ttl=30) for name in ("}x", "\\x", "ab", "a}", "xx")]
    for lock in held:
        assert lock.acquire()
    assert [info.name for info in list_locks(locks, pattern)] == expected
    for lock in held:
        lock.release()


def test_list_locks_leaves_out_free_locks(locks: redis.Redis) -> None:
    """A released lock's key (kept for its fencing counter) is not listed."""
    lock = RedisLock(locks, "freed", ttl=30)
    assert lock.acquire()
    lock.release()
    assert locks.exists("redislock:{freed}")
    assert list_locks(locks) == []


def test_list_locks_describes_queued_and_running_holders(
    app: Celery, locks: redis.Redis, worker: Any
) -> None:
    """A queued until_executed lock and a running task's lock are told apart, with the
    task, the holder id, the worker node and pid, the age and the TTL."""
    queued = cli_app.queued.apply_async(("q",), countdown=60)  # waits in the worker
    running = running_report(app, locks, 1)
    before = time.time()
    by_task = {info.task: info for info in list_locks(locks)}
    assert by_task["cliapp.queued"].state == "queued"
    assert by_task["cliapp.queued"].holder == queued.id
    assert by_task["cliapp.queued"].node is None
    report = by_task["cliapp.report"]
    assert (report.state, report.holder, report.pid) == ("running", running.id, os.getpid())
    assert report.node
    assert report.since is not None
    assert report.since <= before
    age = report.age()
    assert age is not None
    assert age >= 0
    assert 0 < report.ttl_ms <= 60_000
    assert (report.count, report.waiters) == (1, 0)
    assert [i.name for i in list_locks(locks, state="running")] == [report.name]
    assert [i.task for i in list_locks(locks, task="cliapp.queued")] == ["cliapp.queued"]
    assert [i.holder for i in list_locks(locks, holder=running.id)] == [running.id]
    assert finish_report(locks, 1, running) == report.fence
    queued.revoke()
    wait_for(lambda: not list_locks(locks), what="the revoked task's lock to go")


def test_list_locks_counts_waiters(locks: redis.Redis) -> None:
    """A waiter queued for a held lock shows in the lock's waiter count."""
    holder = RedisLock(locks, "busy", ttl=30)
    assert holder.acquire()
    waiter = RedisLock(locks, "busy", ttl=30)
    got, thread = acquire_in_thread(waiter, 20)
    wait_for(lambda: list_locks(locks)[0].waiters == 1, what="the waiter to queue")
    holder.release()
    thread.join(20)
    assert got == [True]
    waiter.release()


def test_list_locks_scans_every_cluster_primary(redislock_cluster: ClusterDeployment) -> None:
    """On a Redis Cluster, locks on every primary are listed."""
    client: RedisCluster = redislock_cluster.client()
    names = [f"spread:{i}" for i in range(12)]
    held = [RedisLock(client, name, ttl=30) for name in names]
    for lock in held:
        assert lock.acquire()
    primaries = {redislock_cluster.primary_for_key(lock.key).port for lock in held}
    assert len(primaries) > 1
    assert [info.name for info in list_locks(client, "spread:*")] == sorted(names)
    assert find_locks(client, "spread:3")[0].name == "spread:3"
    for lock in held:
        lock.release()
    client.close()


def test_locks_of_a_slot_half_moved_are_listed_once_read_and_freed(
    resharding_cluster: ClusterDeployment,
) -> None:
    """While a lock's cluster slot is half-way moved to another primary (its keys
    there, the slot not yet: resharding under way, or stopped part-way), the lock
    is listed once, with its waiter, beside the others, read by name and by
    holder, and freed (handed to its waiter, whose queue moved with it)."""
    cluster = resharding_cluster
    client = cluster.client()
    try:
        still = RedisLock(client, "not-moving", ttl=60, lease="still-id")
        assert still.acquire(blocking=False)
        held = RedisLock(client, "resharded", ttl=60, lease="holder-id")
        assert held.acquire(blocking=False)
        waiter = RedisLock(client, "resharded", ttl=60)
        got, thread = acquire_in_thread(waiter, 30)
        wait_for(
            lambda: (queued := read_lock(client, "resharded")) is not None and queued.waiters == 1,
            what="the waiter to queue",
        )
        slot = client.keyslot(held.key)  # type: ignore[no-untyped-call]
        source, target = migrating(cluster, slot)
        migrate_keys(source, target, slot)
        listed = list_locks(client)
        assert [(info.name, info.waiters) for info in listed] == [
            ("not-moving", 0),
            ("resharded", 1),
        ]
        info = read_lock(client, "resharded")
        assert info is not None
        assert (info.holder, info.fence, info.waiters) == ("holder-id", held.token, 1)
        assert [found.name for found in find_locks(client, "holder-id")] == ["resharded"]
        assert force_release(client, "resharded", fence=info.fence) is ForceReleased.FREED
        thread.join(20)
        assert got == [True]
        settle(cluster, slot, target)
        waiter.release()
        still.release()
    finally:
        client.close()


@pytest.mark.slow
def test_the_command_reads_a_half_moved_slot_and_says_what_blocks_a_release(
    redislock_server: RedisServer, resharding_cluster: ClusterDeployment
) -> None:
    """With a lock's slot half-way moved, `list`, `stats` and `show` read it; a
    release that the cluster refuses until the move ends (the lock's keys would
    be split between the two primaries) fails in one line saying so, and what
    ends the move; once it has ended, the release frees the lock."""
    cluster = resharding_cluster
    ports = ",".join(str(node.port) for node in cluster.nodes)
    client = cluster.client()

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return celery(redislock_server.url, *args, REDISLOCK_TEST_CLUSTER=ports)

    try:
        held = RedisLock(client, "resharded", ttl=120)
        assert held.acquire(blocking=False)
        other = RedisLock(client, "elsewhere", ttl=120)
        assert other.acquire(blocking=False)
        slot = client.keyslot(held.key)  # type: ignore[no-untyped-call]
        source, target = migrating(cluster, slot)
        migrate_keys(source, target, slot)
        listed = command("list", "--json")
        assert listed.returncode == 0, listed.stderr
        names = [lock["name"] for lock in json.loads(listed.stdout)["locks"]]
        assert names == ["elsewhere", "resharded"]
        stats = command("stats", "--json")
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["held"] == 2
        shown = command("show", "resharded", "--json")
        assert shown.returncode == 0, shown.stderr
        (entry,) = json.loads(shown.stdout)["locks"]
        assert entry["lock"]["fence"] == held.token
        refused = one_line_failure(command("release", "resharded", "--yes", "--force"))
        assert refused.startswith("Error: lock store app.conf.redislock_client (function): ")
        assert "cluster slot is moved" in refused
        assert "redis-cli --cluster fix" in refused
        assert read_lock(client, "resharded") is not None
        settle(cluster, slot, target)
        freed = command("release", "resharded", "--yes", "--force")
        assert freed.returncode == 0, freed.stderr
        assert read_lock(client, "resharded") is None
        other.release()
    finally:
        client.close()


def test_a_slot_being_moved_is_named_in_words(redislock_cluster: ClusterDeployment) -> None:
    """A request that meets a cluster slot being moved and cannot follow it is told
    so in an operator's words (MOVED, ASK, TRYAGAIN), not as the bare reply."""
    client = redislock_cluster.client()
    key = lock_keys("words", DEFAULT_PREFIX).lock
    slot = client.keyslot(key)  # type: ignore[no-untyped-call]
    other = next(
        node for node in redislock_cluster.primaries() if node.port != cluster_port(client, slot)
    )
    wrong = other.client()
    try:
        (reply,) = run(transport_for(wrong), [("GET", key)], Deadline.after(5))
        assert isinstance(reply, MovedError)
        with pytest.raises(LockBackendError) as excinfo, backend_errors("read lock 'words'"):
            raise reply
        said = short_reason(excinfo.value)
        owner = f"{reply.host}:{reply.port}"
        assert said.startswith(
            f"cluster slot {slot} is being moved between primaries (MOVED to {owner})"
        )
        assert "try again once the move has ended" in said
        assert str(excinfo.value).endswith(said)
    finally:
        wrong.close()
        client.close()


def cluster_port(client: RedisCluster, slot: int) -> int:
    """The port of the primary that serves ``slot``, as ``client`` knows it."""
    return int(client.nodes_manager.get_node_from_slot(slot).port)


@pytest.mark.parametrize(
    ("pattern", "complaint"),
    [("", "must not be empty"), ("a[", "never closed"), ("a\\", "unescaped")],
)
def test_bad_patterns_are_refused(pattern: str, complaint: str) -> None:
    """A pattern Redis would misread is refused with a message saying why."""
    with pytest.raises(ValueError, match="pattern") as info:
        check_pattern(pattern)
    assert complaint in str(info.value)


def test_find_locks_by_name_or_holder(locks: redis.Redis) -> None:
    """find_locks takes a lock name or the task id of its holder."""
    lock = RedisLock(locks, "job:7", ttl=30, lease="task-7")
    assert lock.acquire()
    assert [i.name for i in find_locks(locks, "job:7")] == ["job:7"]
    assert [i.name for i in find_locks(locks, "task-7")] == ["job:7"]
    assert find_locks(locks, "nobody") == []
    lock.release()


def test_purge_locks(app: Celery, locks: redis.Redis) -> None:
    """purge_locks frees by task, by node, or all; clear_locks is purge_locks(all=True)."""
    with pytest.raises(ValueError, match="task=NAME, node=NODENAME or all=True"):
        purge_locks(app)
    leave_stale_lock(cli_app.report, 1, ttl=30)
    leave_stale_lock(cli_app.report, 2, ttl=30)
    other = RedisLock(locks, "plain", ttl=30, holder_info={"node": "elsewhere@host"})
    assert other.acquire()
    other.detach()
    assert purge_locks(app, node="crashed@leave_stale_lock") == 2
    assert [i.name for i in list_locks(locks)] == ["plain"]
    leave_stale_lock(cli_app.report, 3, ttl=30)
    assert purge_locks(app, task="cliapp.report") == 1
    assert clear_locks(app) == 1
    assert list_locks(locks) == []


def test_lock_stats(locks: redis.Redis) -> None:
    """lock_stats counts held locks per task and state and finds the oldest hold."""
    now = time.time()
    for name, task, state, since in [
        ("a:1", "a", "running", now - 30),
        ("a:2", "a", "queued", now - 5),
        ("b:1", "b", "running", now - 60),
    ]:
        lock = RedisLock(
            locks,
            name,
            ttl=30,
            holder_info={"task": task, "state": state, "since": str(since)},
        )
        assert lock.acquire()
        lock.detach()
    stats = lock_stats(list_locks(locks), now)
    jsonschema.validate(stats, STATS_SCHEMA)
    assert stats["held"] == 3
    assert stats["by_task"]["a"] == {"queued": 1, "running": 1, "unknown": 0, "waiters": 0}
    assert stats["oldest"]["name"] == "b:1"
    assert stats["oldest"]["age"] == pytest.approx(60, abs=1)


# The command line.
def test_ping(redislock_server: RedisServer) -> None:
    """`ping` reports the lock store and its server version."""
    result = celery(redislock_server.url, "ping")
    assert result.returncode == 0, result.stderr
    assert f"lock store {redislock_server.url}: ok (server " in result.stdout


@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "noeviction"])
def test_ping_warns_about_a_server_that_evicts_locks(
    redislock_server: RedisServer, redislock_server_factory: Callable[..., RedisServer], policy: str
) -> None:
    """`ping` warns on stderr about a lock store with a memory limit enforced by
    evicting keys (lock keys all have an expiry, so volatile-* evicts them too),
    and not about noeviction; it succeeds either way."""
    store = redislock_server_factory()
    store.client().config_set("maxmemory", "100mb")
    store.client().config_set("maxmemory-policy", policy)
    result = celery(redislock_server.url, "ping", REDISLOCK_TEST_LOCK_URL=store.url)
    assert result.returncode == 0, result.stderr
    assert f"lock store {store.url}: ok (server " in result.stdout
    warned = f"maxmemory-policy {policy} evicts keys" in result.stderr
    assert warned is (policy != "noeviction"), result.stderr
    if warned:
        assert "set maxmemory-policy noeviction" in result.stderr


def test_ping_does_not_warn_without_a_memory_limit(
    redislock_server: RedisServer, redislock_server_factory: Callable[..., RedisServer]
) -> None:
    """Without maxmemory the server evicts nothing, whatever its policy says."""
    store = redislock_server_factory()
    store.client().config_set("maxmemory-policy", "allkeys-lru")
    result = celery(redislock_server.url, "ping", REDISLOCK_TEST_LOCK_URL=store.url)
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr


def test_unreachable_store_is_one_line_without_password(redislock_server: RedisServer) -> None:
    """With the lock store down, a command prints one line naming the store (password
    hidden) and why, and exits non-zero: no traceback."""
    down = f"redis://:s3cret@127.0.0.1:{free_port()}/0"
    for command in (["ping"], ["list"], ["release", "x:1", "--yes"]):
        result = celery(redislock_server.url, *command, REDISLOCK_TEST_LOCK_URL=down)
        line = one_line_failure(result)
        assert line == (
            f"Error: lock store {down.replace('s3cret', '***')}: unreachable (connection refused)"
        )


def test_an_unreachable_store_of_one_task_is_named_alone_and_the_others_are_worked_on(
    app: Celery, locks: redis.Redis
) -> None:
    """With one task's own lock store down, each command names that store alone (on
    stderr, one line), still works on the store that answers, and exits non-zero."""
    url = str(app.conf.redislock_url)
    down = f"redis://127.0.0.1:{free_port()}/3"
    name = leave_stale_lock(cli_app.report, 21, ttl=30)
    holder = list_locks(locks)[0].holder
    assert holder is not None
    failed = f"Error: lock store {down}: unreachable (connection refused)"

    def command(*args: str) -> subprocess.CompletedProcess[str]:
        return celery(url, *args, REDISLOCK_TEST_ELSEWHERE_URL=down)

    ping = command("ping")
    assert one_line_failure(ping) == failed
    assert f"lock store {url}: ok (server " in ping.stdout
    listed = command("list", "--json")
    assert one_line_failure(listed) == failed
    document = json.loads(listed.stdout)
    jsonschema.validate(document, LIST_SCHEMA)
    assert [lock["name"] for lock in document["locks"]] == [name]
    assert document["errors"] == [failed.removeprefix("Error: ")]
    stats = command("stats")
    assert one_line_failure(stats) == failed
    assert stats.stdout.startswith("1 lock(s) held, 0 waiter(s) queued (in what could be read")
    shown = command("show", name, *NO_WORKER_WAIT)
    assert one_line_failure(shown) == failed
    assert f"holder   {holder}" in shown.stdout
    released = command("release", "--holder", holder, "--yes", "--force")
    assert released.returncode == 1
    assert released.stderr.strip().splitlines()[-1] == failed
    assert f"released {name}: evicted" in released.stdout
    assert read_lock(locks, name) is None
    again = leave_stale_lock(cli_app.report, 21, ttl=30)
    purged = command("purge", "--all", "--yes", "--force")
    assert purged.returncode == 1
    assert purged.stderr.strip().splitlines()[-1] == failed
    assert f"released {again}: evicted" in purged.stdout
    assert read_lock(locks, again) is None


def test_a_task_with_invalid_options_is_a_task_configuration_error(
    app: Celery, locks: redis.Redis
) -> None:
    """A task whose option value is invalid is reported as a task configuration error
    naming the task, not as a lock store's; the command works on the other tasks'
    locks and exits non-zero. `name` of another task is not concerned."""
    url = str(app.conf.redislock_url)
    name = leave_stale_lock(cli_app.report, 22, ttl=30)
    listed = celery(url, "list", REDISLOCK_TEST_MISCONFIGURED="1")
    line = one_line_failure(listed)
    assert line.startswith("Error: task configuration: "), line
    assert "'cliapp.misconfigured'" in line
    assert "on_conflict must be one of" in line
    assert "lock store" not in line
    assert listed.stdout.splitlines()[1].split()[0] == name
    assert read_lock(locks, name) is not None
    named = celery(url, "name", "cliapp.report", "22", REDISLOCK_TEST_MISCONFIGURED="1")
    assert (named.returncode, named.stdout.strip()) == (0, name)


def test_a_cluster_client_that_cannot_be_made_is_one_line(redislock_server: RedisServer) -> None:
    """With the app's redislock_client callable making a RedisCluster whose nodes are
    away (it fails as it is made), a command prints one line naming the store and
    why, and exits non-zero: no traceback."""
    for command in (["list"], ["show", "x:1"], ["release", "x:1", "--yes"], ["purge", "--all"]):
        result = celery(redislock_server.url, *command, REDISLOCK_TEST_CLUSTER=str(free_port()))
        line = one_line_failure(result)
        assert line == (
            "Error: lock store app.conf.redislock_client (function): "
            "unreachable (connection refused)"
        )


def test_missing_app_says_pass_a(tmp_path: Path) -> None:
    """Without -A, the command says to pass one instead of failing on Celery's default app."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CELERY_")}
    result = subprocess.run(
        [sys.executable, "-m", "celery", "redislock", "list"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert "pass -A proj" in one_line_failure(result)


def test_list_text_and_json(app: Celery, locks: redis.Redis, worker: Any) -> None:
    """`list` shows one row per held lock with state, node and pid; `--json` follows the
    documented schema; filters narrow it down."""
    running = running_report(app, locks, 2)
    plain = RedisLock(locks, "plain:1", ttl=30, lease="lease-1")
    assert plain.acquire()
    text = celery_here(app, "list")
    assert text.returncode == 0, text.stderr
    header, *rows, total = text.stdout.splitlines()
    assert header.split() == [
        "NAME",
        "TASK",
        "HOLDER",
        "STATE",
        "NODE",
        "PID",
        "AGE",
        "TTL",
        "FENCE",
        "HOLDS",
        "WAITERS",
    ]
    assert total == "2 lock(s) held"
    report_row = next(row.split() for row in rows if row.startswith("cliapp.report:"))
    assert report_row[1:4] == ["cliapp.report", running.id, "running"]
    assert report_row[5] == str(os.getpid())
    listed = celery_here(app, "list", "--json")
    assert listed.returncode == 0, listed.stderr
    document = json.loads(listed.stdout)
    jsonschema.validate(document, LIST_SCHEMA)
    assert document["count"] == 2
    assert document["errors"] == []
    assert {lock["name"] for lock in document["locks"]} == {
        "plain:1",
        cli_app.report.lock_name((2,), {}),
    }
    only = json.loads(celery_here(app, "list", "--json", "--state", "running").stdout)
    assert [lock["holder"] for lock in only["locks"]] == [running.id]
    by_holder = json.loads(celery_here(app, "list", "--json", "--holder", "lease-1").stdout)
    assert [lock["name"] for lock in by_holder["locks"]] == ["plain:1"]
    by_pattern = json.loads(celery_here(app, "list", "plain:*", "--json").stdout)
    assert by_pattern["count"] == 1
    by_task = json.loads(celery_here(app, "list", "--task", "cliapp.report", "--json").stdout)
    assert by_task["locks"][0]["holder"] == running.id
    finish_report(locks, 2, running)
    plain.release()


def test_bad_pattern_is_one_line(redislock_server: RedisServer) -> None:
    """A malformed glob is refused in one line."""
    result = celery(redislock_server.url, "list", "broken[")
    assert "'[' is never closed" in one_line_failure(result)


def test_show_by_name_and_by_task_id(app: Celery, locks: redis.Redis, worker: Any) -> None:
    """`show` finds a lock by name or by its holder's task id, and tells what the result
    backend and the live workers know of the holder."""
    running = running_report(app, locks, 3)
    name = cli_app.report.lock_name((3,), {})
    by_id = celery_here(app, "show", running.id)
    assert by_id.returncode == 0, by_id.stderr
    fields = dict(line.split(None, 1) for line in by_id.stdout.splitlines() if line.strip())
    assert fields["name"] == name
    assert fields["state"] == "running"
    assert fields["worker"] == "cli-worker@test reports it active"
    assert fields["result"] == "PENDING"
    shown = celery_here(app, "show", name, "--json")
    document = json.loads(shown.stdout)
    jsonschema.validate(document, SHOW_SCHEMA)
    (entry,) = document["locks"]
    assert document["errors"] == []
    assert entry["lock"]["holder"] == running.id
    assert entry["holder_status"]["result_error"] is None
    assert entry["holder_status"]["worker"] == "cli-worker@test"
    assert entry["holder_status"]["worker_state"] == "active"
    finish_report(locks, 3, running)
    missing = celery_here(app, "show", "no-such-lock")
    assert "no lock named 'no-such-lock' is held" in one_line_failure(missing)


def queued_waiting_task(locks: redis.Redis, account: int, go: str) -> tuple[Any, float]:
    """Send cliapp.waiting(account, go) while another holds its lock, wait until it
    is queued for it, and return its result and a ``since`` taken after that: a
    hold that begins later says no earlier time."""
    result = cli_app.waiting.delay(account, go)
    _, queue = lock_keys(cli_app.waiting.lock_name((account, go), {}))
    wait_for(lambda: locks.zcard(queue) == 1, what="the waiting task to queue")
    # (Its description was made before it queued: a millisecond earlier at least.)
    time.sleep(0.01)
    ms = time.time_ns() // 1_000_000
    # As a description's since has it: the milliseconds cut.
    return result, float(f"{ms // 1000}.{ms % 1000:03d}")


def held_by(locks: redis.Redis, account: int, task_id: str) -> LockInfo:
    """The hold of cliapp.waiting(account)'s lock, once task ``task_id`` has it."""
    name = cli_app.waiting.lock_name((account, ""), {})
    wait_for(
        lambda: (info := read_lock(locks, name)) is not None and info.holder == task_id,
        what=f"task {task_id} to hold its lock",
    )
    info = read_lock(locks, name)
    assert info is not None
    return info


def test_since_of_a_waiter_handed_the_lock_is_when_it_got_it(
    app: Celery, locks: redis.Redis, worker: Any
) -> None:
    """A task that waited for its lock, handed over by its holder's release, holds it
    since then, not since it began to wait: `show` and `stats` (the oldest hold, as
    lock_stats finds it) say so, in the lock store's clock as the release ran."""
    first = cli_app.waiting.delay(20, "first")
    held_by(locks, 20, first.id)
    second, before = queued_waiting_task(locks, 20, "second")
    # Queued, it says since when it waits (its hold will say since when it holds).
    (waiting,) = read_waiters(locks, cli_app.waiting.lock_name((20, ""), {}))
    assert waiting.task_id == second.id
    assert waiting.since is not None
    assert waiting.since <= before
    locks.set("go:first", 1)
    first.get(timeout=30)
    held = held_by(locks, 20, second.id)
    assert held.since is not None
    assert held.since >= before
    assert re.fullmatch(r"\d+\.\d{3}", fields(locks, lock_keys(held.name)[0])["b"])
    shown = json.loads(celery_here(app, "show", second.id, "--json").stdout)
    (entry,) = shown["locks"]
    assert entry["lock"]["since"] == held.since
    assert lock_stats(list_locks(locks))["oldest"]["since"] == held.since
    locks.set("go:second", 1)
    second.get(timeout=30)


def test_since_of_a_waiter_an_operator_release_hands_the_lock_to_is_when_it_got_it(
    app: Celery, locks: redis.Redis, worker: Any
) -> None:
    """`release --force` of a running holder hands the lock to the task waiting for
    it, whose hold begins then."""
    first = cli_app.waiting.delay(21, "first")
    held_by(locks, 21, first.id)
    second, before = queued_waiting_task(locks, 21, "second")
    forced = celery_here(app, "release", "--holder", first.id, "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    held = held_by(locks, 21, second.id)
    assert held.since is not None
    assert held.since >= before
    locks.set("go:first", 1)
    locks.set("go:second", 1)
    first.get(timeout=30)
    second.get(timeout=30)


def test_since_of_a_waiter_that_takes_an_expired_lock_is_when_it_took_it(
    app: Celery, locks: redis.Redis, worker: Any
) -> None:
    """A waiting task that takes the lock itself once a crashed holder's hold expired
    (nobody hands it over) holds it since the try that took it."""
    # Held long enough for the task to queue behind it, however slow the worker, then
    # left a second to run.
    stale = leave_stale_lock(cli_app.waiting, 22, "crashed", ttl=60)
    waiting, before = queued_waiting_task(locks, 22, "waiting")
    assert locks.pexpire(lock_keys(stale).lock, 1000)
    held = held_by(locks, 22, waiting.id)
    assert held.since is not None
    assert held.since >= before
    locks.set("go:waiting", 1)
    waiting.get(timeout=30)


def test_show_lists_a_locks_waiters_and_finds_a_waiting_task_by_its_id(
    app: Celery, locks: redis.Redis
) -> None:
    """`show NAME` lists the tasks queued for the lock (task id, task, node, pid, since
    when they wait), under "waiting" and in --json; `show TASK_ID` of a waiting task
    says which lock it waits for, and where in the queue, and shows that lock."""
    holder = RedisLock(locks, "queue:1", ttl=60, lease="holder-id")
    assert holder.acquire()
    since = time.time() - 5
    described = {"task": "t.wait", "state": "running", "node": "w@host", "pid": "42"}
    waiter = RedisLock(
        locks, "queue:1", ttl=60, lease="waiter-id", holder_info={**described, "since": str(since)}
    )
    got, thread = acquire_in_thread(waiter, 30)
    wait_for(lambda: locks.zcard(holder.queue_key) == 1, what="the waiter to queue")
    by_name = celery_here(app, "show", "queue:1", "--json", *NO_WORKER_WAIT)
    assert by_name.returncode == 0, by_name.stderr
    document = json.loads(by_name.stdout)
    jsonschema.validate(document, SHOW_SCHEMA)
    (entry,) = document["locks"]
    assert entry["waiting"] == [
        {**described, "task_id": "waiter-id", "pid": 42, "since": pytest.approx(since)}
    ]
    by_id = celery_here(app, "show", "waiter-id", *NO_WORKER_WAIT)
    assert by_id.returncode == 0, by_id.stderr
    lines = by_id.stdout.splitlines()
    assert lines[0] == "waiter-id is waiting for queue:1, number 1 in its queue"
    fields = dict(line.split(None, 1) for line in lines[1:] if line.strip())
    assert (fields["name"], fields["holder"]) == ("queue:1", "holder-id")
    waiting = datetime.fromtimestamp(since, timezone.utc).isoformat(timespec="seconds")
    assert fields["waiting"].startswith(
        f"waiter-id (t.wait) on w@host pid 42, waiting since {waiting} ("
    )
    holder.release()
    thread.join(30)
    assert got == [True]
    waiter.release()


def test_name_of_a_call(app: Celery) -> None:
    """`name` prints the lock name a call would use; ARGS are JSON values or strings."""
    result = celery_here(app, "name", "cliapp.report", "42", "--kwargs", '{"full": true}')
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == cli_app.report.lock_name((42,), {"full": True})
    as_text = celery_here(app, "name", "cliapp.queued", "hello")
    assert as_text.stdout.strip() == cli_app.queued.lock_name(("hello",), {})
    unknown = celery_here(app, "name", "cliapp.nope")
    assert "no task 'cliapp.nope'" in one_line_failure(unknown)
    bad = celery_here(app, "name", "cliapp.report", "1", "--kwargs", "[1]")
    assert "--kwargs must be a JSON object" in one_line_failure(bad)


def test_name_refuses_an_unknown_option(app: Celery) -> None:
    """An unknown option given to `name` (a mistyped --kwargs) is a usage error that
    names it, the option meant and the options there are, rather than a string
    argument of the call whose lock name is printed; a negative number is an
    argument, and so is anything after '--'."""
    typo = celery_here(app, "name", "cliapp.report", "--kwarg", '{"account_id": 1}')
    assert typo.returncode == 2, typo.stdout
    assert typo.stdout == ""
    assert (
        "Error: No such option '--kwarg'. Did you mean '--kwargs'? The options of 'name' "
        "are --help, --kwargs; an argument of the call that starts with '-' goes after '--'"
    ) in typo.stderr
    unknown = celery_here(app, "name", "cliapp.report", "7", "-x")
    assert unknown.returncode == 2, unknown.stdout
    assert "No such option '-x'. The options of 'name' are --help, --kwargs" in unknown.stderr
    assert "as in: name TASK -- -x" in unknown.stderr
    dashes = celery_here(app, "name", "cliapp.report", "-1", "--kwargs={}", "--", "--kwarg")
    assert dashes.returncode == 0, dashes.stderr
    assert dashes.stdout.strip() == cli_app.report.lock_name((-1, "--kwarg"), {})


def test_name_of_a_call_that_does_not_fit_shows_the_parameters(app: Celery) -> None:
    """Arguments the task's body could not take are refused in one line that shows
    the parameters it takes."""
    result = celery_here(app, "name", "cliapp.report", "1", "true", "3")
    assert one_line_failure(result) == (
        "Error: the arguments do not fit task 'cliapp.report', whose body takes "
        "(account_id, full=False): too many positional arguments"
    )


def test_release_of_a_task_id_or_a_mistyped_name_says_what_to_give(
    app: Celery, locks: redis.Redis, worker: Any
) -> None:
    """`release NAME` given the task id of a holder frees nothing and says to use
    --holder; given a task id that holds nothing, it says so and how to find the held
    locks. `release --holder` given a lock name says to give it as NAME, and
    `--task` a task the app does not have lists those it has."""
    running = running_report(app, locks, 15)
    name = cli_app.report.lock_name((15,), {})
    by_id = one_line_failure(celery_here(app, "release", running.id, "--yes"))
    assert by_id == (
        f"Error: no lock named {running.id!r} is held; {running.id} is the task id holding "
        f"{name}: use --holder {running.id}"
    )
    nobody = str(uuid.uuid4())
    gone = one_line_failure(celery_here(app, "release", nobody, "--yes"))
    assert f"no lock is held by task id {nobody} either (--holder TASK_ID" in gone
    assert "`celery -A tests.cli_app redislock list` shows the held locks" in gone
    by_name = one_line_failure(celery_here(app, "release", "--holder", name, "--yes"))
    assert by_name == (
        f"Error: no lock is held by task id {name!r}; {name!r} is a lock's name: "
        f"release it with `release {name}`"
    )
    typo = one_line_failure(celery_here(app, "release", "--task", "cliapp.reprot", "--yes"))
    assert typo == (
        "Error: no lock of task cliapp.reprot is held (app 'cliapp' has no task "
        "'cliapp.reprot'; its SingletonTasks: cliapp.queued, cliapp.report, cliapp.waiting)"
    )
    assert read_lock(locks, name) is not None
    finish_report(locks, 15, running)


def test_release_asks_first(app: Celery, locks: redis.Redis) -> None:
    """`release NAME` lists what it would free and asks; 'n' (or no answer) frees
    nothing, 'y' frees it and says whose lock it evicted."""
    name = leave_stale_lock(cli_app.report, 5, ttl=30)
    declined = celery_here(app, "release", name, *NO_WORKER_WAIT, stdin="n\n")
    assert declined.returncode == 1
    assert "Aborted!" in declined.stderr
    assert read_lock(locks, name) is not None
    confirmed = celery_here(app, "release", name, *NO_WORKER_WAIT, stdin="y\n")
    assert confirmed.returncode == 0, confirmed.stderr
    assert f"released {name}: evicted task cliapp.report, holder crashed-" in confirmed.stdout
    assert "running on crashed@leave_stale_lock" in confirmed.stdout
    assert read_lock(locks, name) is None


def test_release_warns_of_a_holder_whose_node_did_not_answer(
    app: Celery, locks: redis.Redis
) -> None:
    """A lock described as running on a node that does not answer (here, gone) is
    released after a warning saying that its node did not answer."""
    name = leave_stale_lock(cli_app.report, 9, ttl=30)
    released = celery_here(app, "release", name, "--yes", "--timeout", "0.5")
    assert released.returncode == 0, released.stderr
    assert "node crashed@leave_stale_lock did not answer within 0.5 s" in released.stderr
    assert read_lock(locks, name) is None


def test_release_by_pattern_holder_and_task(app: Celery, locks: redis.Redis) -> None:
    """`release` takes exactly one of NAME, --pattern, --holder or --task; a NAME that
    looks like a glob gets a hint to use --pattern."""
    for account in (6, 7, 8):
        leave_stale_lock(cli_app.report, account, ttl=30)
    hint = celery_here(app, "release", "cliapp.report:*", "--yes")
    assert "use --pattern 'cliapp.report:*'" in one_line_failure(hint)
    holder = list_locks(locks)[0].holder
    assert holder is not None
    by_holder = celery_here(app, "release", "--holder", holder, "--yes", *NO_WORKER_WAIT)
    assert by_holder.returncode == 0, by_holder.stderr
    assert len(list_locks(locks)) == 2
    by_pattern = celery_here(
        app, "release", "--pattern", "cliapp.report:*", "--yes", *NO_WORKER_WAIT
    )
    assert by_pattern.stdout.count("released ") == 2
    assert list_locks(locks) == []
    leave_stale_lock(cli_app.report, 9, ttl=30)
    by_task = celery_here(app, "release", "--task", "cliapp.report", "--yes", *NO_WORKER_WAIT)
    assert by_task.returncode == 0, by_task.stderr
    assert list_locks(locks) == []
    both = celery_here(app, "release", "x:1", "--task", "cliapp.report")
    assert both.returncode == 2
    assert "exactly one of" in one_line_failure(both)


def test_release_refuses_a_running_holder_unless_forced(
    app: Celery, locks: redis.Redis, worker: Any
) -> None:
    """A lock whose holder a live worker is running is not released without --force;
    with it, the lock is freed and the running task finds it lost."""
    running = running_report(app, locks, 10)
    name = cli_app.report.lock_name((10,), {})
    refused = celery_here(app, "release", name, "--yes")
    line = one_line_failure(refused)
    assert f"its holder {running.id} is running on cli-worker@test" in line
    assert "--force" in line
    assert read_lock(locks, name) is not None
    forced = celery_here(app, "release", name, "--yes", "--force")
    assert forced.returncode == 0, forced.stderr
    assert f"released {name}: evicted task cliapp.report, holder {running.id}" in forced.stdout
    assert (
        f"its holder {running.id} was not stopped: if it still runs, it keeps running "
        "without its lock"
    ) in forced.stderr
    assert read_lock(locks, name) is None
    finish_report(locks, 10, running)


def test_release_and_purge_of_a_selection_leave_only_the_running_holders(
    app: Celery, locks: redis.Redis, worker: Any
) -> None:
    """`release --task`, `release --pattern` and `purge` free the selected locks whose
    holder no live worker runs, list those whose holder runs as left, and exit with
    status 4 saying that --force frees those too; with only running holders selected,
    nothing is released."""
    running = running_report(app, locks, 23)
    live = cli_app.report.lock_name((23,), {})
    left = f"left: {live} (task cliapp.report, holder {running.id}, running on cli-worker@test"
    for command in (["release", "--task", "cliapp.report"], ["purge", "--all"]):
        stale = leave_stale_lock(cli_app.report, 24, ttl=30)
        result = celery_here(app, *command, "--yes", "--timeout", "0.5")
        assert result.returncode == 4, result.stderr
        assert f"released {stale}: evicted" in result.stdout
        assert left in result.stdout
        assert "--force frees it too" in result.stdout
        assert (
            result.stderr.strip()
            .splitlines()[-1]
            .endswith(
                "left to their holders, which a live worker is running (listed above); "
                "pass --force to free those too (the tasks keep running, without their locks)"
            )
        )
        assert read_lock(locks, stale) is None
        assert read_lock(locks, live) is not None
    only_live = celery_here(app, "release", "--pattern", live, "--yes", "--timeout", "0.5")
    assert only_live.returncode == 4, only_live.stderr
    assert left in only_live.stdout
    assert "released nothing: the 1 lock(s) matching" in one_line_failure(only_live)
    assert read_lock(locks, live) is not None
    finish_report(locks, 23, running)


def test_a_selection_that_matches_nothing(app: Celery, locks: redis.Redis) -> None:
    """A selection that is valid but matches no held lock exits 0 and says so; one
    that names what cannot be (a task the app does not have and no lock is held
    for, a node name not of the form NAME@HOST) fails."""
    for command in (["purge", "--task", "nosuch", "--yes"], ["list", "--task", "nosuch"]):
        unknown = celery_here(app, *command)
        assert unknown.returncode == 1, unknown.stdout
        assert one_line_failure(unknown) == (
            "Error: no lock of task nosuch is held (app 'cliapp' has no task 'nosuch'; "
            "its SingletonTasks: cliapp.queued, cliapp.report, cliapp.waiting)"
        )
    node = celery_here(app, "purge", "--node", "nosuch", "--yes")
    assert node.returncode == 2
    assert "--node takes a worker node name, NAME@HOST" in one_line_failure(node)
    pattern = celery_here(app, "release", "--pattern", "nothing:*", "--yes")
    assert (pattern.returncode, pattern.stdout) == (0, "no lock matching nothing:* is held\n")
    gone = celery_here(app, "purge", "--node", "gone@host", "--yes")
    assert (gone.returncode, gone.stdout) == (0, "no lock on node gone@host is held\n")
    listed = celery_here(app, "list", "nothing:*")
    assert (listed.returncode, listed.stdout) == (0, "0 lock(s) held\n")
    stats = celery_here(app, "stats")
    assert (stats.returncode, stats.stdout) == (0, "0 lock(s) held, 0 waiter(s) queued\n")
    removed = RedisLock(locks, "removed.task:1", ttl=30, holder_info={"task": "removed.task"})
    assert removed.acquire()
    left = celery_here(app, "list", "--task", "removed.task", "--json")
    assert left.returncode == 0, left.stderr
    assert [lock["name"] for lock in json.loads(left.stdout)["locks"]] == ["removed.task:1"]
    removed.release()


def test_release_leaves_a_lock_that_changed_hands_since_it_was_listed(
    app: Celery, locks: redis.Redis
) -> None:
    """Between the listing (and the question) and the release, one listed lock is
    handed to its waiter: that waiter was never shown nor checked, so it keeps the
    lock, the output says the lock changed hands, and the command exits with status
    3; the other listed lock is released all the same."""
    url = str(app.conf.redislock_url)
    first = RedisLock(locks, "moved:1", ttl=60, lease="task-A")
    other = RedisLock(locks, "moved:2", ttl=60, lease="task-C")
    assert first.acquire()
    assert other.acquire()
    waiter = RedisLock(locks, "moved:1", ttl=60, lease="task-B")
    got, thread = acquire_in_thread(waiter, 30)
    wait_for(lambda: locks.zcard(first.queue_key) == 1, what="the waiter to queue")
    command = [sys.executable, "-m", "celery", "-A", "tests.cli_app", "redislock"]
    with subprocess.Popen(
        [*command, "release", "--pattern", "moved:*", "--timeout", "0.2"],
        cwd=ROOT,
        env=command_environment(url),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        listed = [process.stdout.readline(), process.stdout.readline()]
        assert [line.split()[:3] for line in listed] == [
            ["to", "release:", "moved:1"],
            ["to", "release:", "moved:2"],
        ], listed
        first.release()  # the lock goes to the waiter while the command asks
        thread.join(30)
        assert got == [True]
        out, err = process.communicate("y\n", timeout=60)
    assert process.returncode == 3, (out, err)
    assert "not released moved:1: it changed hands since it was listed" in out
    assert "(now holder task-B; listed: holder task-A, fence" in out
    assert "evicted" not in out.split("moved:1", 1)[1].split("\n", 1)[0]
    assert "released moved:2: evicted holder task-C" in out
    assert "1 lock(s) changed hands since they were listed and were not released" in err
    waiter.check()
    info = read_lock(locks, "moved:1")
    assert info is not None
    assert info.holder == "task-B"
    assert read_lock(locks, "moved:2") is None
    waiter.release()
    first.detach()
    other.detach()


def test_a_frozen_broker_does_not_hang_show_release_or_purge(
    app: Celery, locks: redis.Redis, redislock_server_factory: Callable[..., RedisServer]
) -> None:
    """With the broker frozen (it accepts connections and answers nothing), `show`
    ends and says the broker did not answer; `release` and `purge` refuse, as when
    the workers cannot be asked, unless --force. (The subprocess timeout is the
    guard against a hang.) The three commands that wait for the broker run side by
    side: none of them changes the lock."""
    broker = redislock_server_factory()
    store = str(app.conf.redislock_url)
    name = leave_stale_lock(cli_app.report, 14, ttl=60)
    with broker.paused():
        shown, released, purged = celery_together(
            broker.url,
            ("show", name, "--timeout", "0.1"),
            ("release", name, "--yes", "--timeout", "0.1"),
            ("purge", "--all", "--yes", "--timeout", "0.1"),
            REDISLOCK_TEST_LOCK_URL=store,
        )
        assert read_lock(locks, name) is not None
        forced = celery(
            broker.url, "release", name, "--yes", "--force", REDISLOCK_TEST_LOCK_URL=store
        )
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(None, 1) for line in shown.stdout.splitlines() if line.strip())
    assert fields["worker"].startswith("workers not asked: the broker did not answer within ")
    for refused in (released, purged):
        line = one_line_failure(refused)
        assert "cannot tell whether the holders still run (workers not asked: the broker " in line
        assert "pass --force to release anyway" in line
    assert forced.returncode == 0, forced.stderr
    assert f"released {name}: evicted" in forced.stdout
    assert read_lock(locks, name) is None


def test_show_with_a_frozen_result_backend_says_it_timed_out(
    app: Celery, locks: redis.Redis, redislock_server_factory: Callable[..., RedisServer]
) -> None:
    """With the result backend frozen, `show` reads it while it asks the workers, until
    the one --timeout deadline, and says that it timed out."""
    backend = redislock_server_factory()
    url = str(app.conf.redislock_url)
    name = leave_stale_lock(cli_app.report, 26, ttl=30)
    with backend.paused():
        shown = celery(
            url, "show", name, "--timeout", "0.3", REDISLOCK_TEST_BACKEND_URL=backend.url
        )
    assert shown.returncode == 0, shown.stderr
    fields = dict(line.split(None, 1) for line in shown.stdout.splitlines() if line.strip())
    assert fields["result"] == (
        "unknown (timed out: the result backend did not answer within 0.3 s)"
    )


def test_purge(app: Celery, locks: redis.Redis) -> None:
    """`purge` frees every lock of a task, of a node, or of the app, after the same checks."""
    nothing = celery_here(app, "purge")
    assert nothing.returncode == 2
    assert "--task NAME, --node NODENAME or --all" in one_line_failure(nothing)
    leave_stale_lock(cli_app.report, 11, ttl=30)
    leave_stale_lock(cli_app.queued, "x", ttl=30)
    by_node = celery_here(
        app, "purge", "--node", "crashed@leave_stale_lock", "--yes", *NO_WORKER_WAIT
    )
    assert by_node.stdout.count("released ") == 2, by_node.stderr
    leave_stale_lock(cli_app.report, 12, ttl=30)
    with hold_lock(cli_app.queued, "y"):
        by_task = celery_here(app, "purge", "--task", "cliapp.report", "--yes", *NO_WORKER_WAIT)
        assert by_task.stdout.count("released ") == 1, by_task.stderr
        everything = celery_here(app, "purge", "--all", "--yes", *NO_WORKER_WAIT)
        assert everything.stdout.count("released ") == 1, everything.stderr
    assert list_locks(locks) == []
    empty = celery_here(app, "purge", "--all", "--yes", *NO_WORKER_WAIT)
    assert empty.returncode == 0
    assert "no lock of the app is held" in empty.stdout


def test_stats(app: Celery, locks: redis.Redis) -> None:
    """`stats` counts held locks by task and state; `--json` follows the schema."""
    leave_stale_lock(cli_app.report, 13, ttl=30)
    with hold_lock(cli_app.queued, "z"):
        text = celery_here(app, "stats")
        assert text.returncode == 0, text.stderr
        assert text.stdout.startswith("2 lock(s) held, 0 waiter(s) queued")
        document = json.loads(celery_here(app, "stats", "--json").stdout)
    jsonschema.validate(document, STATS_SCHEMA)
    assert document["held"] == 2
    assert document["errors"] == []
    assert set(document["by_task"]) == {"cliapp.report", "cliapp.queued"}


def test_purge_covers_tasks_with_prefixes_of_their_own(
    redislock_server: RedisServer, locks: redis.Redis
) -> None:
    """A task with a lock_prefix of its own has its locks purged with the app's others."""
    app = make_app(redislock_server.url, "prefixes")

    @app.task(base=SingletonTask, shared=False, name="prefixes.own", lock_prefix="own")
    def own(n: int) -> None: ...

    @app.task(base=SingletonTask, shared=False, name="prefixes.default")
    def default(n: int) -> None: ...

    leave_stale_lock(own, 1, ttl=30)
    leave_stale_lock(default, 1, ttl=30)
    assert [info.prefix for info in list_locks(locks, prefix="own")] == ["own"]
    assert purge_locks(app, all=True) == 2
    assert list_locks(locks, prefix="own") == []
    assert list_locks(locks) == []
    close_app(app)


#: An app (a module of its own, for the command's -A) whose task keeps its locks in a
#: lock store and under a prefix of its own: database 2 of the app's server.
OWN_STORE_APP = '''"""An app whose task has a lock_url and a lock_prefix of its own."""

import os

from celery_redislock import SingletonTask
from tests.support import make_app

URL = os.environ["REDISLOCK_TEST_URL"]
app = make_app(URL, "ownstore")


@app.task(
    base=SingletonTask,
    shared=False,
    name="ownstore.elsewhere",
    lock_url=URL.rsplit("/", 1)[0] + "/2",
    lock_prefix="elsewhere",
)
def elsewhere(n: int) -> None: ...
'''


def test_commands_cover_a_task_with_a_lock_store_of_its_own(
    redislock_server: RedisServer,
    locks: redis.Redis,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The command works on a task's own ``lock_url`` (another database of the server)
    and ``lock_prefix`` too: `list` shows that task's lock, and `purge --all` frees it."""
    (tmp_path / "own_store_app.py").write_text(OWN_STORE_APP)
    monkeypatch.setenv("REDISLOCK_TEST_URL", redislock_server.url)
    spec = importlib.util.spec_from_file_location("own_store_app", tmp_path / "own_store_app.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    elsewhere = redislock_server.client(db=2)
    try:
        name = leave_stale_lock(module.elsewhere, 1, ttl=30)
        assert read_lock(elsewhere, name, "elsewhere") is not None
        assert list_locks(locks) == []  # nothing in the app's own store

        def command(*args: str) -> subprocess.CompletedProcess[str]:
            return celery(redislock_server.url, *args, app="own_store_app", cwd=tmp_path)

        text = command("list")
        assert text.returncode == 0, text.stderr
        _header, *rows, total = text.stdout.splitlines()
        assert [row.split()[:2] for row in rows] == [[name, "ownstore.elsewhere"]]
        assert total == "1 lock(s) held"
        listed = command("list", "--json")
        assert listed.returncode == 0, listed.stderr
        document = json.loads(listed.stdout)
        assert [(lock["name"], lock["prefix"]) for lock in document["locks"]] == [
            (name, "elsewhere")
        ]
        purged = command("purge", "--all", "--yes")
        assert purged.returncode == 0, purged.stderr
        assert purged.stdout.count("released ") == 1
        assert f"released {name}: evicted" in purged.stdout
        assert read_lock(elsewhere, name, "elsewhere") is None
    finally:
        elsewhere.flushdb()
        elsewhere.close()
        close_app(module.app)


def operations_table(column: str) -> list[str]:
    """The first column of the Operations page's table whose first header is ``column``."""
    lines = (ROOT / "docs" / "operations.md").read_text().splitlines()
    (start,) = [i for i, line in enumerate(lines) if line.startswith(f"| {column} |")]
    rows = itertools.takewhile(lambda line: line.startswith("|"), lines[start + 2 :])
    return [row.split("|")[1].strip().strip("`") for row in rows]


def test_operations_page_documents_the_json_schema() -> None:
    """The Operations page's field tables for LOCK, HOLDER and WAITER list the schemas' fields,
    in the schemas' order."""
    assert operations_table("`LOCK` field") == list(LOCK_SCHEMA["properties"])
    assert operations_table("`HOLDER` field") == list(HOLDER_SCHEMA["properties"])
    assert operations_table("`WAITER` field") == list(WAITER_SCHEMA["properties"])
    assert set(LOCK_SCHEMA["required"]) == set(LOCK_SCHEMA["properties"])


def test_reads_scan_and_never_use_keys(locks: redis.Redis) -> None:
    """Listing locks walks the keyspace with SCAN, never KEYS."""
    lock = RedisLock(locks, "scanned:1", ttl=30)
    assert lock.acquire()
    locks.config_resetstat()
    assert [info.name for info in list_locks(locks)] == ["scanned:1"]
    stats = locks.info("commandstats")
    assert "cmdstat_scan" in stats
    assert "cmdstat_keys" not in stats
    lock.release()


def test_ping_reaches_every_cluster_primary(redislock_cluster: ClusterDeployment) -> None:
    """On a Redis Cluster, the server version is read from each primary."""
    client = redislock_cluster.client()
    assert len(server_versions(client)) == 3
    client.close()
