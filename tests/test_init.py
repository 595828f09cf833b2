"""Tests for the package's public namespace."""

from __future__ import annotations

from importlib.metadata import version

import celery_redislock

#: The lock engine's names, which the package root must always export.
CORE_NAMES = {
    "RedisLock",
    "LockError",
    "LockNotOwnedError",
    "LockLostError",
    "LockTimeoutError",
    "RedisServer",
}


def test_every_exported_name_exists() -> None:
    """Every name in ``__all__`` is an attribute of the package (``import *`` works)."""
    namespace: dict[str, object] = {}
    exec("from celery_redislock import *", namespace)
    for name in celery_redislock.__all__:
        assert hasattr(celery_redislock, name), name
        assert name in namespace, name


def test_all_has_no_duplicates() -> None:
    """``__all__`` lists each name once."""
    assert len(celery_redislock.__all__) == len(set(celery_redislock.__all__))


def test_core_engine_names_are_exported() -> None:
    """The lock engine, its errors and the server helper are importable from the root."""
    assert set(celery_redislock.__all__) >= CORE_NAMES


def test_version_matches_metadata() -> None:
    """``__version__`` is the installed distribution's version."""
    assert celery_redislock.__version__ == version("celery_redislock")
