"""Read and repair lock state: what the ``celery redislock`` command shows and does."""

from __future__ import annotations

from dataclasses import dataclass

import redis

from celery_redislock.lock import (
    DEFAULT_PREFIX,
    FENCE_TTL_MS,
    lock_keys,
    name_from_key,
    wake_channel_prefix,
)
from celery_redislock.scripts import FORCE_RELEASE_SCRIPT, Call, request_id, send
from celery_redislock.transport import DEFAULT_CALL_TIMEOUT, Deadline, Router, backend_errors


@dataclass(frozen=True)
class LockInfo:
    """One held lock as stored in Redis."""

    #: The lock name (for a task: ``<task name>:<digest>``).
    name: str
    #: The lease (task id) of the holder, or ``None`` for a plain lock.
    holder: str | None
    #: How many times the holder has taken it (re-entrant holds).
    count: int
    #: The fencing token of the current hold.
    fence: int
    #: Milliseconds until it expires without renewal.
    ttl_ms: int


def list_locks(
    client: redis.Redis, pattern: str = "*", prefix: str = DEFAULT_PREFIX
) -> list[LockInfo]:
    """Every lock whose name matches the glob ``pattern``, sorted by name."""
    found: list[LockInfo] = []
    keys = [
        raw.decode() if isinstance(raw, bytes) else str(raw)
        for raw in client.scan_iter(f"{prefix}:{{{pattern}}}", count=1000)
    ]
    # Two commands per lock, but one round trip for them all.
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hmget(key, "owner", "lease", "count", "fence")
        pipe.pttl(key)
    replies = pipe.execute()
    for key, (owner, lease, count, fence), ttl in zip(
        keys, replies[::2], replies[1::2], strict=True
    ):
        if not owner:  # free (kept for its fencing counter), or gone since SCAN
            continue
        found.append(
            LockInfo(
                name=name_from_key(key, prefix),
                holder=lease.decode() if lease else None,
                count=int(count),
                fence=int(fence or 0),
                ttl_ms=int(ttl),
            )
        )
    return sorted(found, key=lambda info: info.name)


def force_release(client: redis.Redis, name: str, prefix: str = DEFAULT_PREFIX) -> bool:
    """Free a lock whoever holds it and wake its waiters; return whether it was held.

    For operators only: the holder keeps running, unprotected, and finds the
    lock lost at its next heartbeat.
    """
    key, queue = lock_keys(name, prefix)
    call = Call(
        FORCE_RELEASE_SCRIPT,
        [key, queue],
        ["", wake_channel_prefix(prefix), request_id(), FENCE_TTL_MS],
    )
    with backend_errors(f"release lock {name!r}"):
        return bool(send(Router(client), key, call, Deadline.after(DEFAULT_CALL_TIMEOUT)))
