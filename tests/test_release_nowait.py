"""release(wait=False): the release leaves without waiting for its answer, and still
keeps every promise a waited-for release makes."""

from __future__ import annotations

import contextlib
import logging
import select
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
import redis

from celery_redislock import LockNotOwnedError, RedisLock, SingletonTask
from celery_redislock import transport as transport_module
from celery_redislock.heartbeat import get_heartbeat
from celery_redislock.scripts import RELEASE_SCRIPT
from celery_redislock.server import RedisServer
from celery_redislock.testing import run_worker
from celery_redislock.transport import Deadline, transport_for
from tests.proxy import FaultProxy
from tests.support import close_app, held, make_app, wait_for


def test_task_waits_for_one_round_trip_only(redislock_server: RedisServer) -> None:
    """A SingletonTask's body ends without waiting for its release's answer: when apply()
    returns, the answer is still unread, and it is read moments later."""
    app = make_app(redislock_server.url, "one-trip")

    @app.task(base=SingletonTask, shared=False)
    def job() -> str:
        return "done"

    job.apply()  # scripts cached on the server
    transport = transport_for(job.lock_client)
    wait_for(lambda: not transport.owes_replies(), what="the first answers")
    before = transport.sends
    assert job.apply().get() == "done"
    assert transport.sends - before == 2  # the acquire's round trip and the release's write
    assert transport.owes_replies()
    wait_for(lambda: not transport.owes_replies(), what="the release's answer to be read")
    close_app(app)


def test_releases_go_by_digest_once_the_server_has_the_script(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A release without waiting is sent with the script's text only until the server
    is known to have it: after the first answer, releases go as EVALSHA."""
    server = redislock_server_factory()
    client = server.client()
    lock = RedisLock(client, "by-digest", ttl=30)
    transport = transport_for(client)
    for _ in range(5):
        assert lock.acquire(blocking=False)
        lock.release(wait=False)
        wait_for(lambda: not transport.owes_replies(), what="the release's answer")
    stats = client.info("commandstats")
    # The first acquire (after a NOSCRIPT by digest) and the first release carry
    # their scripts' text, once each; the four others of each go by digest.
    assert stats["cmdstat_eval"]["calls"] == 2
    assert stats["cmdstat_evalsha"]["calls"] == 1 + 4 + 4
    client.close()


def test_steady_releases_are_read_by_the_next_requests(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """Releases that keep coming (a worker's, lock after lock) are read by the next
    request on the connection: the heartbeat thread reads none of them itself and
    is not woken for them, and it stops looking once they stop coming. The loop is
    paced like a worker's, so that it spans several of the thread's looks."""
    client = redislock_server_factory().client()
    transport = transport_for(client)
    outcomes: list[str] = []
    first = RedisLock(client, "steady:first", ttl=30)
    assert first.acquire(blocking=False)
    first.release(wait=False, then=outcomes.append)
    lane = get_heartbeat()._lanes[transport]
    notified, drained = lane.notified, lane.drained
    for index in range(300):
        lock = RedisLock(client, f"steady:{index}", ttl=30)
        assert lock.acquire(blocking=False)
        time.sleep(0.0005)
        lock.release(wait=False, then=outcomes.append)
        time.sleep(0.0005)
    wait_for(lambda: len(outcomes) == 301, what="every release's answer")
    assert set(outcomes) == {"released"}
    # A stall of a whole DRAIN_DELAY on a busy machine may cost one early wake-up
    # or one read each; being woken for the releases would be one per look.
    assert lane.notified - notified <= 3
    assert lane.drained - drained <= 3
    wait_for(lambda: lane.drain_at is None, what="the thread to stop looking")
    client.close()


def test_a_lone_release_is_read_by_the_heartbeat(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A release with no request after it is read by the heartbeat thread, and its
    outcome handed over."""
    client = redislock_server_factory().client()
    transport = transport_for(client)
    lock = RedisLock(client, "lone", ttl=30)
    outcomes: list[str] = []
    assert lock.acquire(blocking=False)
    lane = get_heartbeat()._lanes[transport]
    drained = lane.drained
    lock.release(wait=False, then=outcomes.append)
    wait_for(lambda: outcomes == ["released"], what="the release's answer")
    assert not transport.owes_replies()
    assert lane.drained == drained + 1
    client.close()


@pytest.mark.slow
def test_lock_is_free_once_the_result_is_seen(redislock_server: RedisServer) -> None:
    """With a real worker, a client that sees a task's result finds its key free at once,
    every time: the release is written before the result is stored."""
    app = make_app(redislock_server.url, "result-then-free")
    locks = redislock_server.client()

    @app.task(base=SingletonTask, shared=False, on_conflict="raise")
    def job(n: int) -> int:
        return n

    still_held = []
    with run_worker(app, concurrency=2):
        for n in range(50):
            assert job.delay(n).get(timeout=20) == n
            key = f"redislock:{{{job.lock_name((n,), {})}}}"
            if held(locks, key):
                still_held.append(n)
    close_app(app)
    locks.close()
    assert still_held == []


def test_release_nowait_of_a_lost_lock_is_logged(
    redislock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A release that turns out not to have been owned is still logged (and reported to
    ``then`` as 'lost')."""
    lock = RedisLock(redislock_client, "nowait-lost", ttl=10)
    assert lock.acquire()
    redislock_client.delete(lock.key)
    outcomes: list[str] = []
    with caplog.at_level(logging.WARNING, logger="celery_redislock"):
        lock.release(wait=False)
        wait_for(lambda: "no longer held when released" in caplog.text, what="the warning")
    assert lock.acquire()
    redislock_client.delete(lock.key)
    lock.release(wait=False, then=outcomes.append)
    wait_for(lambda: outcomes == ["lost"], what="the outcome")


def test_release_nowait_stops_renewal_even_if_unanswered(
    redislock_server: RedisServer,
) -> None:
    """A release whose answer never comes still stops renewal at once: the lock then
    goes by its TTL (or by the background retry once the server answers again)."""
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        client = redis.Redis.from_url(proxy.url)
        direct = redislock_server.client()
        lock = RedisLock(client, "nowait-blackholed", ttl=1.0, call_timeout=0.5)
        assert lock.acquire()
        proxy.blackhole()
        outcomes: list[str] = []
        lock.release(wait=False, then=outcomes.append)
        assert lock not in get_heartbeat().held()
        assert not lock.holding
        wait_for(lambda: not held(direct, lock.key), timeout=10, what="the lock to go")
        wait_for(lambda: outcomes == ["retrying"], timeout=10, what="the outcome")
        client.close()
        direct.close()


def test_release_nowait_without_a_hold_raises(redislock_client: redis.Redis) -> None:
    """release(wait=False) of a lock this object does not hold raises at once."""
    with pytest.raises(LockNotOwnedError):
        RedisLock(redislock_client, "nowait-unheld", ttl=5).release(wait=False)


def test_release_written_before_exit_lands(redislock_server: RedisServer) -> None:
    """A process that releases without waiting and exits at once (no cleanup at all)
    still frees the lock: the request was written before release() returned."""
    child = textwrap.dedent(
        f"""
        import os
        from celery_redislock import RedisLock
        lock = RedisLock({redislock_server.url!r}, "nowait-exit", ttl=60)
        assert lock.acquire()
        lock.release(wait=False)
        os._exit(0)
        """
    )
    subprocess.run([sys.executable, "-c", child], check=True, timeout=60)
    direct = redislock_server.client()
    wait_for(lambda: not held(direct, "redislock:{nowait-exit}"), what="the release to land")
    direct.close()


def test_answer_is_read_before_a_normal_exit(redislock_server: RedisServer) -> None:
    """A process that releases without waiting and then exits normally reads the answer
    first (at exit at the latest): its ``then`` callback runs."""
    child = textwrap.dedent(
        f"""
        from celery_redislock import RedisLock
        lock = RedisLock({redislock_server.url!r}, "nowait-normal-exit", ttl=60)
        assert lock.acquire()
        lock.release(wait=False, then=lambda outcome: print("outcome:", outcome, flush=True))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], check=True, timeout=60, capture_output=True, text=True
    )
    assert "outcome: released" in done.stdout


def _exiting_child(url: str, name: str, body: str, ends: str) -> subprocess.Popen[str]:
    """A child process that takes locks ``name`` (``lock``) and ``name`` + ``-other``
    (``other``), ttl 60 s, through ``url``, prints ``acquired``, waits for a line
    on its stdin, runs ``body`` and ends: by a normal exit (``"exit"``, the
    ``atexit`` hook) or as a prefork pool child does (``"pool-child"``: the ``worker_process_shutdown``
    handler, then ``os._exit``). Its flush at exit takes 1 s at most."""
    child = textwrap.dedent(
        """
        import logging, os, sys
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
        from celery_redislock import RedisLock, transport
        from celery_redislock.heartbeat import get_heartbeat
        from celery_redislock.task import _flush_at_child_exit
        transport.FLUSH_TIMEOUT = 1.0
        url = {url!r}
        lock = RedisLock(url, {name!r}, ttl=60, call_timeout=0.5)
        other = RedisLock(url, {name!r} + "-other", ttl=60, call_timeout=0.5)
        assert lock.acquire(blocking=False) and other.acquire(blocking=False)
        print("acquired", flush=True)
        sys.stdin.readline()
        {body}
        if {ends!r} == "pool-child":
            _flush_at_child_exit()
            os._exit(0)
        """
    ).format(url=url, name=name, body=textwrap.dedent(body).strip(), ends=ends)
    process = subprocess.Popen(
        [sys.executable, "-c", child],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "acquired"
    return process


def _go_on(process: subprocess.Popen[str]) -> str:
    """Let an :func:`_exiting_child` go on; its output once it has exited."""
    out, _ = process.communicate("\n", timeout=60)
    assert process.returncode == 0, out
    return out


@pytest.mark.parametrize("ends", ["exit", "pool-child"])
def test_a_release_whose_answer_went_dark_is_sent_again_before_the_process_exits(
    redislock_server_factory: Callable[..., RedisServer], ends: str
) -> None:
    """A process releases without waiting on a connection that has gone dark (new
    connections work) and exits: its flush at exit reads no answer, counts it lost,
    and sends the release again on a new connection before the process ends. The
    lock is free as soon as the process has exited, not held for its TTL."""
    # A server of its own: the locks this test leaves to their TTL stay with it.
    server = redislock_server_factory()
    direct = server.client()
    with FaultProxy(server.host, server.port) as proxy:
        child = _exiting_child(
            proxy.url,
            f"exit-dark-{ends}",
            'lock.release(wait=False, then=lambda o: print("outcome:", o, flush=True))',
            ends,
        )
        proxy.silence_open()
        out = _go_on(child)
        assert not held(direct, f"redislock:{{exit-dark-{ends}}}"), out
        assert "outcome: retrying" in out
        assert f"releasing lock 'exit-dark-{ends}': done" in out
    direct.close()


def test_a_release_retried_in_the_background_is_sent_before_the_process_exits(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A release that failed (release() raised) and waits in the background for its
    next try is sent when the process exits, before that try is due: the lock is
    free once the process has exited."""
    # A server of its own: the locks this test leaves to their TTL stay with it.
    server = redislock_server_factory()
    direct = server.client()
    with FaultProxy(server.host, server.port) as proxy:
        child = _exiting_child(
            proxy.url,
            "exit-retried",
            """
            try:
                lock.release()
            except Exception as exc:
                print("raised:", exc, flush=True)
            # No background try from here on: only the exit sends it.
            get_heartbeat().stop()
            print("stopped", flush=True)
            sys.stdin.readline()
            """,
            "exit",
        )
        proxy.silence_open()
        proxy.refuse()
        assert child.stdin is not None
        assert child.stdout is not None
        child.stdin.write("\n")
        child.stdin.flush()
        assert "raised:" in child.stdout.readline()
        assert child.stdout.readline().strip() == "stopped"
        assert held(direct, "redislock:{exit-retried}")
        proxy.heal()
        out = _go_on(child)
        assert not held(direct, "redislock:{exit-retried}"), out
        assert "releasing lock 'exit-retried': done" in out
    direct.close()


def test_exit_with_a_server_out_of_reach_is_bounded(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A process whose server went out of reach (black-holed) exits all the same, a
    release whose answer it owes and one retried in the background given up and
    logged so: its flush at exit reads for part of its time and sends for the rest."""
    # A server of its own: the locks this test leaves to their TTL stay with it.
    server = redislock_server_factory()
    with FaultProxy(server.host, server.port) as proxy:
        child = _exiting_child(
            proxy.url,
            "exit-unreachable",
            """
            other.release(wait=False)
            try:
                lock.release()
            except Exception as exc:
                print("raised:", exc, flush=True)
            """,
            "exit",
        )
        proxy.blackhole()
        out = _go_on(child)
    assert "raised:" in out
    assert "releasing lock 'exit-unreachable': gave up" in out
    assert "as the process exits" in out


def test_a_handler_raising_system_exit_leaves_the_next_answers_handed_over(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """Two releases whose answers are owed on one connection: the first's handler
    raises SystemExit as the answers are read; the second's still gets its answer."""
    client = redislock_server_factory().client()
    transport = transport_for(client)
    outcomes: list[str] = []

    def leave(outcome: str) -> None:
        raise SystemExit(f"leaving on {outcome}")

    first, second = (
        RedisLock(client, "exit:first", ttl=30),
        RedisLock(client, "exit:second", ttl=30),
    )
    assert first.acquire(blocking=False)
    assert second.acquire(blocking=False)
    first.release(wait=False, then=leave)
    second.release(wait=False, then=outcomes.append)
    with contextlib.suppress(SystemExit):
        transport.drain(Deadline.after(5))
    wait_for(lambda: outcomes == ["released"], what="the second release's answer")
    assert not transport.owes_replies()
    client.close()


def test_an_inner_release_refused_unrun_goes_ahead_of_the_outer_one(
    redislock_server: RedisServer,
) -> None:
    """A re-entered lock whose inner release did not wait, and that the server refused
    without running it (its scripts gone: a restart, a failover, ``SCRIPT FLUSH``),
    is freed by its outer release all the same: the inner one's answer is read
    before the outer one goes, so it is sent again ahead of it, in order, rather
    than learned of only while the outer one's round trip reads it."""
    client = redislock_server.client()
    lock = RedisLock(client, "inner-refused", ttl=30)
    assert lock.acquire(blocking=False)
    assert lock.acquire(blocking=False)
    lock.release()
    assert lock.acquire(blocking=False)  # the server runs RELEASE: sent by digest now
    client.script_flush()

    lock.release(wait=False)
    lock.release()

    assert not lock.holding
    assert not RedisLock(client, "inner-refused", ttl=30).locked()
    client.close()


@pytest.mark.parametrize("rdhup", [True, False], ids=["rdhup", "peek"])
def test_a_release_on_a_connection_the_server_closed_goes_on_a_new_one(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch, rdhup: bool
) -> None:
    """The server closes the idle connection while the lock is held (``CLIENT KILL``,
    a restart, its idle ``timeout``): a release without waiting is not written down
    the closed connection, to fail only when its answer is read, but on a new one.
    Its first answer frees the key; no resend is needed. Without ``rdhup``, as on
    a system whose ``poll(2)`` does not report the server's end shut (not Linux):
    the close is seen by a peek."""
    if not rdhup:
        monkeypatch.setattr(transport_module, "_PEER_SHUT", 0)
        monkeypatch.setattr(transport_module, "_WATCHED", select.POLLIN)
        monkeypatch.setattr(transport_module, "_HUNG_UP", select.POLLHUP | select.POLLERR)
    client = redislock_server.client()
    transport = transport_for(client)
    lock = RedisLock(client, f"closed-under-release-{rdhup}", ttl=30)
    assert lock.acquire(blocking=False)
    before = list(transport._idle)
    killer = redislock_server.client()
    assert killer.client_kill_filter(_type="normal", skipme=True) >= 1
    outcomes: list[str] = []
    lock.release(wait=False, then=outcomes.append)
    assert transport.owes_replies()
    assert not any(link in before for link in transport._owed)
    transport.drain(Deadline.after(5))
    assert outcomes == ["released"]
    assert not held(killer, lock.key)
    killer.close()
    client.close()


def test_a_release_after_a_restart_goes_by_text_on_a_new_connection(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """The server restarts while the lock is held: it closed the idle connection and
    lost its scripts. A release without waiting goes on a new connection, by text
    (not by digest, to be refused ``NOSCRIPT`` and sent again only once that answer
    is read): its first answer is the release's own. (Persistence is off: the key
    went with the restart, so the answer says the lock was lost.)"""
    server = redislock_server_factory()
    client = server.client()
    transport = transport_for(client)
    lock = RedisLock(client, "restarted-under-release", ttl=30)
    assert lock.acquire(blocking=False)
    lock.release(wait=False)
    transport.drain(Deadline.after(5))
    assert RELEASE_SCRIPT.sha in transport.scripts
    assert lock.acquire(blocking=False)
    server.restart()
    outcomes: list[str] = []
    lock.release(wait=False, then=outcomes.append)
    transport.drain(Deadline.after(5))
    assert outcomes == ["lost"]
    assert RELEASE_SCRIPT.sha in transport.scripts
    client.close()
