"""One sale event's inventory in Redis, and the fenced write that protects it.

Keys of event ``E`` (the ``{E}`` hash tag keeps them on one Redis Cluster slot)::

    seckill:{E}:tickets    tickets put on sale
    seckill:{E}:stock      tickets left: what a buyer reads, checks and decrements
    seckill:{E}:low        lowest stock ever written (the "never below zero" witness)
    seckill:{E}:fence      highest fencing token that has written
    seckill:{E}:sales      list of sales, one JSON object each
    seckill:{E}:buyers     set of buyers holding a ticket
    seckill:{E}:attempts   hash: buyer -> purchase attempts
    seckill:{E}:stale      writes the fence rejected
    seckill:{E}:opens_at   when the sale opens: a UNIX time, "pending" or "cancelled"

A purchase reads the stock, checks it, waits a moment (the payment check) and
only then decrements it: a check-then-act race on purpose, which only the lock
makes correct. The decrement goes through :func:`commit_sale`, which refuses a
write carrying a fencing token smaller than one that already wrote, so a holder
that stalled past its lock's TTL cannot write after its successor did.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import redis

from celery_redislock import LockLostError, RedisLock

#: Seconds the keys of a finished event are kept for inspection.
EVENT_TTL = 24 * 3600

#: ``opens_at`` values before the sale has a time, and after it was called off.
PENDING = "pending"
CANCELLED = "cancelled"


@dataclass(frozen=True)
class EventKeys:
    """The Redis keys of one event."""

    tickets: str
    stock: str
    low: str
    fence: str
    sales: str
    buyers: str
    attempts: str
    stale: str
    opens_at: str

    def all(self) -> list[str]:
        """Every key of the event."""
        return [
            self.tickets,
            self.stock,
            self.low,
            self.fence,
            self.sales,
            self.buyers,
            self.attempts,
            self.stale,
            self.opens_at,
        ]


def event_keys(event_id: str) -> EventKeys:
    """The keys of event ``event_id``."""
    base = f"seckill:{{{event_id}}}"
    return EventKeys(
        tickets=f"{base}:tickets",
        stock=f"{base}:stock",
        low=f"{base}:low",
        fence=f"{base}:fence",
        sales=f"{base}:sales",
        buyers=f"{base}:buyers",
        attempts=f"{base}:attempts",
        stale=f"{base}:stale",
        opens_at=f"{base}:opens_at",
    )


#: The fenced write: check the token and record the sale in one atomic step.
#:
#: KEYS: fence, stock, low, sales, buyers, stale
#: ARGV[1] fencing token ('' for an unfenced write); ARGV[2] buyer; ARGV[3] sale JSON
#: Returns {1, stock left} when written, {0, newer token} when rejected as stale.
COMMIT_SALE = """
if ARGV[1] ~= '' then
    local last = redis.call('GET', KEYS[1])
    if last and tonumber(ARGV[1]) < tonumber(last) then
        redis.call('INCR', KEYS[6])
        return {0, tonumber(last)}
    end
    redis.call('SET', KEYS[1], ARGV[1])
end
local left = redis.call('DECR', KEYS[2])
local low = tonumber(redis.call('GET', KEYS[3]))
if low == nil or left < low then
    redis.call('SET', KEYS[3], left)
end
redis.call('RPUSH', KEYS[4], ARGV[3])
redis.call('SADD', KEYS[5], ARGV[2])
return {1, left}
"""


@dataclass(frozen=True)
class Commit:
    """What :func:`commit_sale` did."""

    accepted: bool
    #: Stock left after the sale (when accepted).
    stock_left: int | None = None
    #: The newer token that had already written (when rejected).
    newer_token: int | None = None


@dataclass(frozen=True)
class Sale:
    """One recorded sale."""

    user: str
    token: int | None


@dataclass
class EventState:
    """Everything Redis holds about an event."""

    event_id: str
    tickets: int
    stock: int
    low: int
    sales: list[Sale] = field(default_factory=list)
    attempts: dict[str, int] = field(default_factory=dict)
    stale: int = 0

    @property
    def sold(self) -> int:
        """Tickets sold (sales recorded)."""
        return len(self.sales)

    def bought_twice(self) -> list[str]:
        """Buyers with more than one sale."""
        seen: set[str] = set()
        twice: list[str] = []
        for sale in self.sales:
            if sale.user in seen and sale.user not in twice:
                twice.append(sale.user)
            seen.add(sale.user)
        return twice

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "event_id": self.event_id,
            "tickets": self.tickets,
            "stock": self.stock,
            "low": self.low,
            "sold": self.sold,
            "sales": [{"user": s.user, "token": s.token} for s in self.sales],
            "attempts": dict(sorted(self.attempts.items())),
            "stale": self.stale,
        }


def open_event(client: redis.Redis, event_id: str, tickets: int, gated: bool = False) -> None:
    """Put ``tickets`` on sale for a fresh event (any earlier state is wiped).

    ``gated``: purchases wait in :func:`wait_for_opening` until :func:`open_sale`.
    """
    keys = event_keys(event_id)
    pipe = client.pipeline(transaction=True)
    pipe.delete(*keys.all())
    pipe.set(keys.tickets, tickets, ex=EVENT_TTL)
    pipe.set(keys.stock, tickets, ex=EVENT_TTL)
    pipe.set(keys.low, tickets, ex=EVENT_TTL)
    if gated:
        pipe.set(keys.opens_at, PENDING, ex=EVENT_TTL)
    pipe.execute()


def open_sale(client: redis.Redis, event_id: str, delay: float = 0.1) -> float:
    """Open a gated sale ``delay`` seconds from now; return that UNIX time.

    Every worker holding a click is then released at the same instant, however
    far apart their brokers delivered the clicks.
    """
    opens_at = time.time() + delay
    client.set(event_keys(event_id).opens_at, repr(opens_at), ex=EVENT_TTL)
    return opens_at


def cancel_sale(client: redis.Redis, event_id: str) -> None:
    """Call a gated sale off: waiting purchases end without buying."""
    client.set(event_keys(event_id).opens_at, CANCELLED, ex=EVENT_TTL)


def wait_for_opening(
    client: redis.Redis, event_id: str, limit: float = 300.0, poll: float = 0.01
) -> bool:
    """Wait until the sale is open; return False if it was cancelled.

    An event without an opening time is open. A pending one is polled for at
    most ``limit`` seconds, after which the sale counts as cancelled.
    """
    key = event_keys(event_id).opens_at
    deadline = time.monotonic() + limit
    while True:
        value = client.get(key)
        text = _text(value) if value is not None else None
        if text is None:
            return True
        if text == CANCELLED:
            return False
        if text != PENDING:
            delay = float(text) - time.time()
            if delay > 0:
                time.sleep(delay)
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)


def close_event(client: redis.Redis, event_id: str, ttl: int = EVENT_TTL) -> None:
    """Let every key of the event expire ``ttl`` seconds from now."""
    pipe = client.pipeline(transaction=False)
    for key in event_keys(event_id).all():
        pipe.expire(key, ttl)
    pipe.execute()


def note_attempt(client: redis.Redis, event_id: str, user_id: str) -> int:
    """Count one purchase attempt by ``user_id``; return the buyer's count."""
    return int(client.hincrby(event_keys(event_id).attempts, user_id, 1))


def has_ticket(client: redis.Redis, event_id: str, user_id: str) -> bool:
    """Whether ``user_id`` already holds a ticket."""
    return bool(client.sismember(event_keys(event_id).buyers, user_id))


def read_stock(client: redis.Redis, event_id: str) -> int:
    """Tickets left, as stored."""
    return int(client.get(event_keys(event_id).stock) or 0)


def commit_sale(client: redis.Redis, event_id: str, user_id: str, token: int | None) -> Commit:
    """Decrement the stock and record the sale, unless ``token`` is stale.

    A write whose fencing token is smaller than the largest token that already
    wrote is rejected (and counted in ``seckill:{E}:stale``): its holder lost the
    lock and a newer holder has acted since. ``token=None`` writes unfenced (the
    ``--no-lock`` path).
    """
    keys = event_keys(event_id)
    sale = json.dumps({"user": user_id, "token": token})
    script = client.register_script(COMMIT_SALE)
    reply = script(
        keys=[keys.fence, keys.stock, keys.low, keys.sales, keys.buyers, keys.stale],
        args=["" if token is None else str(token), user_id, sale],
    )
    if int(reply[0]) == 1:
        return Commit(accepted=True, stock_left=int(reply[1]))
    return Commit(accepted=False, newer_token=int(reply[1]))


def _int(value: Any, default: int = 0) -> int:
    return default if value is None else int(value)


def read_event(client: redis.Redis, event_id: str) -> EventState:
    """Read an event's whole state."""
    keys = event_keys(event_id)
    pipe = client.pipeline(transaction=True)
    pipe.get(keys.tickets)
    pipe.get(keys.stock)
    pipe.get(keys.low)
    pipe.lrange(keys.sales, 0, -1)
    pipe.hgetall(keys.attempts)
    pipe.get(keys.stale)
    tickets, stock, low, sales, attempts, stale = pipe.execute()
    records = [json.loads(raw) for raw in sales]
    return EventState(
        event_id=event_id,
        tickets=_int(tickets),
        stock=_int(stock),
        low=_int(low, _int(tickets)),
        sales=[Sale(user=str(r["user"]), token=r.get("token")) for r in records],
        attempts={_text(k): int(v) for k, v in attempts.items()},
        stale=_int(stale),
    )


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class StaleHolderDemo:
    """What happened when a holder stalled past its lock's TTL and then wrote."""

    stale_token: int
    fresh_token: int
    fresh_write: Commit
    stale_write: Commit
    stale_release_found_lost: bool
    stock_left: int
    sold: int

    @property
    def stopped(self) -> bool:
        """The stale write was rejected and the successor's write stood."""
        return (
            self.fresh_write.accepted
            and not self.stale_write.accepted
            and self.stock_left == 0
            and self.sold == 1
        )

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "stale_token": self.stale_token,
            "fresh_token": self.fresh_token,
            "fresh_write_accepted": self.fresh_write.accepted,
            "stale_write_accepted": self.stale_write.accepted,
            "stale_release_found_lost": self.stale_release_found_lost,
            "stock_left": self.stock_left,
            "sold": self.sold,
            "stopped": self.stopped,
        }


def stale_holder_demo(
    client: redis.Redis,
    event_id: str,
    lock_name: str,
    prefix: str = "redislock",
    stall_ttl: float = 0.3,
) -> StaleHolderDemo:
    """Show the fence stopping a holder that lost its lock.

    On a one-ticket event, holder A takes the lock (TTL ``stall_ttl``, no
    heartbeat: its process is frozen, as in a long GC pause or a stopped VM),
    reads one ticket left and stalls. Its lock expires; holder B takes it with a
    newer token, sells the ticket and releases. A wakes up and writes with its
    old token: the fence rejects the write, so the ticket is not sold twice.
    """
    open_event(client, event_id, tickets=1)
    stale = RedisLock(client, lock_name, ttl=stall_ttl, heartbeat=False, prefix=prefix)
    if not stale.acquire(blocking=True, timeout=10):
        raise RuntimeError(f"could not take lock {lock_name!r} for the fencing demo")
    assert stale.token is not None
    stale_token = stale.token
    stale_saw = read_stock(client, event_id)  # A reads 1 left ... and stalls.

    fresh = RedisLock(client, lock_name, ttl=10, prefix=prefix)
    if not fresh.acquire(blocking=True, timeout=stall_ttl + 10):  # waits for A's TTL
        raise RuntimeError(f"lock {lock_name!r} was not freed by its TTL")
    try:
        assert fresh.token is not None
        fresh_token = fresh.token
        fresh_write = (
            commit_sale(client, event_id, "buyer-B", fresh_token)
            if read_stock(client, event_id) > 0
            else Commit(accepted=False)
        )
    finally:
        fresh.release()

    # A resumes, still believing it saw a ticket left, and writes with its old token.
    stale_write = (
        commit_sale(client, event_id, "buyer-A", stale_token)
        if stale_saw > 0
        else Commit(accepted=False)
    )
    try:
        stale.release()
        found_lost = False
    except LockLostError:
        found_lost = True
    state = read_event(client, event_id)
    close_event(client, event_id, ttl=3600)
    return StaleHolderDemo(
        stale_token=stale_token,
        fresh_token=fresh_token,
        fresh_write=fresh_write,
        stale_write=stale_write,
        stale_release_found_lost=found_lost,
        stock_left=state.stock,
        sold=state.sold,
    )
