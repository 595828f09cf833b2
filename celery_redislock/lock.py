"""The lock engine: a re-entrant, fenced, self-renewing Redis lock.

Example::

    from celery_redislock import RedisLock

    lock = RedisLock("redis://127.0.0.1:6379/0", "invoice:42", ttl=30)
    with lock:                       # waits for the lock, renews it while held
        write(invoice, fence=lock.token)

Keys, for a lock named ``N`` with the default prefix::

    redislock:{N}          hash: owner, lease, count, fence   (lives as long as the lock)
    redislock:{N}:fence    fencing counter                    (expires FENCE_TTL after use)
    redislock:{N}:released pub/sub channel, never a key       (one message per release)

(a name starting with ``}`` or ``\\`` is written ``\\N`` inside the braces, so the
hash tag is never empty and all three share one cluster slot).

Acquire, release and extend are each one round trip (an ``EVALSHA``). A waiter
subscribes to the release channel, re-checks the lock, then waits for a message
or for the holder's remaining TTL, whichever comes first — a lock that expires
publishes nothing, so the TTL bounds every wait.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import redis
from redis.exceptions import NoScriptError

from celery_redislock import scripts
from celery_redislock.client import as_client
from celery_redislock.errors import (
    LockBackendError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
)
from celery_redislock.heartbeat import Heartbeat, get_heartbeat

#: How long a name's fencing counter outlives the last acquire, in ms. After it
#: expires the next token is seeded from the server clock (microseconds), so
#: tokens still increase.
FENCE_TTL_MS = 3_600_000

#: Default key prefix.
DEFAULT_PREFIX = "redislock"

#: Default TTL of a lock, in seconds.
DEFAULT_TTL = 60.0


#: Longest TTL or duration accepted, in seconds (about 10 years). Redis keeps
#: expiries in milliseconds on a 64-bit clock, but a lock that outlives its
#: holder for longer than this is a lock that never frees: crash recovery rests on
#: the TTL.
MAX_SECONDS = 315_360_000.0

#: Shortest TTL accepted, in seconds: Redis counts expiries in milliseconds.
MIN_TTL = 0.001


def check_ttl(value: object, argument: str = "ttl") -> float:
    """Return ``value`` as a number of seconds Redis can store, or raise naming ``argument``.

    Raises:
        TypeError: not a number.
        ValueError: not finite, below :data:`MIN_TTL`, or above :data:`MAX_SECONDS`.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{argument} must be a number of seconds, not {type(value).__name__}")
    if not MIN_TTL <= value <= MAX_SECONDS:
        raise ValueError(
            f"{argument} must be a finite number of seconds from {MIN_TTL} to "
            f"{MAX_SECONDS:.0f} (about 10 years), got {value!r}; a lock that never "
            "expires is never freed after a crash"
        )
    return float(value)


def check_timeout(value: object, argument: str = "timeout") -> float | None:
    """Return ``value`` as a non-negative number of seconds or ``None`` (no limit)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(
            f"{argument} must be a number of seconds or None, not {type(value).__name__}"
        )
    if not value >= 0:
        raise ValueError(f"{argument} must be >= 0 seconds or None, got {value!r}")
    if value == float("inf"):
        return None
    return float(value)


def check_name(value: object, argument: str = "name") -> str:
    """Return ``value`` if it is a non-empty string Redis can store (UTF-8 encodable)."""
    if not isinstance(value, str):
        raise TypeError(f"{argument} must be a str, not {type(value).__name__}")
    if not value:
        raise ValueError(f"{argument} must be a non-empty string")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{argument} {value!r} cannot be encoded as UTF-8 ({exc.reason} at "
            f"position {exc.start}); lone surrogates cannot be sent to Redis"
        ) from None
    return value


def check_prefix(value: object, argument: str = "prefix") -> str:
    """Return ``value`` if it is a usable key prefix (non-empty, no empty ``{}`` tag)."""
    prefix = check_name(value, argument)
    if _empty_hash_tag(prefix):
        raise ValueError(
            f"{argument} {prefix!r} contains an empty {{hash tag}}; the lock's keys would "
            "land on different cluster slots"
        )
    return prefix


class _Script:
    """One Lua script, run with ``EVALSHA`` and loaded on a server that lacks it."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.sha = hashlib.sha1(text.encode()).hexdigest()

    def run(self, client: redis.Redis, keys: list[str], args: list[Any]) -> Any:
        try:
            return client.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            client.script_load(self.text)
            return client.evalsha(self.sha, len(keys), *keys, *args)


_ACQUIRE = _Script(scripts.ACQUIRE)
_RELEASE = _Script(scripts.RELEASE)
_EXTEND = _Script(scripts.EXTEND)
_RELEASE_LEASE = _Script(scripts.RELEASE_LEASE)


class _Scripts:
    """The engine's scripts bound to one client.

    Cheap to build (the digests are computed once per process) and holds nothing
    global, so a client is freed with the last lock that used it.
    """

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def acquire(self, keys: list[str], args: list[Any]) -> Any:
        return _ACQUIRE.run(self.client, keys, args)

    def release(self, keys: list[str], args: list[Any]) -> Any:
        return _RELEASE.run(self.client, keys, args)

    def extend(self, keys: list[str], args: list[Any]) -> Any:
        return _EXTEND.run(self.client, keys, args)

    def release_lease(self, keys: list[str], args: list[Any]) -> Any:
        return _RELEASE_LEASE.run(self.client, keys, args)


def scripts_for(client: redis.Redis) -> _Scripts:
    """Return the engine's scripts bound to ``client``."""
    return _Scripts(client)


def _empty_hash_tag(text: str) -> bool:
    """Whether the first ``{`` in ``text`` is directly followed by ``}`` (an empty tag,
    which Redis Cluster ignores, hashing the whole key instead)."""
    start = text.find("{")
    return start != -1 and text[start + 1 : start + 2] == "}"


def lock_keys(name: str, prefix: str = DEFAULT_PREFIX) -> tuple[str, str, str]:
    """Return ``(lock key, fence key, release channel)`` for a lock name.

    The name is the ``{hash tag}`` of every key, so the keys one script touches
    share a cluster slot. A name starting with ``}`` would make that tag empty, so
    such names (and, to keep the mapping one-to-one, names starting with ``\\``)
    get a ``\\`` in front inside the braces.

    Raises:
        ValueError: ``prefix`` itself contains an empty hash tag (``{}``).
    """
    check_prefix(prefix)
    check_name(name)
    if name.startswith(("}", "\\")):
        name = "\\" + name
    base = f"{prefix}:{{{name}}}"
    return base, f"{base}:fence", f"{base}:released"


def name_from_key(key: str, prefix: str = DEFAULT_PREFIX) -> str:
    """The lock name behind a lock key: the inverse of :func:`lock_keys`."""
    name = key[len(prefix) + 2 : -1]
    return name[1:] if name.startswith("\\") else name


class RedisLock:
    """A distributed lock held by an owner token, not by a thread.

    Arguments:
        client_or_url: a ``redis.Redis`` client or a ``redis://`` URL (clients for
            a URL are shared per process).
        name: the lock's name; every holder of the same name excludes the others.
        ttl: seconds the lock lives without renewal. Mandatory and > 0; a crashed
            holder's lock frees itself after at most this long.
        owner: the owner token. Default: 128 random bits. Two ``RedisLock``
            objects with the same owner are the same holder (re-entrant).
        lease: an optional lease id (a Celery task id). A new owner of the same
            lease takes the lock over instead of waiting, with a new fencing
            token; the old owner's next renewal finds it lost.
        heartbeat: renew the lock in the background while held (default on).
        heartbeat_interval: seconds between renewals; default ``ttl / 3``.
        on_lost: called with the lock, from the heartbeat thread, if it is lost.
        blocking_timeout: how long ``with lock:`` waits before raising
            :class:`~celery_redislock.errors.LockTimeoutError`; ``None`` waits forever.
        prefix: key prefix.

    Raises:
        TypeError, ValueError: an argument is invalid; the message names it.
    """

    def __init__(
        self,
        client_or_url: redis.Redis | str,
        name: str,
        ttl: float = DEFAULT_TTL,
        *,
        owner: str | None = None,
        lease: str | None = None,
        heartbeat: bool = True,
        heartbeat_interval: float | None = None,
        on_lost: Callable[[RedisLock], Any] | None = None,
        blocking_timeout: float | None = None,
        prefix: str = DEFAULT_PREFIX,
        _heartbeat: Heartbeat | None = None,
    ) -> None:
        check_name(name)
        check_prefix(prefix)
        if on_lost is not None and not callable(on_lost):
            raise TypeError(f"on_lost must be callable or None, not {type(on_lost).__name__}")
        self.ttl = check_ttl(ttl)
        if heartbeat_interval is None:
            self.heartbeat_interval = self.ttl / 3
        else:
            self.heartbeat_interval = check_ttl(heartbeat_interval, "heartbeat_interval")
            if self.heartbeat_interval >= self.ttl:
                raise ValueError(
                    f"heartbeat_interval ({heartbeat_interval}) must be shorter than ttl ({ttl}), "
                    "or the lock expires between renewals"
                )
        if owner is not None:
            check_name(owner, "owner")
        if lease is not None and lease != "":
            check_name(lease, "lease")
        self.blocking_timeout = check_timeout(blocking_timeout, "blocking_timeout")
        self.client = as_client(client_or_url)
        self.name = name
        self.prefix = prefix
        self.key, self.fence_key, self.channel = lock_keys(name, prefix)
        #: The owner token (≥128 random bits unless given).
        self.owner = owner or secrets.token_hex(16)
        self.lease = lease or ""
        self.heartbeat = heartbeat
        self.on_lost = on_lost
        #: The fencing token of the current hold; strictly increasing per name.
        self.token: int | None = None
        #: True once a held lock could not be renewed or was found taken.
        self.lost = False
        #: The lease (task id) that held the lock when an acquire last failed;
        #: ``None`` if it had none. Saves a round trip to ask who is in the way.
        self.blocked_by: str | None = None
        self._holds = 0
        self._expiry = 0.0
        self._state = threading.Lock()
        self._heartbeat = _heartbeat
        self._scripts = scripts_for(self.client)

    def __repr__(self) -> str:
        return f"<RedisLock {self.name!r} owner={self.owner[:8]}… token={self.token}>"

    # The heartbeat's view of the lock.
    @property
    def ttl_ms(self) -> int:
        """The TTL in whole milliseconds (at least 1)."""
        return max(1, int(self.ttl * 1000))

    @property
    def renew_interval(self) -> float:
        """Seconds between heartbeat renewals."""
        return self.heartbeat_interval

    def _renewed(self, now: float) -> None:
        self._expiry = now + self.ttl

    def _expires_at(self) -> float:
        return self._expiry

    def _mark_lost(self) -> None:
        with self._state:
            if self.lost or self._holds == 0:
                return
            self.lost = True
        if self.on_lost is not None:
            self.on_lost(self)

    # Public API.
    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; return whether it was taken.

        Arguments:
            blocking: wait for the lock if another owner holds it.
            timeout: with ``blocking``, give up after this many seconds
                (``None``: wait as long as it takes).

        Raises:
            LockBackendError: Redis could not be reached.
        """
        timeout = check_timeout(timeout)
        started = time.monotonic()
        reply = self._try_acquire()
        if reply[0]:
            return True
        if not blocking or timeout == 0:
            return False
        deadline = None if timeout is None else started + timeout
        return self._wait(deadline)

    def release(self) -> None:
        """Drop one hold; the last hold frees the lock and wakes a waiter.

        Raises:
            LockNotOwnedError: this owner does not hold the lock (nothing deleted).
            LockLostError: this object held it, but it expired or was taken over.
        """
        try:
            result = self._scripts.release(keys=[self.key], args=[self.owner, self.channel])
        except redis.RedisError as exc:
            raise LockBackendError(f"could not release lock {self.name!r}: {exc}") from exc
        if result == 0:
            was_held = self._forget()
            if was_held:
                self.lost = True
                raise LockLostError(self.name)
            raise LockNotOwnedError(self.name)
        with self._state:
            self._holds = max(0, self._holds - 1)
            done = result == 1 or self._holds == 0
        if done:
            self._forget()

    def extend(self, ttl: float | None = None) -> None:
        """Reset the remaining TTL to ``ttl`` seconds (default: the lock's TTL).

        Raises:
            LockNotOwnedError: this owner does not hold the lock.
            LockLostError: this object held it, but it expired or was taken over.
        """
        new_ttl = self.ttl if ttl is None else check_ttl(ttl)
        try:
            result = self._scripts.extend(
                keys=[self.key], args=[self.owner, max(1, int(new_ttl * 1000))]
            )
        except redis.RedisError as exc:
            raise LockBackendError(f"could not extend lock {self.name!r}: {exc}") from exc
        if result != 1:
            if self._forget():
                self.lost = True
                raise LockLostError(self.name)
            raise LockNotOwnedError(self.name)
        self._expiry = time.monotonic() + new_ttl

    def locked(self) -> bool:
        """Whether any owner holds the lock now."""
        try:
            return bool(self.client.exists(self.key))
        except redis.RedisError as exc:
            raise LockBackendError(f"could not read lock {self.name!r}: {exc}") from exc

    def owned(self) -> bool:
        """Whether this owner holds the lock now (asks Redis)."""
        try:
            owner = self.client.hget(self.key, "owner")
        except redis.RedisError as exc:
            raise LockBackendError(f"could not read lock {self.name!r}: {exc}") from exc
        return _text(owner) == self.owner

    def holder_lease(self) -> str | None:
        """The lease (task id) of whoever holds the lock now, if any."""
        try:
            lease = self.client.hget(self.key, "lease")
        except redis.RedisError as exc:
            raise LockBackendError(f"could not read lock {self.name!r}: {exc}") from exc
        return _text(lease) or None

    @property
    def holding(self) -> bool:
        """Whether this object counts a hold (its local view: no round trip)."""
        return self._holds > 0

    def detach(self) -> None:
        """Stop renewing and forget the hold locally, leaving Redis untouched.

        The lock then lives until its TTL runs out, unless another owner of the
        same lease takes it over first (how a retried Celery task keeps its lock
        across the retry).
        """
        self._forget()

    def __enter__(self) -> RedisLock:
        if not self.acquire(blocking=True, timeout=self.blocking_timeout):
            raise LockTimeoutError(self.name, self.blocking_timeout)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    # Internal steps.
    def _try_acquire(self) -> list[Any]:
        try:
            reply: list[Any] = self._scripts.acquire(
                keys=[self.key, self.fence_key],
                args=[self.owner, self.ttl_ms, self.lease, FENCE_TTL_MS],
            )
        except redis.RedisError as exc:
            raise LockBackendError(f"could not acquire lock {self.name!r}: {exc}") from exc
        if reply[0]:
            now = time.monotonic()
            with self._state:
                first = self._holds == 0
                self._holds = 1 if reply[0] == 1 else self._holds + 1
                self.token = int(reply[1])
                self.lost = False
                self._expiry = now + self.ttl
            # A new hold (reply 1) is registered even if this object still counted
            # holds from a lock it lost: losing it took it off the heartbeat.
            if self.heartbeat and (first or reply[0] == 1):
                self._beat().register(self)
        else:
            self.blocked_by = _text(reply[2]) or None
        return reply

    def _wait(self, deadline: float | None) -> bool:
        pubsub = self.client.pubsub()  # type: ignore[no-untyped-call]
        try:
            pubsub.subscribe(self.channel)
            # The re-check below must run after the subscription is in place, or a
            # release in between would go unheard until the holder's TTL ran out.
            _wait_for_subscription(pubsub, deadline)
            while True:
                reply = self._try_acquire()
                if reply[0]:
                    return True
                pttl = int(reply[1])
                wait = pttl / 1000 if pttl > 0 else 0.001
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return False
                    wait = min(wait, remaining)
                _wait_for_message(pubsub, wait)
        except redis.RedisError as exc:
            raise LockBackendError(f"could not wait for lock {self.name!r}: {exc}") from exc
        finally:
            pubsub.close()

    def _beat(self) -> Heartbeat:
        return self._heartbeat or get_heartbeat()

    def _forget(self) -> bool:
        """Drop local hold state; return whether this object thought it held the lock."""
        with self._state:
            was_held = self._holds > 0
            self._holds = 0
        if self.heartbeat:
            self._beat().unregister(self)
        return was_held


def _text(value: bytes | str | None) -> str | None:
    """Decode a reply from a client that may or may not decode responses."""
    return value.decode() if isinstance(value, bytes) else value


def _wait_for_subscription(pubsub: redis.client.PubSub, deadline: float | None) -> None:
    """Block until the server confirms the subscription (or ``deadline`` passes)."""
    while True:
        remaining = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
        message = pubsub.get_message(timeout=max(0.0, remaining))
        if message is not None and message.get("type") == "subscribe":
            return
        if deadline is not None and time.monotonic() >= deadline:
            return


def _wait_for_message(pubsub: redis.client.PubSub, seconds: float) -> None:
    """Block until a published message arrives or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        message = pubsub.get_message(timeout=remaining)
        if message is not None and message.get("type") == "message":
            return


def release_lease(
    client_or_url: redis.Redis | str, name: str, lease: str, prefix: str = DEFAULT_PREFIX
) -> bool:
    """Free lock ``name`` if the given lease (task id) holds it, whatever its hold count.

    For paths where the holder's process cannot release it itself: a task
    revoked while queued, or terminated while running. Returns whether it was freed.
    """
    client = as_client(client_or_url)
    key, _fence, channel = lock_keys(name, prefix)
    try:
        return bool(scripts_for(client).release_lease(keys=[key], args=[lease, channel]))
    except redis.RedisError as exc:
        raise LockBackendError(f"could not release lock {name!r}: {exc}") from exc
