"""The Lua scripts behind :class:`~celery_redislock.lock.RedisLock`, and their runner.

Each script runs atomically on the server, so every read-check-write below is a
single step no other client can interleave with. All keys one call touches
share the lock name's ``{hash tag}``, so one call touches a single cluster slot.

The lock is a hash with the fields:

``owner``  the owner token of the holder (random, or a Celery task id plus a nonce)
``lease``  the lease the holder belongs to (a Celery task id), or ``""``
``count``  the holder's hold count (re-entrant acquires)
``fence``  the fencing token handed out when the holder took the lock
``req``    the id of the last request that changed the hold (acquire or release)

Beside it, the fence hash keeps ``n``, the last fencing token of the name, and
``r``, the id of the last release that freed the lock; it expires
``FENCE_TTL`` after its last use.

**Retries.** A request can reach the server and run while its reply is lost
(a reset connection, a timeout); the client then sends it again. Every request
that changes state carries a fresh request id, and the scripts recognise their
own second arrival: a retried acquire does not count a second hold, a retried
release does not drop a second one, and a retried release of a lock it already
freed still answers "freed" (from ``r``). **Expiry.** Every TTL is checked
inside the script before the first write, so no error can leave a key behind
without an expiry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from redis.exceptions import NoScriptError, RedisError

from celery_redislock.transport import ATTEMPTS, Deadline, Router, Transport, run

#: Highest TTL a script accepts, in ms (about 10 years; see ``lock.MAX_SECONDS``).
MAX_TTL_MS = 315_360_000_000

_CHECK_TTLS = f"""
local function check_ttl(value)
    local ms = tonumber(value)
    if not ms or ms < 1 or ms > {MAX_TTL_MS} or ms ~= math.floor(ms) then
        return redis.error_reply('ERR celery_redislock: TTL out of range: ' .. tostring(value))
    end
    return nil
end
"""

#: Take the lock, take it again (re-entrant), or take it over from an earlier
#: execution of the same lease.
#:
#: KEYS[1] the lock hash; KEYS[2] the fence hash
#: ARGV[1] owner token; ARGV[2] TTL in ms; ARGV[3] lease ("" for none);
#: ARGV[4] TTL of the fence hash in ms; ARGV[5] request id
#: Returns {1, fence} when newly taken (or taken over), {2, fence} when re-entered,
#: {0, pttl, holder lease} when another owner holds it. A retry of a request that
#: already landed returns what the first arrival did.
ACQUIRE = (
    _CHECK_TTLS
    + """
local bad = check_ttl(ARGV[2]) or check_ttl(ARGV[4])
if bad then return bad end
local lock = redis.call('HMGET', KEYS[1], 'owner', 'lease', 'count', 'fence', 'req')
if lock[1] == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    if lock[5] == ARGV[5] then
        return {tonumber(lock[3]) == 1 and 1 or 2, tonumber(lock[4])}
    end
    redis.call('HSET', KEYS[1], 'count', tonumber(lock[3]) + 1, 'req', ARGV[5])
    return {2, tonumber(lock[4])}
end
if lock[1] and (ARGV[3] == '' or lock[2] ~= ARGV[3]) then
    return {0, redis.call('PTTL', KEYS[1]), lock[2] or ''}
end
if redis.call('HEXISTS', KEYS[2], 'n') == 0 then
    -- Seed a fresh counter from the server clock (microseconds) so tokens keep
    -- increasing after an idle counter expired or the server lost its data.
    local now = redis.call('TIME')
    redis.call('HSET', KEYS[2], 'n', now[1] .. string.format('%06d', tonumber(now[2])))
end
local fence = redis.call('HINCRBY', KEYS[2], 'n', 1)
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease', ARGV[3], 'count', 1,
           'fence', fence, 'req', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence}
"""
)

#: Drop one hold; free the lock and wake waiters when the last hold goes.
#:
#: KEYS[1] the lock hash; KEYS[2] the fence hash
#: ARGV[1] owner token; ARGV[2] the wake-up channel; ARGV[3] request id;
#: ARGV[4] TTL of the fence hash in ms; ARGV[5] "" or the request id of the
#: acquire this release undoes (then it acts only if that acquire was the last
#: change to the hold)
#: Returns 1 when freed, 2 when a hold remains, 0 when not owned (nothing changed).
RELEASE = (
    _CHECK_TTLS
    + """
local bad = check_ttl(ARGV[4])
if bad then return bad end
local lock = redis.call('HMGET', KEYS[1], 'owner', 'count', 'req')
if lock[1] ~= ARGV[1] then
    if redis.call('HGET', KEYS[2], 'r') == ARGV[3] then return 1 end
    return 0
end
if lock[3] == ARGV[3] then return 2 end
if ARGV[5] ~= '' and lock[3] ~= ARGV[5] then return 0 end
local count = tonumber(lock[2]) - 1
if count > 0 then
    redis.call('HSET', KEYS[1], 'count', count, 'req', ARGV[3])
    return 2
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], 'r', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PUBLISH', ARGV[2], '1')
return 1
"""
)

#: Set the remaining TTL of a held lock (sending it twice does no harm).
#:
#: KEYS[1] the lock hash
#: ARGV[1] owner token; ARGV[2] the new TTL in ms
#: Returns 1 when extended, 0 when not owned (nothing changed).
EXTEND = (
    _CHECK_TTLS
    + """
local bad = check_ttl(ARGV[2])
if bad then return bad end
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
)

#: Free the lock whatever its hold count, if a given lease holds it. Used when a
#: Celery task ends in a way its own process cannot report (revoked in the queue,
#: terminated), where only the task id is known.
#:
#: KEYS[1] the lock hash; KEYS[2] the fence hash
#: ARGV[1] lease (task id); ARGV[2] the wake-up channel; ARGV[3] request id;
#: ARGV[4] TTL of the fence hash in ms
#: Returns 1 when freed (now or by an earlier arrival of the same request), 0 when
#: that lease does not hold it.
RELEASE_LEASE = (
    _CHECK_TTLS
    + """
local bad = check_ttl(ARGV[4])
if bad then return bad end
if ARGV[1] == '' or redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then
    if redis.call('HGET', KEYS[2], 'r') == ARGV[3] then return 1 end
    return 0
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[2], 'r', ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PUBLISH', ARGV[2], '1')
return 1
"""
)


class Script:
    """One Lua script, sent by digest (``EVALSHA``) and by text when the server lacks it."""

    __slots__ = ("name", "sha", "text")

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def __repr__(self) -> str:
        return f"<Script {self.name}>"


class Call(NamedTuple):
    """One script invocation: the script, its KEYS and its ARGV."""

    script: Script
    keys: Sequence[str]
    args: Sequence[Any]

    def by_sha(self) -> tuple[Any, ...]:
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)

    def by_text(self) -> tuple[Any, ...]:
        return ("EVAL", self.script.text, len(self.keys), *self.keys, *self.args)


ACQUIRE_SCRIPT = Script("ACQUIRE", ACQUIRE)
RELEASE_SCRIPT = Script("RELEASE", RELEASE)
EXTEND_SCRIPT = Script("EXTEND", EXTEND)
RELEASE_LEASE_SCRIPT = Script("RELEASE_LEASE", RELEASE_LEASE)


def run_calls(
    transport: Transport,
    calls: Sequence[Call],
    deadline: Deadline,
    then: Sequence[Sequence[Any]] = (),
) -> list[Any]:
    """Run ``calls``, then the plain commands ``then``, in one pipelined round trip.

    Returns one reply (or error) per call and per command. Calls the server does
    not know by digest yet (``NOSCRIPT``: not run) are sent again by text in a
    second round trip, which also caches them, followed by ``then`` again.
    Transient errors are retried within ``deadline`` (the scripts recognise a retry).

    Raises:
        redis.RedisError: the round trip failed for good.
    """
    replies = run(transport, [*(call.by_sha() for call in calls), *then], deadline)
    missing = [
        i for i, reply in enumerate(replies[: len(calls)]) if isinstance(reply, NoScriptError)
    ]
    if missing:
        again = run(transport, [*(calls[i].by_text() for i in missing), *then], deadline)
        for i, reply in zip(missing, again, strict=False):
            replies[i] = reply
        replies[len(calls) :] = again[len(missing) :]
    return replies


def send(
    router: Router,
    key: str,
    call: Call | Sequence[Any],
    deadline: Deadline,
    then: Sequence[Sequence[Any]] = (),
) -> Any:
    """Send one script call (or plain command) about ``key``; raise an error reply.

    With ``then``, those commands follow in the same round trip and every reply
    comes back, as a list. On a cluster, a redirection or a failed primary
    updates the slot map and the request goes again to the key's owner now.

    Raises:
        redis.RedisError: the request failed for good (connection, timeout, or
            an error reply).
    """
    for attempt in range(ATTEMPTS):
        transport = router.transport(key)
        try:
            if isinstance(call, Call):
                replies = run_calls(transport, [call], deadline, then)
            else:
                replies = run(transport, [call, *then], deadline)
            if isinstance(replies[0], Exception):
                raise replies[0]
            return replies if then else replies[0]
        except RedisError as exc:
            last = attempt + 1 == ATTEMPTS or deadline.expired()
            if last or not router.redirected(exc):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


class Acquired(IntEnum):
    """What an acquire found."""

    HELD = 0  #: another owner holds the lock
    TAKEN = 1  #: newly taken, or taken over from an earlier execution of the lease
    REENTERED = 2  #: this owner held it already; one more hold counted


class AcquireReply(NamedTuple):
    """The ACQUIRE script's reply, typed."""

    outcome: Acquired
    #: The fencing token (``None`` when held by another owner).
    fence: int | None
    #: The holder's remaining TTL in ms (only when held by another owner).
    pttl: int
    #: The holder's lease, if it has one (only when held by another owner).
    holder: str | None

    @classmethod
    def parse(cls, raw: Sequence[Any]) -> AcquireReply:
        outcome = Acquired(int(raw[0]))
        if outcome is Acquired.HELD:
            return cls(outcome, None, int(raw[1]), _text(raw[2]) or None)
        return cls(outcome, int(raw[1]), 0, None)


class Released(IntEnum):
    """What a release did."""

    NOT_OWNED = 0  #: this owner did not hold the lock; nothing changed
    FREED = 1  #: the last hold went: the lock is free and waiters were woken
    KEPT = 2  #: one hold dropped, others remain


def _text(value: bytes | str | None) -> str | None:
    """Decode a bytes reply."""
    return value.decode() if isinstance(value, bytes) else value
