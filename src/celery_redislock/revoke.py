"""Free the ``until_*`` lock of a task revoked while its message still waits.

``AsyncResult.revoke()``, ``app.control.revoke()`` and ``app.control.terminate()``
broadcast Celery's ``revoke`` remote-control command to every running worker
(``celery control terminate`` its ``terminate`` command, which revokes too), and
``app.control.revoke_by_stamped_headers()`` (Celery 5.3+) its
``revoke_by_stamped_headers`` command, which revokes the tasks whose stamps match.
Celery itself only drops a revoked message when a worker gets to it — at its
ETA, or once a busy worker has a free slot — and the ``task_revoked`` handler
frees the lock then. Until that moment the lock taken by ``apply_async`` would
keep the key, and a ``delay()`` with the same arguments would return the revoked
task's id.

:class:`RevokedLockRelease` is a consumer bootstep that a SingletonTask adds to
``app.steps["consumer"]`` when it is bound to the app, so every worker of an app
with singleton tasks runs it, in the process that handles control commands (the
prefork pool's parent). It gives its worker's remote-control node ``revoke``,
``terminate`` and ``revoke_by_stamped_headers`` handlers that run Celery's own
and then free the ``until_*`` lock still held for the message of each task
revoked:

* a request this worker holds and has not handed to its pool yet (waiting for
  its ETA, a rate limit or, on the prefork pool, a free process), revoked by id or
  by its stamps (matched as Celery matches them when it gets to the request,
  :func:`revoked_by_stamps`): the lock name comes from the task and its
  arguments;
* an id it does not know (the message still sits in the broker): the lock is
  found by a bounded ``SCAN`` of the lock keys and a pipelined ``GET`` of their
  lease and owner fields.

A request already handed to the pool keeps its lock: Celery looks whether a
request is revoked once, as it hands it over, and the pool runs it whatever is
revoked later (the threads pool queues the requests it prefetched that no thread
is free for; the green pools wait for a free slot with the request in hand). Its
execution takes the lock over, and until then a ``delay()`` with the same
arguments is deduplicated to it. A request is taken as handed over once Celery
has kept the pool's handle of it, or once it has asked whether the request is
revoked on the way to the pool (noted by
:class:`~celery_redislock.early.Request`, ``SingletonTask``'s request class: the
eventlet pool keeps no handle).

A message revoked by its stamps that no worker holds yet (still in the broker)
keeps its key: the lock does not store a message's stamps. The key frees when a
worker drops the message, when ``lock_enqueue_ttl`` runs out, or with
``celery redislock release``.

Only a lock still owned by the message — its owner is
:func:`~celery_redislock.reservations.queued_owner` of the task id — is freed,
by an owner-checked release: once an execution has taken the lock over, nothing
here touches it, so a revoke that reaches a task already running (Celery lets it
finish, or with ``terminate`` signals it: its hold is left to its end), a copy of
a message waiting here for its ETA while another delivery of it runs, or several
workers freeing the same lock do no harm. A ``terminate`` the pool cannot carry
out (the threads and solo pools cannot signal a running task) makes Celery's
handler fail once it has recorded the revoke: the waiting tasks that revoke
reaches are freed all the same. The Redis work runs on one background
thread per worker, which merges the revokes sent in a burst into one sweep;
failures are logged, each lock's on its own (one that cannot be freed does
not keep the others from being freed), and never reach the worker.

A retry sent with ``self.retry(throw=False)`` by an ``until_executed``
execution that runs on has no reservation yet: the execution holds the lock for
it, and hands it over only as it ends. A revoke of its id (which every copy of
the retry carries) leaves that execution word to free the lock instead
(:func:`~celery_redislock.dropped.free_revoked`), whether the retry waits here
for its ETA, or sits in the broker while this worker runs the execution, or
this worker finds the execution's hold by the search: the lock is free as the
execution ends, not once a worker drops the retry at its ETA. A worker that
cannot tell whether an execution it finds sent a retry leaves the word all the
same; unread, it expires. So too for a message that such an execution sent
under its own task id without a retry count (``self.replace()``,
``apply_async(task_id=self.request.id)``): the word (see
:mod:`celery_redislock.dropped`) is left for the execution's hold, whether or not
it sent one.

With no worker running, Celery drops the broadcast: the key then frees when
``lock_enqueue_ttl`` runs out, or with ``celery redislock release``.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import redis
from celery import bootsteps
from celery.utils.functional import maybe_list
from celery.worker import state as worker_state
from celery.worker.request import Request as CeleryRequest
from redis.cluster import RedisCluster

from celery_redislock.dropped import REVOKED, drop_id, free_dropped, free_revoked, leave_revoked
from celery_redislock.early import HANDED_TO_POOL
from celery_redislock.lock import name_from_key
from celery_redislock.reservations import free_queued, hold_retries, queued_retries
from celery_redislock.scripts import LEASE_FIELD, OWNER_FIELD, decode_lock
from celery_redislock.task import (
    UNTIL_EXECUTED,
    WHILE_EXECUTING,
    SingletonTask,
    request_retries,
    request_sender,
)
from celery_redislock.transport import Client, router_for

logger = logging.getLogger(__name__)

#: Whether Celery lists the requests waiting for their ETA in
#: ``worker_state.requests`` (5.7 and later).
_LISTS_SCHEDULED = hasattr(worker_state, "scheduled_requests")

#: The consumer bootstep that runs the worker's remote-control node.
CONTROL_STEP = "celery.worker.consumer.control.Control"

#: Keys asked for per ``SCAN`` call, and the most calls one search makes per lock
#: store and prefix (a bound on the time a huge keyspace can take).
SCAN_COUNT = 1000
MAX_SCAN_CALLS = 200

#: Scans of a cluster's primaries: the second, after a slot-map refresh, tries
#: those the first could not reach.
SCAN_ROUNDS = 2


class _Pending(NamedTuple):
    """A lock to free for a request this worker holds."""

    task: SingletonTask
    name: str
    task_id: str
    #: The message's retry count: a retry's reservation names it.
    retries: int
    #: The id the request leaves in the word for an execution that sent it as a
    #: retry and runs on (see :mod:`celery_redislock.dropped`): ``REVOKED`` when
    #: revoked by its id, which drops every copy.
    drop: str
    #: The message's header ``redislock_sender``: the owner token of the hold of
    #: the execution that sent it under its own task id, if one did.
    sender: str | None = None
    #: Only word for the execution of the task id that holds the lock, that every
    #: message without a retry count it sent from its body is revoked (the
    #: request runs here: its own reservation, if still there, is left to it).
    word_only: bool = False


class RevokeSweeper:
    """Frees the ``until_*`` locks of revoked tasks for one worker, on a thread of its own."""

    def __init__(self, app: Any, timer: Any = None) -> None:
        self.app = app
        #: The worker's timer, whose entries hold the requests waiting for their
        #: ETA (see :meth:`_scheduled`).
        self.timer = timer
        self._queue: queue.SimpleQueue[tuple[list[_Pending], set[str]] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._guard = threading.Lock()

    def handled(self, command: str, arguments: Mapping[str, Any], failed: bool = False) -> None:
        """Hand over a revoking control ``command`` with its ``arguments``, once
        Celery has handled it.

        ``failed``: Celery's handler raised. It records the revoke first (the ids in
        ``worker_state.revoked``, the stamps in ``worker_state.revoked_stamps``), then
        signals the running tasks with ``terminate``, which a pool may fail to do
        (the threads and solo pools cannot): what it recorded is revoked all the
        same, and only that is handed over.
        """
        if command == STAMPS_COMMAND:
            self.revoked_by_stamps()
            return
        task_ids = maybe_list(arguments.get("task_id")) or []
        if failed:
            task_ids = [task_id for task_id in task_ids if task_id in worker_state.revoked]
        self.revoked(task_ids)

    def revoked(self, task_ids: Iterable[str]) -> None:
        """Hand over the ids of a ``revoke`` command (called after Celery's own handling).

        Sorts them by what this worker knows, without any I/O: the lock names of
        the requests it holds, and the ids it does not know.
        """
        pending: list[_Pending] = []
        unknown: set[str] = set()
        task_ids = list(task_ids)
        scheduled = {held.id: held for held in self._scheduled()} if task_ids else {}
        for task_id in task_ids:
            # A copy waiting for its ETA first: Celery 5.7 lists it in place of a
            # running request of the same id (a message an execution sent under
            # its own id), which earlier releases list alone.
            request = scheduled.get(task_id) or worker_state.requests.get(task_id)
            if request is None:
                unknown.add(task_id)
                continue
            item = _pending(request, REVOKED)
            if request in worker_state.active_requests or handed_to_pool(request):
                # Running, or will run: its execution takes the lock over. A retry
                # it sent as it runs on (``self.retry(throw=False)``), revoked too,
                # may still sit in the broker: word that it is dropped.
                # So may a message it sent under its own id (self.replace(), say).
                if item is not None and item.task.lock_options.strategy == UNTIL_EXECUTED:
                    pending.append(item._replace(retries=item.retries + 1))
                    pending.append(item._replace(word_only=True))
                continue
            if item is not None:
                pending.append(item)
        self._hand_over(pending, unknown)

    def revoked_by_stamps(self) -> None:
        """Hand over the requests this worker holds, not started, that Celery's
        revoked stamps (``revoke_by_stamped_headers``, this one included, already
        handled) make it drop when it gets to them.

        Messages this worker does not hold cannot be matched: the lock does not
        store their stamps.
        """
        revoked_stamps = dict(worker_state.revoked_stamps)
        if not revoked_stamps:
            return
        pending: list[_Pending] = []
        held = list(worker_state.requests.values())
        listed = {id(request) for request in held}
        held += [request for request in self._scheduled() if id(request) not in listed]
        for request in held:
            if request in worker_state.active_requests or handed_to_pool(request):
                continue  # running, or will run: its execution takes the lock over
            try:
                matches = revoked_by_stamps(request, revoked_stamps)
            except Exception as exc:
                logger.warning("could not match the stamps of task %s: %s", request.id, exc)
                continue
            if matches:
                item = _pending(request, drop_id(request))
                if item is not None:
                    pending.append(item)
        self._hand_over(pending, set())

    def _scheduled(self) -> list[Any]:
        """Before Celery 5.7, the requests this worker holds waiting for their ETA
        (a countdown, a retry's delay), as the arguments of its timer's entries:
        those releases list them nowhere else. (Celery 5.7 lists them in
        ``worker_state.requests``: none here.)"""
        timer = self.timer
        if _LISTS_SCHEDULED or timer is None:
            return []
        try:
            entries = timer.queue
        except Exception as exc:
            logger.warning("could not read the worker's timer: %s", exc)
            return []
        return [
            entry.args[0]
            for _eta, _priority, entry in entries
            if not entry.canceled and entry.args and isinstance(entry.args[0], CeleryRequest)
        ]

    def _hand_over(self, pending: list[_Pending], unknown: set[str]) -> None:
        if pending or unknown:
            self._start()
            self._queue.put((pending, unknown))

    def stop(self) -> None:
        """Let the thread finish what it holds and end."""
        with self._guard:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            thread.join(10)

    def _start(self) -> None:
        with self._guard:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="redislock-revoke", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            pending, unknown = list(item[0]), set(item[1])
            stopping = False
            while True:  # merge the revokes of a burst into one sweep
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                pending += more[0]
                unknown |= more[1]
            try:
                self._sweep(pending, unknown)
            except Exception as exc:  # never let the thread die
                logger.warning("could not free the locks of revoked tasks: %s", exc)
            if stopping:
                return

    def _sweep(self, pending: list[_Pending], unknown: set[str]) -> None:
        for item in pending:
            try:
                prefix = item.task.lock_options.prefix
                client = item.task.lock_client
                # Only the message's own reservation (a retry's names its count): a
                # hold of its lease under another owner is an execution's, maybe of
                # another delivery of the message running elsewhere (a copy waiting
                # for its ETA here, delivered again by the broker), which Celery lets
                # finish. A retry's delivery, revoked while the execution that sent it
                # runs on (``self.retry(throw=False)``) and holds the lock for it,
                # leaves that execution word to free the lock as it ends.
                if item.word_only:
                    ttl = item.task.lock_options.enqueue_ttl
                    leave_revoked(client, item.name, item.task_id, prefix, ttl)
                elif item.task.lock_options.strategy == UNTIL_EXECUTED:
                    ttl = item.task.lock_options.enqueue_ttl
                    free_dropped(
                        client, item.name, item.task_id, prefix, item.retries, ttl, item.drop,
                        item.sender,
                    )  # fmt: skip
                else:
                    free_queued(client, item.name, item.task_id, prefix, item.retries)
            except Exception as exc:
                logger.warning(
                    "could not free lock %s of revoked task %s: %s", item.name, item.task_id, exc
                )
        if unknown:
            for client, prefix in self._stores():
                try:
                    find_and_free_queued(client, prefix, unknown)
                except Exception as exc:
                    logger.warning(
                        "could not look for the locks of revoked tasks under %r: %s", prefix, exc
                    )
                if not unknown:
                    return

    def _stores(self) -> list[tuple[redis.Redis, str]]:
        """The (lock store, prefix) pairs of the app's tasks that lock while queued."""
        stores: dict[tuple[int, str], tuple[redis.Redis, str]] = {}
        for task in list(self.app.tasks.values()):
            try:
                if _locks_while_queued(task):
                    client, prefix = task.lock_client, task.lock_options.prefix
                    stores.setdefault((id(client), prefix), (client, prefix))
            except Exception as exc:
                logger.warning("no lock store for task %s: %s", getattr(task, "name", task), exc)
        return list(stores.values())


def handed_to_pool(request: Any) -> bool:
    """Whether the worker has handed ``request`` to its pool (or is on the way to):
    Celery does not look whether it is revoked again, and the pool runs it.

    Celery keeps the pool's handle of a request it handed over (the threads,
    prefork and gevent pools give one); ``SingletonTask``'s request class notes
    the last look too, before the pool is asked (the eventlet pool gives no handle,
    and a green pool waits for a free slot before it returns).
    """
    return getattr(request, "_apply_result", None) is not None or bool(
        getattr(request, HANDED_TO_POOL, False)
    )


def _pending(request: Any, drop: str) -> _Pending | None:
    """The lock to free for ``request``, a revoked request this worker holds and has
    not started (``drop``: its id in a word, see :class:`_Pending`): ``None`` when
    its task takes no lock while queued (or its lock cannot be named, which is
    logged)."""
    task = request.task
    try:
        if not _locks_while_queued(task):
            return None
        name = task._message_name(request, request.args, request.kwargs)
    except Exception as exc:
        logger.warning("could not name the lock of revoked task %s: %s", request.id, exc)
        return None
    return _Pending(task, name, request.id, request_retries(request), drop, request_sender(request))


def revoked_by_stamps(request: Any, revoked_stamps: Mapping[str, Any]) -> bool:
    """Whether ``revoked_stamps`` (header: revoked value or values, as in
    ``celery.worker.state.revoked_stamps``) revoke ``request`` by its stamps.

    The test Celery's ``Request.revoked()`` makes as the worker gets to a request,
    which it cannot be asked alone (it drops the request when it matches): a
    stamped header of the request that has revoked values matches when its value
    is one of them (or equals them), or, for a stamp with several values, when
    one of those is.
    """
    stamped_headers = getattr(request, "stamped_headers", None) or []
    if not stamped_headers:
        return False
    stamps = request.stamps
    for header in stamped_headers:
        if header not in revoked_stamps:
            continue
        revoked = revoked_stamps[header]
        stamped = stamps.get(header)
        if stamped is None:
            continue
        if isinstance(stamped, (list, tuple)):
            if any(value in maybe_list(revoked) for value in stamped):
                return True
        elif stamped in maybe_list(revoked) or stamped == revoked:
            return True
    return False


def _locks_while_queued(task: object) -> bool:
    """Whether ``task`` takes a lock when it is sent (an ``until_*`` SingletonTask)."""
    return isinstance(task, SingletonTask) and task.lock_options.strategy != WHILE_EXECUTING


def find_and_free_queued(client: Client, prefix: str, task_ids: set[str]) -> None:
    """Free the locks under ``prefix`` that the messages of ``task_ids`` still own.

    Scans the lock keys (at most :data:`MAX_SCAN_CALLS` ``SCAN`` calls) and reads
    each one's lease and owner in one pipelined round trip per batch. Each id found
    is removed from ``task_ids`` (a task holds one lock at most); the scan stops
    when none is left. A lock an execution of one of them holds is left to it,
    with word that its next retry is revoked (see :func:`_free_found`).

    A Redis Cluster's primaries are scanned one by one: one that cannot be
    reached (a primary that died, its replica promoted since, which the client's
    slot map does not know yet) does not keep the others from being scanned;
    then the slot map is refreshed and the primaries not scanned yet are tried
    once more.

    Raises:
        redis.RedisError: a server could not be scanned (the ids still not found
            free when ``lock_enqueue_ttl`` runs out).
    """
    pattern = f"{_glob_escape(prefix)}:{{*}}"
    calls = [0]
    scanned: set[str] = set()
    error: redis.RedisError | None = None
    for _ in range(SCAN_ROUNDS):
        error = None
        for where, server in _servers(client):
            if where in scanned:
                continue
            try:
                whole = _scan(client, server, pattern, prefix, task_ids, calls)
            except redis.RedisError as exc:
                error = exc
                continue
            if not task_ids:
                return
            if not whole:
                logger.warning(
                    "gave up looking for the locks of revoked tasks %s under %r after %d "
                    "SCAN calls; they free when lock_enqueue_ttl runs out",
                    ", ".join(sorted(task_ids)),
                    prefix,
                    MAX_SCAN_CALLS,
                )
                return
            scanned.add(where)
        if error is None or not router_for(client).redirected(error):
            break
    if error is not None:
        raise error


def _scan(
    client: Client,
    server: redis.Redis,
    pattern: str,
    prefix: str,
    task_ids: set[str],
    calls: list[int],
) -> bool:
    """Scan ``server``'s lock keys and free those ``task_ids`` still own (see
    :func:`_free_found`), counting the ``SCAN`` calls in ``calls[0]``; whether it
    was scanned whole (or every id found) before :data:`MAX_SCAN_CALLS`."""
    cursor = 0
    while calls[0] < MAX_SCAN_CALLS:
        calls[0] += 1
        cursor, keys = server.scan(cursor=cursor, match=pattern, count=SCAN_COUNT)
        if keys:
            _free_found(client, server, keys, prefix, task_ids)
        if not task_ids or cursor == 0:
            return True
    return False


def _servers(client: Client) -> list[tuple[str, redis.Redis]]:
    """The servers whose keyspaces together hold ``client``'s keys, each with its
    address: each primary of a Redis Cluster (as the client's slot map has
    them), or the one server. A cluster's keys are scanned primary by primary,
    each with a cursor of its own (the cluster client's scan() answers for all
    of them at once)."""
    if isinstance(client, RedisCluster):
        primaries = client.get_primaries()  # type: ignore[no-untyped-call]
        return [(node.name, client.get_redis_connection(node)) for node in primaries]
    return [("", client)]


def _free_found(
    client: Client, server: redis.Redis, keys: list[Any], prefix: str, task_ids: set[str]
) -> None:
    """Free those of the lock ``keys`` (found on ``server``) that the messages of
    ``task_ids`` still own, reading them in one pipelined round trip; drop the ids
    found from ``task_ids``.

    A lock an execution of one of them holds is left to it: Celery lets it
    finish. It may have sent its retry (the id revoked too) with
    ``self.retry(throw=False)`` and run on, holding the lock for the retry, which
    sits in the broker (or a message under its own id without a retry count,
    ``self.replace()`` say): it is left word that the retry (and such a
    message) is revoked, and frees the lock as it ends rather than keep it for a
    message no worker runs (see :func:`~celery_redislock.dropped.free_revoked`).
    Word that no execution acts on expires.

    Each lock found is handled on its own: one that cannot be freed (its store
    did not answer, say, though the release may have run) is logged, and the
    others are freed all the same."""
    with server.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.get(key)
        rows = pipe.execute(raise_on_error=False)
    for key, row in zip(keys, rows, strict=True):
        if isinstance(row, Exception):
            continue  # not a lock key
        fields = decode_lock(row)
        lease, owner = fields.get(LEASE_FIELD), fields.get(OWNER_FIELD)
        if lease is None or lease not in task_ids:
            continue
        task_ids.discard(lease)
        name = name_from_key(_text(key) or "", prefix)
        try:
            _free_one(client, name, lease, owner, prefix)
        except Exception as exc:  # the other ids found are freed all the same
            logger.warning(
                "could not free lock %s of revoked task %s (it frees when lock_enqueue_ttl "
                "runs out, or with `celery redislock release`): %s",
                name,
                lease,
                exc,
            )


def _free_one(client: Client, name: str, lease: str, owner: str | None, prefix: str) -> None:
    """Free lock ``name``, found with the lease of revoked task ``lease`` and
    ``owner``, if the message still owns it; else leave its execution word (see
    :func:`_free_found`)."""
    retries = queued_retries(owner, lease)
    if retries is not None:
        free_queued(client, name, lease, prefix, retries)
    elif owner is not None:
        free_revoked(client, name, lease, prefix, hold_retries(owner, lease) + 1, 0.0)
        # Or a message it sent under its own id without a retry count: revoked
        # too, and so is its reservation, should the hold have moved to it.
        if leave_revoked(client, name, lease, prefix, 0.0, owner) == 2:
            free_queued(client, name, lease, prefix)


def _glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` pattern."""
    return "".join(f"\\{char}" if char in "*?[]\\" else char for char in text)


def _text(value: bytes | str | None) -> str | None:
    """Decode a reply from a client that may or may not decode responses."""
    return value.decode() if isinstance(value, bytes) else value


#: The remote-control command that revokes tasks by their stamps (Celery 5.3+).
STAMPS_COMMAND = "revoke_by_stamped_headers"

#: The remote-control commands that revoke tasks: by id, or by their stamps.
REVOKING_COMMANDS = ("revoke", "terminate", STAMPS_COMMAND)


def _then_sweep(original: Any, sweeper: RevokeSweeper, command: str) -> Any:
    """A control handler for ``command`` that runs ``original``, then has
    ``sweeper`` free the locks of the tasks it revoked (also when ``original``
    raised: see :meth:`RevokeSweeper.handled`)."""

    def sweep(arguments: Mapping[str, Any], failed: bool) -> None:
        try:
            sweeper.handled(command, arguments, failed)
        except Exception as exc:  # the control command's reply must not change
            logger.warning("could not free the locks of revoked tasks: %s", exc)

    def handler(state: Any, **arguments: Any) -> Any:
        try:
            reply = original(state, **arguments)
        except BaseException:
            sweep(arguments, failed=True)
            raise
        sweep(arguments, failed=False)
        return reply

    handler.redislock_wrapped = True  # type: ignore[attr-defined]
    return handler


class RevokedLockRelease(bootsteps.StartStopStep):  # type: ignore[misc]
    """Consumer bootstep: after Celery's ``revoke``, free the ``until_*`` locks of revoked tasks.

    Added to ``app.steps["consumer"]`` when a SingletonTask is bound to the app.
    It wraps the ``revoke``, ``terminate`` and ``revoke_by_stamped_headers``
    handlers of this worker's own remote-control node (the shared registry of
    commands, ``Panel.data``, is left as it is).
    """

    requires = ("celery.worker.consumer.control:Control",)
    label = "Revoked lock release"

    def __init__(self, c: Any, **kwargs: Any) -> None:
        super().__init__(c, **kwargs)
        self.sweeper: RevokeSweeper | None = None

    def start(self, c: Any) -> None:
        """Wrap the node's revoking handlers (once: a consumer restart starts steps
        again; a Celery without ``revoke_by_stamped_headers`` has only the others).
        ``terminate`` (``celery control terminate``) calls Celery's revoke function
        itself, not the node's ``revoke`` handler."""
        control = c.blueprint.steps.get(CONTROL_STEP)
        node = getattr(getattr(control, "box", None), "node", None)
        if node is None:
            return
        handlers = dict(node.handlers)
        for command in REVOKING_COMMANDS:
            original = handlers.get(command)
            if original is None or getattr(original, "redislock_wrapped", False):
                continue
            if self.sweeper is None:
                self.sweeper = RevokeSweeper(c.app, getattr(c, "timer", None))
            handlers[command] = _then_sweep(original, self.sweeper, command)
        node.handlers = handlers

    def shutdown(self, c: Any) -> None:
        """Stop the sweeper thread when the worker shuts down."""
        if self.sweeper is not None:
            self.sweeper.stop()
