"""Ctrl-C and SIGTERM end a run cleanly.

The handler raises ``KeyboardInterrupt`` and also remembers the request: an
exception raised while Python runs a finalizer (``__del__``) is printed and
dropped, so the run's wait loops call :func:`check` to raise it again.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

_requested = threading.Event()


def _handler(signum: int, frame: FrameType | None) -> None:
    _requested.set()
    raise KeyboardInterrupt


def install() -> None:
    """Route SIGINT and SIGTERM to :class:`KeyboardInterrupt` (main thread only)."""
    _requested.clear()
    signal.signal(signal.SIGINT, _handler)
    signal.signal(signal.SIGTERM, _handler)


def check() -> None:
    """Raise ``KeyboardInterrupt`` if a stop was requested (even one that got lost)."""
    if _requested.is_set():
        raise KeyboardInterrupt
