"""A waiter's subscription to a lock's release channel, on a bounded connection.

A waiter subscribes *before* it re-checks the lock, so a release between the two
is not missed, then waits for a release message or for the holder's remaining
TTL. The subscription has a connection of its own (from the lock's
:class:`~celery_redislock.transport.Transport`), so every step is bounded: a
broken or stalled connection raises instead of hanging, and the waiter
re-subscribes and re-checks.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

from celery_redislock.transport import Deadline, Transport


class Subscription:
    """One subscriber connection to one channel.

    Arguments:
        transport: where to connect.
        channel: the channel to listen on.
    """

    def __init__(self, transport: Transport, channel: str) -> None:
        self.transport = transport
        self.channel = channel
        self._conn: Any = None

    @property
    def active(self) -> bool:
        """Whether the subscription is in place (confirmed by the server)."""
        return self._conn is not None

    def open(self, deadline: Deadline) -> None:
        """Connect, subscribe and wait for the server's confirmation.

        Raises:
            redis.ConnectionError, redis.TimeoutError: not subscribed by ``deadline``.
        """
        self.close()
        conn = self.transport.connection(deadline)
        try:
            self.transport.bound(conn, deadline.remaining())
            conn.send_command("SUBSCRIBE", self.channel, check_health=False)
            while True:
                self.transport.bound(conn, deadline.remaining())
                reply = conn.read_response()
                if isinstance(reply, list) and reply[:1] == [b"subscribe"]:
                    break
        except BaseException:
            conn.disconnect()
            raise
        self._conn = conn

    def wait(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for a message; return whether one arrived.

        Raises:
            redis.ConnectionError: the connection broke (the subscription is closed).
        """
        conn = self._conn
        if conn is None:
            raise RedisConnectionError("not subscribed")
        deadline = Deadline.after(seconds)
        try:
            while True:
                remaining = deadline.remaining()
                if remaining <= 0 or not conn.can_read(timeout=remaining):
                    return False
                reply = conn.read_response()
                if isinstance(reply, list) and reply[:1] == [b"message"]:
                    return True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Drop the connection (the server forgets the subscription with it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.disconnect()
