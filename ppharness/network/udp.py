"""The packet-level emulation layer: a userspace UDP proxy that impairs the datagrams of one local UDP socket.

An iroh (QUIC) endpoint talks over one UDP socket. ``UdpImpairer`` sits in front of it: peers send to the proxy's
listen address instead of the endpoint's, and the proxy forwards every datagram to the endpoint (``target``) from an
upstream socket of its own, one per client address. The endpoint therefore sees a distinct source per peer and
answers to that upstream socket; the proxy forwards each answer back to the peer from the listen socket::

    peer (client) --> listen socket --[client -> node]--> upstream socket (one per client) --> target
    peer (client) <-- listen socket <--[node -> client]-- upstream socket (one per client) <-- target

A client is named by its source port: ``peers`` maps ports to node names (``stage-<i>``, ``seed``; ports are unique
within a run), and an unlisted port is ``unknown``. Each direction of each link has its own ``LinkShaper``
(``ppharness.network.shaper``) seeded with ``link_rng(network.seed, src, dst, "packet")``, so the k-th datagram on a
link meets the same fate (lost, duplicated, held back) in every run with that seed. A datagram on a link that
``network.cut(src, dst, t)`` says is partitioned, with ``t`` from the run's ``EventClock``, is dropped before it
enters the link: it takes no draw from the link's generator and no room behind its rate cap. Before the clock
starts, or without a clock, no event holds.

Time on a link counts from the datagram's arrival as the kernel stamped it (``recv_stamped``; Linux's
SO_TIMESTAMPNS), not from when the thread got round to reading it, so a thread that wakes late does not add its
lateness to the configured delay; partitions are judged at that arrival too. Sending is only as punctual as the
thread's wake-ups: on an idle machine a fraction of a millisecond late, on a busy one (other processes on every
core) up to a few milliseconds at times. ``ppharness bench wan --calibrate`` measures it.

One daemon thread does everything: ``select.select`` over the listen socket, the upstream sockets and a wake-up
pipe (select's timeout has microsecond resolution, epoll's milliseconds; select takes descriptors below 1024 only),
and a heap of ``(due, seq, socket, payload, destination, link)`` on ``time.monotonic()``, each sent when it falls
due, never before; ``seq`` keeps datagrams due at the same instant in the order they came. Memory is bounded: at
most ``max_clients`` upstream sockets (datagrams from further clients are refused and counted) and at most
``max_queued`` datagrams or ``max_queued_bytes`` bytes waiting in the heap (beyond that a datagram is dropped and
counted as ``overflow`` on its link). A send or receive error is counted and the thread goes on; nothing a peer
sends can stop it.
"""

from __future__ import annotations

import heapq
import os
import platform
import select
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, fields
from typing import Any

from ppharness.network.clock import EventClock
from ppharness.network.shaper import LinkShaper, link_rng
from ppharness.network.spec import Network

UNKNOWN_NODE = "unknown"
MAX_DATAGRAM = 65_535
MAX_CLIENTS = 256
MAX_QUEUED = 65_536  # datagrams waiting in the heap
MAX_QUEUED_BYTES = 64 * 2**20
SOCKET_BUFFER = 4 * 2**20  # asked of the kernel for every socket (it caps this at net.core.[rw]mem_max)
RECV_BURST = 256  # datagrams read from one socket per wake-up before due sends get their turn
JOIN_TIMEOUT_S = 5.0
FD_SETSIZE = 1024  # select() takes descriptors below this only

_Address = tuple[Any, ...]  # a socket address: (host, port), or (host, port, flowinfo, scope_id) for IPv6


@dataclass
class LinkStats:
    """What one directed link did to the datagrams that crossed the proxy.

    ``sent``: datagrams the proxy took for this link (cut ones included); ``lost``, ``duplicated``, ``reordered``,
    ``dropped_by_queue``: the link's shaper's counts (random or bursty loss, an extra copy, held back, tail drop
    behind the rate cap); ``cut``: dropped by a partition; ``overflow``: dropped because the proxy's heap was full;
    ``delivered``: copies handed to the kernel; ``send_errors``: copies the kernel refused.
    """

    sent: int = 0
    lost: int = 0
    duplicated: int = 0
    reordered: int = 0
    dropped_by_queue: int = 0
    cut: int = 0
    overflow: int = 0
    delivered: int = 0
    send_errors: int = 0


@dataclass
class ProxyStats:
    """The proxy as a whole: clients served; datagrams refused (from a client beyond ``max_clients``, or one that no
    socket could be opened for); failed receives; anything else that went wrong in the thread, after which it went on
    (``errors``, the last one described in ``last_error``)."""

    clients: int = 0
    refused: int = 0
    recv_errors: int = 0
    errors: int = 0
    last_error: str = ""


class _Link:
    """One directed link's shaper and counters."""

    def __init__(self, network: Network, src: str, dst: str) -> None:
        self.src, self.dst = src, dst
        self.shaper = LinkShaper(network.impairment(src, dst), link_rng(network.seed, src, dst, "packet"))
        self.stats = LinkStats()

    def snapshot(self) -> LinkStats:
        s, sh = self.stats, self.shaper
        return LinkStats(
            sent=s.sent,
            lost=sh.lost,
            duplicated=sh.duplicated,
            reordered=sh.reordered,
            dropped_by_queue=sh.dropped_by_queue,
            cut=s.cut,
            overflow=s.overflow,
            delivered=s.delivered,
            send_errors=s.send_errors,
        )


@dataclass
class _Client:
    address: _Address
    upstream: socket.socket
    inbound: _Link  # client -> node
    outbound: _Link  # node -> client


# A datagram waiting for its due time: (due, seq, socket, payload, destination, link). ``seq`` is unique, so the heap
# orders by due time, then by arrival at the proxy, and never compares further; destination None: the socket is
# connected to it.
_Pending = tuple[float, int, socket.socket, bytes, _Address | None, _Link]


class UdpImpairer:
    """A UDP impairment proxy in front of ``target``, the UDP socket of node ``node``.

    ``start()`` binds ``listen`` and returns the bound address (give it to peers instead of ``target``); ``close()``
    stops the thread and closes every socket (idempotent); ``stats()`` gives per-link counters keyed by
    ``(src, dst)``, ``proxy_stats()`` the proxy's own.
    """

    def __init__(
        self,
        network: Network,
        node: str,
        target: tuple[str, int],
        peers: dict[int, str],
        listen: tuple[str, int] = ("127.0.0.1", 0),
        clock: EventClock | None = None,
        *,
        max_clients: int = MAX_CLIENTS,
        max_queued: int = MAX_QUEUED,
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        self.network = network
        self.node = node
        self.target = target
        self.peers = dict(peers)
        self.listen = listen
        self.clock = clock
        self.max_clients = max_clients
        self.max_queued = max_queued
        self.max_queued_bytes = max_queued_bytes
        self._links: dict[tuple[str, str], _Link] = {}
        self._clients: dict[_Address, _Client] = {}
        self._by_upstream: dict[socket.socket, _Client] = {}
        self._heap: list[_Pending] = []
        self._queued_bytes = 0
        self._seq = 0
        self._proxy = ProxyStats()
        self._partitions = any(e.kind == "partition" for e in network.events)
        self._lock = threading.Lock()  # guards the counters against stats() from another thread
        self._state_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._target_addr: _Address | None = None
        self._target_family = socket.AF_INET
        self._wake_r, self._wake_w = -1, -1
        self._thread: threading.Thread | None = None
        self._stop = False
        self._closed = False

    # --- lifecycle ---------------------------------------------------------------------------------------------------

    def start(self) -> tuple[str, int]:
        """Bind the listen socket, start the thread; the bound ``(host, port)`` (the same on a second call)."""
        with self._state_lock:
            if self._closed:
                raise RuntimeError("this UDP impairer is closed; make a new one")
            if self._sock is not None:
                return self.address
            info = socket.getaddrinfo(self.target[0], self.target[1], type=socket.SOCK_DGRAM)[0]
            self._target_family, self._target_addr = info[0], info[4]
            family = socket.AF_INET6 if ":" in self.listen[0] else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            wake_r, wake_w = os.pipe()
            try:
                if max(sock.fileno(), wake_r) >= FD_SETSIZE:
                    raise OSError(
                        f"this process has over {FD_SETSIZE} descriptors open; the UDP impairer's select() "
                        "cannot watch more"
                    )
                _tune(sock)
                sock.bind(self.listen)
                sock.setblocking(False)
                os.set_blocking(wake_r, False)
                os.set_blocking(wake_w, False)
            except BaseException:
                sock.close()
                os.close(wake_r)
                os.close(wake_w)
                raise
            self._sock = sock
            self._wake_r, self._wake_w = wake_r, wake_w
            self._thread = threading.Thread(target=self._run, name=f"udp-impairer-{self.node}", daemon=True)
            self._thread.start()
            return self.address

    @property
    def address(self) -> tuple[str, int]:
        """The bound listen address."""
        if self._sock is None:
            raise RuntimeError("this UDP impairer is not started")
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def close(self) -> None:
        """Stop the thread (waiting for it) and close every socket; what is still waiting is dropped. Idempotent."""
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
            self._stop = True
            thread = self._thread
            if thread is not None:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass
        if thread is not None and thread is not threading.current_thread():
            thread.join(JOIN_TIMEOUT_S)
        with self._state_lock:
            for client in self._clients.values():
                client.upstream.close()
            self._clients.clear()
            self._by_upstream.clear()
            self._heap.clear()
            if self._sock is not None:
                self._sock.close()
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1

    def __enter__(self) -> UdpImpairer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- counters ----------------------------------------------------------------------------------------------------

    def stats(self) -> dict[tuple[str, str], LinkStats]:
        """Per directed link ``(src, dst)``, a snapshot of its counters."""
        with self._lock:
            return {key: link.snapshot() for key, link in self._links.items()}

    def proxy_stats(self) -> ProxyStats:
        with self._lock:
            return ProxyStats(**{f.name: getattr(self._proxy, f.name) for f in fields(ProxyStats)})

    # --- the thread --------------------------------------------------------------------------------------------------

    def _link(self, src: str, dst: str) -> _Link:
        link = self._links.get((src, dst))
        if link is None:
            link = self._links[(src, dst)] = _Link(self.network, src, dst)
        return link

    def _run(self) -> None:
        assert self._sock is not None
        listen = self._sock
        heap = self._heap
        while not self._stop:
            timeout = None
            if heap:
                timeout = max(0.0, heap[0][0] - time.monotonic())
            readable: list[int | socket.socket] = [self._wake_r, listen, *self._by_upstream]
            try:
                ready, _, _ = select.select(readable, [], [], timeout)
            except (OSError, ValueError) as exc:
                if self._stop:
                    return
                with self._lock:
                    self._proxy.errors += 1
                    self._proxy.last_error = f"select: {exc}"
                time.sleep(0.001)
                continue
            if self._stop:
                return
            try:
                for r in ready:
                    if r is listen:
                        self._drain_listen(listen)
                    elif isinstance(r, socket.socket):
                        client = self._by_upstream.get(r)
                        if client is not None:
                            self._drain_upstream(client, listen)
                    else:
                        try:
                            os.read(self._wake_r, 64)
                        except OSError:
                            pass
                self._send_due()
            except Exception as exc:  # the proxy outlives whatever one datagram brings
                with self._lock:
                    self._proxy.errors += 1
                    self._proxy.last_error = f"{type(exc).__name__}: {exc}"

    def _drain_listen(self, listen: socket.socket) -> None:
        for _ in range(RECV_BURST):
            try:
                payload, addr, arrived = recv_stamped(listen)
            except BlockingIOError:
                return
            except OSError:
                with self._lock:
                    self._proxy.recv_errors += 1
                return
            client = self._clients.get(addr)
            if client is None:
                client = self._new_client(addr)
                if client is None:
                    continue
            self._offer(client.inbound, payload, arrived, client.upstream, None)

    def _drain_upstream(self, client: _Client, listen: socket.socket) -> None:
        for _ in range(RECV_BURST):
            try:
                payload, _, arrived = recv_stamped(client.upstream)
            except BlockingIOError:
                return
            except OSError:  # e.g. the target's port is closed (ICMP port unreachable on a connected socket)
                with self._lock:
                    self._proxy.recv_errors += 1
                return
            self._offer(client.outbound, payload, arrived, listen, client.address)

    def _new_client(self, addr: _Address) -> _Client | None:
        if len(self._clients) >= self.max_clients:
            with self._lock:
                self._proxy.refused += 1
            return None
        try:
            upstream = socket.socket(self._target_family, socket.SOCK_DGRAM)
        except OSError:  # out of descriptors
            with self._lock:
                self._proxy.refused += 1
            return None
        try:
            if upstream.fileno() >= FD_SETSIZE:
                raise OSError("descriptor beyond select()'s reach")
            _tune(upstream)
            upstream.setblocking(False)
            assert self._target_addr is not None
            upstream.connect(self._target_addr)  # the kernel then passes only the target's datagrams
        except OSError:
            upstream.close()
            with self._lock:
                self._proxy.refused += 1
            return None
        name = self.peers.get(int(addr[1]), UNKNOWN_NODE)
        with self._lock:
            client = _Client(addr, upstream, self._link(name, self.node), self._link(self.node, name))
            self._proxy.clients += 1
        self._clients[addr] = client
        self._by_upstream[upstream] = client
        return client

    def _offer(
        self, link: _Link, payload: bytes, now: float, sock: socket.socket, destination: _Address | None
    ) -> None:
        """One datagram onto ``link``: cut, or its shaper's fate, then into the heap."""
        with self._lock:
            link.stats.sent += 1
            if self._partitions and self.clock is not None:
                t = self.clock.elapsed()  # the event clock's now, taken back to the datagram's arrival
                if t is not None and self.network.cut(link.src, link.dst, t - max(0.0, time.monotonic() - now)):
                    link.stats.cut += 1
                    return
            arrivals = link.shaper.fate(len(payload), now)
            for due in arrivals:
                if len(self._heap) >= self.max_queued or self._queued_bytes + len(payload) > self.max_queued_bytes:
                    link.stats.overflow += 1
                    continue
                self._seq += 1
                heapq.heappush(self._heap, (due, self._seq, sock, payload, destination, link))
                self._queued_bytes += len(payload)

    def _send_due(self) -> None:
        heap = self._heap
        now = time.monotonic()
        done: list[tuple[_Link, bool]] = []
        while heap and heap[0][0] <= now:
            _, _, sock, payload, destination, link = heapq.heappop(heap)
            self._queued_bytes -= len(payload)
            try:
                if destination is None:
                    sock.send(payload)
                else:
                    sock.sendto(payload, destination)
                done.append((link, True))
            except OSError:  # a full buffer, a closed port, a vanished peer: the datagram is gone, as on a wire
                done.append((link, False))
            if heap and heap[0][0] > now:
                now = time.monotonic()
        if done:
            with self._lock:
                for link, ok in done:
                    if ok:
                        link.stats.delivered += 1
                    else:
                        link.stats.send_errors += 1


def _tune(sock: socket.socket) -> None:
    """Ask for large buffers, so that bursts wait in the kernel rather than vanish, and for receive timestamps (best
    effort)."""
    enable_timestamps(sock)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
        except OSError:
            pass


# --- kernel receive timestamps ------------------------------------------------------------------------------------
# A datagram's delay counts from when the kernel received it, not from when this thread got round to reading it: on a
# busy machine the thread may wake a millisecond late, and that lateness would otherwise add to every configured delay.
# Linux stamps each datagram when asked (SO_TIMESTAMPNS, wall clock, ns); Python's socket module does not name the
# option, so it is used where its number is known (the asm-generic value) and checked on the first datagram. Elsewhere,
# or if the kernel sends no stamp, the time of the read stands in.

_SO_TIMESTAMPNS = 35  # asm-generic (x86, arm, arm64, riscv, powerpc, s390); alpha, mips, parisc and sparc differ
_TIMESPEC = struct.Struct("@ll")
_ANCILLARY = socket.CMSG_SPACE(_TIMESPEC.size)
_STAMPS = sys.platform == "linux" and platform.machine().lower() in {
    "x86_64",
    "amd64",
    "i386",
    "i686",
    "aarch64",
    "arm64",
    "armv7l",
    "riscv64",
    "ppc64le",
    "ppc64",
    "s390x",
}
_MAX_STAMP_AGE_S = 1.0  # a stamp older than this (a stepped wall clock) is not believed


def enable_timestamps(sock: socket.socket) -> bool:
    """Ask the kernel to stamp every datagram ``sock`` receives; whether it agreed."""
    if not _STAMPS:
        return False
    try:
        sock.setsockopt(socket.SOL_SOCKET, _SO_TIMESTAMPNS, 1)
    except OSError:
        return False
    return True


def recv_stamped(sock: socket.socket, bufsize: int = MAX_DATAGRAM) -> tuple[bytes, _Address, float]:
    """One datagram, its source, and when it arrived on ``time.monotonic()``'s clock: the kernel's stamp where
    ``enable_timestamps`` was called (and the kernel gave one), else now. Raises what ``recvmsg`` raises."""
    payload, ancillary, _, addr = sock.recvmsg(bufsize, _ANCILLARY)
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == _SO_TIMESTAMPNS and len(data) == _TIMESPEC.size:
            sec, nsec = _TIMESPEC.unpack(data)
            # wall clock first, then monotonic: a pause between the two reads makes the arrival later, never earlier
            age = (time.time_ns() - (sec * 1_000_000_000 + nsec)) / 1e9
            now = time.monotonic()
            if 0.0 <= age <= _MAX_STAMP_AGE_S:
                return payload, addr, now - age
            return payload, addr, now
    return payload, addr, time.monotonic()
