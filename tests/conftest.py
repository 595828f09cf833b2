"""Shared test configuration: the kit's fixtures and the ``--skip-slow`` flag."""

from __future__ import annotations

import gc
import logging

import pytest

# The same opt-in plugin users enable: private servers, deployments, helpers.
pytest_plugins = ["celery_redislock.testing"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--skip-slow",
        action="store_true",
        default=False,
        help="skip fault/stress tests marked slow (CI runs them)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--skip-slow"):
        return
    skip = pytest.mark.skip(reason="slow test skipped by --skip-slow")
    for item in items:
        if "slow" in item.keywords:
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
