"""Tests for the exception hierarchy and how the exceptions travel (pickle, ``cls(*args)``)."""

from __future__ import annotations

import inspect
import pickle

import pytest

from celery_redislock import errors
from celery_redislock.errors import (
    DuplicateTaskError,
    KeyDerivationError,
    LockBackendError,
    LockConflictError,
    LockError,
    LockLostError,
    LockNotOwnedError,
    LockTimeoutError,
    NoLockError,
    ServerNotFoundError,
    TaskOptionError,
    TaskSkippedError,
)

#: One instance of every public exception, built the way the package raises it.
SAMPLES: list[LockError] = [
    LockError("plain"),
    LockNotOwnedError("invoice:42"),
    LockNotOwnedError("invoice:42", "custom message"),
    LockLostError("invoice:42"),
    LockTimeoutError("invoice:42", 2.5),
    LockTimeoutError("invoice:42", None),
    LockConflictError("report:7", "task-id-1"),
    LockConflictError("report:7", None),
    TaskSkippedError("report:7", "task-id-2"),
    DuplicateTaskError("report:7", "task-id-3"),
    LockBackendError("could not acquire lock 'x': Connection refused"),
    KeyDerivationError("cannot derive a key from <object>"),
    NoLockError("task 'shop.report' has no lock here"),
    ServerNotFoundError("no server"),
    TaskOptionError("shop.report", "lock_ttl", "task 'shop.report': lock_ttl must be > 0"),
]


def _public_exceptions() -> list[type[BaseException]]:
    return [
        obj
        for name, obj in vars(errors).items()
        if inspect.isclass(obj)
        and issubclass(obj, BaseException)
        and not name.startswith("_")
        and obj.__module__ == errors.__name__
    ]


def test_samples_cover_every_public_exception() -> None:
    """The round-trip samples below include every exception class the module defines."""
    assert {type(exc) for exc in SAMPLES} == set(_public_exceptions())


@pytest.mark.parametrize("cls", _public_exceptions(), ids=lambda cls: cls.__name__)
def test_every_error_is_a_lock_error(cls: type[BaseException]) -> None:
    """One ``except LockError`` catches every error the package raises on purpose."""
    assert issubclass(cls, LockError)


def test_hierarchy() -> None:
    """The documented parent/child relations hold."""
    assert issubclass(LockLostError, LockNotOwnedError)
    assert issubclass(TaskSkippedError, LockConflictError)
    assert issubclass(KeyDerivationError, TypeError)
    # Raised as the built-in errors were before it, so code catching those still does.
    assert issubclass(TaskOptionError, TypeError)
    assert issubclass(TaskOptionError, ValueError)
    assert not issubclass(LockTimeoutError, LockNotOwnedError)
    assert not issubclass(LockBackendError, LockNotOwnedError)


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda exc: f"{type(exc).__name__}{exc.args!r}")
def test_pickle_round_trip(exc: LockError) -> None:
    """An exception survives pickling with its type, args, attributes and message."""
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is type(exc)
    assert copy.args == exc.args
    assert str(copy) == str(exc)
    assert vars(copy) == vars(exc)


@pytest.mark.parametrize("exc", SAMPLES, ids=lambda exc: f"{type(exc).__name__}{exc.args!r}")
def test_rebuild_from_args(exc: LockError) -> None:
    """``cls(*exc.args)`` (how Celery rebuilds a task's exception) gives the same error."""
    copy = type(exc)(*exc.args)
    assert copy.args == exc.args
    assert str(copy) == str(exc)
    assert vars(copy) == vars(exc)


def test_messages_name_the_lock() -> None:
    """The messages say which lock, which holder and which timeout were involved."""
    assert "'invoice:42'" in str(LockNotOwnedError("invoice:42"))
    assert "lost" in str(LockLostError("invoice:42"))
    # Not only a renewal too late: an operator may have freed it.
    assert "force release" in str(LockLostError("invoice:42"))
    assert "2.5 s" in str(LockTimeoutError("invoice:42", 2.5))
    assert "'task-id-1'" in str(LockConflictError("report:7", "task-id-1"))


def test_structured_attributes() -> None:
    """The structured errors expose their constructor arguments as attributes."""
    timeout = LockTimeoutError("n", 1.0)
    assert (timeout.name, timeout.timeout) == ("n", 1.0)
    conflict = TaskSkippedError("k", "holder")
    assert (conflict.key, conflict.holder) == ("k", "holder")
    assert LockLostError("n").name == "n"
    option = TaskOptionError("shop.report", "on_conflict", "message")
    assert (option.task_name, option.option) == ("shop.report", "on_conflict")


def test_conflict_errors_call_the_lock_name_a_name() -> None:
    """A conflict error's lock name is ``name``; ``key`` is the same value, the older
    spelling, and a rebuilt (pickled) error keeps both."""
    for exc in (
        LockConflictError("report:7", "task-id-1"),
        DuplicateTaskError("report:7", "task-id-3"),
        TaskSkippedError("report:7", "task-id-2"),
    ):
        rebuilt = pickle.loads(pickle.dumps(exc))
        assert exc.name == exc.key == rebuilt.name == rebuilt.key == "report:7"
