"""The worker soak (:mod:`tests.soak`) with a lock store of a Redis deployment:
a Sentinel-managed primary with a replica, failed over by the Sentinels on
command, killed, or frozen until they fail it over; and a Redis Cluster whose
primaries are killed, or frozen until their replicas take their slots over.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import cast

import pytest
import redis

from celery_redislock.deployments import ClusterDeployment, SentinelDeployment
from celery_redislock.server import RedisServer
from tests.soak import (
    CLUSTER_FAULTS,
    FAILOVER_TIMEOUT_MS,
    SENTINEL_FAULTS,
    Loss,
    fault_cluster,
    fault_sentinel,
    soak,
)

pytestmark = [
    pytest.mark.slow,
    # The pool processes are found in /proc.
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]


def test_real_workers_through_sentinel_failovers_never_run_one_lock_twice_at_once(
    redislock_server_factory: Callable[..., RedisServer],
    redislock_sentinel_factory: Callable[..., SentinelDeployment],
    tmp_path: Path,
) -> None:
    """Through failovers of a Sentinel-managed lock store (on command, of a killed
    primary, of a frozen one), among the workers' faults, no lock runs two bodies
    at once unless the older was told it lost the lock (or a failover may have
    lost it, and the newer's token is higher), every message is taken, and
    nothing is left held."""
    broker = redislock_server_factory()
    deployment = redislock_sentinel_factory(
        replicas=1, sentinels=3, failover_timeout_ms=FAILOVER_TIMEOUT_MS
    )

    def fault_store(rng: random.Random, fault: str, losses: list[Loss]) -> str:
        return fault_sentinel(deployment, fault, losses)

    lock_env = {
        "REDISLOCK_SOAK_LOCK": deployment.sentinel_url,
        "REDISLOCK_SOAK_LOCK_MASTER": deployment.master_name,
    }
    lock_store = deployment.client(socket_timeout=5)
    soak(
        tmp_path,
        broker,
        lock_env,
        deployment.sentinel_url,
        lock_store,
        SENTINEL_FAULTS,
        fault_store,
    )


def test_real_workers_through_cluster_failovers_never_run_one_lock_twice_at_once(
    redislock_server_factory: Callable[..., RedisServer],
    redislock_cluster_factory: Callable[..., ClusterDeployment],
    tmp_path: Path,
) -> None:
    """Through failovers of primaries of a Redis Cluster lock store (killed, or
    frozen until their replica takes over), among the workers' faults, no lock
    runs two bodies at once unless the older was told it lost the lock (or a
    failover may have lost it, and the newer's token is higher), every message is
    taken, and nothing is left held."""
    broker = redislock_server_factory()
    cluster = redislock_cluster_factory(3, 1)

    def fault_store(rng: random.Random, fault: str, losses: list[Loss]) -> str:
        return fault_cluster(rng, cluster, fault, losses)

    lock_env = {
        "REDISLOCK_SOAK_LOCK_CLUSTER": ",".join(f"{n.host}:{n.port}" for n in cluster.nodes)
    }
    # (What the soak asks of it, scan_iter(), get() and pttl(), a cluster client
    # answers as a client of one server does.)
    lock_store = cast(redis.Redis, cluster.client(socket_timeout=5))
    soak(tmp_path, broker, lock_env, cluster.startup_url, lock_store, CLUSTER_FAULTS, fault_store)
