"""The Lua scripts behind :class:`~celery_redislock.lock.RedisLock`, and their runner.

Each script runs atomically on the server, so every read-check-write below is a
single step no other client can interleave with. All keys one call touches
share the lock name's ``{hash tag}``, so one call touches a single cluster slot.

A lock name has one string key, which lives as long as the lock is held and,
once released, until the lock's own expiry (when a release finds enough of it
left: then it writes no new expiry) or ``FENCE_TTL`` past the release. Its value
is the lock's fields in a fixed order (:data:`LAYOUT`), separated by
:data:`SEPARATOR`, with the empty ones at the end left out; each field has a
one-letter name (the names below are the constants that hold them;
``celery redislock`` and :mod:`celery_redislock.admin` show the readable names on
the left):

==================  =====  ===================================================
readable name       field  holds
==================  =====  ===================================================
``owner``           ``o``  the owner token of the holder; empty while the lock is free
``fence``           ``f``  the last fencing token handed out for the name
``req``             ``r``  the id of the last request that changed the hold
                           (acquire or release); ``GRANTED_TO`` + waiter id
                           while a hold a release handed to a waiter is not
                           yet confirmed; while free, empty (an earlier
                           version's undo wrote the acquire it undid here,
                           and its owner token after a space: that acquire
                           still takes nothing)
``lease``           ``l``  the lease the holder belongs to (a Celery task id);
                           empty for none
``count``           ``n``  the holder's hold count (re-entrant acquires); empty
                           for 1
``queued``          ``q``  ``"1"`` while waiters may be queued
``released``        ``x``  the ids of the last few releases that freed the
                           lock; then, after ``UNDONE_MARK``, the last few
                           acquires undone, until when they are kept (only
                           once an acquire was undone: see ``RELEASE``)
``drops``           ``d``  the ids of the last few releases that dropped one
                           of the current hold's re-entered holds (and left
                           it held); empty until one did; then, after
                           ``COPIES_MARK``, those of the releases sent again
                           that did, if any
``reserved``        ``w``  the waiters a release just woke without handing
                           them the lock: the free lock is theirs for
                           ``RESERVE_MS``
``reserved_until``  ``u``  until when ``reserved`` holds, in ms
``task``            ``t``  the holder's description (:data:`HOLDER_FIELDS`): the
``state``           ``s``  task name, ``queued``/``running``, the worker node,
``node``            ``h``  its process id and when the hold began; written only
``pid``             ``p``  for a holder that has one
``since``           ``b``
==================  =====  ===================================================

A held plain lock is its first three fields, ``o``, ``f`` and ``r``: 40 bytes
or so, which the server keeps in one allocation with the key's object. A value
is always written whole, with its expiry in the same ``SET`` (``PX``, or
``KEEPTTL`` for a key that has one), so that taking or freeing a lock is one read
and one write. A free lock keeps its fence (and the releases it remembers), so
the fencing counter needs no second key. A token is one more than the last, or
the server clock in microseconds if that is higher, so tokens keep increasing
when the key has expired, the server lost its data, or a replica that missed the
last tokens was promoted. (A server out of memory refuses the write that frees
a lock: the release then deletes the key, which needs no memory.)

Waiters queue in a sorted set beside the lock key (score: when they first queued;
member: the waiter's :func:`queue_entry`), and a release that frees the lock wakes
the first two of them, each through its own process's wake channel
``<prefix>:wake:<process>`` with the waiter's id as the message: a targeted
handoff, not a broadcast, and one spare in case the first waiter has gone.

The first is handed the lock in the same script: its entry holds its owner token,
TTL, lease and description, so the release writes them with the next fencing
token (and the server clock as the description's ``since`` where the entry leaves
that to it, see :func:`queue_entry`: the hold begins now, not when the waiter
queued) and an expiry of :data:`GRANT_MS` (the waiter's own TTL if shorter), marks
the request field ``GRANTED_TO + waiter id`` until the waiter confirms, and sends
the token after :data:`GRANT_MARK`. The waiter holds the lock as it reads the
message, with no round trip of its own; a waiter that has gone keeps the others
out for ``GRANT_MS`` at most. (An acquire of the same owner re-enters such a hold,
unconfirmed as it is, unless it names the waiter as one of its own that gave up:
the hold is nobody's then, and it takes it anew.) (An entry that is only an id is woken to ask, and
the free lock is kept for the woken for ``RESERVE_MS``. So is the first waiter, for
``RESERVE_MS``, and it alone, while the value lists undone acquires: see below.)

The spare's message ends in :data:`SPARE_MARK`; it gives the first a head start
(``celery_redislock.lock.SPARE_HEAD_START``) rather than race it for the lock,
and then asks (taking the lock if the first never came). Behind a handed lock
(:data:`BEHIND_MARK`) it waits for the grant to run out before it asks. The
release takes only the first out of the queue: the spare keeps its place at the
front, so the next release wakes it first (it is then handed the lock, or asks
at once).

**Dead waiters.** A waiter whose process has died is passed over: where its
entry ends in :data:`WATCHED` (its process subscribes on this server), a release
counts the subscribers of its wake channel (``PUBSUB NUMSUB``, before the first
write), and takes the entry out of the queue, waking the next instead, when
there is none: the server dropped the subscription as the process's connection
closed. A cluster waiter's entry ends in :data:`WATCHED_ON_CLUSTER`: a node
counts it only where it serves the lock's slot (one that a slot is half-way
moved to, reached with ``ASKING``, passes nobody over). Each such waiter is
sent :data:`PASSED_MARK` all the same, which only a
process subscribed where the server does not count it hears (it then asks again,
in its place, and no longer asks to be checked). Up to
:data:`PASSED_OVER_LIMIT` entries go per release.

**Retries.** A request can reach the server and run while its reply is lost
(a reset connection, a timeout); the client then sends it again. Every request
that changes state carries a fresh request id, and the scripts recognise their
own second arrival: a retried acquire does not count a second hold, a retried
release does not drop a second one (from ``drops``, even if the holder took the
lock again and released it in between, up to ``DROPS_REMEMBERED`` times; and a
release whose copy sent again dropped the hold first, from the copies ``drops``
keeps apart, for up to ``COPIES_REMEMBERED`` such copies, however many other
releases dropped a hold since), and
a retried release of a lock it already
freed still answers "freed" (from ``released``, even if the lock was taken and
freed again by others in between, up to ``RELEASES_REMEMBERED`` times).

**Undone acquires.** An acquire whose caller gave up on it, unanswered, is undone
(RELEASE, ARGV[10]); the acquire may still be on its way, held up on the network,
and reach the server after its undo. So is one whose caller holds what a later
try of it took (sent again on another connection, with the same request id),
its hold left as it is (RELEASE, ARGV[6]: a fencing token no hold has): an
earlier try may still be on its way too, and would re-enter that hold once its
last change is another, or take the lock after its release. The undo lists it in ``released``
(:data:`UNDONE_MARK`), whatever it finds, and ACQUIRE refuses a listed request,
whoever holds the lock then. The last :data:`UNDONE_REMEMBERED` are listed, for
the acquire's TTL, carried through the holds and frees that follow as the
releases are. A free value that lists them lives as long as they are kept; and
while they are, a release hands the lock to no waiter (a hold handed to a waiter
that has gone would expire after ``GRANT_MS`` and take the list along): it frees
the lock, keeps it for the first waiter for ``RESERVE_MS``, and wakes it to ask
(one round trip more for it), the spare behind it as usual. The usual acquire and
release see no list, and pay nothing for it.
**Expiry.** Every TTL is checked
inside the script before the first write, so no error can leave a key behind
without an expiry.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from enum import IntEnum
from string import Template
from types import MappingProxyType
from typing import Any, NamedTuple

from redis.exceptions import (
    AskError,
    BusyLoadingError,
    MovedError,
    NoScriptError,
    RedisError,
    TryAgainError,
)

from celery_redislock.ids import REQUEST_ID_DIGITS
from celery_redislock.transport import (
    ATTEMPTS,
    LOADING_PAUSE,
    SCRIPT_TEXTS,
    STALLED,
    TRANSIENT,
    Deadline,
    Router,
    Transport,
    ended,
    held_off,
    may_have_run,
    run,
)

#: Highest TTL a script accepts, in ms (about 10 years; see ``lock.MAX_SECONDS``).
MAX_TTL_MS = 315_360_000_000

# The fields of the lock's value (the table in the module docstring).
#: The holder's owner token; empty while the lock is free.
OWNER_FIELD = "o"
#: The holder's lease (a Celery task id); empty for none.
LEASE_FIELD = "l"
#: The holder's hold count; empty for 1.
COUNT_FIELD = "n"
#: The last fencing token handed out for the name.
FENCE_FIELD = "f"
#: The id of the last request that changed the hold.
REQUEST_FIELD = "r"
#: The ids of the last few releases that freed the lock, newest first.
RELEASED_FIELD = "x"
#: The ids of the last few releases that dropped one of the current hold's
#: re-entered holds, newest first.
DROPS_FIELD = "d"
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

#: Readable name -> stored field, for everything a lock's value can hold, in the
#: order the value holds them.
FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "owner": OWNER_FIELD,
        "fence": FENCE_FIELD,
        "req": REQUEST_FIELD,
        "lease": LEASE_FIELD,
        "count": COUNT_FIELD,
        "queued": QUEUED_FIELD,
        "released": RELEASED_FIELD,
        "drops": DROPS_FIELD,
        "reserved": RESERVED_FIELD,
        "reserved_until": RESERVED_UNTIL_FIELD,
        **dict(zip(HOLDER_FIELDS, HOLDER_STORED, strict=True)),
    }
)

#: The stored fields in the order a lock's value holds them: the ones every held
#: lock has first, so that the empty ones at the end can be left out.
LAYOUT = tuple(FIELDS.values())

#: What separates the fields of a lock's value (the ASCII unit separator), which
#: no value may contain: :func:`~celery_redislock.lock.check_stored` refuses it.
SEPARATOR = "\x1f"

#: How long, in ms, a lock freed with waiters queued that it cannot be handed to
#: (queue entries that are only an id) is kept for the (at most two) waiters it woke: a newcomer, or the releaser coming back, queues behind them
#: instead of taking it first. (A lock whose value lists undone acquires is handed
#: to no waiter: it is kept so for the first waiter alone.) Long enough for a
#: woken waiter to ask; short enough that a waiter that vanished in between delays
#: the others only briefly.
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

#: What follows the waiter id in the message a release sends to a waiter it
#: passed over (:data:`WATCHED`) as its process's wake channel had no subscriber on
#: the server: a waiter that reads it all the same is subscribed where the server
#: does not count it, and no longer asks to be checked so.
PASSED_MARK = " passed"

#: The last element of a queue entry whose waiter's wake-up subscription is on the
#: server that holds the entry (see :func:`queue_entry`): a release passes such a
#: waiter over, and takes its entry out of the queue, when its process's wake
#: channel has no subscriber there (the process has died: the server dropped its
#: subscription as its connection closed).
WATCHED = 1

#: :data:`WATCHED` for a waiter on a Redis Cluster: a release counts the
#: subscribers of the waiter's process only where its server serves the lock's
#: slot (not on one that a slot is half-way moved to, which the waiters'
#: processes do not subscribe on yet), and where the user may ask the server
#: (``CLUSTER MYID``, ``KEYSLOT`` and ``SLOTS``).
WATCHED_ON_CLUSTER = 2

#: The most queue entries of dead processes (:data:`WATCHED`) one release takes out
#: of the queue; the next release takes out more.
PASSED_OVER_LIMIT = 100

#: What ends the owner token of a hold that reserves the lock for its lease (a
#: message sent but not yet started). ``<task id>:queued`` is handed to the first
#: other owner of the lease that asks. A retry's, ``<task id>:<retries>:queued``
#: (see :func:`~celery_redislock.reservations.queued_owner`), goes only to an
#: acquire that names it, as any other hold changes owner only when its holder
#: hands it over (an acquire that names the holder's owner token: a task handing
#: its lock to its own retry): a copy of an older delivery of the message does
#: not take it.
#: Two owners of one lease exclude each other like any two owners, so that a
#: message delivered twice never runs twice at once.
RESERVATION_SUFFIX = ":queued"

#: How many recent freeing releases a lock remembers, so that a retried release
#: is recognised even if the lock was taken and freed again in between.
RELEASES_REMEMBERED = 8

#: How many recent releases that dropped one of its re-entered holds (leaving it
#: held) a hold remembers, so that one sent again is recognised even if its holder
#: took the lock again and released it in between (and drops no second hold). Only
#: a re-entered hold stores them: a plain lock's value does not grow.
DROPS_REMEMBERED = 8

#: How many releases sent again (RELEASE's ARGV[9]: :data:`COPY_MARK`) that
#: dropped one of its re-entered holds a hold remembers besides, whatever the
#: releases that dropped one since: the first send of such a release may reach
#: the server long after the copy did (a connection slow to deliver it), with no
#: last change to act on (see ``RedisLock.release``), and is recognised then.
#: Copies are rare (a release whose answer was lost), so this memory is most
#: often empty; its ids follow the others in ``drops``, after :data:`COPIES_MARK`.
COPIES_REMEMBERED = 32

#: What RELEASE's ARGV[9] holds for a release sent again (see
#: :data:`COPIES_REMEMBERED`).
COPY_MARK = "again"

#: What RELEASE's ARGV[10] holds for the undo of an acquire its caller gave up
#: on (see ``RedisLock._undo``).
UNDO_MARK = "undo"

#: What separates, in ``drops``, the last releases that dropped a re-entered hold
#: from the releases sent again that did (:data:`COPIES_REMEMBERED`).
COPIES_MARK = " | "

#: How many undone acquires (RELEASE's ARGV[10]) a lock name remembers, so that
#: each of them, should it arrive after its undo (held up on the network), takes
#: nothing: the last few undos of the name each leave theirs, and later holds and
#: frees of the name carry them on (see :data:`UNDONE_MARK`).
UNDONE_REMEMBERED = 4

#: How many hex digits of the SHA-1 of an undone acquire's owner token its entry
#: keeps after its request id (ids are counted per process: another owner's
#: acquire may carry the same id), so that every entry has the same size.
UNDONE_OWNER_DIGITS = 8

#: What separates, in ``released``, the ids of the releases that freed the lock
#: from the acquires undone since (left out while there are none, as on the usual
#: path): ``<until> <entry>...``, newest first, where ``until`` is the server time
#: (in ms) they are kept until (the latest undo's, ARGV[4] past it), and each
#: entry an undone acquire's request id followed by :data:`UNDONE_OWNER_DIGITS` of
#: its owner's SHA-1. The field is carried through holds and frees as the releases
#: are, and an acquire it lists takes nothing; a free value keeps its key until
#: ``until`` at least, and once ``until`` has passed the next write leaves them out.
UNDONE_MARK = " / "


def _lua(text: str) -> str:
    """``text`` with its ``$NAME`` placeholders filled: the lock's fields as their
    places in the value (``$OWNER`` is ``1``: the scripts hold a lock's fields in a
    Lua array), ``$FIELD_COUNT`` how many there are, ``$HANDED`` what a queue
    entry hands over after its TTL (the lease, then the holder's fields),
    ``$FREE_VALUE`` a Lua pattern that matches a free lock's value as a release
    leaves it when it wakes nobody (capturing its fence, its queued flag and the
    releases it remembers), ``$AFTER_FENCE`` one that matches any lock's value
    from the field after its fence on (capturing its request id, count, queued
    flag, the releases and the drops it remembers, and the position after them),
    and the marks and numbers the scripts share."""
    places = {name.upper(): str(LAYOUT.index(stored) + 1) for name, stored in FIELDS.items()}
    separator = f"\\{ord(SEPARATOR)}"
    between = LAYOUT.index(QUEUED_FIELD) - LAYOUT.index(FENCE_FIELD)
    free_value = f"^{separator}(%d+){separator * between}(1?){separator}([^{separator}]+)$"
    # A field ends at a separator or where the value does (it leaves empty fields
    # at its end out), and is captured where the scripts need it.
    after_fence = [
        f"([^{separator}]*)"
        if stored in (REQUEST_FIELD, COUNT_FIELD, QUEUED_FIELD, RELEASED_FIELD, DROPS_FIELD)
        else f"[^{separator}]*"
        for stored in LAYOUT[LAYOUT.index(FENCE_FIELD) + 1 : LAYOUT.index(DROPS_FIELD) + 1]
    ]
    after_fence_pattern = "^" + f"{separator}?".join(after_fence) + "()"

    def listed(fields: Sequence[str]) -> str:
        return "{" + ", ".join(str(LAYOUT.index(stored) + 1) for stored in fields) + "}"

    return Template(text).substitute(
        places,
        FIELD_COUNT=len(LAYOUT),
        SEPARATOR=f"'{separator}'",
        FREE_VALUE=f"'{free_value}'",
        AFTER_FENCE=f"'{after_fence_pattern}'",
        HANDED=listed((LEASE_FIELD, *HOLDER_STORED)),
        RESERVE_MS=RESERVE_MS,
        SPARE=f"'{SPARE_MARK}'",
        BEHIND=f"'{BEHIND_MARK}'",
        GRANT=f"'{GRANT_MARK}'",
        GRANTED_TO=f"'{GRANTED_TO}'",
        RESERVATION=f"'{RESERVATION_SUFFIX}'",
        GRANT_MS=GRANT_MS,
        PASSED=f"'{PASSED_MARK}'",
        WATCHED=WATCHED,
        WATCHED_ON_CLUSTER=WATCHED_ON_CLUSTER,
        WATCHED_AT=4 + len(HOLDER_FIELDS) + 1,
        WATCHED_END=f"',{WATCHED}]'",
        CLUSTER_END=f"',{WATCHED_ON_CLUSTER}]'",
        PASSED_OVER_LIMIT=PASSED_OVER_LIMIT,
        RELEASE_HISTORY=RELEASES_REMEMBERED * (REQUEST_ID_DIGITS + 1) - 1,
        DROP_HISTORY=DROPS_REMEMBERED * (REQUEST_ID_DIGITS + 1) - 1,
        COPY_HISTORY=COPIES_REMEMBERED * (REQUEST_ID_DIGITS + 1) - 1,
        COPIES=f"'{COPIES_MARK}'",
        UNDONE=f"'{UNDONE_MARK}'",
        UNDONE_DIGITS=UNDONE_OWNER_DIGITS,
        UNDONE_HISTORY=UNDONE_REMEMBERED * (REQUEST_ID_DIGITS + UNDONE_OWNER_DIGITS + 1) - 1,
    )


# Checks every script makes before its first write, so that an error can never
# leave a write half done (a key without expiry, a lock freed but nobody woken):
# the TTLs it was given, and — on servers with ACLs (Redis >= 7) — that the user
# may run each command that follows the first write on those keys and channels
# (a first write the ACL refuses writes nothing, nor does a read it refuses before
# the first write, so neither needs a check ahead: a check can cost the server
# more than the command it guards). _CHECK_TTL checks a TTL; _READ reads a lock's
# value; _HELPERS has the ACL check, the clock, the fencing counter and the
# writer. A script makes each of its ``local function``s anew on every call (13
# of them cost the server about 1.3 us), so a quick path comes before what it
# does not use.
_CHECK_TTL = f"""
local function check_ttl(value)
    local ms = tonumber(value)
    if not ms or ms < 1 or ms > {MAX_TTL_MS} or ms ~= math.floor(ms) then
        return redis.error_reply('ERR celery_redislock: TTL out of range: ' .. tostring(value))
    end
    return nil
end
"""
_READ = _lua("""
-- The lock's fields (an array: a field's place -> its value; an empty field is
-- nil) from the value of its key (false when there is none), up to the last
-- before the holder's description: the scripts only keep that or replace it
-- whole, so it stays unparsed, as ``lock.tail``.
local function decode(raw)
    local lock = {}
    if not raw then return lock end
    local start, place = 1, 1
    while true do
        local stop = string.find(raw, $SEPARATOR, start, true)
        if not stop then
            if start <= #raw then lock[place] = string.sub(raw, start) end
            return lock
        end
        if stop > start then lock[place] = string.sub(raw, start, stop - 1) end
        if place == $TASK - 1 then
            if stop < #raw then lock.tail = string.sub(raw, stop + 1) end
            return lock
        end
        start, place = stop + 1, place + 1
    end
end

-- End the script with the error reply ``message`` (``ERR celery_redislock: ...``),
-- from however deep a function it is raised in. (Redis 6.2's error() takes only a
-- string, to which it adds where it was raised; a table, the reply itself, is
-- Redis 7's and Valkey's, which have redis.REDIS_VERSION.)
local function fail(message)
    if redis.REDIS_VERSION then error({err = message}) end
    error(message, 0)
end

-- The lock's fields from what a GET of its key returned: an error for a key
-- that holds something else (a lock of an older layout, or a string another
-- program wrote: every lock's value has a fencing token, held or free).
local function parse(raw)
    if type(raw) == 'table' and raw.err then
        fail('ERR celery_redislock: ' .. KEYS[1] .. ' is not a lock of this version ' ..
            '(' .. raw.err .. '); stop the workers of other versions, and delete the key ' ..
            'or let it expire')
    end
    local lock = decode(raw)
    if raw and not string.match(lock[$FENCE] or '', '^%d+$$') then
        fail('ERR celery_redislock: ' .. KEYS[1] .. ' holds a value that is not a ' ..
            'lock (it has no fencing token); stop whatever writes it there, and delete ' ..
            'the key or let it expire')
    end
    return lock
end

local function read()
    return parse(redis.pcall('GET', KEYS[1]))
end
""")
_HELPERS = _lua("""
local function now_ms()
    local now = redis.call('TIME')
    return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end

-- The fencing token after ``last`` (a field's value, or nil): one more, or the
-- server clock in microseconds if that is higher. Every token is so (nearly) the
-- time it was handed out at, and a server whose counter is behind the tokens
-- already handed out (first use, expired remnant, a server that lost its data or
-- a replica promoted without the last writes) still hands out higher ones.
-- Returns the server clock it read too (TIME's reply).
local function next_fence(last)
    local now = redis.call('TIME')
    local seeded = tonumber(now[1]) * 1000000 + tonumber(now[2])
    local fence = tonumber(last)
    if fence and fence + 1 > seeded then return fence + 1, now end
    return seeded, now
end

local function denied(command, ...)
    if redis.acl_check_cmd and not redis.acl_check_cmd(command, ...) then
        local target = select('#', ...) > 0 and (' on ' .. select(1, ...)) or ''
        return redis.error_reply('NOPERM this user has no permission to run ' ..
            string.upper(command) .. target .. ', which celery_redislock needs')
    end
    return nil
end

-- A whole number as its digits (concatenated, a large one would be a float).
local function digits(n)
    return string.format('%.0f', n)
end

-- A lock's ``released`` field as its two parts, each nil when empty: the ids of
-- the releases that freed the lock, and the acquires undone (after UNDONE_MARK:
-- ``<until> <entry>...``, newest first).
local function split_released(field)
    local at = field and string.find(field, $UNDONE, 1, true)
    if not at then return field, nil end
    local ids = string.sub(field, 1, at - 1)
    return ids ~= '' and ids or nil, string.sub(field, at + #$UNDONE)
end

-- The ``released`` field of ``ids`` and ``undone`` (either nil), the undone
-- acquires left out once their time has passed (server time ``now``, in ms).
local function join_released(ids, undone, now)
    if undone and (tonumber(string.match(undone, '^%d+')) or 0) > now then
        return (ids or '') .. $UNDONE .. undone
    end
    return ids
end

-- Acquire ``request`` of ``owner`` as an entry among the undone acquires: every
-- entry has the same size, the owner shortened to the start of its SHA-1.
local function undone_entry(request, owner)
    return request .. string.sub(redis.sha1hex(owner), 1, $UNDONE_DIGITS)
end

-- Whether the undone acquires ``undone`` (or nil) list ``entry``.
local function lists(undone, entry)
    return undone ~= nil and string.find(undone .. ' ', ' ' .. entry .. ' ', 1, true) ~= nil
end

-- The undone acquires ``undone`` (or nil) with ``entry`` first, the last
-- UNDONE_REMEMBERED of them, kept ``ms`` past ``now`` at least (those whose time
-- had passed go).
local function add_undone(undone, entry, ms, now)
    local until_ms, entries = now + tonumber(ms), entry
    local old_until, old = string.match(undone or '', '^(%d+) ?(.*)$$')
    if old_until and tonumber(old_until) > now then
        until_ms = math.max(until_ms, tonumber(old_until))
        if lists(undone, entry) then entries = old
        elseif old ~= '' then entries = string.sub(entry .. ' ' .. old, 1, $UNDONE_HISTORY) end
    end
    return digits(until_ms) .. ' ' .. entries
end

-- Write the lock's fields (strings) as its key's value, with an expiry of ``ms``,
-- or the key's own expiry for nil (only for a key that exists: else it would have
-- none). The empty fields at the end are left out; the others are filled in.
-- With ``or_delete``, a write the server refuses for want of memory (``OOM``)
-- deletes the key instead (an expiry of 0, which needs no memory), and returns
-- false; with ``or_delete`` 'keep', it leaves the key as it was, and returns false.
local function write(lock, ms, or_delete)
    local last = lock.tail and $TASK - 1 or $FIELD_COUNT
    while not lock.tail and last > 0 and (lock[last] or '') == '' do last = last - 1 end
    for place = 1, last do
        if not lock[place] then lock[place] = '' end
    end
    local raw = table.concat(lock, $SEPARATOR, 1, last)
    if lock.tail then raw = raw .. $SEPARATOR .. lock.tail end
    local set = or_delete and redis.pcall or redis.call
    local reply
    if ms then reply = set('SET', KEYS[1], raw, 'PX', ms) else reply = set('SET', KEYS[1], raw, 'KEEPTTL') end
    if type(reply) == 'table' and reply.err then
        -- (Redis 6.2 puts where it was raised first: '<source>: <line>: -OOM ...'.)
        if string.sub(reply.err, 1, 4) ~= 'OOM ' and not string.find(reply.err, ': -OOM ', 1, true) then
            -- Any other refusal is raised as redis.call raises it (an error() of the
            -- reply would lose it on Redis 6.2): the same write, again.
            if ms then return redis.call('SET', KEYS[1], raw, 'PX', ms) end
            return redis.call('SET', KEYS[1], raw, 'KEEPTTL')
        end
        if or_delete ~= 'keep' then redis.call('PEXPIRE', KEYS[1], 0) end
        return false
    end
    return reply
end
""")

# Shared by the scripts that free the lock: keep the key (and its fence) as a
# free remnant for ARGV[4] ms (its current expiry for "0"), remember the release
# (ARGV[3]), and hand the lock to the first of the queued waiters, waking the
# first two (wake channel prefix ARGV[2]), past those whose process has died.
_FREE = _lua("""
-- read(), once ARGV[4] (how long the free value keeps the fence) is checked; else
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

-- Whether this cluster node's count of subscribers stands for the waiters of the
-- lock (WATCHED_ON_CLUSTER): it is the primary that serves the lock's slot. A
-- slot half-way moved here (resharding: its keys here, the slot not yet) has its
-- requests sent with ASKING, while the waiters' processes still subscribe on the
-- slot's primary, which publishes to every node but counts only its own
-- subscribers; a waiter passed over here would ask again, and be refused until
-- the move ends. Read once per call, where the ACL lets the user (else the count
-- does not stand: +cluster|myid +cluster|keyslot +cluster|slots ask for it).
local serves_slot = nil
local function counts_here()
    if serves_slot ~= nil then return serves_slot end
    serves_slot = false
    if redis.acl_check_cmd('cluster', 'myid') and redis.acl_check_cmd('cluster', 'slots')
            and redis.acl_check_cmd('cluster', 'keyslot', KEYS[1]) then
        local me = redis.call('CLUSTER', 'MYID')
        local slot = redis.call('CLUSTER', 'KEYSLOT', KEYS[1])
        for _, range in ipairs(redis.call('CLUSTER', 'SLOTS')) do
            if range[1] <= slot and slot <= range[2] then
                serves_slot = range[3][3] == me
            end
        end
    end
    return serves_slot
end

-- Whether a queue entry's waiter has died with its process: its entry says the
-- process is subscribed to its wake channel on this server (WATCHED, or
-- WATCHED_ON_CLUSTER where this server serves the lock's slot), and the channel
-- has no subscriber here (the server dropped it as the process's connection
-- closed). ``known`` keeps what was learnt of each process. Asked only where the
-- ACL can be checked first (Redis 7, Valkey) and lets the user ask: a refusal
-- would be logged; a count the server does not give is one.
local function dead(member, known)
    local tail = string.sub(member, -#$WATCHED_END)
    if tail ~= $WATCHED_END and tail ~= $CLUSTER_END then return false end
    local ok, value = pcall(cjson.decode, member)
    if not ok or type(value) ~= 'table' or type(value[1]) ~= 'string'
            or (value[$WATCHED_AT] ~= $WATCHED and value[$WATCHED_AT] ~= $WATCHED_ON_CLUSTER) then
        return false
    end
    local cluster = value[$WATCHED_AT] == $WATCHED_ON_CLUSTER
    local process = string.match(value[1], '^([^.]+)%.')
    if not process then return false end
    if known[process] == nil then
        local channel = ARGV[2] .. process
        local gone = false
        if redis.acl_check_cmd and redis.acl_check_cmd('pubsub', 'numsub', channel) then
            local reply = redis.pcall('PUBSUB', 'NUMSUB', channel)
            gone = type(reply) == 'table' and not reply.err and tonumber(reply[2]) == 0
                and (not cluster or counts_here())
        end
        known[process] = gone
    end
    return known[process]
end

local function free(lock)
    -- The first two queued waiters still alive, and the dead ones queued ahead of
    -- them (PASSED_OVER_LIMIT at most), read before the first write (refused, a
    -- read writes nothing).
    local next, passed = {}, {}
    if lock[$QUEUED] then
        local known, from, size = {}, 0, 2
        while true do
            local batch = redis.call('ZRANGE', KEYS[2], from, from + size - 1)
            for _, member in ipairs(batch) do
                if #next < 2 then
                    if #passed < $PASSED_OVER_LIMIT and dead(member, known) then
                        passed[#passed + 1] = member
                    else
                        next[#next + 1] = member
                    end
                end
            end
            if #next > 1 or #batch < size then break end
            from, size = from + size, 16
        end
    end
    if #next > 0 or #passed > 0 then
        local bad = denied('zrem', KEYS[2], 'w') or denied('publish', ARGV[2] .. '0', '')
        if bad then return bad end
    end
    -- A free lock keeps its fence, the ids of the last few releases that freed
    -- it, newest first, and the acquires undone while they are kept; what else it
    -- holds is written below for the woken.
    local released, undone = split_released(lock[$RELEASED])
    released = string.sub(released and (ARGV[3] .. ' ' .. released) or ARGV[3], 1, $RELEASE_HISTORY)
    local now = undone and now_ms()
    local new = {[$FENCE] = lock[$FENCE], [$RELEASED] = join_released(released, undone, now)}
    if new[$RELEASED] == released then undone = nil end
    local ms = ARGV[4] ~= '0' and ARGV[4] or nil
    local woken, grant, turn = {}, nil, nil
    for i = 1, #next do
        local id, handed = entry(next[i])
        woken[#woken + 1] = id
        if i == 1 then grant = handed end
    end
    if grant and undone then
        -- Not handed over while the value keeps undone acquires: a hold handed to
        -- a waiter that has gone would take them along as it expires (GRANT_MS).
        -- The first is woken to ask, and the free value (which keeps them) is
        -- kept for it alone: its turn still, ahead of the spare.
        grant, turn = nil, woken[1]
    end
    local messages = {}
    if grant then
        -- Handed over: the first waiter holds the lock from now, for GRANT_MS
        -- at most, until it confirms the hold by renewing it.
        local fence, clock = next_fence(lock[$FENCE])
        new[$OWNER], new[$FENCE], new[$REQ] = grant[2], digits(fence), $GRANTED_TO .. woken[1]
        for i, place in ipairs($HANDED) do
            local value = grant[3 + i]
            if place == $SINCE and type(value) == 'table' then
                -- [since]: the waiter's since, to be when its hold begins (see
                -- queue_entry): now, the server clock, as the waiter's own
                -- description would say it (seconds, the milliseconds cut).
                value = clock[1] .. string.format('.%03d', math.floor(tonumber(clock[2]) / 1000))
            end
            if type(value) == 'string' then new[place] = value end
        end
        ms = math.min(tonumber(grant[3]), $GRANT_MS)
        messages[1] = woken[1] .. $GRANT .. digits(fence)
    elseif #woken > 0 then
        -- Kept for the waiters it wakes: for RESERVE_MS, nobody else takes it.
        new[$RESERVED] = turn or table.concat(woken, ' ')
        new[$RESERVED_UNTIL] = digits(now_ms() + $RESERVE_MS)
        messages[1] = woken[1]
    end
    if undone and not grant then
        -- Not handed over: the free value lives while it keeps undone acquires.
        local left = tonumber(string.match(undone, '^%d+')) - now
        if (ms and tonumber(ms) or redis.call('PTTL', KEYS[1])) < left then ms = left end
    end
    -- The second is the spare: it lets the first go ahead (behind a handed lock,
    -- it asks only if the grant runs out first).
    if #woken > 1 then messages[2] = woken[2] .. (grant and $BEHIND or '') .. $SPARE end
    if #next > 0 then new[$QUEUED] = '1' end
    if not write(new, ms, true) then
        -- Out of memory, the key deleted: nothing was handed over or kept for
        -- the woken, who are woken to ask (and fail while memory is short), and
        -- so is every other waiter, rather than at its next re-check.
        messages[1] = woken[1]
        if #woken > 1 then
            messages[2] = woken[2] .. $SPARE
            for _, member in ipairs(redis.call('ZRANGE', KEYS[2], #passed + 2, -1)) do
                woken[#woken + 1] = entry(member)
                messages[#woken] = woken[#woken]
            end
        end
    end
    if #next > 0 then
        -- Only the first leaves the queue: the second (the spare) leaves it only
        -- by taking the lock, so while it lets the first go ahead the next
        -- release still finds it at the front.
        passed[#passed + 1] = next[1]
    end
    if #passed > 0 then redis.call('ZREM', KEYS[2], unpack(passed)) end
    for i, message in ipairs(messages) do
        local process = string.match(woken[i], '^([^.]+)%.')
        if process then
            redis.call('PUBLISH', ARGV[2] .. process, message)
        end
    end
    -- The dead are told too: should one be alive all the same (its subscription
    -- on another server that passes the message on), it is woken, asks again,
    -- and keeps its place (see lock.RedisLock._wait).
    for i = 1, #passed - (#next > 0 and 1 or 0) do
        local id = string.match(passed[i], '^%["([^"]+)"')
        local process = id and string.match(id, '^([^.]+)%.')
        if process then redis.call('PUBLISH', ARGV[2] .. process, id .. $PASSED) end
    end
    return 1
end

-- Whether request ARGV[3] is one of the releases that freed the lock lately.
local function released_here(lock)
    local released = split_released(lock[$RELEASED])
    return released and string.find(' ' .. released .. ' ', ' ' .. ARGV[3] .. ' ', 1, true)
end
""")

# A waiter's queue entry in its other forms: unmarked if it is marked (WATCHED or
# WATCHED_ON_CLUSTER), else marked either way (see unwatched()). A waiter sends
# its own marked form or the unmarked one as its subscription comes and goes,
# and keeps one entry in the queue.
_OTHER_ENTRY = _lua("""
local function other_entries(member)
    local tail = string.sub(member, -#$WATCHED_END)
    if tail == $WATCHED_END or tail == $CLUSTER_END then
        return {string.sub(member, 1, -#$WATCHED_END - 1) .. ']'}
    end
    local open = string.sub(member, 1, -2)
    return {open .. $WATCHED_END, open .. $CLUSTER_END}
end
""")

#: Take the lock, take it again (re-entrant), take over the reservation of the
#: caller's lease (:data:`RESERVATION_SUFFIX`) or a hold of that lease its holder
#: hands over; a waiter that finds it held joins the queue.
#:
#: KEYS[1] the lock key; KEYS[2] the waiter queue
#: ARGV[1] owner token; ARGV[2] TTL in ms; ARGV[3] lease ("" for none);
#: ARGV[4] request id; ARGV[5] the waiter's queue entry ("" when not waiting: not
#: queued): the JSON array ``[waiter id, owner token, TTL in ms, lease,
#: description...]`` a release hands the lock over with (see :func:`queue_entry`);
#: ARGV[6] the waiter's queue position from an earlier reply ("" the first time);
#: ARGV[7] optionally, the holder's description, written with the hold: one value
#: per HOLDER_FIELDS name, in that order, up to the last that is not empty, joined
#: by SEPARATOR (absent or empty for none); ARGV[8] optionally, the owner token
#: of a hold of the same lease the caller takes over (handed over by its holder,
#: or a retry's reservation; absent or empty for none); ARGV[9] optionally, the
#: ids of the caller's waiters that gave up, space-separated: a hold a release
#: handed to one of them (found unconfirmed) is nobody's, and is taken as a new
#: one, not re-entered (empty for none); ARGV[10] optionally, non-empty to take
#: over the hold ARGV[8] names and nothing else: a lock that owner no longer holds
#: (free, or held by another) is not taken, as the hold to move is gone; ARGV[11]
#: optionally, with ARGV[10], the wake channel prefix (``<prefix>:wake:``): the
#: waiters of the caller's lease queued behind the hold it moves (a retry that
#: started while the execution that sent it still ran) are woken as it moves, to
#: take it over at once rather than at their next re-check (absent or empty: none)
#: Returns {1, fence, releases} when newly taken (or taken over, or a hold a release
#: handed to this waiter confirmed; releases: the ids of the releases the lock
#: remembers, absent for none), {2, fence} when re-entered,
#: {0, ms to wait, holder lease, queue position, fence, holder owner, held} when
#: another owner holds it (held 1) or it was just freed for the waiters a release
#: woke, and the caller is not one (held 0), where fence is the last token handed
#: out for the name (a hold a release hands to the caller later gets a higher one)
#: and the holder's owner token is given only when it holds the caller's lease;
#: {0, 0, "", "", fence, "", 0} for a request undone before it arrived (listed
#: as undone in ``released``: see RELEASE, ARGV[10]), which takes nothing,
#: whoever holds the lock. A retry of a
#: request that already landed returns what the first arrival did.
ACQUIRE = (
    _CHECK_TTL
    + _lua("""
-- A lock taken by a caller that does not wait is written at once, before the
-- other helpers are made or the value parsed, where its name has no key (new, or
-- its free value expired: a task with new arguments) or a free value as a release
-- leaves it when it wakes nobody (a fence, the queued flag and the releases
-- remembered: a task with the same arguments as before). Anything else goes on.
local current = redis.pcall('GET', KEYS[1])
if ARGV[5] == '' and (ARGV[10] or '') == '' and type(current) ~= 'table'
        and not check_ttl(ARGV[2]) then
    local last, queued, released
    if current then
        last, queued, released = string.match(current, $FREE_VALUE)
        -- (Undone acquires, rarely kept, are checked below.)
        if released and string.find(released, $UNDONE, 1, true) then last = nil end
    end
    if not current or last then
        -- As next_fence() makes it: one more than the last, or the server clock
        -- in microseconds (its seconds and microseconds side by side) if higher.
        local now = redis.call('TIME')
        local digits = now[1] .. string.sub('00000' .. now[2], -6)
        local fence = tonumber(digits)
        if last and tonumber(last) + 1 > fence then
            fence = tonumber(last) + 1
            digits = string.format('%.0f', fence)
        end
        local value = ARGV[1] .. $SEPARATOR .. digits .. $SEPARATOR .. ARGV[4]
        local info = ARGV[7] ~= '' and ARGV[7]
        if info or released then
            -- The lease, no count, the queued flag, the releases; then, after the
            -- reservation's two fields, the holder's description.
            value = value .. $SEPARATOR .. ARGV[3] .. $SEPARATOR .. $SEPARATOR .. (queued or '') ..
                $SEPARATOR .. (released or '')
            if info then
                value = value .. string.rep($SEPARATOR, $TASK - $RELEASED) .. info
            end
        elseif ARGV[3] ~= '' then
            value = value .. $SEPARATOR .. ARGV[3]
        end
        redis.call('SET', KEYS[1], value, 'PX', ARGV[2])
        return {1, fence, released}
    end
end
""")
    + _READ
    + _HELPERS
    + _OTHER_ENTRY
    + _lua("""
local bad = check_ttl(ARGV[2])
if bad then return bad end
-- The waiter id, the first element of its queue entry.
local waiter = ARGV[5] ~= '' and (string.match(ARGV[5], '^%["([^"]+)"') or ARGV[5]) or ''
-- Whether owner token ``owner`` reserves the lock for ``lease`` (a message's or a
-- retry's reservation: see RESERVATION_SUFFIX).
local function reservation(owner, lease)
    if lease == '' then return false end
    if owner == lease .. $RESERVATION then return true end
    return string.sub(owner, 1, #lease + 1) == lease .. ':'
        and string.match(string.sub(owner, #lease + 2), '^%d+' .. $RESERVATION .. '$$') ~= nil
end
local lock = parse(current)
-- This request's caller gave up on it and undid it (see RELEASE, ARGV[10]): it
-- arrives after its undo (held up on the network), and takes nothing, whoever
-- holds the lock now. (A free value an earlier version wrote names the last
-- undone acquire alone, in its request field, as ``<request id> <owner>``.)
local released, undone = split_released(lock[$RELEASED])
if (not lock[$OWNER] and lock[$REQ] == ARGV[4] .. ' ' .. ARGV[1])
        or (undone and lists(undone, undone_entry(ARGV[4], ARGV[1]))
            and (tonumber(string.match(undone, '^%d+')) or 0) > now_ms()) then
    return {0, 0, '', '', tonumber(lock[$FENCE]) or 0, '', 0}
end
-- A move of ARGV[8]'s hold (ARGV[10]) takes nothing else: once that hold has
-- gone (taken over, run and released by the delivery it was kept for), taking
-- the lock would make a reservation nobody takes over again. (Unless this very
-- request made the move: a try sent again after its reply was lost.)
if (ARGV[10] or '') ~= '' and (lock[$OWNER] ~= ARGV[8] or lock[$LEASE] ~= ARGV[3])
        and not (lock[$OWNER] == ARGV[1] and lock[$REQ] == ARGV[4]) then
    local held = lock[$OWNER] and 1 or 0
    return {0, held == 1 and redis.call('PTTL', KEYS[1]) or 0, lock[$LEASE] or '', '',
            tonumber(lock[$FENCE]) or 0, '', held}
end
-- A hold a release handed to a waiter of the caller's that gave up (its queue
-- entry outlived it: a leave that never landed, or a failover that brought the
-- entry back) is held by nobody: the caller takes it anew, below, rather than
-- re-enter it. (A hold handed to any other waiter of this owner may be held by
-- it, unconfirmed: a waiter holds a handed lock as it reads its wake-up.)
local orphan = false
if lock[$OWNER] == ARGV[1] and (ARGV[9] or '') ~= '' and lock[$REQ]
        and string.sub(lock[$REQ], 1, #$GRANTED_TO) == $GRANTED_TO then
    local gone = ' ' .. string.sub(lock[$REQ], #$GRANTED_TO + 1) .. ' '
    orphan = string.find(' ' .. ARGV[9] .. ' ', gone, 1, true) ~= nil
end
if lock[$OWNER] == ARGV[1] and not orphan then
    local fence = tonumber(lock[$FENCE])
    if waiter ~= '' and lock[$REQ] == $GRANTED_TO .. waiter then
        -- Handed to this waiter by a release: the hold is confirmed, with its full TTL.
        lock[$REQ] = ARGV[4]
        write(lock, ARGV[2])
        return {1, fence, lock[$RELEASED]}
    end
    local count = tonumber(lock[$COUNT]) or 1
    if lock[$REQ] == ARGV[4] then
        redis.call('PEXPIRE', KEYS[1], ARGV[2])
        return {count == 1 and 1 or 2, fence, lock[$RELEASED]}
    end
    if reservation(ARGV[1], ARGV[3]) then
        -- A lease's reservation stands for one message: a second is a duplicate.
        return {0, redis.call('PTTL', KEYS[1]), ARGV[3], '', fence, ARGV[1]}
    end
    lock[$COUNT], lock[$REQ] = tostring(count + 1), ARGV[4]
    write(lock, ARGV[2])
    return {2, fence}
end
-- How long the caller can expect to wait: the holder's remaining TTL, or the
-- time left to the waiters a release woke (a free lock is theirs for a moment).
local wait_ms, holder, owner, taken = nil, '', '', 0
-- Another owner's hold of the caller's lease is the caller's to take if it is
-- the lease's reservation, or the caller names it (see RESERVATION_SUFFIX).
if lock[$OWNER] and not orphan and (ARGV[3] == '' or lock[$LEASE] ~= ARGV[3]
        or (lock[$OWNER] ~= ARGV[3] .. $RESERVATION and lock[$OWNER] ~= ARGV[8])) then
    wait_ms, holder, taken = redis.call('PTTL', KEYS[1]), lock[$LEASE] or '', 1
    if ARGV[3] ~= '' and holder == ARGV[3] then owner = lock[$OWNER] end
elseif lock[$RESERVED]
        and not (waiter ~= '' and string.find(' ' .. lock[$RESERVED] .. ' ', ' ' .. waiter .. ' ', 1, true)) then
    local left = tonumber(lock[$RESERVED_UNTIL]) - now_ms()
    if left > 0 then wait_ms = left end
end
if wait_ms then
    local fence = tonumber(lock[$FENCE]) or 0
    if ARGV[5] == '' then return {0, wait_ms, holder, '', fence, owner, taken} end
    local position, others = ARGV[6], other_entries(ARGV[5])
    bad = denied('pexpire', KEYS[2], '1') or (not lock[$QUEUED] and denied('set', KEYS[1], 'w'))
    if bad then return bad end
    if position == '' then
        -- Not known to the waiter (the answer that gave it was lost): the place
        -- its entry has, in either form (see unwatched()), else a new one. (An
        -- increment of 0 reads a score with ZADD, which the ACL gives already.)
        position = redis.call('ZADD', KEYS[2], 'XX', 'INCR', 0, ARGV[5])
        for _, other in ipairs(others) do
            position = position or redis.call('ZADD', KEYS[2], 'XX', 'INCR', 0, other)
        end
        if not position then
            local now = redis.call('TIME')
            position = now[1] .. string.format('%06d', tonumber(now[2]))
        end
    end
    -- The waiter's entry in its other form, if it is there.
    redis.call('ZREM', KEYS[2], unpack(others))
    redis.call('ZADD', KEYS[2], 'NX', position, ARGV[5])
    if redis.call('PTTL', KEYS[2]) < wait_ms + tonumber(ARGV[2]) then
        redis.call('PEXPIRE', KEYS[2], wait_ms + tonumber(ARGV[2]))
    end
    if not lock[$QUEUED] then
        -- (The key exists, held or kept for the woken, and keeps its expiry.)
        lock[$QUEUED] = '1'
        write(lock)
    end
    return {0, wait_ms, holder, position, fence, owner, taken}
end
-- Only what this hold needs: what an earlier holder left (a lease, a count, a
-- reservation for the woken, a description) goes. The undone acquires stay, while
-- they are kept.
local fence = next_fence(lock[$FENCE])
local new = {[$OWNER] = ARGV[1], [$FENCE] = digits(fence), [$REQ] = ARGV[4],
             [$LEASE] = ARGV[3], [$QUEUED] = lock[$QUEUED], [$RELEASED] = lock[$RELEASED]}
if undone then new[$RELEASED] = join_released(released, undone, now_ms()) end
new.tail = ARGV[7] ~= '' and ARGV[7] or nil
if ARGV[5] ~= '' then
    bad = denied('zrem', KEYS[2], 'w')
    if bad then return bad end
    if not new[$QUEUED] then
        -- The flag went with a key that expired (a grant nobody confirmed): others
        -- queued behind this waiter must still be woken by its release.
        local first = redis.call('ZRANGE', KEYS[2], 0, 1)
        if #first > 1 or (first[1] and first[1] ~= ARGV[5]) then new[$QUEUED] = '1' end
    end
end
write(new, ARGV[2])
if ARGV[5] ~= '' then
    redis.call('ZREM', KEYS[2], ARGV[5], unpack(other_entries(ARGV[5])))
elseif (ARGV[11] or '') ~= '' and new[$QUEUED] and ARGV[3] ~= '' then
    -- A hold moved to a reservation: the queued waiters of its lease are woken
    -- to ask again. Only a wake-up, after the write (a read or a publish the
    -- server refuses leaves them to their next re-check).
    local queued = redis.pcall('ZRANGE', KEYS[2], 0, -1)
    if type(queued) == 'table' and not queued.err then
        for _, member in ipairs(queued) do
            local ok, value = pcall(cjson.decode, member)
            if ok and type(value) == 'table' and value[4] == ARGV[3]
                    and type(value[1]) == 'string' then
                local process = string.match(value[1], '^([^.]+)%.')
                if process then redis.pcall('PUBLISH', ARGV[11] .. process, value[1]) end
            end
        end
    end
end
return {1, fence, new[$RELEASED]}
""")
)


def _freeing(body: str, first: str = "") -> str:
    """A script that may free the lock: ``body`` after the shared helpers and
    :data:`_FREE`, and before them all ``first`` (a quick path, which makes none of
    their functions: a script makes each anew on every call)."""
    return _lua(first) + _READ + _CHECK_TTL + _HELPERS + _FREE + _lua(body)


#: Drop one hold; free the lock and wake the next waiters when the last hold goes.
#:
#: KEYS[1] the lock key; KEYS[2] the waiter queue
#: ARGV[1] owner token; ARGV[2] the wake channel prefix (``<prefix>:wake:``);
#: ARGV[3] request id; ARGV[4] how long the free value keeps the fence, in ms, or
#: "0" to leave its expiry (the lock's own) as it is: the caller knows enough of
#: it is left; ARGV[5] "" or the request id of the last change to the hold the
#: caller knows of (the acquire this release undoes, or the last request of the
#: holder of an inner hold): it then acts only if that still is the last change;
#: ARGV[6] optionally, the fencing token of the hold ("" or absent: unknown): a
#: hold of this owner with another token is a later one, which it leaves alone;
#: ARGV[7] optionally, the releases the lock remembered as it was taken (what
#: ACQUIRE returned with the hold); ARGV[8] optionally, "read" to read the lock
#: before writing (others are likely queued: the one-write path would only have to
#: put the lock back; "" or absent: not); ARGV[9] optionally, :data:`COPY_MARK` for
#: a release sent again (the same request id as its first send): one that drops a
#: re-entered hold is remembered among the copies (:data:`COPIES_REMEMBERED`), so
#: that its first send, arriving after it, changes nothing however many releases
#: dropped a hold in between; ARGV[10] optionally, non-empty for the undo of
#: acquire ARGV[5] (its caller gave up on it, unanswered): whatever it finds
#: (the hold the acquire made, which it frees or drops one of as above; a free
#: lock, or no key, which it writes; another hold, which it leaves held), it lists
#: that acquire (with this owner) among the undone acquires of ``released``
#: (:data:`UNDONE_MARK`, the last :data:`UNDONE_REMEMBERED`) for ARGV[4] ms
#: (which is then not "0") at least, carried through the holds and frees that
#: follow, and ACQUIRE refuses that request, should it arrive after its undo
#: (held up on the network); an undo that names a fencing token no hold has
#: (ARGV[6] ``0``) leaves every hold as it is, and only lists the acquire (one
#: whose caller holds what a later try of it took)
#: Returns 1 when freed (by this request, now or on an earlier arrival), 2 when a
#: hold remains, 0 when not owned (nothing changed but what ARGV[10] writes).
RELEASE = _freeing(
    first="""
-- What the quick path found where it does not free the lock: the key's value
-- (false for none), decoded below; nil where it did not run or was refused.
local found
if ARGV[4] == '0' and ARGV[5] == '' and (ARGV[6] or '') ~= '' and ARGV[8] ~= 'read'
        and not string.find(ARGV[7] or '', $UNDONE, 1, true) then
    -- The usual last hold, keeping its key's expiry, is freed by one write: the
    -- free value, set at once where there is a key, returns the lock as it was.
    -- A hold of this owner and token, single, with nobody queued, is freed by it
    -- (or by one more write if the releases it remembered were not as the caller
    -- said); anything else is put back as it was and goes on below.
    -- The free value: the fence, and this release before the ``earlier`` ones.
    local function freed(earlier)
        local released = ARGV[3]
        if (earlier or '') ~= '' then
            released = string.sub(ARGV[3] .. ' ' .. earlier, 1, $RELEASE_HISTORY)
        end
        return $SEPARATOR .. ARGV[6] .. string.rep($SEPARATOR, $RELEASED - $FENCE) .. released
    end
    local old = redis.pcall('SET', KEYS[1], freed(ARGV[7]), 'KEEPTTL', 'XX', 'GET')
    if type(old) ~= 'table' then
        -- Checked with one match rather than decoded: this owner and token come
        -- first, then a request id other than this release's, no count, not
        -- queued, the releases remembered (and no undone acquires), drops other
        -- than this release (one sent again after it dropped an inner hold), and no
        -- reservation after them.
        local mine = ARGV[1] .. $SEPARATOR .. ARGV[6] .. $SEPARATOR
        if old and string.sub(old, 1, #mine) == mine then
            local request, count, queued, released, drops, rest =
                string.match(old, $AFTER_FENCE, #mine + 1)
            -- (What follows the drops, if anything, starts with a separator:
            -- ``rest`` is where.)
            if request ~= ARGV[3] and count == '' and queued == ''
                    and not string.find(released, $UNDONE, 1, true)
                    and (drops == '' or not string.find(' ' .. drops .. ' ', ' ' .. ARGV[3] .. ' ', 1, true))
                    and (rest > #old or string.sub(old, rest + 1, rest + 1) == $SEPARATOR) then
                if released ~= (ARGV[7] or '') then
                    redis.call('SET', KEYS[1], freed(released), 'KEEPTTL')
                end
                return 1
            end
        end
        if old then redis.call('SET', KEYS[1], old, 'KEEPTTL') end
        found = old or false
    end
    -- (A refused SET wrote nothing: read() and what follows answer as they would.)
end
""",
    body="""
local lock = found ~= nil and decode(found) or nil
if not lock then
    local bad = ARGV[4] ~= '0' and check_ttl(ARGV[4]) or nil
    if bad then return bad end
    lock = read()
end
-- The undo of acquire ARGV[5] lists it among the undone acquires whatever it
-- finds (with its owner: request ids are counted per process, and another
-- owner's acquire may carry the same id), for ARGV[4] ms at least, so that it
-- takes nothing should it arrive after its undo; every write below keeps them.
local undone = (ARGV[10] or '') ~= '' and ARGV[4] ~= '0'
if undone then
    local now, released, listed = now_ms(), split_released(lock[$RELEASED])
    listed = add_undone(listed, undone_entry(ARGV[5], ARGV[1]), ARGV[4], now)
    lock[$RELEASED] = join_released(released, listed, now)
end
if undone and not lock[$OWNER] then
    -- Nothing to undo: the acquire has not arrived yet, or arrives never, or
    -- it took the lock and was undone already. The free value (made here if
    -- there is no key) keeps it listed, for ARGV[4] ms, or longer as the key lives.
    if not lock[$FENCE] then lock[$FENCE] = '0' end
    local ms = ARGV[4]
    if redis.call('PTTL', KEYS[1]) > tonumber(ms) then ms = nil end
    write(lock, ms, true)
    if released_here(lock) then return 1 end
    return 0
end
-- Another owner's hold, or this owner's later one (with a new token): not the
-- hold this release was for. It may be sent again after it freed the lock.
if lock[$OWNER] ~= ARGV[1] or ((ARGV[6] or '') ~= '' and lock[$FENCE] ~= ARGV[6]) then
    if released_here(lock) then return 1 end
    -- (An undo lists its acquire in the hold, which keeps it as it is freed; not
    -- while the server is short of memory, the hold left as it is.)
    if undone then write(lock, nil, 'keep') end
    return 0
end
if lock[$REQ] == ARGV[3] then return 2 end
-- One that dropped an inner hold of this hold, sent again after later changes
-- (its holder took the lock again and released it): it did its part then.
local drops = lock[$DROPS]
if drops and string.find(' ' .. drops .. ' ', ' ' .. ARGV[3] .. ' ', 1, true) then return 2 end
if ARGV[5] ~= '' and lock[$REQ] ~= ARGV[5] then
    if undone then write(lock, nil, 'keep') end
    return 0
end
local count = (tonumber(lock[$COUNT]) or 1) - 1
if count > 0 then
    lock[$COUNT], lock[$REQ] = count > 1 and tostring(count) or nil, ARGV[3]
    -- The drops, newest first: the last few, then (after the mark) those of the
    -- releases sent again, which later drops do not push out: the first send of
    -- such a release may still be on its way, and would find nothing else.
    local recent, copies = drops or '', nil
    local mark = string.find(recent, $COPIES, 1, true)
    if mark then
        recent, copies = string.sub(recent, 1, mark - 1), string.sub(recent, mark + #$COPIES)
    end
    if (ARGV[9] or '') ~= '' then
        copies = string.sub(copies and (ARGV[3] .. ' ' .. copies) or ARGV[3], 1, $COPY_HISTORY)
    else
        recent = string.sub(recent ~= '' and (ARGV[3] .. ' ' .. recent) or ARGV[3], 1, $DROP_HISTORY)
    end
    lock[$DROPS] = copies and (recent .. $COPIES .. copies) or recent
    write(lock)
    return 2
end
return free(lock)
""",
)

#: Set the remaining TTL of a held lock (sending it twice does no harm).
#:
#: KEYS[1] the lock key
#: ARGV[1] owner token; ARGV[2] the new TTL in ms; ARGV[3] optionally, the
#: fencing token of the hold ("" or absent: unknown): a hold of this owner with
#: another token is not the caller's (a copy of an earlier hold of the owner on a
#: primary promoted since the caller took it anew elsewhere), and is left alone
#: Returns 1 when extended, 0 when not owned (nothing changed).
EXTEND = (
    _CHECK_TTL
    + _READ
    + _lua("""
local bad = check_ttl(ARGV[2])
if bad then return bad end
-- Only the owner and the fencing token, the value's first two fields (a held
-- lock has a third), are compared: nothing else is parsed.
local raw = redis.pcall('GET', KEYS[1])
if type(raw) == 'table' then parse(raw) end
local mine = ARGV[1] .. $SEPARATOR
if (ARGV[3] or '') ~= '' then mine = mine .. ARGV[3] .. $SEPARATOR end
if not raw or string.sub(raw, 1, #mine) ~= mine then
    return 0
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""")
)

#: Free the lock whatever its hold count, if a given lease holds it. Used when a
#: Celery task ends in a way its own process cannot report (revoked in the queue,
#: terminated), where only the task id is known.
#:
#: KEYS[1] the lock key; KEYS[2] the waiter queue
#: ARGV[1] lease (task id); ARGV[2] the wake channel prefix; ARGV[3] request id;
#: ARGV[4] how long the free value keeps the fence, in ms; ARGV[5] optionally,
#: the fencing token of the hold to free ("" or absent: whatever hold of the
#: lease): sent again to a primary promoted since it freed that hold, it leaves a
#: later hold of the lease alone
#: Returns {1, fence of the hold} when freed now, 1 when freed by an earlier
#: arrival of the same request, 0 when that lease (with that token) does not hold it.
RELEASE_LEASE = _freeing("""
local lock, bad = checked_read()
if bad then return bad end
if ARGV[1] == '' or not lock[$OWNER] or lock[$LEASE] ~= ARGV[1]
        or ((ARGV[5] or '') ~= '' and lock[$FENCE] ~= ARGV[5]) then
    if released_here(lock) then return 1 end
    return 0
end
local fence = lock[$FENCE]
bad = free(lock)
if bad ~= 1 then return bad end
return {1, fence}
""")

#: Free the lock whoever holds it (an operator's repair), or only the hold an
#: operator was shown: its fencing token names that hold alone, so a lock handed
#: to someone else since it was listed (a waiter, a new taker) is left alone.
#:
#: KEYS[1] the lock key; KEYS[2] the waiter queue
#: ARGV[1] the fencing token of the hold to free, or "" for whatever hold there
#: is; ARGV[2] the wake channel prefix; ARGV[3] request id; ARGV[4] how long the
#: free value keeps the fence, in ms
#: Returns 1 when freed (now, or by an earlier arrival of the same request: a
#: retry never frees the hold the first arrival handed to a waiter), 0 when it
#: was not held, 2 when another hold than ARGV[1] holds it (nothing changed).
FORCE_RELEASE = _freeing("""
local lock, bad = checked_read()
if bad then return bad end
if released_here(lock) then return 1 end
if not lock[$OWNER] then return 0 end
if ARGV[1] ~= '' and lock[$FENCE] ~= ARGV[1] then return 2 end
return free(lock)
""")

#: Leave the waiter queue (a waiter that gave up or got the lock another way), and
#: give back the lock if a release handed it to the waiter meanwhile.
#:
#: KEYS[1] the lock key; KEYS[2] the waiter queue
#: ARGV[1] owner token; ARGV[2] the wake channel prefix; ARGV[3] request id;
#: ARGV[4] how long the free value keeps the fence, in ms; ARGV[5] the waiter's
#: queue entry (as ACQUIRE's ARGV[5])
#: Returns 1 when it was queued, 2 when it was handed the lock (now freed), else 0.
LEAVE = _freeing(
    _OTHER_ENTRY
    + """
local lock, bad = checked_read()
if bad then return bad end
local waiter = string.match(ARGV[5], '^%["([^"]+)"') or ARGV[5]
if lock[$OWNER] == ARGV[1] and lock[$REQ] == $GRANTED_TO .. waiter then
    bad = free(lock)
    if bad ~= 1 then return bad end
    return 2
end
return math.min(1, redis.call('ZREM', KEYS[2], ARGV[5], unpack(other_entries(ARGV[5]))))
"""
)

#: Leave word, beside the lock, that a delivery of retry ARGV[2] of lease ARGV[1]
#: ended without running (it failed to start, or was dropped as revoked) while a
#: hold of an earlier delivery of its message holds the lock: the execution that
#: sent it with ``self.retry(throw=False)`` and runs on (or a reservation of an
#: earlier delivery, which a failed start passes on to this retry), which hands
#: its hold to that retry's reservation as it ends, and reads the word then
#: (nobody else would ever take that reservation over). One step, so that the
#: word is left only while such a hold holds the lock: once it has been handed to
#: the retry's reservation, the caller frees the reservation itself.
#:
#: A message without a retry count (ARGV[2] ``0``) that its task id's execution
#: sent from its body (``self.replace()``, ``apply_async(task_id=...)``) names no
#: earlier delivery by its count: the word is left only for the hold ARGV[6]
#: names (the sender's owner token, which the message carries), or, ARGV[6]
#: empty, for any execution's hold of the lease (a revoke of the task id, which
#: drops every message that carries it).
#:
#: The word is ``<fence> <count> <ms> <id>...``: the fencing token of the hold it
#: is meant for (so that only that hold, or one it passes on to, acts on it; a
#: later hold of the same lease, the task id reused or the message delivered
#: again, never does), what to do instead (``0 0``: free the lock; else pass it on
#: to retry ``<count>``'s reservation for ``<ms>`` ms), and the ids of the
#: deliveries that ended so (how many of the retry's copies did; the same id
#: again, a request sent again, counts once). A pass-on wins over a free.
#:
#: KEYS[1] the lock key; KEYS[2] the word's key
#: ARGV[1] lease (task id); ARGV[2] the retry count; ARGV[3] the word's TTL in ms;
#: ARGV[4] what the hold does instead (``<count> <ms>``, ``0 0`` to free it);
#: ARGV[5] the id of this delivery's word (no spaces); ARGV[6] for a count of 0,
#: the owner token of the hold the word is for ('' any execution's)
#: Returns 1 when the word was left, 2 when the retry's reservation holds the lock
#: (nothing changed), 0 otherwise (nothing changed).
DROPPED = (
    _CHECK_TTL
    + _READ
    + _lua("""
local bad = check_ttl(ARGV[3])
if bad then return bad end
local lock = read()
local owner = lock[$OWNER]
if not owner or ARGV[1] == '' or lock[$LEASE] ~= ARGV[1] then return 0 end
-- The retry count of the holder: a reservation's (``<lease>:queued`` is the first
-- delivery's, ``<lease>:<count>:queued`` a retry's), or an execution's (its owner
-- token ends in ``:<count>``, or names none: 0).
local count
local suffix = $RESERVATION
local reserved = string.sub(owner, -#suffix) == suffix
if reserved then
    if string.sub(owner, 1, #ARGV[1]) ~= ARGV[1] then return 0 end
    local middle = string.sub(owner, #ARGV[1] + 1, -#suffix - 1)
    count = middle == '' and 0 or tonumber(string.match(middle, '^:(%d+)$$') or '')
else
    count = tonumber(string.match(owner, ':(%d+)$$') or '0')
end
if reserved and count == tonumber(ARGV[2]) then return 2 end
if ARGV[2] == '0' then
    -- Sent by an execution of the lease from its body: for that execution's hold.
    if reserved or (ARGV[6] ~= '' and owner ~= ARGV[6]) then return 0 end
-- A hold of an earlier delivery of the message: it hands its hold on, and reads
-- the word as it does.
elseif not count or count >= tonumber(ARGV[2]) then return 0 end
local fence, word, ids = lock[$FENCE], ARGV[4], ARGV[5]
local old = redis.call('GET', KEYS[2])
if old then
    local for_fence, old_word, seen = string.match(old, '^(%d+) (%d+ %d+) (.*)$$')
    -- (Another hold's word is stale: this one replaces it.)
    if for_fence == fence then
        if string.find(' ' .. seen .. ' ', ' ' .. ids .. ' ', 1, true) then return 1 end
        if word == '0 0' then word = old_word end
        ids = seen .. ' ' .. ids
    end
end
redis.call('SET', KEYS[2], fence .. ' ' .. word .. ' ' .. ids, 'PX', ARGV[3])
return 1
""")
)


#: Delete the word a delivery of a retry left (see :data:`DROPPED`) once the hold
#: it was left for has acted on it, only if it still reads as it did: sent again
#: after its answer was lost, it deletes nothing more.
#:
#: KEYS[1] the word's key; ARGV[1] the word as it was read
#: Returns 1 when the word was deleted, 0 when it was gone or changed (nothing
#: changed).
FORGET_WORD = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def decode_lock(raw: bytes | str | None) -> dict[str, str]:
    """A lock key's value as its fields (stored name -> value), the empty ones left
    out; ``{}`` for no value."""
    if not raw:
        return {}
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    fields = zip(LAYOUT, text.split(SEPARATOR), strict=False)
    return {name: value for name, value in fields if value}


def queue_entry(
    waiter: str,
    owner: str,
    ttl_ms: int,
    lease: str,
    info: str,
    watched: bool = False,
    since_at_grant: bool = False,
    cluster: bool = False,
) -> str:
    """A waiter's entry in the lock's queue (ACQUIRE's ARGV[5]): what a release
    needs to hand the lock over to it, as one JSON array; ``info`` is the holder's
    description as ACQUIRE takes it (its values joined by :data:`SEPARATOR`), and
    its values come next, one element each.

    ``since_at_grant``: the description's ``since`` says when the hold began, so
    the entry holds it in a one-element array (the description padded to all of
    :data:`HOLDER_FIELDS`): it says when the waiter queued (what ``celery
    redislock show`` lists), and a release that hands the lock over writes the
    moment it does in its place. Not a string, so no description a caller gives
    is taken for it (a release of an older version, which hands over strings
    only, leaves it out). Otherwise the description is handed over as given.

    ``watched``: the waiter's process is subscribed to its wake channel on the
    server that holds the queue (one server, a Sentinel-managed primary, or a
    cluster's primary for the key), so a release may read there whether the
    process still is; the
    description is then padded to all of :data:`HOLDER_FIELDS`, and
    :data:`WATCHED` follows it (:data:`WATCHED_ON_CLUSTER` with ``cluster``)."""
    described: list[str | int | list[str]] = list(info.split(SEPARATOR)) if info else []
    if watched or since_at_grant:
        described += [""] * (len(HOLDER_FIELDS) - len(described))
    if since_at_grant:
        described[-1] = [str(described[-1])]
    if watched:
        described.append(WATCHED_ON_CLUSTER if cluster else WATCHED)
    return json.dumps([waiter, owner, ttl_ms, lease, *described], separators=(",", ":"))


def unwatched(entry: str) -> str:
    """``entry``, a :func:`queue_entry` made ``watched``, without the mark: what
    the waiter sends while its subscription is down, so that a release no longer
    takes it for a waiter whose process died and passes it over at every release
    until it is back. ACQUIRE and LEAVE take the entry's other forms out of the
    queue as they queue or remove one, so a waiter has one entry either way."""
    for mark in (f",{WATCHED}]", f",{WATCHED_ON_CLUSTER}]"):
        if entry.endswith(mark):
            return entry[: -len(mark)] + "]"
    return entry


class Script:
    """One Lua script, sent by digest (``EVALSHA``) and by text when the server lacks it."""

    __slots__ = ("name", "sha", "text")

    def __init__(self, name: str, text: str) -> None:
        self.name = name
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()
        SCRIPT_TEXTS[self.sha] = text

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
DROPPED_SCRIPT = Script("DROPPED", DROPPED)
FORGET_WORD_SCRIPT = Script("FORGET_WORD", FORGET_WORD)


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


#: Pause, in seconds, before sending again a request the server answered with
#: ``TRYAGAIN``: its slot is being migrated, and only some of its keys are on the
#: primary it reached (the others moved already, or do not exist), which the
#: migration's end settles. Sent again while the deadline leaves the pause and
#: as long again for the try after it.
TRYAGAIN_PAUSE = 0.05

#: Pause, in seconds, before sending again a request whose Redis Cluster primary
#: could not be reached while the refreshed slot map still names it: it may have
#: died, and a replica takes its slots over within a few ``cluster-node-timeout``.
#: Sent again (the slot map refreshed each time) until the deadline.
FAILOVER_PAUSE = 0.1

#: How long, in seconds, one try of a request to a Redis Cluster primary may take
#: (beyond the time it asks the server to block, a ``WAIT`` for replicas), within
#: the request's deadline: a primary that hangs (frozen, cut off by the network:
#: how a failover usually starts) costs a try no more than that, and the request
#: goes again, to the replica promoted in its place once the cluster names it.
CLUSTER_TRY = 1.0


def _try_deadline(deadline: Deadline, then: Sequence[Sequence[Any]]) -> Deadline:
    """The deadline of one try of a request to a Redis Cluster primary, within
    the request's ``deadline`` (see :data:`CLUSTER_TRY`); a ``WAIT`` among
    ``then`` adds the time it may block."""
    blocks = sum(int(command[2]) for command in then if command[0] == "WAIT") / 1000
    return Deadline(min(deadline.at, time.monotonic() + CLUSTER_TRY + blocks))


def send(
    router: Router,
    key: str,
    call: Call | Sequence[Any],
    deadline: Deadline,
    then: Sequence[Sequence[Any]] = (),
    before: Sequence[Call] = (),
    unsure: Callable[[], object] | None = None,
) -> Any:
    """Send one script call (or plain command) about ``key``; raise an error reply.

    With ``then``, those commands follow in the same round trip and every reply
    comes back, as a list. The ``before`` calls (about the same key) go ahead of
    it in that round trip, and their replies are dropped: how requests sent again
    in the background keep their place ahead of a later one. On a cluster, a
    redirection or a failed primary
    updates the slot map and the request goes again to the key's owner now; a
    slot being migrated sends it to the primary its key has moved to (``ASK``),
    each of its commands after an ``ASKING``, or again after a pause while its
    keys are split (``TRYAGAIN``). A primary that cannot be reached (killed, or
    hung: frozen, cut off; its failover under way) is asked again until the
    deadline, each try given :data:`CLUSTER_TRY` of it at most, the other nodes
    asked after each failed try which primary serves the key's slot now
    (:meth:`~celery_redislock.transport.Router.relocate`, in the background
    once the deadline has passed) and a :data:`FAILOVER_PAUSE` taken while they
    still name it, so the request reaches the replica promoted in its place (a
    retried acquire is recognised by its request id, and acts once).

    ``unsure()`` is called after each try that may have run without its answer
    coming (see :func:`~celery_redislock.transport.may_have_run`), whether or not
    a later try is answered: that try may still be on its way to the server, held
    up on the network, and arrive after the later ones.

    Raises:
        redis.RedisError: the request failed for good (connection, timeout, or
            an error reply).
    """
    # The primary an ASK named, for the next try (the slot map still says the old).
    asked: Transport | None = None
    attempt = 0
    # Whether a try so far may have run (see may_have_run()).
    ran = False
    while True:
        transport = asked or router.single or router.transport(key)
        # The deadline of this try: on a cluster, a slice of the request's.
        bound = deadline if router.single is not None else _try_deadline(deadline, then)
        try:
            if before:
                assert isinstance(call, Call)
                replies = _run_behind(
                    transport, asked is not None, before, call, then, bound, unsure
                )
            elif isinstance(call, Call):
                # run_calls() for one call, inline: this is every acquire's path.
                if asked is None:
                    replies = run(transport, [call.by_sha(), *then], bound, unsure=unsure)
                else:
                    replies = _run_asking(transport, [call.by_sha(), *then], bound, True, unsure)
                if isinstance(replies[0], NoScriptError):
                    commands = [call.by_text(), *then]
                    replies = _run_asking(transport, commands, bound, asked is not None, unsure)
                if not isinstance(replies[0], NoScriptError):
                    transport.scripts.add(call.script.sha)
            else:
                replies = _run_asking(transport, [call, *then], bound, asked is not None, unsure)
            if isinstance(replies[0], Exception):
                raise replies[0]
            return replies if then else replies[0]
        except RedisError as exc:
            ran = ran or may_have_run(exc)
            ended(exc, ran)
            if ran and unsure is not None:
                unsure()
            if isinstance(exc, TryAgainError):
                # The try after the pause gets a pause's time at least: one cut
                # to the sliver of the deadline left would end the request as a
                # timeout, hiding what held it up.
                if deadline.remaining() <= 2 * TRYAGAIN_PAUSE:
                    raise
                time.sleep(TRYAGAIN_PAUSE)
                continue
            if bound is not deadline and (
                isinstance(exc, BusyLoadingError) or held_off(exc) in STALLED
            ):
                # Refused unrun (the cluster down while a shard fails over, say)
                # until the try's own time ran out: asked again until the
                # request's deadline, as run() does within one.
                if deadline.remaining() <= LOADING_PAUSE:
                    raise
                time.sleep(LOADING_PAUSE)
                continue
            last = attempt + 1 == ATTEMPTS or deadline.expired()
            # (redis-py's MovedError is an AskError: a slot that has moved for good
            # updates the slot map, below, rather than be asked for once.)
            if isinstance(exc, AskError) and not isinstance(exc, MovedError):
                asked = router.asked(exc)
                if asked is None or last:
                    raise
            elif router.single is None and isinstance(exc, TRANSIENT):
                asked = None
                # Where the key lives now, from the other nodes: waited for
                # within the deadline, and learnt in the background for the next
                # request once it has passed. (A question no node answers, all
                # out of reach, is asked again on the next failure: the deadline
                # bounds them all.)
                moved = router.relocate(key, transport, deadline)
                if deadline.expired():
                    raise
                if not moved:
                    # Still the slot's primary by the cluster's word: its replica
                    # has not taken over yet.
                    if deadline.remaining() <= FAILOVER_PAUSE:
                        raise
                    time.sleep(FAILOVER_PAUSE)
            else:
                asked = None
                if last or not router.redirected(exc):
                    raise
        attempt += 1


#: What each request to the primary an ``ASK`` named follows: it lets the one
#: command after it (and that one only) at a key of the slot the primary imports.
_ASKING = ("ASKING",)


def _run_asking(
    transport: Transport,
    commands: Sequence[Sequence[Any]],
    deadline: Deadline,
    asked: bool,
    unsure: Callable[[], object] | None = None,
) -> list[Any]:
    """The replies of ``commands``, run in one round trip: if ``asked`` (sent to
    the primary an ``ASK`` named), each after an ``ASKING`` of its own, as that
    lets only the next command at a key of the slot the primary imports
    (``unsure``: see :func:`send`)."""
    if not asked:
        return run(transport, commands, deadline, unsure=unsure)
    replies = run(
        transport,
        [part for command in commands for part in (_ASKING, command)],
        deadline,
        unsure=unsure,
    )
    return replies[1::2]


def _run_behind(
    transport: Transport,
    asked: bool,
    before: Sequence[Call],
    call: Call,
    then: Sequence[Sequence[Any]],
    deadline: Deadline,
    unsure: Callable[[], object] | None = None,
) -> list[Any]:
    """The replies of ``call`` and ``then``, sent in one round trip behind the
    ``before`` calls (by text: they are rare; each command after an ``ASKING`` if
    ``asked``), for :func:`send`. A ``call`` the server has no script for goes
    again by text, alone: the ``before`` calls ran."""
    commands = [each.by_text() for each in before]
    replies = _run_asking(transport, [*commands, call.by_sha(), *then], deadline, asked, unsure)
    replies = replies[len(commands) :]
    if isinstance(replies[0], NoScriptError):
        replies = _run_asking(transport, [call.by_text(), *then], deadline, asked, unsure)
    if not isinstance(replies[0], NoScriptError):
        transport.scripts.add(call.script.sha)
    return replies


class Acquired(IntEnum):
    """What an acquire found."""

    HELD = 0  #: another owner holds the lock
    TAKEN = 1  #: newly taken, or taken over (the lease's reservation, or handed over)
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
    #: The ids of the releases the lock remembers, and the acquires it lists as
    #: undone if any (only when newly taken, and only if it remembers any): the
    #: hold's release sends them back, so that it can free the lock in one write
    #: (where it lists none).
    released: str | None = None
    #: The holder's owner token (only when held by another owner of the caller's
    #: lease): whether that is a reservation, and whose.
    owner: str | None = None
    #: Whether another owner holds the lock (only when not taken): false while it
    #: is free but kept for the waiters a release woke.
    taken: bool = False

    @classmethod
    def parse(cls, raw: Sequence[Any]) -> AcquireReply:
        outcome = _ACQUIRED[int(raw[0])]
        if outcome is _ACQUIRED[0]:  # Acquired.HELD
            return cls(
                outcome,
                None,
                int(raw[1]),
                _text(raw[2]) or None,
                _text(raw[3]) or None,
                int(raw[4]),
                owner=(_text(raw[5]) or None) if len(raw) > 5 else None,
                taken=len(raw) > 6 and int(raw[6]) == 1,
            )
        released = _text(raw[2]) if len(raw) > 2 else None
        # cls(...) without its Python-level __new__: this is every acquire's reply.
        return tuple.__new__(
            cls, (outcome, int(raw[1]), 0, None, None, None, released, None, False)
        )


class Released(IntEnum):
    """What a release did."""

    NOT_OWNED = 0  #: this owner did not hold the lock; nothing changed
    FREED = 1  #: the last hold went: the lock is free and waiters were woken
    KEPT = 2  #: one hold dropped, others remain


def _text(value: bytes | str | None) -> str | None:
    """Decode a bytes reply."""
    return value.decode() if isinstance(value, bytes) else value
