"""Taking a task's lock as the worker accepts the task, ahead of its start.

Between accepting a task (acknowledging its message, sending ``task-started``)
and calling it, a worker spends some tens of microseconds of its own. On the
pools that run a task in the thread that accepted it (solo and threads: the
pool reports this process as the one the task runs in), a
:class:`~celery_redislock.task.SingletonTask` writes its acquire at the start of
that time and reads the reply as the task starts, so the round trip overlaps
Celery's work instead of coming after it. Nothing else changes: the task still
knows it holds the lock before its body runs, and still renews, releases and
reports it as before.

The prefork pool accepts a task in the parent process and runs it in a child.
There the child writes the acquire of a ``while_executing`` task (the default
strategy), or of an ``until_executed`` task whose message Celery never delivers
again once the child is lost (:func:`_comes_back`), as it is handed the task,
before Celery's tracer sets the task up (its request context, ``task_prerun``,
``track_started``, ``before_start``), and the task reads the reply as it starts
(see :func:`trace_ahead`); other tasks acquire as they start. With a
``Request`` class that does not derive from this one, on the solo and threads
pools, the task acquires as it starts.

The acquire is kept for the task by the thread that runs it (a thread runs one
task at a time). One written for a task whose ``before_start`` raises is given
back right there, before Celery stores the failure
(:meth:`~celery_redislock.task.SingletonTask._start_failed`); one written for a
task that never starts otherwise (its trace failed or skipped it before the task
was called) is given back as the worker records the outcome, or at the latest
when the thread accepts its next task, rather than left to its TTL.

The request also frees the lock of a prefork child that died running the task
(killed by the kernel's out-of-memory killer or a signal, or exited): the parent
sees the child gone, and frees the hold if it is still that child's (the task's
id, the worker's node and the child's process id in its description, its
fencing token in the release), before Celery records the failure or sends the
task again (``task_reject_on_worker_lost``, ``task_retry_on_worker_lost``), so
that the copy need not wait for the TTL. A child that died before the execution
took its ``until_*`` message's reservation over (as it built the arguments, or,
where the take-over waits for the task's start, in ``before_start``) held
nothing of its own: the message's reservation is freed
instead, by its owner token, unless Celery requeues the message
(``acks_late`` with ``task_reject_on_worker_lost``), whose delivery takes it
over. (Two round trips on the worker's event loop, of 5 s at most each:
``DEFAULT_CALL_TIMEOUT``; three for an ``until_executed`` retry whose
reservation is not there yet.) An acquire the child wrote just before it died
may reach the store after that look, delayed on its way: unless the look found
the child's hold, the worker looks once more, from a thread of its own,
:data:`LATE_REQUEST_WAIT` later, and frees a hold of that child's it finds then,
by its fencing token (one delayed longer still expires by its TTL). That includes a child the
worker itself signalled: ``revoke(terminate=True)``, or the cancel of a running
task as the worker loses its broker connection
(``worker_cancel_long_running_tasks_on_connection_loss``). Celery reports those
as it sends the signal, while the task may still run (a ``SIGTERM`` raises
``SystemExit`` in it, whose ``finally`` then runs, and a signal may be ignored),
so nothing is freed then: the pool reports the job ``Terminated`` once it has
reaped the child, and the hold is freed from there. A hard time limit is
reported while the child still runs, just before the pool kills it: the hold is
freed in the same way once the child is gone, from a thread of its own that
looks every :data:`GONE_POLL` seconds, for at most what the hold had left.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import SoftTimeLimitExceeded, Terminated, WorkerLostError
from celery.app.task import Task as _CeleryTask
from celery.worker import state as worker_state
from celery.worker.request import Request as _CeleryRequest

from celery_redislock import transport
from celery_redislock.admin import LockInfo, force_release, read_lock
from celery_redislock.dropped import drop_id
from celery_redislock.task import (
    UNTIL_EXECUTED,
    WHILE_EXECUTING,
    SingletonTask,
    _shown,
    _written_ahead,
    take_written_ahead,
)
from celery_redislock.transport import DEFAULT_CALL_TIMEOUT

__all__ = ["Request", "trace_ahead"]

logger = logging.getLogger(__name__)

#: What a prefork parent reports for a task whose child process is gone (not a
#: hard time limit: reported before the child is killed). ``Terminated``: a child
#: the worker sent a signal to (a terminate, a cancel), reported once reaped.
_PROCESS_GONE = (WorkerLostError, Terminated, SystemExit, KeyboardInterrupt)

#: Whether this Celery sends a task whose pool process was lost again as a
#: retry when the task asks (``retry_on_worker_lost``, new in Celery 5.7).
_RETRIES_WORKER_LOST = hasattr(_CeleryTask, "retry_on_worker_lost")

#: Request attribute set as the worker takes its last look at whether a request it
#: reserved is revoked, on the way to the pool: past that look the pool runs the
#: task, whatever is revoked later (see :mod:`celery_redislock.revoke`).
HANDED_TO_POOL = "redislock_handed_to_pool"

#: How often, in seconds, the worker looks whether a pool process killed for its
#: task's hard time limit is gone.
GONE_POLL = 0.02

#: How long, in seconds, the worker waits for a pool process killed for its
#: task's hard time limit to be gone, before it frees the reservation that
#: process had not taken over yet (the pool kills it at once).
KILL_WAIT = 10.0

#: How long, in seconds, after a pool process is seen gone, the worker looks
#: again for a hold of that process (see :meth:`Request._look_again_later`): a
#: request it wrote just before it died, delayed on its way to the store, can
#: land after the first look. A best effort: the server runs a request whenever
#: it arrives, and this covers delays up to the process's own call deadline
#: (``DEFAULT_CALL_TIMEOUT``), plus a margin.
LATE_REQUEST_WAIT = DEFAULT_CALL_TIMEOUT + 1.0

#: Whether this system shows its processes under ``/proc`` (a zombie is told apart
#: from a live process there).
_PROC = os.path.isdir("/proc/self")


def _process_gone(pid: int) -> bool:
    """Whether this process's child ``pid`` has ended (where ``/proc`` shows it, a
    zombie not yet reaped counts as ended; elsewhere, only once reaped)."""
    if _PROC:
        try:
            with open(f"/proc/{pid}/stat", "rb") as stat:
                # The state follows the command name, which is in parentheses.
                state = stat.read().rsplit(b")", 1)[-1].split()[:1]
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return state in ([b"Z"], [b"X"])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _requeued_lost(task: Any) -> bool:
    """Whether Celery requeues the message of ``task`` as it is when the pool
    process running it is lost (``acks_late`` with ``reject_on_worker_lost``),
    rather than send it again as a retry (``retry_on_worker_lost``) or end it."""
    return (
        bool(task.acks_late)
        and bool(task.reject_on_worker_lost)
        and not (_RETRIES_WORKER_LOST and task.retry_on_worker_lost)
    )


def _comes_back(task: Any) -> bool:
    """Whether Celery may deliver the message of ``task`` again after the pool
    process running it dies or is killed while the worker lives on: requeued as
    the process is lost (:func:`_requeued_lost`) or killed for its hard time
    limit (:func:`_requeued_on_timeout`), or left unacknowledged as the worker
    cancels it on losing its broker connection
    (``worker_cancel_long_running_tasks_on_connection_loss``, which cancels
    ``acks_late`` tasks only)."""
    cancels = task.app.conf.get("worker_cancel_long_running_tasks_on_connection_loss")
    return bool(task.acks_late) and (
        _requeued_lost(task) or _requeued_on_timeout(task) or bool(cancels)
    )


def _requeued_on_timeout(task: Any) -> bool:
    """Whether Celery requeues the message of ``task`` killed for its hard time
    limit (``acks_late`` without ``acks_on_timeout``, or without
    ``acks_on_failure_or_timeout`` on a Celery that has only that)."""
    acks = getattr(task, "acks_on_timeout", None)
    if acks is None:
        acks = getattr(task, "acks_on_failure_or_timeout", True)
    return bool(task.acks_late) and acks is False


class Request(_CeleryRequest):  # type: ignore[misc]
    """The worker request of a :class:`~celery_redislock.task.SingletonTask` (its
    ``Request``): writes the task's acquire as the worker accepts it."""

    def revoked(self) -> bool:
        # Celery asks this of a reserved request once, as it hands it to the pool
        # (at receipt, before it reserves it, too): marked before the answer, a
        # revoke recorded after it is seen to come too late to drop the task.
        if self in worker_state.reserved_requests:
            setattr(self, HANDED_TO_POOL, True)
        return bool(super().revoked())

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        task = self.task
        # The pool reports the process the task runs in: this one, in this thread.
        # (This process's id as the transport keeps it, renewed in a forked
        # child: not a system call on every task.)
        if pid == transport._process_id and isinstance(task, SingletonTask):
            try:
                task._acquire_ahead(self)
            except Exception:
                # Never in the way of the task: it then asks as it starts.
                logger.exception("celery_redislock: writing the acquire of %s failed", self.id)
        try:
            super().on_accepted(pid, time_accepted)
        except BaseException:
            self._give_back()
            raise

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> None:
        # The tracer may end a task without calling it and without a failure
        # (worker_deduplicate_successful_tasks skips a redelivered one).
        self._give_back()
        super().on_success(failed__retval__runtime, **kwargs)

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        self._give_back()
        exc = getattr(exc_info, "exception", None)
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, _PROCESS_GONE) and self.worker_pid not in (None, os.getpid()):
            # Before Celery's own handling, which may send the task again at once
            # (task_retry_on_worker_lost, task_reject_on_worker_lost): the copy it
            # sends must find the lock free, or an until_* send takes it for a
            # duplicate.
            self._free_dead_child_lock(requeued=self._requeued_when_lost(exc))
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)

    def on_timeout(self, soft: bool, timeout: float) -> None:
        pid = self.worker_pid
        if not soft and pid not in (None, os.getpid()) and isinstance(self.task, SingletonTask):
            # The pool kills the child right after this returns, whether Celery's
            # own handling (which calls the task's on_failure and the result
            # backend) raises or not.
            threading.Thread(
                target=self._free_when_gone,
                args=(pid,),
                name="redislock-time-limit",
                daemon=True,
            ).start()
        super().on_timeout(soft, timeout)

    def _free_when_gone(self, pid: int) -> None:
        """Free the hold of pool child ``pid``, killed for this task's hard time
        limit, once the child is gone (and only that hold, by its token: read now,
        while the child is being killed). A child killed before the execution took
        its ``until_*`` message's reservation over (in ``before_start``) held
        none: the reservation is freed instead, unless Celery requeues the
        message (``acks_late`` without ``acks_on_timeout``)."""
        try:
            held = self._message_lock()[1]
        except Exception as exc:
            logger.warning(
                "celery_redislock: could not read the lock of %s[%s], whose pool process "
                "is killed for its time limit (it expires by its TTL): %s",
                self.task.name,
                self.id,
                exc,
            )
            return
        if held is None or held.holder != self.id:
            return
        childs = self._is_childs(held)
        if not childs and _requeued_on_timeout(self.task):
            return
        # The child renews nothing once killed: by then its hold has expired. (A
        # reservation it had not taken over lives on; the kill follows at once.)
        until = time.monotonic() + (max(0, held.ttl_ms) / 1000 if childs else KILL_WAIT)
        while not _process_gone(pid):
            if time.monotonic() >= until:
                return
            time.sleep(GONE_POLL)
        # Read again: a child may have taken the reservation over as it was killed.
        self._free_dead_child_lock(held.fence if childs else None)

    def _message_lock(self) -> tuple[str, LockInfo | None]:
        """The name of this message's lock, and its hold, if it is held.

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        task = self.task
        name = task._message_name(self, self.args, self.kwargs)
        return name, read_lock(task.lock_client, name, task.lock_options.prefix)

    def _is_childs(self, held: LockInfo) -> bool:
        """Whether ``held`` is the hold of the pool child that ran this task (the
        task's id, the worker's node and the child's process id in its description)."""
        return (
            held.holder == self.id
            and held.pid == self.worker_pid
            and held.node == _shown(str(self.hostname))
        )

    def _requeued_when_lost(self, exc: BaseException) -> bool:
        """Whether Celery delivers this message again once it reports ``exc``, its
        pool process lost, as Celery's own ``on_failure`` decides it: requeued as
        it is (``acks_late`` with ``reject_on_worker_lost``), or left unacked as
        the worker cancelled it (its broker connection lost), not sent again as a
        retry (``retry_on_worker_lost``, whose retry reserves its own lock, or
        fails the task once the retries have run out) nor dropped as revoked."""
        if getattr(self, "_already_cancelled", False) and not isinstance(exc, WorkerLostError):
            return True
        if isinstance(exc, Terminated):
            return False
        return _requeued_lost(self.task)

    def _free_dead_child_lock(self, fence: int | None = None, requeued: bool = False) -> None:
        """Free the hold of the pool child that died running this task, if it is
        still that child's (never one another delivery of the task took since: the
        node and process id must match, and the release names the hold's token,
        which must be ``fence`` if given).

        A child that died before the execution took the message's ``until_*``
        reservation over (as it built the arguments, or in ``before_start``) held
        none: the reservation is freed instead, by its owner token (see
        :meth:`_free_reservation`), unless the message is ``requeued``: its
        delivery takes the reservation over as it comes back."""
        task = self.task
        if not isinstance(task, SingletonTask):
            return
        try:
            name, held = self._message_lock()
            if held is None or (fence is not None and held.fence != fence):
                if fence is None:
                    self._look_again_later()
                return
            if not self._is_childs(held):
                if fence is None and not requeued and held.holder == self.id:
                    self._free_reservation(name)
                if fence is None:
                    self._look_again_later()
                return
            self._force_free(name, held, "whose pool process %s died")
        except Exception as exc:
            # Its TTL frees it all the same.
            logger.warning(
                "celery_redislock: could not free the lock of %s[%s], whose pool process "
                "died (it expires by its TTL, or free it with `celery redislock release`): %s",
                task.name,
                self.id,
                exc,
            )

    def _force_free(self, name: str, held: LockInfo, how: str) -> None:
        """Free lock ``name`` by the fencing token of ``held``, the hold of this
        task's dead pool process (``how`` it came to be there, for the log, with
        ``%s`` for the process id).

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        task = self.task
        force_release(task.lock_client, name, task.lock_options.prefix, fence=held.fence)
        logger.info(
            "celery_redislock: freed lock %s of %s[%s], " + how,
            name,
            task.name,
            self.id,
            self.worker_pid,
        )

    def _look_again_later(self) -> None:
        """Look once more, :data:`LATE_REQUEST_WAIT` seconds from now and from a
        thread of its own, for a hold of the pool child that died running this
        task, and free it (by its fencing token) if there is one: the acquire the
        child wrote just before it died may have been delayed on its way to the
        store, and land after the first look found no hold of the child's, to
        stay until the lock's TTL. Never raises: a hold that cannot be freed
        expires by its TTL."""
        try:
            threading.Thread(
                target=self._free_late_hold,
                args=(time.time(),),
                name="redislock-late-hold",
                daemon=True,
            ).start()
        except Exception as exc:
            logger.warning(
                "celery_redislock: cannot look again for a hold of the pool process of "
                "%s[%s] (a late one expires by its TTL): %s",
                self.task.name,
                self.id,
                exc,
            )

    def _free_late_hold(self, gone_at: float) -> None:
        """See :meth:`_look_again_later`; ``gone_at``: when the child was seen gone
        (``time.time()``).

        Only a hold the child asked for before then is its: a pool process
        started since may have been given the same process id (and run a
        delivery of the same message again), but its hold began later, and a
        live process with that id is not the dead child."""
        time.sleep(LATE_REQUEST_WAIT)
        task = self.task
        try:
            name, held = self._message_lock()
            if (
                held is None
                or not self._is_childs(held)
                or held.since is None
                or held.since >= gone_at
                or not _process_gone(self.worker_pid)
            ):
                return
            self._force_free(
                name, held, "taken by a request its pool process %s sent before it died"
            )
        except Exception as exc:
            logger.warning(
                "celery_redislock: could not look again for a hold of %s[%s], whose pool "
                "process died (one taken late expires by its TTL, or free it with "
                "`celery redislock release`): %s",
                task.name,
                self.id,
                exc,
            )

    def _free_reservation(self, name: str) -> None:
        """Free lock ``name`` if this message's ``until_*`` reservation still holds
        it (:func:`~celery_redislock.reservations.free_queued`: an execution's hold
        is left alone), as for a message dropped as revoked: an ``until_executed``
        retry's reservation that is not there yet (the execution that sent the
        retry runs on) is left word to free it as that execution ends
        (:func:`~celery_redislock.dropped.free_dropped`), as is the execution
        that sent this message under its own task id from its body.

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        task = self.task
        options = task.lock_options
        if options.strategy == WHILE_EXECUTING:
            return
        if task._free_message(self, name, options, drop_id(self)):
            logger.info(
                "celery_redislock: freed the reservation %s of %s[%s], whose pool process "
                "%s died before it started",
                name,
                task.name,
                self.id,
                self.worker_pid,
            )

    def _give_back(self) -> None:
        """Give back the hold of an acquire written ahead that the task never read."""
        _give_back_unread(self.id)


def _give_back_unread(task_id: str) -> None:
    """Give back the hold of the acquire written ahead for ``task_id`` on this
    thread, if the task never read it."""
    if not _written_ahead:
        # The usual end: the task read its own (every task ends here).
        return
    written = take_written_ahead(task_id)
    if written is not None:
        written.sent.abandon()


class _Handed:
    """A task handed to a prefork pool process, as
    :meth:`~celery_redislock.task.SingletonTask._acquire_ahead` reads a worker
    request: ``request_dict`` is what the worker sent the process (the message's
    headers and delivery details)."""

    __slots__ = ("args", "hostname", "id", "kwargs", "request_dict")

    def __init__(self, task_id: str, args: Any, kwargs: Any, request: dict[str, Any]) -> None:
        self.id = task_id
        self.args = args
        self.kwargs = kwargs
        self.request_dict = request
        self.hostname = request.get("hostname")


#: Attribute marking a tracer :func:`_ahead_of` made (another library's wrapper
#: may carry ``__wrapped__`` too: that one is wrapped all the same).
_WRITES_AHEAD = "_redislock_writes_ahead"


def _ahead_of(task: SingletonTask, tracer: Any) -> Any:
    """``tracer``, the ``__trace__`` Celery built for ``task`` in a prefork pool
    process, made to write the task's acquire before it runs (see
    :func:`trace_ahead`)."""

    def trace(task_id: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        try:
            try:
                task._acquire_ahead(_Handed(task_id, args, kwargs, request or {}))
            except SoftTimeLimitExceeded:
                # The task's, struck as the acquire was written: the task ends with
                # it, and the finally below gives the acquire back.
                raise
            except Exception:
                # Never in the way of the task: it then asks as it starts.
                logger.exception("celery_redislock: writing the acquire of %s failed", task_id)
            return tracer(task_id, args, kwargs, request)
        finally:
            # Left unread if the tracer ended the task without calling it
            # (track_started could not store the state, a redelivery of a task
            # already done was skipped, a soft time limit struck first).
            _give_back_unread(task_id)

    trace.__wrapped__ = tracer  # type: ignore[attr-defined]
    setattr(trace, _WRITES_AHEAD, True)
    return trace


def trace_ahead(app: Any) -> None:
    """Make each :class:`~celery_redislock.task.SingletonTask` of ``app`` write its
    acquire as this prefork pool process is handed it (at ``worker_process_init``,
    once Celery has built the tasks' tracers).

    The tracer's setup (the request context, ``task_prerun``, ``track_started``,
    ``before_start``) then runs while the request is on its way, as the worker's
    own work does on the solo pool. ``while_executing`` tasks (the default
    strategy) are made to, and ``until_executed`` tasks whose message Celery
    never delivers again once their pool process is lost (:func:`_comes_back`):
    without ``acks_late``, or with it but without ``reject_on_worker_lost``, a
    requeue on the hard time limit and
    ``worker_cancel_long_running_tasks_on_connection_loss``. For those, the
    worker freeing a dead process's hold (:class:`Request`) has the outcome of
    freeing the message's reservation. The others are left as they are, and
    acquire as they start: ``until_executed`` tasks whose message may come back
    (an execution's acquire takes over the reservation the send made, which a
    pool process that dies before the task starts must leave for the delivery
    that comes back), ``until_executing`` tasks (whose lock is released as they
    start), and task classes with a ``__call__`` of their own (which may not
    start the locked execution).
    """
    for task in list(app.tasks.values()):
        tracer = getattr(task, "__trace__", None)
        if (
            isinstance(task, SingletonTask)
            and type(task).__call__ is SingletonTask.__call__
            and (
                task.lock_options.strategy == WHILE_EXECUTING
                or (task.lock_options.strategy == UNTIL_EXECUTED and not _comes_back(task))
            )
            and tracer is not None
            and not getattr(tracer, _WRITES_AHEAD, False)
        ):
            task.__trace__ = _ahead_of(task, tracer)
