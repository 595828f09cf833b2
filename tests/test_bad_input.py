"""Bad input, table-driven: every case raises the documented exception, names the culprit,
and leaves the server's keyspace as it was.

Covered: ``RedisLock(...)`` arguments and method arguments, SingletonTask options
given in ``@app.task(...)``, ``app.conf.redislock_*`` settings, and the arguments
a task is called with.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from celery import Celery

from celery_redislock import KeyDerivationError, RedisLock, SingletonTask
from celery_redislock.server import RedisServer
from tests.support import close_app, make_app


@dataclass(frozen=True)
class Env:
    """What a case runs against: a client to database 0 and a factory of apps on the server."""

    client: redis.Redis
    new_app: Callable[[], Celery]


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
    """Define a SingletonTask with ``options`` on a finalized app (checks run at definition)."""

    def run(env: Env) -> object:
        app = env.new_app()

        @app.task(base=SingletonTask, shared=False, **options)
        def purchase(event_id: int, user_id: int) -> None: ...

        return purchase

    return run


def app_with(setting: str, value: object) -> Run:
    """Define a SingletonTask on an app whose ``app.conf.<setting>`` is ``value``."""

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


@pytest.fixture
def env(redislock_client: redis.Redis, redislock_server: RedisServer) -> Iterator[Env]:
    """The flushed session server, and finalized apps on it (closed afterwards)."""
    apps: list[Celery] = []

    def new_app() -> Celery:
        app = make_app(redislock_server.url, "bad")
        app.finalize()
        apps.append(app)
        return app

    yield Env(redislock_client, new_app)
    for app in apps:
        close_app(app)


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
    ("option", "setting", "field"),
    [
        ("lock_ttl", "redislock_ttl", "ttl"),
        ("lock_enqueue_ttl", "redislock_enqueue_ttl", "enqueue_ttl"),
        ("lock_wait", "redislock_wait", "wait"),
        ("lock_retry_delay", "redislock_retry_delay", "retry_delay"),
    ],
)
def test_durations_range_from_1_ms_to_about_10_years(
    env: Env, option: str, setting: str, field: str
) -> None:
    """Every duration, as a task option or an app setting, takes 1 ms and 315360000 s
    (about 10 years) and refuses half a millisecond and one second more, naming it."""
    for value in (0.001, 315_360_000):
        for task in (task_with(**{option: value})(env), app_with(setting, value)(env)):
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
