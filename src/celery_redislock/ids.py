"""Random identifiers for requests and owners, without a system call each.

Every acquire and release carries a fresh request id, and every task execution a
fresh owner token: two or three per task, each a read of the kernel's random
source when taken one at a time. They are read here in batches instead and
handed out one by one. A forked child drops what its parent had read, so no
identifier is ever handed out in two processes.
"""

from __future__ import annotations

import os

#: How many identifiers of one size one read of the random source makes.
BATCH = 128

# Unused identifiers, per size in hex digits. ``list.pop`` is atomic, so threads
# share a batch without a lock: each identifier goes to one caller only.
_unused: dict[int, list[str]] = {}


def random_hex(digits: int) -> str:
    """``digits`` random hex digits (an even number), as ``secrets.token_hex`` gives."""
    try:
        return _unused[digits].pop()
    except (KeyError, IndexError):
        pass
    text = os.urandom(digits // 2 * BATCH).hex()
    batch = [text[at : at + digits] for at in range(0, len(text), digits)]
    mine = batch.pop()
    _unused[digits] = batch
    return mine


os.register_at_fork(after_in_child=_unused.clear)
