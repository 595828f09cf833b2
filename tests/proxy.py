"""A loopback TCP proxy that injects network faults between a client and a server.

Fault tests point a client at :class:`FaultProxy` instead of at the server and
switch faults on and off from the test thread::

    with FaultProxy(server.host, server.port) as proxy:
        client = redis.Redis.from_url(proxy.url, socket_timeout=1.0)
        proxy.drop_replies(1)      # the next reply is lost and its connection reset

Each accepted client connection gets its own fresh connection to the target and
one thread that moves bytes both ways with ``select``. That thread owns both
sockets; the control methods only change shared settings or ask it to act, so
they are safe to call from any thread at any time. Unless a method says
otherwise, a fault applies to open connections and to new ones alike.
"""

from __future__ import annotations

import math
import select
import socket
import struct
import threading
import time
from collections import deque
from types import TracebackType

#: How often an idle connection thread looks at the fault settings, in seconds.
_POLL = 0.02
#: Bound on a blocking send or connect, so a stuck peer cannot hang a thread forever.
_IO_TIMEOUT = 5.0


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with an RST instead of a FIN, so its peer sees ECONNRESET."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _readable(sockets: list[socket.socket], timeout: float) -> list[socket.socket]:
    """Those of ``sockets`` that can be read (or have closed or failed) within
    ``timeout`` seconds. ``poll``, not ``select``: a long test session may number
    its sockets past 1023, which ``select`` refuses."""
    poller = select.poll()
    by_number = {}
    for sock in sockets:
        poller.register(sock, select.POLLIN)
        by_number[sock.fileno()] = sock
    return [by_number[number] for number, _ in poller.poll(math.ceil(timeout * 1000))]


class _Link:
    """One proxied client connection and the thread forwarding it."""

    def __init__(self, proxy: FaultProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.stop_requested = False
        self.reset_requested = False
        # Its client side is to be reset, what hold_next() held kept (cut_held).
        self.cut_requested = False
        # Whether a request held here waits to be let through; set once the client
        # side has been cut.
        self.holding = False
        self.cut = threading.Event()
        # A black hole of this connection's own (see FaultProxy.silence_open).
        self.silenced = False
        # The reply to the request just forwarded is to be lost (drop_reply_to).
        self.drop_next_reply = False
        # How many times the proxy let held requests through, as this link last saw.
        self.let_through = proxy.let_through_count
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="fault-proxy-link", daemon=True)

    def _run(self) -> None:
        try:
            upstream = socket.create_connection(self.proxy.target, timeout=_IO_TIMEOUT)
        except OSError:
            _reset(self.client)
            self.done.set()
            return
        try:
            self._forward(upstream)
        finally:
            upstream.close()
            self.done.set()

    @property
    def dark(self) -> bool:
        """Whether this connection forwards nothing now."""
        return self.proxy.blackholed or self.silenced

    def _forward(self, upstream: socket.socket) -> None:
        """Move bytes both ways until a side closes, a fault resets, or the proxy stops."""
        proxy, client = self.proxy, self.client
        client.settimeout(_IO_TIMEOUT)
        # Chunks waiting out the latency: (due time, bytes), per direction.
        to_server: deque[tuple[float, bytes]] = deque()
        to_client: deque[tuple[float, bytes]] = deque()
        client_open = upstream_open = True
        while True:
            if self.reset_requested:
                _reset(client)
                return
            if self.cut_requested and not self.cut.is_set():
                # The client sees its connection broken; what was held still goes
                # to the server once let through, and the server's replies are lost.
                if client_open:
                    _reset(client)
                    client_open = False
                to_client.clear()
                self.cut.set()
            if self.stop_requested:
                client.close()
                return
            # A side that hung up ends the link once what it sent is delivered; a
            # black hole hides the server's close from the client.
            if (not client_open and not to_server) or (
                not upstream_open and not to_client and not self.dark
            ):
                client.close()
                return
            if self.let_through != proxy.let_through_count:
                # Held chunks (due never) are due now, in the order they came.
                self.let_through = proxy.let_through_count
                now = time.monotonic()
                to_server = deque((min(due, now), data) for due, data in to_server)
            wait = _POLL
            for queue in (to_server, to_client):
                if queue:
                    wait = min(wait, max(0.0, queue[0][0] - time.monotonic()))
            readable = [
                s for s, is_open in ((client, client_open), (upstream, upstream_open)) if is_open
            ]
            ready = _readable(readable, wait)
            try:
                if client in ready:
                    data = client.recv(65536)
                    client_open = bool(data)
                    if data and proxy.take_marked(data):
                        self.drop_next_reply = True
                    if data and not self.dark:
                        held_here = proxy.take_held()
                        self.holding = self.holding or held_here
                        due = math.inf if held_here else time.monotonic() + proxy.latency
                        to_server.append((due, data))
                if upstream in ready:
                    data = upstream.recv(65536)
                    upstream_open = bool(data)
                    if data and (self.drop_next_reply or proxy.take_drop()):
                        # The reply exists, so the server ran the command: lose it.
                        _reset(client)
                        return
                    if data and not self.dark and not self.cut.is_set():
                        to_client.append((time.monotonic() + proxy.latency, data))
                self._flush(to_server, upstream, to_server=True)
                self._flush(to_client, client, to_server=False)
            except OSError:
                client.close()
                return

    def _flush(
        self, queue: deque[tuple[float, bytes]], sock: socket.socket, to_server: bool
    ) -> None:
        """Send every chunk of ``queue`` that is due; a black hole discards them instead."""
        while queue and queue[0][0] <= time.monotonic():
            _, data = queue.popleft()
            if self.dark:
                continue
            sock.sendall(data)
            if to_server:
                self.proxy.count_to_server(len(data))


class FaultProxy:
    """Forward TCP connections from a free 127.0.0.1 port to ``target_host:target_port``.

    Faults (all thread-safe, all cleared by :meth:`heal`):

    * :meth:`set_latency` delays every chunk in both directions;
    * :meth:`reset_all` resets every open connection once;
    * :meth:`drop_replies` lets requests through but loses replies and resets;
    * :meth:`drop_reply_to` does that to the reply to a request naming a marker;
    * :meth:`hold_next` keeps the next request at the proxy until let through;
    * :meth:`cut_held` resets the connections of held requests, which still
      reach the server once let through;
    * :meth:`refuse` resets new connections as soon as they are accepted;
    * :meth:`close_port` stops listening, so the system refuses new connections;
    * :meth:`blackhole` forwards nothing and closes nothing;
    * :meth:`silence_open` does that to the connections open now only, as a
      middlebox that forgot them would: new connections work.
    """

    host = "127.0.0.1"

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.latency = 0.0
        self.blackholed = False
        self.refusing = False
        self._drops_left: int | None = 0  # None: drop every reply until heal()
        self._close_after_drops = False
        # drop_reply_to(): the marker, how many such requests pass first, how many
        # replies to lose.
        self._marker = b""
        self._marked_skip = 0
        self._marked_left = 0
        self.marked_drops = 0
        # hold_next(): how many chunks are still to be held; how many were held, and
        # how many times they were let through.
        self._hold_left = 0
        self.held = 0
        self.let_through_count = 0
        self._guard = threading.Lock()
        self._links: list[_Link] = []
        self._accepted = 0
        self._to_server = 0
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------

    def start(self) -> FaultProxy:
        """Listen on a free port (the same as before, once it had one) and start
        accepting connections."""
        if self._listener is not None:
            return self
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._stopping.clear()
        self._acceptor = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stop listening, close every connection and join every thread."""
        self._close_port()
        with self._guard:
            links, self._links = self._links, []
        for link in links:
            link.stop_requested = True
        for link in links:
            link.thread.join(_IO_TIMEOUT * 2)

    def _close_port(self) -> None:
        self._stopping.set()
        acceptor, self._acceptor = self._acceptor, None
        if acceptor is not None and acceptor is not threading.current_thread():
            acceptor.join(_IO_TIMEOUT)
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            ready = _readable([self._listener], _POLL)
            if not ready:
                continue
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            with self._guard:
                self._accepted += 1
                self._links = [link for link in self._links if not link.done.is_set()]
                if self.refusing:
                    _reset(client)
                    continue
                link = _Link(self, client)
                self._links.append(link)
            link.thread.start()

    # -- addresses -------------------------------------------------------

    def url_for(self, db: int = 0) -> str:
        """``redis://127.0.0.1:PORT/DB`` for clients that should go through the proxy."""
        return f"redis://{self.host}:{self.port}/{db}"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT/0``."""
        return self.url_for(0)

    # -- faults ----------------------------------------------------------

    def set_latency(self, seconds: float) -> None:
        """Delay every chunk read from now on, in both directions, by ``seconds`` (0: off)."""
        if seconds < 0:
            raise ValueError("latency cannot be negative")
        self.latency = seconds

    def reset_all(self, timeout: float = _IO_TIMEOUT) -> None:
        """Reset every open connection (RST to the client, close to the server) and wait for it.

        New connections are unaffected and work normally.
        """
        links = self._open_links()
        for link in links:
            link.reset_requested = True
        for link in links:
            link.done.wait(timeout)

    def drop_replies(self, count: int | None = None, then_close_port: bool = False) -> None:
        """Lose server replies: requests still reach the server and run, replies never arrive.

        The proxy reads what the server sent (so the command has run), discards
        it and resets that client connection with an RST: the client gets a
        connection error for a command that took effect. Each such read counts
        as one dropped reply; after ``count`` of them forwarding is normal
        again (``None``: keep dropping until :meth:`heal`). A reply to a
        connection handshake (such as ``CLIENT SETINFO``) counts too, so open
        the client's connection before calling this. With ``then_close_port``,
        the last of the ``count`` drops does :meth:`close_port` before the client
        learns of it: its next tries cannot connect.
        """
        if count is not None and count < 0:
            raise ValueError("count cannot be negative")
        with self._guard:
            self._drops_left = count
            self._close_after_drops = then_close_port

    def take_drop(self) -> bool:
        """Whether the reply just read from the server is to be dropped (uses up one drop)."""
        with self._guard:
            if self._drops_left is None:
                return True
            if self._drops_left == 0:
                return False
            self._drops_left -= 1
            close = self._drops_left == 0 and self._close_after_drops
        if close:
            self._close_port()
        return True

    def drop_reply_to(self, marker: bytes, count: int = 1, skip: int = 0) -> None:
        """Lose the replies to the next ``count`` requests whose bytes contain
        ``marker``, after ``skip`` of them went through, as :meth:`drop_replies`
        does: each runs on the server, and its connection is reset before the reply
        arrives. For a client that waits for each reply before its next request
        (no pipelining); :attr:`marked_drops` counts the replies lost so."""
        if count < 0 or skip < 0:
            raise ValueError("count and skip cannot be negative")
        with self._guard:
            self._marker, self._marked_skip, self._marked_left = marker, skip, count

    def take_marked(self, data: bytes) -> bool:
        """Whether the reply to the request ``data`` is to be lost (uses up one
        drop of :meth:`drop_reply_to`)."""
        with self._guard:
            if self._marked_left == 0 or self._marker not in data:
                return False
            if self._marked_skip:
                self._marked_skip -= 1
                return False
            self._marked_left -= 1
            self.marked_drops += 1
            return True

    def hold_next(self, count: int = 1) -> None:
        """Keep the next ``count`` chunks any client sends at the proxy (and what
        follows each on its connection) until :meth:`let_held_through`: as on a path
        that delays one request, which reaches the server later than requests sent
        after it on other connections. :attr:`held` counts the chunks held so."""
        if count < 0:
            raise ValueError("count cannot be negative")
        with self._guard:
            self._hold_left = count

    def take_held(self) -> bool:
        """Whether the chunk just read from a client is to be held (uses up one
        of :meth:`hold_next`)."""
        with self._guard:
            if self._hold_left == 0:
                return False
            self._hold_left -= 1
            self.held += 1
            return True

    def let_held_through(self) -> None:
        """Send the chunks :meth:`hold_next` held on to the server, in order."""
        with self._guard:
            self._hold_left = 0
            self.let_through_count += 1

    def cut_held(self, timeout: float = _IO_TIMEOUT) -> int:
        """Reset (RST) the client side of every open connection that has a request
        :meth:`hold_next` holds, but keep that request, to reach the server when
        :meth:`let_held_through` (the server's replies are lost): a request held
        up on the network while its sender sees the connection broken and sends
        it again on another. Returns how many connections were cut."""
        links = [link for link in self._open_links() if link.holding and not link.cut.is_set()]
        for link in links:
            link.cut_requested = True
        for link in links:
            link.cut.wait(timeout)
        return len(links)

    def refuse(self) -> None:
        """Reset each new connection right after accepting it; open ones keep working."""
        self.refusing = True

    def close_port(self) -> None:
        """Stop listening: the system refuses new connections, as when nothing
        listens on the port; open ones keep working. :meth:`heal` listens again
        on the same port."""
        self._close_port()

    def blackhole(self) -> None:
        """Forward nothing either way, on open and new connections, and close nothing.

        Bytes read while the black hole lasts are discarded, so clients wait until
        their own timeouts. A server closing its side is not passed on either.
        """
        self.blackholed = True

    def silence_open(self) -> int:
        """Forward nothing either way on the connections open now, for good, and
        close nothing; new connections work. Returns how many were silenced."""
        links = self._open_links()
        for link in links:
            link.silenced = True
        return len(links)

    def heal(self) -> None:
        """Clear every fault: no latency, no drops, no refusing, no black hole, no
        request held.

        Connections that lived through a black hole forward again, but the bytes
        it swallowed are gone, so their protocol streams are usually out of step;
        clients that timed out have dropped those connections already, and new
        connections are fine.
        """
        with self._guard:
            self._drops_left = 0
            self._close_after_drops = False
            self._marked_left = 0
        self.let_held_through()
        self.latency = 0.0
        self.refusing = False
        self.blackholed = False
        self.start()

    # -- counters --------------------------------------------------------

    def count_to_server(self, size: int) -> None:
        """Add ``size`` bytes to :attr:`bytes_to_server`."""
        with self._guard:
            self._to_server += size

    @property
    def connections_accepted(self) -> int:
        """Client connections accepted so far, including refused ones."""
        with self._guard:
            return self._accepted

    @property
    def bytes_to_server(self) -> int:
        """Bytes delivered to the target so far, over every connection."""
        with self._guard:
            return self._to_server

    def active_connections(self) -> int:
        """Client connections currently open through the proxy."""
        return len(self._open_links())

    def _open_links(self) -> list[_Link]:
        with self._guard:
            return [link for link in self._links if not link.done.is_set()]
