"""The Lua scripts behind :class:`~celery_redislock.lock.RedisLock`.

Each script runs atomically on the server, so every read-check-write below is a
single step no other client can interleave with. All keys one call touches
share the lock name's ``{hash tag}``, so the scripts also run on Redis Cluster.

The lock itself is a hash with the fields:

``owner``  the owner token of the holder (random, or a Celery task id plus a nonce)
``lease``  the lease the holder belongs to (a Celery task id), or ``""``
``count``  the holder's hold count (re-entrant acquires)
``fence``  the fencing token handed out when the holder took the lock

Replies use small integers for the outcome so the client needs no string
parsing on the hot path.
"""

from __future__ import annotations

#: Take the lock, take it again (re-entrant), or take it over from an earlier
#: execution of the same lease.
#:
#: KEYS[1] the lock hash; KEYS[2] the fence counter
#: ARGV[1] owner token; ARGV[2] TTL in ms; ARGV[3] lease ("" for none);
#: ARGV[4] TTL of the fence counter in ms
#: Returns {1, fence} when newly taken (or taken over), {2, fence} when re-entered,
#: {0, pttl, holder_lease} when another owner holds it.
ACQUIRE = """
local owner = redis.call('HGET', KEYS[1], 'owner')
if owner == ARGV[1] then
    redis.call('HINCRBY', KEYS[1], 'count', 1)
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {2, tonumber(redis.call('HGET', KEYS[1], 'fence'))}
end
if owner and (ARGV[3] == '' or redis.call('HGET', KEYS[1], 'lease') ~= ARGV[3]) then
    return {0, redis.call('PTTL', KEYS[1]), redis.call('HGET', KEYS[1], 'lease') or ''}
end
if redis.call('EXISTS', KEYS[2]) == 0 then
    -- Seed a fresh counter from the server clock so tokens keep increasing
    -- even after an idle counter expired.
    local now = redis.call('TIME')
    redis.call('SET', KEYS[2], now[1] .. string.format('%06d', tonumber(now[2])))
end
local fence = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'owner', ARGV[1], 'lease', ARGV[3], 'count', 1, 'fence', fence)
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1, fence}
"""

#: Drop one hold; free the lock and wake waiters when the last hold goes.
#:
#: KEYS[1] the lock hash
#: ARGV[1] owner token; ARGV[2] the wake-up channel
#: Returns 1 when freed, 2 when a hold remains, 0 when not owned (nothing changed).
RELEASE = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
    return 0
end
if redis.call('HINCRBY', KEYS[1], 'count', -1) > 0 then
    return 2
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], '1')
return 1
"""

#: Set the remaining TTL of a held lock.
#:
#: KEYS[1] the lock hash
#: ARGV[1] owner token; ARGV[2] the new TTL in ms
#: Returns 1 when extended, 0 when not owned (nothing changed).
EXTEND = """
if redis.call('HGET', KEYS[1], 'owner') ~= ARGV[1] then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

#: Free the lock whatever its hold count, if a given lease holds it. Used when a
#: Celery task ends in a way its own process cannot report (revoked in the queue,
#: terminated), where only the task id is known.
#:
#: KEYS[1] the lock hash
#: ARGV[1] lease (task id); ARGV[2] the wake-up channel
#: Returns 1 when freed, 0 when that lease does not hold it.
RELEASE_LEASE = """
if ARGV[1] == '' or redis.call('HGET', KEYS[1], 'lease') ~= ARGV[1] then
    return 0
end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], '1')
return 1
"""
