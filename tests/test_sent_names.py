"""The name an ``until_*`` send reserves is the one its execution derives, however
the call is encoded: with a serializer of its own, or a ``pydantic=True`` task's
models, which Celery sends as dicts; and the one its execution takes when the
worker would derive another (the name travels in the message's headers) (real
Redis, a real in-process worker)."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator
from decimal import Decimal
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery, Task
from celery.result import AsyncResult
from celery.worker import state as worker_state

from celery_redislock import KeyDerivationError, SingletonTask
from celery_redislock.reservations import queued_owner
from celery_redislock.server import RedisServer
from celery_redislock.task import _NAME_HEADER
from celery_redislock.testing import hold_lock
from tests.support import (
    client_left_clean,
    close_app,
    gate,
    in_process_worker,
    lock_keys,
    make_app,
    record,
    runs,
    scheduled_copies,
    wait_for,
)

TIMEOUT = 20
#: Ample for a finished execution to free its lock; a stranded one keeps it an hour.
FREED = 5

try:
    from pydantic import BaseModel
except ImportError:  # pragma: no cover - pydantic is in the dev extra
    BaseModel = None  # type: ignore[assignment,misc]

#: Whether this Celery dumps a ``pydantic=True`` task's models as it sends them.
DUMPS_MODELS = BaseModel is not None and hasattr(Task, "_dump_pydantic_arguments")


class Region(str, enum.Enum):
    """JSON delivers a member as its value; pickle as the member itself."""

    EU = "eu"


if BaseModel is not None:

    class Order(BaseModel):
        """A model a ``pydantic=True`` task takes."""

        id: int


#: The version of the key derivation of each call (by its item) that ``versioned_key``
#: runs as: a test changes it between a send and its execution, as a deploy
#: changes it between a producer and a worker.
VERSIONS: dict[str, str] = {}


def versioned_key(item: str, **_: Any) -> str:
    """Key material that depends on the version this process runs as."""
    version = VERSIONS.get(item, "v1")
    if version == "broken":
        raise RuntimeError("this version cannot name the call")
    return f"{version}:{item}"


def define_tasks(app: Celery) -> SimpleNamespace:
    """The tasks the worker runs (registered before it starts)."""

    def by_region(serializer: str) -> Any:
        @app.task(
            base=SingletonTask,
            shared=False,
            name=f"names.by_region_{serializer}",
            serializer=serializer,
            lock_strategy="until_executed",
            lock_key=lambda region, tag: f"{tag}:{region}",
        )
        def sync(region: Any, tag: str) -> str:
            """Sample body."""
            record("by_region", (tag, repr(region)))
            return tag

        return sync

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="names.versioned",
        lock_strategy="until_executed",
        lock_key=versioned_key,
    )
    def versioned(self: Any, item: str) -> str:
        """Records the lock it runs under and the name its message carried."""
        record("versioned", (item, self.lock.name, getattr(self.request, _NAME_HEADER, None)))
        return item

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="names.versioned_retry",
        lock_strategy="until_executed",
        lock_key=versioned_key,
    )
    def versioned_retry(self: Any, item: str) -> str:
        """Sends one retry of itself; records the lock each execution runs under."""
        record("versioned_retry", (item, self.request.retries, self.lock.name))
        if not self.request.retries:
            raise self.retry(countdown=0)
        return item

    @app.task(
        base=SingletonTask,
        shared=False,
        name="names.versioned_early",
        lock_strategy="until_executing",
        lock_key=versioned_key,
    )
    def versioned_early(item: str) -> str:
        """Held at its gate once it has started."""
        record("versioned_early", item)
        gate(item).wait(TIMEOUT)
        return item

    @app.task(
        base=SingletonTask,
        shared=False,
        name="names.versioned_held",
        lock_strategy="until_executed",
        lock_key=versioned_key,
    )
    def versioned_held(item: str) -> str:
        """Held at its gate once it has started."""
        record("versioned_held", item)
        gate(item).wait(TIMEOUT)
        return item

    class FailsToStart(SingletonTask):
        """Its ``before_start`` raises: the task is never called."""

        def before_start(self, task_id: str, args: Any, kwargs: Any) -> None:
            raise RuntimeError("start failed")

    def fails_to_start(strategy: str) -> Any:
        @app.task(
            base=FailsToStart,
            shared=False,
            name=f"names.fails_to_start_{strategy}",
            lock_strategy=strategy,
            lock_key=versioned_key,
        )
        def fails(item: str) -> str:
            """Never called."""
            record("fails_to_start", item)
            return item

        return fails

    tasks = SimpleNamespace(
        by_region={s: by_region(s) for s in ("json", "pickle")},
        versioned=versioned,
        versioned_retry=versioned_retry,
        versioned_early=versioned_early,
        versioned_held=versioned_held,
        fails_to_start={s: fails_to_start(s) for s in ("until_executed", "until_executing")},
    )
    if DUMPS_MODELS:

        @app.task(
            base=SingletonTask,
            shared=False,
            name="names.ship",
            pydantic=True,
            lock_strategy="until_executed",
        )
        def ship(order: Order, tag: str) -> int:
            """Held at its gate: a second send meanwhile is a duplicate."""
            gate(tag).wait(TIMEOUT)
            record("ship", tag)
            return order.id

        @app.task(
            base=SingletonTask,
            shared=False,
            name="names.ship_by_item",
            pydantic=True,
            lock_strategy="until_executed",
            lock_key=lambda order, **_: order["id"],
        )
        def ship_by_item(order: Order, tag: str) -> int:
            """Keyed on the dict the worker receives."""
            gate(tag).wait(TIMEOUT)
            record("ship_by_item", tag)
            return order.id

        @app.task(
            base=SingletonTask,
            shared=False,
            name="names.ship_by_attribute",
            pydantic=True,
            lock_strategy="until_executed",
            lock_key=lambda order, **_: order.id,
        )
        def ship_by_attribute(order: Order, tag: str) -> int:
            """Keyed on the model, which only a pickled message delivers."""
            record("ship_by_attribute", tag)
            return order.id

        tasks.ship, tasks.ship_by_item = ship, ship_by_item
        tasks.ship_by_attribute = ship_by_attribute
    return tasks


@pytest.fixture(scope="module")
def app(redislock_server: RedisServer) -> Iterator[Celery]:
    """An app taking JSON and pickled messages, with the test tasks registered."""
    app = make_app(redislock_server.url, "names")
    app.conf.accept_content = ["json", "pickle"]
    app.tasks_ns = define_tasks(app)
    yield app
    close_app(app)


@pytest.fixture(scope="module")
def tasks(app: Celery) -> Iterator[SimpleNamespace]:
    """The registered test tasks, with a real worker (threads pool) running them."""
    with in_process_worker(app, concurrency=2):
        yield app.tasks_ns


@pytest.fixture
def locks(redislock_server: RedisServer) -> Iterator[redis.Redis]:
    """A client to the lock database; every test must leave no lock held."""
    with client_left_clean(redislock_server) as client:
        yield client


def unique(prefix: str) -> str:
    """A name no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.mark.parametrize(
    ("task_serializer", "call_serializer"), [("pickle", "json"), ("json", "pickle")]
)
def test_a_call_sent_with_its_own_serializer_reserves_the_name_it_runs_under(
    tasks: SimpleNamespace, locks: redis.Redis, task_serializer: str, call_serializer: str
) -> None:
    """A ``lock_key`` callable sees a call as the serializer it is sent with
    delivers it (a ``str`` Enum member as its value under JSON), then through the
    task's own, as the worker does: the execution frees the reservation its send
    made, and the next send is not a duplicate of a finished task."""
    sync = tasks.by_region[task_serializer]
    tag = unique("region")
    sent = sync.apply_async((Region.EU, tag), serializer=call_serializer)
    assert sent.get(timeout=TIMEOUT) == tag
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free the reservation")
    again = sync.apply_async((Region.EU, tag))
    assert again.id != sent.id
    assert again.get(timeout=TIMEOUT) == tag
    assert len([t for t, _ in runs("by_region") if t == tag]) == 2


needs_dumped_models = pytest.mark.skipif(
    not DUMPS_MODELS, reason="needs pydantic and a Celery that dumps pydantic=True models"
)


@needs_dumped_models
@pytest.mark.parametrize("task_name", ["ship", "ship_by_item"])
def test_a_pydantic_task_reserves_the_name_of_the_dicts_it_sends(
    tasks: SimpleNamespace, locks: redis.Redis, task_name: str
) -> None:
    """Celery sends a ``pydantic=True`` task's models as dicts: the name is derived
    from those, with the default key and with a ``lock_key`` callable alike; an
    equal model sent meanwhile is a duplicate, and the execution frees the name."""
    task = getattr(tasks, task_name)
    tag = unique("order")
    first = task.delay(Order(id=7), tag)
    assert task.delay(Order(id=7), tag).id == first.id
    assert task.apply_async((), {"order": {"id": 7}, "tag": tag}).id == first.id
    gate(tag).set()
    assert first.get(timeout=TIMEOUT) == 7
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free the reservation")
    assert runs(task_name).count(tag) == 1


@needs_dumped_models
@pytest.mark.parametrize("task_name", ["ship", "ship_by_item"])
def test_a_pydantic_tasks_lock_name_and_the_test_kit_name_models_as_the_send_does(
    tasks: SimpleNamespace, locks: redis.Redis, task_name: str
) -> None:
    """``lock_name()`` of a call with a model is the name its send reserves (that
    of the dict its message carries), and ``hold_lock()`` with the model holds
    that name: the call sent meanwhile is a duplicate of the holder."""
    task = getattr(tasks, task_name)
    tag = unique("kit")
    assert task.lock_name((Order(id=8), tag), {}) == task.lock_name(({"id": 8}, tag), {})
    with hold_lock(task, Order(id=8), tag) as holder:
        assert holder.name == task.lock_name((Order(id=8), tag), {})
        assert task.delay(Order(id=8), tag).id == holder.lease
    assert not lock_keys(locks)
    assert runs(task_name).count(tag) == 0


@needs_dumped_models
def test_a_lock_key_reading_a_model_a_worker_gets_as_a_dict_fails_at_send(
    tasks: SimpleNamespace, locks: redis.Redis
) -> None:
    """A ``lock_key`` callable that needs the model itself, which the worker gets
    as a dict, fails as the call is sent, reserving and sending nothing; a pickled
    message, whose model Celery leaves as it is, is keyed on the model."""
    tag = unique("attribute")
    with pytest.raises(KeyDerivationError, match=r"lock_key of task 'names\.ship_by_attribute'"):
        tasks.ship_by_attribute.delay(Order(id=3), tag)
    assert not lock_keys(locks)
    pickled = tasks.ship_by_attribute.apply_async((Order(id=3), tag), serializer="pickle")
    assert pickled.get(timeout=TIMEOUT) == 3
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free the reservation")
    assert runs("ship_by_attribute").count(tag) == 1


def send_as_reserved(task: Any, args: tuple[Any, ...], name: str | None, **options: Any) -> Any:
    """Send ``task`` as a producer that named the call ``name`` does (one of another
    version): ``name`` reserved for the message, and carried in its headers
    (``None``: reserved by a producer of a release that sends no name)."""
    task_id = str(uuid.uuid4())
    opts = task.lock_options
    reserved = name if name is not None else task.lock_name(args, {})
    ttl = opts.enqueue_ttl + options.get("countdown", 0)
    lock = task._new_lock(reserved, task_id, queued_owner(task_id), ttl, heartbeat=False, opts=opts)
    assert lock.acquire(blocking=False)
    headers = {} if name is None else {_NAME_HEADER: name}
    return super(SingletonTask, task).apply_async(args, None, task_id, headers=headers, **options)


@pytest.fixture
def item() -> Iterator[str]:
    """A call's argument no other test uses; its derivation is reset afterwards."""
    value = unique("item")
    yield value
    VERSIONS.pop(value, None)


def test_an_until_executed_message_runs_under_the_name_its_send_reserved(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """A worker that would name the call otherwise (another version) runs it under
    the name its send reserved, which travels in the message, and frees it: the
    producer's next send of the call is not a duplicate of the finished one."""
    reserved = tasks.versioned.lock_name((item,), {})
    VERSIONS[item] = "v2"
    derived = tasks.versioned.lock_name((item,), {})
    assert derived != reserved
    first = send_as_reserved(tasks.versioned, (item,), reserved)
    assert first.get(timeout=TIMEOUT) == item
    assert runs("versioned")[-1] == (item, reserved, reserved)
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free the reservation")
    del VERSIONS[item]
    again = tasks.versioned.delay(item)
    assert again.id != first.id
    assert again.get(timeout=TIMEOUT) == item
    # A send of this version names the call in its message as it reserves it.
    assert runs("versioned")[-1] == (item, reserved, reserved)
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free the reservation")


def test_a_derivation_that_raises_only_in_the_worker_strands_nothing(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """A key the worker cannot derive (its ``lock_key`` raises there, not where the
    call was sent) is not needed: the message runs under its reserved name and frees it."""
    reserved = tasks.versioned.lock_name((item,), {})
    VERSIONS[item] = "broken"
    with pytest.raises(KeyDerivationError):
        tasks.versioned.lock_name((item,), {})
    sent = send_as_reserved(tasks.versioned, (item,), reserved)
    assert sent.get(timeout=TIMEOUT) == item
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free the reservation")


def test_a_message_without_the_name_is_named_by_the_worker(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """A message from a producer that sends no name (an earlier release) runs under
    the name the worker derives, and frees it."""
    derived = tasks.versioned.lock_name((item,), {})
    sent = send_as_reserved(tasks.versioned, (item,), None)
    assert sent.get(timeout=TIMEOUT) == item
    assert runs("versioned")[-1] == (item, derived, None)
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free the reservation")


def test_a_retry_reserves_and_runs_under_the_name_of_its_own_send(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """``self.retry()`` names the retry it sends as it reserves it, not as the
    message it retries was named (whose headers the retry copies): each execution
    frees the name it ran under."""
    reserved = tasks.versioned_retry.lock_name((item,), {})
    VERSIONS[item] = "v2"
    derived = tasks.versioned_retry.lock_name((item,), {})
    sent = send_as_reserved(tasks.versioned_retry, (item,), reserved)
    assert sent.get(timeout=TIMEOUT) == item
    done = [(r, name) for i, r, name in runs("versioned_retry") if i == item]
    assert done == [(0, reserved), (1, derived)]
    wait_for(lambda: not lock_keys(locks), FREED, "the executions to free their names")


def test_an_until_executing_message_frees_the_name_its_send_reserved_as_it_starts(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """An ``until_executing`` message frees the name its send reserved as its body
    starts, whatever the worker would name the call."""
    reserved = tasks.versioned_early.lock_name((item,), {})
    VERSIONS[item] = "v2"
    sent = send_as_reserved(tasks.versioned_early, (item,), reserved)
    try:
        wait_for(lambda: item in runs("versioned_early"), TIMEOUT, "the body to start")
        wait_for(lambda: not lock_keys(locks), FREED, "the start to free the reservation")
    finally:
        gate(item).set()
    assert sent.get(timeout=TIMEOUT) == item


@pytest.mark.parametrize("strategy", ["until_executed", "until_executing"])
def test_a_message_whose_start_failed_frees_the_name_its_send_reserved(
    tasks: SimpleNamespace, locks: redis.Redis, item: str, strategy: str
) -> None:
    """A message whose ``before_start`` raises frees the name its send reserved
    before its failure is stored, whatever the worker would name the call."""
    task = tasks.fails_to_start[strategy]
    reserved = task.lock_name((item,), {})
    VERSIONS[item] = "v2"
    sent = send_as_reserved(task, (item,), reserved)
    with pytest.raises(RuntimeError, match="start failed"):
        sent.get(timeout=TIMEOUT)
    assert not lock_keys(locks)
    assert item not in runs("fails_to_start")


def test_the_worker_finds_a_running_execution_under_the_name_its_send_reserved(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """The worker's request of a running message finds its execution's hold under
    the name its send reserved, as it looks for it to free it once the pool
    process running it has died, whatever the worker would name the call."""
    reserved = tasks.versioned_held.lock_name((item,), {})
    VERSIONS[item] = "v2"
    sent = send_as_reserved(tasks.versioned_held, (item,), reserved)
    try:
        wait_for(lambda: item in runs("versioned_held"), TIMEOUT, "the body to start")
        request = worker_state.requests[sent.id]
        name, held = request._message_lock()
        assert held is not None
        assert request._is_childs(held)
        assert name == reserved
        assert held.name == reserved
        assert held.holder == sent.id
    finally:
        gate(item).set()
    assert sent.get(timeout=TIMEOUT) == item
    wait_for(lambda: not lock_keys(locks), FREED, "the execution to free its lock")


def test_an_eager_retry_with_other_arguments_runs_under_its_own_name(
    redislock_server: RedisServer, locks: redis.Redis
) -> None:
    """Under ``task_always_eager`` the retry of a call runs at once, with the
    headers of the call it retries: one with other arguments still runs under the
    name of its own arguments, and no lock is left behind."""
    app = make_app(redislock_server.url, "names_eager")
    app.conf.task_always_eager = True
    seen: list[tuple[int, str]] = []

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="names_eager.job",
        lock_strategy="until_executed",
        max_retries=1,
    )
    def job(self: Any, n: int) -> int:
        seen.append((n, self.lock.name))
        if n == 1:
            raise self.retry(args=(2,), countdown=0)
        return n

    try:
        assert job.delay(1).get() == 2
        assert seen == [(1, job.lock_name((1,), {})), (2, job.lock_name((2,), {}))]
        assert not lock_keys(locks)
    finally:
        close_app(app)


def test_an_eager_call_whose_arguments_the_serializer_changes_runs_under_its_reserved_name(
    redislock_server: RedisServer, locks: redis.Redis
) -> None:
    """Under ``task_always_eager`` Celery puts a call's arguments through the
    serializer before it runs them: a dict that kombu's JSON decodes as another
    type (here a ``Decimal``) runs under the name its send reserved, and frees
    it, so the same call sent again runs again."""
    app = make_app(redislock_server.url, "names_eager_shape")
    app.conf.task_always_eager = True
    seen: list[tuple[Any, str]] = []

    @app.task(
        base=SingletonTask,
        bind=True,
        shared=False,
        name="names_eager_shape.job",
        lock_strategy="until_executed",
    )
    def job(self: Any, value: Any) -> str:
        seen.append((value, self.lock.name))
        return "ran"

    shaped = {"__type__": "decimal", "__value__": "1"}
    reserved = job.lock_name((shaped,), {})
    try:
        first = job.delay(shaped)
        assert first.get() == "ran"
        assert seen == [(Decimal("1"), reserved)]
        assert not lock_keys(locks)
        second = job.delay(shaped)
        assert second.id != first.id
        assert len(seen) == 2
        assert not lock_keys(locks)
    finally:
        close_app(app)


def scheduled_here(task_id: str) -> bool:
    """Whether this process's worker holds ``task_id``, waiting for its countdown."""
    return scheduled_copies(task_id) > 0


def test_revoking_a_queued_message_frees_the_name_its_send_reserved(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """A message the worker holds for its countdown, revoked, frees the name its
    send reserved, whatever the worker would name the call."""
    reserved = tasks.versioned.lock_name((item,), {})
    VERSIONS[item] = "v2"
    sent: AsyncResult = send_as_reserved(tasks.versioned, (item,), reserved, countdown=60)
    wait_for(lambda: scheduled_here(sent.id), TIMEOUT, "the worker to schedule the countdown")
    sent.revoke()
    wait_for(lambda: not lock_keys(locks), FREED, "the revoke to free the reservation")


def test_a_message_the_worker_drops_as_revoked_frees_the_name_its_send_reserved(
    tasks: SimpleNamespace, locks: redis.Redis, item: str
) -> None:
    """A message revoked before the worker got it is dropped as it arrives, and
    frees the name its send reserved, whatever the worker would name the call."""
    reserved = tasks.versioned.lock_name((item,), {})
    VERSIONS[item] = "v2"
    task_id = str(uuid.uuid4())
    worker_state.revoked.add(task_id)
    try:
        opts = tasks.versioned.lock_options
        lock = tasks.versioned._new_lock(
            reserved, task_id, queued_owner(task_id), opts.enqueue_ttl, heartbeat=False, opts=opts
        )
        assert lock.acquire(blocking=False)
        super(SingletonTask, tasks.versioned).apply_async(
            (item,), None, task_id, headers={_NAME_HEADER: reserved}
        )
        wait_for(lambda: not lock_keys(locks), FREED, "the worker to free the reservation")
    finally:
        worker_state.revoked.discard(task_id)
    assert not [r for r in runs("versioned") if r[0] == item]
