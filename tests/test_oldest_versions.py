"""The oldest releases of Celery, kombu and redis-py the package declares it works
with (the ``>=`` floors of its dependencies) pass the tests of the parts that lean
on their internals: the worker's request class, the task's start and end, the
pools, the connection layer, a Redis Cluster's slot map and the Sentinels'
failovers. The oldest Python it declares, and the newest installed, pass the
tests of lock names, of the engine and of a solo worker. The rest of the suite
runs on the newest releases of the dependencies, on the Python that runs it."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from packaging.version import Version

from tests.support import CHILD_PYTEST_OPTIONS, child_environment
from tests.test_example import run_seckill

ROOT = Path(__file__).resolve().parent.parent

#: The dependencies whose oldest release is tested here.
FLOORED = ("celery", "kombu", "redis")

#: Tests of the code that uses Celery's and redis-py's internals (the request
#: class, the pools, revokes, retries and redeliveries, the connection layer), run
#: on the floors (with ``INTEGRATION_SELECTION``: of the deployments, the cluster's
#: and the Sentinels').
INTEGRATION_TESTS = (
    "tests/test_early.py",
    "tests/test_early_crowded.py",
    "tests/test_task_solo.py",
    "tests/test_workers.py",
    "tests/test_transport.py",
    "tests/test_client.py",
    "tests/test_deployments_engine.py",
    "tests/test_revoke.py",
    "tests/test_redelivery.py",
    "tests/test_sent_names.py",
)
INTEGRATION_SELECTION = "not test_deployments_engine or cluster or sentinel"

#: Slow worker tests (prefork workers in subprocesses) of what Celery 5.6 does
#: otherwise than 5.7, run on the floors too: a message killed for its hard time
#: limit is delivered again (``acks_on_failure_or_timeout`` off: 5.6 has no
#: ``acks_on_timeout``), and a task revoked by its id as it ran is stored as revoked
#: until its success is stored over that.
FLOOR_WORKER_TESTS = (
    "tests/test_workers.py::test_a_message_requeued_as_it_is_killed_for_its_time_limit_keeps_its_reservation",
    "tests/test_workers.py::test_a_revoke_that_finds_an_until_executed_task_running_leaves_word_that_expires",
)


#: Tests run on the oldest Python the package declares and on the newest installed:
#: the derivation of lock names (what a value formats as changes between Python
#: releases), the lock engine, and a task end to end in a solo worker.
OTHER_PYTHON_TESTS = ("tests/test_keys.py", "tests/test_lock.py", "tests/test_task_solo.py")

#: What those tests need besides the package's own dependencies (pytest-xdist: the
#: project's pytest options name it).
TEST_TOOLS = ("pytest>=8", "pytest-xdist>=3.8", "hypothesis>=6")


def requirements() -> list[str]:
    """The runtime dependencies pyproject.toml declares, as written there."""
    text = (ROOT / "pyproject.toml").read_text()
    block = text.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    return re.findall(r'^\s*"([^"]+)"', block, flags=re.MULTILINE)


def oldest_python() -> tuple[str, str | None]:
    """The oldest Python release the package declares (``requires-python``), and
    an interpreter of it installed here (on ``PATH``, or among pyenv's versions),
    if there is one."""
    text = (ROOT / "pyproject.toml").read_text()
    match = re.search(r'^requires-python = ">=(\d+\.\d+)"$', text, flags=re.MULTILINE)
    assert match is not None, "requires-python names no oldest release"
    return match[1], python_of(match[1])


def newest_python() -> tuple[str, str | None]:
    """The newest Python release installed here (on ``PATH``, or among pyenv's
    versions) that is newer than the one running the tests, and an interpreter of
    it; the running release and ``None`` where there is none."""
    this = sys.version_info[:2]
    candidates = {(3, minor) for minor in range(this[1] + 1, this[1] + 10)}
    candidates |= {
        (3, int(match[1]))
        for version in (pyenv_root() / "versions").glob("3.*")
        if (match := re.fullmatch(r"3\.(\d+)\.\d+", version.name))
    }
    for release in sorted(candidates, reverse=True):
        if release > this and (python := python_of(f"{release[0]}.{release[1]}")):
            return f"{release[0]}.{release[1]}", python
    return f"{this[0]}.{this[1]}", None


def pyenv_root() -> Path:
    """Where pyenv keeps its Python versions, if it is here."""
    return Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))


def python_of(release: str) -> str | None:
    """An interpreter of ``release`` (``3.10``) that runs here: on ``PATH`` or among
    pyenv's versions."""
    found = [shutil.which(f"python{release}")]
    found += sorted(str(p) for p in pyenv_root().glob(f"versions/{release}.*/bin/python{release}"))
    for python in found:
        # (A pyenv shim of a release pyenv does not have installed fails to run.)
        if (
            python
            and subprocess.run([python, "-c", ""], capture_output=True, timeout=60).returncode == 0
        ):
            return python
    return None


def floors() -> dict[str, str]:
    """``{distribution: oldest version}`` as pyproject.toml declares them."""
    found: dict[str, str] = {}
    for requirement in requirements():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([0-9][0-9.]*)", requirement)
        if match and match[1] in FLOORED:
            found[match[1]] = match[2]
    return found


def this_environments_packages() -> list[str]:
    """The directories this environment's packages are installed in: a virtual
    environment's own (which ``venv --system-site-packages`` would not give a new
    one: it gives the base interpreter's), those it sees of its base interpreter,
    the user's."""
    return [
        entry
        for entry in sys.path
        if Path(entry).name in ("site-packages", "dist-packages") and Path(entry).is_dir()
    ]


def see_packages(python: str, directories: list[str]) -> None:
    """Have the virtual environment of ``python`` import from ``directories``
    too, after its own site-packages (a ``.pth`` file there)."""
    own = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout.strip()  # fmt: skip
    Path(own, "_tested_environment.pth").write_text("".join(f"{d}\n" for d in directories))


def test_every_runtime_dependency_has_a_floor() -> None:
    """Each runtime dependency names the oldest release it admits, which the test
    below installs: none is left open."""
    assert sorted(floors()) == sorted(FLOORED)


#: The virtual environments the slow tests below run in, by test: the oldest
#: releases of the dependencies, and the oldest and the newest Python here.
FLOORS, OLDEST_PYTHON, NEWEST_PYTHON = "floors", "oldest-python", "newest-python"
ENVIRONMENT_OF = {
    "test_the_oldest_supported_releases_pass_the_integration_tests": FLOORS,
    "test_the_seckill_demo_runs_on_the_oldest_supported_releases": FLOORS,
    "test_the_oldest_supported_releases_pass_the_worker_tests_of_their_own_ways": FLOORS,
    "test_the_oldest_supported_python_passes_the_key_engine_and_worker_tests": OLDEST_PYTHON,
    "test_the_newest_python_here_passes_the_key_engine_and_worker_tests": NEWEST_PYTHON,
}


@pytest.fixture(scope="module")
def environments(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Future[str]]]:
    """The virtual environments of the tests of :data:`ENVIRONMENT_OF` this session
    runs (those not skipped), by name, each the future of its interpreter. All are
    built side by side as the first of those tests starts (an install is one pip
    process, mostly on one CPU): one after the other, they made this module take
    about 30 s longer (150 s against 120 on two CPUs)."""
    wanted = {
        ENVIRONMENT_OF[item.originalname]
        for item in request.session.items
        if isinstance(item, pytest.Function)
        and item.originalname in ENVIRONMENT_OF
        and item.get_closest_marker("skip") is None
    }
    builds: dict[str, Callable[[Path], str]] = {FLOORS: make_floors_environment}
    for name, (_, python) in ((OLDEST_PYTHON, oldest_python()), (NEWEST_PYTHON, newest_python())):
        if python is not None:
            builds[name] = functools.partial(make_environment, python)
    root = tmp_path_factory.mktemp("environments")
    with ThreadPoolExecutor(max_workers=len(builds)) as pool:
        yield {
            name: pool.submit(build, root / name)
            for name, build in builds.items()
            if name in wanted
        }


def make_floors_environment(venv: Path) -> str:
    """Make a virtual environment at ``venv`` with the oldest releases of Celery,
    kombu and redis-py the package admits, which sees this environment's packages
    for the rest; return its interpreter."""
    # No pip of its own (installing one is most of a new environment's set-up): the
    # environment sees this one's packages, pip among them, which installs the pins
    # into the new environment's site-packages, ahead of this one's.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = str(venv / "bin" / "python")
    see_packages(python, this_environments_packages())
    pins = [f"{name}=={version}" for name, version in sorted(floors().items())]
    installed = subprocess.run(
        [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *pins],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return python


def make_environment(python: str, venv: Path) -> str:
    """Make a virtual environment of ``python`` at ``venv`` with the newest
    dependencies that install there, and the test tools; return its interpreter."""
    subprocess.run([python, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    interpreter = str(venv / "bin" / "python")
    # This environment's pip installs into the new one (pip 22.3 and later).
    installed = subprocess.run(
        [sys.executable, "-m", "pip", "--python", interpreter, "install", "-q",
         "--disable-pip-version-check", *requirements(), *TEST_TOOLS],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stdout + installed.stderr
    return interpreter


@pytest.mark.slow
def test_the_oldest_supported_releases_pass_the_integration_tests(
    environments: dict[str, Future[str]],
) -> None:
    """A virtual environment with the oldest releases of Celery, kombu and redis-py
    the package admits (the rest taken from this environment) runs the tests of the
    worker integration and of the connection layer, and passes them."""
    python = environments[FLOORS].result()
    env = child_environment()
    versions = subprocess.run(
        [python, "-c", "import celery, kombu, redis; print(celery.__version__, "
         "kombu.__version__, redis.__version__)"],
        capture_output=True, text=True, env=env, timeout=60, check=True,
    )  # fmt: skip
    assert [Version(v) for v in versions.stdout.split()] == [
        Version(floors()[name]) for name in FLOORED
    ]
    result = subprocess.run(
        [
            python,
            "-m",
            "pytest",
            *INTEGRATION_TESTS,
            "-k",
            INTEGRATION_SELECTION,
            *CHILD_PYTEST_OPTIONS,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@pytest.mark.slow
def test_the_oldest_supported_releases_pass_the_worker_tests_of_their_own_ways(
    environments: dict[str, Future[str]],
) -> None:
    """The same environment runs :data:`FLOOR_WORKER_TESTS`, slow as they are, and
    passes them."""
    python = environments[FLOORS].result()
    options = [option for option in CHILD_PYTEST_OPTIONS if option != "--skip-slow"]
    result = subprocess.run(
        [python, "-m", "pytest", *FLOOR_WORKER_TESTS, *options],
        cwd=ROOT, capture_output=True, text=True, env=child_environment(), timeout=600,
        check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert f"{len(FLOOR_WORKER_TESTS)} passed" in result.stdout


@pytest.mark.slow
def test_the_seckill_demo_runs_on_the_oldest_supported_releases(
    environments: dict[str, Future[str]], tmp_path: Path
) -> None:
    """The README's main command, ``python -m example_worker`` (an embedded Redis and
    four workers), sells exactly its tickets and exits on the oldest releases of
    Celery, kombu and redis-py the package admits. (On Celery 5.6 it once sold them
    and then hung as it exited: its task results, collected after the embedded server
    had stopped, each tried to reconnect to it for 20 s.)"""
    python = environments[FLOORS].result()
    done, report = run_seckill([], tmp_path, redis_url=None, timeout=180, python=python)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "embedded" in done.stderr
    assert "invariants: OK" in done.stdout
    assert (report["sold"], report["attempts"]) == (10, 50)


@pytest.mark.slow
def test_the_oldest_supported_python_passes_the_key_engine_and_worker_tests(
    environments: dict[str, Future[str]],
) -> None:
    """A virtual environment of the oldest Python the package declares, with the
    newest releases of its dependencies that install there, runs the tests of the
    lock names, the engine and a solo worker, and passes them (skipped where no
    interpreter of that release is installed)."""
    release, python = oldest_python()
    if python is None:
        pytest.skip(f"no Python {release} here")
    pass_the_key_engine_and_worker_tests(environments[OLDEST_PYTHON].result(), release)


@pytest.mark.slow
def test_the_newest_python_here_passes_the_key_engine_and_worker_tests(
    environments: dict[str, Future[str]],
) -> None:
    """The same on the newest Python installed here, where it is newer than the one
    that runs the rest of the suite (skipped where there is none)."""
    release, python = newest_python()
    if python is None:
        pytest.skip(f"no Python newer than {release} here")
    pass_the_key_engine_and_worker_tests(environments[NEWEST_PYTHON].result(), release)


def pass_the_key_engine_and_worker_tests(interpreter: str, release: str) -> None:
    """Run ``OTHER_PYTHON_TESTS`` with ``interpreter`` (of a virtual environment
    :func:`make_environment` made, of Python ``release``): they must pass."""
    env = child_environment()
    version = subprocess.run(
        [interpreter, "-c", "import sys; print(*sys.version_info[:2], sep='.')"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert version.stdout.strip() == release
    result = subprocess.run(
        [interpreter, "-m", "pytest", *OTHER_PYTHON_TESTS, *CHILD_PYTEST_OPTIONS],
        cwd=ROOT, capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
