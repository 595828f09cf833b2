"""The celery_redislock signals, sent by SingletonTask around its lock."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from redis.cluster import RedisCluster

from celery_redislock import LockBackendError, RedisLock, SingletonTask, signals, wakeups
from celery_redislock.scripts import OWNER_FIELD
from celery_redislock.server import RedisServer, free_port
from celery_redislock.transport import flush
from tests.proxy import FaultProxy
from tests.support import close_app, held, make_app, wait_for, write_fields


@pytest.fixture
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app on the test server (tasks run eagerly through apply())."""
    app = make_app(redislock_server.url, "signals")
    yield app
    close_app(app)


@pytest.fixture
def sent() -> Iterator[list[tuple[str, dict[str, Any]]]]:
    """Every celery_redislock signal sent during the test, in order.

    At the end, the replies still owed (a task's release is read moments after the
    task returns) are read while the receivers listen: a signal of this test's is
    not sent into the next test's list.
    """
    seen: list[tuple[str, dict[str, Any]]] = []
    receivers = {}
    for name in signals.__all__:

        def receiver(sender: Any = None, _name: str = name, **kwargs: Any) -> None:
            kwargs.pop("signal", None)
            seen.append((_name, kwargs))

        receivers[name] = receiver
        getattr(signals, name).connect(receiver, weak=False)
    yield seen
    flush()
    for name, receiver in receivers.items():
        getattr(signals, name).disconnect(receiver)


def test_acquired_and_released(app: Celery, sent: list[tuple[str, dict[str, Any]]]) -> None:
    """A run sends lock_acquired (with its token) then lock_released, for the same lock."""

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any) -> int:
        return int(self.lock.token)

    result = job.apply()
    # The release's answer is read after the task returns; the signal follows it.
    wait_for(lambda: len(sent) == 2, what="lock_released")
    names = [name for name, _ in sent]
    assert names == ["lock_acquired", "lock_released"]
    acquired, released = sent[0][1], sent[1][1]
    assert acquired["token"] == result.get()
    assert acquired["task_id"] == result.id
    assert acquired["name"] == released["name"] == job.lock_name((), {})
    assert acquired["waited"] == 0.0  # free at once
    assert released["held"] >= 0
    assert released["outcome"] == "released"


def test_acquired_after_a_wait_reports_how_long_it_waited(
    app: Celery, redislock_client: redis.Redis, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    """A task that waited for its lock reports the wait, from the moment it found the
    lock held to the moment it took it."""

    @app.task(base=SingletonTask, shared=False, on_conflict="wait", lock_wait=10)
    def job() -> None: ...

    holder = RedisLock(redislock_client, job.lock_name((), {}), ttl=30, lease="holder-id")
    assert holder.acquire()
    threading.Timer(0.3, holder.release).start()
    job.apply().get()
    acquired = [kw for name, kw in sent if name == "lock_acquired"]
    assert len(acquired) == 1
    assert acquired[0]["waited"] > 0


def test_released_reports_a_lost_lock(
    app: Celery,
    redislock_client: redis.Redis,
    sent: list[tuple[str, dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lock taken from the running task ends with lock_released outcome 'lost', and
    a WARNING that it was lost before the task ended."""

    @app.task(base=SingletonTask, bind=True, shared=False)
    def job(self: Any) -> None:
        key = f"redislock:{{{self.lock.name}}}"
        write_fields(redislock_client, key, **{OWNER_FIELD: "someone-else"})

    with caplog.at_level(logging.WARNING, logger="celery_redislock"):
        result = job.apply()
        wait_for(lambda: any(name == "lock_released" for name, _ in sent), what="lock_released")
    result.get()
    released = [kw for name, kw in sent if name == "lock_released"]
    assert [kw["outcome"] for kw in released] == ["lost"]
    name = job.lock_name((), {})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"lock {name} of {job.name}[{result.id}] was lost before the task ended" in warnings
    redislock_client.flushdb()


def test_released_reports_a_release_that_could_not_be_confirmed(
    app: Celery,
    redislock_server: RedisServer,
    redislock_client: redis.Redis,
    sent: list[tuple[str, dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A release whose answer never came (the reply lost with its connection) ends
    with lock_released outcome 'failed', and a WARNING that it could not be
    confirmed; it is sent again in the background, and the lock ends free."""
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        app.conf.redislock_url = proxy.url

        @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=3)
        def job(self: Any) -> str:
            # From now on every reply is lost; the release goes out as the body ends.
            proxy.drop_replies()
            return "done"

        with caplog.at_level(logging.WARNING, logger="celery_redislock"):
            result = job.apply()
            wait_for(lambda: any(name == "lock_released" for name, _ in sent), what="lock_released")
        proxy.heal()
        key = f"redislock:{{{job.lock_name((), {})}}}"
        wait_for(lambda: not held(redislock_client, key), what="the lock to be free")
        flush()
    assert result.get() == "done"
    released = [kw for name, kw in sent if name == "lock_released"]
    assert [(kw["task_id"], kw["outcome"]) for kw in released] == [(result.id, "failed")]
    name = job.lock_name((), {})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        f"could not confirm the release of lock {name} of {job.name}[{result.id}]; it is "
        "retried in the background, or expires by its TTL"
    ) in warnings


def test_conflict_names_holder_and_action(
    app: Celery, redislock_client: redis.Redis, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    """A skipped duplicate sends lock_conflict with the holder's task id and 'skip'."""

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    holder = RedisLock(redislock_client, job.lock_name((), {}), ttl=30, lease="holder-id")
    assert holder.acquire()
    job.apply()
    holder.release()
    assert sent == [
        (
            "lock_conflict",
            {
                "task_id": sent[0][1]["task_id"],
                "name": holder.name,
                "key": holder.name,
                "holder": "holder-id",
                "action": "skip",
            },
        )
    ]


def test_enqueue_dedup(
    app: Celery, redislock_client: redis.Redis, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    """An until_executed duplicate that publishes nothing sends lock_conflict 'dedup'."""

    @app.task(base=SingletonTask, shared=False, lock_strategy="until_executed")
    def job() -> None: ...

    holder = RedisLock(redislock_client, job.lock_name((), {}), ttl=30, lease="first-id")
    assert holder.acquire()
    assert job.delay().id == "first-id"
    holder.release()
    assert [(n, kw["action"], kw["holder"]) for n, kw in sent] == [
        ("lock_conflict", "dedup", "first-id")
    ]


def test_lost(
    app: Celery,
    redislock_client: redis.Redis,
    sent: list[tuple[str, dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A lock deleted under a running task sends lock_lost from the heartbeat, and is
    logged at WARNING."""

    @app.task(base=SingletonTask, bind=True, shared=False, lock_ttl=0.6)
    def job(self: Any) -> None:
        redislock_client.delete(f"redislock:{{{self.lock.name}}}")
        wait_for(lambda: self.lock.lost, what="the heartbeat to notice")

    with caplog.at_level(logging.WARNING, logger="celery_redislock"):
        result = job.apply()
        # Its release's signal comes once the answer is read: not during the next test.
        wait_for(lambda: any(n == "lock_released" for n, _ in sent), what="lock_released")
    result.get()
    lost = [kw for name, kw in sent if name == "lock_lost"]
    name = job.lock_name((), {})
    assert lost == [{"task_id": result.id, "name": name, "key": name}]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        f"lock {name} of task {job.name}[{result.id}] was lost while it ran; "
        "self.lock.check() will raise"
    ) in warnings


@pytest.mark.parametrize("store", ["url", "cluster client"])
@pytest.mark.parametrize("mode", ["fail", "run"])
def test_unavailable_reports_the_error_and_what_the_task_does(
    app: Celery, sent: list[tuple[str, dict[str, Any]]], mode: str, store: str
) -> None:
    """A lock store that cannot be reached sends lock_unavailable, with the error and
    what the task does about it: fail, or run without its lock; at execution, and
    from apply_async for a lock taken as the task is sent. A RedisCluster that a
    redislock_client callable cannot make (its nodes are away) is no different."""
    port = free_port()
    if store == "url":
        app.conf.redislock_url = f"redis://127.0.0.1:{port}/0"
    else:
        app.conf.redislock_client = lambda: RedisCluster(host="127.0.0.1", port=port)
    # Nothing to store the outcome in but the broker's server: keep it out of this.
    app.conf.task_store_eager_result = False

    @app.task(
        base=SingletonTask, shared=False, name=f"signals.down-{mode}", lock_on_redis_error=mode
    )
    def job() -> str:
        return "ran"

    @app.task(
        base=SingletonTask,
        shared=False,
        name="signals.down-sent",
        lock_strategy="until_executed",
        lock_on_redis_error="fail",
    )
    def sent_job() -> None: ...

    result = job.apply()
    assert [name for name, _ in sent] == ["lock_unavailable"]
    reported = sent[0][1]
    assert reported["action"] == mode
    assert reported["task_id"] == result.id
    assert reported["name"] == job.lock_name((), {})
    assert isinstance(reported["error"], LockBackendError)
    assert (result.get() == "ran") if mode == "run" else isinstance(result.result, LockBackendError)
    with pytest.raises(LockBackendError):
        sent_job.apply_async()
    assert [name for name, _ in sent] == ["lock_unavailable"] * 2
    assert sent[1][1]["action"] == "fail"
    assert sent[1][1]["name"] == sent_job.lock_name((), {})


def test_signals_send_the_name_under_both_spellings(
    app: Celery, redislock_client: redis.Redis, sent: list[tuple[str, dict[str, Any]]]
) -> None:
    """Every lock signal carries the lock name as ``name`` and as ``key`` (the older
    spelling), so a receiver written for either keeps working."""

    @app.task(base=SingletonTask, shared=False)
    def job() -> None: ...

    job.apply()
    holder = RedisLock(redislock_client, job.lock_name((), {}), ttl=30, lease="holder-id")
    assert holder.acquire()
    job.apply()
    holder.release()
    wait_for(lambda: len(sent) == 3, what="three signals")
    assert [name for name, _ in sent] == ["lock_acquired", "lock_released", "lock_conflict"]
    for _signal, kwargs in sent:
        assert kwargs["name"] == kwargs["key"] == job.lock_name((), {})


def test_signals_nobody_listens_to_are_not_sent(
    app: Celery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no receiver connected, a run does not even call a signal's ``send``
    (which builds its arguments and walks its receivers on every task)."""
    called: list[str] = []
    for name in signals.__all__:
        signal = getattr(signals, name)
        # Nobody listens here, whatever other tests left connected.
        monkeypatch.setattr(signal, "receivers", [])
        monkeypatch.setattr(signal, "send", lambda *a, _name=name, **k: called.append(_name))

    @app.task(base=SingletonTask, shared=False)
    def job() -> int:
        return 1

    assert job.apply().get() == 1
    flush()
    assert called == []


@pytest.mark.parametrize("subscribed", [False, True])
def test_a_waiting_duplicate_reports_its_conflict_once_and_asks_no_more_than_needed(
    app: Celery,
    redislock_client: redis.Redis,
    sent: list[tuple[str, dict[str, Any]]],
    subscribed: bool,
) -> None:
    """An ``on_conflict="wait"`` duplicate sends lock_conflict 'wait' (with the holder's
    task id) once, then gets the lock the holder's release hands it. It tries the lock
    twice before it waits (once, then to queue) — once, queueing at its first try, in
    a process whose wake-up subscription is in place already."""
    # A prefix of its own: the process's wake-up subscription is per prefix, and one
    # that earlier tests left in place would not go until it has been idle 30 s.
    prefix = f"conflict-once-{uuid.uuid4().hex}"

    @app.task(
        base=SingletonTask, shared=False, on_conflict="wait", lock_wait=30, lock_prefix=prefix
    )
    def job() -> str:
        return "ran"

    # (On the task's own client: the wake-up subscription is per connection pool, and
    # the one whose state counts is the task's.)
    holder = RedisLock(
        job.lock_client,
        job.lock_name((), {}),
        ttl=30,
        lease="holder-id",
        heartbeat=False,
        prefix=prefix,
    )
    assert holder.acquire()
    hub = wakeups.hub_for(holder.transport, holder.prefix)
    kept = hub.join() if subscribed else None
    wait_for(
        lambda: hub.subscribed == subscribed,
        timeout=wakeups.IDLE_EXIT + 5,
        what="the process's wake-up subscription",
    )
    redislock_client.config_resetstat()
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(job.apply().get()))
    thread.start()
    wait_for(lambda: redislock_client.zcard(holder.queue_key) == 1, what="the duplicate queued")
    evalsha = redislock_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
    assert evalsha == (1 if subscribed else 2)
    holder.release()
    thread.join(30)
    if kept is not None:
        hub.leave(kept)
    assert result == ["ran"]
    conflicts = [kw for name, kw in sent if name == "lock_conflict"]
    assert [(kw["action"], kw["holder"]) for kw in conflicts] == [("wait", "holder-id")]
    # (A release's answer, and its signal, can come late: an earlier test's too.)
    reported = [name for name, _ in sent if name != "lock_released"]
    assert reported == ["lock_conflict", "lock_acquired"]
