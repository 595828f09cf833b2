"""The name an ``until_*`` send reserves is the one its execution derives, however
the call is encoded: with a serializer of its own, or a ``pydantic=True`` task's
models, which Celery sends as dicts (real Redis, a real in-process worker)."""

from __future__ import annotations

import enum
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from celery import Celery, Task

from celery_redislock import KeyDerivationError, SingletonTask
from celery_redislock.server import RedisServer
from tests.support import (
    client_left_clean,
    close_app,
    gate,
    in_process_worker,
    lock_keys,
    make_app,
    record,
    runs,
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

    tasks = SimpleNamespace(by_region={s: by_region(s) for s in ("json", "pickle")})
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
