"""The emulated network of vast.ai instances: each instance's own address, and the forwarders that publish its
container ports on the public address at other ports, as vast.ai maps a ``-p P:P`` entry to a public port.

The emulator runs every container on this machine without a network namespace of its own, so an instance's own
interface is stood in for by a loopback address of its own in ``127.77.0.0/16`` (Linux routes all of 127.0.0.0/8 to
the loopback interface). ``reserve_address`` gives each instance one that no other instance of any emulator on this
machine holds: the reservation is an abstract unix socket named after the address, held until ``Reservation.release``
or the end of the process, so two instances binding the same container port never collide, also across emulators
running at the same time in other processes.

``publish`` opens one forwarder per container port of a running instance, listening on the public address
(``PUBLIC_HOST``) at a port the OS picks and forwarding to the instance's address at the container port:

- ``TcpForwarder`` joins each accepted connection to a new connection to the target. Each direction holds at most
  ``BUFFER_LIMIT`` bytes (it stops reading a side whose peer is slow to take them). When either side ends its
  stream, what it sent before is delivered and the end is passed on (a half-close, as docker's proxy does); both
  ends are closed once both sides ended, ``ENDING_S`` after the first end at the latest, and at once when either
  side fails (a reset, a write to a closed socket). A target that refuses makes a closed client connection; at most
  ``MAX_CONNECTIONS`` pairs at a time (more are closed at once).
- ``UdpForwarder`` relays datagrams both ways with one upstream socket per client address, so replies reach the
  client from the public port it sent to (as a NAT does); at most ``MAX_CLIENTS`` client addresses (the longest idle
  is dropped for a new one), each forgotten after ``CLIENT_IDLE_S`` without traffic; a datagram that cannot be
  passed on is dropped, as a network drops it. The target sees the forwarder's address as the sender.

Each forwarder is one thread running a selector loop; ``close()`` stops it, closes every socket it opened and joins
the thread before it returns, and is idempotent.
"""

from __future__ import annotations

import functools
import re
import selectors
import socket
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable

from ppharness.errors import ProviderError

PUBLIC_HOST = "127.0.0.1"
PUBLIC_IPADDR_SHOWN = "127.0.0.1 \n"  # the public address padded as vast.ai pads it, so clients must strip it
ADDRESS_PREFIX = "127.77"
ADDRESS_SLOTS = 256 * 254  # 127.77.0.1 .. 127.77.255.254
RESERVATION_NAME = "\0ppharness-vastai-emulator-address-{}"
CHUNK = 64 * 1024
BUFFER_LIMIT = 1 << 20
MAX_CONNECTIONS = 256
CONNECT_TIMEOUT_S = 2.0
ENDING_S = 10.0
DATAGRAM_MAX = 65535
MAX_CLIENTS = 64
CLIENT_IDLE_S = 120.0
BATCH = 64  # datagrams taken per readiness event before the loop serves the other sockets
SOCKET_BUFFER = 4 << 20
TICK_S = 1.0
_PORT_SPEC = re.compile(r"^(\d{1,5})/(tcp|udp)$")


class Reservation:
    """An instance's own address, held by this process until ``release`` (idempotent) or its end."""

    def __init__(self, address: str, holder: socket.socket) -> None:
        self.address, self._holder = address, holder

    def release(self) -> None:
        self._holder.close()


def reserve_address(owner: str, instance_id: int) -> Reservation:
    """An address in ``127.77.0.0/16`` that no other holder on this machine has, tried first at a slot derived from
    ``owner`` (the emulator's id) and ``instance_id``."""
    start = zlib.crc32(f"{owner}/{instance_id}".encode())
    for step in range(ADDRESS_SLOTS):
        slot = (start + step) % ADDRESS_SLOTS
        address = f"{ADDRESS_PREFIX}.{slot // 254}.{slot % 254 + 1}"
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            holder.bind(RESERVATION_NAME.format(address))
        except OSError:
            holder.close()
            continue
        return Reservation(address, holder)
    raise ProviderError(f"vast.ai emulator: every instance address in {ADDRESS_PREFIX}.0.0/16 is taken")


class _Forwarder:
    """The selector loop and its thread, shared by both kinds: ``_public`` is the socket on the public address."""

    protocol = ""

    def __init__(self, public: socket.socket, target: tuple[str, int]) -> None:
        self.target = target
        self._public = public
        self.host: str = public.getsockname()[0]
        self.port: int = public.getsockname()[1]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"vastai-emulator-{self.protocol}-{self.port}", daemon=True
        )

    @property
    def alive(self) -> bool:
        """Whether the forwarder's thread still runs."""
        return self._thread.is_alive()

    def close(self) -> None:
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5.0)
        self._wake_w.close()

    def _run(self) -> None:
        try:
            while not self._closing.is_set():
                for key, events in self._selector.select(TICK_S):
                    if key.data is not None and not self._closing.is_set():
                        key.data(events)
                self._tick()
        finally:
            self._release()
            for key in list(self._selector.get_map().values()):
                self._selector.unregister(key.fileobj)
                if isinstance(key.fileobj, socket.socket):
                    key.fileobj.close()
            self._selector.close()
            self._public.close()
            self._wake_r.close()

    def _tick(self) -> None:
        """Housekeeping, at least every ``TICK_S``."""

    def _release(self) -> None:
        """Close what the loop opened beyond the sockets it watches (when the loop ends)."""


class TcpForwarder(_Forwarder):
    """Accepts on ``PUBLIC_HOST`` (or ``listen_host``) at a port the OS picks (``port``) and forwards each connection
    to ``target`` (module docstring)."""

    protocol = "tcp"

    def __init__(self, target: tuple[str, int], listen_host: str = PUBLIC_HOST) -> None:
        listener = socket.create_server((listen_host, 0), backlog=64)
        listener.setblocking(False)
        super().__init__(listener, target)
        self._pairs: set[_Pair] = set()
        self._selector.register(listener, selectors.EVENT_READ, self._accept)
        self._thread.start()

    @property
    def connections(self) -> int:
        """Connection pairs open now."""
        return len(self._pairs)

    def _accept(self, events: int) -> None:
        while True:
            try:
                client, _ = self._public.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if len(self._pairs) >= MAX_CONNECTIONS:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=CONNECT_TIMEOUT_S)
            except OSError:
                client.close()
                continue
            self._pairs.add(_Pair(client, upstream, self._selector, self._pairs.discard))

    def _tick(self) -> None:
        now = time.monotonic()
        for pair in [p for p in self._pairs if p.ending_since is not None and now - p.ending_since > ENDING_S]:
            pair.close()

    def _release(self) -> None:
        for pair in list(self._pairs):
            pair.close()


class _Pair:
    """A client connection and its upstream connection, joined (module docstring)."""

    def __init__(
        self, a: socket.socket, b: socket.socket, selector: selectors.BaseSelector, forget: Callable[[_Pair], None]
    ) -> None:
        for s in (a, b):
            s.setblocking(False)
        self.peer = {a: b, b: a}
        self.pending = {a: bytearray(), b: bytearray()}  # bytes waiting to be written to that socket
        self.interest = {a: 0, b: 0}
        self.handlers = {s: functools.partial(self.on_event, s) for s in (a, b)}
        self.ended: set[socket.socket] = set()  # sides that sent their end of stream
        self.shut: set[socket.socket] = set()  # sides told the other's end of stream
        self.ending_since: float | None = None
        self.selector, self.forget = selector, forget
        self.closed = False
        self._update()

    def on_event(self, sock: socket.socket, events: int) -> None:
        if self.closed:
            return
        try:
            if events & selectors.EVENT_WRITE and self.pending[sock]:
                sent = sock.send(self.pending[sock])
                del self.pending[sock][:sent]
            if events & selectors.EVENT_READ and sock not in self.ended:
                data = sock.recv(CHUNK)
                if data:
                    self.pending[self.peer[sock]] += data
                else:
                    self.ended.add(sock)
                    self.ending_since = self.ending_since or time.monotonic()
            for side in self.ended:
                peer = self.peer[side]
                if peer not in self.shut and not self.pending[peer]:
                    self.shut.add(peer)
                    peer.shutdown(socket.SHUT_WR)
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.close()
            return
        if len(self.ended) == 2 and not any(self.pending.values()):
            self.close()
            return
        self._update()

    def _update(self) -> None:
        for sock, peer in self.peer.items():
            want = 0
            if sock not in self.ended and len(self.pending[peer]) < BUFFER_LIMIT:
                want |= selectors.EVENT_READ
            if self.pending[sock]:
                want |= selectors.EVENT_WRITE
            have = self.interest[sock]
            if want == have:
                continue
            if not have:
                self.selector.register(sock, want, self.handlers[sock])
            elif not want:
                self.selector.unregister(sock)
            else:
                self.selector.modify(sock, want, self.handlers[sock])
            self.interest[sock] = want

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for sock in self.peer:
            if self.interest[sock]:
                self.selector.unregister(sock)
            sock.close()
        self.forget(self)


class UdpForwarder(_Forwarder):
    """Receives datagrams on ``PUBLIC_HOST`` (or ``listen_host``) at a port the OS picks (``port``) and relays them to
    ``target`` and the replies back (module docstring)."""

    protocol = "udp"

    def __init__(self, target: tuple[str, int], listen_host: str = PUBLIC_HOST) -> None:
        public = _datagram_socket()
        public.bind((listen_host, 0))
        super().__init__(public, target)
        self._clients: OrderedDict[tuple[str, int], tuple[socket.socket, list[float]]] = OrderedDict()
        self._selector.register(public, selectors.EVENT_READ, self._from_client)
        self._thread.start()

    def _from_client(self, events: int) -> None:
        for _ in range(BATCH):
            try:
                data, client = self._public.recvfrom(DATAGRAM_MAX)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue
            upstream = self._upstream(client)
            try:
                upstream.send(data)
            except OSError:
                pass

    def _upstream(self, client: tuple[str, int]) -> socket.socket:
        entry = self._clients.get(client)
        if entry is not None:
            self._clients.move_to_end(client)
            entry[1][0] = time.monotonic()
            return entry[0]
        if len(self._clients) >= MAX_CLIENTS:
            self._forget(next(iter(self._clients)))
        sock = _datagram_socket()
        sock.connect(self.target)
        seen = [time.monotonic()]
        self._clients[client] = (sock, seen)
        self._selector.register(sock, selectors.EVENT_READ, functools.partial(self._from_target, client, sock, seen))
        return sock

    def _from_target(self, client: tuple[str, int], sock: socket.socket, seen: list[float], events: int) -> None:
        for _ in range(BATCH):
            try:
                data = sock.recv(DATAGRAM_MAX)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                continue  # an earlier datagram was refused (ICMP): that one is lost, the next may pass
            seen[0] = time.monotonic()
            try:
                self._public.sendto(data, client)
            except OSError:
                pass

    def _forget(self, client: tuple[str, int]) -> None:
        sock, _ = self._clients.pop(client)
        self._selector.unregister(sock)
        sock.close()

    def _release(self) -> None:
        for client in list(self._clients):
            self._forget(client)

    def _tick(self) -> None:
        now = time.monotonic()
        for client in [c for c, (_, seen) in self._clients.items() if now - seen[0] > CLIENT_IDLE_S]:
            self._forget(client)


def _datagram_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setblocking(False)
    for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
        sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER)
    return sock


Forwarder = TcpForwarder | UdpForwarder


def publish(address: str, container_ports: list[str]) -> dict[str, Forwarder]:
    """A forwarder per container port (``"7100/tcp"``, ``"7100/udp"``) from the public address to ``address``; none is
    left open when one cannot be made."""
    out: dict[str, Forwarder] = {}
    try:
        for spec in container_ports:
            m = _PORT_SPEC.match(spec)
            if m is None or not 1 <= int(m[1]) <= 65535:
                raise ProviderError(f"vast.ai emulator: {spec!r} is not a container port")
            kind = TcpForwarder if m[2] == "tcp" else UdpForwarder
            out[spec] = kind((address, int(m[1])))
    except BaseException:
        withdraw(out)
        raise
    return out


def withdraw(forwarders: dict[str, Forwarder]) -> None:
    """Close every forwarder of ``forwarders`` and forget them."""
    for forwarder in forwarders.values():
        forwarder.close()
    forwarders.clear()


def platform_env(forwarders: dict[str, Forwarder]) -> dict[str, str]:
    """What vast.ai tells a container about its published ports: ``PUBLIC_IPADDR`` (padded) and
    ``VAST_TCP_PORT_<P>`` / ``VAST_UDP_PORT_<P>`` = the public port of container port P."""
    env = {"PUBLIC_IPADDR": PUBLIC_IPADDR_SHOWN}
    for spec, forwarder in forwarders.items():
        port, protocol = spec.split("/")
        env[f"VAST_{protocol.upper()}_PORT_{port}"] = str(forwarder.port)
    return env
