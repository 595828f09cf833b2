"""Run the seckill batch: start or find workers, fan the clicks out, wait, report.

Importing this module imports the Celery app, which reads ``REDIS_URL`` then:
set the environment first (``example_worker.__main__`` does).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from celery import states

from example_worker import interrupt, inventory, tasks
from example_worker.app import DEFAULT_QUEUE, app
from example_worker.report import Click, RunResult, build_report

#: Seconds each worker gets to start and answer a ping.
WORKER_START_TIMEOUT = 60.0

#: Seconds workers get to shut down after SIGTERM before they are killed.
WORKER_STOP_GRACE = 10.0

#: With ``--enqueue-only`` and no ``--workers`` count: seconds to keep listening
#: for more workers after the first one answered.
DISCOVERY_SETTLE = 2.0


class RunError(Exception):
    """The run could not go on; the message says why."""


@dataclass
class Options:
    """What to run."""

    tickets: int = 10
    buyers: int = 50
    #: Workers to start (local run) or to wait for (``--enqueue-only``; 0: any).
    workers: int = 4
    #: Every n-th buyer clicks twice (0: nobody).
    double_click_every: int = 5
    locked: bool = True
    #: Seconds to wait for the whole batch.
    timeout: float = 120.0
    think: float = tasks.THINK_SECONDS
    #: The queue workers consume when idle (each batch gets its own queue).
    queue: str = DEFAULT_QUEUE
    json_path: str | None = None


def say(message: str) -> None:
    """A status line on stderr (the report goes to stdout)."""
    print(f"[seckill] {message}", file=sys.stderr, flush=True)


def buyer_ids(buyers: int) -> list[str]:
    """``buyer-01``, ``buyer-02``, ..."""
    width = max(2, len(str(buyers)))
    return [f"buyer-{i:0{width}d}" for i in range(1, buyers + 1)]


def click_plan(buyers: int, double_click_every: int) -> list[str]:
    """The buyer of each click, in order; every n-th buyer clicks twice in a row."""
    plan: list[str] = []
    for number, user in enumerate(buyer_ids(buyers), start=1):
        plan.append(user)
        if double_click_every and number % double_click_every == 0:
            plan.append(user)
    return plan


class Progress:
    """A one-line counter on stderr: rewritten in place on a terminal, else every second."""

    def __init__(self, total: int, stream: IO[str] | None = None) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = time.monotonic()
        self._last_print = 0.0
        self._last_text = ""

    def update(self, done: int, sold: int, force: bool = False) -> None:
        """Show ``done`` of ``total`` answered."""
        now = time.monotonic()
        text = (
            f"[seckill] {done}/{self.total} clicks answered, {sold} sold, "
            f"{now - self.started:.1f} s"
        )
        if self.tty:
            self.stream.write("\r" + text.ljust(len(self._last_text)))
            self.stream.flush()
        elif force or (text != self._last_text and now - self._last_print >= 1.0):
            self.stream.write(text + "\n")
            self.stream.flush()
            self._last_print = now
        self._last_text = text

    def done(self, done: int, sold: int) -> None:
        """Show the final count and end the line."""
        if self.tty:
            self.update(done, sold)
            self.stream.write("\n")
            self.stream.flush()
        else:
            self.update(done, sold, force=True)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: have the worker get SIGTERM if this process dies without stopping it."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class LocalWorkers:
    """N ``celery worker`` processes on this machine, each like a separate server."""

    def __init__(self, count: int, run_id: str, queue: str) -> None:
        self.names = [f"worker{i}@seckill-{run_id}" for i in range(1, count + 1)]
        self.queue = queue
        self.processes: list[subprocess.Popen[bytes]] = []
        self._logs: list[IO[bytes]] = []
        self._log_dir = Path(tempfile.mkdtemp(prefix="seckill-workers-"))

    def command(self, name: str) -> list[str]:
        """The command line of one worker: the same entry the compose file runs."""
        return [
            sys.executable,
            "-m",
            "example_worker",
            "--worker",
            "--name",
            name,
            "--queue",
            self.queue,
            "--loglevel",
            "WARNING",
        ]

    def start(self) -> None:
        """Start every worker (they answer pings once ready: see :meth:`wait_ready`)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for name in self.names:
            log = open(self._log_dir / f"{name.split('@')[0]}.log", "wb")  # noqa: SIM115
            self._logs.append(log)
            process = subprocess.Popen(
                self.command(name),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches us; we stop them in order
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
            self.processes.append(process)
            say(f"started worker {name} (pid {process.pid})")

    def log_tail(self, index: int, lines: int = 20) -> str:
        """The last lines a worker printed."""
        path = self._log_dir / f"{self.names[index].split('@')[0]}.log"
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        """Raise :class:`RunError` if a worker has exited."""
        for index, process in enumerate(self.processes):
            code = process.poll()
            if code is not None:
                raise RunError(
                    f"worker {self.names[index]} exited with code {code}; its last output:\n"
                    + self.log_tail(index)
                )

    def wait_ready(self, timeout: float = WORKER_START_TIMEOUT) -> None:
        """Wait until every worker answers a ping."""
        deadline = time.monotonic() + timeout
        missing = set(self.names)
        while missing:
            interrupt.check()
            self.check_alive()
            if time.monotonic() > deadline:
                raise RunError(
                    f"worker(s) {', '.join(sorted(missing))} did not answer within {timeout:.0f} s"
                )
            replies = app.control.ping(destination=sorted(missing), timeout=0.5, limit=len(missing))
            for reply in replies or []:
                missing -= set(reply)
        say(f"{len(self.names)} worker(s) ready")

    def stop(self, grace: float = WORKER_STOP_GRACE) -> None:
        """SIGTERM every worker, SIGKILL those still running after ``grace`` seconds."""
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        try:
            for name, process in zip(self.names, self.processes, strict=False):
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    say(f"worker {name} did not stop in {grace:.0f} s: killing it")
                    process.kill()
                    process.wait()
        except KeyboardInterrupt:
            say("interrupted again: killing the workers")
            for process in self.processes:
                if process.poll() is None:
                    process.kill()
                process.wait()
            raise
        finally:
            for log in self._logs:
                log.close()
            shutil.rmtree(self._log_dir, ignore_errors=True)
        if self.processes:
            say(f"stopped {len(self.processes)} worker(s)")
        self.processes = []
        self._logs = []


def discover_workers(want: int, timeout: float) -> list[str]:
    """Workers already running (``--enqueue-only``): wait for ``want`` of them, or
    (``want`` = 0) for whoever answers within a short settle time after the first."""
    deadline = time.monotonic() + timeout
    seen: set[str] = set()
    first_seen: float | None = None
    say("waiting for workers to answer a ping ...")
    while True:
        interrupt.check()
        replies = app.control.ping(timeout=0.5)
        for reply in replies or []:
            seen |= set(reply)
        now = time.monotonic()
        if seen and first_seen is None:
            first_seen = now
        if want and len(seen) >= want:
            break
        if not want and first_seen is not None and now - first_seen >= DISCOVERY_SETTLE:
            break
        if now > deadline:
            if not seen:
                raise RunError(
                    f"no worker answered within {timeout:.0f} s: start some with "
                    "`python -m example_worker --worker` (same REDIS_URL)"
                )
            say(f"only {len(seen)} of {want} worker(s) answered; going on with them")
            break
    names = sorted(seen)
    say(f"{len(names)} worker(s): {', '.join(names)}")
    return names


def consumers_of(queue: str, names: list[str], timeout: float = 5.0) -> list[str]:
    """Those of the workers ``names`` that consume ``queue``."""
    replies = app.control.inspect(destination=names, timeout=timeout, limit=len(names))
    queues = replies.active_queues() or {}
    return sorted(
        name
        for name, consumed in queues.items()
        if any(isinstance(q, dict) and q.get("name") == queue for q in consumed or [])
    )


def submit(opts: Options, event_id: str, queue: str) -> list[Click]:
    """Send every click of the batch to ``queue``."""
    task = tasks.place_order if opts.locked else tasks.purchase_unlocked
    clicks: list[Click] = []
    for user in click_plan(opts.buyers, opts.double_click_every):
        result = task.apply_async(args=(event_id, user), kwargs={"think": opts.think}, queue=queue)
        clicks.append(Click(user=user, task_id=str(result.id)))
    return clicks


def _error_text(result: Any) -> str:
    error = result.result
    if isinstance(error, BaseException):
        return f"{result.state} {type(error).__name__}: {error}"
    return f"{result.state} {error!r}"


def collect(
    clicks: list[Click],
    timeout: float,
    progress: Progress,
    check: Callable[[], None] | None = None,
) -> tuple[dict[str, dict[str, Any]], dict[str, str], list[str]]:
    """Wait for every distinct task of the batch; return (outcomes, failures, unfinished)."""
    pending = list(dict.fromkeys(click.task_id for click in clicks))
    outcomes: dict[str, dict[str, Any]] = {}
    failures: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    total = len(pending)
    results = {task_id: app.AsyncResult(task_id) for task_id in pending}
    while True:
        interrupt.check()
        if check is not None:
            check()
        still: list[str] = []
        for task_id in pending:
            result = results[task_id]
            state = result.state
            if state == states.SUCCESS:
                value = result.result
                outcomes[task_id] = value if isinstance(value, dict) else {"outcome": repr(value)}
            elif state in states.READY_STATES:
                failures[task_id] = _error_text(result)
            else:
                still.append(task_id)
        pending = still
        sold = sum(1 for o in outcomes.values() if o.get("outcome") == "sold")
        if not pending:
            progress.done(total, sold)
            return outcomes, failures, []
        if time.monotonic() > deadline:
            progress.done(total - len(pending), sold)
            return outcomes, failures, pending
        progress.update(total - len(pending), sold)
        time.sleep(0.1)


def run_batch(opts: Options, start_workers: bool) -> int:
    """Run one batch and print its report; return the exit code.

    ``start_workers``: start ``opts.workers`` local worker processes on a queue
    of their own (stopped at the end, also on Ctrl-C); otherwise use the workers
    already running that consume ``opts.queue``.

    The clicks are all queued before the sale opens: a worker that receives one
    holds it until the opening, so every worker starts buying at the same
    instant, and a double click always finds the first click still pending.
    """
    run_id = secrets.token_hex(3)
    event_id = f"event-{run_id}"
    queue = f"{opts.queue}.{run_id}" if start_workers else opts.queue
    client = tasks.inventory_client()
    client.ping()
    workers: LocalWorkers | None = None
    finished_ok = False
    say(
        f"{opts.buyers} buyers, {opts.tickets} tickets, "
        f"{'with' if opts.locked else 'WITHOUT'} the lock; event {event_id}"
    )
    try:
        if start_workers:
            workers = LocalWorkers(opts.workers, run_id, queue)
            workers.start()
            workers.wait_ready()
            names = workers.names
        else:
            running = discover_workers(opts.workers, WORKER_START_TIMEOUT)
            names = consumers_of(queue, running)
            if not names:
                raise RunError(f"none of the running workers consumes the queue {queue!r}")

        inventory.open_event(client, event_id, opts.tickets, gated=True)
        clicks = submit(opts, event_id, queue)
        say(f"{len(clicks)} clicks queued for {len(names)} worker(s); opening the sale")
        opens_at = inventory.open_sale(client, event_id)
        waited_from = time.monotonic()
        outcomes, failures, unfinished = collect(
            clicks,
            opts.timeout,
            Progress(len({c.task_id for c in clicks})),
            workers.check_alive if workers is not None else None,
        )
        # From the opening to the last purchase's end (all clocks on one host or NTP).
        finished = [float(o["finished_at"]) for o in outcomes.values() if "finished_at" in o]
        makespan = max(finished) - opens_at if finished and not unfinished else -1.0
        if makespan < 0:
            makespan = time.monotonic() - waited_from
        fencing = None
        if opts.locked:
            fencing = inventory.stale_holder_demo(
                client,
                f"{event_id}-fencing",
                tasks.purchase.lock_name((f"{event_id}-fencing", "buyer-A"), {}),
                prefix=tasks.purchase.lock_prefix,
            )
        result = RunResult(
            locked=opts.locked,
            event_id=event_id,
            tickets=opts.tickets,
            clicks=clicks,
            outcomes=outcomes,
            failures=failures,
            unfinished=unfinished,
            state=inventory.read_event(client, event_id),
            makespan=makespan,
            workers=names,
            fencing=fencing,
        )
        report = build_report(result)
        print(report.to_text(), flush=True)
        if opts.json_path:
            Path(opts.json_path).write_text(report.to_json() + "\n")
        finished_ok = not unfinished
        return report.exit_code
    finally:
        with contextlib.suppress(Exception):
            if not finished_ok:
                # Clicks still queued or waiting for the opening end without buying.
                inventory.cancel_sale(client, event_id)
            inventory.close_event(client, event_id)
        if workers is not None:
            workers.stop()


def default_worker_name() -> str:
    """``worker-<pid>@<host>``: unique per process here and per container in compose."""
    return f"worker-{os.getpid()}@{socket.gethostname()}"


def run_worker(queue: str = DEFAULT_QUEUE, name: str | None = None, loglevel: str = "INFO") -> int:
    """Run one ``celery worker`` in the foreground until it is stopped (SIGTERM/Ctrl-C)."""
    argv = [
        "worker",
        "--pool=solo",
        f"--queues={queue}",
        f"--hostname={name or default_worker_name()}",
        f"--loglevel={loglevel}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
    ]
    code = app.start(argv)
    return int(code or 0)
