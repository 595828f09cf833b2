"""Pytest fixtures that give every test a real Redis-compatible server.

Registered through the ``pytest11`` entry point, so installing the package is
enough: ``pytest`` needs no Redis running beforehand.

Fixtures:
    redislock_server          one server for the whole session
    redislock_url             its ``redis://`` URL
    redislock_client          a client to it, with the database flushed before the test
    redislock_server_factory  starts extra independent servers, stopped after the test

Deployments (from :mod:`celery_redislock.deployments`; each starts only when a
test asks for it):
    redislock_cluster              a 3-primary Redis Cluster for the session
                                   (``.client()`` is a ``RedisCluster``)
    redislock_cluster_factory      ``factory(masters=3, replicas_per_master=0)``: clusters
                                   of the test's own (to kill nodes in), stopped after it
    redislock_sentinel             a primary, one replica and three Sentinels for the
                                   session (``.sentinel_url``, ``.transport_options``,
                                   ``.client()``); do not kill its primary: use the factory
    redislock_sentinel_factory     ``factory(replicas=1, sentinels=3)``: Sentinel deployments
                                   of the test's own (``.kill_master()``,
                                   ``.wait_for_failover()``), stopped after it
    redislock_tls_server           a TLS-only server for the session (``.url`` is
                                   ``rediss://…?ssl_cert_reqs=required&ssl_ca_certs=…``,
                                   ``.ca_path``); needs ``cryptography``; skipped
                                   when the server binary has no TLS
    redislock_acl_server_factory   ``factory(rules, username="locker", password=…)``: a new
                                   server with that ACL user; returns an ``AclUser``
                                   (``.url``, ``.client()``, ``.server``)

Session deployments are shared: a test must leave no keys behind (or clean up
what it wrote) and must not stop or kill their processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import redis

from celery_redislock.deployments import (
    AclUser,
    ClusterDeployment,
    SentinelDeployment,
    TLSServer,
    create_acl_user,
    tls_available,
)
from celery_redislock.server import RedisServer


@pytest.fixture(scope="session")
def redislock_server() -> Iterator[RedisServer]:
    """A private server on a free 127.0.0.1 port, shared by the session."""
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redislock_url(redislock_server: RedisServer) -> str:
    """The session server's URL."""
    return redislock_server.url


@pytest.fixture
def redislock_client(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the session server; the database is emptied first."""
    client = redislock_server.client()
    client.flushall()
    yield client
    client.close()


@pytest.fixture
def redislock_server_factory() -> Iterator[Callable[..., RedisServer]]:
    """Start more servers (``factory(binary=None, extra_args=())``); all stop afterwards."""
    started: list[RedisServer] = []

    def factory(binary: str | None = None, extra_args: tuple[str, ...] = ()) -> RedisServer:
        server = RedisServer(binary=binary, extra_args=extra_args).start()
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def redislock_cluster() -> Iterator[ClusterDeployment]:
    """A Redis Cluster of three primaries (no replicas), shared by the session."""
    with ClusterDeployment(masters=3) as cluster:
        yield cluster


@pytest.fixture
def redislock_cluster_factory() -> Iterator[Callable[..., ClusterDeployment]]:
    """Start clusters of the test's own (``factory(masters=3, replicas_per_master=0,
    **kwargs)``, as :class:`ClusterDeployment` takes them); all stop afterwards."""
    started: list[ClusterDeployment] = []

    def factory(masters: int = 3, replicas_per_master: int = 0, **kwargs: Any) -> ClusterDeployment:
        cluster = ClusterDeployment(masters, replicas_per_master, **kwargs)
        started.append(cluster)
        return cluster.start()

    yield factory
    for cluster in started:
        cluster.stop()


@pytest.fixture(scope="session")
def redislock_sentinel() -> Iterator[SentinelDeployment]:
    """A primary with one replica watched by three Sentinels, shared by the session."""
    with SentinelDeployment(replicas=1, sentinels=3) as deployment:
        yield deployment


@pytest.fixture
def redislock_sentinel_factory() -> Iterator[Callable[..., SentinelDeployment]]:
    """Start Sentinel deployments of the test's own (``factory(replicas=1, sentinels=3,
    **kwargs)``, as :class:`SentinelDeployment` takes them); all stop afterwards."""
    started: list[SentinelDeployment] = []

    def factory(replicas: int = 1, sentinels: int = 3, **kwargs: Any) -> SentinelDeployment:
        deployment = SentinelDeployment(replicas=replicas, sentinels=sentinels, **kwargs)
        started.append(deployment)
        return deployment.start()

    yield factory
    for deployment in started:
        deployment.stop()


@pytest.fixture(scope="session")
def redislock_tls_server() -> Iterator[TLSServer]:
    """A server that accepts only TLS, with a throw-away CA, shared by the session.

    Tests that use it are skipped when the server binary was built without TLS.
    """
    if not tls_available():
        pytest.skip("the Redis server binary was built without TLS support")
    with TLSServer() as server:
        yield server


@pytest.fixture
def redislock_acl_server_factory() -> Iterator[Callable[..., AclUser]]:
    """Start a server with one ACL user: ``factory(rules, username="locker",
    password="locker-password")`` returns the :class:`AclUser`; servers stop afterwards."""
    started: list[RedisServer] = []

    def factory(
        rules: Sequence[str],
        username: str = "locker",
        password: str = "locker-password",
        binary: str | None = None,
    ) -> AclUser:
        server = RedisServer(binary=binary)
        started.append(server)
        return create_acl_user(server.start(), username, password, rules)

    yield factory
    for server in started:
        server.stop()
