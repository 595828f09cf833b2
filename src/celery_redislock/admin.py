"""Read and repair lock state: what ``celery redislock`` shows and does, callable from Python.

Everything here reads the storage format of :mod:`celery_redislock.scripts`: one
string key per lock name (held while its owner field is non-empty, kept free for a
while after release for its fencing counter) with the holder's description
(task, state, node, pid, since), and a sorted set of queued waiters beside it.

Reads only ever ``SCAN`` the keyspace (never ``KEYS``), on every primary of a
Redis Cluster, and read what they found in one pipelined round trip per batch,
over the engine's own bounded connections: an unreachable store costs a
command at most its timeout.

For code::

    from celery_redislock.admin import list_locks, purge_locks

    for info in list_locks(client, "proj.tasks.rebuild_report:*"):
        print(info.name, info.holder, info.state, info.age())
    purge_locks(app, task="proj.tasks.rebuild_report")   # free them all

:func:`purge_locks` (alias :func:`clear_locks`) is the counterpart of
celery-singleton's ``clear_locks(app)``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, NamedTuple

import redis
from celery.local import maybe_evaluate
from redis.cluster import RedisCluster
from redis.exceptions import AskError, RedisError, TryAgainError

from celery_redislock.ids import request_id
from celery_redislock.lock import (
    DEFAULT_PREFIX,
    FENCE_TTL_MS,
    check_prefix,
    lock_keys,
    name_from_key,
    wake_channel_prefix,
)
from celery_redislock.scripts import (
    FIELDS,
    FORCE_RELEASE_SCRIPT,
    HOLDER_FIELDS,
    OWNER_FIELD,
    Call,
    decode_lock,
    send,
)
from celery_redislock.store import describe_store, lock_store
from celery_redislock.transport import (
    DEFAULT_CALL_TIMEOUT,
    Client,
    Deadline,
    Router,
    Transport,
    backend_errors,
    run,
    slot_moving,
)

__all__ = [
    "HOLDER_STATES",
    "LIST_SCHEMA",
    "SHOW_SCHEMA",
    "STATS_SCHEMA",
    "ForceReleased",
    "HolderStatus",
    "LockInfo",
    "ResultReads",
    "Store",
    "WaiterInfo",
    "Waiting",
    "WorkerActivity",
    "app_stores",
    "check_pattern",
    "clear_locks",
    "find_locks",
    "find_waiting",
    "force_release",
    "holder_status",
    "list_locks",
    "lock_stats",
    "purge_locks",
    "read_lock",
    "read_waiters",
    "worker_activity",
]

#: What a lock's holder can be doing: its message waits in the queue (an
#: ``until_*`` lock taken by ``apply_async``), or its body runs.
HolderState = Literal["queued", "running"]
HOLDER_STATES: tuple[HolderState, ...] = ("queued", "running")

#: Keys asked for per ``SCAN`` call (a hint to the server, not a limit).
SCAN_COUNT = 1000


@dataclass(frozen=True)
class LockInfo:
    """One held lock, as stored in Redis."""

    #: The lock name (for a task: ``<task name>:<digest>``).
    name: str
    #: The lease (Celery task id) of the holder, or ``None`` for a plain lock.
    holder: str | None
    #: How many times the holder has taken it (re-entrant holds).
    count: int
    #: The fencing token of the current hold.
    fence: int
    #: Milliseconds until it expires without renewal (``-1``: no expiry).
    ttl_ms: int
    #: The holder's task name, when the holder described itself (a SingletonTask does).
    task: str | None = None
    #: ``"queued"`` (taken at enqueue, the message waits) or ``"running"``.
    state: HolderState | None = None
    #: The worker node that runs the holder (``celery@host``), when running.
    node: str | None = None
    #: The worker process that runs the holder, when running.
    pid: int | None = None
    #: When the hold began, in Unix seconds.
    since: float | None = None
    #: How many waiters are queued for the lock (``on_conflict="wait"`` tasks).
    waiters: int = 0
    #: The key prefix the lock lives under.
    prefix: str = DEFAULT_PREFIX

    def age(self, now: float | None = None) -> float | None:
        """Seconds since the hold began (``None`` when the holder did not say)."""
        if self.since is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.since)

    def to_json(self, now: float | None = None) -> dict[str, Any]:
        """The lock as a JSON object of the documented schema (:data:`LOCK_SCHEMA`)."""
        age = self.age(now)
        return {
            "name": self.name,
            "prefix": self.prefix,
            "task": self.task,
            "holder": self.holder,
            "state": self.state,
            "node": self.node,
            "pid": self.pid,
            "since": self.since,
            "age": None if age is None else round(age, 3),
            "ttl": None if self.ttl_ms < 0 else self.ttl_ms / 1000,
            "fence": self.fence,
            "count": self.count,
            "waiters": self.waiters,
        }


def _nullable(kind: str, **extra: Any) -> dict[str, Any]:
    return {"type": [kind, "null"], **extra}


#: JSON schema of one lock in ``--json`` output.
LOCK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "name",
        "prefix",
        "task",
        "holder",
        "state",
        "node",
        "pid",
        "since",
        "age",
        "ttl",
        "fence",
        "count",
        "waiters",
    ],
    "properties": {
        "name": {"type": "string", "description": "the lock name"},
        "prefix": {"type": "string", "description": "the key prefix it lives under"},
        "task": _nullable("string", description="the holder's task name"),
        "holder": _nullable("string", description="the holder's task id (lease)"),
        "state": {"enum": ["queued", "running", None], "description": "queued or running"},
        "node": _nullable("string", description="worker node running the holder"),
        "pid": _nullable("integer", description="worker process running the holder"),
        "since": _nullable("number", description="when the hold began (Unix seconds)"),
        "age": _nullable("number", minimum=0, description="seconds since the hold began"),
        "ttl": _nullable("number", description="seconds until it expires unless renewed"),
        "fence": {"type": "integer", "description": "fencing token of the hold"},
        "count": {"type": "integer", "minimum": 1, "description": "re-entrant holds"},
        "waiters": {"type": "integer", "minimum": 0, "description": "queued waiters"},
    },
}

#: JSON schema of the ``errors`` of the command's ``--json`` outputs.
ERRORS_SCHEMA: dict[str, Any] = {
    "type": "array",
    "items": {"type": "string"},
    "description": (
        "what could not be read (a lock store unreachable, a task's invalid options), "
        "as the command's error lines say it; the rest of the output is about the others"
    ),
}

#: JSON schema of ``celery redislock list --json``.
LIST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["locks", "count"],
    "properties": {
        "locks": {"type": "array", "items": LOCK_SCHEMA},
        "count": {"type": "integer", "minimum": 0},
        "errors": ERRORS_SCHEMA,
    },
}

#: JSON schema of what is known of a holder (``show --json``).
HOLDER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": [
        "task_id",
        "result_state",
        "worker",
        "worker_state",
        "workers_answered",
        "result_error",
    ],
    "properties": {
        "task_id": {"type": "string"},
        "result_state": _nullable("string", description="AsyncResult(id).state, if known"),
        "worker": _nullable("string", description="the live worker that reports the task"),
        "worker_state": {
            "enum": ["active", "reserved", "scheduled", None],
            "description": "how that worker reports it",
        },
        "workers_answered": {
            "type": "integer",
            "minimum": 0,
            "description": "how many workers answered within the timeout",
        },
        "result_error": _nullable(
            "string", description="why result_state is null (timed out, the backend failed)"
        ),
    },
}

#: JSON schema of a waiter queued for a lock (``show --json``).
WAITER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["task_id", "task", "state", "node", "pid", "since"],
    "properties": {
        "task_id": _nullable("string", description="the waiter's task id (lease)"),
        "task": _nullable("string", description="the waiter's task name"),
        "state": _nullable("string", description="what the waiter said it was doing"),
        "node": _nullable("string", description="worker node running the waiter"),
        "pid": _nullable("integer", description="worker process running the waiter"),
        "since": _nullable("number", description="when it began to ask (Unix seconds)"),
    },
}

#: JSON schema of ``celery redislock show --json``.
SHOW_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["locks"],
    "properties": {
        "locks": {
            "type": "array",
            "items": {
                "type": "object",
                "additionalProperties": False,
                "required": ["lock", "holder_status"],
                "properties": {
                    "lock": LOCK_SCHEMA,
                    "holder_status": {"anyOf": [HOLDER_SCHEMA, {"type": "null"}]},
                    "waiting": {
                        "type": "array",
                        "items": WAITER_SCHEMA,
                        "description": "its queued waiters, first in line first",
                    },
                },
            },
        },
        "errors": ERRORS_SCHEMA,
    },
}

#: JSON schema of ``celery redislock stats --json``.
STATS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "additionalProperties": False,
    "required": ["held", "waiters", "by_task", "oldest"],
    "properties": {
        "held": {"type": "integer", "minimum": 0, "description": "locks held"},
        "waiters": {"type": "integer", "minimum": 0, "description": "waiters queued, in all"},
        "by_task": {
            "type": "object",
            "description": "per task name ('' for locks without one): held locks by state",
            "additionalProperties": {
                "type": "object",
                "additionalProperties": False,
                "required": ["queued", "running", "unknown", "waiters"],
                "properties": {
                    "queued": {"type": "integer", "minimum": 0},
                    "running": {"type": "integer", "minimum": 0},
                    "unknown": {"type": "integer", "minimum": 0},
                    "waiters": {"type": "integer", "minimum": 0},
                },
            },
        },
        "oldest": {"anyOf": [LOCK_SCHEMA, {"type": "null"}]},
        "errors": ERRORS_SCHEMA,
    },
}


def check_pattern(pattern: object, argument: str = "pattern") -> str:
    """Return ``pattern`` if it is a usable Redis glob, or raise ``ValueError`` naming it.

    A glob matches lock names: ``*`` any run of characters, ``?`` one, ``[abc]``
    a class, ``\\`` escapes the next character.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"{argument} must be a str, not {type(pattern).__name__}")
    if not pattern:
        raise ValueError(f"{argument} must not be empty (use '*' for every lock)")
    try:
        pattern.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{argument} {pattern!r} cannot be encoded as UTF-8") from None
    escaped = in_class = False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
    if escaped:
        raise ValueError(f"bad {argument} {pattern!r}: it ends with an unescaped '\\'")
    if in_class:
        raise ValueError(f"bad {argument} {pattern!r}: '[' is never closed by ']'")
    return pattern


def is_glob(text: str) -> bool:
    """Whether ``text`` contains a glob wildcard (``*``, ``?`` or ``[``)."""
    return any(char in text for char in "*?[")


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in text)


def _class_end(pattern: bytes, start: int) -> int:
    """Where the ``[...]`` class whose ``[`` is at ``start`` in ``pattern`` ends (the
    index of its ``]``, or ``len(pattern)`` if none closes it), read as Redis reads it:
    ``\\`` escapes, a range ``a-z`` takes the character after ``-`` whatever it is."""
    at = start + 1
    if at < len(pattern) and pattern[at] == ord("^"):
        at += 1
    while at < len(pattern) and pattern[at] != ord("]"):
        if pattern[at] == ord("\\") and at + 1 < len(pattern):
            at += 1
        elif at + 2 < len(pattern) and pattern[at + 1] == ord("-"):
            at += 2
        at += 1
    return at


def _in_class(pattern: bytes, start: int, char: int) -> bool:
    """Whether the class whose ``[`` is at ``start`` matches the byte ``char``."""
    at, end = start + 1, _class_end(pattern, start)
    negated = at < end and pattern[at] == ord("^")
    at += negated
    found = False
    while at < end:
        if pattern[at] == ord("\\") and at + 1 < len(pattern):
            at += 1
            found = found or pattern[at] == char
        elif at + 2 < len(pattern) and pattern[at + 1] == ord("-"):
            low, high = sorted((pattern[at], pattern[at + 2]))
            found = found or low <= char <= high
            at += 2
        else:
            found = found or pattern[at] == char
        at += 1
    return found != negated


def _glob_matches(pattern: bytes, text: bytes) -> bool:
    """Whether ``text`` matches the glob ``pattern`` as Redis's ``MATCH`` matches
    keys (byte by byte: ``*``, ``?``, ``[...]`` with ``^`` and ranges, ``\\``
    escapes), so that names filtered here agree with what the server selects."""
    p = t = 0
    # Where to resume after the last '*': its pattern position, and the text
    # position it has swallowed up to. One '*' backtracking at a time suffices
    # (a later '*' supersedes an earlier one), as in Redis.
    star: tuple[int, int] | None = None
    while t < len(text):
        if p < len(pattern):
            char = pattern[p]
            if char == ord("*"):
                star = (p, t)
                p += 1
                continue
            if char == ord("?"):
                p, t = p + 1, t + 1
                continue
            if char == ord("["):
                end = _class_end(pattern, p)
                if _in_class(pattern, p, text[t]):
                    p, t = min(end + 1, len(pattern)), t + 1
                    continue
            else:
                if char == ord("\\") and p + 1 < len(pattern):
                    p += 1
                if pattern[p] == text[t]:
                    p, t = p + 1, t + 1
                    continue
        if star is None:
            return False
        p, t = star[0] + 1, star[1] + 1
        star = (star[0], t)
    return all(char == ord("*") for char in pattern[p:])


def _first_element(pattern: bytes) -> int:
    """How many bytes the first element of the glob ``pattern`` takes."""
    if pattern[:1] == b"[":
        return min(_class_end(pattern, 0) + 1, len(pattern))
    if pattern[:1] == b"\\" and len(pattern) > 1:
        return 2
    return 1


def _scan_match(pattern: str) -> str:
    """The ``{...}`` part of a ``SCAN MATCH`` that finds every lock key whose name
    matches ``pattern`` (and maybe others: the names read are filtered again).

    A name starting with ``}`` or ``\\`` is stored escaped, as ``{\\name}``
    (:func:`~celery_redislock.lock.lock_keys`). Where the pattern's first element
    can match those characters, the match allows for the escape: after a literal
    one, every name found is escaped, so ``\\`` goes in front; after ``?`` or a
    class, the element becomes ``*`` (one or two characters, escaped or not).
    """
    raw = pattern.encode("utf-8")
    if raw[:1] == b"*":
        return pattern
    size = _first_element(raw)
    first = raw[:size]
    if not any(_glob_matches(first, char) for char in (b"}", b"\\")):
        return pattern
    if first[:1] in (b"?", b"["):
        return "*" + raw[size:].decode("utf-8")
    return "\\\\" + pattern


def _text(value: bytes | str | None) -> str | None:
    """Decode a reply (the engine's connections return bytes)."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _int(value: bytes | str | None, default: int | None = 0) -> int | None:
    text = _text(value)
    try:
        return int(text) if text else default
    except ValueError:
        return default


def _float(value: bytes | str | None) -> float | None:
    text = _text(value)
    try:
        return float(text) if text else None
    except ValueError:
        return None


def _parse(key: str, prefix: str, raw: Any, pttl: Any, waiters: Any) -> LockInfo | None:
    """A :class:`LockInfo` from the replies read for ``key``; ``None`` unless it is held.

    Raises:
        redis.RedisError: a read the server refused (an ACL without ``ZCARD``, say),
            rather than take it for an empty answer.
    """
    if isinstance(raw, Exception):
        if "WRONGTYPE" in str(raw):
            return None  # not a lock key
        raise raw
    for reply in (pttl, waiters):
        if isinstance(reply, Exception):
            raise reply
    stored = decode_lock(raw)
    if OWNER_FIELD not in stored:
        return None  # gone since the scan, or free
    values = {name: stored.get(field) for name, field in FIELDS.items()}
    state = values["state"]
    return LockInfo(
        name=name_from_key(key, prefix),
        holder=values["lease"],
        count=_int(values["count"]) or 1,  # absent: one hold
        fence=_int(values["fence"]) or 0,
        ttl_ms=int(pttl) if isinstance(pttl, int) else -2,
        task=values["task"],
        state=state if state in HOLDER_STATES else None,
        node=values["node"],
        pid=_int(values["pid"], None),
        since=_float(values["since"]),
        waiters=waiters if isinstance(waiters, int) else 0,
        prefix=prefix,
    )


def _read_commands(key: str) -> list[tuple[Any, ...]]:
    """The reads that describe lock ``key``: its value, its TTL and its queue length."""
    return [("GET", key), ("PTTL", key), ("ZCARD", f"{key}:waiters")]


def _scan(transport: Transport, match: str, timeout: float) -> Iterator[list[str]]:
    """The keys matching ``match`` on one server, a batch per ``SCAN`` call."""
    cursor: Any = 0
    while True:
        (reply,) = run(
            transport,
            [("SCAN", cursor, "MATCH", match, "COUNT", SCAN_COUNT)],
            Deadline.after(timeout),
        )
        if isinstance(reply, Exception):
            raise reply
        cursor, keys = reply
        yield [_text(key) or "" for key in keys]
        if int(cursor) == 0:
            return


def list_locks(
    client: Client,
    pattern: str = "*",
    prefix: str = DEFAULT_PREFIX,
    *,
    task: str | None = None,
    holder: str | None = None,
    state: HolderState | None = None,
    timeout: float = DEFAULT_CALL_TIMEOUT,
) -> list[LockInfo]:
    """Every held lock whose name matches the glob ``pattern``, sorted by name.

    Arguments:
        client: the lock store (one server, or a Redis Cluster: every primary is scanned).
        pattern: a glob over lock names (see :func:`check_pattern`).
        prefix: the key prefix.
        task: only locks whose holder is this task (by its description, or, for a
            holder without one, by the name's ``<task>:`` part).
        holder: only the lock held by this task id (lease).
        state: only locks whose holder is ``"queued"`` or ``"running"``.
        timeout: deadline of each round trip, in seconds.

    Raises:
        ValueError: a bad pattern, prefix or state.
        LockBackendError: the store could not be reached.
    """
    check_pattern(pattern)
    check_prefix(prefix)
    if state is not None and state not in HOLDER_STATES:
        raise ValueError(f"state must be one of {', '.join(HOLDER_STATES)}, got {state!r}")
    match = f"{glob_escape(prefix)}:{{{_scan_match(pattern)}}}"
    wanted = None if pattern == "*" else pattern.encode("utf-8")
    found: list[LockInfo] = []
    # The keys read so far: a key SCAN returns twice (SCAN may; a key moved to
    # another primary between the scans of both) is listed once.
    seen: set[str] = set()
    router = Router(client)
    with backend_errors("list locks"):
        for transport in router.transports():
            for batch in _scan(transport, match, timeout):
                keys = [key for key in batch if key not in seen]
                if not keys:
                    continue
                seen.update(keys)
                commands = [command for key in keys for command in _read_commands(key)]
                replies = run(transport, commands, Deadline.after(timeout))
                for i, key in enumerate(keys):
                    read = replies[3 * i : 3 * i + 3]
                    if any(isinstance(reply, AskError | TryAgainError) for reply in read):
                        # A key of a slot being moved to this primary (SCAN lists
                        # it here, but the slot is not yet served here: MOVED), or
                        # moved away since the scan (ASK): read where it is now.
                        first, *then = _read_commands(key)
                        read = send(router, key, first, Deadline.after(timeout), then)
                    info = _parse(key, prefix, *read)
                    if info is None or not _matches(info, task, holder, state):
                        continue
                    # The server matched the stored (maybe escaped) key; the
                    # pattern is about the name.
                    if wanted is None or _glob_matches(wanted, info.name.encode("utf-8")):
                        found.append(info)
    return sorted(found, key=lambda info: info.name)


def _matches(
    info: LockInfo, task: str | None, holder: str | None, state: HolderState | None
) -> bool:
    if holder is not None and info.holder != holder:
        return False
    if state is not None and info.state != state:
        return False
    if task is not None:
        named = info.task if info.task is not None else info.name.rpartition(":")[0]
        return named == task
    return True


def read_lock(
    client: Client, name: str, prefix: str = DEFAULT_PREFIX, timeout: float = DEFAULT_CALL_TIMEOUT
) -> LockInfo | None:
    """Lock ``name`` if it is held, else ``None``: one round trip.

    Raises:
        LockBackendError: the store could not be reached.
    """
    key = lock_keys(name, prefix).lock
    first, *then = _read_commands(key)
    with backend_errors(f"read lock {name!r}"):
        replies = send(Router(client), key, first, Deadline.after(timeout), then)
        return _parse(key, prefix, *replies)


def find_locks(
    client: Client,
    name_or_id: str,
    prefix: str = DEFAULT_PREFIX,
    timeout: float = DEFAULT_CALL_TIMEOUT,
) -> list[LockInfo]:
    """The held lock called ``name_or_id``, or else those held by task id ``name_or_id``.

    Raises:
        LockBackendError: the store could not be reached.
    """
    info = read_lock(client, name_or_id, prefix, timeout)
    if info is not None:
        return [info]
    return list_locks(client, "*", prefix, holder=name_or_id, timeout=timeout)


#: The most waiters read per lock (the first ones in its queue): what ``show``
#: lists, and how far into each queue a waiting task id is looked for.
WAITERS_READ = 100


@dataclass(frozen=True)
class WaiterInfo:
    """One waiter queued for a lock, as its queue entry describes it."""

    #: The waiter's lease: for a task, its Celery task id (``None``: none given).
    task_id: str | None
    #: Its task name, state, worker node and process, when it described itself.
    task: str | None = None
    state: str | None = None
    node: str | None = None
    pid: int | None = None
    #: When it began to ask for the lock, in Unix seconds.
    since: float | None = None

    def age(self, now: float | None = None) -> float | None:
        """Seconds since it began to ask (``None`` when it did not say)."""
        if self.since is None:
            return None
        return max(0.0, (time.time() if now is None else now) - self.since)

    def to_json(self) -> dict[str, Any]:
        """The waiter as a JSON object of the documented schema (:data:`WAITER_SCHEMA`)."""
        return {
            "task_id": self.task_id,
            "task": self.task,
            "state": self.state,
            "node": self.node,
            "pid": self.pid,
            "since": self.since,
        }


def _waiter(entry: bytes | str) -> WaiterInfo:
    """A :class:`WaiterInfo` from a queue entry: the JSON array ``[waiter id, owner
    token, TTL in ms, lease, description...]`` (see
    :func:`~celery_redislock.scripts.queue_entry`); an entry that is only an id
    (an older form) describes nothing."""
    try:
        values = json.loads(_text(entry) or "")
    except ValueError:
        return WaiterInfo(None)
    if not isinstance(values, list) or len(values) < 4:
        return WaiterInfo(None)
    # A SingletonTask's since comes in a one-element array (see queue_entry).
    shown = [value[0] if isinstance(value, list) and value else value for value in values[4:]]
    described = dict(zip(HOLDER_FIELDS, [str(value) for value in shown], strict=False))
    return WaiterInfo(
        task_id=str(values[3]) or None,
        task=described.get("task") or None,
        state=described.get("state") or None,
        node=described.get("node") or None,
        pid=_int(described.get("pid"), None),
        since=_float(described.get("since")),
    )


def read_waiters(
    client: Client, name: str, prefix: str = DEFAULT_PREFIX, timeout: float = DEFAULT_CALL_TIMEOUT
) -> list[WaiterInfo]:
    """The waiters queued for lock ``name``, first in line first (the first
    :data:`WAITERS_READ` of them): one round trip.

    Raises:
        LockBackendError: the store could not be reached.
    """
    queue = lock_keys(name, prefix).queue
    with backend_errors(f"read the waiters of lock {name!r}"):
        entries = send(
            Router(client), queue, ("ZRANGE", queue, 0, WAITERS_READ - 1), Deadline.after(timeout)
        )
    return [_waiter(entry) for entry in entries or ()]


class Waiting(NamedTuple):
    """Where a task id waits: the lock, and its place in the lock's queue."""

    #: The lock name it waits for.
    name: str
    #: Its place in the queue, from 1 (next in line).
    position: int
    #: Its queue entry.
    waiter: WaiterInfo


def find_waiting(
    client: Client,
    task_id: str,
    prefix: str = DEFAULT_PREFIX,
    timeout: float = DEFAULT_CALL_TIMEOUT,
) -> list[Waiting]:
    """The locks task id ``task_id`` waits for (queued as a waiter), sorted by name.

    Walks the waiter queues with ``SCAN`` (every primary of a Cluster) and reads
    the first :data:`WAITERS_READ` entries of each, in one pipelined round trip
    per batch. A queue of a cluster slot being moved is left out until the move ends.

    Raises:
        LockBackendError: the store could not be reached.
    """
    check_prefix(prefix)
    match = f"{glob_escape(prefix)}:{{*}}:waiters"
    found: list[Waiting] = []
    seen: set[str] = set()
    with backend_errors("find waiting tasks"):
        for transport in Router(client).transports():
            for batch in _scan(transport, match, timeout):
                queues = [queue for queue in batch if queue not in seen]
                if not queues:
                    continue
                seen.update(queues)
                commands = [("ZRANGE", queue, 0, WAITERS_READ - 1) for queue in queues]
                replies = run(transport, commands, Deadline.after(timeout))
                for queue, reply in zip(queues, replies, strict=True):
                    if isinstance(reply, AskError | TryAgainError):
                        continue
                    if isinstance(reply, Exception):
                        if "WRONGTYPE" in str(reply):
                            continue  # a lock named '...}:waiters', not a queue
                        raise reply
                    for position, entry in enumerate(reply or (), 1):
                        waiter = _waiter(entry)
                        if waiter.task_id == task_id:
                            name = name_from_key(queue.removesuffix(":waiters"), prefix)
                            found.append(Waiting(name, position, waiter))
    return sorted(found, key=lambda waiting: waiting.name)


class ForceReleased(Enum):
    """What :func:`force_release` did. Only :attr:`FREED` is true, so callers that
    ask ``if force_release(...)`` read "was it freed"."""

    #: The lock was not held: nothing changed.
    NOT_HELD = 0
    #: The hold was freed (and the lock handed to its next waiter, if one is queued).
    FREED = 1
    #: Another hold than the one named by its fencing token holds the lock: the
    #: lock changed hands since that hold was read, and nothing changed.
    CHANGED_HANDS = 2

    def __bool__(self) -> bool:
        return self is ForceReleased.FREED


def force_release(
    client: Client, name: str, prefix: str = DEFAULT_PREFIX, fence: int | None = None
) -> ForceReleased:
    """Free a lock and hand it to its next waiter, if one is queued; say what it did.

    With ``fence`` (the :attr:`LockInfo.fence` of a hold that was read), only that
    hold is freed: an operator decides on the hold they were shown, and whoever
    took the lock since (the waiter it was handed to, a new taker) is left alone
    (:attr:`ForceReleased.CHANGED_HANDS`). Without it, whatever hold there is goes.

    For operators only: the holder keeps running, unprotected, and finds the
    lock lost at its next heartbeat.

    Raises:
        LockBackendError: the store could not be reached.
    """
    key, queue = lock_keys(name, prefix)
    call = Call(
        FORCE_RELEASE_SCRIPT,
        [key, queue],
        [
            "" if fence is None else str(fence),
            wake_channel_prefix(prefix),
            request_id(),
            FENCE_TTL_MS,
        ],
    )
    with backend_errors(f"release lock {name!r}"):
        reply = send(Router(client), key, call, Deadline.after(DEFAULT_CALL_TIMEOUT))
    return ForceReleased(int(reply))


def lock_stats(locks: Iterable[LockInfo], now: float | None = None) -> dict[str, Any]:
    """Totals over ``locks``: held, waiters, per task by state, and the oldest hold
    (a JSON object of :data:`STATS_SCHEMA`)."""
    held = waiters = 0
    by_task: dict[str, dict[str, int]] = {}
    oldest: LockInfo | None = None
    for info in locks:
        held += 1
        waiters += info.waiters
        counts = by_task.setdefault(
            info.task or "", {"queued": 0, "running": 0, "unknown": 0, "waiters": 0}
        )
        counts[info.state or "unknown"] += 1
        counts["waiters"] += info.waiters
        if info.since is not None and (oldest is None or info.since < (oldest.since or 0)):
            oldest = info
    return {
        "held": held,
        "waiters": waiters,
        "by_task": dict(sorted(by_task.items())),
        "oldest": oldest.to_json(now) if oldest is not None else None,
    }


class Store(NamedTuple):
    """One place locks of an app live: a client and a key prefix."""

    client: Client
    prefix: str
    #: Where it is, for messages (no password shown).
    description: str


def app_stores(app: Any, *, bad_tasks: list[tuple[str, Exception]] | None = None) -> list[Store]:
    """Where the locks of ``app`` live: its lock store under ``redislock_prefix``,
    plus the own ``lock_url``/``lock_prefix`` of each registered SingletonTask.

    Arguments:
        bad_tasks: when given, a SingletonTask whose options are invalid is left
            out and added to it as ``(task name, error)``, so that the stores of
            the others can still be worked on; without it, the first such error
            is raised.

    Raises:
        ValueError, TypeError: the app names no usable lock store (or, without
            ``bad_tasks``, a task's options are invalid).
        LockBackendError: its ``redislock_client`` callable could not reach the store.
    """
    from celery_redislock.task import SingletonTask

    stores: dict[tuple[str, str], Store] = {}
    problem: Exception | None = None
    try:
        prefix = check_prefix(app.conf.get("redislock_prefix") or DEFAULT_PREFIX)
        description = describe_store(app)
        stores[(description, prefix)] = Store(lock_store(app), prefix, description)
    except (ValueError, TypeError) as exc:
        problem = exc
    for task in _registered_tasks(app, bad_tasks is not None):
        if not isinstance(task, SingletonTask):
            continue
        try:
            options = task.lock_options
        except (ValueError, TypeError) as exc:
            if bad_tasks is None:
                raise
            bad_tasks.append((task.name, exc))
            continue
        where = (describe_store(app, options.url), options.prefix)
        if options.url is None and problem is not None:
            raise problem
        if where not in stores:
            stores[where] = Store(task.lock_client, options.prefix, where[0])
    if not stores:
        if problem is None:
            # Every task of the app names a store of its own, and each was left out.
            raise ValueError("no usable lock store: every task's configuration is invalid")
        raise problem
    return list(stores.values())


def _registered_tasks(app: Any, past_bad_tasks: bool) -> list[Any]:
    """The tasks of ``app``, registered (the app finalized) as the first look at
    ``app.tasks`` does.

    A task whose options are invalid raises as it is registered, which stops the
    registration of those declared after it. With ``past_bad_tasks``, those are
    registered all the same (the raising task is left registered, and raises
    again when its options are read, where its name is known).
    """
    try:
        return list(app.tasks.values())
    except (ValueError, TypeError) as exc:
        if not past_bad_tasks:
            raise
        first: Exception = exc
    pending = getattr(app, "_pending", None)
    while pending:
        try:
            maybe_evaluate(pending.popleft())
        except (ValueError, TypeError):
            continue  # raises again when its options are read
    tasks = list(app.tasks.values())
    if not any(_invalid_options(task) for task in tasks):
        raise first  # not a task's options: the app's settings
    return tasks


def _invalid_options(task: Any) -> bool:
    """Whether ``task`` is a SingletonTask whose options cannot be read."""
    from celery_redislock.task import SingletonTask

    if not isinstance(task, SingletonTask):
        return False
    try:
        _ = task.lock_options
    except (ValueError, TypeError):
        return True
    return False


@dataclass(frozen=True)
class WorkerActivity:
    """What the live workers said about their tasks (Celery's ``inspect``)."""

    #: Task id -> (worker node, ``"active"``/``"reserved"``/``"scheduled"``).
    tasks: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: The workers that answered within the timeout.
    answered: frozenset[str] = frozenset()
    #: Why nothing could be asked (the broker was unreachable), else ``None``.
    error: str | None = None

    def running(self, task_id: str | None) -> str | None:
        """The node a live worker reports running ``task_id`` on, else ``None``."""
        where = self.tasks.get(task_id or "")
        return where[0] if where is not None and where[1] == "active" else None


_INSPECT_KINDS = ("active", "reserved", "scheduled")

#: Seconds, beyond the time given to the workers to answer, that asking them may
#: take to reach the broker (connect, publish the question). A broker that takes
#: longer (frozen, its replies lost) is reported as not answering, rather than
#: hanging the command: its client has no socket timeout of its own.
BROKER_ALLOWANCE = 3.0


class _Call:
    """``function(argument)`` on a thread of its own; :meth:`result` waits for it,
    until a deadline at most (a daemon thread: one stuck on a frozen broker is
    left behind, and does not keep the process alive)."""

    def __init__(self, function: Callable[[str], dict[str, Any]], argument: str) -> None:
        self._result: dict[str, Any] = {}

        def target() -> None:
            self._result = function(argument)

        self._thread = threading.Thread(target=target, name="redislock-inspect", daemon=True)
        self._thread.start()

    def result(self, deadline: float) -> dict[str, Any] | None:
        """What ``function`` returned, or ``None`` if it has not returned by
        ``deadline`` (a ``time.monotonic()`` value)."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return None if self._thread.is_alive() else self._result


def worker_activity(
    app: Any, timeout: float = 1.0, kinds: Sequence[str] = _INSPECT_KINDS
) -> WorkerActivity:
    """Ask every live worker of ``app`` which tasks it runs (``active``), holds
    (``reserved``) and waits on for an ETA (``scheduled``); each question waits
    ``timeout`` seconds for the answers. Never raises for an unreachable broker,
    nor waits more than ``timeout`` plus :data:`BROKER_ALLOWANCE` seconds for one
    that does not answer: :attr:`WorkerActivity.error` says why nothing is known."""
    tasks: dict[str, tuple[str, str]] = {}
    answered: set[str] = set()
    errors: list[str] = []

    def ask(kind: str) -> dict[str, Any]:
        # One connection per question, so the questions wait for answers together.
        try:
            with app.connection_for_write() as conn:
                conn.ensure_connection(max_retries=0)
                inspect = app.control.inspect(timeout=timeout, connection=conn)
                return getattr(inspect, kind)() or {}
        except Exception as exc:  # the broker is the app's business: report, never fail
            errors.append(f"workers not asked: {exc}")
            return {}

    threads = {kind: _Call(ask, kind) for kind in kinds}
    waited = timeout + BROKER_ALLOWANCE
    deadline = time.monotonic() + waited
    for kind, call in threads.items():
        result = call.result(deadline)
        if result is None:
            errors.insert(0, f"workers not asked: the broker did not answer within {waited:g} s")
            continue
        for node, entries in result.items():
            answered.add(node)
            for entry in entries or ():
                request = entry.get("request", entry) if kind == "scheduled" else entry
                task_id = request.get("id") if isinstance(request, dict) else None
                if task_id and task_id not in tasks:
                    tasks[task_id] = (node, kind)
    if errors:
        return WorkerActivity(tasks, frozenset(answered), errors[0])
    return WorkerActivity(tasks, frozenset(answered))


class ResultReads:
    """The result backend's state (``AsyncResult(id).state``) of some task ids, all
    asked at once, each on a daemon thread of its own, and waited for until one
    deadline shared by them all (and by whatever the caller does meanwhile): a
    frozen result backend, whose client retries on its own, holds a command up
    for that deadline once, not once per read."""

    def __init__(self, app: Any, task_ids: Iterable[str]) -> None:
        self._reads: dict[str, _ResultRead] = {}
        for task_id in task_ids:
            if task_id not in self._reads:
                self._reads[task_id] = _ResultRead(app, task_id)

    def result(self, task_id: str, deadline: float, waited: float) -> tuple[str | None, str | None]:
        """``(state, None)``, or ``(None, why not)`` if the state of ``task_id`` could
        not be read by ``deadline`` (a ``time.monotonic()`` value, ``waited`` seconds
        after the command began, as the message says)."""
        read = self._reads.get(task_id)
        if read is None:
            return None, "the result backend was not asked"
        return read.wait(deadline, waited)


class _ResultRead:
    """One ``AsyncResult(id).state`` read, on a daemon thread of its own."""

    def __init__(self, app: Any, task_id: str) -> None:
        self._state: str | None = None
        self._error: str | None = None
        self._thread = threading.Thread(
            target=self._read, args=(app, task_id), name="redislock-result", daemon=True
        )
        self._thread.start()

    def _read(self, app: Any, task_id: str) -> None:
        try:
            self._state = str(app.AsyncResult(task_id).state)
        except Exception as exc:  # the result backend is the app's business: report
            self._error = f"the result backend failed: {exc}"

    def wait(self, deadline: float, waited: float) -> tuple[str | None, str | None]:
        """What was read, or why nothing was (see :meth:`ResultReads.result`)."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            return None, f"timed out: the result backend did not answer within {waited:g} s"
        return self._state, self._error


@dataclass(frozen=True)
class HolderStatus:
    """What is known of the task holding a lock."""

    task_id: str
    #: Its state in the result backend (``AsyncResult(id).state``), if it could be read.
    result_state: str | None
    #: The live worker that reports it, and how (``active``, ``reserved``, ``scheduled``).
    worker: str | None
    worker_state: str | None
    #: How many workers answered (0: none alive, or the broker unreachable).
    workers_answered: int
    #: Why ``result_state`` is unknown (timed out, the backend failed), else ``None``.
    result_error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The status as a JSON object of the documented schema (``HOLDER_SCHEMA``)."""
        return {
            "task_id": self.task_id,
            "result_state": self.result_state,
            "worker": self.worker,
            "worker_state": self.worker_state,
            "workers_answered": self.workers_answered,
            "result_error": self.result_error,
        }


def holder_status(
    app: Any,
    task_id: str,
    timeout: float = 1.0,
    activity: WorkerActivity | None = None,
    *,
    results: ResultReads | None = None,
    deadline: float | None = None,
) -> HolderStatus:
    """Ask the result backend and the live workers about ``task_id``, each within
    about ``timeout`` seconds (pass ``activity`` to reuse one round of questions).

    Pass ``results`` (reads started beforehand) and ``deadline`` (a
    ``time.monotonic()`` value) to wait for the result backend only until
    ``deadline``, shared with whatever was asked meanwhile.
    """
    if results is None:
        results = ResultReads(app, [task_id])
    if deadline is None:
        deadline = time.monotonic() + timeout
    if activity is None:
        activity = worker_activity(app, timeout)
    state, error = results.result(task_id, deadline, timeout)
    node, kind = activity.tasks.get(task_id, (None, None))
    return HolderStatus(task_id, state, node, kind, len(activity.answered), error)


def purge_locks(
    app: Any, *, task: str | None = None, node: str | None = None, all: bool = False
) -> int:
    """Free the locks of ``app``'s tasks, whoever holds them; return how many were freed.

    The counterpart of celery-singleton's ``clear_locks(app)``: ``purge_locks(app,
    all=True)`` frees every lock in the app's lock stores (a test's or a
    deployment's clean slate); ``task=`` only those held for that task name;
    ``node=`` only those held by tasks running on that worker node (one that died
    and will not come back). Holders still running are not stopped, and find
    their locks lost at their next renewal. Waiters are woken. Only the holds
    found are freed: a lock that changed hands since it was found (handed to a
    waiter, taken anew) is left to its new holder, who was never selected.

    Raises:
        ValueError: none of ``task``, ``node`` or ``all=True`` was given.
        LockBackendError: a lock store could not be reached.
    """
    if task is None and node is None and not all:
        raise ValueError("purge_locks: say what to free: task=NAME, node=NODENAME or all=True")
    freed = 0
    for store in app_stores(app):
        for info in list_locks(store.client, "*", store.prefix, task=task):
            if node is not None and info.node != node:
                continue
            if force_release(store.client, info.name, store.prefix, info.fence):
                freed += 1
    return freed


def clear_locks(app: Any) -> int:
    """Free every lock of ``app``: celery-singleton's ``clear_locks(app)``, same name."""
    return purge_locks(app, all=True)


def is_cluster(client: Client) -> bool:
    """Whether ``client`` talks to a Redis Cluster."""
    return isinstance(client, RedisCluster)


#: The ``maxmemory-policy`` values under which the server never drops a key to
#: make room: ``noeviction`` refuses writes instead.
SAFE_MEMORY_POLICIES = ("noeviction",)


class ServerFacts(NamedTuple):
    """What ``celery redislock ping`` reports of one primary of the lock store."""

    #: The server's version (``redis_version``, or ``valkey_version`` for Valkey).
    version: str
    #: Its memory limit in bytes (``maxmemory``; 0: none).
    maxmemory: int
    #: What it does when the limit is reached (``maxmemory-policy``).
    policy: str

    @property
    def evicts_locks(self) -> bool:
        """Whether the server may drop a held lock's key to make room: every lock
        key has an expiry, so the ``volatile-*`` policies evict them as the
        ``allkeys-*`` ones do."""
        return self.maxmemory > 0 and self.policy not in SAFE_MEMORY_POLICIES


def server_facts(client: Client, timeout: float = DEFAULT_CALL_TIMEOUT) -> list[ServerFacts]:
    """The version and memory settings of each primary of the lock store
    (``INFO server`` and ``INFO memory``, in one round trip per primary).

    Raises:
        LockBackendError: the store could not be reached.
    """
    facts = []
    with backend_errors("reach the lock store"):
        for transport in Router(client).transports():
            commands = [("INFO", "server"), ("INFO", "memory")]
            fields: dict[str, str] = {}
            for reply in run(transport, commands, Deadline.after(timeout)):
                if isinstance(reply, Exception):
                    raise reply
                text = _text(reply) or ""
                for line in text.splitlines():
                    name, colon, value = line.partition(":")
                    if colon and not name.startswith("#"):
                        fields[name] = value
            version = fields.get("valkey_version") or fields.get("redis_version") or "?"
            limit = fields.get("maxmemory", "0")
            facts.append(
                ServerFacts(
                    version=version,
                    maxmemory=int(limit) if limit.isdigit() else 0,
                    policy=fields.get("maxmemory_policy", "noeviction"),
                )
            )
    return facts


def server_versions(client: Client, timeout: float = DEFAULT_CALL_TIMEOUT) -> list[str]:
    """The server version of each primary of the lock store.

    Raises:
        LockBackendError: the store could not be reached.
    """
    return [facts.version for facts in server_facts(client, timeout)]


def short_reason(exc: BaseException) -> str:
    """Why a lock store could not be used, in a few words for a one-line message."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, RedisError):
        cause = cause.__cause__
    if cause is None:
        return str(exc)
    message = str(cause)
    if isinstance(cause, redis.AuthenticationError) or "WRONGPASS" in message:
        return "authentication failed (check the user name and password)"
    if isinstance(cause, redis.TimeoutError):
        return "unreachable (timed out)"
    if isinstance(cause, redis.ConnectionError):
        lowered = message.lower()
        for sign, said in (
            ("refused", "connection refused"),
            ("name or service not known", "unknown host"),
            ("nodename nor servname", "unknown host"),
            ("timed out", "timed out"),
            ("no route", "no route to host"),
            ("reset by peer", "connection reset"),
        ):
            if sign in lowered:
                return f"unreachable ({said})"
        return f"unreachable ({message})"
    if isinstance(cause, AskError | TryAgainError):
        return slot_moving(cause)
    return str(exc).removeprefix("could not ").split(": ", 1)[-1]
