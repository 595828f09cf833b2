"""The seckill tasks: a buyer's click, the locked purchase and its unlocked twin.

``place_order(event_id, user_id)``
    One click. A :class:`~celery_redislock.SingletonTask` keyed on the buyer
    (``until_executed``): a second click while the first is queued or running
    publishes nothing and gets the first click's ``AsyncResult`` back. Its body
    runs ``purchase`` in place, so that window lasts until the attempt is over.

``purchase(event_id, user_id)``
    A ``SingletonTask`` keyed on the event: at most one purchase of an event
    runs at a time, on any worker; the others wait for the lock. The body reads,
    checks and decrements the inventory in separate steps (a race without the
    lock) and writes through the fence with ``self.lock.token``.

``purchase_unlocked(event_id, user_id)``
    The same body on a plain task: the ``--no-lock`` demonstration of the race.

Clicks that arrive before the event's sale opens wait for it
(:func:`~example_worker.inventory.wait_for_opening`), so every worker starts
buying at the same instant.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import redis

from celery_redislock import LockHandle, SingletonTask
from example_worker import inventory
from example_worker.app import app

#: Seconds between the stock check and the decrement (the payment check): the
#: window in which, without the lock, several buyers see the same last ticket.
THINK_SECONDS = 0.01

#: Seconds a purchase waits for the event's lock before failing.
LOCK_WAIT_SECONDS = 120.0

#: TTL of the event lock; the heartbeat renews it while a purchase runs.
PURCHASE_LOCK_TTL = 10.0

#: How long a click's lock, taken at enqueue time, lives while the click waits in
#: the queue (the heartbeat renews it once the order runs).
ORDER_LOCK_TTL = 600.0

_clients: dict[tuple[int, str], redis.Redis] = {}
_clients_guard = threading.Lock()


def inventory_client() -> redis.Redis:
    """This process's client of the store that holds the inventory (the lock store)."""
    url = str(app.conf.redislock_url)
    key = (os.getpid(), url)
    with _clients_guard:
        client = _clients.get(key)
        if client is None:
            client = redis.Redis.from_url(url, decode_responses=True)
            _clients[key] = client
        return client


class TimedSingletonTask(SingletonTask):
    """A ``SingletonTask`` that notes when it asked for its lock, so the body can
    report how long it waited."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.request.lock_asked_at = time.monotonic()
        return super().__call__(*args, **kwargs)


def attempt_purchase(
    client: redis.Redis,
    event_id: str,
    user_id: str,
    *,
    lock: LockHandle | None,
    think: float,
) -> dict[str, Any]:
    """One purchase attempt: read, check, think, then write through the fence.

    Returns ``{"outcome": ..., "stock_left": ..., "token": ...}`` where outcome is
    ``sold``, ``sold_out``, ``already_has_ticket`` or ``stale`` (this holder lost
    its lock, or a newer token already wrote: nothing was written).
    """
    token = lock.token if lock is not None else None
    result: dict[str, Any] = {"user": user_id, "token": token, "stock_left": None}
    inventory.note_attempt(client, event_id, user_id)
    if inventory.has_ticket(client, event_id, user_id):
        return {**result, "outcome": "already_has_ticket"}
    left = inventory.read_stock(client, event_id)
    if left <= 0:
        return {**result, "outcome": "sold_out", "stock_left": left}
    time.sleep(think)  # the payment check: the race window
    if lock is not None and lock.lost:
        # The heartbeat found the lock expired or taken over: stop before writing.
        return {**result, "outcome": "stale"}
    commit = inventory.commit_sale(client, event_id, user_id, token)
    if not commit.accepted:
        # A newer holder wrote while this one was stalled: the fence said no.
        return {**result, "outcome": "stale", "newer_token": commit.newer_token}
    return {**result, "outcome": "sold", "stock_left": commit.stock_left}


@app.task(
    base=TimedSingletonTask,
    bind=True,
    lock_on=("event_id",),
    on_conflict="wait",
    lock_wait=LOCK_WAIT_SECONDS,
    lock_ttl=PURCHASE_LOCK_TTL,
)
def purchase(self: Any, event_id: str, user_id: str, think: float = THINK_SECONDS) -> Any:
    """Buy one ticket of ``event_id`` for ``user_id``, one purchase of the event at a time."""
    began = time.time()
    asked = getattr(self.request, "lock_asked_at", None)
    waited = 0.0 if asked is None else max(0.0, time.monotonic() - asked)
    result = attempt_purchase(inventory_client(), event_id, user_id, lock=self.lock, think=think)
    return {
        **result,
        "worker": self.request.hostname,
        "lock_wait": waited,
        "started_at": began,
        "finished_at": time.time(),
    }


def cancelled(user_id: str, worker: str) -> dict[str, Any]:
    """The result of a click whose sale was called off before it opened."""
    return {"user": user_id, "outcome": "cancelled", "worker": worker, "lock_wait": 0.0}


@app.task(bind=True)
def purchase_unlocked(self: Any, event_id: str, user_id: str, think: float = THINK_SECONDS) -> Any:
    """The same purchase with no lock: concurrent buyers race for the last tickets."""
    if not inventory.wait_for_opening(inventory_client(), event_id):
        return cancelled(user_id, self.request.hostname)
    began = time.time()
    result = attempt_purchase(inventory_client(), event_id, user_id, lock=None, think=think)
    return {
        **result,
        "worker": self.request.hostname,
        "lock_wait": 0.0,
        "started_at": began,
        "finished_at": time.time(),
    }


@app.task(
    base=SingletonTask,
    bind=True,
    lock_on=("event_id", "user_id"),
    lock_strategy="until_executed",
    on_conflict="skip",
    lock_enqueue_ttl=ORDER_LOCK_TTL,
)
def place_order(self: Any, event_id: str, user_id: str, think: float = THINK_SECONDS) -> Any:
    """One click of ``user_id``; a second click while this one is pending is not sent."""
    if not inventory.wait_for_opening(inventory_client(), event_id):
        return cancelled(user_id, self.request.hostname)
    # Run the purchase here, under this click's lock, so a double click cannot
    # start a second attempt while the first one is still going.
    attempt = purchase.apply(args=(event_id, user_id), kwargs={"think": think}, throw=True)
    return {**attempt.result, "worker": self.request.hostname}
