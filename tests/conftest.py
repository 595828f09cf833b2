"""Shared test configuration: the kit's fixtures and the ``--skip-slow`` flag."""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from celery.result import AsyncResult

from celery_redislock.deployments import ClusterDeployment
from celery_redislock.server import SERVER_ENV
from tests.support import CELERY_5_7, is_redis_6_2, node_command, redis_6_2_binary

# The same opt-in plugin users enable: private servers, deployments, helpers.
pytest_plugins = ["celery_redislock.testing"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-slow",
        action="store_true",
        default=False,
        help="skip fault/stress tests marked slow (CI runs them)",
    )


#: ``TMPDIR`` as the session found it, while :func:`pytest_configure` replaces it.
_TMPDIR_KEY = pytest.StashKey[tuple[str | None, str]]()


def pytest_configure(config: pytest.Config) -> None:
    """Give the processes the tests start a temporary directory of the session's.

    Many tests SIGKILL what they started (workers, their pool processes, the
    processes that own a server), and a killed process cannot remove its
    temporary directories (multiprocessing's ``pymp-*``, a server's working
    directory): they are left in the session's directory, removed with it as the
    session ends. This process keeps the temporary directory it had (read first,
    so that ``tempfile`` keeps it), and so do pytest's ``tmp_path`` directories.
    """
    tempfile.gettempdir()
    mine = tempfile.mkdtemp(prefix="redislock-tests-")
    config.stash[_TMPDIR_KEY] = (os.environ.get("TMPDIR"), mine)
    os.environ["TMPDIR"] = mine
    if not CELERY_5_7:
        _leave_collected_results_subscribed()


def _leave_collected_results_subscribed() -> None:
    """Before Celery 5.7, a result the garbage collector finalizes unsubscribes on
    the pub/sub connection of the thread that made it, from whichever thread collects
    it: an in-process worker's thread then writes on a test's connection while the
    test reads it for a result (Celery 5.7 serialises the two), and that result can
    be lost, its ``get()`` timing out. The tests leave such results subscribed."""
    AsyncResult.__del__ = lambda self: None


def pytest_unconfigure(config: pytest.Config) -> None:
    if _TMPDIR_KEY not in config.stash:
        return
    before, mine = config.stash[_TMPDIR_KEY]
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    shutil.rmtree(mine, ignore_errors=True)


#: What the fixtures of a test that starts a Redis Cluster or Sentinels are named.
_DEPLOYMENT_FIXTURE = re.compile("cluster|sentinel")

#: The modules that take longest (minutes each on two cores), longest first: they
#: run first, so that the shorter modules fill the other workers' time meanwhile
#: and the workers end together (``--no-loadscope-reorder`` in ``pyproject.toml``
#: keeps this order; pytest-xdist would otherwise start the modules with most
#: tests first, and so the Redis 6.2 session, a single test, last, while the
#: other workers idled).
LONGEST_FIRST = (
    "test_oldest_versions.py",
    "test_oldest_redis.py",
    "test_workers.py",
    "test_deployments_engine.py",
)


def _longest_first(item: pytest.Item) -> int:
    """Where ``item``'s module comes in :data:`LONGEST_FIRST` (the others after)."""
    name = item.path.name
    return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Stable: each module's tests keep their order.
    items.sort(key=_longest_first)
    if config.getoption("--skip-slow"):
        skip = pytest.mark.skip(reason="slow test skipped by --skip-slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    binary = os.environ.get(SERVER_ENV)
    if binary and is_redis_6_2(binary):
        # A session whose servers are Redis 6.2 (tests/test_oldest_redis.py).
        skip = pytest.mark.skip(reason="the cluster and Sentinel deployments here need Redis 7")
        for item in items:
            if any(_DEPLOYMENT_FIXTURE.search(name) for name in getattr(item, "fixturenames", ())):
                item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Leave what collection built out of every later garbage collection.

    The tests collect garbage often (``close_app``, ``quiet_sockets``, each
    in-process worker's stop) to finalize what a test left behind: sockets,
    unsubscribing results, dropped lock objects. A full collection walks every
    tracked object, and most of them are the imported modules and the collected
    tests, which live until the session ends: frozen, they are not walked again,
    and each collection costs a fraction of the time. Objects the tests create
    afterwards are collected as before.
    """
    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def redis_6_2(tmp_path_factory: pytest.TempPathFactory) -> str | None:
    """A Redis 6.2 server binary (see :func:`tests.support.redis_6_2_binary`), or
    ``None`` where none can be had; fetched once a session, as a test first asks."""
    return redis_6_2_binary(tmp_path_factory.mktemp("redis-6.2"))


@pytest.fixture(scope="session")
def _root_log_level() -> int:
    """The root logger's level when the session's first test started."""
    return logging.getLogger().level


@pytest.fixture(autouse=True)
def _root_log_level_restored(_root_log_level: int) -> None:
    """Give each test the session's root logger level.

    An in-process Celery worker sets it for itself (ERROR by default) and leaves it
    so; a WARNING logged before a test's ``caplog.at_level`` block would then be
    dropped, and log assertions would depend on which tests ran before.
    """
    logging.getLogger().setLevel(_root_log_level)


#: A slot a node is moving out (``[slot->-id]``) or in (``[slot-<-id]``), in its own
#: line of ``CLUSTER NODES``.
_MOVING_SLOT = re.compile(r"\[(\d+)-[<>]-")


@pytest.fixture(scope="session")
def _resharding_clusters() -> Iterator[list[ClusterDeployment]]:
    """The cluster :func:`resharding_cluster` hands out (none until a test asks)."""
    clusters: list[ClusterDeployment] = []
    yield clusters
    for cluster in clusters:
        cluster.stop()


@pytest.fixture
def resharding_cluster(
    _resharding_clusters: list[ClusterDeployment],
) -> Iterator[ClusterDeployment]:
    """Three primaries (no replicas), shared by the tests that move slots between
    them: a cluster takes more than two seconds to start (a new primary waits two
    seconds before it serves), a slot move only milliseconds.

    Each test finds every slot settled on some primary and no key anywhere;
    which primary serves which slots is whatever the moves before it left, so a
    test picks its source and target from the cluster as it finds it. After
    each test, a move it left under way is called off and every key deleted; a
    cluster that does not settle again is replaced by a new one.
    """
    if not _resharding_clusters:
        _resharding_clusters.append(ClusterDeployment(masters=3).start())
    cluster = _resharding_clusters[0]
    yield cluster
    try:
        _reset_cluster(cluster)
    except Exception:
        _resharding_clusters.remove(cluster)
        cluster.stop()


def _reset_cluster(cluster: ClusterDeployment) -> None:
    """Call off every slot move under way, delete every key, and wait until the
    cluster's nodes agree again."""
    for node in cluster.primaries():
        nodes = node_command(node, "CLUSTER", "NODES")
        text = nodes.decode() if isinstance(nodes, bytes) else str(nodes)
        (own,) = [line for line in text.splitlines() if "myself" in line.split()[2]]
        for slot in _MOVING_SLOT.findall(own):
            node_command(node, "CLUSTER", "SETSLOT", int(slot), "STABLE")
    for node in cluster.primaries():
        node_command(node, "FLUSHALL")
    cluster.wait_until_ok(10.0)
