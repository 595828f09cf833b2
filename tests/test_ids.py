"""Identifiers for owners and requests: unique across threads and forks, and small."""

from __future__ import annotations

import itertools
import os
import string
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import pytest

from celery_redislock import ids
from celery_redislock.ids import (
    BATCH,
    OWNER_TOKEN_CHARS,
    REQUEST_ID_DIGITS,
    owner_token,
    random_hex,
    request_id,
)
from tests.support import in_forked_child

URL_SAFE = set(string.ascii_letters + string.digits + "-_")


def test_identifiers_have_the_size_and_alphabet_promised() -> None:
    for digits in (16, 2):
        value = random_hex(digits)
        assert len(value) == digits
        assert set(value) <= set(string.hexdigits.lower())
    token = owner_token()
    assert len(token) == OWNER_TOKEN_CHARS
    assert set(token) <= URL_SAFE


def test_request_ids_are_ten_digit_numbers_the_server_keeps_as_32_bit_integers() -> None:
    """Every id has the same length (a release remembers several in one string) and
    reads back from Redis unchanged as a number: no leading zero, below 2**31."""
    for _ in range(BATCH):
        value = request_id()
        assert len(value) == REQUEST_ID_DIGITS
        assert value == str(int(value))
        assert 10**9 <= int(value) < 2**31


def test_request_ids_count_up_and_wrap_within_their_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = int(request_id())
    assert int(request_id()) == first + 1  # nothing else asks for one meanwhile
    monkeypatch.setattr(ids, "_requests", itertools.count(2**31 - 10**9 - 1))
    assert [request_id() for _ in range(2)] == [str(2**31 - 1), str(10**9)]


@pytest.mark.parametrize("make", [lambda: random_hex(10), owner_token, request_id])
def test_threads_never_get_the_same_identifier(make: Callable[[], str]) -> None:
    taken: list[list[str]] = [[] for _ in range(8)]

    def take(into: list[str]) -> None:
        for _ in range(BATCH * 5):
            into.append(make())

    threads = [threading.Thread(target=take, args=(into,)) for into in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [value for into in taken for value in into]
    assert len(set(every)) == len(every) == 8 * BATCH * 5


def _take_in_child(conn: Connection) -> None:
    conn.send(
        {
            "hex": [random_hex(16) for _ in range(BATCH)],
            "tokens": [owner_token() for _ in range(BATCH)],
            "requests": [request_id() for _ in range(BATCH)],
        }
    )


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_does_not_reuse_its_parents_identifiers() -> None:
    """A child drops the batches its parent had read and counts its request ids
    from a start of its own, not on from the parent's."""
    random_hex(16)  # the parent now holds batches it has not used up
    owner_token()
    left_hex, left_tokens = set(ids._unused[16]), set(ids._unused[ids._TOKENS])
    child = in_forked_child(_take_in_child)
    parents_next = [request_id() for _ in range(BATCH)]
    assert len(set(child["hex"])) == len(set(child["tokens"])) == BATCH
    assert not set(child["hex"]) & left_hex
    assert not set(child["tokens"]) & left_tokens
    assert not set(child["requests"]) & set(parents_next)
