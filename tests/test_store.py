"""The lock store of an app: redislock_client, Sentinel URLs with transport options, the
broker as a fallback, and SingletonTask end to end on Cluster, Sentinel and TLS."""

from __future__ import annotations

import gc
import os
import re
import ssl
import threading
import time
import uuid
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster
from redis.sentinel import SentinelManagedSSLConnection

from celery_redislock import LockBackendError, SingletonTask
from celery_redislock import store as store_module
from celery_redislock.client import get_client, url_shown
from celery_redislock.deployments import ClusterDeployment, SentinelDeployment, TLSServer
from celery_redislock.scripts import OWNER_FIELD, SEPARATOR
from celery_redislock.server import RedisServer, free_port
from celery_redislock.store import describe_store, lock_store, store_url
from celery_redislock.task import lock_store_url
from celery_redislock.transport import Client, router_for
from tests.support import close_app, field, in_forked_child, wait_for, wait_until


def make(name: str, **conf: Any) -> Celery:
    """An app with no broker of its own unless ``broker_url`` is given in ``conf``."""
    app = Celery(name, set_as_current=False, broker=conf.pop("broker_url", "memory://"))
    app.conf.update(conf)
    app.finalize()
    return app


def job_of(app: Celery, **options: Any) -> Any:
    """A bound SingletonTask that reports its fencing token and whether it held its lock."""

    @app.task(base=SingletonTask, bind=True, shared=False, name=f"{app.main}.job", **options)
    def job(self: Any, key: str) -> tuple[int | None, bool]:
        handle = self.lock
        assert handle is not None
        return handle.token, bool(field(self.lock_client, handle_key(self, key), OWNER_FIELD))

    return job


def handle_key(task: Any, key: str) -> str:
    """The Redis key of ``task``'s lock for ``key``."""
    return f"{task.lock_options.prefix}:{{{task.lock_name((key,), {})}}}"


def test_redislock_client_given_ready(redislock_server: RedisServer) -> None:
    """A ready client in redislock_client is the lock store, ahead of redislock_url."""
    client = redislock_server.client()
    app = make("ready", redislock_client=client, redislock_url="redis://127.0.0.1:1/0")
    job = job_of(app)
    assert job.lock_client is client
    token, held = job.apply(("a",)).get()
    assert isinstance(token, int)
    assert held
    assert describe_store(app) == "app.conf.redislock_client (Redis)"
    close_app(app)
    client.close()


def _child_locks(job: Any, conn: Connection) -> None:
    """In a forked child: build an execution's lock and run one; report what they used."""
    lock = job._execution_lock("k", "child-task", job.lock_options, None)
    held = job.apply(("b",)).get()[1]
    conn.send(
        {
            "own_router": lock._router is router_for(job.lock_client),
            "pid": lock._info.split(SEPARATOR)[3],
            "held": held,
        }
    )
    conn.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork()")
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_locks_on_its_own_connections(redislock_server: RedisServer) -> None:
    """A task's executions share the lock state that does not change between them,
    kept per process: a forked child (a prefork worker's) that inherited a client
    object from ``redislock_client`` builds its locks on connections of its own and
    describes itself with its own process id."""
    client = redislock_server.client()
    app = make("forked", redislock_client=client)
    job = job_of(app)
    parent = job._execution_lock("k", "parent-task", job.lock_options, None)
    assert parent._router is router_for(client)
    assert job.apply(("a",)).get()[1]
    report = in_forked_child(_child_locks, job)
    assert report["own_router"]
    assert report["held"]
    assert report["pid"] != str(os.getpid())
    # The parent's own state is untouched.
    again = job._execution_lock("k", "parent-task-2", job.lock_options, None)
    assert again._router is parent._router
    assert again._info.split(SEPARATOR)[3] == str(os.getpid())
    close_app(app)
    client.close()


def test_store_is_resolved_again_only_when_its_settings_change(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is worked out from app.conf once, not on every task; a store setting
    changed through app.conf is picked up at the next use."""
    from celery_redislock import store

    resolved: list[Any] = []
    real = store._resolve

    def counting(app: Any) -> Any:
        resolved.append(app)
        return real(app)

    monkeypatch.setattr(store, "_resolve", counting)
    app = Celery("resolve-once", set_as_current=False)
    app.conf.update(broker_url="memory://", redislock_url=redislock_server.url)
    first = lock_store(app)
    assert all(lock_store(app) is first for _ in range(5))
    assert len(resolved) == 1
    app.conf.redislock_url = redislock_server.url.replace("/0", "/3")
    again = lock_store(app)
    assert isinstance(again, redis.Redis)
    assert again.connection_pool.connection_kwargs["db"] == 3
    assert len(resolved) == 2
    close_app(app)


def test_config_from_object_after_first_use_is_picked_up(redislock_server: RedisServer) -> None:
    """``config_from_object()`` on an app whose store was already resolved makes a new
    configuration: the next use resolves the store from it."""

    class First:
        broker_url = "memory://"
        redislock_url = redislock_server.url

    class Second(First):
        redislock_url = redislock_server.url.replace("/0", "/5")

    app = Celery("from-object", set_as_current=False)
    app.config_from_object(First)
    first = lock_store(app)
    assert first.connection_pool.connection_kwargs["db"] == 0  # type: ignore[union-attr]
    app.config_from_object(Second)
    again = lock_store(app)
    assert again.connection_pool.connection_kwargs["db"] == 5  # type: ignore[union-attr]
    assert lock_store(app) is again
    close_app(app)


def test_executions_look_the_store_up_again_only_after_a_while(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A task's executions go on with the lock store they last looked up for
    ``STORE_RECHECK`` seconds, rather than read the store settings every time;
    after that, the next one looks again, and a store setting changed meanwhile
    takes effect."""
    from celery_redislock import store
    from celery_redislock import task as task_module

    looked: list[Any] = []

    def counting(app: Any, url: str | None = None) -> Any:
        looked.append(app)
        return store.lock_store(app, url)

    monkeypatch.setattr(task_module, "lock_store", counting)
    app = Celery("recheck", set_as_current=False)
    app.conf.update(broker_url="memory://", redislock_url=redislock_server.url)

    @app.task(base=SingletonTask, shared=False, name="recheck.job")
    def job() -> None: ...

    # Due again at once: every execution looks, and sees a changed setting.
    monkeypatch.setattr(task_module, "STORE_RECHECK", 0.0)
    before = job._execution_lock("k", "t-0", job.lock_options, None)
    app.conf.redislock_url = redislock_server.url.replace("/0", "/3")
    moved = job._execution_lock("k", "t-1", job.lock_options, None)
    assert len(looked) == 2
    assert moved.client is not before.client
    assert moved.client.connection_pool.connection_kwargs["db"] == 3
    # Due in an hour: the next execution looks, and those after it go on with it.
    monkeypatch.setattr(task_module, "STORE_RECHECK", 3600.0)
    kept = [job._execution_lock("k", f"t-{i}", job.lock_options, None) for i in range(2, 8)]
    assert len(looked) == 3
    assert all(lock.client is moved.client for lock in kept)
    close_app(app)


def test_redislock_client_callable_is_called_once_per_process(
    redislock_server: RedisServer,
) -> None:
    """A callable in redislock_client is called lazily, once per process, however many
    tasks run."""
    calls: list[redis.Redis] = []

    def build() -> redis.Redis:
        calls.append(redislock_server.client())
        return calls[-1]

    app = make("lazy", redislock_client=build)
    job = job_of(app)
    assert calls == []
    for key in ("a", "b", "c"):
        assert job.apply((key,)).get()[1]
    assert len(calls) == 1
    assert job.lock_client is calls[0]
    close_app(app)


@pytest.mark.parametrize(
    ("setting", "value", "error"),
    [
        ("redislock_client", 5, TypeError),
        ("redislock_client", "redis://127.0.0.1/0", TypeError),
        ("redislock_transport_options", ["master_name"], TypeError),
        ("redislock_min_replicas", -1, ValueError),
        ("redislock_min_replicas", 1.5, TypeError),
    ],
)
def test_bad_store_settings_fail_at_definition(setting: str, value: object, error: type) -> None:
    """A redislock_client that is no client, transport options that are no dict, and a bad
    redislock_min_replicas fail when the task is defined, naming the setting."""
    app = make("bad-store", **{setting: value})
    with pytest.raises(error) as excinfo:

        @app.task(base=SingletonTask, shared=False)
        def job() -> None: ...

    assert setting in str(excinfo.value)


def test_callable_returning_no_client_is_refused(redislock_server: RedisServer) -> None:
    """A redislock_client callable that returns something else raises at use."""
    app = make("returns-junk", redislock_client=lambda: "redis://x")
    job = job_of(app)
    with pytest.raises(TypeError) as excinfo:
        job.lock_client  # noqa: B018
    assert "redislock_client" in str(excinfo.value)


def test_an_error_of_the_client_callable_itself_is_raised_as_it_is() -> None:
    """A redislock_client callable that fails other than by reaching the store (one
    that takes an argument, say) raises its own error at use, every time."""
    app = make("needs-argument", redislock_client=lambda url: redis.Redis.from_url(url))
    for _ in range(2):
        with pytest.raises(TypeError, match="url"):
            lock_store(app)


def test_a_client_callable_that_cannot_reach_its_cluster_is_called_again(
    redislock_cluster: ClusterDeployment,
) -> None:
    """A redislock_client callable that fails to reach the store (a RedisCluster asks
    its nodes for the slot map as it is made) raises LockBackendError naming the
    setting; nothing is kept, so the next use calls it again, and gets the client
    once the cluster answers."""
    ports = [free_port()]
    calls: list[int] = []

    def build() -> RedisCluster:
        calls.append(ports[0])
        return RedisCluster(host="127.0.0.1", port=ports[0])

    app = make("cluster-away", redislock_client=build)
    with pytest.raises(LockBackendError) as excinfo:
        lock_store(app)
    message = str(excinfo.value)
    # (RedisClusterUnreachableError from redis-py 8.2, RedisClusterException before.)
    assert re.search(r"app\.conf\.redislock_client raised RedisCluster\w+", message), message
    assert "Connection refused" in message
    assert "called again at the next use" in message
    ports[0] = redislock_cluster.nodes[0].port
    client = lock_store(app)
    assert isinstance(client, RedisCluster)
    assert lock_store(app) is client
    assert len(calls) == 2
    close_app(app)
    client.close()


def test_passwords_are_not_shown() -> None:
    """Messages show lock store URLs without their passwords."""
    assert url_shown("redis://:hunter2@h:6379/0") == "redis://:***@h:6379/0"
    assert url_shown("sentinel://u:pw@a:1;sentinel://b:2") == "sentinel://u:***@a:1;sentinel://b:2"
    app = make("shown", redislock_url="rediss://me:hunter2@h:6380/0")
    assert "hunter2" not in describe_store(app)


def test_sentinel_url_with_transport_options(redislock_sentinel: SentinelDeployment) -> None:
    """redislock_url = sentinel://… with redislock_transport_options locks on the master
    the Sentinels name."""
    app = make(
        "sentinel-url",
        redislock_url=redislock_sentinel.sentinel_url,
        redislock_transport_options=redislock_sentinel.transport_options,
    )
    job = job_of(app)
    token, held = job.apply((uuid.uuid4().hex,)).get()
    assert isinstance(token, int)
    assert held
    close_app(app)


def test_task_sentinel_lock_url_with_transport_options(
    redislock_sentinel: SentinelDeployment,
) -> None:
    """A task's own lock_url = sentinel://… takes redislock_transport_options too."""
    app = make(
        "sentinel-task-url", redislock_transport_options=redislock_sentinel.transport_options
    )
    job = job_of(app, lock_url=redislock_sentinel.sentinel_url)
    token, held = job.apply((uuid.uuid4().hex,)).get()
    assert isinstance(token, int)
    assert held
    close_app(app)


def test_sentinel_broker_options_of_the_transport_are_left_out(
    redislock_sentinel: SentinelDeployment,
) -> None:
    """The broker's own transport options (visibility_timeout, ...) are not connection
    options: the lock store on a Sentinel broker leaves them out; a missing
    master_name names the setting it is read from."""
    app = make(
        "sentinel-broker-options",
        broker_url=redislock_sentinel.sentinel_url,
        broker_transport_options={
            **redislock_sentinel.transport_options,
            "visibility_timeout": 3600,
            "socket_timeout": 4,
        },
    )
    _token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    close_app(app)
    nameless = make(
        "sentinel-broker-nameless",
        broker_url=redislock_sentinel.sentinel_url,
        broker_transport_options={"visibility_timeout": 3600},
    )
    with pytest.raises(ValueError, match=r"app\.conf\.broker_transport_options = "):
        lock_store(nameless)
    close_app(nameless)


def test_broker_url_given_as_a_list_locks_on_the_first(redislock_server: RedisServer) -> None:
    """A broker given as a list of failover URLs (as kombu takes it): the locks live on
    the first; a list that is no Redis URL is refused without showing a password."""
    app = make("broker-list", broker_url=[redislock_server.url, "redis://127.0.0.1:1/0"])
    assert store_url(app)[0] == redislock_server.url
    _token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    close_app(app)
    other = make("broker-list-amqp", broker_url=["amqp://user:s3cret@h1//"])
    with pytest.raises(ValueError) as excinfo:
        store_url(other)
    assert "s3cret" not in str(excinfo.value)
    close_app(other)


def test_broker_url_given_as_a_string_of_failover_urls_locks_on_the_first(
    redislock_server: RedisServer,
) -> None:
    """Failover URLs in one string, separated by ";" (as kombu takes them too): the
    locks live on the first, its database included."""
    first = redislock_server.url.replace("/0", "/4")
    app = make("broker-failover-string", broker_url=f"{first};redis://127.0.0.1:1/4")
    assert store_url(app)[0] == first
    _token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    assert lock_store(app).connection_pool.connection_kwargs["db"] == 4  # type: ignore[union-attr]
    close_app(app)


def test_lock_store_url_is_the_url_the_store_is_made_from(redislock_server: RedisServer) -> None:
    """``lock_store_url`` reads the settings at each call: ``redislock_url``, else
    the broker's (made ``rediss://`` by ``broker_use_ssl``); a bad one is refused
    naming the setting."""
    app = make("store-url", broker_url="redis://127.0.0.1:1/0")
    app.conf.broker_use_ssl = {"ssl_cert_reqs": "required"}
    assert lock_store_url(app) == "rediss://127.0.0.1:1/0"
    app.conf.redislock_url = redislock_server.url
    assert lock_store_url(app) == redislock_server.url
    app.conf.redislock_url = "http://nowhere"
    with pytest.raises(ValueError, match=r"app\.conf\.redislock_url"):
        lock_store_url(app)
    close_app(app)


def test_a_plain_redislock_url_takes_no_sentinel_options(redislock_server: RedisServer) -> None:
    """``redislock_transport_options`` name a Sentinel master: with a ``redis://``
    ``redislock_url`` (development beside a Sentinel production setting) they are
    left out, not handed to redis-py."""
    app = make(
        "plain-with-sentinel-options",
        redislock_url=redislock_server.url,
        redislock_transport_options={"master_name": "mymaster", "sentinel_kwargs": {}},
    )
    assert store_url(app)[1] == {}
    _token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    close_app(app)


def _store_in_child(app: Celery, conn: Connection) -> None:
    conn.send(lock_store(app).ping())
    conn.close()


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_child_forked_while_the_store_is_being_built_builds_its_own(
    redislock_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process forked while the parent's redislock_client callable is still making
    the client (in a thread that does not exist in the child), and while another
    thread holds the store's lock, calls the callable itself and gets its own
    client; the parent's call, once it returns, serves the parent."""
    monkeypatch.setattr(store_module, "CLIENT_BUILD_WAIT", 0.1)
    parent = os.getpid()
    release = threading.Event()
    made: list[redis.Redis] = []

    def build() -> redis.Redis:
        if os.getpid() == parent:
            release.wait(30)
        made.append(redislock_server.client())
        return made[-1]

    app = make("fork-while-building", redislock_client=build)
    with pytest.raises(LockBackendError, match="still making it"):
        lock_store(app)
    with store_module._guard:
        assert in_forked_child(_store_in_child, app) is True
    release.set()
    wait_for(lambda: made, what="the parent's call to return")
    assert lock_store(app) is made[0]
    close_app(app)
    made[0].close()


@pytest.fixture(scope="module")
def lone_cluster() -> Iterator[ClusterDeployment]:
    """A Redis Cluster of one node, for this module's tests to freeze."""
    with ClusterDeployment(masters=1) as cluster:
        yield cluster


class FrozenClusterClients:
    """A redislock_client callable making a RedisCluster without socket timeouts (so
    its question for the slot map waits for ever on a frozen node): records which
    thread each call ran in, and the client each made."""

    def __init__(self, cluster: ClusterDeployment) -> None:
        self.node = cluster.nodes[0]
        self.calls: list[int] = []
        self.started: list[float] = []
        self.made: dict[int, RedisCluster] = {}

    def __call__(self) -> RedisCluster:
        self.calls.append(threading.get_ident())
        self.started.append(time.monotonic())
        client = RedisCluster(
            host=self.node.host,
            port=self.node.port,
            socket_timeout=None,
            socket_connect_timeout=None,
        )
        self.made[threading.get_ident()] = client
        return client

    def all_returned(self) -> bool:
        return len(self.made) == len(self.calls)

    def close(self) -> None:
        for client in self.made.values():
            client.close()


def uses_at_once(app: Celery, count: int) -> list[BaseException | Client]:
    """What ``count`` threads asking for ``app``'s lock store at once got."""
    outcomes: list[BaseException | Client] = []

    def use() -> None:
        try:
            outcomes.append(lock_store(app))
        except BaseException as exc:
            outcomes.append(exc)

    threads = [threading.Thread(target=use) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive(), "a use of the lock store hung"
    return outcomes


def test_a_client_callable_stuck_on_a_frozen_node_holds_no_use_past_the_wait(
    lone_cluster: ClusterDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redislock_client callable whose RedisCluster waits for a frozen node (SIGSTOP)
    is called once, in a thread of its own, however many threads need the store:
    each use waits CLIENT_BUILD_WAIT at most, then fails with LockBackendError saying
    the client is still being made (a task execution then acts by
    lock_on_redis_error, running no body under "fail"). The client it makes once the
    node answers again is kept, and the next use takes it."""
    monkeypatch.setattr(store_module, "CLIENT_BUILD_WAIT", 0.3)
    build = FrozenClusterClients(lone_cluster)
    app = make("frozen-cluster", redislock_client=build)
    job = job_of(app)
    with lone_cluster.nodes[0].paused():
        failed = job.apply(("a",)).result
        assert isinstance(failed, LockBackendError)
        assert "app.conf.redislock_client has not returned within 0.3 s" in str(failed)
        outcomes = uses_at_once(app, 4)
        assert all(isinstance(outcome, LockBackendError) for outcome in outcomes), outcomes
        assert all("still making it" in str(outcome) for outcome in outcomes)
        assert len(build.calls) == 1
    wait_for(build.all_returned, what="the call under way to return")
    assert len(build.made) == 1
    client = lock_store(app)
    assert client is build.made[build.calls[0]]
    assert all(outcome is client for outcome in uses_at_once(app, 3))
    assert job.apply(("b",)).get()[1]
    assert len(build.calls) == 1
    close_app(app)
    build.close()


def test_a_client_callable_stuck_for_long_is_called_again_once(
    lone_cluster: ClusterDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redislock_client callable stuck for CLIENT_BUILD_ABANDON_WAITS waits blocks the
    store no longer: the next use calls it again, once however many threads ask at
    that moment, and its client, not the stuck call's, is the lock store."""
    monkeypatch.setattr(store_module, "CLIENT_BUILD_WAIT", 0.2)
    monkeypatch.setattr(store_module, "CLIENT_BUILD_ABANDON_WAITS", 1000)
    build = FrozenClusterClients(lone_cluster)
    app = make("stuck-cluster", redislock_client=build)
    with lone_cluster.nodes[0].paused():
        for _ in range(2):
            with pytest.raises(LockBackendError, match="still making it"):
                lock_store(app)
        assert len(build.calls) == 1
        # Given up on after 5 waits (1 s): wait past that since the call started.
        monkeypatch.setattr(store_module, "CLIENT_BUILD_ABANDON_WAITS", 5)
        time.sleep(max(0.0, build.started[0] + 1.1 - time.monotonic()))
        outcomes = uses_at_once(app, 4)
        assert all(isinstance(outcome, LockBackendError) for outcome in outcomes), outcomes
        assert len(build.calls) == 2
    wait_for(build.all_returned, what="both calls to return")
    client = lock_store(app)
    assert client is build.made[build.calls[1]]
    assert job_of(app).apply(("a",)).get()[1]
    assert len(build.calls) == 2
    close_app(app)
    build.close()


def test_a_new_client_callable_is_called(redislock_server: RedisServer) -> None:
    """A redislock_client callable set in place of another after the store was made is
    called at the next use, and its client is the lock store."""
    made: list[redis.Redis] = []

    def build() -> redis.Redis:
        made.append(redislock_server.client())
        return made[-1]

    def rebuild() -> redis.Redis:
        return build()

    app = make("new-callable", redislock_client=build)
    assert lock_store(app) is made[0]
    app.conf.redislock_client = rebuild
    assert lock_store(app) is made[1]
    assert len(made) == 2
    close_app(app)
    for client in made:
        client.close()


def test_a_client_method_of_a_configuration_object_is_called_once(
    lone_cluster: ClusterDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A redislock_client given as a method of a configuration object
    (``config_from_object()`` of an instance) is a new bound method at every read of
    the setting: it is the same source all the same, called once however many uses
    wait for it while its node is frozen (each use does not leave a stuck call of its
    own behind), and its client is kept once made."""
    monkeypatch.setattr(store_module, "CLIENT_BUILD_WAIT", 0.2)
    build = FrozenClusterClients(lone_cluster)

    class Config:
        broker_url = "memory://"

        def redislock_client(self) -> RedisCluster:
            return build()

    app = Celery("method-config", set_as_current=False)
    app.config_from_object(Config())
    assert app.conf.get("redislock_client") is not app.conf.get("redislock_client")
    with lone_cluster.nodes[0].paused():
        for _ in range(3):
            with pytest.raises(LockBackendError, match="still making it"):
                lock_store(app)
        outcomes = uses_at_once(app, 3)
        assert all(isinstance(outcome, LockBackendError) for outcome in outcomes), outcomes
        assert len(build.calls) == 1
    wait_for(build.all_returned, what="the call under way to return")
    assert lock_store(app) is build.made[build.calls[0]]
    assert all(lock_store(app) is build.made[build.calls[0]] for _ in range(3))
    assert len(build.calls) == 1
    close_app(app)
    build.close()


def test_a_client_callable_replaced_while_it_makes_its_client_is_not_kept(
    redislock_server: RedisServer,
) -> None:
    """redislock_client replaced by another thread while a use waits for the old
    callable: that use gets the old callable's client, but it is not kept as the
    store of the new setting: the next use calls the new callable and gets its client."""
    entered, release = threading.Event(), threading.Event()
    old_client, new_client = redislock_server.client(), redislock_server.client()

    def old() -> redis.Redis:
        entered.set()
        release.wait(30)
        return old_client

    def new() -> redis.Redis:
        return new_client

    app = make("replaced-callable", redislock_client=old)
    got: list[Client] = []
    first = threading.Thread(target=lambda: got.append(lock_store(app)))
    first.start()
    assert entered.wait(30)
    app.conf.redislock_client = new
    release.set()
    first.join(30)
    assert got == [old_client]
    assert lock_store(app) is new_client
    assert all(lock_store(app) is new_client for _ in range(3))
    close_app(app)
    old_client.close()
    new_client.close()


def _one_job_app(server: RedisServer, job: int, reads_its_app: bool) -> None:
    """A job of an application that makes a Celery app per job, with a client of its
    own as the lock store (a ``redislock_client`` callable that, with
    ``reads_its_app``, names the client after the app), sends an ``until_executed``
    task (which takes its lock as it is sent) and closes the app."""
    name = f"app-per-job-{int(reads_its_app)}-{job}"
    app = make(name, task_default_queue=name)

    def build() -> redis.Redis:
        return server.client(client_name=app.main if reads_its_app else name)

    app.conf.redislock_client = build

    @app.task(base=SingletonTask, shared=False, name=name, lock_strategy="until_executed")
    def job_task() -> None: ...

    job_task.delay()
    close_app(app)


@pytest.mark.parametrize("reads_its_app", [False, True], ids=["plain", "reading-its-app"])
def test_an_app_made_per_job_leaves_nothing_behind_once_dropped(
    redislock_server: RedisServer, reads_its_app: bool
) -> None:
    """An application that makes a Celery app per job, each with a client of its own
    as its lock store, and drops it once the job has sent its task, leaves nothing
    behind: the client the app's callable made goes with the app (though the app's
    configuration refers back to it once it has sent a message, and the callable
    may too), and so do the connections its locks opened."""
    admin = redislock_server.client()

    prefix = f"app-per-job-{int(reads_its_app)}-"

    def left_open() -> int:
        gc.collect()
        return sum(1 for c in admin.client_list() if c["name"].startswith(prefix))

    for job in range(2):
        _one_job_app(redislock_server, job, reads_its_app)
    wait_until(lambda: left_open() == 0, timeout=5)
    assert left_open() == 0
    for job in range(2):
        admin.delete(*admin.keys(f"*{prefix}{job}*"))
    admin.close()


def test_sentinel_url_without_master_name_says_what_to_set(
    redislock_sentinel: SentinelDeployment,
) -> None:
    """A Sentinel URL without master_name fails at use with a message naming the setting."""
    app = make("sentinel-nameless", redislock_url=redislock_sentinel.sentinel_url)
    job = job_of(app)
    with pytest.raises(ValueError) as excinfo:
        job.lock_client  # noqa: B018
    assert "redislock_transport_options" in str(excinfo.value)
    assert "master_name" in str(excinfo.value)


def test_sentinel_broker_is_the_fallback(redislock_sentinel: SentinelDeployment) -> None:
    """With redislock_url unset and a Sentinel broker, the broker URL and its transport
    options are the lock store."""
    app = make(
        "sentinel-broker",
        broker_url=redislock_sentinel.sentinel_url,
        broker_transport_options=redislock_sentinel.transport_options,
    )
    url, options = store_url(app)
    assert url == redislock_sentinel.sentinel_url
    assert options["master_name"] == redislock_sentinel.transport_options["master_name"]
    client = lock_store(app)
    assert client.connection_pool.service_name == options["master_name"]  # type: ignore[union-attr]
    _token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    close_app(app)


def test_sentinel_broker_takes_broker_use_ssl_for_the_master(
    redislock_sentinel: SentinelDeployment,
) -> None:
    """A Sentinel broker's ``broker_use_ssl`` makes the lock store's connections to
    the master TLS ones, as kombu's are (the kombu spelling of the certificate
    requirement included)."""
    app = make(
        "sentinel-broker-tls",
        broker_url=redislock_sentinel.sentinel_url,
        broker_transport_options=redislock_sentinel.transport_options,
        broker_use_ssl={"ssl_cert_reqs": "CERT_REQUIRED", "ssl_ca_certs": "/etc/ssl/ca.pem"},
    )
    pool: Any = lock_store(app).connection_pool  # type: ignore[union-attr]
    assert pool.connection_class is SentinelManagedSSLConnection
    assert pool.connection_kwargs["ssl_cert_reqs"] == "required"
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/ssl/ca.pem"
    close_app(app)


def test_min_replicas_on_sentinel(redislock_sentinel: SentinelDeployment) -> None:
    """lock_min_replicas=1 with a live replica: the task runs, its lock confirmed by the replica."""
    app = make(
        "sentinel-replicated",
        redislock_url=redislock_sentinel.sentinel_url,
        redislock_transport_options=redislock_sentinel.transport_options,
    )
    job = job_of(app, lock_min_replicas=1)
    assert job.lock_options.min_replicas == 1
    _token, held = job.apply((uuid.uuid4().hex,)).get()
    assert held
    close_app(app)


def test_cluster_client(redislock_cluster: ClusterDeployment) -> None:
    """A RedisCluster in redislock_client: tasks with different keys lock on every primary."""
    cluster = redislock_cluster.client()
    app = make("cluster", redislock_client=cluster)
    job = job_of(app)
    primaries = set()
    for i in range(12):
        key = f"k{i}"
        token, held = job.apply((key,)).get()
        assert held
        assert isinstance(token, int)
        slot = cluster.keyslot(handle_key(job, key))  # type: ignore[no-untyped-call]
        primaries.add(redislock_cluster.primary_for_slot(slot).port)
    assert len(primaries) == 3
    assert isinstance(job.lock_client, RedisCluster)
    close_app(app)
    cluster.close()


def test_tls_url(redislock_tls_server: TLSServer) -> None:
    """A rediss:// URL with ssl_ca_certs locks over TLS."""
    app = make("tls", redislock_url=redislock_tls_server.url)
    token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    assert isinstance(token, int)
    close_app(app)


def test_tls_url_in_kombus_spelling(redislock_tls_server: TLSServer) -> None:
    """A rediss:// URL that spells the certificate requirement as kombu does
    (``ssl_cert_reqs=CERT_REQUIRED``, as a broker URL may) locks over TLS too."""
    url = redislock_tls_server.url.replace("ssl_cert_reqs=required", "ssl_cert_reqs=CERT_REQUIRED")
    assert "CERT_REQUIRED" in url
    app = make("tls-kombu", redislock_url=url)
    _token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    close_app(app)


@pytest.mark.parametrize("required", [ssl.CERT_REQUIRED, "CERT_REQUIRED"])
@pytest.mark.parametrize("scheme", ["rediss", "redis"])
def test_broker_use_ssl_reaches_the_lock_store(
    redislock_tls_server: TLSServer, scheme: str, required: object
) -> None:
    """A broker URL without TLS options of its own, with ``broker_use_ssl`` as Celery's
    Redis transport takes it (``ssl.CERT_REQUIRED``, or kombu's spelling of it as
    text), locks over TLS: a ``redis://`` URL too, as kombu turns it into TLS."""
    server = redislock_tls_server
    app = make(
        f"broker-ssl-{scheme}-{required}",
        broker_url=f"{scheme}://{server.host}:{server.port}/0",
        broker_use_ssl={"ssl_cert_reqs": required, "ssl_ca_certs": server.ca_path},
    )
    _token, held = job_of(app).apply((uuid.uuid4().hex,)).get()
    assert held
    assert describe_store(app).startswith("rediss://")
    close_app(app)


def test_broker_use_ssl_with_other_options_says_what_to_set() -> None:
    """``broker_use_ssl`` options the lock store cannot take are refused by name."""
    app = make("broker-ssl-bad", broker_url="redis://127.0.0.1:1/0", broker_use_ssl={"cert": "x"})
    with pytest.raises(ValueError, match=r"broker_use_ssl.*not cert.*redislock_url"):
        lock_store(app)
    close_app(app)


def test_sentinel_options_reach_redis_py(redislock_sentinel: SentinelDeployment) -> None:
    """sentinel_kwargs go to the Sentinel connections, other transport options and the
    URL's password to the master's."""
    url = redislock_sentinel.sentinel_url.replace("sentinel://", "sentinel://:pw-from-url@", 1)
    options = {
        **redislock_sentinel.transport_options,
        "sentinel_kwargs": {"socket_timeout": 1.25},
        "socket_keepalive": True,
    }
    client: Any = get_client(url, options)
    assert client.connection_pool.connection_kwargs["password"] == "pw-from-url"
    assert client.connection_pool.connection_kwargs["socket_keepalive"] is True
    sentinel = client.connection_pool.sentinel_manager
    assert sentinel.sentinel_kwargs["socket_timeout"] == 1.25
