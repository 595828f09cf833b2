"""The Lua scripts behind :class:`~celery_redislock.lock.RedisLock`, and their runner.

Each script runs atomically on the server, so every read-check-write below is a
single step no other client can interleave with. All keys one call touches
share the lock name's ``{hash tag}``, so one call touches a single cluster slot.

A lock name has one hash, which lives as long as the lock is held and, once
released, until the lock's own expiry (when a release finds enough of it left:
then it writes no expiry at all) or ``FENCE_TTL`` past the release. Its fields have one-letter names, so that a
held lock costs the server little (the names below are the constants that hold
them; ``celery redislock`` and :mod:`celery_redislock.admin` show the readable
names on the left):

==================  =====  ===================================================
readable name       field  holds
==================  =====  ===================================================
``owner``           ``o``  the owner token of the holder, ``""`` while the lock is free
``lease``           ``l``  the lease the holder belongs to (a Celery task id);
                           absent or ``""`` for none
``count``           ``n``  the holder's hold count (re-entrant acquires); absent
                           or ``""`` for 1
``fence``           ``f``  the last fencing token handed out for the name
``req``             ``r``  the id of the last request that changed the hold
                           (acquire or release); ``""`` while free;
                           ``GRANTED_TO`` + waiter id while a hold a release
                           handed to a waiter is not yet confirmed
``released``        ``x``  the ids of the last few releases that freed the lock
``queued``          ``q``  ``"1"`` while waiters may be queued
``reserved``        ``w``  the waiters a release just woke without handing
                           them the lock: the free lock is theirs for
                           ``RESERVE_MS``
``reserved_until``  ``u``  until when ``reserved`` holds, in ms
``task``            ``t``  the holder's description (:data:`HOLDER_FIELDS`): the
``state``           ``s``  task name, ``queued``/``running``, the worker node,
``node``            ``h``  its process id and when the hold began; written only
``pid``             ``p``  for a holder that has one (``task`` then always, the
``since``           ``b``  others when not empty)
==================  =====  ===================================================

A held plain lock is three fields, ``o``, ``f`` and ``r``: nothing is written
that says only "none" or "1". Redis has no way to remove a field with the
commands the engine is allowed (see the minimal ACL), so a field that an earlier
holder wrote and the current one does not need is emptied instead; a release
empties the holder's fields, so a free hash keeps little beyond its fence.

Keeping the hash (rather than deleting it) on release keeps the fencing counter
without a second key, and lets a release be one ``HSET`` (and a ``PEXPIRE`` when
little of the lock's expiry is left). When
the hash has expired, or the server lost its data, the next token is seeded
from the server clock in microseconds, so tokens keep increasing.

Waiters queue in a sorted set beside the hash (score: when they first queued;
member: the waiter's :func:`queue_entry`), and a release that frees the lock wakes
the first two of them, each through its own process's wake channel
``<prefix>:wake:<process>`` with the waiter's id as the message: a targeted
handoff, not a broadcast, and one spare in case the first waiter has gone.

The first is handed the lock in the same script: its entry holds its owner token,
TTL, lease and description, so the release writes them with the next fencing
token and an expiry of :data:`GRANT_MS` (the waiter's own TTL if shorter), marks
the request field ``GRANTED_TO + waiter id`` until the waiter confirms, and sends
the token after :data:`GRANT_MARK`. The waiter holds the lock as it reads the
message, with no round trip of its own; a waiter that has gone keeps the others
out for ``GRANT_MS`` at most. (An entry that is only an id is woken to ask, and
the free lock is kept for the woken for ``RESERVE_MS``.)

The spare's message ends in :data:`SPARE_MARK`; it gives the first a head start
(``celery_redislock.lock.SPARE_HEAD_START``) rather than race it for the lock,
and then asks (taking the lock if the first never came). Behind a handed lock
(:data:`BEHIND_MARK`) it waits for the grant to run out before it asks. The
release takes only the first out of the queue: the spare keeps its place at the
front, so the next release wakes it first (it is then handed the lock, or asks
at once).

**Retries.** A request can reach the server and run while its reply is lost
(a reset connection, a timeout); the client then sends it again. Every request
that changes state carries a fresh request id, and the scripts recognise their
own second arrival: a retried acquire does not count a second hold, a retried
release does not drop a second one, and a retried release of a lock it already
freed still answers "freed" (from ``released``, even if the lock was taken and
freed again by others in between, up to ``RELEASES_REMEMBERED`` times). **Expiry.** Every TTL is checked
inside the script before the first write, so no error can leave a key behind
without an expiry.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from enum import IntEnum
from string import Template
from types import MappingProxyType
from typing import Any, NamedTuple

from redis.exceptions import NoScriptError, RedisError

from celery_redislock.ids import REQUEST_ID_DIGITS
from celery_redislock.transport import ATTEMPTS, Deadline, Router, Transport, run

#: Highest TTL a script accepts, in ms (about 10 years; see ``lock.MAX_SECONDS``).
MAX_TTL_MS = 315_360_000_000

# The fields of the lock hash (the table in the module docstring).
#: The holder's owner token; ``""`` while the lock is free.
OWNER_FIELD = "o"
#: The holder's lease (a Celery task id); absent or ``""`` for none.
LEASE_FIELD = "l"
#: The holder's hold count; absent or ``""`` for 1.
COUNT_FIELD = "n"
#: The last fencing token handed out for the name.
FENCE_FIELD = "f"
#: The id of the last request that changed the hold.
REQUEST_FIELD = "r"
#: The ids of the last few releases that freed the lock, newest first.
RELEASED_FIELD = "x"
#: ``"1"`` while waiters may be queued.
QUEUED_FIELD = "q"
#: The waiters a release woke, space-separated.
RESERVED_FIELD = "w"
#: Until when (server time, ms) the free lock is kept for ``RESERVED_FIELD``.
RESERVED_UNTIL_FIELD = "u"

#: The holder's description a lock can carry (what ``celery redislock list`` shows):
#: the task name, ``queued``/``running``, the worker node, its process id, and
#: when the hold began (Unix time, in seconds).
HOLDER_FIELDS = ("task", "state", "node", "pid", "since")
#: The field each :data:`HOLDER_FIELDS` name is stored in, in the same order.
HOLDER_STORED = ("t", "s", "h", "p", "b")

#: Readable name -> stored field, for everything the lock hash can hold.
FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "owner": OWNER_FIELD,
        "lease": LEASE_FIELD,
        "count": COUNT_FIELD,
        "fence": FENCE_FIELD,
        "req": REQUEST_FIELD,
        "released": RELEASED_FIELD,
        "queued": QUEUED_FIELD,
        "reserved": RESERVED_FIELD,
        "reserved_until": RESERVED_UNTIL_FIELD,
        **dict(zip(HOLDER_FIELDS, HOLDER_STORED, strict=True)),
    }
)

#: How long, in ms, a lock freed with waiters queued that it cannot be handed to
#: (queue entries that are only an id) is kept for the (at most two) waiters it woke: a newcomer, or the releaser coming back, queues behind them
#: instead of taking it first. Long enough for a woken waiter to ask; short enough
#: that a waiter that vanished in between delays the others only briefly.
RESERVE_MS = 250

#: What the wake-up message of the second woken waiter (the spare) ends with.
SPARE_MARK = " spare"

#: What comes before :data:`SPARE_MARK` in the spare's message when the first
#: woken waiter was handed the lock: the spare need not ask unless the grant
#: runs out.
BEHIND_MARK = " behind"

#: What follows the waiter id in the wake-up message of a waiter the lock was
#: handed to, before the hold's fencing token.
GRANT_MARK = " grant "

#: The TTL, in ms, of a hold a release hands to the first queued waiter (at most
#: the waiter's own TTL): the waiter renews it to its full TTL as soon as it reads
#: its wake-up. Long enough for that; short enough that a waiter gone since it
#: queued keeps the others out only briefly.
GRANT_MS = 2000

#: What the request field holds while a handed-over hold is not yet confirmed by
#: its waiter: this, followed by the waiter id.
GRANTED_TO = "g:"

#: How many recent freeing releases a lock remembers, so that a retried release
#: is recognised even if the lock was taken and freed again in between.
RELEASES_REMEMBERED = 8


def _lua(text: str) -> str:
    """``text`` with its ``$NAME`` placeholders filled: the hash's field names as
    Lua strings (``$OWNER`` is ``'o'``), ``$HOLDER`` the holder's fields as a Lua
    list, and the numbers the scripts share."""
    quoted = {name.upper(): f"'{stored}'" for name, stored in FIELDS.items()}
    holder = "{" + ", ".join(f"'{stored}'" for stored in HOLDER_STORED) + "}"
    return Template(text).substitute(
        quoted,
        HOLDER=holder,
        RESERVE_MS=RESERVE_MS,
        SPARE=f"'{SPARE_MARK}'",
        BEHIND=f"'{BEHIND_MARK}'",
        GRANT=f"'{GRANT_MARK}'",
        GRANTED_TO=f"'{GRANTED_TO}'",
        GRANT_MS=GRANT_MS,
        RELEASE_HISTORY=RELEASES_REMEMBERED * (REQUEST_ID_DIGITS + 1) - 1,
    )


# Checks every script makes before its first write, so that an error can never
# leave a write half done (a key without expiry, a lock freed but nobody woken):
# the TTLs it was given, and — on servers with ACLs (Redis >= 7) — that the user
# may run each command that follows the first write on those keys and channels
# (a first write the ACL refuses writes nothing, nor does a read it refuses before
# the first write, so neither needs a check ahead: a check can cost the server
# more than the command it guards).
_CHECK_TTLS = f"""
local function check_ttl(value)
    local ms = tonumber(value)
    if not ms or ms < 1 or ms > {MAX_TTL_MS} or ms ~= math.floor(ms) then
        return redis.error_reply('ERR celery_redislock: TTL out of range: ' .. tostring(value))
    end
    return nil
end

local function now_ms()
    local now = redis.call('TIME')
    return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end

-- The fencing token after ``last`` (a field's value, or false): one more, or when
-- there is none (first use, expired remnant, a server that lost its data) one
-- seeded from the server clock in microseconds, so tokens keep increasing.
local function next_fence(last)
    local fence = tonumber(last)
    if fence then return fence + 1 end
    local now = redis.call('TIME')
    return tonumber(now[1]) * 1000000 + tonumber(now[2])
end

local function denied(command, ...)
    if redis.acl_check_cmd and not redis.acl_check_cmd(command, ...) then
        local target = select('#', ...) > 0 and (' on ' .. select(1, ...)) or ''
        return redis.error_reply('NOPERM this user has no permission to run ' ..
            string.upper(command) .. target .. ', which celery_redislock needs')
    end
    return nil
end
"""

# Shared by the scripts that free the lock: keep the hash (and its fence) as a
# free remnant for ARGV[4] ms (its current expiry for "0"), remember the release
# (ARGV[3]), and hand the lock
# to the first two queued waiters (wake channel prefix ARGV[2]). The holder's
# fields are emptied, so the remnant keeps little beyond the fence.
_FREE = _lua("""
-- What the scripts that free the lock read of it, in one HMGET: the owner, the
-- request id, the lease, the count, the releases remembered, the queued flag,
-- the holder's task name (the first of its description) and the fence, in that
-- order (a missing field is false).
local function read()
    return redis.call('HMGET', KEYS[1], $OWNER, $REQ, $LEASE, $COUNT, $RELEASED, $QUEUED,
                      $TASK, $FENCE)
end

-- read(), once ARGV[4] (how long the free hash keeps the fence) is checked; else
-- nil and the error to return.
local function checked_read()
    local bad = check_ttl(ARGV[4])
    if bad then return nil, bad end
    return read(), nil
end

-- A queue entry's waiter id, and what the lock is handed over with: the entry's
-- array {id, owner, TTL in ms, lease, description...}, or nil for an entry that
-- is only an id (it is woken to ask, with the lock kept free for it).
local function entry(member)
    if string.sub(member, 1, 1) == '[' then
        local ok, value = pcall(cjson.decode, member)
        if ok and type(value) == 'table' and type(value[1]) == 'string'
                and type(value[2]) == 'string' and value[2] ~= ''
                and not check_ttl(value[3]) then
            return value[1], value
        end
    end
    return member, nil
end

local function free(lock)
    local queued = lock[6] == '1'
    -- The first two queued waiters, read before the first write (refused, a read
    -- writes nothing).
    local next = queued and redis.call('ZRANGE', KEYS[2], 0, 1) or {}
    -- A lone HSET needs no check: denied, it writes nothing.
    if queued or ARGV[4] ~= '0' then
        local bad = denied('hset', KEYS[1], $OWNER, '') or denied('pexpire', KEYS[1], '1')
        if #next > 0 then
            bad = bad or denied('zrem', KEYS[2], 'w') or denied('publish', ARGV[2] .. '0', '')
                or denied('time')
        end
        if bad then return bad end
    end
    -- The ids of the last few releases that freed the lock, newest first.
    local history = string.sub(ARGV[3] .. ' ' .. (lock[5] or ''), 1, $RELEASE_HISTORY)
    local fields = {$OWNER, '', $REQ, '', $RELEASED, history}
    if lock[3] and lock[3] ~= '' then
        fields[#fields + 1] = $LEASE
        fields[#fields + 1] = ''
    end
    if lock[4] and lock[4] ~= '' then
        fields[#fields + 1] = $COUNT
        fields[#fields + 1] = ''
    end
    if lock[7] and lock[7] ~= '' then
        -- (An empty task name means the other holder fields are empty or absent.)
        for _, name in ipairs($HOLDER) do
            fields[#fields + 1] = name
            fields[#fields + 1] = ''
        end
    end
    if queued then
        if #next == 0 then
            fields[#fields + 1] = $QUEUED
            fields[#fields + 1] = ''
        else
            -- Only the first leaves the queue: the second (the spare) leaves it
            -- only by taking the lock, so while it lets the first go ahead the
            -- next release still finds it at the front.
            redis.call('ZREM', KEYS[2], next[1])
        end
    end
    local woken, grant = {}, nil
    for i = 1, #next do
        local id, handed = entry(next[i])
        woken[#woken + 1] = id
        if i == 1 then grant = handed end
    end
    local messages = {}
    if grant then
        -- Handed over: the first waiter holds the lock from now, for GRANT_MS
        -- at most, until it confirms the hold by renewing it.
        local fence = next_fence(lock[8])
        fields[#fields + 1] = $OWNER
        fields[#fields + 1] = grant[2]
        fields[#fields + 1] = $FENCE
        fields[#fields + 1] = fence
        fields[#fields + 1] = $REQ
        fields[#fields + 1] = $GRANTED_TO .. woken[1]
        if type(grant[4]) == 'string' and grant[4] ~= '' then
            fields[#fields + 1] = $LEASE
            fields[#fields + 1] = grant[4]
        end
        if #grant > 4 then
            for i, name in ipairs($HOLDER) do
                local value = grant[4 + i]
                if i == 1 or (type(value) == 'string' and value ~= '') then
                    fields[#fields + 1] = name
                    fields[#fields + 1] = tostring(value or '')
                end
            end
        end
        -- (Concatenated, a number this large would be written as a float.)
        messages[1] = woken[1] .. $GRANT .. string.format('%.0f', fence)
    elseif #woken > 0 then
        -- Kept for the waiters it wakes: for RESERVE_MS, nobody else takes it.
        fields[#fields + 1] = $RESERVED
        fields[#fields + 1] = table.concat(woken, ' ')
        fields[#fields + 1] = $RESERVED_UNTIL
        fields[#fields + 1] = now_ms() + $RESERVE_MS
        messages[1] = woken[1]
    end
    -- The second is the spare: it lets the first go ahead (behind a handed lock,
    -- it asks only if the grant runs out first).
    if #woken > 1 then messages[2] = woken[2] .. (grant and $BEHIND or '') .. $SPARE end
    -- (A field named twice takes the last value: the holder's, over the emptied one.)
    redis.call('HSET', KEYS[1], unpack(fields))
    if grant then
        redis.call('PEXPIRE', KEYS[1], math.min(tonumber(grant[3]), $GRANT_MS))
    elseif ARGV[4] ~= '0' then
        redis.call('PEXPIRE', KEYS[1], ARGV[4])
    end
    for i, message in ipairs(messages) do
        local process = string.match(woken[i], '^([^.]+)%.')
        if process then
            redis.call('PUBLISH', ARGV[2] .. process, message)
        end
    end
    return 1
end

-- Whether request ARGV[3] is one of the releases that freed the lock lately.
local function released_here(lock)
    local released = lock[5]
    return released and string.find(' ' .. released .. ' ', ' ' .. ARGV[3] .. ' ', 1, true)
end
""")

#: Take the lock, take it again (re-entrant), or take it over from an earlier
#: execution of the same lease; a waiter that finds it held joins the queue.
#:
#: KEYS[1] the lock hash; KEYS[2] the waiter queue
#: ARGV[1] owner token; ARGV[2] TTL in ms; ARGV[3] lease ("" for none);
#: ARGV[4] request id; ARGV[5] the waiter's queue entry ("" when not waiting: not
#: queued): the JSON array ``[waiter id, owner token, TTL in ms, lease,
#: description...]`` a release hands the lock over with (see :func:`queue_entry`);
#: ARGV[6] the waiter's queue position from an earlier reply ("" the first time);
#: ARGV[7..] optionally, the holder's description: one value per HOLDER_FIELDS
#: name, in that order, written with the hold (and emptied by a holder without one)
#: Returns {1, fence} when newly taken (or taken over, or a hold a release handed to
#: this waiter confirmed), {2, fence} when re-entered,
#: {0, ms to wait, holder lease, queue position, fence} when another owner holds it
#: (or it was just freed for the waiters a release woke, and the caller is not one),
#: where fence is the last token handed out for the name: a hold a release hands
#: to the caller later gets a higher one. A retry of a request that already landed
#: returns what the first arrival did.
ACQUIRE = _CHECK_TTLS + _lua("""
local bad = check_ttl(ARGV[2])
if bad then return bad end
-- The waiter id, the first element of its queue entry.
local waiter = ARGV[5] ~= '' and (string.match(ARGV[5], '^%["([^"]+)"') or ARGV[5]) or ''
local lock = redis.call('HMGET', KEYS[1], $OWNER, $LEASE, $COUNT, $FENCE, $REQ, $TASK,
                       $RESERVED, $RESERVED_UNTIL)
if lock[1] == ARGV[1] then
    bad = denied('pexpire', KEYS[1], '1') or denied('hset', KEYS[1], $COUNT, '1')
    if bad then return bad end
    if waiter ~= '' and lock[5] == $GRANTED_TO .. waiter then
        -- Handed to this waiter by a release: the hold is confirmed, with its full TTL.
        redis.call('HSET', KEYS[1], $REQ, ARGV[4])
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
        return {1, tonumber(lock[4])}
    end
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    local count = tonumber(lock[3]) or 1
    if lock[5] == ARGV[4] then
        return {count == 1 and 1 or 2, tonumber(lock[4])}
    end
    redis.call('HSET', KEYS[1], $COUNT, count + 1, $REQ, ARGV[4])
    return {2, tonumber(lock[4])}
end
-- How long the caller can expect to wait: the holder's remaining TTL, or the
-- time left to the waiters a release woke (a free lock is theirs for a moment).
local wait_ms, holder = nil, ''
if lock[1] and lock[1] ~= '' and (ARGV[3] == '' or lock[2] ~= ARGV[3]) then
    wait_ms, holder = redis.call('PTTL', KEYS[1]), lock[2] or ''
elseif lock[7] and lock[7] ~= ''
        and not (waiter ~= '' and string.find(' ' .. lock[7] .. ' ', ' ' .. waiter .. ' ', 1, true)) then
    local left = tonumber(lock[8]) - now_ms()
    if left > 0 then wait_ms = left end
end
if wait_ms then
    local position = ARGV[6]
    if ARGV[5] ~= '' then
        local pttl = wait_ms
        if position == '' then
            local now = redis.call('TIME')
            position = now[1] .. string.format('%06d', tonumber(now[2]))
        end
        bad = denied('zadd', KEYS[2], '1', 'w') or denied('pexpire', KEYS[2], '1')
            or denied('hset', KEYS[1], $QUEUED, '1')
        if bad then return bad end
        redis.call('ZADD', KEYS[2], 'NX', position, ARGV[5])
        if redis.call('PTTL', KEYS[2]) < pttl + tonumber(ARGV[2]) then
            redis.call('PEXPIRE', KEYS[2], pttl + tonumber(ARGV[2]))
        end
        redis.call('HSET', KEYS[1], $QUEUED, '1')
        return {0, pttl, holder, position, tonumber(lock[4]) or 0}
    end
    return {0, wait_ms, holder, '', tonumber(lock[4]) or 0}
end
local fence = next_fence(lock[4])
-- HSET writes first (denied, it writes nothing); what follows it is checked.
bad = denied('pexpire', KEYS[1], '1')
if ARGV[5] ~= '' then
    bad = bad or denied('zrem', KEYS[2], 'w')
end
if bad then return bad end
-- Only what this hold needs; what an earlier holder left (a lease, a count, a
-- reservation for the woken) is emptied.
local fields = {$OWNER, ARGV[1], $FENCE, fence, $REQ, ARGV[4]}
if ARGV[3] ~= '' or (lock[2] and lock[2] ~= '') then
    fields[#fields + 1] = $LEASE
    fields[#fields + 1] = ARGV[3]
end
if lock[3] and lock[3] ~= '' then
    fields[#fields + 1] = $COUNT
    fields[#fields + 1] = ''
end
if lock[7] and lock[7] ~= '' then
    fields[#fields + 1] = $RESERVED
    fields[#fields + 1] = ''
    fields[#fields + 1] = $RESERVED_UNTIL
    fields[#fields + 1] = ''
end
if #ARGV > 6 or lock[6] then
    -- The task field is always written with a description, so a hash without
    -- one has no other holder field; else a holder without a description
    -- empties the one its predecessor left.
    for i, name in ipairs($HOLDER) do
        local value = ARGV[6 + i] or ''
        if i == 1 or value ~= '' or lock[6] then
            fields[#fields + 1] = name
            fields[#fields + 1] = value
        end
    end
end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
if ARGV[5] ~= '' then
    redis.call('ZREM', KEYS[2], ARGV[5])
end
return {1, fence}
""")


def _freeing(body: str) -> str:
    """A script that may free the lock: ``body`` after the TTL checks and :data:`_FREE`."""
    return _CHECK_TTLS + _FREE + _lua(body)


#: Drop one hold; free the lock and wake the next waiters when the last hold goes.
#:
#: KEYS[1] the lock hash; KEYS[2] the waiter queue
#: ARGV[1] owner token; ARGV[2] the wake channel prefix (``<prefix>:wake:``);
#: ARGV[3] request id; ARGV[4] how long the free hash keeps the fence, in ms, or
#: "0" to leave its expiry (the lock's own) as it is: the caller knows enough of
#: it is left; ARGV[5] "" or the request id of the acquire this release undoes
#: (then it acts only if that acquire was the last change to the hold)
#: Returns 1 when freed, 2 when a hold remains, 0 when not owned (nothing changed).
RELEASE = _freeing("""
local bad = ARGV[4] ~= '0' and check_ttl(ARGV[4]) or nil
if bad then return bad end
local lock = read()
if lock[1] ~= ARGV[1] then
    if released_here(lock) then return 1 end
    return 0
end
if lock[2] == ARGV[3] then return 2 end
if ARGV[5] ~= '' and lock[2] ~= ARGV[5] then return 0 end
local count = (tonumber(lock[4]) or 1) - 1
if count > 0 then
    bad = denied('hset', KEYS[1], $COUNT, '1')
    if bad then return bad end
    redis.call('HSET', KEYS[1], $COUNT, count, $REQ, ARGV[3])
    return 2
end
return free(lock)
""")

#: Set the remaining TTL of a held lock (sending it twice does no harm).
#:
#: KEYS[1] the lock hash
#: ARGV[1] owner token; ARGV[2] the new TTL in ms
#: Returns 1 when extended, 0 when not owned (nothing changed).
EXTEND = _CHECK_TTLS + _lua("""
local bad = check_ttl(ARGV[2])
if bad then return bad end
if redis.call('HGET', KEYS[1], $OWNER) ~= ARGV[1] then
    return 0
end
bad = denied('pexpire', KEYS[1], '1')
if bad then return bad end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")

#: Free the lock whatever its hold count, if a given lease holds it. Used when a
#: Celery task ends in a way its own process cannot report (revoked in the queue,
#: terminated), where only the task id is known.
#:
#: KEYS[1] the lock hash; KEYS[2] the waiter queue
#: ARGV[1] lease (task id); ARGV[2] the wake channel prefix; ARGV[3] request id;
#: ARGV[4] how long the free hash keeps the fence, in ms
#: Returns 1 when freed (now or by an earlier arrival of the same request), 0 when
#: that lease does not hold it.
RELEASE_LEASE = _freeing("""
local lock, bad = checked_read()
if bad then return bad end
if ARGV[1] == '' or not lock[1] or lock[1] == '' or lock[3] ~= ARGV[1] then
    if released_here(lock) then return 1 end
    return 0
end
return free(lock)
""")

#: Free the lock whoever holds it (an operator's repair).
#:
#: KEYS[1] the lock hash; KEYS[2] the waiter queue
#: ARGV[1] unused; ARGV[2] the wake channel prefix; ARGV[3] request id;
#: ARGV[4] how long the free hash keeps the fence, in ms
#: Returns 1 when freed, 0 when it was not held.
FORCE_RELEASE = _freeing("""
local lock, bad = checked_read()
if bad then return bad end
if not lock[1] or lock[1] == '' then return 0 end
return free(lock)
""")

#: Leave the waiter queue (a waiter that gave up or got the lock another way), and
#: give back the lock if a release handed it to the waiter meanwhile.
#:
#: KEYS[1] the lock hash; KEYS[2] the waiter queue
#: ARGV[1] owner token; ARGV[2] the wake channel prefix; ARGV[3] request id;
#: ARGV[4] how long the free hash keeps the fence, in ms; ARGV[5] the waiter's
#: queue entry (as ACQUIRE's ARGV[5])
#: Returns 1 when it was queued, 2 when it was handed the lock (now freed), else 0.
LEAVE = _freeing("""
local lock, bad = checked_read()
if bad then return bad end
local waiter = string.match(ARGV[5], '^%["([^"]+)"') or ARGV[5]
if lock[1] == ARGV[1] and lock[2] == $GRANTED_TO .. waiter then
    bad = free(lock)
    if bad ~= 1 then return bad end
    return 2
end
return redis.call('ZREM', KEYS[2], ARGV[5])
""")


def queue_entry(waiter: str, owner: str, ttl_ms: int, lease: str, info: Sequence[str]) -> str:
    """A waiter's entry in the lock's queue (ACQUIRE's ARGV[5]): what a release
    needs to hand the lock over to it, as one JSON array."""
    return json.dumps([waiter, owner, ttl_ms, lease, *info], separators=(",", ":"))


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
FORCE_RELEASE_SCRIPT = Script("FORCE_RELEASE", FORCE_RELEASE)
LEAVE_SCRIPT = Script("LEAVE", LEAVE)


def run_calls(
    transport: Transport,
    calls: Sequence[Call],
    deadline: Deadline,
    then: Sequence[Sequence[Any]] = (),
) -> list[Any]:
    """Run ``calls``, then the plain commands ``then``, in one pipelined round trip.

    Returns one reply (or error) per call and per command. Calls the server does
    not know by digest yet (``NOSCRIPT``: not run) are sent again in a second
    round trip, followed by ``then`` again: the first of each script by text
    (which caches it), the others by digest.
    Transient errors are retried within ``deadline`` (the scripts recognise a retry).

    Raises:
        redis.RedisError: the round trip failed for good.
    """
    commands = [call.by_sha() for call in calls]
    replies = run(transport, commands + list(then) if then else commands, deadline)
    missing = [
        i for i, reply in enumerate(replies[: len(calls)]) if isinstance(reply, NoScriptError)
    ]
    if missing:
        # The text once per script (running it caches it), then by digest.
        sent: set[str] = set()
        resend = []
        for i in missing:
            sha = calls[i].script.sha
            resend.append(calls[i].by_sha() if sha in sent else calls[i].by_text())
            sent.add(sha)
        again = run(transport, [*resend, *then], deadline)
        for i, reply in zip(missing, again, strict=False):
            replies[i] = reply
        replies[len(calls) :] = again[len(missing) :]
    for call, reply in zip(calls, replies, strict=False):
        if not isinstance(reply, NoScriptError):
            transport.scripts.add(call.script.sha)
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
        transport = router.single or router.transport(key)
        try:
            if isinstance(call, Call):
                # run_calls() for one call, inline: this is every acquire's path.
                replies = run(transport, [call.by_sha(), *then], deadline)
                if isinstance(replies[0], NoScriptError):
                    replies = run(transport, [call.by_text(), *then], deadline)
                if not isinstance(replies[0], NoScriptError):
                    transport.scripts.add(call.script.sha)
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


#: The outcomes by number (an enum lookup by value costs a Python call on every acquire).
_ACQUIRED = tuple(sorted(Acquired, key=int))


class AcquireReply(NamedTuple):
    """The ACQUIRE script's reply, typed."""

    outcome: Acquired
    #: The fencing token (``None`` when held by another owner).
    fence: int | None
    #: The holder's remaining TTL in ms (only when held by another owner).
    pttl: int
    #: The holder's lease, if it has one (only when held by another owner).
    holder: str | None
    #: A waiter's place in the queue (only when held and the caller waits).
    position: str | None
    #: The last fencing token handed out for the name (only when held by another owner).
    last_fence: int | None = None

    @classmethod
    def parse(cls, raw: Sequence[Any]) -> AcquireReply:
        outcome = _ACQUIRED[int(raw[0])]
        if outcome is Acquired.HELD:
            return cls(
                outcome,
                None,
                int(raw[1]),
                _text(raw[2]) or None,
                _text(raw[3]) or None,
                int(raw[4]),
            )
        return cls(outcome, int(raw[1]), 0, None, None)


class Released(IntEnum):
    """What a release did."""

    NOT_OWNED = 0  #: this owner did not hold the lock; nothing changed
    FREED = 1  #: the last hold went: the lock is free and waiters were woken
    KEPT = 2  #: one hold dropped, others remain


def _text(value: bytes | str | None) -> str | None:
    """Decode a bytes reply."""
    return value.decode() if isinstance(value, bytes) else value
