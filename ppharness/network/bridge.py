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

A link's delay counts from the datagram's arrival as the kernel stamped it (``ppharness.network.datagram``), and a
partition is judged at that arrival, with the time from the run's ``EventClock`` (before it starts, or without one,
no event holds). The link's shaper is seeded with the run's seed and the link's name, so the k-th datagram on a link
meets the same fate in every run with that seed. ``ppharness bench wan --calibrate`` measures how faithfully two
bridges apply delay, loss and rate caps.

A Unix datagram socket queues only a few datagrams for its reader (``net.unix.max_dgram_qlen``, 10 by default), so a
burst outruns a peer's bridge however quickly it reads. What its socket cannot take yet waits, in order, in a backlog
per peer (a socket connected to the peer's, which the kernel says is writable again once the peer has read) of at
most ``SOCKET_BUFFER`` bytes, as it would in a socket buffer; beyond that, or when the peer's bridge is not there, a
datagram is lost and counted as ``send_errors``.

One daemon thread per bridge: ``select.select`` over the UDP sockets, the Unix sockets and a wake-up pipe
(microsecond timeouts), and a heap of datagrams due. Memory is bounded (``max_queued`` datagrams, ``max_queued_bytes``
bytes waiting for their time; beyond that a datagram is dropped and counted as ``overflow``). A datagram from a port
other than the endpoint's own, or a frame from the Unix socket that names no peer, is dropped and counted
(``foreign``): nothing a stranger sends goes anywhere.
"""

from __future__ import annotations

import heapq
import os
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from ppharness.network.clock import EventClock
from ppharness.network.datagram import (
    FD_SETSIZE,
    MAX_DATAGRAM,
    MAX_QUEUED,
    MAX_QUEUED_BYTES,
    RECV_BURST,
    SOCKET_BUFFER,
    recv_stamped,
    set_buffers,
    tune,
)
from ppharness.network.shaper import LinkStats, ShapedLink
from ppharness.network.spec import Network

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
        self._unix: socket.socket | None = None  # where the other bridges' frames arrive
        self._out: dict[str, socket.socket] = {}  # peer -> a socket connected to its bridge's
        self._backlog: dict[str, deque[tuple[bytes, ShapedLink]]] = {peer: deque() for peer in self._peers}
        self._backlog_bytes = dict.fromkeys(self._peers, 0)
        self._header = node.encode().ljust(NAME_BYTES, b"\0")
        self._links: dict[str, ShapedLink] = {}  # peer -> the link node -> peer
        self._heap: list[tuple[float, int, bytes, str, ShapedLink]] = []
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
                tune(s)
                s.bind((self.host, self.table[peer][1]))
                s.setblocking(False)
            if os.path.exists(path):
                os.unlink(path)
            unix = self._unix = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            set_buffers(unix)
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
            self._links[peer] = ShapedLink(self.network, self.node, peer, "packet")
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
        for s in self._out.values():
            s.close()
        self._out.clear()
        for backlog in self._backlog.values():
            backlog.clear()
        self._backlog_bytes = dict.fromkeys(self._peers, 0)
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
            waiting = [self._out[peer] for peer, backlog in self._backlog.items() if backlog and peer in self._out]
            try:
                readable: list[int | socket.socket] = [self._wake_r, unix, *self._by_sock]
                ready, writable, _ = select.select(readable, waiting, [], timeout)
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
                for peer, backlog in self._backlog.items():
                    if backlog and self._out.get(peer) in writable:
                        self._flush(peer)
                self._send_due()
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

    def _offer(self, link: ShapedLink, peer: str, payload: bytes, now: float) -> None:
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

    def _send_due(self) -> None:
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _, _, payload, peer, link = heapq.heappop(self._heap)
            self._queued_bytes -= len(payload)
            if self._backlog[peer] or not self._pass(peer, payload, link):
                self._hold(peer, payload, link)
            if self._heap and self._heap[0][0] > now:
                now = time.monotonic()

    def _hold(self, peer: str, payload: bytes, link: ShapedLink) -> None:
        """Keep a datagram until ``peer``'s bridge can take it, behind those already waiting."""
        if self._backlog_bytes[peer] + len(payload) > SOCKET_BUFFER:
            with self._lock:  # the peer's bridge has not read for a while: lost, as from a full socket buffer
                link.stats.send_errors += 1
            return
        self._backlog[peer].append((payload, link))
        self._backlog_bytes[peer] += len(payload)

    def _flush(self, peer: str) -> None:
        """What waits for ``peer``'s bridge, in order, until its socket is full again."""
        backlog = self._backlog[peer]
        while backlog:
            payload, link = backlog[0]
            if not self._pass(peer, payload, link):
                return
            backlog.popleft()
            self._backlog_bytes[peer] -= len(payload)

    def _pass(self, peer: str, payload: bytes, link: ShapedLink) -> bool:
        """Pass one datagram to ``peer``'s bridge: True when done with it (passed on, or lost), False when the peer's
        socket is full for now (it has not read the datagrams before)."""
        try:
            sock = self._out.get(peer) or self._connect(peer)
            sock.send(self._header + payload)
            ok = True
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:  # the peer's bridge is not there (yet, or any more): the datagram is lost, as on a wire
            dead = self._out.pop(peer, None)
            if dead is not None:
                dead.close()
            ok = False
        with self._lock:
            if ok:
                link.stats.delivered += 1
            else:
                link.stats.send_errors += 1
        return True

    def _connect(self, peer: str) -> socket.socket:
        """A socket connected to ``peer``'s bridge: the kernel then says when a full one can take more."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if sock.fileno() >= FD_SETSIZE:
                raise OSError(f"a descriptor beyond {FD_SETSIZE}: select() cannot watch it")
            set_buffers(sock)
            sock.setblocking(False)
            sock.connect(socket_path(self.directory, peer))
        except BaseException:
            sock.close()
            raise
        self._out[peer] = sock
        return sock

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
