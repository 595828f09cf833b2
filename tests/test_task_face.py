"""What a task body and a task's app see: ``self.lock`` and its fence, warnings about
misspelt settings, errors about misspelt options, warnings about options without
effect, and the log lines of a waiting duplicate."""

from __future__ import annotations

import inspect
import logging
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery.app import task as celery_task
from celery.worker.request import Request as CeleryRequest

from celery_redislock import (
    LockBackendError,
    LockConflictError,
    LockHandle,
    NoLockError,
    RedisLock,
    SingletonTask,
    TaskOptionError,
    early,
)
from celery_redislock.server import RedisServer, free_port
from celery_redislock.task import (
    KNOWN_SETTINGS,
    OPTIONS,
    RequestClassWarning,
    UnknownSettingWarning,
    UnusedOptionWarning,
    resembled_option,
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


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("on_confict", "on_conflict"),
        ("onconflict", "on_conflict"),
        ("On_Conflict", "on_conflict"),
        ("lockttl", "lock_ttl"),
        ("lock_wiat", "lock_wait"),
        ("on_duplicate", "lock_on_duplicate"),
        ("on_redis_error", "lock_on_redis_error"),
    ],
)
def test_a_near_miss_of_an_option_fails_at_definition_naming_it(
    redislock_server: RedisServer, name: str, meant: str
) -> None:
    """A keyword close to an option's name (not only a ``lock_*`` one), or an ``on_*``
    option's name without its ``lock_`` prefix, is taken for a misspelling: it fails
    naming the task, the keyword and the option meant, given to the task or set on a
    base class of it."""
    app = make_app(redislock_server.url, "near")
    app.finalize()
    try:
        with pytest.raises(TaskOptionError) as excinfo:

            @app.task(base=SingletonTask, shared=False, name="near.job", **{name: "wait"})
            def job() -> None: ...

        assert (excinfo.value.task_name, excinfo.value.option) == ("near.job", name)
        assert str(excinfo.value).startswith("task 'near.job' (tests.test_task_face:")
        assert str(excinfo.value).endswith(
            f": {name} is not a SingletonTask option, and would be ignored; did you mean "
            f"{meant}? (a name of your own must not come this close to an option's)"
        ) or str(excinfo.value).endswith(f"did you mean {meant}?")

        base = type("Base", (SingletonTask,), {name: "wait"})
        with pytest.raises(TaskOptionError, match=rf"{name}, set on class Base, is not a Singl"):

            @app.task(base=base, shared=False, name="near.inherited")
            def inherited() -> None: ...

    finally:
        close_app(app)


#: Keywords ``@app.task(...)`` takes, besides the task attributes: Celery's own
#: (``autoretry_for`` and its kin are read off the keywords, not the class).
CELERY_TASK_KEYWORDS = {
    "autoretry_for",
    "dont_autoretry_for",
    "retry_kwargs",
    "retry_backoff",
    "retry_backoff_max",
    "retry_jitter",
    "bind",
    "base",
    "name",
    "shared",
    "lazy",
    "filter",
    "pydantic",
    "pydantic_strict",
    "pydantic_context",
    "pydantic_dump_kwargs",
}


def test_celery_task_attributes_and_names_of_your_own_pass(redislock_server: RedisServer) -> None:
    """No attribute of Celery's Task (nor a keyword of ``@app.task``) is taken for a
    misspelt option; nor are a task's own attributes that are a word of an option's
    name, given to the task or set in its class."""
    celery_names = set(dir(celery_task.Task)) | CELERY_TASK_KEYWORDS
    assert {name: resembled_option(name) for name in celery_names if resembled_option(name)} == {}
    own = {
        "strategy": "fast",
        "conflict": "none",
        "ttl": 3,
        "wait": 1,
        "prefix": "mine",
        "url": "https://example.org",
        "key": "k",
        "retry_delay": 5,
        "enqueue_ttl": 10,
        "min_replicas": 1,
        "timeout": 2,
        "lock_timeout_handler": staticmethod(lambda: None),
    }
    app = make_app(redislock_server.url, "own")
    # Nothing read off SingletonTask while checking binds it to an app (Task.app does).
    bound_to = vars(SingletonTask).get("_app")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")

            @app.task(
                base=SingletonTask,
                shared=False,
                name="own.job",
                acks_late=True,
                autoretry_for=(KeyError,),
                retry_backoff=True,
                retry_backoff_max=60,
                retry_jitter=False,
                retry_kwargs={"max_retries": 2},
                default_retry_delay=3,
                rate_limit="10/s",
                soft_time_limit=5,
                time_limit=10,
                track_started=True,
                typing=True,
                expires=60,
                serializer="json",
                reject_on_worker_lost=True,
                acks_on_failure_or_timeout=True,
                **own,
            )
            def job() -> None: ...

            class Own(SingletonTask):
                name = "own.class"
                strategy = "fast"
                retry_delay = 5

                def run(self) -> None: ...

            app.register_task(Own())
            app.finalize()
        assert (job.strategy, job.retry_delay, job.default_retry_delay) == ("fast", 5, 3)
        assert job.lock_options.retry_delay == 1.0
        assert vars(SingletonTask).get("_app") is bound_to
    finally:
        close_app(app)


def _first_line(task: Any) -> int:
    """The line the definition of ``task``'s function starts at (its decorator's)."""
    line = int(task.run.__code__.co_firstlineno)
    assert "@app.task(" in inspect.getsourcelines(task.run)[0][0]
    return line


@pytest.mark.parametrize(
    ("options", "option", "why"),
    [
        ({"lock_enqueue_ttl": 600}, "lock_enqueue_ttl", "lock_strategy is 'while_executing'"),
        ({"lock_on_duplicate": "raise"}, "lock_on_duplicate", "lock_strategy is 'while_executing'"),
        ({"lock_wait": 5}, "lock_wait", "on_conflict='skip'"),
        ({"lock_wait": 5, "on_conflict": "retry"}, "lock_wait", "on_conflict='retry'"),
        ({"lock_retry_delay": 2, "on_conflict": "wait"}, "lock_retry_delay", "on_conflict='wait'"),
    ],
)
def test_an_option_without_effect_warns_at_the_tasks_definition(
    app: Celery, options: dict[str, Any], option: str, why: str
) -> None:
    """An option a task sets that its other options leave without effect warns, once,
    with an UnusedOptionWarning naming the task and saying why, at the line the task
    is defined at, though raised as the app finalizes."""

    @app.task(base=SingletonTask, shared=False, name="face.unused", **options)
    def unused() -> None: ...

    with pytest.warns(UnusedOptionWarning) as caught:
        app.finalize()
    (warning,) = caught
    line = _first_line(unused)
    assert str(warning.message).startswith(
        "task 'face.unused' (tests.test_task_face:test_an_option_without_effect_warns_at_the_"
        f"tasks_definition.<locals>.unused, {__file__}:{line}): {option} has no effect "
    )
    assert why in str(warning.message)
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_a_call_that_sets_on_conflict_uses_the_tasks_lock_wait(app: Celery) -> None:
    """The lock_wait that warns on a task whose on_conflict is not "wait" is still what a
    call given lock_options={"on_conflict": "wait"} waits."""

    @app.task(base=SingletonTask, bind=True, shared=False, name="face.per_call", lock_wait=7)
    def job(self: SingletonTask) -> tuple[str, float]:
        options = self.lock.options
        assert options is not None
        return options.on_conflict, options.wait

    with pytest.warns(UnusedOptionWarning, match="lock_wait has no effect"):
        app.finalize()
    assert job.apply(lock_options={"on_conflict": "wait"}).get() == ("wait", 7.0)
    assert job.apply().get() == ("skip", 7.0)


def test_an_option_without_effect_in_a_task_class_warns(app: Celery) -> None:
    """An option set to no effect in the body of a class registered as a task warns too,
    at the line of its ``run``."""

    class Purchase(SingletonTask):
        name = "face.purchase"
        lock_wait = 5

        def run(self) -> None: ...

    with pytest.warns(UnusedOptionWarning) as caught:
        app.register_task(Purchase())
    (warning,) = caught
    line = Purchase.run.__code__.co_firstlineno
    assert str(warning.message).startswith(
        "task 'face.purchase' (tests.test_task_face:test_an_option_without_effect_in_a_task_"
        f"class_warns.<locals>.Purchase, {__file__}:{line}): lock_wait has no effect "
    )
    assert (warning.filename, warning.lineno) == (__file__, line)


def test_a_bad_option_of_a_task_class_names_the_class_and_its_run(app: Celery) -> None:
    """A bad option in the body of a class registered as a task names the task, the
    class and the line its ``run`` starts at."""

    class Refund(SingletonTask):
        name = "face.refund"
        lock_ttl = "10"  # type: ignore[assignment]  # the bad value under test

        def run(self) -> None: ...

    with pytest.raises(TypeError) as excinfo:
        app.register_task(Refund())
    assert isinstance(excinfo.value, TaskOptionError)
    assert str(excinfo.value) == (
        "task 'face.refund' (tests.test_task_face:test_a_bad_option_of_a_task_class_names_the_"
        f"class_and_its_run.<locals>.Refund, {__file__}:{Refund.run.__code__.co_firstlineno}): "
        "lock_ttl must be a number of seconds, not str; fix lock_ttl where the task is "
        "defined (@app.task(...) or its class)"
    )


def test_a_default_without_effect_on_some_tasks_does_not_warn(
    redislock_server: RedisServer,
) -> None:
    """A value from ``app.conf``, or from a base class several tasks share, is a default
    that some tasks use and others not: it never warns; nor does an option its task's
    other options (its own, inherited, or from ``app.conf``) give effect to."""
    app = make_app(redislock_server.url, "defaults")
    app.conf.update(
        redislock_wait=5,
        redislock_retry_delay=2,
        redislock_enqueue_ttl=600,
        redislock_on_duplicate="raise",
    )
    waiting = make_app(redislock_server.url, "waiting")
    waiting.conf.redislock_on_conflict = "wait"

    class Family(SingletonTask):
        lock_wait = 10
        lock_retry_delay = 1
        lock_enqueue_ttl = 60
        lock_on_duplicate = "raise"

    class Waits(SingletonTask):
        on_conflict = "wait"

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")

            @app.task(base=SingletonTask, shared=False, name="defaults.plain")
            def plain() -> None: ...

            @app.task(base=Family, shared=False, name="defaults.family")
            def family() -> None: ...

            @app.task(base=Waits, shared=False, name="defaults.waits", lock_wait=3)
            def waits() -> None: ...

            @app.task(
                base=SingletonTask,
                shared=False,
                name="defaults.retries",
                on_conflict="retry",
                lock_retry_delay=3,
            )
            def retries() -> None: ...

            @app.task(
                base=SingletonTask,
                shared=False,
                name="defaults.queued",
                lock_strategy="until_executed",
                lock_enqueue_ttl=60,
                lock_on_duplicate="return",
            )
            def queued() -> None: ...

            @waiting.task(base=SingletonTask, shared=False, name="waiting.job", lock_wait=3)
            def waiting_job() -> None: ...

            app.finalize()
            waiting.finalize()
        assert (family.lock_options.wait, waits.lock_options.wait) == (10.0, 3.0)
        assert waiting_job.lock_options.wait == 3.0
    finally:
        close_app(app)
        close_app(waiting)


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
