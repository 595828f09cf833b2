"""The lock store of a Celery app: which Redis the locks of its tasks live in.

Resolved at first use, and again whenever one of the settings below is changed
through ``app.conf`` (assignment or ``update()``), so configuring the app after
defining its tasks, or between uses, works; the first of these that is set wins:

1. ``app.conf.redislock_client``: a ready redis-py client (``redis.Redis``, a
   Sentinel ``master_for()`` client, ``redis.cluster.RedisCluster``) or a
   zero-argument callable returning one, called lazily once per process (after
   ``fork()``, so a prefork child builds its own) in a thread of its own, one
   call at a time however many threads need the store. A use waits for it
   :data:`CLIENT_BUILD_WAIT` seconds at most; a callable that fails to reach
   the store (a ``RedisCluster`` asks a node for the slot map as it is made) or
   is still making the client then raises
   :class:`~celery_redislock.errors.LockBackendError`, as a lock call would. A
   client made after its callers stopped waiting is kept for the next use.
   After a failed call the next use calls it again, as it does once a call has
   been under way :data:`CLIENT_BUILD_ABANDON_WAITS` times the wait (that one
   is left to end on its own, its outcome dropped);
2. ``app.conf.redislock_url`` (``redis://``, ``rediss://``, ``unix://`` or
   ``sentinel://``), with ``app.conf.redislock_transport_options`` for Sentinel
   (``master_name``, ``sentinel_kwargs``, as Celery's
   ``broker_transport_options``; they serve a task's own ``sentinel://``
   ``lock_url`` too);
3. the broker URL (the first of several failover URLs, a list or separated by
   ``;``), when it is one of those, with the Sentinel and connection options of
   ``broker_transport_options`` (not the transport's own, such as
   ``visibility_timeout``) and the TLS options of ``broker_use_ssl`` (a dict of
   ``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``, as
   Celery's Redis transport takes it: then the locks, like the broker's
   messages, go over TLS; for a Sentinel broker, to its master).

What is resolved for an app, and the client its callable made, are kept on the
app itself: an app that is dropped (one made per job) takes them along, and the
connections the client's locks opened are closed.
"""

from __future__ import annotations

import operator
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException, RedisError

from celery_redislock.client import (
    URL_SCHEMES,
    check_url,
    get_client,
    sentinel_options,
    url_shown,
)
from celery_redislock.errors import LockBackendError
from celery_redislock.transport import DEFAULT_CALL_TIMEOUT, Client, describe_error

#: A lock store given directly: a client, or a callable that builds one.
ClientSource = Client | Callable[[], Client]

#: Seconds a use of the lock store waits for its ``redislock_client`` callable
#: to make the client (it runs in a thread of its own) before it fails with
#: LockBackendError, as a round trip that long would: the caller (a task
#: execution, a command) is never held longer by a constructor that hangs.
CLIENT_BUILD_WAIT: float = DEFAULT_CALL_TIMEOUT

#: After this many :data:`CLIENT_BUILD_WAIT` periods, a call of the callable that
#: has not returned is given up on: the next use calls it again, in a new thread,
#: and the old one is left to end on its own (its outcome dropped). A
#: constructor stuck for ever (a frozen server, no socket timeout) thus blocks
#: the store no longer than that, and leaves one thread behind per period.
CLIENT_BUILD_ABANDON_WAITS: int = 12

_guard = threading.Lock()

#: The attribute of an app that holds what this module keeps for it (see :func:`_kept`).
_KEPT = "_celery_redislock_store"

#: Counts the forks this process comes from: what an app kept in the parent is
#: not the child's (see :func:`_forget_after_fork`).
_generation = 0


class _Kept:
    """What this module keeps for one app in this process: the store resolved for
    it, with the configuration and the setting values it was resolved from; the
    client its ``redislock_client`` callable made, with that callable; and the
    call of the callable under way, or ended and not yet taken up."""

    __slots__ = ("built", "generation", "making", "resolved")

    def __init__(self) -> None:
        self.generation = _generation
        self.resolved: tuple[Any, tuple[Any, ...], Client] | None = None
        self.built: tuple[object, Client] | None = None
        self.making: _Making | None = None


def _kept(app: Any) -> _Kept:
    """What this module keeps for ``app``, kept on the app itself rather than in a
    table by app: whatever of it refers back to the app (its configuration does,
    once the app has sent a message; so may a ``redislock_client`` callable that
    reads it) then goes with the app. An entry of a table by app, weak as its key
    may be, would keep the app alive, and with it the client its callable made
    and the connections that client's locks opened, for as long as the process
    runs: an application that makes an app per job would gather them all."""
    kept: _Kept | None = getattr(app, _KEPT, None)
    if kept is not None and kept.generation == _generation:
        return kept
    with _guard:
        kept = getattr(app, _KEPT, None)
        if kept is None or kept.generation != _generation:
            kept = _Kept()
            setattr(app, _KEPT, kept)
    return kept


class _Making:
    """One call of a ``redislock_client`` callable, in a daemon thread of its own;
    every use that needs the client meanwhile waits for this same call."""

    def __init__(self, source: Callable[[], Client]) -> None:
        self.source = source
        self.started = time.monotonic()
        self.done = threading.Event()
        self.client: Client | None = None
        self.error: BaseException | None = None

    def start(self) -> None:
        """Call the callable in a new daemon thread (one that cannot start ends this
        call with that error, for every use waiting for it)."""
        thread = threading.Thread(target=self._run, name="redislock-client-build", daemon=True)
        try:
            thread.start()
        except BaseException as exc:
            self.error = exc
            self.done.set()
            raise

    def _run(self) -> None:
        """The thread: keep the client the callable returns, or what it raised (or a
        ``TypeError`` if it returned no client), then wake the uses waiting."""
        try:
            client = self.source()
            check_client_source(client, "the client app.conf.redislock_client returned")
            if callable(client) and not isinstance(client, redis.Redis | RedisCluster):
                raise TypeError("app.conf.redislock_client returned a callable, not a client")
            self.client = client
        except BaseException as exc:  # handed to the uses waiting for it
            self.error = exc
        finally:
            self.done.set()

    def serves(self, source: object, now: float) -> bool:
        """Whether a use of ``source`` should wait for this call rather than start
        another: it calls ``source`` and has neither failed nor been under way for
        :data:`CLIENT_BUILD_ABANDON_WAITS` waits."""
        if not same_source(self.source, source):
            return False
        if self.done.is_set():
            return self.error is None
        return now - self.started < CLIENT_BUILD_WAIT * CLIENT_BUILD_ABANDON_WAITS


def same_source(known: object, source: object) -> bool:
    """Whether ``source`` is the ``redislock_client`` value ``known``: the same object,
    or an equal one. A method of a configuration object (``config_from_object()``
    of an instance whose class defines ``redislock_client``) is a new bound method
    at every read of the setting, equal to the others (same object, same function)."""
    return known is source or known == source


def check_client_source(value: object, argument: str = "app.conf.redislock_client") -> None:
    """Raise naming ``argument`` unless ``value`` is a client, a callable or ``None``."""
    if value is None or isinstance(value, redis.Redis | RedisCluster) or callable(value):
        return
    raise TypeError(
        f"{argument} must be a redis.Redis or redis.cluster.RedisCluster client, or a "
        f"callable returning one, not {type(value).__name__}"
    )


def check_transport_options(value: object, argument: str) -> Mapping[str, Any]:
    """Return ``value`` if it is a mapping (or ``None`` as empty), or raise naming ``argument``."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"{argument} must be a dict, not {type(value).__name__}")
    return value


def store_url(app: Any) -> tuple[str, Mapping[str, Any]]:
    """The URL of ``app``'s lock store and its transport options (``redislock_client`` aside).

    Raises:
        ValueError: neither ``redislock_url`` nor the broker URL is a Redis URL;
            the message says what to set.
    """
    url = app.conf.get("redislock_url")
    if url:
        check_url(url, "app.conf.redislock_url")
        options = check_transport_options(
            app.conf.get("redislock_transport_options"), "app.conf.redislock_transport_options"
        )
        # They name a Sentinel master: a plain URL (a development setting beside
        # a Sentinel production one, say) takes none of them.
        return url, options if url.startswith("sentinel://") else {}
    broker = app.conf.broker_url or ""
    if isinstance(broker, list | tuple) and broker:
        # Failover URLs, as kombu takes them: the locks live on the first.
        broker = broker[0]
    elif isinstance(broker, str) and ";" in broker and not broker.startswith("sentinel://"):
        # The same, as one string of URLs separated by ";" (a Sentinel URL is
        # written that way too, but names the Sentinels of one master).
        broker = broker.split(";", 1)[0].strip()
    if not isinstance(broker, str) or not broker.startswith(URL_SCHEMES):
        shown = url_shown(broker) if isinstance(broker, str) else type(broker).__name__
        raise ValueError(
            "no lock store: set app.conf.redislock_url (or redislock_client, or the task's "
            f"lock_url); the broker URL {shown} is not a Redis URL"
        )
    options = check_transport_options(
        app.conf.get("broker_transport_options"), "app.conf.broker_transport_options"
    )
    tls = _tls_options(app.conf.get("broker_use_ssl"))
    if broker.startswith("sentinel://"):
        # The broker's options are the transport's (visibility_timeout, ...): only
        # those that name the Sentinels' master and connect to it apply here,
        # with broker_use_ssl's for the master's connections (as kombu does).
        kept = sentinel_options(options, "app.conf.broker_transport_options")
        if tls:
            kept.update(tls, ssl=True)
        return broker, kept
    if not tls or broker.startswith("unix://"):
        return broker, {}
    # A redis:// broker with TLS options speaks TLS, as kombu has it.
    return "rediss://" + broker.split("://", 1)[1], tls


def _tls_options(use_ssl: object) -> dict[str, Any]:
    """The connection options of ``broker_use_ssl``: its dict of ``ssl_*`` options
    (``True`` has none: a ``rediss://`` URL carries its own), with kombu's spelling
    of a certificate requirement (``"CERT_REQUIRED"``) as redis-py's.

    Raises:
        ValueError: a key the lock store cannot take, named.
    """
    if not use_ssl or not isinstance(use_ssl, Mapping):
        return {}
    unknown = sorted(str(key) for key in use_ssl if not str(key).startswith("ssl_"))
    if unknown:
        raise ValueError(
            f"app.conf.broker_use_ssl: the lock store takes only ssl_* options "
            f"(ssl_cert_reqs, ssl_ca_certs, ssl_certfile, ssl_keyfile), not {', '.join(unknown)}; "
            "or set app.conf.redislock_url to a rediss:// URL of its own"
        )
    options = dict(use_ssl)
    required = options.get("ssl_cert_reqs")
    if isinstance(required, str) and required.upper().startswith("CERT_"):
        options["ssl_cert_reqs"] = required[len("CERT_") :].lower()
    return options


#: The settings a lock store is resolved from. Each task execution needs the
#: store, and reading app.conf costs microseconds a key; so the resolved client
#: is kept, with the values those settings had in ``app.conf.changes`` (where
#: ``app.conf.update()`` and assignments land): a change there resolves it again.
_STORE_SETTINGS = (
    "redislock_client",
    "redislock_url",
    "redislock_transport_options",
    "broker_url",
    "broker_transport_options",
    "broker_use_ssl",
)


def lock_store(app: Any, url: str | None = None) -> Client:
    """The client of ``app``'s lock store (or of ``url``, a task's own ``lock_url``).

    Raises:
        TypeError, ValueError: the configuration names no usable lock store.
        LockBackendError: a ``redislock_client`` callable could not reach the
            store to make its client.
    """
    if url is not None:
        if url.startswith("sentinel://"):
            options = app.conf.get("redislock_transport_options")
            return get_client(
                url, check_transport_options(options, "app.conf.redislock_transport_options")
            )
        return get_client(url)
    kept = _kept(app)
    known, settings = kept.resolved, _settings(app)
    # The very same configuration, with the very same values as when it was
    # resolved (compared by identity): ``config_from_object()`` on a configured
    # app makes a new one.
    if (
        known is not None
        and settings
        and known[0] is app.conf
        and len(known[1]) == len(settings)
        and all(map(operator.is_, known[1], settings))
    ):
        return known[2]
    source, client = _resolve(app)
    # Read after resolving, which may have loaded the app's configuration (it
    # replaces the pending one until then). Kept only if the settings did not
    # change meanwhile (another thread's assignment while a callable made the
    # client): the new settings with the old store would serve every later use.
    # Not kept, the next use resolves again.
    after = _settings(app)
    if same_source(source, app.conf.get("redislock_client")) and (
        not settings or (len(settings) == len(after) and all(map(operator.is_, settings, after)))
    ):
        kept.resolved = (app.conf, after, client)
    return client


def _settings(app: Any) -> tuple[Any, ...]:
    """The values of the store settings in ``app.conf.changes`` (an empty tuple while
    the configuration is pending: it matches no reading)."""
    changes = getattr(app.conf, "changes", None)
    if not isinstance(changes, dict):
        return ()
    return tuple(map(changes.get, _STORE_SETTINGS))


def _resolve(app: Any) -> tuple[ClientSource | None, Client]:
    """:func:`lock_store` without the cache: the ``redislock_client`` value it used
    (``None``: none was set) and the client."""
    source = app.conf.get("redislock_client")
    if source is None:
        store, options = store_url(app)
        return None, get_client(store, options)
    check_client_source(source)
    if isinstance(source, redis.Redis | RedisCluster):
        return source, source
    built = _kept(app).built
    if built is not None and same_source(built[0], source):
        return source, built[1]
    return source, _made_by(app, source)


def _made_by(app: Any, source: Callable[[], Client]) -> Client:
    """The client ``app``'s ``redislock_client`` callable ``source`` makes: one call
    at a time per app and process, in a thread of its own, waited for
    :data:`CLIENT_BUILD_WAIT` seconds at most.

    Raises:
        LockBackendError: the call failed to reach the store (a ``RedisCluster``
            asks a node for the slot map as it is made), or has not returned
            within the wait; the message says what to check.
        Exception: any other error of the callable (a ``TypeError`` from one
            that takes arguments, say), or a ``TypeError`` if it returned no client.
    """
    kept = _kept(app)
    with _guard:
        built = kept.built
        if built is not None and same_source(built[0], source):
            return built[1]
        making = kept.making
        fresh = making is None or not making.serves(source, time.monotonic())
        if fresh:
            # A call of another callable (the setting changed), a failed one or one
            # under way for too long is dropped: it ends unseen.
            making = kept.making = _Making(source)
    assert making is not None
    if fresh:
        making.start()
    if not making.done.wait(CLIENT_BUILD_WAIT):
        raise LockBackendError(
            f"could not make the lock store's client: app.conf.redislock_client has not "
            f"returned within {CLIENT_BUILD_WAIT:g} s and is still making it (check that the "
            "servers it names are up and answer, and give the client a socket_connect_timeout "
            "and socket_timeout; a later use takes the client once it is made)"
        )
    error = making.error
    if error is not None:
        if isinstance(error, RedisError | RedisClusterException | OSError):
            reason = describe_error(error) if isinstance(error, RedisError) else str(error)
            raise LockBackendError(
                f"could not make the lock store's client: app.conf.redislock_client raised "
                f"{type(error).__name__}: {reason} (check that the servers it names are up and "
                "reachable from this host, with the addresses, credentials and TLS settings it "
                "gives; it is called again at the next use)"
            ) from error
        raise error
    client = making.client
    assert client is not None
    with _guard:
        if kept.making is making:
            kept.making = None
        built = kept.built
        if built is None or not same_source(built[0], source):
            built = kept.built = (source, client)
    return built[1]


def describe_store(app: Any, url: str | None = None) -> str:
    """Where ``app``'s locks live, for messages (no password shown)."""
    if url is not None:
        return url_shown(url)
    source = app.conf.get("redislock_client")
    if source is not None:
        return f"app.conf.redislock_client ({type(source).__name__})"
    return url_shown(store_url(app)[0])


def _forget_after_fork() -> None:
    """A forked child builds its own clients (see ``redislock_client``), under a lock
    of its own: another thread of the parent may have held this one as it forked,
    and a call of the callable the parent had under way has no thread in the child:
    what the apps kept in the parent is set aside (see :func:`_kept`)."""
    global _guard, _generation
    _generation += 1
    _guard = threading.Lock()


os.register_at_fork(after_in_child=_forget_after_fork)
