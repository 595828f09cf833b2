"""Random identifiers handed out from batches: unique across threads and forks."""

from __future__ import annotations

import os
import string
import threading

import pytest

from celery_redislock import ids
from celery_redislock.ids import BATCH, random_hex
from celery_redislock.scripts import REQUEST_ID_HEX, request_id


def test_identifiers_are_hex_of_the_size_asked() -> None:
    for digits in (REQUEST_ID_HEX, 16, 2):
        value = random_hex(digits)
        assert len(value) == digits
        assert set(value) <= set(string.hexdigits.lower())
    assert len(request_id()) == REQUEST_ID_HEX


def test_threads_never_get_the_same_identifier() -> None:
    taken: list[list[str]] = [[] for _ in range(8)]

    def take(into: list[str]) -> None:
        for _ in range(BATCH * 5):
            into.append(random_hex(10))

    threads = [threading.Thread(target=take, args=(into,)) for into in taken]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [value for into in taken for value in into]
    assert len(set(every)) == len(every) == 8 * BATCH * 5


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_does_not_reuse_its_parents_batch() -> None:
    random_hex(16)  # the parent now holds a batch it has not used up
    left = list(ids._unused[16])
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read)
            os.write(write, "".join(random_hex(16) for _ in range(BATCH)).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        text = pipe.read()
    os.waitpid(pid, 0)
    child = {text[at : at + 16] for at in range(0, len(text), 16)}
    assert len(child) == BATCH
    assert not child & set(left)
