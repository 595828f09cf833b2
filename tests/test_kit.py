"""celery_redislock.testing, the test kit for users: its helpers, and the complete
example of the Testing page (docs/testing.md) run as a pytest session of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, bootsteps, current_app
from celery.worker import state as worker_state

from celery_redislock import LockLostError, RedisLock, SingletonTask, is_skipped, signals
from celery_redislock.admin import ForceReleased, force_release, read_lock
from celery_redislock.server import RedisServer
from celery_redislock.testing import (
    assert_no_locks,
    configure_app,
    hold_lock,
    leave_stale_lock,
    run_worker,
    steal_lock,
    wait_for_lock,
)
from tests.support import close_app, gate, wait_for

ROOT = Path(__file__).resolve().parent.parent


def page_example() -> dict[str, str]:
    """The files of the Testing page's example: each ```python block of its "An
    example" section, titled with a file name."""
    page = (ROOT / "docs" / "testing.md").read_text()
    section = page.split("\n## An example\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r'```python title="(\w+\.py)"\n(.*?)```', section, flags=re.DOTALL)
    return dict(blocks)


def test_page_example_passes_as_a_project_of_its_own(tmp_path: Path) -> None:
    """The Testing page's example (task, conftest, tests) passes when run as a user's
    project: the plugin is enabled by its conftest alone, which imports the helpers
    before it lists the plugin without pytest's warning that the module was
    imported too early to be rewritten (an error here)."""
    files = page_example()
    assert set(files) == {"reports.py", "conftest.py", "test_reports.py"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.pop("PYTHONPATH", None)
    pytest_command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    # Pytest warns of a plugin imported before it was listed (too late to rewrite it).
    pytest_command += ["-W", "error::pytest.PytestAssertRewriteWarning"]
    result = subprocess.run(
        pytest_command,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 passed" in result.stdout


# Tests that start and stop a worker of their own come before the module's worker
# starts: stopping an in-process worker sets Celery's process-wide shutdown flag,
# which would stop that one too.


def test_run_worker_returns_after_its_running_task_finished(
    redislock_server: RedisServer, redislock_client: redis.Redis
) -> None:
    """run_worker returns only once a task running when its block ends has finished:
    no thread of the pool is left running it, and its lock is free."""
    app = configure_app(Celery("kit-stop", set_as_current=False), redislock_server.url)
    app.conf.task_default_queue = "kit-stop-queue"
    finished = threading.Event()
    ran_on: list[threading.Thread] = []

    @app.task(base=SingletonTask, bind=True, shared=False, name="kit.outlast")
    def outlast(self: SingletonTask) -> bool:
        # Outlast the worker: Celery sets its shutdown flag when it stops the worker
        # and clears it once the worker's thread has exited; go on a little after.
        ran_on.append(threading.current_thread())
        deadline = time.monotonic() + 20
        while worker_state.should_terminate is None and time.monotonic() < deadline:
            time.sleep(0.01)
        while worker_state.should_terminate is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)
        finished.set()
        return True

    try:
        with run_worker(app, concurrency=2) as worker:
            result = outlast.delay()
            wait_for_lock(outlast)
            pool_threads = list(worker.pool.executor._threads)
        assert finished.is_set(), "run_worker returned while the task was still running"
        assert pool_threads
        assert ran_on
        assert not [thread.name for thread in pool_threads + ran_on if thread.is_alive()]
        assert_no_locks(redislock_client)
        assert result.get(timeout=10) is True
    finally:
        close_app(app)


def test_a_worker_given_less_time_to_stop_than_it_takes_leaves_the_next_able_to_start(
    redislock_server: RedisServer,
) -> None:
    """A ``shutdown_timeout`` shorter than a worker takes to stop (about a second)
    makes run_worker raise, saying so; the next worker of the process still starts
    and runs tasks (Celery's own timeout leaves its process-wide stop flag set)."""
    app = configure_app(Celery("kit-hasty", set_as_current=False), redislock_server.url)
    app.conf.task_default_queue = "kit-hasty-queue"

    @app.task(base=SingletonTask, shared=False, name="kit.hasty")
    def hasty() -> bool:
        return True

    try:
        with (
            pytest.raises(RuntimeError, match="still stopping after shutdown_timeout"),
            run_worker(app, concurrency=1, shutdown_timeout=0.05),
        ):
            pass
        with run_worker(app, concurrency=1):
            assert hasty.delay().get(timeout=20) is True
    finally:
        worker_state.should_terminate = None
        close_app(app)


def test_run_worker_raises_when_a_task_outlasts_shutdown_timeout(
    redislock_server: RedisServer, redislock_client: redis.Redis
) -> None:
    """A task still running on the worker's threads pool ``shutdown_timeout`` seconds
    after the block ended makes run_worker raise, saying so, rather than return with
    the task (and its lock) going on into whatever runs next."""
    app = configure_app(Celery("kit-outlasting", set_as_current=False), redislock_server.url)
    app.conf.task_default_queue = "kit-outlasting-queue"
    let_go = threading.Event()
    ran_on: list[threading.Thread] = []

    @app.task(base=SingletonTask, shared=False, name="kit.outlasting")
    def outlasting() -> bool:
        ran_on.append(threading.current_thread())
        return let_go.wait(30)

    sent: list[Any] = []

    def leave_it_running() -> None:
        # (Long enough for the worker's own thread to stop: about a second.)
        with run_worker(app, concurrency=1, shutdown_timeout=3):
            sent.append(outlasting.delay())
            wait_for_lock(outlasting)

    try:
        with pytest.raises(RuntimeError) as excinfo:
            leave_it_running()
        assert not let_go.is_set()
        assert [thread.is_alive() for thread in ran_on] == [True]
    finally:
        let_go.set()
        for thread in ran_on:
            thread.join(30)
        # Should the worker's own thread have outlasted shutdown_timeout, Celery
        # raises and leaves its process-wide shutdown flag set: no later worker in
        # this session could start.
        worker_state.should_terminate = None
    assert str(excinfo.value) == (
        f"tasks still running on the worker's threads pool ({ran_on[0].name}) after "
        "shutdown_timeout: raise it if your tasks take longer to finish"
    )
    assert_no_locks(redislock_client)
    assert sent[0].get(timeout=10) is True
    close_app(app)


def test_run_worker_puts_the_current_app_back(redislock_server: RedisServer) -> None:
    """Celery makes a worker's app the current and the default one: after the block,
    the app that was current before is current again."""
    before = current_app._get_current_object()
    app = configure_app(Celery("kit-current", set_as_current=False), redislock_server.url)
    app.conf.task_default_queue = "kit-current-queue"
    try:
        with run_worker(app):
            assert current_app._get_current_object() is app
        assert current_app._get_current_object() is before
    finally:
        close_app(app)


def test_run_worker_raises_when_the_worker_fails_to_start(
    redislock_server: RedisServer,
) -> None:
    """A worker whose consumer fails to start (a bootstep raises) makes run_worker
    raise that error, instead of waiting for ever for a worker that never gets ready."""
    app = configure_app(Celery("kit-broken", set_as_current=False), redislock_server.url)
    app.conf.task_default_queue = "kit-broken-queue"

    class Broken(bootsteps.StartStopStep):  # type: ignore[misc]
        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, consumer: Any) -> None:
            raise RuntimeError("the step failed")

    app.steps["consumer"].add(Broken)
    raised: list[BaseException] = []

    def start_broken_worker() -> None:
        try:
            with run_worker(app, startup_timeout=30):
                pass
        except BaseException as exc:
            raised.append(exc)

    # In a thread of its own, so that a run_worker that hangs fails the test
    # rather than hanging the session.
    runner = threading.Thread(target=start_broken_worker, daemon=True)
    runner.start()
    runner.join(60)
    try:
        assert not runner.is_alive(), "run_worker hangs on a worker that failed to start"
        assert len(raised) == 1
        assert isinstance(raised[0], RuntimeError)
        assert str(raised[0]) == "the worker failed to start: RuntimeError('the step failed')"
    finally:
        close_app(app)


@pytest.fixture(scope="module")
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app pointed at the session server by the kit, with a task to hold, and a worker."""
    app = configure_app(Celery("kit", set_as_current=False), redislock_server.url)
    app.conf.task_default_queue = "kit-queue"

    @app.task(base=SingletonTask, bind=True, shared=False, name="kit.job")
    def job(self: SingletonTask, n: int, until_lost: bool = False) -> bool:
        deadline = time.monotonic() + 20
        while until_lost and not self.lock.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        if until_lost:
            self.lock.check()
        return True

    @app.task(base=SingletonTask, bind=True, shared=False, name="kit.gated")
    def gated(self: SingletonTask, n: int) -> bool:
        # Hold the lock until it is lost or the test opens the call's gate (at most
        # 20 s); return whether it was still held.
        opened = gate(f"kit.gated:{n}")
        deadline = time.monotonic() + 20
        while not self.lock.lost and not opened.is_set() and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self.lock.lost

    with run_worker(app, concurrency=2):
        yield app
    close_app(app)


@pytest.fixture
def job(app: Celery) -> Any:
    """The kit.job task."""
    return app.tasks["kit.job"]


def test_configure_app_uses_database_1_for_messages_and_0_for_locks() -> None:
    """configure_app points broker and results at database 1 and locks at the given URL."""
    app = configure_app(Celery("conf", set_as_current=False), "redis://127.0.0.1:7000/0")
    assert app.conf.broker_url == "redis://127.0.0.1:7000/1"
    assert app.conf.result_backend == "redis://127.0.0.1:7000/1"
    assert app.conf.redislock_url == "redis://127.0.0.1:7000/0"
    assert app.conf.result_expires is None


def test_hold_lock_makes_a_call_a_duplicate(job: Any, redislock_client: redis.Redis) -> None:
    """Inside hold_lock the call is a duplicate of another holder; after it, it runs."""
    with hold_lock(job, 1) as held:
        outcome = job.delay(1).get(timeout=20)
        assert is_skipped(outcome)
        assert outcome["holder"] == held.lease
        assert job.delay(2).get(timeout=20) is True
        with pytest.raises(AssertionError, match="already held"), hold_lock(job, n=1):
            pass
    assert job.delay(1).get(timeout=20) is True
    assert_no_locks(redislock_client)


def test_leave_stale_lock_is_never_renewed(job: Any, redislock_client: redis.Redis) -> None:
    """A stale lock is held with a crashed holder's description and frees by its TTL."""
    name = leave_stale_lock(job, 3, ttl=3)  # time for the worker to see it held
    info = read_lock(redislock_client, name)
    assert info is not None
    assert (info.state, info.node) == ("running", "crashed@leave_stale_lock")
    assert is_skipped(job.delay(3).get(timeout=20))
    wait_for(lambda: read_lock(redislock_client, name) is None, what="the TTL to free it")


def test_a_stale_lock_under_a_prefix_of_its_own_is_freed_as_the_migration_guide_says(
    redislock_server: RedisServer,
) -> None:
    """The celery-singleton guide's ``release_lock`` counterpart frees the lock of a
    task whose locks live under another prefix (``SINGLETONLOCK``, as the guide's
    settings keep them), given the task's prefix."""
    app = configure_app(Celery("migrated", set_as_current=False), redislock_server.url)
    app.conf.redislock_prefix = "SINGLETONLOCK"

    @app.task(base=SingletonTask, shared=False, name="migrated.job")
    def job(n: int) -> None: ...

    try:
        leave_stale_lock(job, 1, ttl=30)
        name = job.lock_name((1,), {})
        assert force_release(job.lock_client, name, job.lock_options.prefix) is ForceReleased.FREED
        assert read_lock(job.lock_client, name, prefix="SINGLETONLOCK") is None
    finally:
        close_app(app)


def test_steal_lock_makes_the_running_task_lose_it(job: Any, redislock_client: redis.Redis) -> None:
    """steal_lock takes a running call's lock over: its self.lock reports it lost at once
    and check() raises; the thief's token is newer."""
    result = job.delay(4, until_lost=True)
    before = wait_for_lock(job, 4, until_lost=True)
    assert before.holder == result.id
    with steal_lock(job, 4, until_lost=True) as thief, pytest.raises(LockLostError):
        result.get(timeout=20)
    assert thief.token is not None
    assert thief.token > before.fence
    assert_no_locks(redislock_client)
    with pytest.raises(AssertionError, match="nothing to steal"), steal_lock(job, 5):
        pass


def test_steal_lock_keeps_the_task_id_so_a_delivery_of_it_waits_as_a_redelivery(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """The hold steal_lock takes keeps the task's id: in the block, a delivery of that
    id (its message sent again) waits for it as for an earlier delivery of its own
    message (lock_conflict 'redelivered') instead of meeting on_conflict, and runs
    once the block ends; a delivery of another id meets on_conflict ('skip')."""
    gated = app.tasks["kit.gated"]
    opened = gate("kit.gated:1")
    opened.clear()
    conflicts: list[tuple[str, str, str]] = []
    acquired: list[str] = []
    released: list[tuple[str, str]] = []

    def on_conflict(sender: Any = None, **kwargs: Any) -> None:
        if sender is gated:
            conflicts.append((kwargs["task_id"], kwargs["holder"], kwargs["action"]))

    def on_acquired(sender: Any = None, **kwargs: Any) -> None:
        if sender is gated:
            acquired.append(kwargs["task_id"])

    def on_released(sender: Any = None, **kwargs: Any) -> None:
        if sender is gated:
            released.append((kwargs["task_id"], kwargs["outcome"]))

    signals.lock_conflict.connect(on_conflict, weak=False, dispatch_uid="kit-steal-copy")
    signals.lock_acquired.connect(on_acquired, weak=False, dispatch_uid="kit-steal-copy")
    signals.lock_released.connect(on_released, weak=False, dispatch_uid="kit-steal-copy")
    try:
        first = gated.delay(1)
        wait_for_lock(gated, 1)
        with steal_lock(gated, 1) as thief:
            assert thief.lease == first.id
            assert first.get(timeout=20) is False  # it lost its lock
            gated.apply_async((1,), task_id=first.id)
            wait_for(lambda: bool(conflicts), what="the copy to meet the lock")
            other = gated.delay(1)
            skipped = other.get(timeout=20)
            assert is_skipped(skipped)
            assert skipped["holder"] == first.id
            assert acquired == [first.id]  # the copy waits
        wait_for(lambda: len(acquired) == 2, what="the copy to take the lock")
        opened.set()
        wait_for(lambda: (first.id, "released") in released, what="the copy to end")
    finally:
        opened.set()
        for signal in (signals.lock_conflict, signals.lock_acquired, signals.lock_released):
            signal.disconnect(dispatch_uid="kit-steal-copy")
    assert conflicts == [(first.id, first.id, "redelivered"), (other.id, first.id, "skip")]
    assert acquired == [first.id, first.id]
    assert_no_locks(redislock_client)


def test_wait_for_lock_gives_up(job: Any) -> None:
    """wait_for_lock fails, naming the lock, when nobody takes it in time."""
    with pytest.raises(AssertionError, match="was not taken within"):
        wait_for_lock(job, 6, timeout=0.05)


def test_assert_no_locks_lists_what_is_left(redislock_client: redis.Redis) -> None:
    """assert_no_locks passes on a clean store and fails naming held locks and queues."""
    assert_no_locks(redislock_client, timeout=0)
    lock = RedisLock(redislock_client, "left:1", ttl=30, lease="task-left")
    assert lock.acquire()
    redislock_client.zadd("redislock:{left:1}:waiters", {"w": 1})
    with pytest.raises(AssertionError) as failure:
        assert_no_locks(redislock_client, timeout=0.05)
    assert "left:1 (holder task-left" in str(failure.value)
    assert "redislock:{left:1}:waiters (waiters queued)" in str(failure.value)
    lock.release()
    redislock_client.delete("redislock:{left:1}:waiters")
    assert_no_locks(redislock_client, timeout=0)
