"""Tests for the package's public namespace."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import celery_redislock

ROOT = Path(__file__).resolve().parent.parent


def documented_names() -> set[str]:
    """The names the package docstring lists under "Public names"."""
    doc = celery_redislock.__doc__ or ""
    section = doc.split("Public names", 1)[1].split("\n\n", 2)[1]
    return set(re.findall(r"``(\w+)``", section))


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


def test_exported_names_are_the_documented_ones() -> None:
    """``__all__`` is exactly the list in the package docstring: nothing more, nothing less."""
    assert set(celery_redislock.__all__) == documented_names()


def test_test_helpers_are_not_on_the_package_face() -> None:
    """The server helper lives in celery_redislock.server only, not at the root."""
    assert "RedisServer" not in celery_redislock.__all__
    assert not hasattr(celery_redislock, "RedisServer")
    from celery_redislock.server import RedisServer

    assert RedisServer.__module__ == "celery_redislock.server"


def test_no_pytest_plugin_is_registered_by_installing(tmp_path: Path) -> None:
    """Neither the project nor the installed distribution declares a ``pytest11`` entry
    point: the pytest kit loads only where a project asks for it."""
    assert "pytest11" not in (ROOT / "pyproject.toml").read_text()
    code = (
        "from importlib.metadata import entry_points; "
        "print([e.value for e in entry_points(group='pytest11')])"
    )
    # From a directory of its own, so only what is installed is seen.
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert "celery_redislock" not in out.stdout


def test_importing_the_package_loads_no_pytest() -> None:
    """``import celery_redislock`` pulls in neither pytest nor the test kit."""
    code = (
        "import sys, celery_redislock; "
        "print(sorted(m for m in sys.modules if m == 'pytest' or m.endswith('.testing') "
        "and m.startswith('celery_redislock')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"


def test_version_matches_metadata() -> None:
    """``__version__`` is the installed distribution's version."""
    assert celery_redislock.__version__ == version("celery_redislock")
