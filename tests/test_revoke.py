"""Revoking a queued ``until_*`` task frees its key at once (in-process threads-pool worker).

The ``celery worker`` subprocess (prefork) versions are in ``tests/test_workers.py``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import TaskRevokedError

from celery_redislock import RedisLock, SingletonTask
from celery_redislock.deployments import ClusterDeployment
from celery_redislock.dropped import (
    ALL_COPIES,
    REVOKED,
    drop_id,
    dropped_key,
    free_dropped,
    read_word,
)
from celery_redislock.revoke import RevokedLockRelease, find_and_free_queued
from celery_redislock.scripts import LEASE_FIELD, OWNER_FIELD, RELEASE_SCRIPT
from celery_redislock.server import RedisServer
from celery_redislock.task import queued_owner
from celery_redislock.transport import ATTEMPTS as RELEASE_TRIES
from celery_redislock.transport import Client
from tests.proxy import FaultProxy
from tests.support import (
    CELERY_5_7,
    client_left_clean,
    close_app,
    field,
    gate,
    held,
    in_process_worker,
    lock_keys,
    make_app,
    record,
    runs,
    scheduled_copies,
    wait_for,
    write_fields,
)

TIMEOUT = 20
#: A queue no worker consumes: a message sent there stays in the broker.
NOBODY = "revoke-nobody"
#: How long a freed key may take to show, generously (it takes a round trip or two).
FREED_WITHIN = 5.0


@pytest.fixture(scope="module")
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app with until_* singleton tasks, on the session server."""
    app = make_app(redislock_server.url, "revoke")

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="rv.once",
        lock_strategy="until_executed",
    )
    def once(self: Any, name: str) -> str:
        record("rv.once", (name, self.request.id))
        return str(self.request.id)

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="rv.hold",
        lock_strategy="until_executed",
    )
    def hold(self: Any, name: str) -> str:
        record("rv.hold", (name, self.request.id))
        gate(name).wait(TIMEOUT)
        return "done"

    app.tasks_ns = SimpleNamespace(once=once, hold=hold)
    yield app
    close_app(app)


@pytest.fixture(scope="module")
def tasks(app: Celery) -> SimpleNamespace:
    """The registered test tasks."""
    return app.tasks_ns  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def worker(app: Celery) -> Iterator[Any]:
    """A real worker (threads pool) consuming the app's default queue in this process."""
    with in_process_worker(app, concurrency=4) as worker:
        yield worker


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the lock database; every test must leave no lock behind."""
    with client_left_clean(redislock_server) as client:
        yield client


@pytest.fixture
def broker(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the broker database; the queue nobody consumes is emptied afterwards."""
    client = redis.Redis.from_url(redislock_server.url.rsplit("/", 1)[0] + "/1")
    yield client
    client.delete(NOBODY)
    client.close()


def unique(prefix: str) -> str:
    """A name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def lock_key(task: Any, *args: Any) -> str:
    """The Redis key of ``task``'s lock for a call with ``args``."""
    return f"redislock:{{{task.lock_name(args, {})}}}"


def ran(kind: str, task_id: str) -> bool:
    """Whether an execution recorded ``task_id``."""
    return any(recorded_id == task_id for _name, recorded_id in runs(kind))


def scheduled_here(task_id: str) -> bool:
    """Whether this process's worker holds ``task_id``, waiting for its countdown."""
    return scheduled_copies(task_id) > 0


def assert_ran_on(result: Any, revoked_by_id: bool) -> None:
    """``result`` is of a task revoked as it ran (by its id, or by its stamps), which
    ran on and returned ``"done"``. Celery before 5.7 stores a task revoked by its id
    as revoked at the revoke, though it runs on, and its success over that as it
    ends: its caller reads either, whichever it finds first. There, it is only
    checked to have run."""
    if revoked_by_id and not CELERY_5_7:
        outcome = result.get(timeout=TIMEOUT, propagate=False)
        assert outcome == "done" or isinstance(outcome, TaskRevokedError)
        assert ran("rv.hold", result.id)
        wait_for(
            lambda: result.backend.get_task_meta(result.id)["status"] == "SUCCESS",
            what="its success to be stored",
        )
        return
    assert result.get(timeout=TIMEOUT) == "done"


def revoke_by_result(app: Celery, result: Any) -> None:
    """Revoke through ``AsyncResult.revoke()``."""
    result.revoke()


def revoke_by_control(app: Celery, result: Any) -> None:
    """Revoke through ``app.control.revoke(id)``."""
    app.control.revoke(result.id)


def revoke_by_terminate_command(app: Celery, result: Any) -> None:
    """Revoke through the ``terminate`` control command (``celery control terminate``),
    which Celery handles apart from ``revoke``."""
    app.control.broadcast("terminate", arguments={"signal": "SIGTERM", "task_id": result.id})


REVOKES = [revoke_by_result, revoke_by_control, revoke_by_terminate_command]
REVOKE_IDS = ["AsyncResult.revoke", "app.control.revoke", "celery control terminate"]


def test_singleton_task_adds_the_consumer_step(app: Celery) -> None:
    """Binding a SingletonTask to an app (when it finalizes) adds the revoke bootstep to its consumer."""
    app.finalize()
    assert RevokedLockRelease in app.steps["consumer"]


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("revoke", REVOKES, ids=REVOKE_IDS)
def test_countdown_task_revoked_frees_key(
    app: Celery,
    tasks: SimpleNamespace,
    locks: redis.Redis,
    revoke: Callable[[Celery, Any], None],
) -> None:
    """A countdown task revoked while the worker holds it frees its key; a resend gets a new id and runs."""
    name = unique("countdown")
    key = lock_key(tasks.once, name)
    first = tasks.once.apply_async((name,), countdown=60)
    assert held(locks, key)
    wait_for(lambda: scheduled_here(first.id), what="the worker to schedule the countdown")
    revoke(app, first)
    wait_for(lambda: not held(locks, key), timeout=FREED_WITHIN, what="the key to be freed")
    again = tasks.once.delay(name)
    assert again.id != first.id
    assert again.get(timeout=TIMEOUT) == again.id
    assert not ran("rv.once", first.id)


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("revoke", REVOKES, ids=REVOKE_IDS)
def test_message_in_broker_revoked_frees_key(
    app: Celery,
    tasks: SimpleNamespace,
    locks: redis.Redis,
    broker: redis.Redis,
    revoke: Callable[[Celery, Any], None],
) -> None:
    """A message no worker has fetched, revoked, frees its key (found by its lease); a resend runs."""
    name = unique("broker")
    key = lock_key(tasks.once, name)
    first = tasks.once.apply_async((name,), queue=NOBODY)
    assert broker.llen(NOBODY) == 1
    assert held(locks, key)
    revoke(app, first)
    wait_for(lambda: not held(locks, key), timeout=FREED_WITHIN, what="the key to be freed")
    again = tasks.once.delay(name)
    assert again.id != first.id
    assert again.get(timeout=TIMEOUT) == again.id
    assert broker.llen(NOBODY) == 1


@pytest.mark.usefixtures("worker")
def test_revoking_a_running_task_keeps_its_lock(
    app: Celery, tasks: SimpleNamespace, locks: redis.Redis, broker: redis.Redis
) -> None:
    """A revoke without terminate leaves a running task's lock alone: Celery lets the task finish."""
    name = unique("running")
    key = lock_key(tasks.hold, name)
    running = tasks.hold.delay(name)
    wait_for(lambda: ran("rv.hold", running.id), what="the task to start")
    markers = [unique("marker"), unique("marker")]
    sent = [tasks.once.apply_async((marker,), queue=NOBODY) for marker in markers]
    app.control.revoke([running.id, sent[0].id])
    wait_for(lambda: not held(locks, lock_key(tasks.once, markers[0])), timeout=FREED_WITHIN)
    # Revokes are handled in order: once the next one is done, so is the first.
    app.control.revoke(sent[1].id)
    wait_for(lambda: not held(locks, lock_key(tasks.once, markers[1])), timeout=FREED_WITHIN)
    assert held(locks, key)
    assert tasks.hold.delay(name).id == running.id
    if not CELERY_5_7:
        # Stored as revoked at the revoke, though it runs on (see assert_ran_on).
        assert app.backend.get_task_meta(running.id)["status"] == "REVOKED"
    gate(name).set()
    assert_ran_on(running, revoked_by_id=True)


@pytest.mark.usefixtures("worker")
def test_a_retry_revoked_while_it_waits_in_the_worker_frees_its_reservation(
    app: Celery, tasks: SimpleNamespace, locks: redis.Redis
) -> None:
    """A retry's reservation names its retry count: revoked while the worker holds it
    (waiting for its countdown), the retry's key is freed all the same."""
    name = unique("retry")
    key = lock_key(tasks.once, name)
    retry = tasks.once.apply_async((name,), retries=1, countdown=60)
    assert field(locks, key, OWNER_FIELD) == queued_owner(retry.id, 1)
    wait_for(lambda: scheduled_here(retry.id), what="the worker to hold the retry")
    app.control.revoke(retry.id)
    wait_for(lambda: not held(locks, key), timeout=FREED_WITHIN, what="the key to be freed")
    again = tasks.once.delay(name)
    assert again.id != retry.id
    assert again.get(timeout=TIMEOUT) == again.id
    assert not ran("rv.once", retry.id)


def revoke_handed_by_id(app: Celery, result: Any, _value: str) -> None:
    """``app.control.revoke(id)``."""
    app.control.revoke(result.id)


def revoke_handed_by_stamp(app: Celery, _result: Any, value: str) -> None:
    """``app.control.revoke_by_stamped_headers()``."""
    app.control.revoke_by_stamped_headers({"batch": value})


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(
    "revoke", [revoke_handed_by_id, revoke_handed_by_stamp], ids=["by id", "by stamp"]
)
@pytest.mark.parametrize("pool_handle", [True, False], ids=["pool handle", "no pool handle"])
def test_a_task_revoked_once_handed_to_the_pool_keeps_its_reservation(
    app: Celery,
    tasks: SimpleNamespace,
    locks: redis.Redis,
    worker: Any,
    monkeypatch: pytest.MonkeyPatch,
    revoke: Callable[[Celery, Any, str], None],
    pool_handle: bool,
) -> None:
    """The threads pool queues the tasks it was handed that no thread is free for,
    and runs them whatever is revoked later (Celery looks once, as it hands a task
    over): revoked there, a task keeps its reservation, a ``delay()`` with the same
    arguments is deduplicated to it, and it runs. The same with a pool that gives
    Celery no handle of the task (as the eventlet pool)."""
    pool = worker.pool
    if not pool_handle:
        hand_over = pool.on_apply

        def without_handle(*args: Any, **kwargs: Any) -> None:
            hand_over(*args, **kwargs)

        monkeypatch.setattr(pool, "on_apply", without_handle)
    busy = [unique("busy") for _ in range(4)]
    running = [tasks.hold.delay(busy_name) for busy_name in busy]
    wait_for(lambda: all(ran("rv.hold", r.id) for r in running), what="the slots to fill")
    value, name = unique("batch"), unique("handed")
    key = lock_key(tasks.once, name)
    sent = tasks.once.s(name).stamp(batch=value).apply_async()
    wait_for(lambda: pool.executor._work_queue.qsize() == 1, what="the pool to queue the task")
    revoke(app, sent, value)
    # Revokes are handled in order: once the next one is done, so is the first.
    marker_name = unique("marker")
    marker = tasks.once.apply_async((marker_name,), queue=NOBODY)
    app.control.revoke(marker.id)
    wait_for(
        lambda: not held(locks, lock_key(tasks.once, marker_name)),
        timeout=FREED_WITHIN,
        what="the revokes to be handled",
    )
    assert field(locks, key, OWNER_FIELD) == queued_owner(sent.id)
    assert tasks.once.delay(name).id == sent.id
    for busy_name in busy:
        gate(busy_name).set()
    assert [r.get(timeout=TIMEOUT) for r in running] == ["done"] * 4
    wait_for(lambda: ran("rv.once", sent.id), what="the task handed to the pool to run")
    assert [run_id for run_name, run_id in runs("rv.once") if run_name == name] == [sent.id]


def _queued(
    client: Client, name: str, task_id: str, prefix: str = "redislock", retries: int = 0
) -> RedisLock:
    """Take lock ``name`` the way ``apply_async`` does for the message of ``task_id``
    (``retries``: sent as that retry)."""
    lock = RedisLock(
        client,
        name,
        ttl=60,
        owner=queued_owner(task_id, retries),
        lease=task_id,
        heartbeat=False,
        prefix=prefix,
    )
    assert lock.acquire(blocking=False)
    return lock


def test_search_frees_only_locks_still_owned_by_the_message(
    locks: redis.Redis,
) -> None:
    """The search by lease frees a lock its message still owns, never one an execution took over."""
    _queued(locks, "t.job:queued", "id-queued")
    running = RedisLock(locks, "t.job:running", ttl=60, owner="id-running:1a2b", lease="id-running")
    assert running.acquire(blocking=False)
    wanted = {"id-queued", "id-running", "id-unknown"}
    find_and_free_queued(locks, "redislock", wanted)
    assert wanted == {"id-unknown"}
    assert lock_keys(locks) == ["redislock:{t.job:running}"]
    running.release()
    # (Word that its next retry is revoked: see the tests below.)
    for retries in (0, 1):
        locks.delete(dropped_key("t.job:running", "id-running", retries, "redislock"))


def test_search_leaves_an_execution_it_finds_word_that_its_retry_is_revoked(
    locks: redis.Redis,
) -> None:
    """An execution of a revoked id that holds its lock keeps it, but may have sent its
    retry with ``self.retry(throw=False)``, which sits in the broker: the search
    leaves word, tied to the execution's hold, that every copy of its next retry is
    revoked, so that it frees the lock as it ends. Left again (by another worker),
    the word reads the same."""
    name, task_id = "t.job:sender", "id-sender"
    sender = RedisLock(locks, name, ttl=60, owner="sendertoken:1", lease=task_id)
    assert sender.acquire(blocking=False)
    try:
        for _ in range(2):
            wanted = {task_id}
            find_and_free_queued(locks, "redislock", wanted)
            assert wanted == set()
            assert sender.owned()
            word = read_word(locks, name, task_id, 2, "redislock")
            assert word is not None
            assert (word.fence, word.then, word.drops) == (sender.token, 0, ALL_COPIES)
            assert word.text == f"{sender.token} 0 0 {REVOKED}"
    finally:
        sender.release()
        for retries in (0, 2):
            locks.delete(dropped_key(name, task_id, retries, "redislock"))


def test_search_leaves_an_execution_it_finds_word_that_a_send_of_its_own_id_is_revoked(
    locks: redis.Redis,
) -> None:
    """An execution of a revoked id that holds its lock may have sent its own task id
    again without a retry count (``self.replace()``, ``apply_async(task_id=...)``),
    the message sitting in the broker: the search leaves word about that message
    too (under retry count 0), tied to the execution's hold, so that it frees the
    lock as it ends. Should the hold have moved to that message's reservation by the
    time the word is left, the search frees the reservation (the message is
    revoked)."""
    name, task_id = "t.job:replaced", "id-replaced"
    sender = RedisLock(locks, name, ttl=60, owner="sendertoken:3", lease=task_id)
    assert sender.acquire(blocking=False)
    try:
        wanted = {task_id}
        find_and_free_queued(locks, "redislock", wanted)
        assert wanted == set()
        assert sender.owned()
        word = read_word(locks, name, task_id, 0, "redislock")
        assert word is not None
        assert (word.fence, word.then, word.drops) == (sender.token, 0, ALL_COPIES)
    finally:
        sender.release()
        for retries in (0, 4):
            locks.delete(dropped_key(name, task_id, retries, "redislock"))


def test_word_about_a_send_of_its_own_id_is_left_only_for_the_hold_that_sent_it(
    locks: redis.Redis,
) -> None:
    """A message without a retry count that ended without running leaves word only
    for the execution its header ``redislock_sender`` names, tied to that hold's
    fencing token: not for another execution of the same task id that holds the lock
    (a later use of the id), nor when it names no sender (a first delivery, whose
    reservation nobody hands a hold to). Once the sender has handed its hold to the
    message's reservation, the delivery frees the reservation itself."""
    name, task_id, prefix = "t.job:own-id", "id-own", "redislock"
    sender = RedisLock(locks, name, ttl=60, owner="sender-token", lease=task_id)
    assert sender.acquire(blocking=False)
    try:
        for other in (None, "", "another-token"):
            assert not free_dropped(locks, name, task_id, prefix, 0, 60.0, None, other)
            assert read_word(locks, name, task_id, 0, prefix) is None
        assert not free_dropped(locks, name, task_id, prefix, 0, 60.0, "drop-1", sender.owner)
        assert sender.owned()
        word = read_word(locks, name, task_id, 0, prefix)
        assert word is not None
        assert (word.fence, word.then, word.drops) == (sender.token, 0, 1)
    finally:
        sender.release()
        locks.delete(dropped_key(name, task_id, 0, prefix))
    reservation = _queued(locks, name, task_id)
    assert free_dropped(locks, name, task_id, prefix, 0, 60.0, "drop-2", sender.owner)
    assert not reservation.owned()
    assert read_word(locks, name, task_id, 0, prefix) is None


def test_a_delivery_dropped_again_is_counted_once(locks: redis.Redis) -> None:
    """A retry's delivery that a revoke sweep (by its stamps) already reported
    dropped to the execution that sent it, and that the worker drops once more as
    its ETA comes, names itself the same both times: counted once, so that a copy of
    the retry still on its way keeps the lock reserved."""
    name, task_id = "t.job:twice", "id-twice"
    sender = RedisLock(locks, name, ttl=60, owner="sendertoken:0", lease=task_id)
    assert sender.acquire(blocking=False)
    request = SimpleNamespace(id=task_id)
    try:
        for _ in range(2):
            free_dropped(locks, name, task_id, "redislock", 1, 60.0, drop_id(request))
        word = read_word(locks, name, task_id, 1, "redislock")
        assert word is not None
        assert word.drops == 1
        free_dropped(locks, name, task_id, "redislock", 1, 60.0, drop_id(SimpleNamespace()))
        word = read_word(locks, name, task_id, 1, "redislock")
        assert word is not None
        assert word.drops == 2
    finally:
        sender.release()
        locks.delete(dropped_key(name, task_id, 1, "redislock"))


def test_search_frees_every_lock_it_finds_when_one_cannot_be_freed(
    redislock_server: RedisServer, locks: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock the search finds that it cannot free (every answer to its release lost,
    though the release ran) is logged, and the search goes on: the other revoked
    ids' reservations are freed all the same, not left until lock_enqueue_ttl."""
    names = [unique("t.job:lost") for _ in range(3)]
    ids = [unique("id-lost") for _ in names]
    for name, task_id in zip(names, ids, strict=True):
        _queued(locks, name, task_id)
    caplog.set_level(logging.WARNING, logger="celery_redislock")
    with FaultProxy(redislock_server.host, redislock_server.port) as proxy:
        client = redis.Redis.from_url(proxy.url, socket_timeout=5, socket_connect_timeout=5)
        try:
            # Every try of the first release the search makes: its answer is lost.
            proxy.drop_reply_to(RELEASE_SCRIPT.sha.encode(), count=RELEASE_TRIES)
            wanted = set(ids)
            find_and_free_queued(client, "redislock", wanted)
        finally:
            client.close()
        assert proxy.marked_drops == RELEASE_TRIES
    assert wanted == set()
    assert lock_keys(locks) == []
    assert "could not free lock" in caplog.text


def test_search_frees_a_retrys_reservation(locks: redis.Redis) -> None:
    """A retry's reservation (which names its retry count) is the message's too: the
    search frees it."""
    _queued(locks, "t.job:retried", "id-retried", retries=2)
    wanted = {"id-retried"}
    find_and_free_queued(locks, "redislock", wanted)
    assert wanted == set()
    assert lock_keys(locks) == []


def test_search_takes_the_prefix_literally(locks: redis.Redis) -> None:
    """A prefix with glob characters matches only itself, and a name needing escaping is found."""
    _queued(locks, "}odd", "id-odd", prefix="we*rd[1]")
    _queued(locks, "plain", "id-other", prefix="weXrd1")
    wanted = {"id-odd", "id-other"}
    find_and_free_queued(locks, "we*rd[1]", wanted)
    assert wanted == {"id-other"}
    assert not held(locks, "we*rd[1]:{\\}odd}")
    assert held(locks, "weXrd1:{plain}")
    locks.delete("weXrd1:{plain}")


def test_search_is_bounded(
    locks: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The search gives up after MAX_SCAN_CALLS SCAN calls, logging which ids it did not find."""
    keys = [f"bounded:{{t.job:{n}}}" for n in range(50)]
    for n, key in enumerate(keys):
        write_fields(locks, key, **{LEASE_FIELD: f"other-{n}", OWNER_FIELD: "x"})
    caplog.set_level(logging.WARNING, logger="celery_redislock")
    monkeypatch.setattr("celery_redislock.revoke.SCAN_COUNT", 1)
    monkeypatch.setattr("celery_redislock.revoke.MAX_SCAN_CALLS", 2)
    wanted = {"id-missing"}
    find_and_free_queued(locks, "bounded", wanted)
    locks.delete(*keys)
    assert wanted == {"id-missing"}
    assert "gave up" in caplog.text
    assert "id-missing" in caplog.text


def test_search_scans_every_primary_of_a_cluster(
    redislock_cluster: ClusterDeployment, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a Redis Cluster, the search scans each primary with a cursor of its own: a
    queued lock is found behind many other keys, on whichever primary holds it."""
    client = redislock_cluster.client()
    others = [f"crowd:{n}" for n in range(300)]
    for key in others:
        client.set(key, "x")
    lock = _queued(client, f"t.job:{uuid.uuid4().hex}", "id-clustered")
    monkeypatch.setattr("celery_redislock.revoke.SCAN_COUNT", 5)
    wanted = {"id-clustered", "id-unknown"}
    find_and_free_queued(client, "redislock", wanted)
    assert wanted == {"id-unknown"}
    assert not lock.locked()
    for key in others:
        client.delete(key)
    client.close()


@pytest.mark.usefixtures("worker")
def test_revoking_a_copy_waiting_for_its_eta_leaves_the_running_delivery_its_lock(
    app: Celery, tasks: SimpleNamespace, locks: redis.Redis
) -> None:
    """A copy of a message (a Redis broker delivers an ETA message again once its
    visibility timeout passes) waits for its ETA in this worker while another delivery
    of it runs elsewhere, holding the lock under an owner of its own. Revoking the
    task (without terminate, which Celery lets the running delivery finish) frees
    only what still waits for the message, not the running delivery's hold."""
    name = unique("copy")
    task_id = str(uuid.uuid4())
    # The delivery running on another worker: an execution's hold (lease: the task id).
    running = RedisLock(locks, tasks.once.lock_name((name,), {}), ttl=30, lease=task_id)
    assert running.acquire(blocking=False)
    try:
        app.send_task("rv.once", args=(name,), task_id=task_id, countdown=60)
        wait_for(lambda: scheduled_here(task_id), what="the worker to schedule the copy")
        # A revoke of another id, sent after it, tells when this one was handled.
        marker_name = unique("marker")
        marker = tasks.once.apply_async((marker_name,), queue=NOBODY)
        app.control.revoke(task_id)
        app.control.revoke(marker.id)
        wait_for(
            lambda: not held(locks, lock_key(tasks.once, marker_name)),
            timeout=FREED_WITHIN,
            what="the revokes to be handled",
        )
        assert running.owned()
        assert not running.lost
    finally:
        if running.owned():
            running.release()


@pytest.mark.usefixtures("worker")
def test_a_revoked_copy_dropped_at_its_eta_leaves_the_running_delivery_its_lock(
    app: Celery, tasks: SimpleNamespace, locks: redis.Redis
) -> None:
    """The worker drops a revoked copy of a message when its ETA comes (``task_revoked``,
    not terminated): that frees what still waits for the message, never the hold of
    another delivery of it that runs."""
    from celery.signals import task_revoked

    name = unique("copy-eta")
    task_id = str(uuid.uuid4())
    dropped: list[str] = []

    def seen(request: Any = None, **_: Any) -> None:
        dropped.append(request.id)

    # Connected after celery_redislock's own receiver, so called after it.
    task_revoked.connect(seen, weak=False)
    running = RedisLock(locks, tasks.once.lock_name((name,), {}), ttl=30, lease=task_id)
    assert running.acquire(blocking=False)
    try:
        app.control.revoke(task_id)
        app.send_task("rv.once", args=(name,), task_id=task_id, countdown=0.5)
        wait_for(lambda: task_id in dropped, what="the worker to drop the revoked copy")
        assert running.owned()
        assert not running.lost
    finally:
        task_revoked.disconnect(seen)
        if running.owned():
            running.release()


#: Ways to revoke by stamps, as (the stamp the matching message carries, the
#: ``revoke_by_stamped_headers`` arguments for stamp ``value``, under header ``batch``).
STAMP_REVOKES: list[tuple[Callable[[str], Any], Callable[[str], dict[str, Any]]]] = [
    (lambda value: value, lambda value: {"headers": {"batch": value}}),
    # A stamp with several values (``append_stamps``) matches one of a list.
    (
        lambda value: ["first", value],
        lambda value: {"headers": {"batch": [f"{value}-other", value]}},
    ),
    # ``celery control revoke_by_stamped_headers batch=<value>`` sends a list.
    (lambda value: value, lambda value: {"headers": [f"batch={value}"]}),
    (
        lambda value: value,
        lambda value: {"headers": {"batch": value}, "terminate": True, "signal": "SIGTERM"},
    ),
]
STAMP_REVOKE_IDS = ["one value", "several values", "header list", "terminate"]


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize(("stamp", "arguments"), STAMP_REVOKES, ids=STAMP_REVOKE_IDS)
def test_countdown_task_revoked_by_its_stamp_frees_key(
    app: Celery,
    tasks: SimpleNamespace,
    locks: redis.Redis,
    broker: redis.Redis,
    stamp: Callable[[str], Any],
    arguments: Callable[[str], dict[str, Any]],
) -> None:
    """A countdown task the worker holds, revoked by a stamp it carries
    (``revoke_by_stamped_headers``), frees its key; a resend gets a new id and runs.
    Held messages whose stamps do not match keep theirs, and so does a matching
    message still in the broker (the lock does not know its stamps)."""
    value = unique("batch")
    name, other_value, other_header, in_broker = (
        unique(kind) for kind in ("stamped", "v", "h", "b")
    )
    sent = {
        name: tasks.once.s(name).stamp(batch=stamp(value)).apply_async(countdown=60),
        other_value: tasks.once.s(other_value).stamp(batch=other_value).apply_async(countdown=60),
        other_header: tasks.once.s(other_header).stamp(lot=value).apply_async(countdown=60),
        in_broker: tasks.once.s(in_broker).stamp(batch=value).apply_async(queue=NOBODY),
    }
    countdowns = [sent[held_name].id for held_name in (name, other_value, other_header)]
    wait_for(
        lambda: all(scheduled_here(task_id) for task_id in countdowns),
        what="the worker to schedule the countdowns",
    )
    marker_name = unique("marker")
    marker = tasks.once.apply_async((marker_name,), queue=NOBODY)
    app.control.broadcast("revoke_by_stamped_headers", arguments=arguments(value))
    # Revokes are handled in order: once the next one is done, so is the first.
    app.control.revoke(marker.id)
    wait_for(
        lambda: not held(locks, lock_key(tasks.once, marker_name)),
        timeout=FREED_WITHIN,
        what="the revokes to be handled",
    )
    assert not held(locks, lock_key(tasks.once, name))
    kept = [other_value, other_header, in_broker]
    assert all(held(locks, lock_key(tasks.once, kept_name)) for kept_name in kept)
    again = tasks.once.delay(name)
    assert again.id != sent[name].id
    assert again.get(timeout=TIMEOUT) == again.id
    assert not ran("rv.once", sent[name].id)
    app.control.revoke([sent[kept_name].id for kept_name in kept])
    kept_keys = [lock_key(tasks.once, kept_name) for kept_name in kept]
    wait_for(lambda: not any(held(locks, key) for key in kept_keys), timeout=FREED_WITHIN)


def terminate_by_id(app: Celery, running: Any, waiting: Any, _value: str) -> None:
    """``app.control.revoke([ids], terminate=True)``."""
    app.control.revoke([running.id, waiting.id], terminate=True, signal="SIGTERM")


def terminate_by_stamp(app: Celery, _running: Any, _waiting: Any, value: str) -> None:
    """``app.control.revoke_by_stamped_headers(headers, terminate=True)``."""
    app.control.revoke_by_stamped_headers({"batch": value}, terminate=True, signal="SIGTERM")


@pytest.mark.usefixtures("worker")
@pytest.mark.parametrize("terminate", [terminate_by_id, terminate_by_stamp], ids=["id", "stamp"])
def test_a_terminate_the_pool_cannot_carry_out_frees_the_waiting_task_all_the_same(
    app: Celery,
    tasks: SimpleNamespace,
    locks: redis.Redis,
    broker: redis.Redis,
    terminate: Callable[[Celery, Any, Any, str], None],
) -> None:
    """A revoke with ``terminate`` that reaches a running task and one waiting for its
    countdown: the threads pool cannot signal the running task (Celery's handler
    fails, having recorded the revoke), which runs on and keeps its lock until it
    ends; the waiting task's key is freed all the same."""
    value = unique("batch")
    running_name, waiting_name = unique("running"), unique("waiting")
    running = tasks.hold.s(running_name).stamp(batch=value).apply_async()
    waiting = tasks.once.s(waiting_name).stamp(batch=value).apply_async(countdown=60)
    wait_for(lambda: ran("rv.hold", running.id), what="the task to start")
    wait_for(lambda: scheduled_here(waiting.id), what="the worker to schedule the countdown")
    marker_name = unique("marker")
    marker = tasks.once.apply_async((marker_name,), queue=NOBODY)
    terminate(app, running, waiting, value)
    # Revokes are handled in order: once the next one is done, so is the first.
    app.control.revoke(marker.id)
    wait_for(
        lambda: not held(locks, lock_key(tasks.once, marker_name)),
        timeout=FREED_WITHIN,
        what="the revokes to be handled",
    )
    assert not held(locks, lock_key(tasks.once, waiting_name))
    assert held(locks, lock_key(tasks.hold, running_name))
    gate(running_name).set()
    assert_ran_on(running, revoked_by_id=terminate is terminate_by_id)
    again = tasks.once.delay(waiting_name)
    assert again.id != waiting.id
    assert again.get(timeout=TIMEOUT) == again.id


@pytest.mark.usefixtures("worker")
def test_a_message_revoked_by_its_stamp_before_a_worker_held_it_frees_its_key_when_dropped(
    app: Celery, tasks: SimpleNamespace, locks: redis.Redis
) -> None:
    """A message revoked by its stamps before it reached the worker (the sweep cannot
    match it: the lock does not store stamps) keeps its key until the worker drops
    it at its ETA, which frees it."""
    value, name = unique("batch"), unique("late")
    replies = app.control.revoke_by_stamped_headers(
        {"batch": value}, reply=True, limit=1, timeout=TIMEOUT
    )
    assert replies
    result = tasks.once.s(name).stamp(batch=value).apply_async(countdown=0.5)
    wait_for(lambda: result.state == "REVOKED", what="the worker to drop the message")
    wait_for(lambda: not held(locks, lock_key(tasks.once, name)), timeout=FREED_WITHIN)
    assert not ran("rv.once", result.id)
