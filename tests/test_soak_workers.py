"""The worker soak (:mod:`tests.soak`) with a single lock store behind a fault
proxy: the workers' connections reset, cut, slowed and made to lose replies, the
store frozen, restarted (with its data), killed and started again (with its
data, as after a crash), or wiped (killed and started again without its data).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_redislock.server import RedisServer
from tests.proxy import FaultProxy
from tests.soak import SERVER_FAULTS, Loss, Store, fault_server, soak

pytestmark = [
    pytest.mark.slow,
    # The pool processes are found in /proc.
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only"),
]


@pytest.fixture
def soak_servers(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> Iterator[tuple[RedisServer, Store]]:
    """The broker's server (also the logs'), and the lock store (which keeps its data
    across a restart or a crash: every write is in its append-only file before it
    answers) with a proxy before it."""
    data = tmp_path / "store"
    data.mkdir()
    persistent = ("--appendonly", "yes", "--appendfsync", "always", "--dir", str(data))
    broker, server = redislock_server_factory(), redislock_server_factory(extra_args=persistent)
    with FaultProxy(server.host, server.port) as proxy:
        yield broker, Store(server, data, proxy)


def test_real_workers_under_injected_faults_never_run_one_lock_twice_at_once(
    soak_servers: tuple[RedisServer, Store], tmp_path: Path
) -> None:
    """Under kills, freezes, resets, cuts, lost replies, a frozen, restarted, crashed or
    wiped store, no lock runs two bodies at once unless the older was told it lost
    the lock (or the store lost its data, and the newer's token is higher), every
    message is taken, and nothing is left held."""
    broker, store = soak_servers

    def fault_store(rng: random.Random, fault: str, losses: list[Loss]) -> str:
        return fault_server(rng, store, fault, losses)

    # The test sends (and an until_executed send reserves) on the store directly;
    # the workers reach it through the proxy.
    lock_env = {"REDISLOCK_SOAK_LOCK": store.server.url}
    soak(
        tmp_path,
        broker,
        lock_env,
        store.proxy.url,
        store.server.client(),
        SERVER_FAULTS,
        fault_store,
    )
