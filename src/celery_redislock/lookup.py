"""Host names resolved within a deadline.

The system's resolver (``getaddrinfo``) blocks for as long as its own settings
allow: with a DNS server that does not answer, five seconds or more for each try
(``/etc/resolv.conf``'s ``timeout`` and ``attempts``). A lock call must not wait
on it past its own deadline, so a name is looked up in a thread of its own while
the caller waits at most until its deadline. A lookup the caller gave up on goes
on; callers asking for the same name meanwhile wait for it rather than start
another. Nothing is cached once a lookup ends: a name's next connection looks it
up again, so a record changed by a failover (a cloud primary endpoint) is seen.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError


class _Lookup:
    """One name's lookup under way, in a daemon thread."""

    __slots__ = ("addresses", "done", "error", "key")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.done = threading.Event()
        self.addresses: list[str] = []
        self.error: Exception | None = None

    def start(self) -> None:
        threading.Thread(target=self._run, name="celery-redislock-lookup", daemon=True).start()

    def _run(self) -> None:
        host, port = self.key
        try:
            found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except Exception as exc:
            # Not only OSError: a name IDNA cannot encode raises UnicodeError.
            self.error = exc
        else:
            # The addresses in the resolver's order of preference, each once; a
            # scoped IPv6 address (link-local) keeps its scope.
            self.addresses = list(dict.fromkeys(_numeric(info[4]) for info in found))
        finally:
            with _guard:
                if _lookups.get(self.key) is self:
                    del _lookups[self.key]
            self.done.set()


def _numeric(address: tuple[object, ...]) -> str:
    """The host part of a socket address, as a numeric address to connect to."""
    host = str(address[0])
    if len(address) == 4 and address[3]:
        return f"{host}%{address[3]}"
    return host


#: Lookups under way, by host and port.
_lookups: dict[tuple[str, int], _Lookup] = {}
_guard = threading.Lock()


def _forget_after_fork() -> None:
    # A forked child has none of its parent's lookup threads, and the guard may
    # have been held by another thread of the parent as it forked.
    global _guard
    _guard = threading.Lock()
    _lookups.clear()


os.register_at_fork(after_in_child=_forget_after_fork)


def is_address(host: str) -> bool:
    """Whether ``host`` is a numeric IPv4 or IPv6 address (nothing to look up)."""
    try:
        ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    return True


def resolve(host: str, port: int, timeout: float) -> list[str]:
    """The addresses of ``host``, waiting for the system's resolver at most
    ``timeout`` seconds; a numeric address is returned as it is.

    Raises:
        redis.TimeoutError: the resolver did not answer in time.
        redis.ConnectionError: the resolver answered that ``host`` has no address
            (or failed).
    """
    if is_address(host):
        return [host]
    key = (host, port)
    with _guard:
        lookup = _lookups.get(key)
        new = lookup is None
        if lookup is None:
            lookup = _lookups[key] = _Lookup(key)
    if new:
        # Started outside the guard: starting a thread waits for it to run.
        try:
            lookup.start()
        except RuntimeError as exc:
            # No thread can be started as the interpreter shuts down (Python 3.12,
            # at exit): a lookup unbounded by the caller's deadline is no option.
            lookup.error = exc
            with _guard:
                if _lookups.get(key) is lookup:
                    del _lookups[key]
            lookup.done.set()
    if not lookup.done.wait(max(0.0, timeout)):
        raise RedisTimeoutError(
            f"timed out looking up the address of {host!r} (the system's resolver, "
            "or its DNS server, did not answer in time)"
        )
    if lookup.error is not None:
        raise RedisConnectionError(f"could not look up the address of {host!r}: {lookup.error}")
    if not lookup.addresses:
        raise RedisConnectionError(f"no address found for {host!r}")
    return lookup.addresses
