"""The heartbeat: one daemon thread per process that keeps held locks alive.

Every lock taken with ``heartbeat=True`` registers here. The thread sleeps until
the earliest lock is due, then renews every lock that is due (or nearly due) in
one pipelined round trip per Redis server, however many locks the process holds.

A lock that cannot be renewed — the server says another owner holds it, or the
server stayed unreachable until the lock's TTL ran out — is marked lost, taken
off the list and reported through its ``on_lost`` callback; it is never renewed
again. The thread survives errors (they are logged) and is rebuilt lazily in a
child process after ``fork()``, which starts with no locks and no thread.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Protocol

import redis
from redis.exceptions import NoScriptError

from celery_redislock.scripts import EXTEND

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

logger = logging.getLogger(__name__)


class Renewable(Protocol):
    """What the heartbeat needs from a lock."""

    client: redis.Redis
    key: str
    owner: str

    @property
    def ttl_ms(self) -> int: ...

    @property
    def renew_interval(self) -> float: ...

    def _renewed(self, now: float) -> None: ...

    def _mark_lost(self) -> None: ...

    def _expires_at(self) -> float: ...


class Heartbeat:
    """Renews registered locks from a single background thread.

    Use :func:`get_heartbeat` for the process-wide instance; separate instances
    exist only for tests.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._due: dict[Renewable, float] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        # When the sleeping thread will wake by itself (-inf while it is awake).
        self._wake_at = -math.inf
        #: Completed renewal rounds; each round is one round trip per server.
        self.rounds = 0

    def register(self, lock: Renewable) -> None:
        """Start renewing ``lock`` every ``lock.renew_interval`` seconds."""
        with self._cond:
            due = self._clock() + lock.renew_interval
            self._due[lock] = due
            self._ensure_thread()
            # Wake the thread only if this lock is due before it would wake anyway:
            # with one TTL for all locks that is never, and a task pays no thread switch.
            if due < self._wake_at:
                self._cond.notify()

    def unregister(self, lock: Renewable) -> None:
        """Stop renewing ``lock`` (no-op if it is not registered)."""
        with self._cond:
            self._due.pop(lock, None)

    def held(self) -> list[Renewable]:
        """The locks being renewed right now."""
        with self._cond:
            return list(self._due)

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and wait for it; registered locks are no longer renewed."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(
                target=self._run, name="celery-redislock-heartbeat", daemon=True
            )
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping:
                    now = self._clock()
                    if self._due:
                        wait = min(self._due.values()) - now
                        if wait <= 0:
                            break
                    else:
                        wait = None
                    self._wake_at = math.inf if wait is None else now + wait
                    self._cond.wait(wait)
                    self._wake_at = -math.inf
                if self._stopping:
                    return
                now = self._clock()
                # Renew everything due within half an interval, so locks taken at
                # nearly the same moment share one round trip.
                batch = [
                    lock for lock, due in self._due.items() if due - lock.renew_interval / 2 <= now
                ]
            try:
                self.renew(batch)
            except Exception:  # pragma: no cover - the thread must not die
                logger.exception("celery_redislock heartbeat round failed")

    def renew(self, locks: Iterable[Renewable]) -> None:
        """Renew ``locks`` now: one pipelined round trip per Redis client."""
        by_client: dict[redis.Redis, list[Renewable]] = defaultdict(list)
        for lock in locks:
            by_client[lock.client].append(lock)
        for client, group in by_client.items():
            self._renew_group(client, group)
        self.rounds += 1

    def _renew_group(self, client: redis.Redis, group: list[Renewable]) -> None:
        now = self._clock()
        try:
            results = _extend_many(client, group)
        except redis.RedisError as exc:
            logger.warning("celery_redislock: could not renew %d lock(s): %s", len(group), exc)
            for lock in group:
                if lock._expires_at() <= self._clock():
                    self._lose(lock)
                else:
                    self._reschedule(lock, now + min(1.0, lock.renew_interval))
            return
        for lock, result in zip(group, results, strict=True):
            if isinstance(result, Exception):
                logger.warning("celery_redislock: renewing %s failed: %s", lock.key, result)
                self._reschedule(lock, now + min(1.0, lock.renew_interval))
            elif result == 1:
                lock._renewed(now)
                self._reschedule(lock, now + lock.renew_interval)
            else:
                self._lose(lock)

    def _reschedule(self, lock: Renewable, due: float) -> None:
        with self._cond:
            if lock in self._due:
                self._due[lock] = due

    def _lose(self, lock: Renewable) -> None:
        with self._cond:
            registered = self._due.pop(lock, None) is not None
        if registered:
            try:
                lock._mark_lost()
            except Exception:
                # A failing on_lost callback must not cut the round short for the
                # other locks (or kill the thread).
                logger.exception("celery_redislock: on_lost callback for %s failed", lock.key)


_EXTEND_SHA: str | None = None


def _extend_many(client: redis.Redis, locks: list[Renewable]) -> list[object]:
    """Run the EXTEND script for every lock in one pipelined round trip."""
    global _EXTEND_SHA
    if _EXTEND_SHA is None:
        import hashlib

        _EXTEND_SHA = hashlib.sha1(EXTEND.encode()).hexdigest()
    for _attempt in range(2):
        pipe = client.pipeline(transaction=False)
        for lock in locks:
            pipe.evalsha(_EXTEND_SHA, 1, lock.key, lock.owner, lock.ttl_ms)
        results: list[object] = pipe.execute(raise_on_error=False)
        if not any(isinstance(r, NoScriptError) for r in results):
            return results
        client.script_load(EXTEND)
    return results


_heartbeat: Heartbeat | None = None
_heartbeat_guard = threading.Lock()


def get_heartbeat() -> Heartbeat:
    """Return this process's heartbeat, creating it on first use."""
    global _heartbeat
    if _heartbeat is None:
        with _heartbeat_guard:
            if _heartbeat is None:
                _heartbeat = Heartbeat()
    return _heartbeat


def _reset_after_fork() -> None:
    global _heartbeat, _heartbeat_guard
    _heartbeat = None
    _heartbeat_guard = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
