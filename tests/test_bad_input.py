"""Bad input, table-driven: every case raises the documented exception, names the culprit,
and leaves the server's keyspace as it was.

Covered: ``RedisLock(...)`` arguments and method arguments, SingletonTask options
given in ``@app.task(...)``, ``app.conf.redislock_*`` settings, and the arguments
a task is called with; and the options of a task of an app not yet finalized,
which raise as the app finalizes (a worker starting), naming the task.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import KeyDerivationError, RedisLock, SingletonTask, TaskOptionError
from celery_redislock.server import RedisServer
from tests.support import close_app, make_app

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Env:
    """What a case runs against: a client to database 0, a factory of apps on the
    server, and the apps it made."""

    client: redis.Redis
    new_app: Callable[[], Celery]
    apps: list[Celery] = field(default_factory=list)


#: A case: runs something that must fail.
Run = Callable[[Env], object]


def new_lock(**arguments: Any) -> Run:
    """``RedisLock(client, "bad-input", **arguments)``; ``name``/``client_or_url`` may be replaced."""

    def run(env: Env) -> object:
        rest = dict(arguments)
        client = rest.pop("client_or_url", env.client)
        name = rest.pop("name", "bad-input")
        return RedisLock(client, name, **rest)

    return run


def lock_method(method: str, *args: Any, **kwargs: Any) -> Run:
    """Call ``method`` of a valid lock (not held) with bad arguments."""

    def run(env: Env) -> object:
        lock = RedisLock(env.client, "bad-input", ttl=10)
        return getattr(lock, method)(*args, **kwargs)

    return run


def task_with(**options: Any) -> Run:
    """Define a SingletonTask with ``options`` on an app of ``env`` (a finalized one checks
    them at definition)."""

    def run(env: Env) -> object:
        app = env.new_app()

        @app.task(base=SingletonTask, shared=False, **options)
        def purchase(event_id: int, user_id: int) -> None: ...

        return purchase

    return run


def app_with(setting: str, value: object) -> Run:
    """Define a SingletonTask on an app of ``env`` whose ``app.conf.<setting>`` is ``value``."""

    def run(env: Env) -> object:
        app = env.new_app()
        app.conf[setting] = value

        @app.task(base=SingletonTask, shared=False)
        def purchase(event_id: int, user_id: int) -> None: ...

        return purchase

    return run


def _recursive_list() -> list[Any]:
    items: list[Any] = []
    items.append(items)
    return items


def _recursive_dict() -> dict[str, Any]:
    mapping: dict[str, Any] = {}
    mapping["again"] = mapping
    return mapping


def called_with(
    *args: Any, strategy: str = "until_executed", lock_key: Any = None, **kwargs: Any
) -> Run:
    """Send (``until_*``: the key is derived before anything is sent) or run eagerly a task
    ``order(event_id, items=())`` called with these arguments."""

    def run(env: Env) -> object:
        app = env.new_app()
        options: dict[str, Any] = {"lock_strategy": strategy}
        if lock_key is not None:
            options["lock_key"] = lock_key

        @app.task(base=SingletonTask, shared=False, name="bad.order", **options)
        def order(event_id: int, items: Any = ()) -> None: ...

        if strategy == "while_executing":
            return order.apply(args, kwargs).get()
        return order.apply_async(args, kwargs)

    return run


class Unencodable:
    """An argument type with no canonical form."""


CASES = [
    # RedisLock(...) arguments.
    pytest.param(new_lock(ttl=0), ValueError, "ttl", id="lock-ttl-0"),
    pytest.param(new_lock(ttl=-1), ValueError, "ttl", id="lock-ttl-negative"),
    pytest.param(new_lock(ttl=math.nan), ValueError, "ttl", id="lock-ttl-nan"),
    pytest.param(new_lock(ttl=math.inf), ValueError, "ttl", id="lock-ttl-inf"),
    pytest.param(new_lock(ttl=1e17), ValueError, "ttl", id="lock-ttl-1e17"),
    pytest.param(new_lock(ttl=sys.maxsize), ValueError, "ttl", id="lock-ttl-maxsize"),
    pytest.param(new_lock(ttl="10"), TypeError, "ttl", id="lock-ttl-str"),
    pytest.param(new_lock(ttl=True), TypeError, "ttl", id="lock-ttl-bool"),
    pytest.param(
        new_lock(ttl=10, heartbeat_interval=10),
        ValueError,
        "heartbeat_interval",
        id="lock-heartbeat-interval-equal-ttl",
    ),
    pytest.param(
        new_lock(ttl=10, heartbeat_interval=30),
        ValueError,
        "heartbeat_interval",
        id="lock-heartbeat-interval-above-ttl",
    ),
    pytest.param(
        new_lock(blocking_timeout=-1), ValueError, "blocking_timeout", id="lock-blocking-timeout"
    ),
    pytest.param(new_lock(name=""), ValueError, "name", id="lock-name-empty"),
    pytest.param(new_lock(name=123), TypeError, "name", id="lock-name-int"),
    pytest.param(new_lock(name="\ud800"), ValueError, "name", id="lock-name-lone-surrogate"),
    pytest.param(new_lock(owner=""), ValueError, "owner", id="lock-owner-empty"),
    pytest.param(new_lock(prefix=""), ValueError, "prefix", id="lock-prefix-empty"),
    pytest.param(new_lock(prefix="a{}b"), ValueError, "prefix", id="lock-prefix-empty-tag"),
    pytest.param(new_lock(prefix=5), TypeError, "prefix", id="lock-prefix-int"),
    pytest.param(new_lock(on_lost=5), TypeError, "on_lost", id="lock-on-lost-not-callable"),
    pytest.param(
        new_lock(client_or_url=object()), TypeError, "client_or_url", id="lock-not-a-client"
    ),
    # RedisLock method arguments.
    pytest.param(lock_method("acquire", timeout=-1), ValueError, "timeout", id="acquire-timeout"),
    pytest.param(lock_method("extend", 0), ValueError, "ttl", id="extend-0"),
    pytest.param(lock_method("extend", math.nan), ValueError, "ttl", id="extend-nan"),
    # SingletonTask options in @app.task(...).
    pytest.param(task_with(lock_ttl="10"), TypeError, "lock_ttl", id="opt-ttl-str"),
    pytest.param(task_with(lock_ttl=-1), ValueError, "lock_ttl", id="opt-ttl-negative"),
    pytest.param(task_with(lock_ttl=sys.maxsize), ValueError, "lock_ttl", id="opt-ttl-maxsize"),
    pytest.param(task_with(lock_ttl=math.nan), ValueError, "lock_ttl", id="opt-ttl-nan"),
    pytest.param(task_with(lock_ttl=True), TypeError, "lock_ttl", id="opt-ttl-bool"),
    pytest.param(
        task_with(lock_enqueue_ttl="1h"), TypeError, "lock_enqueue_ttl", id="opt-enqueue-ttl-str"
    ),
    pytest.param(
        task_with(lock_enqueue_ttl=0), ValueError, "lock_enqueue_ttl", id="opt-enqueue-ttl-0"
    ),
    pytest.param(task_with(lock_wait=[30]), TypeError, "lock_wait", id="opt-wait-list"),
    pytest.param(task_with(lock_wait=-5), ValueError, "lock_wait", id="opt-wait-negative"),
    pytest.param(
        task_with(lock_retry_delay="1"), TypeError, "lock_retry_delay", id="opt-retry-delay-str"
    ),
    pytest.param(
        task_with(lock_retry_delay=math.inf),
        ValueError,
        "lock_retry_delay",
        id="opt-retry-delay-inf",
    ),
    pytest.param(task_with(lock_strategy=5), TypeError, "lock_strategy", id="opt-strategy-int"),
    pytest.param(
        task_with(lock_strategy="sometimes"), ValueError, "lock_strategy", id="opt-strategy-value"
    ),
    pytest.param(task_with(on_conflict=5), TypeError, "on_conflict", id="opt-conflict-int"),
    pytest.param(
        task_with(on_conflict="ignore"), ValueError, "on_conflict", id="opt-conflict-ignore"
    ),
    pytest.param(
        task_with(lock_on_redis_error=True),
        TypeError,
        "lock_on_redis_error",
        id="opt-redis-error-bool",
    ),
    pytest.param(
        task_with(lock_on_redis_error="ignore"),
        ValueError,
        "lock_on_redis_error",
        id="opt-redis-error-value",
    ),
    pytest.param(task_with(lock_prefix=5), TypeError, "lock_prefix", id="opt-prefix-int"),
    pytest.param(task_with(lock_prefix=""), ValueError, "lock_prefix", id="opt-prefix-empty"),
    pytest.param(
        task_with(lock_prefix="a{}b"), ValueError, "lock_prefix", id="opt-prefix-empty-tag"
    ),
    pytest.param(task_with(lock_url=5), TypeError, "lock_url", id="opt-url-int"),
    pytest.param(task_with(lock_url="http://x"), ValueError, "lock_url", id="opt-url-http"),
    pytest.param(task_with(lock_on="x"), TypeError, "lock_on", id="opt-lock-on-str"),
    pytest.param(task_with(lock_on=5), TypeError, "lock_on", id="opt-lock-on-int"),
    pytest.param(task_with(lock_on=(1,)), TypeError, "lock_on", id="opt-lock-on-not-names"),
    pytest.param(task_with(lock_on=("nope",)), ValueError, "lock_on", id="opt-lock-on-unknown"),
    pytest.param(task_with(lock_key=5), TypeError, "lock_key", id="opt-lock-key-int"),
    pytest.param(
        task_with(lock_key=lambda event_id: event_id),
        ValueError,
        "lock_key",
        id="opt-lock-key-takes-too-few",
    ),
    # app.conf.redislock_* settings.
    pytest.param(
        app_with("redislock_ttl", "10"), TypeError, "app.conf.redislock_ttl", id="conf-ttl-str"
    ),
    pytest.param(
        app_with("redislock_ttl", -1), ValueError, "app.conf.redislock_ttl", id="conf-ttl-negative"
    ),
    pytest.param(
        app_with("redislock_enqueue_ttl", "1h"),
        TypeError,
        "app.conf.redislock_enqueue_ttl",
        id="conf-enqueue-ttl-str",
    ),
    pytest.param(
        app_with("redislock_enqueue_ttl", math.inf),
        ValueError,
        "app.conf.redislock_enqueue_ttl",
        id="conf-enqueue-ttl-inf",
    ),
    pytest.param(
        app_with("redislock_wait", [1]), TypeError, "app.conf.redislock_wait", id="conf-wait-list"
    ),
    pytest.param(
        app_with("redislock_wait", 0), ValueError, "app.conf.redislock_wait", id="conf-wait-0"
    ),
    pytest.param(
        app_with("redislock_retry_delay", "1"),
        TypeError,
        "app.conf.redislock_retry_delay",
        id="conf-retry-delay-str",
    ),
    pytest.param(
        app_with("redislock_retry_delay", -1),
        ValueError,
        "app.conf.redislock_retry_delay",
        id="conf-retry-delay-negative",
    ),
    pytest.param(
        app_with("redislock_strategy", 1),
        TypeError,
        "app.conf.redislock_strategy",
        id="conf-strategy-int",
    ),
    pytest.param(
        app_with("redislock_strategy", "sometimes"),
        ValueError,
        "app.conf.redislock_strategy",
        id="conf-strategy-value",
    ),
    pytest.param(
        app_with("redislock_on_conflict", ["skip"]),
        TypeError,
        "app.conf.redislock_on_conflict",
        id="conf-conflict-list",
    ),
    pytest.param(
        app_with("redislock_on_conflict", "ignore"),
        ValueError,
        "app.conf.redislock_on_conflict",
        id="conf-conflict-ignore",
    ),
    pytest.param(
        app_with("redislock_on_redis_error", 0.5),
        TypeError,
        "app.conf.redislock_on_redis_error",
        id="conf-redis-error-float",
    ),
    pytest.param(
        app_with("redislock_on_redis_error", "retry"),
        ValueError,
        "app.conf.redislock_on_redis_error",
        id="conf-redis-error-value",
    ),
    pytest.param(
        app_with("redislock_prefix", 5),
        TypeError,
        "app.conf.redislock_prefix",
        id="conf-prefix-int",
    ),
    pytest.param(
        app_with("redislock_prefix", "a{}b"),
        ValueError,
        "app.conf.redislock_prefix",
        id="conf-prefix-empty-tag",
    ),
    pytest.param(
        app_with("redislock_url", 6379), TypeError, "app.conf.redislock_url", id="conf-url-int"
    ),
    pytest.param(
        app_with("redislock_url", "http://x"),
        ValueError,
        "app.conf.redislock_url",
        id="conf-url-http",
    ),
    # The arguments a task is called with.
    pytest.param(
        called_with(1, Unencodable()), KeyDerivationError, "'items'", id="arg-unencodable"
    ),
    pytest.param(
        called_with(1, items=_recursive_list()),
        KeyDerivationError,
        "'items'",
        id="arg-recursive-list",
    ),
    pytest.param(
        called_with(_recursive_dict()),
        KeyDerivationError,
        "'event_id'",
        id="arg-recursive-dict",
    ),
    pytest.param(
        called_with(1, lock_key=lambda event_id, items=(): _recursive_list()),
        KeyDerivationError,
        "lock_key",
        id="arg-recursive-lock-key-result",
    ),
    pytest.param(
        called_with(items=[1]), KeyDerivationError, "'event_id'", id="arg-missing-required"
    ),
    pytest.param(
        called_with(1, colour="red"), KeyDerivationError, "'colour'", id="arg-unexpected-keyword"
    ),
    pytest.param(
        called_with(1, [], 3), KeyDerivationError, "'bad.order'", id="arg-too-many-positional"
    ),
    pytest.param(
        called_with(1, Unencodable(), strategy="while_executing"),
        KeyDerivationError,
        "'items'",
        id="arg-unencodable-eager",
    ),
    pytest.param(
        called_with(_recursive_list(), strategy="while_executing"),
        KeyDerivationError,
        "'event_id'",
        id="arg-recursive-eager",
    ),
]


def _env(client: redis.Redis, url: str, finalized: bool) -> Iterator[Env]:
    """An :class:`Env` of apps on the server at ``url``, finalized or not (closed afterwards)."""
    apps: list[Celery] = []

    def new_app() -> Celery:
        app = make_app(url, "bad")
        if finalized:
            app.finalize()
        apps.append(app)
        return app

    yield Env(client, new_app, apps)
    for app in apps:
        close_app(app)


@pytest.fixture
def env(redislock_client: redis.Redis, redislock_server: RedisServer) -> Iterator[Env]:
    """The flushed session server, and finalized apps on it (closed afterwards)."""
    yield from _env(redislock_client, redislock_server.url, finalized=True)


@pytest.fixture
def lazy_env(redislock_client: redis.Redis, redislock_server: RedisServer) -> Iterator[Env]:
    """As :func:`env`, but its apps are not finalized: ``@app.task`` returns a proxy,
    and Celery makes the task (and SingletonTask checks it) as the app finalizes."""
    yield from _env(redislock_client, redislock_server.url, finalized=False)


def keyspace(client: redis.Redis) -> tuple[int, list[str]]:
    """The size and the sorted key list of database 0."""
    return client.dbsize(), sorted(str(key) for key in client.keys("*"))


@pytest.mark.parametrize(("run", "error", "culprit"), CASES)
def test_bad_input_is_rejected(env: Env, run: Run, error: type[Exception], culprit: str) -> None:
    """Bad input raises the documented exception naming the culprit, and writes nothing."""
    env.client.set("bystander", "1")
    before = keyspace(env.client)
    with pytest.raises(error) as excinfo:
        run(env)
    assert culprit in str(excinfo.value)
    assert keyspace(env.client) == before


#: The cases of a task's options and of the settings they take.
OPTION_CASES = [case for case in CASES if str(case.id).startswith(("opt-", "conf-"))]


@pytest.mark.parametrize(("run", "error", "culprit"), OPTION_CASES)
def test_a_bad_option_on_an_app_not_finalized_raises_as_it_finalizes_naming_the_task(
    lazy_env: Env, run: Run, error: type[Exception], culprit: str
) -> None:
    """On an app not finalized, the decorator returns; the bad option raises as the app
    finalizes, far from the task's definition (no frame of it in the traceback), so
    the error names the task, its function and the line it is defined at, the option
    or setting, and what to change. It is a TaskOptionError, and still the built-in
    error the table gives."""
    run(lazy_env)  # Nothing is made yet, so nothing raises.
    (app,) = lazy_env.apps
    with pytest.raises(TaskOptionError) as excinfo:
        app.finalize()
    exc = excinfo.value
    assert isinstance(exc, error)
    assert (exc.task_name, exc.option) == ("tests.test_bad_input.purchase", culprit)
    message = str(exc)
    assert message.startswith(
        "task 'tests.test_bad_input.purchase' "
        f"(tests.test_bad_input:{run.__qualname__}.<locals>.purchase, "
        f"{__file__}:"
    ), message
    assert culprit in message
    assert f"; fix {culprit}" in message


def test_a_bad_option_raises_at_the_tasks_first_use_or_as_its_tasks_are_read(
    lazy_env: Env,
) -> None:
    """Celery also makes a task of an app not finalized when the task is first used (an
    attribute read: a send), or as the app's tasks are read (which finalizes it): the
    bad option raises there."""
    first, second = lazy_env.new_app(), lazy_env.new_app()

    @first.task(base=SingletonTask, shared=False, on_conflict="ignore")
    def refund(invoice_id: int) -> None: ...

    @second.task(base=SingletonTask, shared=False, lock_ttl=-1)
    def audit(invoice_id: int) -> None: ...

    with pytest.raises(ValueError, match=r"^task 'tests\.test_bad_input\.refund' .*on_conflict"):
        refund.delay(1)
    with pytest.raises(TaskOptionError, match=r"^task 'tests\.test_bad_input\.audit' .*lock_ttl"):
        _ = second.tasks


def test_a_bad_option_stops_a_worker_at_start_naming_the_task(
    tmp_path: Path, redislock_server: RedisServer
) -> None:
    """``celery -A app worker`` with a bad option on a task of the app exits as it starts
    (as it finalizes the app), its last line naming the task, where it is defined, the
    option and what to change."""
    (tmp_path / "badapp.py").write_text(
        "from celery import Celery\n"
        "from celery_redislock import SingletonTask\n"
        f"app = Celery('badapp', broker={redislock_server.url!r})\n"
        "\n"
        "@app.task(base=SingletonTask, on_conflict='ignore')\n"
        "def purchase(event_id):\n"
        "    return event_id\n"
    )
    # The caller's own PYTHONPATH first: the worker imports the package the tests do.
    caller = [entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    path = os.pathsep.join([str(tmp_path), *caller, str(ROOT / "src"), str(ROOT)])
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "badapp", "worker", "-P", "solo"],
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=path),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (
        "celery_redislock.errors.TaskOptionError: task 'badapp.purchase' "
        f"(badapp:purchase, {tmp_path / 'badapp.py'}:5): on_conflict must be one of "
        "'skip', 'raise', 'retry', 'wait', got 'ignore'; fix on_conflict where the task "
        "is defined (@app.task(...) or its class)"
    ), done.stderr


@pytest.mark.parametrize(
    ("run", "expiry"),
    [
        pytest.param(task_with(lock_ttl=-1), True, id="lock_ttl"),
        pytest.param(task_with(lock_enqueue_ttl=math.inf), True, id="lock_enqueue_ttl"),
        pytest.param(task_with(lock_wait=-1), False, id="lock_wait"),
        pytest.param(task_with(lock_retry_delay=math.inf), False, id="lock_retry_delay"),
        pytest.param(new_lock(ttl=0), True, id="RedisLock-ttl"),
        pytest.param(new_lock(call_timeout=0), False, id="RedisLock-call_timeout"),
        pytest.param(new_lock(replica_timeout=-1), False, id="RedisLock-replica_timeout"),
        pytest.param(new_lock(heartbeat_interval=0), False, id="RedisLock-heartbeat_interval"),
    ],
)
def test_a_duration_out_of_range_says_why_only_for_a_lifetime(
    env: Env, run: Run, expiry: bool
) -> None:
    """Only a lock's lifetime is refused for the reason that a lock that never expires
    is never freed; a wait or a delay out of range is just out of range."""
    with pytest.raises(ValueError, match="from") as excinfo:
        run(env)
    assert ("never freed after a crash" in str(excinfo.value)) is expiry


@pytest.mark.parametrize(
    ("option", "setting", "field", "using"),
    [
        ("lock_ttl", "redislock_ttl", "ttl", {}),
        (
            "lock_enqueue_ttl",
            "redislock_enqueue_ttl",
            "enqueue_ttl",
            {"lock_strategy": "until_executed"},
        ),
        ("lock_wait", "redislock_wait", "wait", {"on_conflict": "wait"}),
        ("lock_retry_delay", "redislock_retry_delay", "retry_delay", {"on_conflict": "retry"}),
    ],
)
def test_durations_range_from_1_ms_to_about_10_years(
    env: Env, option: str, setting: str, field: str, using: dict[str, str]
) -> None:
    """Every duration, as a task option or an app setting, takes 1 ms and 315360000 s
    (about 10 years) and refuses half a millisecond and one second more, naming it.
    (``using``: the options that give it effect on the task.)"""
    for value in (0.001, 315_360_000):
        for task in (task_with(**{option: value}, **using)(env), app_with(setting, value)(env)):
            assert isinstance(task, SingletonTask)
            assert getattr(task.lock_options, field) == value
    for value in (0.0005, 315_360_001):
        for run, culprit in (
            (task_with(**{option: value}), option),
            (app_with(setting, value), f"app.conf.{setting}"),
        ):
            with pytest.raises(ValueError, match=r"from 0\.001 to 315360000 ") as excinfo:
                run(env)
            assert culprit in str(excinfo.value)


def test_a_lock_ttl_ranges_from_1_ms_to_about_10_years(env: Env) -> None:
    """RedisLock's ``ttl`` takes 1 ms and 315360000 s (about 10 years) and refuses half a
    millisecond and one second more."""
    for value in (0.001, 315_360_000):
        lock = new_lock(ttl=value)(env)
        assert isinstance(lock, RedisLock)
        assert lock.ttl == value
    for value in (0.0005, 315_360_001):
        with pytest.raises(
            ValueError, match=r"^ttl must be a finite number of seconds from 0\.001 to 315360000 "
        ):
            new_lock(ttl=value)(env)
