"""Per-process Redis clients, shared by URL.

Locks, the heartbeat and the Celery integration all ask for clients here so a
process keeps one connection pool per server instead of one per lock or per
task call. The cache is emptied in a forked child (Celery's prefork pool), so a
child never talks over a socket it inherited from its parent.

URLs take the forms Celery's own Redis transport takes:

* ``redis://[[user]:password@]host[:port][/db]``, ``rediss://…`` (TLS, with
  redis-py's ``ssl_*`` query parameters such as ``ssl_cert_reqs`` and
  ``ssl_ca_certs``) and ``unix:///path/to.sock[?db=N]``;
* Sentinel: ``sentinel://[:password@]host:port[/db];sentinel://host2:port;…``,
  with transport options naming the master (``master_name``) and, optionally,
  ``sentinel_kwargs`` for the connections to the Sentinels themselves — the keys
  of Celery's ``broker_transport_options`` for a Sentinel broker.

The clients made here time out their connects and reads after
:data:`~celery_redislock.transport.DEFAULT_CALL_TIMEOUT`; the lock's own round
trips are bounded tighter by their callers (see :mod:`celery_redislock.transport`).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import threading
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlparse, urlsplit, urlunsplit

import redis
from redis.cluster import RedisCluster
from redis.sentinel import Sentinel

from celery_redislock.transport import DEFAULT_CALL_TIMEOUT, Client

#: URL schemes of a lock store.
URL_SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")

_TIMEOUTS: dict[str, Any] = {
    "socket_timeout": DEFAULT_CALL_TIMEOUT,
    "socket_connect_timeout": DEFAULT_CALL_TIMEOUT,
}

_clients: dict[str, redis.Redis] = {}
_guard = threading.Lock()


def url_shown(url: str) -> str:
    """``url`` as a message may show it: with any password replaced by ``***``."""
    shown = []
    for part in url.split(";"):
        parsed = urlsplit(part)
        try:
            password = parsed.password
        except ValueError:  # pragma: no cover - a port that is not a number
            password = None
        if password is not None:
            netloc = parsed.netloc.replace(f":{password}@", ":***@", 1)
            part = urlunsplit(parsed._replace(netloc=netloc))
        shown.append(part)
    return ";".join(shown)


def check_url(value: object, argument: str = "url") -> str:
    """Return ``value`` if it is a lock store URL, or raise naming ``argument``.

    The message shows the URL's scheme only: the rest may hold a password.
    """
    schemes = ", ".join(URL_SCHEMES)
    if not isinstance(value, str):
        raise TypeError(
            f"{argument} must be a Redis URL string ({schemes}), not {type(value).__name__}"
        )
    if not value.startswith(URL_SCHEMES):
        scheme, sep, _rest = value.partition("://")
        shown = f"{scheme}://…" if sep else f"{value[:12]!r} (no scheme)"
        raise ValueError(f"{argument} must be a Redis URL ({schemes}), got {shown}")
    return value


def get_client(url: str, transport_options: Mapping[str, Any] | None = None) -> redis.Redis:
    """Return this process's shared client for ``url``, creating it on first use.

    Arguments:
        url: a lock store URL (see the module docstring).
        transport_options: for a ``sentinel://`` URL, ``master_name`` (required),
            ``sentinel_kwargs`` and any further keyword for the master's client;
            for any other URL, keywords for its connections (the ``ssl_*`` options
            of Celery's ``broker_use_ssl``, say).

    Raises:
        ValueError: the URL is not a Redis URL, or a Sentinel URL lacks ``master_name``.
    """
    check_url(url)
    options = dict(transport_options or {})
    cache_key = f"{url}\0{_stable(options)}" if options else url
    client = _clients.get(cache_key)
    if client is None:
        with _guard:
            client = _clients.get(cache_key)
            if client is None:
                if url.startswith("sentinel://"):
                    client = _sentinel_master(url, options)
                else:
                    client = redis.Redis.from_url(
                        _as_redis_py_url(url),
                        **{"health_check_interval": 30, **_TIMEOUTS, **options},
                    )
                _clients[cache_key] = client
    return client


#: kombu's spelling of a certificate requirement in a ``rediss://`` URL
#: (``ssl_cert_reqs=CERT_REQUIRED``), which redis-py spells ``required``.
_KOMBU_CERT_REQS = re.compile(r"(?i)(\bssl_cert_reqs=)CERT_(REQUIRED|OPTIONAL|NONE)\b")


def _as_redis_py_url(url: str) -> str:
    """``url`` with kombu's spellings of its settings turned into redis-py's: the
    broker URL Celery takes serves as the lock store's."""
    return _KOMBU_CERT_REQS.sub(lambda found: found[1] + found[2].lower(), url)


def _stable(options: Mapping[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=repr)


#: The key under which :func:`sentinel_options` keeps the setting its options came
#: from, to name it in a message.
SETTING_KEY = "_setting"

#: The keys of a Sentinel's transport options that are not the master's connection
#: options: its name, the Sentinels' own options, and the setting they came from.
_SENTINEL_KEYS = ("master_name", "sentinel_kwargs", SETTING_KEY)


def sentinel_options(options: Mapping[str, Any], setting: str) -> dict[str, Any]:
    """Of a Celery transport's ``options`` (``broker_transport_options``), those a
    Sentinel lock store takes: the master's name, the Sentinels' options, and the
    master's connection options redis-py knows; not the broker's own
    (``visibility_timeout``, ...). ``setting`` names them in messages."""
    known = _connection_parameters()
    kept = {key: value for key, value in options.items() if key in _SENTINEL_KEYS or key in known}
    kept[SETTING_KEY] = setting
    return kept


def _connection_parameters() -> frozenset[str]:
    """The keyword arguments redis-py's connection classes take."""
    names: set[str] = set()
    for kind in (redis.connection.AbstractConnection, redis.connection.Connection):
        names.update(inspect.signature(kind.__init__).parameters)
    names.update(inspect.signature(redis.connection.SSLConnection.__init__).parameters)
    return frozenset(names - {"self", "args", "kwargs"})


def _sentinel_master(url: str, options: dict[str, Any]) -> redis.Redis:
    """A client of the master that the Sentinels in ``url`` name ``master_name``."""
    setting = options.pop(SETTING_KEY, "app.conf.redislock_transport_options")
    master_name = options.pop("master_name", None)
    if not master_name:
        raise ValueError(
            f"the Sentinel URL {url_shown(url)!r} needs the master's name: set "
            f'{setting} = {{"master_name": "mymaster"}}'
        )
    sentinel_kwargs = dict(_TIMEOUTS, **options.pop("sentinel_kwargs", None) or {})
    hosts: list[tuple[str, int]] = []
    master: dict[str, Any] = dict(_TIMEOUTS)
    for part in url.split(";"):
        part = part.strip()
        if not part:
            continue
        check_url(part)
        parsed = urlparse(part)
        hosts.append((parsed.hostname or "localhost", parsed.port or 26379))
        if parsed.password and "password" not in master:
            master["password"] = unquote(parsed.password)
        if parsed.username and "username" not in master:
            master["username"] = unquote(parsed.username)
        db = parsed.path.strip("/")
        if db and "db" not in master:
            master["db"] = int(db)
    master.update(options)
    sentinel = Sentinel(hosts, sentinel_kwargs=sentinel_kwargs, **_TIMEOUTS)  # type: ignore[no-untyped-call,unused-ignore]
    client: redis.Redis = sentinel.master_for(master_name, **master)  # type: ignore[no-untyped-call,unused-ignore]
    return client


def as_client(client_or_url: Client | str) -> Client:
    """Accept a ready client (one server, Sentinel-managed, or a cluster) or a URL."""
    if isinstance(client_or_url, str):
        if not client_or_url:
            raise ValueError(
                "client_or_url: an empty URL was given; pass a redis:// URL or a client"
            )
        return get_client(client_or_url)
    if isinstance(client_or_url, redis.Redis | RedisCluster):
        return client_or_url
    raise TypeError(
        "client_or_url must be a redis.Redis or redis.cluster.RedisCluster client or a "
        f"redis:// URL, not {type(client_or_url).__name__}"
    )


def _forget_after_fork() -> None:
    global _guard
    _clients.clear()
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
