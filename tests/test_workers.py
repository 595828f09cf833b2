"""SingletonTask with real ``celery worker`` subprocesses (prefork): contention and faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import redis
from billiard.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded, WorkerLostError
from celery.exceptions import TaskRevokedError

from celery_redislock import is_skipped
from celery_redislock.dropped import ALL_COPIES, DROPPED_WORD_TTL, dropped_key, read_word
from celery_redislock.lock import lock_keys as lock_keys_for
from celery_redislock.scripts import FENCE_FIELD, LEASE_FIELD, OWNER_FIELD
from celery_redislock.server import RedisServer
from tests.proxy import FaultProxy
from tests.support import (
    CELERY_5_7,
    answers_ping,
    close_app,
    field,
    held,
    lock_keys,
    wait_for,
    waiter_queues,
)

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

#: Tests of what the package does when Celery sends a task again as a retry because
#: its pool process died (``retry_on_worker_lost``, new in Celery 5.7).
needs_retry_on_worker_lost = pytest.mark.skipif(
    not CELERY_5_7, reason="Celery before 5.7 has no retry_on_worker_lost"
)


class Worker:
    """A ``celery worker`` subprocess on the test app."""

    def __init__(
        self,
        url: str,
        name: str,
        concurrency: int = 2,
        pool: str = "prefork",
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.name = f"{name}-{uuid.uuid4().hex[:6]}@localhost"
        # This checkout's package and tests, whatever is installed.
        path = os.pathsep.join([str(ROOT / "src"), str(ROOT)])
        env = dict(os.environ, REDISLOCK_TEST_URL=url, PYTHONPATH=path, **(extra_env or {}))
        self.process = subprocess.Popen(
            [
                sys.executable, "-m", "celery", "-A", "tests.worker_app", "worker",
                "-P", pool, "-c", str(concurrency), "-n", self.name, "-l", "warning",
                "--without-gossip", "--without-mingle", "--without-heartbeat",
            ],
            cwd=ROOT,
            env=env,
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def wait_ready(self, app: Any) -> Worker:
        """Block until the worker answers a ping."""
        wait_for(
            lambda: self.process.poll() is None and answers_ping(app, self.name),
            timeout=60,
            what=f"worker {self.name} to start",
        )
        return self

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's main process only."""
        self.process.send_signal(signum)

    def kill_all(self) -> None:
        """SIGKILL the worker and its pool children, like a machine dying (also the
        test's cleanup: its server is thrown away with it, and a warm shutdown would
        take seconds; ``test_warm_shutdown_finishes_and_releases`` tests that one)."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # the worker and all its children have exited already
        self.process.wait(10)


@pytest.fixture
def env(
    redislock_server_factory: Callable[..., RedisServer],
) -> Iterator[tuple[Any, redis.Redis, Callable[..., Worker]]]:
    """A private server, the test app bound to it, and a worker launcher."""
    server = redislock_server_factory()
    os.environ["REDISLOCK_TEST_URL"] = server.url
    sys.modules.pop("tests.worker_app", None)
    import tests.worker_app as worker_app

    started: list[Worker] = []

    def launch(name: str = "w", concurrency: int = 2, pool: str = "prefork", **env: str) -> Worker:
        worker = Worker(server.url, name, concurrency, pool, env)
        # Killed as the test ends even if it never answers.
        started.append(worker)
        return worker.wait_ready(worker_app.app)

    client = server.client()
    yield worker_app, client, launch
    for worker in started:
        worker.kill_all()
    close_app(worker_app.app)
    sys.modules.pop("tests.worker_app", None)
    os.environ.pop("REDISLOCK_TEST_URL", None)


def records(client: redis.Redis, kind: str) -> list[dict[str, Any]]:
    """The JSON records the tasks logged under ``kind``."""
    return [json.loads(raw) for raw in client.lrange(f"log:{kind}", 0, -1)]


def test_contention_history(env: tuple[Any, redis.Redis, Callable[..., Worker]]) -> None:
    """60 same-key tasks on 4 worker processes: executions never overlap, tokens increase."""
    mod, client, launch = env
    launch("a", concurrency=2)
    launch("b", concurrency=2)
    results = [mod.critical.delay("seckill", n) for n in range(60)]
    assert sorted(r.get(timeout=120) for r in results) == list(range(60))
    history = sorted(records(client, "critical"), key=lambda r: r["start"])
    assert len(history) == 60
    assert int(client.get("counter:seckill") or 0) == 60
    assert len({r["pid"] for r in history}) >= 2
    for before, after in pairwise(history):
        assert after["start"] >= before["end"], "two executions overlapped"
        assert after["token"] > before["token"]
    assert lock_keys(client) == []
    assert waiter_queues(client) == []


def test_a_soft_time_limit_that_fires_while_a_task_waits_ends_its_wait(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A prefork task waiting its turn (``on_conflict="wait"``) whose soft time
    limit fires meanwhile fails with ``SoftTimeLimitExceeded``: its body never
    runs, and it leaves the queue, nothing left behind once the holder ends."""
    mod, client, launch = env
    launch("soft", concurrency=2)
    holder = mod.sleeper.delay("soft", 6)  # long past the waiter's start and its limit
    wait_for(lambda: records(client, "sleeper"), what="the holder to start")
    waiter = mod.sleeper.apply_async(("soft", 0), soft_time_limit=1)
    with pytest.raises(SoftTimeLimitExceeded):
        waiter.get(timeout=30)
    assert holder.get(timeout=30) == "soft"
    assert [r["id"] for r in records(client, "sleeper")] == [holder.id]
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")
    wait_for(lambda: waiter_queues(client) == [], what="the queue to be empty")


def test_prefork_child_reads_its_last_release_before_it_exits(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A pool child that exits right after its task (``worker_max_tasks_per_child``)
    reads the answer of the release it wrote without waiting before it goes:
    ``lock_released`` is sent from it."""
    mod, client, launch = env
    launch("exit", concurrency=1, REDISLOCK_TEST_MAX_TASKS_PER_CHILD="1")
    result = mod.queued_once.delay("child-exit")
    result.get(timeout=60)
    wait_for(lambda: records(client, "released"), what="lock_released from the child")
    [released] = records(client, "released")
    assert (released["task_id"], released["outcome"]) == (result.id, "released")
    assert lock_keys(client) == []


def test_killed_worker_lock_expires(env: tuple[Any, redis.Redis, Callable[..., Worker]]) -> None:
    """SIGKILL mid-task: the heartbeat dies with the process and the TTL frees the lock."""
    mod, client, launch = env
    doomed = launch("doomed", concurrency=1)
    mod.sleeper.delay("k", 60)
    wait_for(lambda: records(client, "sleeper"), what="the task to start")
    key = f"redislock:{{{mod.sleeper.lock_name(('k', 60), {})}}}"
    assert held(client, key)
    doomed.kill_all()
    wait_for(lambda: not held(client, key), timeout=10, what="the TTL to free the lock")
    launch("next", concurrency=1)
    assert mod.sleeper.delay("k", 0.1).get(timeout=30) == "k"  # same key, new holder


def test_heartbeat_keeps_long_task_locked(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A task running for several TTLs keeps its lock the whole time (prefork child heartbeat)."""
    mod, client, launch = env
    launch("hb", concurrency=1)
    result = mod.sleeper.delay("long", 6)  # lock_ttl is 2 s
    wait_for(lambda: records(client, "sleeper"), what="the task to start")
    key = f"redislock:{{{mod.sleeper.lock_name(('long', 6), {})}}}"
    # Two TTLs, ending long before the task does, however late the start was seen.
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        assert held(client, key), "the lock expired while its task was running"
        time.sleep(0.1)
    assert result.get(timeout=30) == "long"
    assert not held(client, key)


def test_acks_late_redelivery_runs(env: tuple[Any, redis.Redis, Callable[..., Worker]]) -> None:
    """An acks_late task whose worker died is redelivered and runs once the dead
    worker's lock has expired: it waits it out rather than take it over, and is not
    skipped."""
    mod, client, launch = env
    doomed = launch("late1", concurrency=1)
    result = mod.late.delay("r", 60)
    wait_for(lambda: records(client, "late"), what="the first run")
    key = f"redislock:{{{mod.late.lock_name(('r', 60), {})}}}"
    left = client.pttl(key)
    assert left > 6_000  # the stale lock outlives the redelivery delay
    killed = time.time()
    doomed.kill_all()
    launch("late2", concurrency=1)
    assert result.get(timeout=60) == "r"
    # The broker may deliver the message once more while the redelivery waits
    # (its visibility timeout, 4 s here, passes again): that copy waits behind it,
    # and runs after it (see concepts.md, "A message delivered again while it runs").
    runs = records(client, "late_done")
    assert runs[0]["run"] == 2
    first, second, *copies = records(client, "late")
    assert {first["id"], second["id"]} == {result.id}
    assert all(copy["start"] > second["start"] for copy in copies)
    # Not before the dead worker's hold ran out (a second of slack for the clocks).
    assert second["start"] > killed + left / 1000 - 1
    wait_for(lambda: not held(client, key), what="the lock to be released")


def test_a_dead_pool_childs_lock_is_freed_by_the_worker(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A prefork child killed while it runs a task (as the out-of-memory killer
    would) leaves no lock behind for its TTL: the worker sees the child gone and
    frees the hold it still had."""
    mod, client, launch = env
    launch("oom", concurrency=1)
    result = mod.late.delay("oom", 60)
    wait_for(lambda: records(client, "late"), what="the task to start")
    [started] = records(client, "late")
    key = f"redislock:{{{mod.late.lock_name(('oom', 60), {})}}}"
    assert client.pttl(key) > 9_000
    os.kill(started["pid"], signal.SIGKILL)
    wait_for(lambda: not held(client, key), timeout=6, what="the worker to free the lock")
    with pytest.raises(WorkerLostError):
        result.get(timeout=30)


def test_a_pool_process_writes_its_acquire_before_the_task_is_set_up(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A prefork child writes a while_executing task's acquire as it is handed the
    task: by the time Celery's tracer sends ``task_prerun``, the acquire is kept for
    the task and its lock held; the task reads the reply as it starts, runs and
    releases the lock."""
    mod, client, launch = env
    launch("ahead", concurrency=1)
    result = mod.ahead_probe.delay("a")
    assert result.get(timeout=30) == "a"
    [set_up] = records(client, "set_up")
    assert set_up == {"id": result.id, "written": True, "held": True}
    assert [r["id"] for r in records(client, "ahead_probe")] == [result.id]
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


def test_a_pool_process_that_dies_holding_a_lock_it_took_ahead_leaves_no_lock(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A prefork child killed after its task's acquire written ahead took the lock,
    before the task started (in ``task_prerun``): the worker sees the child gone and
    frees the hold (the task's id, node and process id are in it from the first
    request on), rather than leave it for its 60 s TTL."""
    mod, client, launch = env
    launch("ahead-dies", concurrency=1)
    result = mod.ahead_probe.delay("dies")
    with pytest.raises(WorkerLostError):
        result.get(timeout=30)
    [set_up] = records(client, "set_up")
    assert set_up == {"id": result.id, "written": True, "held": True}
    assert records(client, "ahead_probe") == []
    wait_for(lambda: lock_keys(client) == [], timeout=6, what="the worker to free the lock")


def test_an_acquire_a_pool_process_wrote_ahead_whose_reply_is_lost_is_asked_again_once(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """The acquire a prefork child wrote as it was handed the task runs on the
    server, and its reply is lost (the connection reset): the task asks again with
    the same request id, which the script recognises, and runs once under one
    hold, released as it ends."""
    mod, client, launch = env
    server = client.connection_pool.connection_kwargs
    with FaultProxy(server["host"], server["port"]) as proxy:
        launch("ahead-reset", concurrency=1, REDISLOCK_TEST_LOCK_URL=proxy.url_for(0))
        proxy.drop_reply_to(mod.ahead_probe.lock_name(("reset",), {}).encode())
        result = mod.ahead_probe.delay("reset")
        assert result.get(timeout=30) == "reset"
        assert proxy.marked_drops == 1
    [set_up] = records(client, "set_up")
    assert set_up == {"id": result.id, "written": True, "held": True}
    assert [r["id"] for r in records(client, "ahead_probe")] == [result.id]
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


@pytest.mark.parametrize(
    "task", ["executing_dies_as_it_starts", "executed_dies_as_it_starts", "late_dies_as_it_starts"]
)
def test_a_pool_process_that_dies_before_its_task_starts_leaves_no_reservation(
    env: tuple[Any, redis.Redis, Callable[..., Worker]], task: str
) -> None:
    """An until_* task whose prefork child dies after the worker accepted it but
    before the task was called (here in ``before_start``) leaves no lock behind,
    before the worker records the failure: an until_executing task's reservation,
    which nothing took over, is freed by its owner token; an until_executed task
    whose message Celery does not deliver again (without ``acks_late``, or with it
    and no ``reject_on_worker_lost``), whose pool process took the reservation
    over as it was handed the task, has that hold freed as the dead process's.
    The same call sent again is sent (not taken for a duplicate of the failed
    task) and runs."""
    mod, client, launch = env
    job = getattr(mod, task)
    # An acks_late message is acknowledged only once the worker has seen its pool
    # process lost, which under load can take longer than the tests' visibility
    # timeout: the broker would deliver it again meanwhile.
    launch("dies", concurrency=1, REDISLOCK_TEST_VISIBILITY_TIMEOUT="600")
    first = job.delay("d")
    with pytest.raises(WorkerLostError):
        first.get(timeout=30)
    assert lock_keys(client) == []
    again = job.delay("d")
    assert again.id != first.id
    assert again.get(timeout=30) == "d"
    assert [r["id"] for r in records(client, task)] == [again.id]
    [start] = records(client, "starts")
    # The second call's, as before_start runs: its reservation, or already its
    # execution's hold, taken over as the pool process was handed the task.
    assert (start["id"], start["lease"]) == (again.id, again.id)
    if task == "executing_dies_as_it_starts":
        assert start["owner"] == f"{again.id}:queued"
    else:
        assert not start["owner"].endswith(":queued")
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


def test_a_hold_a_dead_pool_process_took_late_is_freed(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A prefork child whose acquire (taking the reservation over) is delayed on its
    way to the store, and that is killed meanwhile: the worker's look as it sees the
    child gone finds no hold of the child's, and frees the reservation; the acquire
    then lands, a hold of a dead process. The worker looks once more, once no
    request of the child's can be answered, and frees it by its fencing token,
    rather than leave it until lock_ttl."""
    mod, client, launch = env
    server = client.connection_pool.connection_kwargs
    with FaultProxy(server["host"], server["port"]) as proxy:
        launch(
            "late", concurrency=1, REDISLOCK_TEST_LOCK_URL=proxy.url_for(0),
            REDISLOCK_TEST_LATE_REQUEST_WAIT="2",
        )  # fmt: skip
        result = mod.gated.delay("g")
        key = lock_keys_for(mod.gated.lock_name(("g",), {})).lock
        wait_for(lambda: records(client, "gated"), timeout=30, what="the child's start")
        [gated] = records(client, "gated")
        proxy.hold_next(1)
        client.set(f"gate:{result.id}", "1")
        wait_for(lambda: proxy.held == 1, timeout=10, what="the child's acquire to be held")
        os.kill(gated["pid"], signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            result.get(timeout=30)
        proxy.let_held_through()
        wait_for(lambda: field(client, key, OWNER_FIELD) is not None, what="the late acquire")
        wait_for(lambda: lock_keys(client) == [], timeout=15, what="the late hold to be freed")
    assert records(client, "gated_runs") == []


@pytest.mark.parametrize("task", ["executed_stalls_as_it_starts", "late_stalls_as_it_starts"])
def test_a_task_killed_for_its_time_limit_before_it_starts_leaves_no_reservation(
    env: tuple[Any, redis.Redis, Callable[..., Worker]], task: str
) -> None:
    """An until_executed task whose prefork child is killed for its hard time limit
    before the task was called (here in a ``before_start`` that runs too long)
    leaves no reservation behind: the child took it over as it was handed the task
    (its message is not delivered again: no ``acks_late``, or ``acks_late`` with
    ``acks_on_timeout``); once the child is gone, the worker frees that hold, and
    the same call sent again runs."""
    mod, client, launch = env
    job = getattr(mod, task)
    # (An acks_late message is acknowledged as its time limit is reported: not
    # delivered again meanwhile, however slow the machine.)
    launch("stalls", concurrency=1, REDISLOCK_TEST_VISIBILITY_TIMEOUT="600")
    first = job.delay("s")
    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=30)
    wait_for(lambda: lock_keys(client) == [], what="the reservation to be freed")
    again = job.delay("s")
    assert again.id != first.id
    assert again.get(timeout=30) == "s"
    assert [r["id"] for r in records(client, task)] == [again.id]
    [start] = records(client, "starts")
    assert (start["id"], start["lease"]) == (again.id, again.id)
    assert not start["owner"].endswith(":queued")
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


@pytest.mark.parametrize("how", ["retry", "own-id", "own-id-dies"])
def test_a_send_of_its_own_id_that_fails_behind_its_running_sender_leaves_the_lock_free(
    env: tuple[Any, redis.Redis, Callable[..., Worker]], how: str
) -> None:
    """An until_executed execution that sends its message again under its own task
    id (its retry with ``self.retry(throw=False)``, or ``apply_async(task_id=...)``)
    and runs on, whose new message's delivery ends without running while the
    sender still runs (its soft time limit fires as it waits behind the sender;
    or its prefork process dies as it starts), leaves the lock free once both have
    ended: the delivery leaves the sender word, and the sender frees the lock as
    it ends rather than hand it to a reservation nobody would take over. The
    same call sent again then runs."""
    mod, client, launch = env
    launch("behind", concurrency=2)
    first = mod.sends_itself_and_runs_on.delay("b", how)
    wait_for(lambda: records(client, "sender"), timeout=30, what="the sender to end")
    [seen] = records(client, "sender")
    error = "WorkerLostError" if how.endswith("-dies") else "SoftTimeLimitExceeded"
    assert (seen["state"], seen["error"]) == ("FAILURE", error)
    # The sender deletes the word it read just after it frees the lock.
    wait_for(
        lambda: lock_keys(client) == [] and not list(client.scan_iter("redislock:*:dropped:*")),
        timeout=10,
        what="the lock to be freed and the word read",
    )
    again = mod.sends_itself_and_runs_on.delay("b", "plain")
    assert again.id != first.id
    assert again.get(timeout=30) == "again"
    assert [r["id"] for r in records(client, "sends_itself_and_runs_on")] == [first.id, again.id]
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


def test_a_message_requeued_as_it_is_killed_for_its_time_limit_keeps_its_reservation(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An until_executed message that Celery requeues when it is killed for its
    hard time limit before its start (``acks_late`` without ``acks_on_timeout``;
    before Celery 5.7, without ``acks_on_failure_or_timeout``: delivered again by
    the broker) keeps its reservation: its next delivery finds it as it starts,
    takes it over and runs, and leaves nothing behind."""
    mod, client, launch = env
    launch("requeue-stall", concurrency=1)
    first = mod.requeued_stalls_as_it_starts.delay("s")
    wait_for(lambda: records(client, "requeued_stalls_as_it_starts"), 30, "the redelivery")
    [run] = records(client, "requeued_stalls_as_it_starts")
    assert run["id"] == first.id
    [start] = records(client, "starts")
    assert (start["id"], start["owner"]) == (first.id, f"{first.id}:queued")
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


def test_a_message_requeued_as_its_pool_process_died_before_its_start_keeps_its_reservation(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An until_executed message that Celery requeues when its prefork child dies
    before the execution took the reservation over (``acks_late`` with
    ``reject_on_worker_lost``) keeps its reservation while it waits again, as a
    message rejected with ``requeue=True`` does: its delivery finds it as it
    starts, takes it over and runs, and leaves nothing behind."""
    mod, client, launch = env
    launch("requeue", concurrency=1)
    first = mod.requeued_dies_as_it_starts.delay("d")
    assert first.get(timeout=30) == "d"
    assert [r["id"] for r in records(client, "requeued_dies_as_it_starts")] == [first.id]
    [start] = records(client, "starts")
    assert (start["id"], start["owner"]) == (first.id, f"{first.id}:queued")
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


@needs_retry_on_worker_lost
def test_a_task_sent_again_as_its_pool_process_died_before_its_start_runs(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An until_executing task that Celery sends again as a retry when its prefork
    child dies before the execution took the reservation over
    (``retry_on_worker_lost``) has the first message's reservation freed before
    the retry is sent: the retry reserves its own, runs, and leaves nothing behind."""
    mod, client, launch = env
    launch("resend", concurrency=1)
    first = mod.resent_dies_as_it_starts.delay("d")
    assert first.get(timeout=30) == "d"
    [run] = records(client, "resent_dies_as_it_starts")
    assert (run["id"], run["retries"]) == (first.id, 1)
    # The retry's own reservation, not the first message's.
    [start] = records(client, "starts")
    assert (start["id"], start["owner"]) == (first.id, f"{first.id}:1:queued")
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


def test_a_dead_pool_childs_lock_waits_for_its_ttl_with_a_request_class_not_from_early(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """What :class:`~celery_redislock.task.RequestClassWarning` warns of: with a
    worker request class not derived from ``celery_redislock.early.Request``, the
    hold of a prefork child killed while it runs the task is left to its TTL."""
    mod, client, launch = env
    launch("plainreq", concurrency=1)
    result = mod.late_plain_request.delay("oom", 60)
    wait_for(lambda: records(client, "late_plain_request"), what="the task to start")
    [started] = records(client, "late_plain_request")
    key = f"redislock:{{{mod.late_plain_request.lock_name(('oom', 60), {})}}}"
    os.kill(started["pid"], signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        result.get(timeout=30)
    # The worker has recorded the failure: the early request class would have
    # freed the hold before that.
    assert held(client, key)
    assert client.pttl(key) > 0


@needs_retry_on_worker_lost
def test_a_task_sent_again_after_its_pool_process_died_runs(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An until_executed task that Celery sends again when its pool process dies
    (``retry_on_worker_lost``) finds its lock freed by the worker first: the copy is
    sent, not taken for a duplicate of the dead run, and runs."""
    mod, client, launch = env
    launch("lost", concurrency=1)
    result = mod.lost_once.delay("again")
    wait_for(lambda: records(client, "lost_once"), what="the first run")
    [first] = records(client, "lost_once")
    os.kill(first["pid"], signal.SIGKILL)
    assert result.get(timeout=30) == "again"
    assert [r["run"] for r in records(client, "lost_once")] == [1, 2]
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


def test_a_message_rejected_with_requeue_keeps_its_lock_while_it_waits_again(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An acks_late until_executed task that rejects its message with requeue=True
    hands its lock to the message's reservation for lock_enqueue_ttl, as a message
    just sent (not lock_ttl): a duplicate sent while it waits in the queue again
    publishes nothing, and the message runs when its turn comes."""
    mod, client, launch = env
    launch("rej", concurrency=1)
    result = mod.rejects_once.delay("r")
    mod.occupy.delay("rej-gate")  # queued behind it, so the message comes back behind
    wait_for(lambda: records(client, "occupy"), what="the slot to be taken")
    assert [r["run"] for r in records(client, "rejects_once")] == [1]
    key = f"redislock:{{{mod.rejects_once.lock_name(('r',), {})}}}"
    assert client.pttl(key) > 1_000  # lock_ttl is 1 s
    assert mod.rejects_once.delay("r").id == result.id
    client.set("release:rej-gate", "1")
    assert result.get(timeout=30) == "r"
    assert [r["run"] for r in records(client, "rejects_once")] == [1, 2]


def test_a_message_its_start_sends_back_in_a_pool_process_keeps_its_reservation(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An acks_late until_executed task whose prefork child took the send's
    reservation over as it was handed the task (its message is acknowledged if
    the child dies), and whose ``before_start`` then raises
    ``Reject(requeue=True)``: the hold goes back to the message's reservation, for
    lock_enqueue_ttl (not lock_ttl), while the message waits in the queue again,
    so a duplicate sent meanwhile publishes nothing; the message then runs once."""
    mod, client, launch = env
    launch("sendback", concurrency=1)
    result = mod.sent_back_at_start.delay("b")
    mod.occupy.delay("sendback-gate")  # queued behind it, so the message comes back behind
    wait_for(lambda: records(client, "occupy"), what="the slot to be taken")
    [sent_back] = records(client, "sent_back")
    # Taken over as the child was handed the task, before before_start.
    assert (sent_back["id"], sent_back["lease"]) == (result.id, result.id)
    assert sent_back["owner"] != f"{result.id}:queued"
    key = lock_keys_for(mod.sent_back_at_start.lock_name(("b",), {})).lock
    assert field(client, key, OWNER_FIELD) == f"{result.id}:queued"
    assert client.pttl(key) > 1_000  # lock_ttl is 1 s
    assert mod.sent_back_at_start.delay("b").id == result.id
    client.set("release:sendback-gate", "1")
    assert result.get(timeout=30) == "b"
    assert [r["id"] for r in records(client, "sent_back_at_start")] == [result.id]
    wait_for(lambda: lock_keys(client) == [], what="the lock to be released")


def test_an_until_executed_task_whose_start_failed_leaves_no_reservation(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An until_executed task whose ``before_start`` raises is never called, so its
    execution never takes its message's reservation over: the reservation is freed
    before the failure is stored, and the task sent again is sent (not taken for a
    duplicate of the failed one for ``lock_enqueue_ttl``) and runs."""
    mod, client, launch = env
    launch("start", concurrency=1)
    first = mod.fails_to_start.delay("s")
    with pytest.raises(RuntimeError, match="start failed"):
        first.get(timeout=30)
    assert lock_keys(client) == []
    again = mod.fails_to_start.delay("s")
    assert again.id != first.id
    with pytest.raises(RuntimeError, match="start failed"):
        again.get(timeout=30)
    assert lock_keys(client) == []
    assert records(client, "fails_to_start") == []


def test_a_message_delivered_again_while_it_runs_is_not_run_beside_it(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """An acks_late task that outlives the broker's visibility timeout is delivered
    again while it runs: the copy waits, sees the first delivery renew the lock, and
    is dropped; the task runs once, keeps its lock, and its result is its own."""
    mod, client, launch = env
    launch("vis", concurrency=2)
    result = mod.delivered.delay("twice", 9)  # the visibility timeout is 4 s
    assert result.get(timeout=60) == "twice"
    assert [r["id"] for r in records(client, "delivered")] == [result.id]
    [done] = records(client, "delivered_done")
    assert not done["lost"]
    assert {"task_id": result.id, "action": "redelivered"} in records(client, "conflict")
    assert lock_keys(client) == []


def test_a_retry_raised_in_a_try_finally_runs_only_once_its_sender_has_cleaned_up(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """Prefork: an until_executed task raises its retry inside a ``try``/``finally``;
    the retry, started by the other pool process while the sender still runs its
    ``finally``, waits for the lock and runs only once the sender has ended, taking
    over the hold handed to its reservation. Nothing is left locked."""
    mod, client, launch = env
    launch("cleanup", concurrency=2)
    assert mod.retries_in_cleanup.delay("c").get(timeout=30) == 1
    steps = [(r["step"], r["retries"]) for r in records(client, "retries_in_cleanup")]
    assert steps == [("start", 0), ("cleaned", 0), ("start", 1)]
    assert lock_keys(client) == []


def test_a_replacement_runs_only_once_the_task_it_replaced_has_cleaned_up(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """Prefork: an until_executed task replaces itself (``self.replace()``, the
    replacement sent under its own task id) inside a ``try``/``finally``; the
    replacement, started by the other pool process while the sender still runs its
    ``finally``, runs only once the sender has ended, taking over the hold handed
    to its reservation. Nothing is left locked."""
    mod, client, launch = env
    launch("replace", concurrency=2)
    assert mod.replaces_in_cleanup.delay("r").get(timeout=30) == "replaced"
    steps = [(r["step"], r["nesting"]) for r in records(client, "replaces_in_cleanup")]
    assert steps == [("start", 0), ("cleaned", 0), ("start", 1)]
    assert lock_keys(client) == []


def test_soft_time_limit_releases(env: tuple[Any, redis.Redis, Callable[..., Worker]]) -> None:
    """A task stopped by its soft time limit releases its lock at once."""
    from celery.exceptions import SoftTimeLimitExceeded

    mod, client, launch = env
    launch("soft", concurrency=1)
    with pytest.raises(SoftTimeLimitExceeded):
        mod.overrun.delay("s").get(timeout=30)
    assert lock_keys(client) == []


@pytest.mark.parametrize(
    ("deaf", "task"),
    [(False, "hard_limited"), (True, "hard_limited"), (True, "hard_limited_failing")],
    ids=["ends-on-sigterm", "killed", "killed-on-failure-raises"],
)
def test_a_task_killed_for_its_hard_time_limit_leaves_no_lock_behind(
    env: tuple[Any, redis.Redis, Callable[..., Worker]], deaf: bool, task: str
) -> None:
    """Past its hard time limit, a task's pool process gets SIGTERM, then SIGKILL. A
    task that ends on the SIGTERM releases its lock as it ends; the hold of one that
    does not is freed by the worker once the process is gone, instead of being left
    to its TTL (60 s), even if the task's on_failure raises."""
    from celery.exceptions import TimeLimitExceeded

    mod, client, launch = env
    launch("hard", concurrency=1)
    limited = getattr(mod, task)
    result = limited.delay("h", deaf)
    wait_for(lambda: records(client, "hard_limited"), what="the task to start")
    [started] = records(client, "hard_limited")
    key = f"redislock:{{{limited.lock_name(('h', deaf), {})}}}"
    with pytest.raises(TimeLimitExceeded):
        result.get(timeout=30)
    wait_for(lambda: not held(client, key), timeout=10, what="the lock to be freed")

    def released_by_the_task() -> list[dict[str, Any]]:
        return [r for r in records(client, "released") if r["task_id"] == result.id]

    if deaf:
        assert released_by_the_task() == []
    else:
        wait_for(released_by_the_task, what="the task's own release")
    # The next one with the same arguments runs, on a fresh pool process.
    again = limited.delay("h", deaf)
    wait_for(lambda: len(records(client, "hard_limited")) == 2, what="the next one to start")
    assert records(client, "hard_limited")[1]["pid"] != started["pid"]
    with pytest.raises(TimeLimitExceeded):
        again.get(timeout=30)


def test_revoke_terminate_releases(env: tuple[Any, redis.Redis, Callable[..., Worker]]) -> None:
    """Revoking a running task with terminate=True and SIGKILL frees its lock soon
    after its pool process is gone, not at its TTL."""
    mod, client, launch = env
    launch("term", concurrency=1)
    result = mod.cleans_up.delay("t", 60, 0)
    wait_for(lambda: records(client, "cleans_up"), what="the task to start")
    key = f"redislock:{{{mod.cleans_up.lock_name(('t', 60, 0), {})}}}"
    assert held(client, key)
    result.revoke(terminate=True, signal="SIGKILL")
    wait_for(lambda: not held(client, key), timeout=10, what="the lock to be freed")
    assert [r["step"] for r in records(client, "cleans_up")] == ["start"]


def test_a_task_terminated_while_running_keeps_its_lock_until_its_cleanup_ends(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """revoke(terminate=True) with its default SIGTERM, which a prefork child ends
    on by raising SystemExit in the task, leaves the lock held while the task's
    finally still runs: a duplicate sent meanwhile does not start before that
    cleanup ended, and the lock is freed as the task ends."""
    mod, client, launch = env
    launch("cleanup", concurrency=2)
    first = mod.cleans_up.delay("c", 60, 3)
    wait_for(lambda: records(client, "cleans_up"), what="the task to start")
    key = f"redislock:{{{mod.cleans_up.lock_name(('c', 60, 3), {})}}}"
    first.revoke(terminate=True)

    def steps() -> list[tuple[str, str]]:
        return [(r["id"], r["step"]) for r in records(client, "cleans_up")]

    wait_for(lambda: (first.id, "cleanup") in steps(), what="the revoked task's cleanup")
    assert field(client, key, LEASE_FIELD) == first.id, "freed while its cleanup still ran"
    duplicate = mod.cleans_up.delay("c", 60, 3)
    outcome = duplicate.get(timeout=60)
    history = steps()
    if (duplicate.id, "start") in history:
        assert history.index((first.id, "cleaned")) < history.index((duplicate.id, "start"))
        duplicate.revoke(terminate=True, signal="SIGKILL")
    else:
        assert is_skipped(outcome)
        assert outcome["holder"] == first.id
    wait_for(lambda: not held(client, key), timeout=15, what="the lock to be freed")
    assert (first.id, "cleaned") in steps()


def test_a_revoke_that_finds_an_until_executed_task_running_leaves_word_that_expires(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """A revoke that reaches an ``until_executed`` task while it runs (without
    ``terminate``, and with it: the default ``SIGTERM`` ends the body, the
    ``finally`` keeps the lock) leaves its execution word that the messages it
    may have sent under its task id are revoked: its next retry's
    (``<lock key>:dropped:<task id>:1``) and one without a retry count
    (``...:0``), tied to its hold by its fencing token. It sent none, so it never
    reads them: they stay once it has ended, each expiring within a day (or
    ``lock_enqueue_ttl`` if longer), and the next send of the same call runs, is
    left no word and leaves none."""
    mod, client, launch = env
    launch("word", concurrency=2)
    _revoke_running_until_executed(mod, client, "plain", terminate=False)
    _revoke_running_until_executed(mod, client, "terminated", terminate=True)


def _revoke_running_until_executed(
    mod: Any, client: redis.Redis, name: str, terminate: bool
) -> None:
    """Revoke a running ``runs_until_told`` call of ``name``, let it end, and check
    the word it is left (see the test above); send the call again."""
    task = mod.runs_until_told
    lock = task.lock_name((name,), {})
    key = f"redislock:{{{lock}}}"

    def left() -> list[str]:
        return sorted(k.decode() for k in client.scan_iter(f"{key}:*"))

    def started(task_id: str) -> dict[str, Any] | None:
        runs = [r for r in records(client, "runs_until_told") if r["id"] == task_id]
        return runs[0] if runs else None

    result = task.delay(name)
    wait_for(lambda: started(result.id), what="the task to start")
    words = sorted(dropped_key(lock, result.id, retries, "redislock") for retries in (0, 1))
    result.revoke(terminate=terminate)
    wait_for(lambda: left() == words, what="the revoke to reach the running task")
    client.set(f"release:{name}", 1)
    outcome = result.get(timeout=30, propagate=False)
    if terminate:
        assert result.state == "REVOKED"
    elif CELERY_5_7:
        assert outcome == name
    else:
        # Celery before 5.7 stores a task revoked by its id as revoked at the
        # revoke, though it runs to its end (its start is recorded below), and its
        # success over that as it ends: the caller reads whichever it finds first.
        assert outcome == name or isinstance(outcome, TaskRevokedError)
    wait_for(lambda: not held(client, key), what="the lock to be freed")
    assert left() == words
    run = started(result.id)
    assert run is not None
    longest = max(DROPPED_WORD_TTL, task.lock_enqueue_ttl) * 1000
    for retries in (0, 1):
        word = read_word(client, lock, result.id, retries, "redislock")
        assert word is not None
        assert (word.fence, word.then, word.drops) == (run["token"], 0, ALL_COPIES)
        assert 0 < client.pttl(dropped_key(lock, result.id, retries, "redislock")) <= longest
    again = task.delay(name)
    assert again.id != result.id
    assert again.get(timeout=30) == name
    wait_for(lambda: not held(client, key), what="the lock to be freed again")
    assert left() == words


@pytest.mark.parametrize(
    ("pool", "signame", "worker_env"),
    [
        ("prefork", "SIGINT", {}),
        ("prefork", "SIGTERM", {"REMAP_SIGTERM": "SIGQUIT"}),
        ("threads", "SIGTERM", {}),
        ("solo", "SIGTERM", {}),
    ],
    ids=["prefork-SIGINT", "prefork-SIGTERM-remapped", "threads", "solo"],
)
def test_revoke_terminate_with_a_signal_the_task_lives_through_keeps_its_lock(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
    pool: str,
    signame: str,
    worker_env: dict[str, str],
) -> None:
    """A terminate the task lives through leaves the lock to the task, which still
    runs: it is freed as the task ends, not while it runs. A prefork child ignores
    SIGINT, and SIGTERM in a worker run with REMAP_SIGTERM=SIGQUIT; the threads
    and solo pools cannot terminate a task at all."""
    mod, client, launch = env
    launch("int", concurrency=1, pool=pool, **worker_env)
    result = mod.sleeper.delay("i", 3)
    wait_for(lambda: records(client, "sleeper"), what="the task to start")
    key = f"redislock:{{{mod.sleeper.lock_name(('i', 3), {})}}}"
    result.revoke(terminate=True, signal=signame)
    deadline = time.monotonic() + 30
    while held(client, key):
        assert time.monotonic() < deadline, "the lock was never freed"
        time.sleep(0.05)
    assert records(client, "sleeper_done"), "freed while its task still ran"


def test_a_task_cancelled_as_the_broker_connection_is_lost_leaves_no_lock_behind(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """With worker_cancel_long_running_tasks_on_connection_loss, a worker that loses
    its broker connection signals the pool process of a running acks_late task: a
    process that dies on it without releasing has its hold freed by the worker once
    it is gone, not at its TTL (30 s), and the message delivered again runs."""
    mod, client, launch = env
    launch("cancel", concurrency=1, REDISLOCK_TEST_CANCEL_ON_CONNECTION_LOSS="1")
    mod.dies_on_sigterm.delay("x")
    wait_for(lambda: records(client, "dies_on_sigterm"), what="the task to start")
    [first] = records(client, "dies_on_sigterm")
    key = f"redislock:{{{mod.dies_on_sigterm.lock_name(('x',), {})}}}"
    assert field(client, key, FENCE_FIELD) == str(first["token"])
    # The broker's connections (its database): the worker's consumer loses its own.
    broker = [c["id"] for c in client.client_list() if c["db"] == "1"]
    assert broker
    for connection in broker:
        client.client_kill_filter(_id=connection)
    # This process's own went too: later tests get new ones, not a closed one.
    mod.app.pool.force_close_all()

    def first_hold_gone() -> bool:
        return not held(client, key) or field(client, key, FENCE_FIELD) != str(first["token"])

    wait_for(first_hold_gone, timeout=15, what="the cancelled task's hold to be freed")
    wait_for(
        lambda: len(records(client, "dies_on_sigterm")) == 2,
        timeout=60,
        what="the message delivered again to run",
    )
    assert records(client, "dies_on_sigterm")[1]["pid"] != first["pid"]


def test_warm_shutdown_finishes_and_releases(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """SIGTERM (warm shutdown) lets the running task finish and release its lock."""
    mod, client, launch = env
    worker = launch("warm", concurrency=1)
    result = mod.sleeper.delay("w", 1.5)
    wait_for(lambda: records(client, "sleeper"), what="the task to start")
    worker.signal(signal.SIGTERM)
    worker.process.wait(30)
    assert result.get(timeout=10) == "w"
    assert lock_keys(client) == []


def test_worker_survives_lock_store_outage(
    env: tuple[Any, redis.Redis, Callable[..., Worker]],
) -> None:
    """With the lock store down, each task fails with LockBackendError and the worker keeps serving."""
    from celery_redislock import LockBackendError
    from celery_redislock.server import free_port

    mod, client, launch = env
    worker = launch("outage", REDISLOCK_TEST_LOCK_URL=f"redis://127.0.0.1:{free_port()}/0")
    results = [mod.critical.delay("down", n) for n in range(4)]
    outcomes = [r.get(timeout=60, propagate=False) for r in results]
    assert all(isinstance(o, LockBackendError) for o in outcomes), outcomes
    assert worker.process.poll() is None
    assert records(client, "critical") == []


def scheduled_ids(app: Any, worker: Worker) -> set[str]:
    """The ids of the requests ``worker`` holds waiting for their countdown/ETA."""
    replies = app.control.inspect(destination=[worker.name], timeout=1).scheduled() or {}
    return {entry["request"]["id"] for entries in replies.values() for entry in entries}


def reserved_ids(app: Any, worker: Worker) -> set[str]:
    """The ids of the requests ``worker`` has fetched and not started."""
    replies = app.control.inspect(destination=[worker.name], timeout=1).reserved() or {}
    return {entry["id"] for entries in replies.values() for entry in entries}


def revoke(app: Any, result: Any, how: str) -> None:
    """Revoke ``result`` through ``AsyncResult.revoke()`` or ``app.control.revoke(id)``."""
    if how == "AsyncResult.revoke":
        result.revoke()
    else:
        app.control.revoke(result.id)


@pytest.mark.parametrize("how", ["AsyncResult.revoke", "app.control.revoke"])
def test_revoked_countdown_task_frees_key(
    env: tuple[Any, redis.Redis, Callable[..., Worker]], how: str
) -> None:
    """A countdown until_executed task revoked in a prefork worker frees its key; a resend runs."""
    mod, client, launch = env
    # No redelivery of the held message (which would also drop it, and free the key)
    # while the test runs: only the revoke can free it.
    worker = launch("eta", concurrency=1, REDISLOCK_TEST_VISIBILITY_TIMEOUT="600")
    first = mod.queued_once.apply_async(("c",), countdown=120)
    key = f"redislock:{{{mod.queued_once.lock_name(('c',), {})}}}"
    assert held(client, key)
    wait_for(lambda: first.id in scheduled_ids(mod.app, worker), what="the countdown to be held")
    revoke(mod.app, first, how)
    wait_for(lambda: not held(client, key), timeout=5, what="the revoked task's key to be freed")
    again = mod.queued_once.delay("c")
    assert again.id != first.id
    assert again.get(timeout=30) == again.id
    assert [r["id"] for r in records(client, "queued_once")] == [again.id]


@pytest.mark.parametrize("how", ["AsyncResult.revoke", "app.control.revoke"])
def test_revoked_message_behind_busy_slot_frees_key(
    env: tuple[Any, redis.Redis, Callable[..., Worker]], how: str
) -> None:
    """A message left in the broker behind a busy slot, revoked, frees its key; a resend runs."""
    mod, client, launch = env
    worker = launch("busy", concurrency=1)
    busy = mod.occupy.delay("slot")
    wait_for(lambda: records(client, "occupy"), what="the slot to be taken")
    first = mod.queued_once.delay("b")
    key = f"redislock:{{{mod.queued_once.lock_name(('b',), {})}}}"
    broker = redis.Redis.from_url(mod.URL.rsplit("/", 1)[0] + "/1")
    assert broker.llen("workers-queue") == 1
    assert first.id not in reserved_ids(mod.app, worker)
    assert broker.llen("workers-queue") == 1  # still not fetched after the inspect round trip
    revoke(mod.app, first, how)
    wait_for(lambda: not held(client, key), timeout=5, what="the revoked task's key to be freed")
    again = mod.queued_once.delay("b")
    assert again.id != first.id
    client.set("release:slot", 1)
    assert busy.get(timeout=30) == "slot"
    assert again.get(timeout=30) == again.id
    assert [r["id"] for r in records(client, "queued_once")] == [again.id]
    broker.close()
