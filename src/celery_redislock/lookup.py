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

    __slots__ = ("addresses", "done", "error", "key", "pid")

    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.pid = os.getpid()
        self.done = threading.Event()
        self.addresses: list[str] = []
        self.error: OSError | None = None
        threading.Thread(target=self._run, name="redislock-lookup", daemon=True).start()

    def _run(self) -> None:
        host, port = self.key
        try:
            found = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
        except OSError as exc:
            self.error = exc
        else:
            # The addresses in the resolver's order of preference, each once.
            self.addresses = list(dict.fromkeys(str(info[4][0]) for info in found))
        finally:
            with _guard:
                if _lookups.get(self.key) is self:
                    del _lookups[self.key]
            self.done.set()


#: Lookups under way, by host and port.
_lookups: dict[tuple[str, int], _Lookup] = {}
_guard = threading.Lock()


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
        if lookup is None or lookup.pid != os.getpid():
            # (A forked child has no thread of its parent's lookup: it starts its own.)
            lookup = _lookups[key] = _Lookup(key)
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
