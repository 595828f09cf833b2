# mypy: disallow-untyped-decorators=False
# (Celery ships no type information, so ``@app.task`` is an untyped decorator.)
"""SingletonTask in real workers, beside a plain task and the peer libraries.

Usage::

    python bench/bench_task.py [--quick] [--url URL] [--only 1,2,3,4,5] [--tasks N] [--rounds R]
                               [--work-ms 0,5] [--pools solo,prefork] [--pin] [--profile]
                               [--json FILE]

Two private servers are started on free 127.0.0.1 ports (see
:class:`celery_redislock.server.RedisServer`): one is the broker and result
backend, the other holds nothing but locks, so that ``INFO commandstats`` on it
counts exactly what each kind of lock costs (``CONFIG RESETSTAT`` before each
batch). With ``--url`` both roles share that server and the lock counts include
the broker's traffic. Workers are real ``celery worker`` subprocesses importing
this module as ``bench_task``.

Sections, numbered after the project's performance goals (figures only,
nothing is asserted; a figure that misses its target prints ``NOT MET``):

1. Lock cost per task: each kind of task run through ``apply_async`` in eager
   mode against the lock-only server, so every lock command it makes is seen:
   client round trips (and how many were made on the calling thread, the
   task's critical path), script calls (``EVALSHA``; ``FCALL`` for the
   owner-checked floor) and the commands run inside them.
   With ``--profile``, ``cProfile`` of eager SingletonTask executions too.
2. Throughput ratio to a plain task: a worker (solo pool, then prefork with 2
   processes) drains batches of no-op tasks (and of tasks that sleep
   ``--work-ms``) for each kind: plain, ``SingletonTask``, celery-once's
   ``QueueOnce``, celery-singleton's ``Singleton``, a plain task taking
   redis-py's ``Lock`` in its body, and three floors: a plain task making one
   round trip (``SET NX``), one that also writes a ``DEL`` whose answer it
   reads later (what a lock released without waiting needs at least), and one
   whose two requests run scripts instead, with a fencing token from the
   server clock and an owner check (what a lock checked and fenced on the
   server, as ``SingletonTask``'s is, needs at least). Kinds
   are interleaved over rounds and each round's rate is divided by the same
   round's plain rate. Beside the rate:
   the worker's CPU per task, the producer's time per ``apply_async``, and the
   lock store's commands and CPU per task (``INFO cpu``, sends included). No-op
   tasks are also timed *end to end*: sent while the worker runs, from the first
   send to the last result, so that what a kind costs the producer counts too.
3. Contention: 50 purchases of one event, each a 10 ms critical section, on 4
   worker processes waiting for the lock: makespan against the ideal
   50 x 10 ms, for ``SingletonTask(on_conflict="wait")`` and plain tasks using
   python-redis-lock or redis-py's ``Lock``; lock commands per purchase.
4. Client instructions per task (not with ``--quick``; needs ``valgrind``):
   each kind run eagerly, as in section 1, in processes of its own under
   ``valgrind --tool=callgrind``, with 50 and then 350 tasks; the difference of
   the instruction counts per task. A count: it moves by a few percent at most
   from run to run. Then the same count for the worker's side alone: a solo
   worker under valgrind drains 40, then 240 tasks of each kind queued for it,
   counted for all its threads and for its main thread alone.
5. Interleaved: one solo worker drains batches in which the kinds of section 2,
   and ``SingletonTask`` taking its lock as it starts (nothing written ahead,
   as for an ``until_executed`` task in a prefork pool process whose message
   Celery requeues if that process is lost), take
   turns task by task (which kind comes first rotates from round to
   round): batches of no-op tasks, then, for each other ``--work-ms`` value,
   batches of tasks that sleep that long (with ``--pin``, the worker on a CPU of
   its own). The worker notes when it receives each task
   (``task_received``, before it accepts the task: ``SingletonTask`` writes its
   acquire as the task is accepted), so the time from one task's receipt to the
   next one's is what that task cost on the worker's clock, its kind known. A
   slow moment of the machine hits every kind alike: over ten runs,
   SingletonTask's ratio moved by 2.3 points and celery-singleton's, the most,
   by 5, where section 2's move by ten. The worker also notes when each task
   starts and ends (``task_prerun``, ``task_postrun``) and when its body's work
   begins and ends, and a table splits each kind's time per task into receipt
   to start, start to body, the work, body to end and end to the next receipt,
   and (Linux) counts how often per task the worker's thread slept, was
   preempted, and was off its CPU in all.
   Then the lock store's time per command
   over the counted rounds (``INFO commandstats``): the scripts' ``EVALSHA``
   and the owner-checked floor's ``FCALL`` beside the peers' ``SET`` and ``DEL``.
   Last, a prefork worker with one pool process: per kind (plain,
   ``SingletonTask``, the same taking its lock as it starts, an
   ``until_executed`` one with ``acks_late``, the one-round-trip floor), the
   pool process's time from being handed a no-op task to its body.

celery-once and celery-singleton take their lock when the task is *sent*
(``apply_async``) and free it when it ends, so part of their cost is paid by
the producer: the tables show the producer's time per ``apply_async`` beside
the worker's rate. ``SingletonTask`` (default strategy) and the in-body locks
take it when the task runs.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import itertools
import os
import re
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import redis
from celery import Celery, signals
from celery.result import ResultSet
from common import (
    CommandCount,
    Findings,
    Spread,
    command_calls,
    command_stats,
    counting_writes,
    describe_machine,
    import_peer,
    per_operation,
    print_profile,
    reset_stats,
    rotated,
    server_cpu,
    servers,
)

from celery_redislock import SingletonTask
from celery_redislock.transport import transport_for

#: Environment variables giving the worker subprocess the server URLs.
URL_ENV = "CELERY_REDISLOCK_BENCH_URL"
LOCK_URL_ENV = "CELERY_REDISLOCK_BENCH_LOCK_URL"
#: Queue of the benchmark tasks (so a worker of another app on the same server
#: does not take them).
QUEUE = "celery_redislock_bench"
HERE = Path(__file__).resolve().parent

#: Contention: purchases, critical section (seconds), worker processes.
PURCHASES, CRITICAL, CONTENDERS = 50, 0.010, 4

celery_once, ONCE_MISSING = import_peer("celery-once")
celery_singleton, SINGLETON_MISSING = import_peer("celery-singleton")
redis_lock, REDIS_LOCK_MISSING = import_peer("python-redis-lock")


def configure(app: Celery, url: str, lock_url: str) -> None:
    """Broker and results on ``url``; every kind of lock on ``lock_url``."""
    app.conf.update(
        broker_url=url,
        result_backend=url,
        redislock_url=lock_url,
        task_default_queue=QUEUE,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
        # celery-once: its Redis backend, locks kept at most an hour.
        ONCE={
            "backend": "celery_once.backends.Redis",
            "settings": {"url": lock_url, "default_timeout": 3600},
        },
        # celery-singleton: its Redis backend; an expiry like the others' (it has none by default).
        singleton_backend_url=lock_url,
        singleton_lock_expiry=3600,
    )


app = Celery("bench_task", set_as_current=False)
if os.environ.get(URL_ENV):
    configure(app, os.environ[URL_ENV], os.environ.get(LOCK_URL_ENV, os.environ[URL_ENV]))

_lock_clients: dict[tuple[int, str], redis.Redis] = {}


def lock_client() -> redis.Redis:
    """A client of the lock store for the in-body locks (one per process: workers fork)."""
    url = app.conf.redislock_url
    key = (os.getpid(), url)
    if key not in _lock_clients:
        _lock_clients[key] = redis.Redis.from_url(url)
    return _lock_clients[key]


def critical_section(work: float) -> tuple[float, float]:
    """A purchase's critical section: ``work`` seconds of :func:`busy`; returns when
    it began and ended (wall clock), for the contention run's overlap check."""
    began = time.time()
    busy(work)
    return began, time.time()


def busy(work: float) -> None:
    """Stand for ``work`` seconds of real work (a sleep: it leaves the CPU to others).
    While section 5 marks the worker's clock, its start and end are noted too."""
    if _marking:
        _marks.append((time.perf_counter(), BODY, ""))
    if work:
        time.sleep(work)
    if _marking:
        _marks.append((time.perf_counter(), BODY_END, ""))


#: The floors SingletonTask's ratio is compared with: their labels in the tables,
#: and what a finding calls them.
FLOORS = {
    "one round trip (floor)": "the one-round-trip floor",
    "one round trip + one written": "the floor of a lock released without waiting",
    "owner-checked floor (scripts)": "the floor of a lock checked and fenced on the server",
}

#: The other libraries' kinds, whose ratios SingletonTask's must reach.
PEERS = ("celery-once", "celery-singleton", "redis-py Lock in task")

#: The ratio to a plain task SingletonTask's must also reach when tasks do real work.
WORK_TARGET = 0.98


# The kinds of task compared in sections 1 and 2; all take (round_id, index, work).
@app.task(name="bench.plain", shared=False)
def plain(round_id: str, index: int, work: float = 0.0) -> None:
    """No lock at all: the baseline."""
    busy(work)


@app.task(name="bench.singleton", base=SingletonTask, shared=False)
def singleton(round_id: str, index: int, work: float = 0.0) -> None:
    """This project's task: a lock keyed on all arguments, held while it runs."""
    busy(work)


class AcquiredAtStart(SingletonTask):
    """``SingletonTask`` whose acquire nothing writes ahead: its class has a
    ``__call__`` of its own (the package writes ahead only for a task whose
    ``__call__`` is ``SingletonTask``'s). The task takes its lock as it starts, as
    an ``until_executed`` task of a prefork pool process whose message Celery
    requeues if that process is lost does (whose worker accepts it in another
    process, and whose pool process leaves its reservation alone until the task
    starts)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return super().__call__(*args, **kwargs)


@app.task(name="bench.singleton_at_start", base=AcquiredAtStart, shared=False)
def singleton_at_start(round_id: str, index: int, work: float = 0.0) -> None:
    """This project's task, its lock taken as it starts (see :class:`AcquiredAtStart`)."""
    busy(work)


@app.task(
    name="bench.singleton_until_late",
    base=SingletonTask,
    shared=False,
    lock_strategy="until_executed",
    acks_late=True,
)
def singleton_until_late(round_id: str, index: int, work: float = 0.0) -> None:
    """This project's task, reserved as it is sent and acknowledged as it ends: its
    message is not delivered again if its pool process dies, so that process
    takes the reservation over as it is handed the task."""
    busy(work)


#: Section 5's prefork kind of :func:`singleton_until_late`.
UNTIL_LATE_LABEL = "until_executed, acks_late"


@app.task(name="bench.redis_py", shared=False)
def redis_py(round_id: str, index: int, work: float = 0.0) -> None:
    """A plain task that takes redis-py's ``Lock`` around its body."""
    with lock_client().lock(f"bench.redis_py:{round_id}:{index}", timeout=60):
        busy(work)


@app.task(name="bench.floor", shared=False)
def floor(round_id: str, index: int, work: float = 0.0) -> None:
    """The floor of any lock taken as the task runs: one synchronous round trip
    (a ``SET NX PX``, nothing released, no owner check, no heartbeat)."""
    lock_client().set(f"bench.floor:{round_id}:{index}", 1, nx=True, px=60_000)
    busy(work)


class Unanswered:
    """The floors' bare redis-py connections, one of each process's and thread's
    own (workers fork; the threads pool runs tasks side by side), on which a
    request may be written and its answer left to be read after the next one."""

    def __init__(self, *setup: tuple[Any, ...]) -> None:
        #: Commands each new connection sends first, waiting for their answers.
        self.setup = setup
        self.connections: dict[tuple[int, int], Any] = {}
        self.owing: set[tuple[int, int]] = set()

    def round_trip(self, *command: Any) -> Any:
        """Write ``command``, read the answer still owed (it came first), then its own."""
        me = (os.getpid(), threading.get_ident())
        connection: Any = self.connections.get(me)
        if connection is None:
            connection = self.connections[me] = lock_client().connection_pool.get_connection()
            for first in self.setup:
                connection.send_command(*first)
                connection.read_response()
        connection.send_command(*command)
        if me in self.owing:
            self.owing.discard(me)
            connection.read_response()
        return connection.read_response()

    def write(self, *command: Any) -> None:
        """Write ``command`` on this thread's connection and leave its answer owed."""
        me = (os.getpid(), threading.get_ident())
        self.connections[me].send_command(*command)
        self.owing.add(me)


_written = Unanswered()


@app.task(name="bench.floor_written", shared=False)
def floor_written(round_id: str, index: int, work: float = 0.0) -> None:
    """The floor of a lock released as its task ends without waiting for the answer:
    one synchronous round trip (a ``SET NX PX``) and one written request (a ``DEL``)
    whose answer is read after the next request is written; no owner check, no
    heartbeat."""
    key = f"bench.floor_written:{round_id}:{index}"
    _written.round_trip("SET", key, 1, "NX", "PX", 60_000)
    busy(work)
    _written.write("DEL", key)


#: The scripted floor's Redis functions (loaded once per process; a function costs
#: the server what the same script run by ``EVALSHA`` does, and ``INFO
#: commandstats`` counts its calls apart, as ``FCALL``).
FLOOR_LIBRARY = """#!lua name=celery_redislock_bench
-- KEYS[1] the lock key; ARGV[1] owner token; ARGV[2] TTL in ms. Where the name
-- has no key, take it with a fencing token from the server clock, as
-- SingletonTask's acquire of a new name does (GET, TIME, SET PX); returns the
-- token, or 0 when the name has a key.
redis.register_function('bench_floor_acquire', function(keys, args)
    if redis.call('GET', keys[1]) then return 0 end
    local now = redis.call('TIME')
    local fence = now[1] .. string.format('%06d', tonumber(now[2]))
    redis.call('SET', keys[1], args[1] .. ':' .. fence, 'PX', args[2])
    return tonumber(fence)
end)
-- KEYS[1] the lock key; ARGV[1] owner token. Delete the key if this owner holds
-- it; returns 1 when freed, 0 when not owned.
redis.register_function('bench_floor_release', function(keys, args)
    local value = redis.call('GET', keys[1])
    if value and string.sub(value, 1, #args[1] + 1) == args[1] .. ':' then
        return redis.call('DEL', keys[1])
    end
    return 0
end)
"""
_checked = Unanswered(("FUNCTION", "LOAD", "REPLACE", FLOOR_LIBRARY))


@app.task(name="bench.floor_checked", shared=False)
def floor_checked(round_id: str, index: int, work: float = 0.0) -> None:
    """The floor of a lock whose owner check and fencing token live on the server,
    as SingletonTask's do: one synchronous round trip running a script (a fencing
    token from the clock) and one written script (the owner compared, the key
    deleted) whose answer is read after the next request is written; no renewal,
    no holder description, no queue, no retry of a lost reply."""
    key = f"bench.floor_checked:{round_id}:{index}"
    owner = os.urandom(6).hex()
    if not _checked.round_trip("FCALL", "bench_floor_acquire", 1, key, owner, 60_000):
        raise RuntimeError(f"{key} is held")
    busy(work)
    _checked.write("FCALL", "bench_floor_release", 1, key, owner)


once: Any = None
if celery_once is not None:

    @app.task(name="bench.once", base=celery_once.QueueOnce, shared=False, once={"graceful": True})
    def once(round_id: str, index: int, work: float = 0.0) -> None:
        """celery-once: locked by ``apply_async``, unlocked after the task returns."""
        busy(work)


csingleton: Any = None
if celery_singleton is not None:

    @app.task(name="bench.celery_singleton", base=celery_singleton.Singleton, shared=False)
    def csingleton(round_id: str, index: int, work: float = 0.0) -> None:
        """celery-singleton: locked by ``apply_async``, unlocked on success or failure."""
        busy(work)


# Section 5's clock, in the worker: when each task was received, started and
# ended (Celery's signals, with the task's name), and when its body's work began
# and ended (busy(), without a name: the task started last's).
RECEIVED, STARTED, BODY, BODY_END, ENDED = "received", "started", "body", "body end", "ended"
_marks: list[tuple[float, str, str]] = []
_marking = False

#: Noted just before each receipt, where the system counts them per thread
#: (Linux): how often the worker's main thread, which runs the tasks of a solo
#: pool, has given up its CPU so far to wait (for a reply, a sleep: ``SLEPT``) and
#: had it taken away by another task the kernel ran there instead (``PREEMPTED``).
#: Their marks carry the count where the others carry a time.
SLEPT, PREEMPTED = "slept", "preempted"
_THREAD_USAGE: int | None = getattr(resource, "RUSAGE_THREAD", None)


def _note_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    if _THREAD_USAGE is not None:
        usage = resource.getrusage(_THREAD_USAGE)
        _marks.append((usage.ru_nvcsw, SLEPT, ""))
        _marks.append((usage.ru_nivcsw, PREEMPTED, ""))
    _marks.append((time.perf_counter(), RECEIVED, request.name))


def _note_started(sender: Any = None, **_: Any) -> None:
    _marks.append((time.perf_counter(), STARTED, sender.name))


def _note_ended(sender: Any = None, **_: Any) -> None:
    _marks.append((time.perf_counter(), ENDED, sender.name))


_NOTES = (
    (signals.task_received, _note_received),
    (signals.task_prerun, _note_started),
    (signals.task_postrun, _note_ended),
)


@app.task(name="bench.starts", shared=False)
def starts(action: str) -> list[tuple[float, str, str]]:
    """``"start"``: note from now on when each task is received, starts and ends,
    and when its body's work begins and ends; ``"stop"``: stop, and return the
    notes as ``(time, event, task name)`` (this task's own receipt last)."""
    global _marking
    if action == "start":
        _marks.clear()
        for signal, note in _NOTES:
            signal.connect(note, weak=False)
        _marking = True
        return []
    _marking = False
    for signal, note in _NOTES:
        signal.disconnect(note)
    found = list(_marks)
    _marks.clear()
    return found


#: Section 5's prefork mark: when a pool process is handed a task (see
#: :func:`_mark_handed`).
HANDED = "handed"


def _handed_noted(task: Any, tracer: Any) -> Any:
    """``tracer``, a task's ``__trace__`` in a prefork pool process, made to note
    when the process is handed the task, while section 5 marks the clock."""

    def trace(task_id: str, args: Any, kwargs: Any, request: Any = None) -> Any:
        if _marking:
            _marks.append((time.perf_counter(), HANDED, task.name))
        return tracer(task_id, args, kwargs, request)

    return trace


@signals.worker_process_init.connect
def _mark_handed(**_: Any) -> None:
    """In a prefork pool process: note when it is handed each task of this module.
    Connected after the package's own receiver (imported above), so the note
    comes before the acquire the package writes there."""
    for task in app.tasks.values():
        if task.name.startswith("bench.") and task.__trace__ is not None:
            task.__trace__ = _handed_noted(task, task.__trace__)


#: The marks every task gets, in order, and the next task's receipt after them.
EVENTS = (RECEIVED, STARTED, BODY, BODY_END, ENDED)
NEXT = "next received"

#: Section 5's parts of a task's time on the worker, between the marks they
#: run from and to (see :func:`segments`).
SEGMENTS = {
    "receipt to start": (RECEIVED, STARTED),
    "start to body": (STARTED, BODY),
    "body": (BODY, BODY_END),
    "body to end": (BODY_END, ENDED),
    "end to next": (ENDED, NEXT),
}


#: The worker's main thread's context switches per task, from the counts noted
#: at one task's receipt to those at the next (see :data:`SLEPT`), and the two
#: together: how often the task was off its CPU, and waited to be run again
#: (unless what it would have waited for came in meanwhile).
SWITCHES = (SLEPT, PREEMPTED)
OFF_CPU = "off CPU"
COUNTS = (*SWITCHES, OFF_CPU)


def segments(marks: list[tuple[float, str, str]]) -> dict[str, dict[str, list[float]]]:
    """Per task name, the seconds each task spent in each of :data:`SEGMENTS`, and
    where they were counted, its :data:`COUNTS`, from the worker's marks (a task
    whose marks are not all there is left out)."""
    found: dict[str, dict[str, list[float]]] = {}
    task: dict[str, float] = {}
    name = ""
    counts: dict[str, float] = {}
    for when, event, marked in marks:
        if event in SWITCHES:
            counts[event] = when
            continue
        if event == RECEIVED:
            if all(mark in task for mark in EVENTS):
                task[NEXT] = when
                parts = found.setdefault(name, {part: [] for part in SEGMENTS})
                for part, (start, end) in SEGMENTS.items():
                    parts[part].append(task[end] - task[start])
                if all(switch in task and switch in counts for switch in SWITCHES):
                    switched = [counts[switch] - task[switch] for switch in SWITCHES]
                    for switch, times in zip(COUNTS, (*switched, sum(switched)), strict=True):
                        parts.setdefault(switch, []).append(times)
            task, name = dict(counts), marked
        task.setdefault(event, when)
    return found


# The purchases of section 3; each returns when its critical section began and ended.
@app.task(
    name="bench.purchase_singleton",
    base=SingletonTask,
    shared=False,
    lock_on=("event_id",),
    on_conflict="wait",
    lock_wait=120,
)
def purchase_singleton(event_id: str, index: int, work: float) -> tuple[float, float]:
    """A purchase under this project's lock, waiting for it when another holds it."""
    return critical_section(work)


@app.task(
    name="bench.purchase_retry",
    base=SingletonTask,
    shared=False,
    lock_on=("event_id",),
    on_conflict="retry",
    lock_retry_delay=0.01,
    max_retries=None,
)
def purchase_retry(event_id: str, index: int, work: float) -> tuple[float, float]:
    """A purchase under this project's lock, sent back to the queue while another holds it."""
    return critical_section(work)


@app.task(
    name="bench.purchase_skip",
    base=SingletonTask,
    shared=False,
    lock_on=("event_id",),
    on_conflict="skip",
)
def purchase_skip(event_id: str, index: int, work: float) -> tuple[float, float]:
    """A purchase under this project's lock, dropped while another holds it."""
    return critical_section(work)


@app.task(name="bench.purchase_plain", shared=False)
def purchase_plain(event_id: str, index: int, work: float) -> tuple[float, float]:
    """A purchase with no lock at all: critical sections overlap."""
    return critical_section(work)


@app.task(name="bench.purchase_redis_py", shared=False)
def purchase_redis_py(event_id: str, index: int, work: float) -> tuple[float, float]:
    """A purchase under redis-py's ``Lock`` (it polls every 0.1 s while it waits)."""
    with lock_client().lock(f"bench.purchase:{event_id}", timeout=60, blocking_timeout=120):
        return critical_section(work)


purchase_once: Any = None
if celery_once is not None:

    @app.task(
        name="bench.purchase_once",
        base=celery_once.QueueOnce,
        shared=False,
        once={"graceful": True, "keys": ["event_id"]},
    )
    def purchase_once(event_id: str, index: int, work: float) -> tuple[float, float]:
        """A purchase under celery-once: a duplicate is dropped when it is sent."""
        return critical_section(work)


purchase_csingleton: Any = None
if celery_singleton is not None:

    @app.task(
        name="bench.purchase_celery_singleton",
        base=celery_singleton.Singleton,
        shared=False,
        unique_on=["event_id"],
    )
    def purchase_csingleton(event_id: str, index: int, work: float) -> tuple[float, float]:
        """A purchase under celery-singleton: a duplicate sent while one is queued or
        running gets that one's result instead."""
        return critical_section(work)


purchase_prl: Any = None
if redis_lock is not None:

    @app.task(name="bench.purchase_prl", shared=False)
    def purchase_prl(event_id: str, index: int, work: float) -> tuple[float, float]:
        """A purchase under python-redis-lock (waiters block in ``BLPOP`` on a signal list)."""
        lock = redis_lock.Lock(lock_client(), f"bench.purchase:{event_id}", expire=60)  # type: ignore[union-attr]
        with lock:
            return critical_section(work)


@dataclass
class Kind:
    """One kind of task: its label, the task (``None``: unavailable) and why not."""

    label: str
    task: Any
    note: str = ""
    missing: str = ""


def interleaved_kinds() -> list[Kind]:
    """The kinds of section 5: those of sections 1 and 2, and ``SingletonTask`` taking
    its lock as it starts, with nothing written ahead (see :class:`AcquiredAtStart`)."""
    kinds = task_kinds()
    kinds.insert(2, Kind("SingletonTask, at start", singleton_at_start, "lock taken at start"))
    return kinds


def task_kinds() -> list[Kind]:
    """The kinds compared in sections 1 and 2, plain first."""
    return [
        Kind("plain task", plain, "no lock"),
        Kind("SingletonTask", singleton, "lock while running"),
        Kind("celery-once", once, "lock from send to end", ONCE_MISSING),
        Kind("celery-singleton", csingleton, "lock from send to end", SINGLETON_MISSING),
        Kind("redis-py Lock in task", redis_py, "lock in the body"),
        Kind("one round trip (floor)", floor, "one SET NX in the body"),
        Kind("one round trip + one written", floor_written, "SET NX, then DEL unanswered"),
        Kind("owner-checked floor (scripts)", floor_checked, "two scripts, one unanswered"),
    ]


# Workers.
@contextmanager
def worker_process(
    url: str, lock_url: str, pool: str, concurrency: int, cpus: set[int] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A ``celery worker`` subprocess importing this module, in a process group of its own
    (so the whole pool can be paused and its CPU time summed); ``cpus``: the only
    CPUs it may run on."""
    env = dict(os.environ)
    env[URL_ENV], env[LOCK_URL_ENV] = url, lock_url
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    command = [
        sys.executable, "-m", "celery", "--app", "bench_task:app", "--quiet", "worker",
        "--pool", pool, "--concurrency", str(concurrency), "--loglevel", "WARNING",
        "--without-mingle", "--without-gossip", "--without-heartbeat", "--queues", QUEUE,
        "--hostname", f"bench-{uuid.uuid4().hex[:8]}@%h",
    ]  # fmt: skip
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            command, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        if cpus is not None:
            # Before the worker starts its threads (they inherit it): it is still
            # importing when Popen returns.
            os.sched_setaffinity(process.pid, cpus)
        try:
            yield process
        except BaseException:
            log.seek(0)
            tail = log.read()[-4000:].decode(errors="replace")
            if tail:
                print(f"--- worker output (tail) ---\n{tail}", file=sys.stderr)
            raise
        finally:
            signal_group(process, signal.SIGCONT)
            signal_group(process, signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                signal_group(process, signal.SIGKILL)
                process.wait()


def signal_group(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    """Send ``signum`` to the worker's whole process group (its pool processes too)."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def group_cpu(pgid: int) -> float | None:
    """User + system CPU seconds of every process in group ``pgid`` (Linux ``/proc`` only)."""
    total, found = 0, False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            total += int(fields[11]) + int(fields[12])
            found = True
    return total / os.sysconf("SC_CLK_TCK") if found else None


class Mode(NamedTuple):
    """How section 2 measures a batch: the work each task does, and whether the
    worker is paused while the batch is sent (its drain rate) or not (end to end)."""

    work: float
    paused: bool = True

    @property
    def column(self) -> str:
        """Its heading in the ratio table."""
        tasks = "no-op" if not self.work else f"{self.work * 1e3:g} ms"
        return tasks if self.paused else f"{tasks}, end to end"

    @property
    def what(self) -> str:
        """How the findings and the per-mode tables name it."""
        tasks = "no-op tasks" if not self.work else f"tasks of {self.work * 1e3:g} ms"
        return tasks if self.paused else f"{tasks}, end to end"


@dataclass
class Batch:
    """What one batch cost."""

    rate: float  #: tasks per second drained by the worker
    cpu_ms: float | None  #: worker CPU per task (all its processes)
    enqueue_us: float  #: producer time per apply_async
    commands: CommandCount  #: lock-store commands per task (producer and worker)
    lock_server_us: float  #: the lock store's CPU per task (producer and worker), microseconds
    results: list[Any] = field(default_factory=list)


def run_batch(
    calls: list[tuple[Any, tuple[Any, ...]]],
    worker: subprocess.Popen[bytes],
    lock_stats: redis.Redis,
    timeout: float,
    paused: bool = True,
) -> Batch:
    """Send ``calls`` while the worker is paused, then time it draining them.

    The worker's process group is stopped (SIGSTOP) while the batch is sent, and
    the clock starts when it resumes: the rate is how fast the worker drains a
    backlog, without the producer competing for the CPU. With ``paused=False``
    the worker runs while the batch is sent and the clock starts at the first
    send: the rate is then end to end, producer and worker sharing the machine.
    Lock-store commands are counted from before the first send to the last result.
    """
    reset_stats(lock_stats)
    lock_cpu = server_cpu(lock_stats)
    if paused:
        signal_group(worker, signal.SIGSTOP)
    else:
        cpu_before, began = group_cpu(worker.pid), time.perf_counter()
    try:
        started = time.perf_counter()
        sent = [task.apply_async(args) for task, args in calls]
        enqueue = time.perf_counter() - started
        # Peers that drop a duplicate when it is sent return no message to wait for
        # (celery-once: an EagerResult without an id), or the one already queued
        # (celery-singleton): each message is waited for once.
        results = ResultSet(list({r.id: r for r in sent if r is not None and r.id}.values()))
    finally:
        if paused:
            cpu_before = group_cpu(worker.pid)
            began = time.perf_counter()
            signal_group(worker, signal.SIGCONT)
    # join_native polls every `interval` seconds (0.5 by default, too coarse here).
    values = results.join_native(timeout=timeout, propagate=True, interval=0.002)
    elapsed = time.perf_counter() - began
    cpu_after = group_cpu(worker.pid)
    commands = per_operation(command_calls(lock_stats), len(calls))
    lock_cpu = server_cpu(lock_stats) - lock_cpu
    results.forget()
    cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return Batch(
        rate=len(calls) / elapsed,
        cpu_ms=None if cpu is None else cpu / len(calls) * 1e3,
        enqueue_us=enqueue / len(calls) * 1e6,
        commands=commands,
        lock_server_us=lock_cpu / len(calls) * 1e6,
        results=list(values),
    )


# 1. Lock cost per task.
def bench_cost_per_task(lock_url: str, count: int, findings: Findings, profile: bool) -> None:
    """Section 1: round trips and server commands per task, every kind run eagerly.

    With ``profile``, also where a SingletonTask execution spends the client's CPU.
    """
    print(
        f"\n1. Lock cost per task: {count} tasks of each kind through apply_async in eager mode"
        " (producer and worker in one thread), against the lock-only server"
    )
    app.conf.task_always_eager = True
    try:
        stats = redis.Redis.from_url(lock_url)
        # The engine's connections to the lock store, to read its own round-trip counter.
        client = singleton.lock_client
        engine = transport_for(client) if isinstance(client, redis.Redis) else None
        rows: list[tuple[str, Any, Callable[[str, int], tuple[Any, ...]]]] = []
        for kind in task_kinds():
            if kind.task is not None:
                rows.append((kind.label, kind.task, lambda r, i: (r, i, 0.0)))
            if kind.task is singleton:
                rows.append(("SingletonTask, one key", singleton, lambda r, i: ("same", 0, 0.0)))
        print(
            f"   {'kind':<24} {'round':>6} {'waited':>7} {'scripts':>8} {'other':>6} {'all':>5}"
            f"   {'us/task':>7}   other commands per task"
        )
        print(f"   {'':<24} {'trips':>6} {'for':>7} {'run':>8} {'cmds':>6} {'cmds':>5}")
        engine_rows: dict[str, tuple[float, float, CommandCount, float]] = {}
        for label, task, arguments in rows:
            for i in range(20):  # scripts loaded, connections open, imports done
                task.apply_async(arguments("warm-up", i)).get()
            round_id = uuid.uuid4().hex
            sends = engine.sends if engine else 0
            reset_stats(stats)
            with counting_writes() as writes:
                started = time.perf_counter()
                for i in range(count):
                    task.apply_async(arguments(round_id, i)).get()
                took = (time.perf_counter() - started) / count * 1e6
            calls = per_operation(command_calls(stats), count)
            print(
                f"   {label:<24} {writes.total / count:6.2f} {writes.waited / count:7.2f}"
                f" {calls.scripts:8.2f} {calls.other:6.2f} {calls.total:5.2f}   {took:7.0f}"
                f"   {calls.breakdown()}"
            )
            if task is singleton:
                per_task_sends = (engine.sends - sends) / count if engine else float("nan")
                engine_rows[label] = (
                    writes.total / count,
                    writes.waited / count,
                    calls,
                    per_task_sends,
                )
        for kind in task_kinds():
            if kind.task is None:
                print(f"   {kind.label:<24} left out: {kind.missing}")
        print(
            "   (SingletonTask: new arguments each time, the usual case, so each task's lock name"
            " is new; 'one key': the same arguments every time. Either way each acquire reads"
            " the server clock, the TIME: no fencing token is lower than it)"
        )
        for label, (_, _, calls, _) in engine_rows.items():
            print(
                f"   {label}: {calls.other:.2f} commands inside the scripts per task: "
                + findings.add(
                    1,
                    f"{label}: commands run by the scripts per task",
                    f"{calls.other:.2f}",
                    "<= 6",
                    calls.other <= 6,
                )
                + f"; {calls.total:.2f} counting the EVALSHAs: "
                + findings.add(
                    1,
                    f"{label}: all server commands per task, EVALSHAs included",
                    f"{calls.total:.2f}",
                    "<= 6 (EVALSHA counted too)",
                    calls.total <= 6,
                )
            )
        if profile:
            profile_singleton(count)
        trips, caller, calls, own_sends = engine_rows["SingletonTask"]
        print(
            f"   SingletonTask: {trips:.2f} round trips per task: "
            + findings.add(
                1, "SingletonTask: round trips per task", f"{trips:.2f}", "<= 2", trips <= 2.0001
            )
            + f" (the lock's own counter, Transport.sends: {own_sends:.2f})"
        )
        print(
            f"   SingletonTask: {caller:.2f} of them waited for on the task's own thread: "
            + findings.add(
                1,
                "SingletonTask: round trips on the task's critical path",
                f"{caller:.2f}",
                "1 (next target)",
                caller <= 1.0001,
            )
        )
        stats.close()
    finally:
        app.conf.task_always_eager = False


def profile_singleton(count: int) -> None:
    """cProfile (CPU time) of ``count`` eager SingletonTask executions with new arguments."""
    round_id = uuid.uuid4().hex
    profiler = cProfile.Profile(time.process_time)
    profiler.enable()
    for i in range(count):
        singleton.apply_async((round_id, i, 0.0)).get()
    profiler.disable()
    print(
        f"   profile of {count} eager SingletonTask executions (CPU time; producer and task in"
        " one thread, no broker):"
    )
    print_profile(profiler)


# 2. Throughput ratio to a plain task.
def warm_up(
    kinds: list[Kind], worker: subprocess.Popen[bytes], stats: redis.Redis
) -> dict[str, str]:
    """Run a few tasks of each kind on a started worker (its connections, scripts
    and imports); return the kinds that cannot run, with why."""
    broken = {kind.label: kind.missing for kind in kinds if kind.task is None}
    plain.apply_async(("warm-up", 0)).get(timeout=60)  # the worker is up
    for kind in kinds:
        if kind.label in broken:
            continue
        try:
            run_batch([(kind.task, ("warm-up", i, 0.0)) for i in range(20)], worker, stats, 60)
        except Exception as exc:
            broken[kind.label] = f"fails with Celery here: {exc!r}"[:200]
    return broken


def bench_throughput(
    url: str,
    lock_url: str,
    pool: str,
    concurrency: int,
    count: int,
    rounds: int,
    modes: list[Mode],
    findings: Findings,
) -> dict[tuple[str, Mode], Spread]:
    """Section 2 for one pool: every kind, interleaved over rounds; returns the ratios."""
    kinds = task_kinds()
    processes = "1 process" if pool == "solo" else f"{concurrency} processes"
    print(f"\n2. Throughput, {pool} pool ({processes}), {rounds} rounds, kinds interleaved")
    stats = redis.Redis.from_url(lock_url)
    batches: dict[tuple[str, Mode], list[Batch]] = {}
    ratios: dict[tuple[str, Mode], Spread] = {}
    with worker_process(url, lock_url, pool, concurrency) as worker:
        broken = warm_up(kinds, worker, stats)
        live = [kind for kind in kinds if kind.label not in broken]
        for r in range(rounds):
            for mode in modes:
                work = mode.work
                n = count if not work else max(20, count // 2)
                for kind in rotated(live, r):
                    round_id = uuid.uuid4().hex
                    calls = [(kind.task, (round_id, i, work)) for i in range(n)]
                    timeout = 60 + n * (0.05 + work)
                    batch = run_batch(calls, worker, stats, timeout, mode.paused)
                    batches.setdefault((kind.label, mode), []).append(batch)
            print(
                f"   round {r + 1}/{rounds}: "
                + ", ".join(
                    f"{kind.label} {batches[(kind.label, modes[0])][-1].rate:.0f}/s"
                    for kind in live
                ),
                flush=True,
            )
    for mode in modes:
        what = mode.what
        base = batches[("plain task", mode)]
        n = len(base)
        print(f"   {what}:")
        print(
            f"   {'kind':<24} {'tasks/s':>15} {'ratio to plain':>18} {'worker CPU':>14}"
            f" {'apply_async':>12} {'lock commands':>14} {'lock server CPU':>16}"
        )
        print(
            f"   {'':<24} {'':>15} {'':>18} {'ms/task':>14} {'us/task':>12} {'per task':>14}"
            f" {'us/task':>16}"
        )
        for kind in kinds:
            if kind.label in broken:
                print(f"   {kind.label:<24} {broken[kind.label]}")
                continue
            mine = batches[(kind.label, mode)]
            ratio = Spread.of([mine[i].rate / base[i].rate for i in range(n)])
            ratios[(kind.label, mode)] = ratio
            cpu = [b.cpu_ms for b in mine if b.cpu_ms is not None]
            commands = mine[-1].commands
            print(
                f"   {kind.label:<24} {Spread.of([b.rate for b in mine]).show(0):>15}"
                f" {ratio.show(2):>18} {Spread.of(cpu).show(2) if cpu else 'n/a':>14}"
                f" {Spread.of([b.enqueue_us for b in mine]).show(0):>12}"
                f" {commands.total:14.2f}"
                f" {Spread.of([b.lock_server_us for b in mine]).show(0):>16}"
            )
        engine = ratios.get(("SingletonTask", mode))
        peers = [ratios[(label, mode)].median for label in PEERS if (label, mode) in ratios]
        if engine is not None and peers and not mode.paused:
            # Not a target: the targets are on the worker's own rate.
            findings.add(2, f"SingletonTask/plain throughput, {what}, {pool} pool", engine.show(3))
            print(
                f"   SingletonTask / plain, {what}, {pool}: {engine.show(3)}"
                f" (no target; the best peer's: {max(peers):.3f})"
            )
        elif engine is not None and peers:
            print(
                f"   SingletonTask / plain, {what}, {pool}: {engine.show(3)}: "
                + judge_ratio(findings, f"{what}, {pool} pool", engine, max(peers), mode.work)
            )
        for floor_label, floor_name in FLOORS.items():
            if engine is not None and (floor_label, mode) in ratios:
                gap = ratios[(floor_label, mode)].median - engine.median
                findings.add(2, f"SingletonTask below {floor_name}, {what}, {pool} pool",
                             f"{gap:.3f}")  # fmt: skip
        for kind in kinds:
            if kind.label not in ("plain task", "SingletonTask") and (kind.label, mode) in ratios:
                findings.add(2, f"{kind.label}/plain throughput, {what}, {pool} pool",
                             ratios[(kind.label, mode)].show(2))  # fmt: skip
    for label, why in broken.items():
        findings.add(2, f"{label}, {pool} pool", why)
    stats.close()
    return ratios


def judge_ratio(findings: Findings, where: str, engine: Spread, best: float, work: float) -> str:
    """Add SingletonTask's ratio to a plain task (``where``: how it was measured)
    as a finding against its target: every peer's (``best``: the highest), and
    :data:`WORK_TARGET` too when tasks do ``work``. Returns the verdict."""
    target = f">= every peer's ({best:.3f})" + (f" and >= {WORK_TARGET}" if work else "")
    bar = max(best, WORK_TARGET) if work else best
    return findings.add(
        2, f"SingletonTask/plain throughput, {where}", engine.show(3), target, engine.median >= bar
    )


def print_ratio_table(ratios: dict[str, dict[tuple[str, Mode], Spread]], modes: list[Mode]) -> None:
    """The ratio of each kind to a plain task, per pool and mode: median (min-max over rounds)."""
    print("\n2. Throughput ratio to a plain task, median (min-max over rounds), per pool:")
    columns = [(pool, mode) for pool in ratios for mode in modes]
    labels = [f"{pool}, {mode.column}" for pool, mode in columns]
    width = max(22, *map(len, labels))
    print(f"   {'kind':<24}" + "".join(f" {label:>{width}}" for label in labels))
    for kind in task_kinds():
        cells = "".join(
            f" {ratios[pool][(kind.label, mode)].show(2) if (kind.label, mode) in ratios[pool] else 'n/a':>{width}}"
            for pool, mode in columns
        )
        print(f"   {kind.label:<24}{cells}")


# 5. Interleaved.
def pin_apart(urls: list[str]) -> set[int]:
    """For ``--pin``: keep the servers at ``urls`` (and this process) off one CPU,
    left to the worker, as a lock store on another machine would be: a request
    the worker writes then never wakes its server on the worker's own CPU, where
    it would take the CPU from the worker until it answers. Returns the worker's
    CPUs.

    Raises:
        SystemExit: fewer than two CPUs, or a server this process cannot pin
            (not on this machine, or not its own).
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin needs at least two CPUs")
    worker, others = {cpus[0]}, set(cpus[1:])
    for url in set(urls):
        with redis.Redis.from_url(url) as server:
            pid = int(server.info("server")["process_id"])
        try:
            os.sched_setaffinity(pid, others)
        except OSError as exc:
            raise SystemExit(f"--pin: cannot pin the server at {url} (pid {pid}): {exc}") from None
    os.sched_setaffinity(0, others)
    return worker


def pinned_where(cpus: set[int] | None) -> str:
    """Where section 5's worker runs, with ``--pin`` (``cpus``: its own), for a heading."""
    if cpus is None:
        return ""
    return f" on CPU {min(cpus)}, the servers and the producer on the others"


def marked_rounds(
    kinds: list[Kind],
    worker: subprocess.Popen[bytes],
    stats: redis.Redis,
    count: int,
    rounds: int,
    work: float,
) -> Iterator[list[tuple[float, str, str]]]:
    """Section 5's rounds: each a batch of ``count`` tasks of ``kinds`` taking
    turns (which comes first rotating), each task sleeping ``work`` seconds, the
    worker marking its clock meanwhile (see :func:`starts`). Yields the marks of
    each of ``rounds`` rounds, after one more that warms up."""
    for r in range(rounds + 1):
        starts.apply_async(("start",)).get(timeout=30)
        order = rotated(kinds, r)
        round_id = uuid.uuid4().hex
        calls = [(order[i % len(order)].task, (round_id, i, work)) for i in range(count)]
        run_batch(calls, worker, stats, 60 + count * (0.05 + work))
        marks = starts.apply_async(("stop",)).get(timeout=30)
        if r:
            yield marks


def bench_interleaved(
    url: str,
    lock_url: str,
    count: int,
    rounds: int,
    findings: Findings,
    work: float = 0.0,
    cpus: set[int] | None = None,
) -> None:
    """Section 5: the kinds taking turns within each batch, timed by the worker;
    each task sleeps ``work`` seconds. ``cpus``: the worker's own, with ``--pin``
    (see :func:`pin_apart`)."""
    tasks = "no-op tasks" if not work else f"tasks of {work * 1e3:g} ms"
    # How the findings name it: the no-op run kept its name from before there were two.
    what = ("interleaved" if not work else f"interleaved {work * 1e3:g} ms") + (
        "" if cpus is None else " pinned"
    )
    where = pinned_where(cpus)
    print(
        f"\n5. Interleaved: the kinds taking turns in batches of {count} {tasks}, "
        f"solo pool{where}, {rounds} rounds (after one to warm up)"
    )
    stats = redis.Redis.from_url(lock_url)
    with worker_process(url, lock_url, "solo", 1, cpus) as worker:
        broken = warm_up(interleaved_kinds(), worker, stats)
        kinds = [kind for kind in interleaved_kinds() if kind.label not in broken]
        labels = {kind.task.name: kind.label for kind in kinds}
        # Per kind: the median time per task in each round, and its ratio to plain's.
        took: dict[str, list[float]] = {kind.label: [] for kind in kinds}
        ratios: dict[str, list[float]] = {kind.label: [] for kind in kinds}
        # Per kind and part of a task (SEGMENTS), the median in each round.
        parted: dict[str, dict[str, list[float]]] = {}
        # The lock store's time in the timed rounds: {command: [calls, microseconds]}.
        served: dict[str, list[float]] = {}
        for marks in marked_rounds(kinds, worker, stats, count, rounds, work):
            for name, parts in segments(marks).items():
                if name in labels:
                    kept = parted.setdefault(labels[name], {})
                    for part, times in parts.items():
                        # A time's median, in us; a count's mean (mostly 0, 1 or 2).
                        kept.setdefault(part, []).append(
                            statistics.fmean(times)
                            if part in COUNTS
                            else statistics.median(times) * 1e6
                        )
            for command, (ran, usec) in command_stats(stats).items():
                total = served.setdefault(command, [0, 0.0])
                total[0] += ran
                total[1] += usec
            spans: dict[str, list[float]] = {}
            began = [(when, name) for when, event, name in marks if event == RECEIVED]
            for (start, name), (following, _) in itertools.pairwise(began):
                if name in labels:
                    spans.setdefault(labels[name], []).append(following - start)
            base = statistics.median(spans["plain task"])
            for label, times in spans.items():
                took[label].append(statistics.median(times) * 1e6)
                ratios[label].append(base / statistics.median(times))
    stats.close()
    plain_us = statistics.median(took["plain task"])
    print(f"   {'kind':<30} {'us per task':>22} {'above plain':>12} {'ratio to plain':>18}")
    for kind in kinds:
        mine = Spread.of(took[kind.label])
        print(
            f"   {kind.label:<30} {mine.show(0):>22} {mine.median - plain_us:12.0f}"
            f" {Spread.of(ratios[kind.label]).show(3):>18}"
        )
    for label, why in broken.items():
        print(f"   {label:<30} {why}")
        findings.add(2, f"{label}, {what}", why)
    print_segments(parted, [kind.label for kind in kinds], findings, what)
    print_served(served, findings, what)
    engine = Spread.of(ratios["SingletonTask"])
    peers = [statistics.median(ratios[label]) for label in PEERS if label in ratios]
    if peers:
        print(
            f"   SingletonTask / plain, interleaved {tasks}, solo: {engine.show(3)}: "
            + judge_ratio(findings, f"{what}, solo pool", engine, max(peers), work)
        )
    for kind in kinds:
        if kind.label not in ("plain task", "SingletonTask"):
            findings.add(2, f"{kind.label}/plain throughput, {what}, solo pool",
                         Spread.of(ratios[kind.label]).show(3))  # fmt: skip


def handed_kinds() -> list[Kind]:
    """The kinds of section 5's prefork run: plain, ``SingletonTask`` (its acquire
    written as the pool process is handed the task), the same taking its lock as
    it starts, an ``until_executed`` ``acks_late`` one (written as it is handed
    the task too), and the one-round-trip floor."""
    kinds = {kind.label: kind for kind in interleaved_kinds()}
    kinds[UNTIL_LATE_LABEL] = Kind(UNTIL_LATE_LABEL, singleton_until_late, "reserved as sent")
    return [
        kinds[label]
        for label in (
            "plain task", "SingletonTask", "SingletonTask, at start", UNTIL_LATE_LABEL,
            FLOOR_LABEL,
        )
    ]  # fmt: skip


#: The one-round-trip floor's label in the tables.
FLOOR_LABEL = "one round trip (floor)"


def bench_handed(
    url: str, lock_url: str, count: int, rounds: int, findings: Findings, cpus: set[int] | None
) -> None:
    """Section 5, prefork: a pool process's time from being handed a no-op task to
    its body, per kind taking turns in each batch. ``cpus``: the worker's own,
    with ``--pin``."""
    pinned = "" if cpus is None else " pinned"
    print(
        f"\n5. Prefork pool, 1 process{pinned_where(cpus)}: from being handed a no-op task to its body,"
        f" the kinds taking turns in batches of {count}, {rounds} rounds (after one to warm up)"
    )
    stats = redis.Redis.from_url(lock_url)
    with worker_process(url, lock_url, "prefork", 1, cpus) as worker:
        broken = warm_up(handed_kinds(), worker, stats)
        kinds = [kind for kind in handed_kinds() if kind.label not in broken]
        labels = {kind.task.name: kind.label for kind in kinds}
        # Per kind, the median time from handed to body in each round.
        took: dict[str, list[float]] = {kind.label: [] for kind in kinds}
        for marks in marked_rounds(kinds, worker, stats, count, rounds, 0.0):
            spans: dict[str, list[float]] = {}
            handed: tuple[float, str] | None = None
            for when, event, name in marks:
                if event == HANDED:
                    handed = (when, name)
                elif event == BODY and handed is not None:
                    if handed[1] in labels:
                        spans.setdefault(labels[handed[1]], []).append(when - handed[0])
                    handed = None
            for label, times in spans.items():
                took[label].append(statistics.median(times) * 1e6)
    stats.close()
    plain_us = statistics.median(took["plain task"])
    print(f"   {'kind':<30} {'us handed to body':>22} {'above plain':>12}")
    for kind in kinds:
        mine = Spread.of(took[kind.label])
        print(f"   {kind.label:<30} {mine.show(0):>22} {mine.median - plain_us:12.0f}")
        findings.add(2, f"{kind.label} us handed to body, prefork{pinned}", mine.show(0))
    for label, why in broken.items():
        print(f"   {label:<30} {why}")


def print_segments(
    parted: dict[str, dict[str, list[float]]], labels: list[str], findings: Findings, what: str
) -> None:
    """Section 5's table of where each kind's time per task goes on the worker,
    and, where the system counts them, how often per task the worker's thread was
    off its CPU (see :data:`COUNTS`); SingletonTask's parts, and every kind's
    counts, go to the findings too."""
    counted = [count for count in COUNTS if count in parted.get("plain task", {})]
    print(
        "   where the time per task goes on the worker (median us over the rounds): received"
        " (task_received) to started (task_prerun), to its body's work, the work, to ended"
        " (task_postrun), to the next task's receipt"
        + (
            "; then how often per task (the mean in a round; the median over the rounds) the"
            " worker's thread that runs them gave up its CPU to wait (slept: for an answer,"
            " in the body), had it taken by another task (preempted: where the servers share"
            " the worker's CPUs, often one a request the worker wrote had just woken), and"
            " the two together (off CPU: each time, the task waits to run again, unless what"
            " it would have waited for comes in meanwhile)"
            if counted
            else ""
        )
    )
    print(
        f"   {'kind':<30}"
        + "".join(f" {part:>16}" for part in SEGMENTS)
        + "".join(f" {count:>9}" for count in counted)
    )
    for label in labels:
        if label in parted:
            cells = (statistics.median(parted[label][part]) for part in SEGMENTS)
            counts = [statistics.median(parted[label][count]) for count in counted]
            print(
                f"   {label:<30}"
                + "".join(f" {cell:16,.0f}" for cell in cells)
                + "".join(f" {count:9.2f}" for count in counts)
            )
            for count, value in zip(counted, counts, strict=True):
                findings.add(2, f"{label} {count} per task, {what}", f"{value:.2f}")
    for part in SEGMENTS:
        times = parted.get("SingletonTask", {}).get(part)
        if times:
            findings.add(2, f"SingletonTask us {part}, {what}", f"{statistics.median(times):.0f}")


#: The lock store's commands section 5 reports the time of, and who sends them.
SERVED = {
    "evalsha": "SingletonTask's acquire and release, redis-py Lock's release",
    "fcall": "the owner-checked floor's acquire and release",
    "set": "the floors', celery-once's, celery-singleton's and redis-py Lock's acquire",
    "del": "the floors', celery-once's and celery-singleton's release",
}


def print_served(served: dict[str, list[float]], findings: Findings, what: str) -> None:
    """Section 5's lock-store figures: the server's time per command (``INFO
    commandstats``), on a server whose caches the rest of the machine keeps cold;
    ``what`` names the run in the findings."""
    print("   lock store, time per command over these rounds (INFO commandstats):")
    for command, who in SERVED.items():
        if command in served:
            calls, usec = served[command]
            print(f"   {command.upper():>8} {usec / calls:6.1f} us  ({int(calls)} calls; {who})")
            findings.add(2, f"lock store us per {command.upper()}, {what}",
                         f"{usec / calls:.1f}")  # fmt: skip


# 3. Contention.
def bench_contention(url: str, lock_url: str, rounds: int, findings: Findings) -> None:
    """Section 3: 50 purchases of one event on 4 worker processes, waiting for the lock."""
    ideal = PURCHASES * CRITICAL
    kinds: list[tuple[str, Any, str]] = [
        ("no lock", purchase_plain, ""),
        ("SingletonTask, on_conflict=wait", purchase_singleton, ""),
        ("SingletonTask, on_conflict=retry", purchase_retry, ""),
        ("SingletonTask, on_conflict=skip", purchase_skip, ""),
        ("python-redis-lock in task", purchase_prl, REDIS_LOCK_MISSING),
        ("redis-py Lock in task", purchase_redis_py, ""),
        ("celery-once (cannot wait)", purchase_once, ONCE_MISSING),
        ("celery-singleton (cannot wait)", purchase_csingleton, SINGLETON_MISSING),
    ]
    print(
        f"\n3. Contention: {PURCHASES} purchases of one event, {CRITICAL * 1e3:g} ms critical"
        f" section each, prefork pool of {CONTENDERS} processes; ideal makespan"
        f" {ideal * 1e3:.0f} ms; {rounds} round(s), kinds interleaved"
    )
    stats = redis.Redis.from_url(lock_url)
    live = [kind for kind in kinds if kind[1] is not None]
    measured: dict[str, list[tuple[float, float, float, int, CommandCount, int]]] = {}
    with worker_process(url, lock_url, "prefork", CONTENDERS) as worker:
        plain.apply_async(("warm-up", 0)).get(timeout=60)
        for _label, task, _ in live:  # every process: connections, scripts, subscriptions
            event = f"warm-{uuid.uuid4().hex}"
            run_batch([(task, (event, i, 0.0)) for i in range(CONTENDERS * 3)], worker, stats, 60)
        for r in range(rounds):
            for label, task, _ in rotated(live, r):
                event = f"event-{uuid.uuid4().hex[:8]}"
                calls = [(task, (event, i, CRITICAL)) for i in range(PURCHASES)]
                batch = run_batch(calls, worker, stats, 180)
                # A purchase that ran returns its critical section; a dropped one
                # returns something else (SingletonTask's skip marker) or nothing.
                spans = sorted(
                    (float(r[0]), float(r[1]))
                    for r in batch.results
                    if isinstance(r, list | tuple) and len(r) == 2
                )
                overlaps = sum(1 for p, n in itertools.pairwise(spans) if n[0] < p[1])
                gaps = sorted(n[0] - p[1] for p, n in itertools.pairwise(spans)) or [0.0]
                makespan = PURCHASES / batch.rate
                measured.setdefault(label, []).append(
                    (
                        makespan,
                        spans[-1][1] - spans[0][0],
                        gaps[len(gaps) // 2],
                        overlaps,
                        batch.commands,
                        len(spans),
                    )
                )
    print(
        f"   {'kind':<32} {'ran':>6} {'makespan ms':>18} {'x ideal':>16} {'first->last ms':>16}"
        f" {'gap ms':>13} {'overlaps':>8}   lock commands per purchase"
    )
    for label, _task, missing in kinds:
        if label not in measured:
            print(f"   {label:<32} left out: {missing}")
            continue
        rows = measured[label]
        span = Spread.of([row[0] * 1e3 for row in rows])
        factor = Spread.of([row[0] / ideal for row in rows])
        commands = rows[-1][4]
        ran = min(row[5] for row in rows)
        print(
            f"   {label:<32} {f'{ran}/{PURCHASES}':>6} {span.show(0):>18} {factor.show(2):>16}"
            f" {Spread.of([row[1] * 1e3 for row in rows]).show(0):>16}"
            f" {Spread.of([row[2] * 1e3 for row in rows]).show(2):>13}"
            f" {sum(row[3] for row in rows):8d}   {commands.total:.2f}"
            f" ({commands.scripts:.2f} EVALSHA; {commands.breakdown()})"
        )
        findings.add(3, f"{label}: purchases that ran (fewest in a round)", f"{ran}/{PURCHASES}")
        findings.add(3, f"{label}: makespan / ideal", factor.show(2))
        findings.add(3, f"{label}: overlapping critical sections", str(sum(r[3] for r in rows)))
        findings.add(3, f"{label}: lock commands per purchase", f"{commands.total:.2f}")
    print(
        "   ran: purchases whose critical section ran (the others were dropped as duplicates);"
        " makespan: from the workers' resumption to the last result; first->last: first"
        " critical section's start to the last one's end; gap: median time between one"
        " purchase's end and the next one's start; overlaps: critical sections that began"
        " before the previous one ended (a lock that excludes has none)"
    )
    stats.close()


# 4. Client instructions per task.
#: How many eager tasks the two counted runs of a kind make: the difference of
#: their counts, over the difference of these, is one task's (start-up, imports
#: and the warm-up cancel out).
INSTRUCTION_RUNS = (50, 350)


def run_counted(kind_index: int, count: int) -> None:
    """The counted process of section 4: ``count`` eager tasks of one kind, and 20
    more that warm it up, against the servers the environment names."""
    app.conf.task_always_eager = True
    task = task_kinds()[kind_index].task
    # Arguments of this process's own: the two counted runs of a kind run at
    # once, and must not find each other's locks.
    round_id = uuid.uuid4().hex
    for i in range(count + 20):
        task.apply_async((round_id, i, 0.0)).get()


def count_instructions(kind_index: int, count: int, url: str, lock_url: str) -> int:
    """Instructions a whole :func:`run_counted` process runs, counted by valgrind."""
    command = [
        "valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
        sys.executable, str(Path(__file__).resolve()),
        "--count-kind", str(kind_index), "--tasks", str(count),
    ]  # fmt: skip
    environment = {**os.environ, URL_ENV: url, LOCK_URL_ENV: lock_url, "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    counted = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or counted is None:
        raise RuntimeError(f"valgrind run failed ({done.returncode}): {done.stderr[-500:]}")
    return int(counted.group(1))


@app.task(name="bench.stop_worker", shared=False)
def stop_worker() -> None:
    """End the worker that runs it at once (a counted worker's last task)."""
    os._exit(0)


#: How many tasks the two counted workers of a kind run (see :data:`INSTRUCTION_RUNS`).
WORKER_INSTRUCTION_RUNS = (40, 240)


class WorkerCount(NamedTuple):
    """Instructions of one counted worker: all its threads', and its main thread's."""

    every_thread: int
    main_thread: int


def count_worker_instructions(kind_index: int, count: int, url: str, lock_url: str) -> WorkerCount:
    """Instructions of a solo ``celery worker`` under valgrind that drains ``count``
    tasks of one kind, queued before it starts, then :func:`stop_worker`: of all its
    threads, and of its main thread (which runs the tasks) alone.

    The main thread's is the steadier figure: valgrind makes a task last well over
    the heartbeat thread's :data:`~celery_redislock.heartbeat.DRAIN_DELAY` (50 ms),
    so that thread wakes about once per task there, where in a worker running at
    full speed it wakes once per fifty tasks or so; its count per task is inflated
    accordingly, and moves with the machine's load."""
    kind = task_kinds()[kind_index]
    # A queue of its own: the two counted workers of a kind run at once.
    queue = f"{QUEUE}-counted-{uuid.uuid4().hex[:8]}"
    round_id = uuid.uuid4().hex
    for i in range(count):
        kind.task.apply_async((round_id, i, 0.0), queue=queue)
    stop_worker.apply_async(queue=queue)
    with tempfile.TemporaryDirectory() as out:
        command = [
            "valgrind", "--tool=callgrind", "--separate-threads=yes",
            f"--callgrind-out-file={out}/callgrind.out",
            sys.executable, "-m", "celery", "--app", "bench_task:app", "--quiet", "worker",
            "--pool", "solo", "--loglevel", "WARNING", "--without-mingle", "--without-gossip",
            "--without-heartbeat", "--queues", queue, "--hostname", f"counted-{round_id[:8]}@%h",
        ]  # fmt: skip
        environment = {
            **os.environ, URL_ENV: url, LOCK_URL_ENV: lock_url, "PYTHONWARNINGS": "ignore",
            "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p),
        }  # fmt: skip
        done = subprocess.run(
            command, cwd=HERE, env=environment, capture_output=True, text=True, timeout=900
        )
        counted = re.search(r"Collected : (\d+)", done.stderr)
        main = Path(out, "callgrind.out-01")
        main_total = (
            re.search(r"^totals: (\d+)$", main.read_text(), re.MULTILINE) if main.exists() else None
        )
        if counted is None or main_total is None:
            raise RuntimeError(
                f"valgrind worker run failed ({done.returncode}): {done.stderr[-500:]}"
            )
        return WorkerCount(int(counted.group(1)), int(main_total.group(1)))


def bench_worker_instructions(url: str, lock_url: str, findings: Findings) -> None:
    """Section 4, in a worker: the client instructions a solo worker spends per
    task of each kind (valgrind), the producer left out."""
    low, high = WORKER_INSTRUCTION_RUNS
    print(
        f"   In a solo worker: each kind's tasks queued ({low}, then {high}), then a worker"
        " started under valgrind drains them and stops; the difference per task. The"
        " worker's side only: celery-once and celery-singleton take their locks in"
        " apply_async, which the eager counts above include and these do not. All threads,"
        " and the main thread alone (which runs the tasks; under valgrind the heartbeat"
        " thread wakes about once per task, in a worker at full speed once per fifty or so)"
    )
    print(
        f"   {'kind':<30} {'all threads':>12} {'above plain':>12} {'main thread':>12}"
        f" {'above plain':>12}"
    )
    counts: dict[str, WorkerCount] = {}
    for index, kind in enumerate(task_kinds()):
        if kind.task is None:
            continue
        with ThreadPoolExecutor(2) as both:
            runs = [
                both.submit(count_worker_instructions, index, n, url, lock_url) for n in (low, high)
            ]
            few, many = (run.result() for run in runs)
        per_task = counts[kind.label] = WorkerCount(
            *((b - a) // (high - low) for a, b in zip(few, many, strict=True))
        )
        plain_count = counts.get("plain task", per_task)
        print(
            f"   {kind.label:<30} {per_task.every_thread / 1e3:11,.0f}k"
            f" {(per_task.every_thread - plain_count.every_thread) / 1e3:+11,.0f}k"
            f" {per_task.main_thread / 1e3:11,.0f}k"
            f" {(per_task.main_thread - plain_count.main_thread) / 1e3:+11,.0f}k"
        )
    plain = counts.get("plain task")
    if plain is None:
        return
    for label in ("SingletonTask", *PEERS, *FLOORS):
        if label in counts:
            findings.add(
                7,
                f"{label}: client instructions per task in a solo worker above a plain task"
                " (all threads / main thread)",
                f"{(counts[label].every_thread - plain.every_thread) / 1e3:,.0f}k /"
                f" {(counts[label].main_thread - plain.main_thread) / 1e3:,.0f}k",
            )


def bench_instructions(url: str, lock_url: str, findings: Findings) -> None:
    """Section 4: the client's instructions per eager task of each kind (valgrind)."""
    low, high = INSTRUCTION_RUNS
    print(
        "\n4. Client instructions per task: each kind run eagerly (producer and task in one"
        f" process) under valgrind --tool=callgrind, {low} and {high} tasks; the difference"
        " per task. A count, not a timing: it moves by a few percent at most from run to"
        " run, whatever else the machine does"
    )
    if shutil.which("valgrind") is None:
        print("   skipped: valgrind is not installed (Debian's valgrind package)")
        return
    print(f"   {'kind':<30} {'instructions':>12} {'above plain':>12}")
    counts: dict[str, float] = {}
    for index, kind in enumerate(task_kinds()):
        if kind.task is None:
            print(f"   {kind.label:<30} left out: {kind.missing}")
            continue
        with ThreadPoolExecutor(2) as both:
            runs = [both.submit(count_instructions, index, n, url, lock_url) for n in (low, high)]
            few, many = (run.result() for run in runs)
        counts[kind.label] = per_task = (many - few) / (high - low)
        above = per_task - counts.get("plain task", per_task)
        print(f"   {kind.label:<30} {per_task / 1e3:11,.0f}k {above / 1e3:+11,.0f}k")
    plain_count = counts.get("plain task")
    mine = counts.get("SingletonTask")
    if plain_count is None or mine is None:
        return
    print(
        f"   SingletonTask: {(mine - plain_count) / 1e3:,.0f}k instructions per task above a"
        " plain task"
        + findings.add(
            7,
            "SingletonTask: client instructions per eager task above a plain task",
            f"{(mine - plain_count) / 1e3:,.0f}k",
        )
    )
    for label in (*PEERS, *FLOORS):
        if label in counts:
            extra = counts[label] - plain_count
            print(f"   {label}: {extra / 1e3:,.0f}k above a plain task")
            findings.add(
                7, f"{label}: client instructions per eager task above a plain task",
                f"{extra / 1e3:,.0f}k",
            )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Run the selected sections and print their figures."""
    parser = argparse.ArgumentParser(
        description="SingletonTask in real workers, beside a plain task and the peer libraries."
    )
    parser.add_argument("--url", help="Redis URL to use (default: start private servers)")
    parser.add_argument("--quick", action="store_true", help="a short run (about 25 s)")
    parser.add_argument("--only", help="comma-separated sections to run, e.g. 2,5")
    parser.add_argument("--tasks", type=int, help="no-op tasks per batch (default 200)")
    parser.add_argument("--rounds", type=int, help="rounds of section 2 (default 5)")
    parser.add_argument(
        "--work-ms", default="0,5",
        help="comma-separated milliseconds each task sleeps, standing for real work (default 0,5)",
    )  # fmt: skip
    parser.add_argument("--pools", default="solo,prefork", help="pools of section 2")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="section 5: the worker on a CPU of its own, the servers and producer on the others",
    )
    parser.add_argument(
        "--profile", action="store_true", help="section 1: also profile SingletonTask executions"
    )
    parser.add_argument("--json", help="write the findings against the targets to this file")
    parser.add_argument("--count-kind", type=int, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    if options.count_kind is not None:
        run_counted(options.count_kind, options.tasks or 0)
        return 0
    count = options.tasks or (100 if options.quick else 200)
    rounds = options.rounds or (3 if options.quick else 5)
    if count < 1 or rounds < 1:
        parser.error("--tasks and --rounds must be at least 1")
    works = [float(w) / 1e3 for w in options.work_ms.split(",")]
    if 0.0 not in works:
        works.insert(0, 0.0)
    # The worker's drain rate for each work, and no-op tasks end to end.
    modes = [Mode(work) for work in works] + [Mode(0.0, paused=False)]
    pools = options.pools.split(",")
    sections = {int(s) for s in options.only.split(",")} if options.only else {1, 2, 3, 4, 5}
    findings = Findings()
    started = time.monotonic()
    with servers(options.url, 2) as (url, lock_url):
        for line in describe_machine(url):
            print(line)
        where = "one shared server" if options.url else "a private server"
        print(f"broker + results: {where} at {url}; locks: {lock_url}")
        configure(app, url, lock_url)
        if 1 in sections:
            bench_cost_per_task(lock_url, 200 if options.quick else 500, findings, options.profile)
        if 2 in sections:
            ratios = {
                pool: bench_throughput(
                    url, lock_url, pool, 1 if pool == "solo" else 2, count, rounds, modes, findings
                )
                for pool in pools
            }
            print_ratio_table(ratios, modes)
        if 3 in sections:
            if not options.url and sections & {1, 2}:
                # Else the earlier sections' keys would be expiring by the
                # thousand while it runs, the server's expiry cycle slowing
                # every handoff.
                with redis.Redis.from_url(lock_url) as lock_server:
                    lock_server.flushdb()
            bench_contention(url, lock_url, 1 if options.quick else 3, findings)
        if 4 in sections and not options.quick:
            bench_instructions(url, lock_url, findings)
            if shutil.which("valgrind") is not None:
                bench_worker_instructions(url, lock_url, findings)
        if 5 in sections:
            cpus = pin_apart([url, lock_url]) if options.pin else None
            for work in works:
                # Fewer tasks of real work: a batch of them takes longer.
                tasks = count * (3 if work else 6)
                bench_interleaved(url, lock_url, tasks, rounds, findings, work, cpus)
            bench_handed(url, lock_url, count * 3, rounds, findings, cpus)
        # The results still in reference cycles, collected while their backend is up:
        # Celery before 5.7 reconnects to it as each is collected, retrying for
        # minutes once the server has stopped.
        gc.collect()
    print(f"\nbench_task: {time.monotonic() - started:.0f} s")
    findings.save(options.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
