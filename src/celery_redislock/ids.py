"""Identifiers for requests and owners, without a system call each.

Every lock object gets a fresh owner token, and every acquire and release
carries a request id: two or three per task. Owner tokens are random, read from
the kernel's random source in batches and handed out one by one. Request ids
count up, from a random start per process. A forked child drops what its parent
had read and starts counting from a start of its own, so no owner token is ever
handed out in two processes.

Both are kept small, because a held lock stores both: a plain lock's value (its
owner token, fencing token and last request id, 40 bytes) then stays short
enough (44 bytes at most) for the server to keep it in one allocation with its
object (see ``bench/bench_lock.py``, section 6).
"""

from __future__ import annotations

import base64
import itertools
import os
import secrets

#: How many identifiers of one size one read of the random source makes.
BATCH = 128

#: An owner token is this many URL-safe characters: 72 random bits. It only has
#: to differ from the tokens of the other holders of one lock name, and two
#: tokens drawn at random are the same once in 2**72 pairs.
OWNER_TOKEN_CHARS = 12

#: A request id is this many decimal digits: a number from 10**9 up to 2**31 - 1,
#: so that every id has the same length (a release remembers the last few as one
#: string) and the server stores it as a 32-bit integer (6 bytes rather than 12).
REQUEST_ID_DIGITS = 10
_REQUEST_FIRST = 10**9
_REQUEST_SPAN = 2**31 - _REQUEST_FIRST

# Unused identifiers: random hex per size in digits, and owner tokens. ``list.pop``
# is atomic, so threads share a batch without a lock: each goes to one caller only.
_unused: dict[int | str, list[str]] = {}
_TOKENS = "owner tokens"


def random_hex(digits: int) -> str:
    """``digits`` random hex digits (an even number), as ``secrets.token_hex`` gives."""
    try:
        return _unused[digits].pop()
    except (KeyError, IndexError):
        return _refill(digits, os.urandom(digits // 2 * BATCH).hex(), digits)


def owner_token() -> str:
    """A new owner token: :data:`OWNER_TOKEN_CHARS` URL-safe characters, 72 random bits."""
    try:
        return _unused[_TOKENS].pop()
    except (KeyError, IndexError):
        # Every 9 bytes encode to 12 characters, without padding.
        text = base64.urlsafe_b64encode(os.urandom(9 * BATCH)).decode()
        return _refill(_TOKENS, text, OWNER_TOKEN_CHARS)


def _refill(kind: int | str, text: str, size: int) -> str:
    """Cut ``text`` into identifiers of ``size`` characters: keep all but one for
    later, as the batch of ``kind``, and return that one."""
    batch = [text[at : at + size] for at in range(0, len(text), size)]
    mine = batch.pop()
    _unused[kind] = batch
    return mine


def _counter() -> itertools.count[int]:
    return itertools.count(secrets.randbelow(_REQUEST_SPAN))


# ``next()`` on it is atomic: threads never get the same number.
_requests = _counter()


def request_id() -> str:
    """A fresh id for one state-changing request (sent again as is on a retry).

    Ids count up within a process, so one never repeats the one before it (a
    holder's next request always differs from its last); processes start at
    random places, :data:`REQUEST_ID_DIGITS` digits each.
    """
    return str(_REQUEST_FIRST + next(_requests) % _REQUEST_SPAN)


def _forked() -> None:
    global _requests
    _unused.clear()
    _requests = _counter()


os.register_at_fork(after_in_child=_forked)
