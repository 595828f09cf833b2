"""Shared test configuration: the kit's fixtures and the ``--skip-slow`` flag."""

from __future__ import annotations

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
