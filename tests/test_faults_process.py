"""Process faults: holders frozen with SIGSTOP past their TTL, and a soak under injected faults.

Everything runs in real processes against a private server: a lock holder
started with ``python -m tests.fault_children``, prefork ``celery worker``
processes on ``tests.fault_app``, and soak workers some of which reach Redis
through a :class:`~tests.proxy.FaultProxy` whose connections the test resets
and whose replies it loses at random. The children write their histories to
Redis; the tests check them afterwards. The last test pins a retried release
that the engine does not yet recognise (expected to fail until it is fixed).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis

from celery_redislock import RedisLock
from celery_redislock.ids import request_id
from celery_redislock.scripts import OWNER_FIELD, QUEUED_FIELD
from celery_redislock.server import RedisServer
from tests.fault_children import SOAK_HOLDS, SOAK_STATS, SOAK_STOP, fence_log, fenced_write
from tests.proxy import FaultProxy
from tests.support import (
    acquire_in_thread,
    answers_ping,
    close_app,
    field,
    held,
    lock_keys,
    queue_entries,
    tail,
    wait_for,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

Process = subprocess.Popen[bytes]


#: The caller's own PYTHONPATH, which a child keeps after the root: it imports what
#: the tests do.
_PATH = [path for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path]


def spawn(args: list[str], log: Path, **env: str) -> Process:
    """Start ``args`` from the repository root in a session of its own, output to ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(
            args,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *_PATH]), **env),
            start_new_session=True,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def signal_group(process: Process, signum: int) -> None:
    """Send ``signum`` to every process of ``process``'s session (ignored once it is gone)."""
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def end(process: Process) -> None:
    """Continue, then SIGKILL, a child and its descendants if still running; reap it."""
    if process.poll() is None:
        signal_group(process, signal.SIGCONT)
        signal_group(process, signal.SIGKILL)
    process.wait(10)


def exit_code(process: Process, timeout: float) -> int | None:
    """The child's exit status, or ``None`` if it is still running after ``timeout`` seconds."""
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        return None


def entries(client: redis.Redis, key: str) -> list[dict[str, Any]]:
    """The JSON records in list ``key``."""
    return [json.loads(raw) for raw in client.lrange(key, 0, -1)]


# 1. A plain holder process frozen past its TTL.


def process_state(pid: int) -> str:
    """The one-letter state of a process (``T``: stopped), from ``/proc``."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


@pytest.mark.parametrize("freeze", ["by-parent", "after-check"])
def test_holder_stopped_past_ttl_sees_lost_and_cannot_release(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path, freeze: str
) -> None:
    """A holder frozen past its TTL (anywhere, or between its check and its write) sees `lost` before writing again or is refused by the fence; its release raises LockLostError and deletes nothing."""
    server = redislock_server_factory()
    client = server.client()
    log = tmp_path / "holder.log"
    args = ["holder", server.url, "paused", "res", "report", "--ttl", "1.0"]
    if freeze == "after-check":
        args.append("--freeze-after-check")  # it stops itself between the check and a write
    child = spawn([sys.executable, "-m", "tests.fault_children", *args], log)
    parent = RedisLock(client, "paused", ttl=10)
    try:
        wait_for(
            lambda: (
                child.poll() is not None
                or any(e["event"] == "renewed" for e in entries(client, "report"))
            ),
            timeout=30,
            what="the holder to keep its lock past one TTL",
        )
        assert child.poll() is None, tail(log)
        (acquired,) = [e for e in entries(client, "report") if e["event"] == "acquired"]

        if freeze == "after-check":
            wait_for(lambda: process_state(child.pid) == "T", what="the holder to stop itself")
        else:
            os.kill(child.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        assert parent.acquire(timeout=10), "the stopped holder's lock never expired"
        assert parent.token is not None
        assert parent.token > acquired["token"]
        assert fenced_write(client, "res", parent.token, "parent", parent.key)
        time.sleep(max(0.0, stopped_at + 2.5 - time.monotonic()))  # the fault: frozen 2.5 s
        assert not [e for e in entries(client, "report") if e["event"] == "outcome"]
        os.kill(child.pid, signal.SIGCONT)

        assert exit_code(child, 30) == 0, tail(log)
        reports = {e["event"]: e for e in entries(client, "report")}
        outcome, released = reports["outcome"], reports["released"]
        writes = fence_log(client, "res")
        first_parent = next(i for i, w in enumerate(writes) if w["writer"] == "parent")
        late = [w for w in writes[first_parent:] if w["writer"] == "child"]
        seen = f"outcome {outcome}, release {released}, writes after the takeover {late}"
        # Resumed: either it checked `lost` first, or the write it was about to
        # make when frozen was refused by the fence; nothing else got through.
        expected = {"lost-before-write", "write-rejected"}
        if freeze == "after-check":
            expected = {"write-rejected"}
        assert outcome["outcome"] in expected, seen
        assert outcome["lost"] is True, seen
        assert len(late) == (1 if outcome["outcome"] == "write-rejected" else 0), seen
        assert not any(w["accepted"] for w in late), seen
        assert any(w["accepted"] for w in writes[:first_parent]), writes
        assert all(w["current"] for w in writes if w["accepted"]), writes
        assert released["result"] == "LockLostError", seen
        assert field(client, parent.key, OWNER_FIELD) == parent.owner
        assert parent.owned()
        assert not parent.lost
    finally:
        end(child)
        if parent.holding:
            parent.release()
        parent.transport.reset()
    assert lock_keys(client) == []
    client.close()


# 2. A prefork worker child frozen past lock_ttl while another worker takes the key.


class Worker:
    """A prefork ``celery worker`` (concurrency 1) on ``tests.fault_app`` consuming one queue."""

    def __init__(self, url: str, queue: str, log: Path) -> None:
        self.name = f"{queue}-{uuid.uuid4().hex[:6]}@localhost"
        self.log = log
        self.process = spawn(
            [sys.executable, "-m", "celery", "-A", "tests.fault_app", "worker", "-P", "prefork",
             "-c", "1", "-Q", queue, "-n", self.name, "-l", "warning", "--without-gossip",
             "--without-mingle", "--without-heartbeat"],
            log,
            REDISLOCK_FAULT_URL=url,
        )  # fmt: skip

    def wait_ready(self, app: Any) -> None:
        """Block until the worker answers a ping."""
        wait_for(
            lambda: self.process.poll() is not None or answers_ping(app, self.name),
            timeout=60,
            what=f"worker {self.name} to start",
        )
        assert self.process.poll() is None, tail(self.log)

    def stop(self) -> None:
        """End the worker and its children at once (the test's cleanup: how it stops is
        not what the test looks at, and a warm shutdown would take seconds)."""
        end(self.process)


@pytest.fixture
def fault_app(
    redislock_server_factory: Callable[..., RedisServer], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[ModuleType, RedisServer]]:
    """``tests.fault_app`` imported fresh against a private server."""
    server = redislock_server_factory()
    monkeypatch.setenv("REDISLOCK_FAULT_URL", server.url)
    sys.modules.pop("tests.fault_app", None)
    module = importlib.import_module("tests.fault_app")
    yield module, server
    close_app(module.app)
    module.store.close()
    sys.modules.pop("tests.fault_app", None)


def test_prefork_child_stopped_past_lock_ttl(
    fault_app: tuple[ModuleType, RedisServer], tmp_path: Path
) -> None:
    """A prefork child frozen past lock_ttl is overtaken by another worker, then sees its lock lost before writing again."""
    mod, server = fault_app
    client = server.client()
    workers = [Worker(server.url, q, tmp_path / f"{q}.log") for q in ("faults-a", "faults-b")]
    frozen: int | None = None
    try:
        for worker in workers:
            worker.wait_ready(mod.app)
        result_a = mod.fenced.apply_async(("k", "A", 20.0), queue="faults-a")
        wait_for(
            lambda: entries(client, "log:renewed"), timeout=30, what="task A to outlive its TTL"
        )
        (start_a,) = entries(client, "log:start")
        os.kill(start_a["pid"], signal.SIGSTOP)
        frozen, stopped_at = start_a["pid"], time.monotonic()

        result_b = mod.fenced.apply_async(("k", "B", 0.3), queue="faults-b")
        assert result_b.get(timeout=30) == "done", tail(workers[1].log)
        time.sleep(max(0.0, stopped_at + 3.0 - time.monotonic()))  # the fault: frozen 3 s
        assert [e["label"] for e in entries(client, "log:end")] == ["B"]  # B ran while A was frozen
        os.kill(frozen, signal.SIGCONT)
        frozen = None

        outcome = result_a.get(timeout=30)
        starts = {e["label"]: e for e in entries(client, "log:start")}
        ends = {e["label"]: e for e in entries(client, "log:end")}
        writes = fence_log(client, mod.RESOURCE)
        first_b = next(i for i, w in enumerate(writes) if w["writer"] == "B")
        late = [w for w in writes[first_b:] if w["writer"] == "A"]
        seen = f"A ended with {ends['A']}, A's writes after B's first {late}"
        assert starts["B"]["token"] > starts["A"]["token"]
        assert starts["B"]["pid"] != starts["A"]["pid"]
        assert outcome == ends["A"]["outcome"]
        assert outcome in {"lost-before-write", "write-rejected"}, seen
        assert ends["A"]["lost"] is True, seen
        assert ends["A"]["check_raised"] is True, seen
        assert len(late) == (1 if outcome == "write-rejected" else 0), seen
        assert not any(w["accepted"] for w in late), seen
        assert any(w["accepted"] for w in writes[:first_b] if w["writer"] == "A"), writes
        assert all(w["current"] for w in writes if w["accepted"]), writes
        assert ends["B"] == {
            "label": "B", "outcome": "done", "lost": False, "check_raised": False
        }  # fmt: skip
        assert lock_keys(client) == []
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        for worker in workers:
            worker.stop()
        client.close()


# 3. A bounded soak with connection resets and frozen workers.

SOAK_PROCESSES = 4  # the first half reach Redis through the fault proxy
SOAK_THREADS = 2
SOAK_TTL = 0.8
SOAK_MIN_HOLDS = 2000
SOAK_LIMIT = 60.0
#: Faults to inject at least, whatever the pace of the holds.
SOAK_MIN_RESETS = 20
SOAK_MIN_LONG_STOPS = 3


def inject_faults(
    client: redis.Redis, proxy: FaultProxy, workers: list[Process], rng: random.Random
) -> Counter[str]:
    """Reset the proxy's connections, lose replies, and freeze one worker at a time,
    until enough holds and faults happened, a worker exited, or :data:`SOAK_LIMIT`
    seconds passed."""
    faults: Counter[str] = Counter()
    frozen: tuple[Process, float] | None = None
    started = time.monotonic()
    next_reset = started + rng.uniform(0.05, 0.3)
    next_stop = started + rng.uniform(0.2, 0.5)
    try:
        while time.monotonic() - started < SOAK_LIMIT:
            now = time.monotonic()
            if any(worker.poll() is not None for worker in workers):
                faults["worker_exited"] += 1
                break
            enough = (
                client.llen(SOAK_HOLDS) >= SOAK_MIN_HOLDS
                and faults["resets"] >= SOAK_MIN_RESETS
                and faults["long_stops"] >= SOAK_MIN_LONG_STOPS
            )
            if enough and frozen is None:
                break
            if now >= next_reset:
                if rng.random() < 0.25:
                    # The next reply is lost after its command ran: a retry must
                    # be recognised by the scripts.
                    proxy.drop_replies(1)
                    faults["dropped_replies"] += 1
                else:
                    proxy.reset_all()
                    faults["resets"] += 1
                next_reset = now + rng.uniform(0.05, 0.3)
            if frozen is None and now >= next_stop:
                victim = rng.choice(workers)
                long = rng.random() < 0.5
                # A long freeze outlasts the TTL: the victim's holds must be flagged lost.
                pause = rng.uniform(1.0, 1.6) if long else rng.uniform(0.05, 0.5)
                os.kill(victim.pid, signal.SIGSTOP)
                frozen = (victim, now + pause)
                faults["long_stops" if long else "short_stops"] += 1
            elif frozen is not None and now >= frozen[1]:
                os.kill(frozen[0].pid, signal.SIGCONT)
                frozen = None
                next_stop = now + rng.uniform(0.1, 0.5)
            time.sleep(0.005)  # the scheduler's tick
    finally:
        if frozen is not None:
            os.kill(frozen[0].pid, signal.SIGCONT)
    faults["seconds"] = round(time.monotonic() - started)
    return faults


def history_problems(holds: list[list[Any]]) -> list[str]:
    """Overlapping holds and out-of-order tokens, per name, among holds not flagged lost."""
    problems: list[str] = []
    by_name: dict[str, list[list[Any]]] = defaultdict(list)
    tokens: dict[str, Counter[int]] = defaultdict(Counter)
    for hold in holds:
        name, token, _start, _end, lost, _label = hold
        tokens[name][token] += 1
        if not lost:
            by_name[name].append(hold)
    for name, counted in tokens.items():
        problems += [f"{name}: token {t} handed out {n} times" for t, n in counted.items() if n > 1]
    for name, sequence in by_name.items():
        sequence.sort(key=lambda hold: hold[2])
        for before, after in pairwise(sequence):
            if after[2] < before[3]:
                problems.append(f"{name}: {after} started before {before} ended")
            if after[1] <= before[1]:
                problems.append(f"{name}: token of {after} not above that of {before}")
    return problems


def test_soak_with_resets_and_frozen_workers(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """Under connection resets and SIGSTOPs past the TTL, 2,000+ holds on 4 names never overlap unless flagged lost, and tokens increase."""
    server = redislock_server_factory()
    client = server.client()
    seed = random.randrange(2**32)
    logs = [tmp_path / f"soak{i}.log" for i in range(SOAK_PROCESSES)]
    workers: list[Process] = []
    with FaultProxy(server.host, server.port) as proxy:
        try:
            for i, log in enumerate(logs):
                via_proxy = i < SOAK_PROCESSES // 2
                label = f"{'proxied' if via_proxy else 'direct'}-{i}"
                lock_url = proxy.url if via_proxy else server.url
                args = ["soak", lock_url, server.url, label, "--ttl", str(SOAK_TTL)]
                args += ["--threads", str(SOAK_THREADS)]
                workers.append(spawn([sys.executable, "-m", "tests.fault_children", *args], log))
            faults = inject_faults(client, proxy, workers, random.Random(seed))
            proxy.heal()
            client.set(SOAK_STOP, "1")
            codes = [exit_code(worker, 30) for worker in workers]
        finally:
            for worker in workers:
                end(worker)

    holds = [json.loads(raw) for raw in client.lrange(SOAK_HOLDS, 0, -1)]
    stats = entries(client, SOAK_STATS)
    counters: Counter[str] = Counter()
    for entry in stats:
        counters.update({k: v for k, v in entry.items() if isinstance(v, int)})
    per_label = Counter(hold[5] for hold in holds)
    summary = (
        f"seed {seed}: {len(holds)} holds ({sum(1 for h in holds if h[4])} flagged lost), "
        f"per worker {dict(per_label)}; faults {dict(faults)}; worker counters "
        f"{dict(counters)} (LockBackendErrors: {counters['acquire_errors']} on acquire, "
        f"{counters['release_errors']} on release)"
    )
    outputs = "\n".join(f"--- {log.name}\n{tail(log)}" for log in logs)
    assert codes == [0] * SOAK_PROCESSES, f"exit codes {codes}; {summary}\n{outputs}"
    assert all(not entry["crashes"] for entry in stats), stats
    assert len(holds) >= SOAK_MIN_HOLDS, (
        f"only {len(holds)} holds completed within {SOAK_LIMIT:.0f} s (at least "
        f"{SOAK_MIN_HOLDS} expected): the workers spent too long waiting or failing; {summary}"
    )
    assert all(per_label[f"proxied-{i}"] > 0 for i in range(SOAK_PROCESSES // 2)), summary
    problems = history_problems(holds)
    assert not problems, f"{len(problems)} problems, first: {problems[:5]}; {summary}"

    # A release that failed during a reset is retried in the background, or the
    # TTL frees the lock: every key left behind expires within one TTL.
    left = {key: client.pttl(key) for key in lock_keys(client)}
    assert all(ttl == -2 or 0 < ttl <= SOAK_TTL * 1000 for ttl in left.values()), left
    wait_for(lambda: not lock_keys(client), timeout=SOAK_TTL + 5, what="leftover locks to expire")
    client.close()


# 4. A release whose reply was lost, retried after the lock changed hands.


def test_release_retried_after_another_owner_freed_the_lock(
    redislock_server_factory: Callable[..., RedisServer],
) -> None:
    """A release whose reply was lost reports success even if another owner took and freed the lock before the retry."""
    server = redislock_server_factory()
    direct = server.client()
    errors: list[BaseException] = []
    with FaultProxy(server.host, server.port) as proxy:
        proxied = redis.Redis.from_url(proxy.url)
        holder = RedisLock(proxied, "retried", ttl=30, call_timeout=10)
        assert holder.acquire(timeout=5)
        holder.release()  # the server now caches the scripts: a release runs on first arrival
        assert holder.acquire(timeout=5)

        def release() -> None:
            try:
                holder.release()
            except BaseException as exc:
                errors.append(exc)

        # The release lands, its reply is lost; the retry crawls through the latency.
        proxy.set_latency(0.5)
        proxy.drop_replies(1)
        thread = threading.Thread(target=release)
        thread.start()
        try:
            wait_for(lambda: not held(direct, holder.key), what="the first release to land")
            other = RedisLock(direct, "retried", ttl=30)
            assert other.acquire(blocking=False)
            other.release()
            assert thread.is_alive(), "the retry came back before the other owner was done"
        finally:
            thread.join(20)
            proxy.heal()
            holder.transport.reset()
            proxied.close()
    assert lock_keys(direct) == []
    direct.close()
    if errors:
        raise errors[0]


# 5. A waiting process killed or frozen while a release hands it the lock.


def queued_waiter(
    client: redis.Redis, server: RedisServer, tmp_path: Path, holder: RedisLock, threads: int = 1
) -> Process:
    """A child process queued behind ``holder`` (see ``fault_children.waiter``), with
    ``threads`` waiters."""
    child = spawn(
        [sys.executable, "-m", "tests.fault_children", "waiter", server.url, holder.name, "res",
         "report", "--threads", str(threads)],
        tmp_path / "waiter.log",
    )  # fmt: skip
    wait_for(
        lambda: child.poll() is not None or client.zcard(holder.queue_key) == threads,
        timeout=30,
        what="the child to queue",
    )
    assert child.poll() is None, tail(tmp_path / "waiter.log")
    return child


def live_waiter_behind(
    client: redis.Redis, holder: RedisLock, ahead: int = 1
) -> tuple[RedisLock, list[bool], threading.Thread]:
    """A waiter of this process queued for ``holder``'s lock behind ``ahead`` others, in
    a thread: its lock, where its outcome lands, and the thread."""
    live = RedisLock(client, holder.name, ttl=60)
    got, thread = acquire_in_thread(live, 30)
    wait_for(lambda: client.zcard(holder.queue_key) == ahead + 1, what="the live waiter to queue")
    return live, got, thread


def test_waiters_of_a_killed_process_are_passed_over_by_the_next_release(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """A process with three threads waiting for a lock is SIGKILLed while they are queued
    first. The server drops the process's wake-up subscription with its connection, so
    the release passes its waiters over: it takes them out of the queue and hands the
    lock at once to the live waiter behind them, rather than to each dead one in turn
    for its grant."""
    server = redislock_server_factory()
    client = server.client()
    holder = RedisLock(client, "handed-killed", ttl=60)
    assert holder.acquire()
    child = queued_waiter(client, server, tmp_path, holder, threads=3)
    try:
        (process,) = {
            json.loads(m)[0].split(".")[0] for m, _ in queue_entries(client, holder.queue_key)
        }
        channel = f"{holder.wake_prefix}{process}"
        assert client.pubsub_numsub(channel) == [(channel.encode(), 1)]
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
        wait_for(lambda: client.pubsub_numsub(channel) == [(channel.encode(), 0)])
        live, got, thread = live_waiter_behind(client, holder, ahead=3)
        holder.release()
        assert field(client, holder.key, OWNER_FIELD) == live.owner
        assert client.zcard(holder.queue_key) == 0
        thread.join(40)
        assert got == [True]
        assert holder.token is not None
        assert live.token is not None
        assert live.token > holder.token
        assert fenced_write(client, "res", live.token, "parent", live.key)
        live.release()
    finally:
        end(child)
    assert lock_keys(client) == []
    client.close()


def test_waiter_frozen_while_handed_the_lock_takes_its_turn_after_the_next(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """A waiting process is SIGSTOPped while queued first, and the release hands it the
    lock: frozen, it keeps its wake-up subscription, and the release, which checks it,
    cannot tell it from a live waiter. The waiter behind it takes the lock once the
    grant has run out. Resumed, the frozen one reads its wake-up too late to trust the
    handed hold: it asks, finds the lock held, queues again, and gets it only after the
    other's release. No two holds overlap: every write the fence accepts is from the
    lock's current holder."""
    server = redislock_server_factory()
    client = server.client()
    holder = RedisLock(client, "handed-frozen", ttl=60)
    assert holder.acquire()
    child = queued_waiter(client, server, tmp_path, holder)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        live, got, thread = live_waiter_behind(client, holder)
        assert queue_entries(client, holder.queue_key)[0][0].endswith(b",1]")  # checked
        holder.release()
        (waiting,) = [e for e in entries(client, "report") if e["event"] == "waiting"]
        assert field(client, holder.key, OWNER_FIELD) == waiting["owner"]
        thread.join(40)
        assert got == [True]
        assert fenced_write(client, "res", live.token, "parent", live.key)
        os.kill(child.pid, signal.SIGCONT)
        # Resumed, it asks again and queues behind the live holder.
        wait_for(lambda: client.zcard(holder.queue_key) == 1, what="the resumed child to queue")
        assert not [e for e in entries(client, "report") if e["event"] == "acquired"]
        assert live.owned()
        assert fenced_write(client, "res", live.token, "parent", live.key)
        live.release()
        assert exit_code(child, 30) == 0, tail(tmp_path / "waiter.log")
        reports = {e["event"]: e for e in entries(client, "report")}
        assert live.token is not None
        assert reports["acquired"]["token"] > live.token
        assert reports["wrote"]["accepted"] is True
        writes = fence_log(client, "res")
        assert [w["writer"] for w in writes] == ["parent", "parent", "child"]
        assert all(w["accepted"] and w["current"] for w in writes), writes
    finally:
        end(child)
    assert lock_keys(client) == []
    client.close()


def test_an_undone_acquire_takes_nothing_after_a_release_woke_a_frozen_waiter(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """A waiting process is SIGSTOPped while queued first for a name that lists an
    undone acquire (its caller gave up on it, unanswered; it may still be on its
    way). Frozen, it keeps its wake-up subscription, and the release cannot tell it
    from a live waiter; but it does not hand it the lock (a grant it never confirms
    would run out and take the list along): it keeps the free lock for it a moment
    and wakes it to ask. The live waiter behind it takes the lock once that moment
    has passed, and the list stays: the undone acquire, arriving after that hold,
    takes nothing. Resumed, the frozen one asks and takes the lock. Every write the
    fence accepts is from the lock's current holder."""
    server = redislock_server_factory()
    client = server.client()
    holder = RedisLock(client, "undone-frozen", ttl=60)
    late = RedisLock(client, holder.name, ttl=30)
    request = request_id()
    late._run(late._undo_call(request), late._call_deadline(None))
    assert holder.acquire()
    child = queued_waiter(client, server, tmp_path, holder)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        live, got, thread = live_waiter_behind(client, holder)
        holder.release()
        thread.join(40)
        assert got == [True]
        assert fenced_write(client, "res", live.token, "parent", live.key)
        live.release()

        late._run(late._acquire_call(request), late._call_deadline(None))

        assert field(client, holder.key, OWNER_FIELD) is None
        assert not [e for e in entries(client, "report") if e["event"] == "acquired"]
        os.kill(child.pid, signal.SIGCONT)
        assert exit_code(child, 30) == 0, tail(tmp_path / "waiter.log")
        writes = fence_log(client, "res")
        assert [w["writer"] for w in writes] == ["parent", "child"]
        assert all(w["accepted"] and w["current"] for w in writes), writes
    finally:
        end(child)
    assert lock_keys(client) == []
    client.close()


def test_an_expired_lock_goes_to_the_first_asker_and_the_waiter_queues_behind_it(
    redislock_server_factory: Callable[..., RedisServer], tmp_path: Path
) -> None:
    """A lock that expires is handed to nobody: the first request the server sees after
    the expiry takes it, though a waiter (a process, SIGSTOPped here as the TTL runs
    out) was queued first and the caller does not wait. Resumed, the waiter asks,
    finds the lock held, queues again, and gets it at the new holder's release."""
    server = redislock_server_factory()
    client = server.client()
    # Held for a minute while the child starts (which may take over a second on a busy
    # machine), then cut to one second once the child is queued and stopped.
    holder = RedisLock(client, "expired-first-asker", ttl=60, heartbeat=False)
    assert holder.acquire()
    child = queued_waiter(client, server, tmp_path, holder)
    try:
        os.kill(child.pid, signal.SIGSTOP)
        holder.extend(1)
        wait_for(lambda: not held(client, holder.key), what="the holder's TTL to run out")
        newcomer = RedisLock(client, holder.name, ttl=60)
        assert newcomer.acquire(blocking=False)
        assert client.zcard(holder.queue_key) == 1  # the stopped waiter's entry stays
        assert field(client, holder.key, QUEUED_FIELD) is None  # taken as a free lock
        os.kill(child.pid, signal.SIGCONT)
        wait_for(
            lambda: (
                any(e["event"] == "acquired" for e in entries(client, "report"))
                or field(client, holder.key, QUEUED_FIELD) == "1"
            ),
            what="the resumed waiter to ask again",
        )
        assert not [e for e in entries(client, "report") if e["event"] == "acquired"]
        assert newcomer.owned()
        assert fenced_write(client, "res", newcomer.token, "parent", newcomer.key)
        newcomer.release()
        assert exit_code(child, 30) == 0, tail(tmp_path / "waiter.log")
        reports = {e["event"]: e for e in entries(client, "report")}
        assert newcomer.token is not None
        assert reports["acquired"]["token"] > newcomer.token
        assert reports["wrote"]["accepted"] is True
    finally:
        end(child)
    assert lock_keys(client) == []
    client.close()
