"""Work about a lock done again in the background while the lock store does not
answer.

The heartbeat sends single requests again (a release, a free) until they land;
some work takes several, each depending on the answer to the one before (read
the word a dropped delivery left beside a lock, act on it, forget it). Such a
job is handed here when the store fails it, and tried again on a thread of its
own, with pauses that grow, until it lands or it is no longer worth doing (the
lock it is about would have expired by then): a lock is not left held until its
TTL for want of a second try. Each try's round trips have deadlines of their own.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Protocol

from celery_redislock import transport as _transport
from celery_redislock.errors import LockBackendError
from celery_redislock.transport import Deadline

__all__ = ["Job", "Retried", "retry_later"]

logger = logging.getLogger(__name__)

#: What a job given up leaves, and what an operator can do, for the log.
_WHAT_NOW = "the lock expires by its TTL, or free it with `celery redislock release`"

#: The first pause between tries of work done again in the background (see
#: :class:`Retried`), in seconds; it doubles after each failed try, up to
#: :data:`RETRY_PAUSE_MAX`.
RETRY_PAUSE = 0.05
RETRY_PAUSE_MAX = 1.0


class Job(Protocol):
    """Work :class:`Retried` tries again: done twice, or late, it is done once
    (each of its writes checks what it acts on)."""

    #: Until when (a monotonic time) it is worth trying.
    until: float

    @property
    def what(self) -> str:
        """What it is, for the log."""
        ...

    def attempt(self) -> None:
        """Do it once more.

        Raises:
            LockBackendError: the lock store could not be reached.
        """
        ...


class Retried:
    """Work about a lock done again on a thread of its own while the lock store
    does not answer (each job's ``attempt()`` raises ``LockBackendError``), until
    it lands or the job's ``until`` (a monotonic time) passes, rather than leave
    a lock held until its TTL. One per process (a forked child starts with none
    of its parent's); a :func:`~celery_redislock.transport.flush`, as the
    process exits, does what is left from its own thread (see :meth:`run_now`)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: list[tuple[float, float, Job]] = []  # (due, pause, job)
        # The job the thread is trying, with its pause: a try stuck on a
        # connection gone dark does not keep a flush at exit from it.
        self._current: tuple[float, Job] | None = None
        self._thread: threading.Thread | None = None

    def add(self, job: Job, pause: float | None = None) -> None:
        """Try ``job`` again in ``pause`` seconds (:data:`RETRY_PAUSE` if ``None``)."""
        if pause is None:
            pause = RETRY_PAUSE
        with self._cond:
            self._jobs.append((time.monotonic() + pause, pause, job))
            self._cond.notify_all()
            if _transport.exiting or (self._thread is not None and self._thread.is_alive()):
                return  # (exiting: no thread is started now; the flush does it)
            thread = threading.Thread(target=self._run, name="redislock-retried", daemon=True)
            try:
                thread.start()
            except RuntimeError as error:
                # (No thread can be started now: the flush at exit tries it.)
                logger.warning("%s: not tried again before the process exits: %s", job.what, error)
                return
            self._thread = thread

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._jobs:
                    self._thread = None
                    return
                entry = min(self._jobs, key=lambda item: item[0])
                wait = entry[0] - time.monotonic()
                if wait > 0:
                    # (A job added meanwhile may be due sooner.)
                    self._cond.wait(min(wait, RETRY_PAUSE_MAX))
                    continue
                self._jobs.remove(entry)
                self._current = (entry[1], entry[2])
            try:
                self._try(entry[2], entry[1], final=False)
            finally:
                with self._cond:
                    self._current = None

    def _try(self, job: Job, pause: float, final: bool) -> None:
        try:
            job.attempt()
        except LockBackendError as error:
            if final or time.monotonic() + pause >= job.until:
                logger.warning("%s: given up (%s): %s", job.what, _WHAT_NOW, error)
            else:
                self.add(job, min(pause * 2, RETRY_PAUSE_MAX))
        except Exception as error:
            logger.warning("%s: not possible (%s): %s", job.what, _WHAT_NOW, error)

    def run_now(self, deadline: Deadline, final: bool = False) -> None:
        """Try every job now, from the calling thread, while ``deadline`` has not
        passed (each try's round trips have deadlines of their own): for a
        :func:`~celery_redislock.transport.flush`. ``final``: the process exits,
        so a job that fails, or is not tried by then, is given up, logged; the
        job the thread is trying is tried here too (its try may be stuck on a
        connection gone dark; a job done twice is done once)."""
        in_flight = final
        while True:
            with self._cond:
                jobs = [(pause, job) for _due, pause, job in self._jobs]
                self._jobs = []
                if in_flight and self._current is not None:
                    jobs.append(self._current)
            in_flight = False
            for pause, job in jobs:
                if not deadline.expired():
                    self._try(job, pause, final)
                elif final:
                    logger.warning("%s: given up as the process exits (%s)", job.what, _WHAT_NOW)
                else:
                    self.add(job, pause)
            # At exit, a job handed over meanwhile (no thread takes it now) too.
            if not (final and jobs):
                return


_retried = Retried()


def _retried_now(deadline: Deadline, final: bool) -> None:
    """:meth:`Retried.run_now` for this process's jobs, as a flush sends what
    the heartbeat retries (see :func:`~celery_redislock.transport.flush`)."""
    _retried.run_now(deadline, final)


def _retried_after_fork() -> None:
    global _retried
    _retried = Retried()


os.register_at_fork(after_in_child=_retried_after_fork)
# Before the heartbeat's: what a job hands the heartbeat (a hold freed in the
# background) goes with its sends.
_transport._after_drain.insert(0, _retried_now)


def retry_later(job: Job) -> None:
    """Try ``job`` again in the background (see :class:`Retried`)."""
    _retried.add(job)
