"""What a task body and a task's app see: ``self.lock`` and its fence, warnings about
misspelt settings, and the log lines of a waiting duplicate."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery.worker.request import Request as CeleryRequest

from celery_redislock import (
    LockBackendError,
    LockConflictError,
    LockHandle,
    NoLockError,
    RedisLock,
    SingletonTask,
    early,
)
from celery_redislock.server import RedisServer, free_port
from celery_redislock.task import (
    KNOWN_SETTINGS,
    OPTIONS,
    RequestClassWarning,
    UnknownSettingWarning,
)
from celery_redislock.testing import hold_lock
from tests.proxy import FaultProxy
from tests.support import close_app, make_app, wait_for


@pytest.fixture
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app on the test server (tasks run eagerly through apply())."""
    app = make_app(redislock_server.url, "face")
    yield app
    close_app(app)


def test_fence_is_the_token_as_an_int(app: Celery, redislock_client: redis.Redis) -> None:
    """Inside a locked body, self.lock is a LockHandle and self.lock.fence its token."""

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: SingletonTask) -> tuple[bool, int, int | None]:
        handle = self.lock
        return isinstance(handle, LockHandle), handle.fence, handle.token

    is_handle, fence, token = job.apply().get()
    assert is_handle
    assert fence == token
    assert isinstance(fence, int)


def test_a_task_id_with_the_field_separator_fails_the_task_naming_it(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """A task id a lock cannot store (it contains the separator of the lock's stored
    fields) fails that execution, before the body runs, with an error naming it."""
    ran: list[bool] = []

    @app.task(base=SingletonTask, shared=False, name="face.separated")
    def job() -> None:
        ran.append(True)

    result = job.apply(task_id="task\x1f1")
    assert isinstance(result.result, ValueError)
    assert "task id" in str(result.result)
    assert ran == []
    assert redislock_client.keys("redislock:*") == []


def test_a_cooperative_base_class_between_it_and_celerys_task_is_called(
    app: Celery, redislock_client: redis.Redis
) -> None:
    """A base class placed between SingletonTask and Celery's Task, whose
    ``apply_async`` names fewer parameters than Celery's and passes the rest on,
    is called by SingletonTask's on every strategy's path."""
    seen: list[str] = []

    class Traced(Task):  # type: ignore[misc]
        def apply_async(
            self, args: Any = None, kwargs: Any = None, task_id: Any = None, **options: Any
        ) -> Any:
            seen.append(self.name)
            return super().apply_async(args, kwargs, task_id, **options)

    class Both(SingletonTask, Traced):
        pass

    app.conf.task_always_eager = True
    for strategy in ("while_executing", "until_executed"):

        @app.task(base=Both, shared=False, name=f"face.traced-{strategy}", lock_strategy=strategy)
        def add(x: int, y: int) -> int:
            return x + y

        assert add.apply_async((1, 2)).get() == 3
    assert seen == ["face.traced-while_executing", "face.traced-until_executed"]


def test_lock_outside_an_execution_raises(app: Celery) -> None:
    """Reading task.lock outside a locked execution raises NoLockError, a LockError."""

    @app.task(base=SingletonTask, bind=True, shared=False, name="face.outside")
    def job(self: SingletonTask) -> None: ...

    with pytest.raises(NoLockError, match="holds no lock here"):
        _ = job.lock


def test_until_executing_body_has_no_lock(app: Celery, redislock_client: redis.Redis) -> None:
    """An until_executing task's body finds no lock: its lock went as the body started."""

    @app.task(base=SingletonTask, bind=True, shared=False, lock_strategy="until_executing")
    def job(self: SingletonTask) -> str:
        try:
            _ = self.lock
        except NoLockError as exc:
            return str(exc)
        return "had a lock"

    assert "until_executing" in job.apply().get()


def test_fence_raises_when_running_unlocked(redislock_server: RedisServer) -> None:
    """With the store away and lock_on_redis_error='run', the body runs, token is None and
    fence raises NoLockError instead of handing out a missing token."""
    app = make_app(redislock_server.url, "unlocked")
    app.conf.redislock_url = f"redis://127.0.0.1:{free_port()}/0"

    @app.task(base=SingletonTask, bind=True, shared=False, lock_on_redis_error="run")
    def job(self: SingletonTask) -> tuple[bool, int | None, str]:
        try:
            _ = self.lock.fence
        except NoLockError as exc:
            return self.lock.held, self.lock.token, str(exc)
        return True, 0, ""

    held, token, message = job.apply().get()
    assert (held, token) == (False, None)
    assert "no fencing token" in message
    close_app(app)


def test_misspelt_setting_warns_once_naming_the_closest(redislock_server: RedisServer) -> None:
    """An unknown redislock_* setting warns, once per app, at task definition, naming the
    closest known setting."""
    app = Celery("typo", set_as_current=False)
    app.conf.update(redislock_url=redislock_server.url, redislock_ttl_seconds=600)
    app.finalize()
    with pytest.warns(UnknownSettingWarning, match=r"redislock_ttl_seconds .* redislock_ttl\?"):

        @app.task(base=SingletonTask, shared=False, name="typo.one")
        def one() -> None: ...

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @app.task(base=SingletonTask, shared=False, name="typo.two")
        def two() -> None: ...


def test_a_misspelt_task_option_fails_at_definition_naming_it(
    redislock_server: RedisServer,
) -> None:
    """A keyword given to the task as a ``lock_*`` option SingletonTask does not
    have fails as the task is defined, naming it and the option meant; a method
    or property of the task's own named ``lock_*`` is no option, and passes."""
    app = make_app(redislock_server.url, "misspelt")
    app.finalize()  # Tasks are made as they are defined.
    try:
        with pytest.raises(TypeError, match=r"lock_on_conflict .* did you mean on_conflict\?"):

            @app.task(base=SingletonTask, shared=False, lock_on_conflict="retry")
            def one() -> None: ...

        with pytest.raises(TypeError, match=r"lock_ttl_seconds .* did you mean lock_ttl\?"):

            @app.task(base=SingletonTask, shared=False, lock_ttl_seconds=600)
            def two() -> None: ...

        class Own(SingletonTask):
            def lock_for_report(self) -> str:
                return "mine"

            @property
            def lock_label(self) -> str:
                return "mine"

        @app.task(base=Own, shared=False, lock_ttl=5)
        def three() -> None: ...

        assert three.lock_options.ttl == 5
    finally:
        close_app(app)


def test_upper_case_setting_is_named_in_lower_case(redislock_server: RedisServer) -> None:
    """A setting spelt in capitals is pointed to its lower-case name."""
    app = Celery("caps", set_as_current=False)
    app.conf.update(redislock_url=redislock_server.url, REDISLOCK_ON_CONFLICT="wait")
    app.finalize()
    with pytest.warns(UnknownSettingWarning, match="did you mean redislock_on_conflict"):

        @app.task(base=SingletonTask, shared=False, name="caps.job")
        def job() -> None: ...


def test_known_settings_do_not_warn(redislock_server: RedisServer) -> None:
    """Every setting celery_redislock reads passes without a warning."""
    assert {option.setting for option in OPTIONS} <= KNOWN_SETTINGS
    assert {
        "redislock_url",
        "redislock_client",
        "redislock_transport_options",
        "redislock_metrics",
    } <= KNOWN_SETTINGS
    app = Celery("known", set_as_current=False)
    app.conf.update(
        redislock_url=redislock_server.url,
        redislock_ttl=30,
        redislock_metrics=False,
        redislock_transport_options={},
    )
    app.finalize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @app.task(base=SingletonTask, shared=False, name="known.job")
        def job() -> None: ...


def test_waits_are_logged(
    app: Celery, redislock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A waiting duplicate logs at INFO when it starts waiting, when it gets the lock, and
    when it gives up."""
    caplog.set_level(logging.INFO, logger="celery_redislock")

    @app.task(base=SingletonTask, shared=False, on_conflict="wait", lock_wait=0.1)
    def short() -> None: ...

    with hold_lock(short), pytest.raises(LockConflictError, match="still held"):
        short.apply().get()
    assert "waits up to 0.1 s" in caplog.text
    assert "gave up after waiting 0.1 s" in caplog.text

    @app.task(base=SingletonTask, shared=False, on_conflict="wait", lock_wait=20)
    def patient() -> None: ...

    holder = RedisLock(redislock_client, patient.lock_name((), {}), ttl=30, lease="first")
    assert holder.acquire()
    outcome: list[Any] = []
    waiter = threading.Thread(target=lambda: outcome.append(patient.apply().get()))
    waiter.start()
    wait_for(lambda: "waits up to 20 s" in caplog.text, what="the waiter to log its wait")
    holder.release()
    waiter.join(20)
    assert outcome == [None]
    assert "got lock" in caplog.text


def test_every_conflict_is_logged(
    app: Celery, redislock_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A skipped, raised or retried duplicate and a deduplicated enqueue each log at INFO."""
    caplog.set_level(logging.INFO, logger="celery_redislock")

    @app.task(base=SingletonTask, shared=False, name="face.skip")
    def skip() -> None: ...

    @app.task(base=SingletonTask, shared=False, name="face.raise", on_conflict="raise")
    def raising() -> None: ...

    @app.task(
        base=SingletonTask, shared=False, name="face.retry", on_conflict="retry", max_retries=0
    )
    def retrying() -> None: ...

    @app.task(base=SingletonTask, shared=False, name="face.dedup", lock_strategy="until_executed")
    def dedup() -> None: ...

    with hold_lock(skip), hold_lock(raising), hold_lock(retrying), hold_lock(dedup):
        assert skip.apply().get()["skipped"]
        with pytest.raises(LockConflictError):
            raising.apply().get()
        with pytest.raises(LockConflictError):
            retrying.apply().get()
        dedup.delay()
    messages = [record.getMessage() for record in caplog.records]
    assert any(m.startswith("face.skip[") and " skipped: lock" in m for m in messages)
    assert any(m.startswith("face.raise[") and "raises LockConflictError" in m for m in messages)
    assert any(m.startswith("face.retry[") and "retries in" in m for m in messages)
    assert any(m.startswith("face.dedup: duplicate of held-by-test-") for m in messages)


def test_a_waiting_task_whose_first_try_fails_runs_unlocked_with_run(
    redislock_server: RedisServer,
) -> None:
    """``on_conflict="wait"`` with ``lock_on_redis_error="run"``: a first try that cannot
    reach the store runs the body unlocked, as for every other mode."""
    app = make_app(redislock_server.url, "wait-unlocked")
    app.conf.redislock_url = f"redis://127.0.0.1:{free_port()}/0"

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        on_conflict="wait",
        lock_wait=5,
        lock_on_redis_error="run",
    )
    def job(self: SingletonTask) -> bool:
        return self.lock.held

    assert job.apply().get() is False
    close_app(app)


@pytest.mark.slow
def test_a_waiting_task_whose_store_goes_away_fails_rather_than_run_unlocked(
    redislock_server: RedisServer,
) -> None:
    """``on_conflict="wait"`` with ``lock_on_redis_error="run"``: once the task has found
    the lock held and waits, losing the store fails it (``LockBackendError``, after the
    lock's ``call_timeout`` of failures in a row); it never runs the body unlocked
    beside the holder."""
    with FaultProxy("127.0.0.1", redislock_server.port) as proxy:
        app = make_app(redislock_server.url, "wait-store-lost")
        app.conf.redislock_url = proxy.url

        @app.task(
            base=SingletonTask,
            shared=False,
            on_conflict="wait",
            lock_wait=60,
            lock_on_redis_error="run",
        )
        def job() -> str:
            return "ran"

        client = redislock_server.client()
        holder = RedisLock(client, job.lock_name((), {}), ttl=60, lease="holder-id")
        assert holder.acquire()
        outcome: list[Any] = []

        def run() -> None:
            try:
                outcome.append(job.apply().get())
            except Exception as exc:
                outcome.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_for(lambda: client.zcard(holder.queue_key) == 1, what="the task to queue")
        proxy.refuse()
        proxy.reset_all()
        thread.join(60)
        assert len(outcome) == 1
        assert isinstance(outcome[0], LockBackendError), outcome
        assert holder.owned()
        holder.release()
        client.close()
        close_app(app)


class _OwnRequest(early.Request):
    """A worker request class of a user's own, derived as the docs ask."""


@pytest.mark.parametrize(
    "request_class",
    [
        pytest.param("celery.worker.request:Request", id="path"),
        pytest.param(CeleryRequest, id="class"),
    ],
)
def test_a_request_class_not_from_early_warns_at_definition(
    app: Celery, request_class: Any
) -> None:
    """A task whose ``Request`` is not derived from ``celery_redislock.early.Request``
    warns as it is defined, naming the task and what it loses."""
    app.finalize()
    with pytest.warns(RequestClassWarning, match=r"'face\.plain_request'.*to its TTL"):

        @app.task(
            base=SingletonTask, shared=False, name="face.plain_request", Request=request_class
        )
        def plain_request() -> None: ...


@pytest.mark.parametrize(
    "request_class",
    [
        pytest.param("celery_redislock.early:Request", id="default-path"),
        pytest.param("celery_redislock.early.Request", id="dotted-path"),
        pytest.param(early.Request, id="class"),
        pytest.param(_OwnRequest, id="derived"),
        pytest.param(f"{__name__}:_OwnRequest", id="derived-path"),
        pytest.param("no_such_module:Request", id="unimportable"),
    ],
)
def test_a_request_class_from_early_does_not_warn(app: Celery, request_class: Any) -> None:
    """The default request class, one derived from it, and a path that cannot be
    imported here (the worker reports that) define the task without a warning."""
    app.finalize()
    with warnings.catch_warnings():
        warnings.simplefilter("error")

        @app.task(base=SingletonTask, shared=False, name="face.own_request", Request=request_class)
        def own_request() -> None: ...
