"""The packet layer between network namespaces: every endpoint of a run lives in a network namespace of its own, and
its QUIC datagrams cross to the others only through this bridge, which impairs them on the way out.

Why namespaces: QUIC endpoints (iroh) tell each other the addresses their sockets are bound to and switch to
whichever path answers fastest. On one shared network a proxy in front of a socket is therefore bypassed within a
second. In a namespace of its own, an endpoint's socket is reachable by nothing but its own bridge.

How it crosses: the run picks two ports per endpoint (``ppharness.network.packet.plan_ports``): ``quic`` (where
the endpoint binds its socket) and ``virtual`` (the port it advertises, in its ticket). In every namespace, the
bridge binds, on 127.0.0.1, the virtual port of every *other* endpoint: to an endpoint, its peers live at
127.0.0.1:<their virtual port>, which is its own bridge. A datagram the endpoint sends to a peer's virtual port is
read by the bridge, goes through the link's impairment (``LinkShaper``: loss, delay, jitter, rate cap, duplication,
reordering; dropped while a partition holds), and is passed, when due, to the peer's bridge over a Unix datagram
socket (``<dir>/<node>.sock``: a file, reachable across namespaces). The peer's bridge hands it to its endpoint's
QUIC socket from the socket that stands for the sender. Each endpoint impairs what it sends, as the message layer
does.

One daemon thread per bridge: ``select.select`` over the UDP sockets, the Unix socket and a wake-up pipe
(microsecond timeouts), and a heap of datagrams due. Memory is bounded (``max_queued`` datagrams, ``max_queued_bytes``
bytes; beyond that a datagram is dropped and counted as ``overflow``). A datagram from a port other than the
endpoint's own, or a frame from the Unix socket that names no peer, is dropped and counted: nothing a stranger sends
goes anywhere.
"""

from __future__ import annotations

import heapq
import os
import select
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from ppharness.network.clock import EventClock
from ppharness.network.spec import Network
from ppharness.network.udp import (
    FD_SETSIZE,
    MAX_DATAGRAM,
    MAX_QUEUED,
    MAX_QUEUED_BYTES,
    RECV_BURST,
    LinkStats,
    _Link,
    _tune,
    recv_stamped,
)

NAME_BYTES = 32  # a frame on the Unix socket: the sender's name, NUL-padded to this, then the datagram
JOIN_TIMEOUT_S = 5.0


def socket_path(directory: str | os.PathLike[str], node: str) -> str:
    return str(Path(directory) / f"{node}.sock")


class Bridge:
    """One endpoint's side of the packet layer (see the module's docstring).

    ``table``: every endpoint's ``(quic port, virtual port)`` by node name; ``directory``: where the run's Unix
    sockets live; ``clock``: the run's event clock (partitions). ``start()`` binds everything and starts the thread;
    ``close()`` stops it (idempotent); ``stats()`` gives per-link counters keyed by ``(src, dst)``.
    """

    def __init__(
        self,
        network: Network,
        node: str,
        table: Mapping[str, tuple[int, int]],
        directory: str | os.PathLike[str],
        clock: EventClock | None = None,
        *,
        host: str = "127.0.0.1",
        max_queued: int = MAX_QUEUED,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        if node not in table:
            raise ValueError(f"the port table has no entry for {node}")
        if any(len(name.encode()) > NAME_BYTES for name in table):
            raise ValueError(f"node names are at most {NAME_BYTES} bytes")
        self.network, self.node, self.clock, self.host = network, node, clock, host
        self.table = dict(table)
        self.directory = str(directory)
        self.max_queued, self.max_queued_bytes = max_queued, max_queued_bytes
        self.quic_port = self.table[node][0]
        self._peers = [name for name in self.table if name != node]
        self._udp: dict[str, socket.socket] = {}  # peer -> the socket standing for it here
        self._by_sock: dict[socket.socket, str] = {}
        self._unix: socket.socket | None = None
        self._links: dict[str, _Link] = {}  # peer -> the link node -> peer
        self._heap: list[tuple[float, int, bytes, str, _Link]] = []
        self._queued_bytes = 0
        self._seq = 0
        self._partitions = any(e.kind == "partition" for e in network.events)
        self.foreign = 0  # datagrams from anything but this endpoint, frames naming no peer
        self.errors = 0
        self._lock = threading.Lock()
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False

    # --- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> None:
        path = socket_path(self.directory, self.node)
        try:
            for peer in self._peers:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                self._udp[peer] = s
                self._by_sock[s] = peer
                _tune(s)
                s.bind((self.host, self.table[peer][1]))
                s.setblocking(False)
            if os.path.exists(path):
                os.unlink(path)
            unix = self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                try:
                    unix.setsockopt(socket.SOL_SOCKET, option, 4 * 2**20)
                except OSError:
                    pass
            unix.bind(path)
            unix.setblocking(False)
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            fds = [s.fileno() for s in self._udp.values()] + [unix.fileno(), self._wake_r]
            if max(fds) >= FD_SETSIZE:
                raise OSError(f"descriptors beyond {FD_SETSIZE}: select() cannot watch them")
        except BaseException:
            self._close_sockets()
            raise
        for peer in self._peers:
            self._links[peer] = _Link(self.network, self.node, peer)
        self._thread = threading.Thread(target=self._run, name=f"bridge-{self.node}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = self._stop = True
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in self._udp.values():
            s.close()
        self._udp.clear()
        self._by_sock.clear()
        if self._unix is not None:
            self._unix.close()
            try:
                os.unlink(socket_path(self.directory, self.node))
            except OSError:
                pass
            self._unix = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1
        self._heap.clear()

    def __enter__(self) -> Bridge:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stats(self) -> dict[tuple[str, str], LinkStats]:
        with self._lock:
            return {(self.node, peer): link.snapshot() for peer, link in self._links.items()}

    # --- the thread --------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        unix = self._unix
        assert unix is not None
        while not self._stop:
            timeout = max(0.0, self._heap[0][0] - time.monotonic()) if self._heap else None
            try:
                readable: list[int | socket.socket] = [self._wake_r, unix, *self._by_sock]
                ready, _, _ = select.select(readable, [], [], timeout)
            except (OSError, ValueError):
                if self._stop:
                    return
                self.errors += 1
                time.sleep(0.001)
                continue
            try:
                for r in ready:
                    if r is unix:
                        self._from_peers(unix)
                    elif isinstance(r, socket.socket):
                        self._from_endpoint(r)
                    else:
                        os.read(self._wake_r, 64)
                self._send_due(unix)
            except Exception:  # the bridge outlives whatever one datagram brings
                self.errors += 1

    def _from_endpoint(self, sock: socket.socket) -> None:
        """Datagrams this endpoint sent to a peer: onto the link, into the heap."""
        peer = self._by_sock[sock]
        link = self._links[peer]
        for _ in range(RECV_BURST):
            try:
                payload, addr, arrived = recv_stamped(sock)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.errors += 1
                return
            if int(addr[1]) != self.quic_port:
                self.foreign += 1
                continue
            self._offer(link, peer, payload, arrived)

    def _offer(self, link: _Link, peer: str, payload: bytes, now: float) -> None:
        with self._lock:
            link.stats.sent += 1
            if self._partitions and self.clock is not None:
                t = self.clock.elapsed()
                if t is not None and self.network.cut(self.node, peer, t - max(0.0, time.monotonic() - now)):
                    link.stats.cut += 1
                    return
            for due in link.shaper.fate(len(payload), now):
                if len(self._heap) >= self.max_queued or self._queued_bytes + len(payload) > self.max_queued_bytes:
                    link.stats.overflow += 1
                    continue
                self._seq += 1
                heapq.heappush(self._heap, (due, self._seq, payload, peer, link))
                self._queued_bytes += len(payload)

    def _send_due(self, unix: socket.socket) -> None:
        header = self.node.encode().ljust(NAME_BYTES, b"\0")
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _, _, payload, peer, link = heapq.heappop(self._heap)
            self._queued_bytes -= len(payload)
            try:
                unix.sendto(header + payload, socket_path(self.directory, peer))
                ok = True
            except OSError:  # the peer's bridge is gone or its buffer full: the datagram is lost, as on a wire
                ok = False
            with self._lock:
                if ok:
                    link.stats.delivered += 1
                else:
                    link.stats.send_errors += 1
            if self._heap and self._heap[0][0] > now:
                now = time.monotonic()

    def _from_peers(self, unix: socket.socket) -> None:
        """Frames from the other bridges: hand each datagram to this endpoint from the socket standing for its
        sender."""
        for _ in range(RECV_BURST):
            try:
                frame = unix.recv(NAME_BYTES + MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.errors += 1
                return
            sender = frame[:NAME_BYTES].rstrip(b"\0").decode(errors="replace")
            sock = self._udp.get(sender)
            if sock is None or len(frame) <= NAME_BYTES:
                self.foreign += 1
                continue
            try:
                sock.sendto(frame[NAME_BYTES:], (self.host, self.quic_port))
            except OSError:
                self.errors += 1
