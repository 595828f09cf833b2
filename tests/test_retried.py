"""Work done again in the background (``celery_redislock.retried``): what a flush
at exit does with the jobs still waiting."""

from __future__ import annotations

import logging
import time

import pytest

from celery_redislock.errors import LockBackendError
from celery_redislock.retried import Retried
from celery_redislock.transport import Deadline


class _StoreDown:
    """A job whose every try finds the lock store out of reach."""

    what = "a job about lock 'x'"

    def __init__(self) -> None:
        self.until = time.monotonic() + 60
        self.tries = 0

    def attempt(self) -> None:
        self.tries += 1
        raise LockBackendError("the lock store could not be reached")


@pytest.mark.parametrize("time_left", [True, False], ids=["time left", "none left"])
def test_a_job_the_exits_flush_cannot_do_is_logged_as_given_up(
    caplog: pytest.LogCaptureFixture, time_left: bool
) -> None:
    """At exit, a job still waiting for its next try is tried once more from the
    exiting thread if the flush has time left, and logged as given up either way
    (its lock expires by its TTL, or an operator frees it): nothing is left to
    try it later."""
    caplog.set_level(logging.WARNING, logger="celery_redislock.retried")
    retried = Retried()
    job = _StoreDown()
    retried.add(job, pause=60.0)

    retried.run_now(Deadline(time.monotonic() + (5.0 if time_left else 0.0)), final=True)

    assert job.tries == (1 if time_left else 0)
    given_up = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
    assert len(given_up) == 1
    assert job.what in given_up[0]
    assert "celery redislock release" in given_up[0]
