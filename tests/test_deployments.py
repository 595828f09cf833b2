"""The deployment helpers themselves: Cluster, Sentinel, TLS and ACL servers start,
settle, fail over and clean up as documented (the lock engine on them is tested in
``test_deployments_engine.py``)."""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

from celery_redislock.deployments import (
    CLUSTER_SLOTS,
    AclUser,
    ClusterDeployment,
    SentinelDeployment,
    TLSServer,
    create_acl_user,
)
from celery_redislock.server import RedisServer


def _role(server: RedisServer) -> str:
    """The ``ROLE`` a running server answers (``master`` or ``slave``)."""
    client = server.client(socket_timeout=5)
    try:
        role = client.execute_command("ROLE")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    return str(role[0].decode() if isinstance(role[0], bytes) else role[0])


def _refuses(host: str, port: int) -> bool:
    """Whether nothing accepts a plain connection on ``host:port`` any more."""
    client = redis.Redis(
        host=host,
        port=port,
        socket_connect_timeout=1,
        socket_timeout=1,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        client.ping()
    except redis.ConnectionError:
        return True
    finally:
        client.close()
    return False


# Cluster.


@pytest.fixture(scope="module")
def cluster_client(redislock_cluster: ClusterDeployment) -> Iterator[RedisCluster]:
    """A cluster client for the session cluster."""
    client = redislock_cluster.client()
    yield client
    client.close()


def test_cluster_is_ok_and_keys_spread_over_every_primary(
    redislock_cluster: ClusterDeployment, cluster_client: RedisCluster
) -> None:
    """Every node of the session cluster says cluster_state:ok, the three primaries
    split all 16384 slots, and keys written through a cluster client land on each."""
    assert len(redislock_cluster.nodes) == 3
    for node in redislock_cluster.nodes:
        client = node.client(decode_responses=True)
        info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
        assert "cluster_state:ok" in info
        assert f"cluster_slots_ok:{CLUSTER_SLOTS}" in info
        client.close()
    primaries = redislock_cluster.primaries()
    assert sorted(p.port for p in primaries) == sorted(n.port for n in redislock_cluster.nodes)
    keys = [f"deployments:spread:{i}" for i in range(30)]
    for key in keys:
        cluster_client.set(key, "1")
    try:
        counts = {}
        for primary in primaries:
            client = primary.client()
            counts[primary.port] = sum(1 for _ in client.scan_iter("deployments:spread:*"))
            client.close()
        assert sum(counts.values()) == len(keys)
        assert all(count > 0 for count in counts.values()), counts
        for key in keys[:5]:
            owner = redislock_cluster.primary_for_key(key)
            direct = owner.client()
            assert direct.get(key) == b"1"
            direct.close()
    finally:
        cluster_client.delete(*keys)


def test_cluster_startup_url_and_nodes_reach_the_cluster(
    redislock_cluster: ClusterDeployment,
) -> None:
    """startup_url works with RedisCluster.from_url and startup_nodes lists every node."""
    client = RedisCluster.from_url(redislock_cluster.startup_url)
    try:
        assert len(client.get_primaries()) == 3  # type: ignore[no-untyped-call]
    finally:
        client.close()
    assert [n.port for n in redislock_cluster.startup_nodes] == [
        n.port for n in redislock_cluster.nodes
    ]


@pytest.mark.slow
def test_cluster_failover_promotes_the_replica_and_stop_cleans_up(
    redislock_cluster_factory: Callable[..., ClusterDeployment],
) -> None:
    """With a replica per primary, killing a primary hands its slots (and its data) to
    its replica, the cluster settles again, and stop() ends every process and removes
    the deployment's directory."""
    cluster = redislock_cluster_factory(masters=3, replicas_per_master=1)
    assert len(cluster.primaries()) == 3
    assert len(cluster.replicas()) == 3
    assert all(_role(node) == "slave" for node in cluster.replicas())
    client = cluster.client()
    try:
        client.set("deployments:failover", "kept")
        victim = cluster.primary_for_key("deployments:failover")
        direct = victim.client()
        assert direct.execute_command("WAIT", 1, 5000) == 1  # type: ignore[no-untyped-call]
        direct.close()
        cluster.kill(victim)
        heir = cluster.wait_for_failover(victim, timeout=30)
        assert heir is not victim
        assert cluster.primary_for_key("deployments:failover") is heir
        assert _role(heir) == "master"
        fresh = cluster.client()
        assert fresh.get("deployments:failover") == b"kept"
        fresh.close()
    finally:
        client.close()
    directory = cluster.directory
    nodes = list(cluster.nodes)
    cluster.stop()
    assert not os.path.exists(directory)
    assert all(node.process is None for node in nodes)
    assert all(_refuses(node.host, node.port) for node in nodes)
    cluster.stop()  # a second stop is harmless


# Sentinel.


def test_sentinel_reports_the_master_and_its_replica(
    redislock_sentinel: SentinelDeployment,
) -> None:
    """Every Sentinel of the session deployment names the first server primary, which
    answers ROLE master, and the replica answers ROLE slave; the URL lists every
    Sentinel and redis-py's Sentinel finds the same primary."""
    master = redislock_sentinel.master()
    assert master is redislock_sentinel.servers[0]
    assert _role(master) == "master"
    assert [_role(r) for r in redislock_sentinel.replicas()] == ["slave"]
    hosts = redislock_sentinel.sentinel_hosts
    assert len(hosts) == 3
    assert redislock_sentinel.sentinel_url == ";".join(f"sentinel://{h}:{p}" for h, p in hosts)
    assert redislock_sentinel.transport_options == {"master_name": "mymaster"}
    sentinel = Sentinel(hosts, socket_timeout=5)  # type: ignore[no-untyped-call,unused-ignore]
    assert sentinel.discover_master("mymaster") == (master.host, master.port)  # type: ignore[no-untyped-call,unused-ignore]
    for node in sentinel.sentinels:
        node.close()
    client = redislock_sentinel.client(socket_timeout=5)
    assert client.ping()
    client.close()


@pytest.mark.slow
def test_sentinel_failover_produces_a_new_master(
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
) -> None:
    """kill_master() SIGKILLs the primary; wait_for_failover() returns once every
    Sentinel names the replica, which then answers ROLE master; stop() cleans up."""
    deployment = redislock_sentinel_factory(replicas=1, sentinels=3)
    old = deployment.kill_master()
    assert old.process is None
    new = deployment.wait_for_failover(timeout=30, old=old)
    assert new is not old
    assert new is deployment.master()
    assert _role(new) == "master"
    directory = deployment.directory
    processes = [*deployment.servers, *deployment.sentinel_servers]
    deployment.stop()
    assert not os.path.exists(directory)
    assert all(server.process is None for server in processes)


def test_failed_start_stops_what_it_started() -> None:
    """A deployment whose start fails half-way (a Sentinel rejects its configuration)
    raises, and has already stopped the servers it started and removed its directory."""
    deployment = SentinelDeployment(master_name="no spaces allowed", startup_timeout=5)
    with pytest.raises(RuntimeError, match="Unrecognized sentinel configuration"):
        deployment.start()
    assert deployment.servers, "the data servers were started before the Sentinel"
    assert all(server.process is None for server in deployment.servers)
    assert all(_refuses(s.host, s.port) for s in deployment.servers)
    with pytest.raises(RuntimeError, match="not started"):
        _ = deployment.directory


# TLS.


def test_tls_rejects_plain_connections_and_accepts_a_verified_one(
    redislock_tls_server: TLSServer,
) -> None:
    """The TLS server refuses plain TCP and an unverifiable TLS handshake, and answers a
    client that verifies it with the CA, whether built from its rediss:// URL or by
    client()."""
    server = redislock_tls_server
    assert server.url.startswith(f"rediss://127.0.0.1:{server.port}/0?")
    assert "ssl_cert_reqs=required" in server.url
    assert f"ssl_ca_certs={server.ca_path}" in server.url
    no_retry = Retry(NoBackoff(), 0)
    plain = redis.Redis(host=server.host, port=server.port, socket_timeout=2, retry=no_retry)
    with pytest.raises(redis.ConnectionError):
        plain.ping()
    plain.close()
    unverified = redis.Redis(
        host=server.host, port=server.port, ssl=True, ssl_cert_reqs="required", retry=no_retry
    )
    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        unverified.ping()
    unverified.close()
    for client in (redis.Redis.from_url(server.url), server.client()):
        assert client.ping()
        client.close()


def test_mutual_tls_demands_a_client_certificate(redislock_tls_server: TLSServer) -> None:
    """With mutual=True the server refuses a client that verifies it but presents no
    certificate, and accepts the one its URL names; restart() keeps the certificates."""
    with TLSServer(binary=redislock_tls_server.binary, mutual=True) as server:
        assert server.tls is not None
        assert server.tls.auth_clients
        assert "ssl_certfile=" in server.url
        anonymous = redis.Redis(
            host=server.host,
            port=server.port,
            ssl=True,
            ssl_cert_reqs="required",
            ssl_ca_certs=server.ca_path,
            socket_timeout=2,
            retry=Retry(NoBackoff(), 0),
        )
        with pytest.raises((redis.ConnectionError, ssl.SSLError)):
            anonymous.ping()
        anonymous.close()
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        ca_path = server.ca_path
        server.restart()
        assert server.ca_path == ca_path
        assert client.ping()
        client.close()
        certificates = os.path.dirname(ca_path)
    assert not os.path.exists(certificates)


# ACL.


def test_acl_user_gets_noperm_outside_its_patterns(
    redislock_acl_server_factory: Callable[..., AclUser],
) -> None:
    """An ACL user limited to ~app:* and &app:* reads and writes its keys, and gets
    NOPERM for other keys and channels; its URL carries its credentials."""
    user = redislock_acl_server_factory(
        ("~app:*", "&app:*", "+@all"), username="app-user", password="p@ss:w/rd %"
    )
    client = redis.Redis.from_url(user.url)
    assert client.acl_whoami() == "app-user"
    client.set("app:1", "x")
    assert client.get("app:1") == b"x"
    with pytest.raises(redis.exceptions.NoPermissionError, match=r"(?i)key"):
        client.set("other:1", "x")
    with pytest.raises(redis.exceptions.NoPermissionError, match=r"(?i)channel"):
        client.publish("other:channel", "x")
    assert client.publish("app:channel", "x") == 0
    client.close()
    second = create_acl_user(user.server, "reader", "pw", ("~app:*", "+get"))
    reader = second.client()
    assert reader.get("app:1") == b"x"
    with pytest.raises(redis.exceptions.NoPermissionError, match="set"):
        reader.set("app:1", "y")
    reader.close()


def test_tls_restart_keeps_the_certificates_when_an_attempt_fails(
    redislock_tls_server: TLSServer,
) -> None:
    """restart() keeps the CA and certificates even when its first attempts fail (the
    port is still held by another socket): a client made before still connects."""
    with TLSServer(binary=redislock_tls_server.binary) as server:
        client = server.client(socket_timeout=5)
        assert client.ping()
        ca_path = server.ca_path
        log = os.path.join(os.path.dirname(ca_path), "server.log")
        # The client closes its connection first, so the server's side of it leaves
        # nothing behind on the port that would stop the holder below from binding.
        client.connection_pool.disconnect()
        server.kill()
        # Bound without SO_REUSEADDR and not listening: the server cannot bind the
        # port, and the start's TLS probe is refused instead of meeting a listener
        # that then goes away in the middle of its handshake.
        holder = socket.socket()
        holder.bind((server.host, server.port))
        refused = threading.Event()

        def release_when_refused() -> None:
            """Free the port once the log shows a start that could not bind it."""
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with open(log, errors="replace") as lines:
                    if "in use" in lines.read():
                        refused.set()
                        break
                time.sleep(0.02)
            holder.close()

        releaser = threading.Thread(target=release_when_refused)
        releaser.start()
        try:
            server.restart(timeout=30)
        finally:
            releaser.join()
        assert refused.is_set(), "no start attempt met the held port"
        assert server.ca_path == ca_path
        assert os.path.exists(ca_path)
        assert client.ping()
        client.close()


def test_tls_failed_first_start_removes_its_certificates(
    redislock_tls_server: TLSServer,
) -> None:
    """A first start that fails (its port is taken) leaves no certificates behind."""
    server = TLSServer(binary=redislock_tls_server.binary, port=redislock_tls_server.port)
    with pytest.raises(RuntimeError, match="did not start"):
        server.start()
    assert server.process is None
    with pytest.raises(RuntimeError, match="no certificates"):
        _ = server.ca_path
