"""Helpers shared by the benchmark scripts: servers, statistics, counters, findings.

The scripts in this folder import it as ``common`` (they run with this folder on
``sys.path``). Nothing here asserts anything: the benchmarks print figures, and
a finding that misses its target is reported as ``NOT MET``, never raised.
"""

from __future__ import annotations

import cProfile
import importlib
import importlib.metadata
import io
import json
import os
import platform
import pstats
import statistics
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import redis
from redis.connection import AbstractConnection

from celery_redislock.server import RedisServer
from celery_redislock.transport import Transport, _Link

#: PyPI distributions compared against, with the module each one provides.
PEERS: dict[str, str] = {
    "celery-once": "celery_once",
    "celery-singleton": "celery_singleton",
    "python-redis-lock": "redis_lock",
}

#: How to install the peers, for messages about a missing one.
INSTALL_PEERS = "pip install -e '.[bench]'"


# Environment.
def load_average() -> str:
    """The 1/5/15-minute load averages (other work on the machine skews every timing)."""
    try:
        return "{:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except (AttributeError, OSError):
        return "n/a"


def version_of(distribution: str) -> str:
    """The installed version of a distribution, or ``not installed``."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def server_version(url: str) -> str:
    """``redis 7.0.15``-style name and version of the server at ``url``."""
    with redis.Redis.from_url(url) as client:
        info = client.info("server")
    if "valkey_version" in info:
        return f"valkey {info['valkey_version']}"
    return f"redis {info['redis_version']}"


def describe_machine(url: str | None = None) -> list[str]:
    """Lines naming the machine, the load, and the versions of everything measured."""
    lines = [
        f"machine : {platform.platform()} ({platform.machine()}), {os.cpu_count()} CPUs, "
        f"load average {load_average()}",
        f"python  : {platform.python_implementation()} {platform.python_version()}",
        "libs    : "
        + ", ".join(
            f"{name} {version_of(name)}"
            for name in ("celery_redislock", "celery", "kombu", "redis", *PEERS)
        ),
    ]
    if url is not None:
        lines.append(f"server  : {server_version(url)}")
    return lines


def import_peer(distribution: str) -> tuple[ModuleType | None, str]:
    """Import a peer library; return ``(module, "")`` or ``(None, why not)``.

    Peers are optional (the ``bench`` extra), so a missing one is reported in
    the output instead of stopping the benchmark.
    """
    module = PEERS[distribution]
    try:
        return importlib.import_module(module), ""
    except ImportError as exc:
        return None, f"{distribution} cannot be imported ({exc}); {INSTALL_PEERS}"


# Servers.
@contextmanager
def servers(url: str | None, count: int) -> Iterator[list[str]]:
    """``count`` server URLs: private servers on free 127.0.0.1 ports, or ``url`` each time.

    With ``url`` every figure counted by the server also includes whatever
    else talks to it, so it should be a server nothing else uses.
    """
    if url:
        yield [url] * count
        return
    with ExitStack() as stack:
        yield [stack.enter_context(RedisServer()).url for _ in range(count)]


# Server-side counting.
def reset_stats(client: redis.Redis) -> None:
    """``CONFIG RESETSTAT``: zero ``INFO commandstats`` before a measurement."""
    client.config_resetstat()


#: Commands the measurement itself sends, left out of every count.
_MEASURING = frozenset({"info", "config|resetstat", "config"})

#: Commands that are the round trip itself rather than work done inside it.
SCRIPT_CALLS = frozenset({"evalsha", "eval", "evalsha_ro", "eval_ro", "fcall"})


def command_stats(client: redis.Redis) -> dict[str, tuple[int, float]]:
    """``INFO commandstats`` as ``{command: (calls, microseconds spent)}``,
    measuring commands left out.

    Redis counts the commands a Lua script runs as well as the ``EVALSHA``
    that ran it (whose time includes theirs), so this shows what one request
    really costs the server.
    """
    stats: dict[str, Any] = client.info("commandstats")
    return {
        name.removeprefix("cmdstat_"): (int(value["calls"]), float(value["usec"]))
        for name, value in stats.items()
        if name.removeprefix("cmdstat_") not in _MEASURING and int(value["calls"])
    }


def command_calls(client: redis.Redis) -> dict[str, int]:
    """:func:`command_stats`'s calls alone: ``{command: calls}``."""
    return {name: calls for name, (calls, _) in command_stats(client).items()}


def server_cpu(client: redis.Redis) -> float:
    """CPU seconds (user + system) the server has used so far (``INFO cpu``)."""
    info: dict[str, Any] = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


@dataclass
class CommandCount:
    """Server commands per operation: script calls, and everything else."""

    #: Script calls (``EVALSHA``, ``EVAL``, ``FCALL``, ...) per operation.
    scripts: float
    #: Every other command per operation (run inside scripts, or sent plainly).
    other: float
    #: ``other`` by command name.
    by_name: dict[str, float]

    @property
    def total(self) -> float:
        """All commands the server counted, script calls included."""
        return self.scripts + self.other

    def breakdown(self) -> str:
        """``get 2.00, set 2.00, ...`` (script calls first)."""
        parts = [f"{name} {n:.2f}" for name, n in sorted(self.by_name.items())]
        return ", ".join(parts) or "-"


def per_operation(calls: dict[str, int], operations: int) -> CommandCount:
    """Turn a commandstats snapshot taken since a reset into a per-operation count."""
    scripts = sum(n for name, n in calls.items() if name in SCRIPT_CALLS)
    other = {name: n / operations for name, n in calls.items() if name not in SCRIPT_CALLS}
    return CommandCount(scripts / operations, sum(other.values()), other)


# Client-side counting.
class WriteCounter:
    """Counts request writes on every redis-py connection of this process.

    One write is one request or one pipeline: one round trip. Writes made from
    the thread that entered the counter are on the caller's critical path; the
    rest come from background threads (a heartbeat, a retried release). Of the
    caller's writes, those sent with the engine's ``Transport.send_deferred``
    (a release that does not wait for its answer) are not waited for: the
    caller's *synchronous* round trips are the others.
    """

    def __init__(self) -> None:
        self.total = 0
        self.caller = 0
        self.deferred = 0
        self.caller_deferred = 0
        self._caller_ident = threading.get_ident()
        self._guard = threading.Lock()

    def _count(self, deferred: bool = False) -> None:
        with self._guard:
            mine = threading.get_ident() == self._caller_ident
            if deferred:
                self.deferred += 1
                self.caller_deferred += mine
            else:
                self.total += 1
                self.caller += mine

    @property
    def waited(self) -> int:
        """Round trips the calling thread waited for (written, then its reply read)."""
        return self.caller - self.caller_deferred


@contextmanager
def counting_writes() -> Iterator[WriteCounter]:
    """Count redis-py request writes while the block runs (see :class:`WriteCounter`).

    The count is taken at the lowest level every redis-py client shares
    (``send_packed_command``), so it covers clients the benchmark does not
    control (the peers' clients), and where the lock engine writes to its own
    connections' sockets (``_Link.send``).
    """
    counter = WriteCounter()
    original: Callable[..., Any] = AbstractConnection.send_packed_command
    engine_send: Callable[..., Any] = _Link.send

    def counted(self: AbstractConnection, command: Any, check_health: bool = True) -> Any:
        counter._count()
        return original(self, command, check_health)

    def counted_engine_send(self: _Link, *args: Any) -> Any:
        counter._count()
        return engine_send(self, *args)

    deferred: Callable[..., Any] | None = getattr(Transport, "send_deferred", None)

    def counted_deferred(self: Transport, *args: Any, **kwargs: Any) -> Any:
        counter._count(deferred=True)
        assert deferred is not None
        return deferred(self, *args, **kwargs)

    AbstractConnection.send_packed_command = counted  # type: ignore[method-assign]
    _Link.send = counted_engine_send  # type: ignore[method-assign,assignment]
    if deferred is not None:
        setattr(Transport, "send_deferred", counted_deferred)  # noqa: B010 - patched for the count
    try:
        yield counter
    finally:
        AbstractConnection.send_packed_command = original  # type: ignore[method-assign]
        _Link.send = engine_send  # type: ignore[method-assign]
        if deferred is not None:
            setattr(Transport, "send_deferred", deferred)  # noqa: B010 - restored


# Statistics.
def percentile(values: Sequence[float], fraction: float) -> float:
    """The value at ``fraction`` (0..1) of the sorted values (nearest rank)."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Spread:
    """The median of some samples and their range: a noisy machine shows as a wide range."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        """The spread of ``samples`` (at least one)."""
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))

    def show(self, digits: int = 2, unit: str = "") -> str:
        """``1.23 (1.10-1.40)`` with ``digits`` decimals and an optional unit."""
        spec = f",.{digits}f"
        if self.count == 1:
            return f"{self.median:{spec}}{unit}"
        return f"{self.median:{spec}}{unit} ({self.low:{spec}}-{self.high:{spec}})"


# Findings: each goal's figure against its target, for the summary table.
@dataclass
class Finding:
    """One measured figure compared with its target."""

    goal: int
    what: str
    value: str
    target: str
    #: ``True``/``False`` against the target, ``None`` when there is no target.
    met: bool | None

    @property
    def verdict(self) -> str:
        """``MET``, ``NOT MET`` or ``-``."""
        return "-" if self.met is None else ("MET" if self.met else "NOT MET")


@dataclass
class Findings:
    """The findings of one run, printed as they are made and saved as JSON for ``run_all``."""

    items: list[Finding] = field(default_factory=list)

    def add(
        self, goal: int, what: str, value: str, target: str = "", met: bool | None = None
    ) -> str:
        """Record a finding; return the text to print after the figure (``target ...: MET``)."""
        finding = Finding(goal, what, value, target, met)
        self.items.append(finding)
        if met is None:
            return ""
        return f"target {target}: {finding.verdict}"

    def save(self, path: str | None) -> None:
        """Write the findings as JSON to ``path`` (nothing without a path)."""
        if path:
            Path(path).write_text(json.dumps([asdict(f) for f in self.items], indent=1))


def load_findings(path: Path) -> list[Finding]:
    """Read findings written by :meth:`Findings.save` (none if the file is missing)."""
    if not path.exists() or not path.read_text().strip():
        return []
    return [Finding(**item) for item in json.loads(path.read_text())]


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` started at ``shift`` (mod its length): interleaves variants across rounds,
    so that none always runs first, or always right after the same other one."""
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def print_profile(profiler: cProfile.Profile, cumulative: int = 15, own: int = 10) -> None:
    """Print the top functions of a profile by cumulative time, then by time spent in
    themselves: the first shows which path costs most, the second where it is spent."""
    for order, top in (("cumulative", cumulative), ("tottime", own)):
        buffer = io.StringIO()
        pstats.Stats(profiler, stream=buffer).strip_dirs().sort_stats(order).print_stats(top)
        lines = buffer.getvalue().splitlines()
        start = next(i for i, line in enumerate(lines) if "ncalls" in line)
        print(f"   top {top} by {'cumulative' if order == 'cumulative' else 'own'} time:")
        for line in lines[start:]:
            if line.strip():
                print(f"   {line}")
