"""The distribution as users get it: what the wheel holds, and a user's project that
type-checks against the installed package."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: A user's task module: a bound SingletonTask reading its lock, and the engine.
#: The ``type: ignore`` is needed only if ``fence`` is typed ``int`` (strict mode
#: reports an unused one): it proves the types reach the user's code, not ``Any``.
USER_TASKS = """
from celery import Celery

from celery_redislock import LockHandle, RedisLock, SingletonTask

app = Celery("shop")


@app.task(base=SingletonTask, bind=True, lock_on=("event_id",))
def purchase(self: SingletonTask, event_id: int, user_id: int) -> int:
    self.lock.check()
    handle: LockHandle = self.lock
    handle.fence + "x"  # type: ignore[operator]
    if self.lock.lost:
        return -1
    return self.lock.fence + event_id


def invoice(url: str) -> int | None:
    with RedisLock(url, "invoice:42", ttl=30) as lock:
        return lock.token
"""


def page_mypy_config() -> str:
    """The mypy configuration the Install section of the Getting started page
    (docs/getting-started.md) gives users."""
    page = (ROOT / "docs" / "getting-started.md").read_text()
    section = page.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    (config,) = re.findall(r"```toml[^\n]*\n(.*?)```", section, flags=re.DOTALL)
    return str(config)


def test_user_project_type_checks_strictly(tmp_path: Path) -> None:
    """mypy --strict, with the Getting started page's configuration, accepts a user's
    project that uses SingletonTask, self.lock (a LockHandle, its fence an int) and
    RedisLock."""
    (tmp_path / "pyproject.toml").write_text(page_mypy_config())
    package = tmp_path / "shop"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "tasks.py").write_text(USER_TASKS)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "shop"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout


def test_wheel_holds_only_the_package(tmp_path: Path) -> None:
    """The built wheel contains celery_redislock/ (typed: py.typed) and its dist-info,
    nothing else, and declares the celery plug-in but no pytest plug-in."""
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "src",
        source / "src",
        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc"),
    )
    build = (
        "from setuptools import build_meta; "
        "print(build_meta.build_wheel(r'" + str(tmp_path / "dist") + "'))"
    )
    result = subprocess.run(
        [sys.executable, "-c", build],
        cwd=source,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    wheel = tmp_path / "dist" / result.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        declared = archive.read(entry_points).decode()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [
            line for line in archive.read(metadata).decode().splitlines()
            if line.startswith("Requires-Dist:")
        ]  # fmt: skip
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"celery_redislock", "celery_redislock-0.1.0.dist-info"}, sorted(names)
    assert "celery_redislock/py.typed" in names
    assert "celery_redislock/testing.py" in names
    assert "[celery.commands]" in declared
    assert "pytest11" not in declared
    # Celery's Redis transport needs more than redis-py: its [redis] extra.
    assert any(re.match(r"Requires-Dist: celery\[redis\]", line) for line in requires), requires
    # What kombu 5.7's [redis] extra takes.
    assert "Requires-Dist: redis>=6.4" in requires, requires
