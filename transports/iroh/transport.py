"""iroh transport: QUIC between authenticated endpoints, on loopback/LAN (relay disabled) or across the WAN (relays).

An endpoint's address is ``iroh://`` followed by its endpoint ticket (the base32 string carrying its endpoint id, its
direct addresses and, with relays, its home relay). Each transport runs one asyncio event loop in a daemon thread for
binding, accepting, dialling and watching connections (``transports.iroh.session``, which also describes the wire
protocol); this class is the synchronous ``Transport`` face of it. Guarantees:

- delivery is reliable and in order per sender -> receiver pair while the connection lives: one long-lived QUIC
  connection per pair of peers (reused in both directions) and one long-lived stream per direction;
- only invited peers get in: with ``allowed`` (the run's endpoint ids, from ``plan_endpoints``) a connection from
  any other endpoint id is closed right after the handshake, logged on stderr with that id, and nothing it sent is
  delivered; the transport does not dial such an endpoint either; ``allowed=None`` (a transport made without a plan,
  as in the contract tests) accepts any endpoint;
- ``relay="disabled"`` binds loopback (or ``host``), uses no relay and no discovery service: no traffic leaves the
  machine unless ``host`` is a non-loopback interface, and then only to the peers dialled; ``relay="default"`` uses
  the n0 public relays and discovery (WAN), and direct addresses whenever they work;
- ``send_frame`` to a new address waits for the connection (up to ``connect_timeout``; ``ConnectFailed``); every
  send returns once QUIC has taken the frame into its send buffer (it does not wait for the peer); when the peer's
  flow-control window is full it blocks up to ``send_timeout``, then raises ``ConnectFailed`` and that peer stays
  failed; a frame over the codec's size limit raises ``CodecError`` and is not sent;
- a peer whose connection ended (closed by it, or dropped: QUIC's idle timeout is 30 s) makes the next send to it
  raise ``PeerClosed`` naming its address and endpoint id; an unexpected end is also logged on stderr;
- ``recv_frame``: ``None`` waits forever, ``0`` does not wait, otherwise up to ``timeout`` s; ``TransportTimeout``
  when nothing came; any thread may send, one at a time receives; ``close()`` from another thread wakes a blocked
  receiver with ``TransportClosed``;
- ``close()`` finishes every outgoing stream, waits up to ``LINGER_S`` for the peers to acknowledge what was sent,
  closes every connection and the endpoint and stops the loop thread; it is idempotent and every later call raises
  ``TransportClosed``;
- iroh exceptions surface as ``ppharness.errors`` types (``raise ... from``), never as iroh types;
- what a peer can make it spend is bounded (handshakes, connections per endpoint id and in all, streams per connection,
  kept peers, refusals remembered and logged: ``transports.iroh.session``); a send to another address of an endpoint
  already connected reuses that connection.

Importing this module does not import iroh; the first transport (or ``plan_endpoints``) does, and applies the
bulk-copy fix of ``transports.iroh.fastcopy`` (version-guarded) before any byte is sent. Sends run the binding's
stream write on the calling thread and each incoming stream is read by a thread of its own
(``transports.iroh.sync``, version-guarded; otherwise those calls go through the loop thread); readers run
continuously, so a peer never stalls on a full window because this side is busy.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import ipaddress
import queue
import socket
import threading
import weakref
from collections.abc import Coroutine
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from ppharness.errors import CodecError, ConnectFailed, PeerClosed, TransportClosed, TransportError, TransportTimeout
from ppharness.seams.transport import JsonObject, Transport
from ppharness.wire import codec
from transports.iroh import fastcopy as _iroh_fastcopy
from transports.iroh import sync as _iroh_sync
from transports.iroh.session import ALPN, PREFIX, SCHEME, Peer, Session, iroh_reason, log, parse_address
from transports.iroh.settings import RELAY_MODES

if TYPE_CHECKING:  # the binding itself is imported by load_iroh()
    from iroh import EndpointBuilder, SendStream

LINGER_S = 2.0
INLINE_BYTES = 64 * 1024
ONLINE_TIMEOUT_S = 15.0
CONNECT_LOCKS = 64  # dials to one address are serialised by one of these (a fixed number, whatever peers name)
_T = TypeVar("_T")
_iroh: ModuleType | None = None
_direct_calls = False
_load_lock = threading.Lock()
_live: weakref.WeakSet[IrohTransport] = weakref.WeakSet()


@atexit.register
def _close_live_transports() -> None:
    """Close transports still open at interpreter exit: their threads and the Rust runtime's callbacks must stop
    before the interpreter is torn down."""
    for transport in list(_live):
        transport.close()


def load_iroh() -> ModuleType:
    """The iroh module, imported once, with the bulk-copy fix applied when its version is known to be safe."""
    global _iroh, _direct_calls
    with _load_lock:
        if _iroh is None:
            try:
                import iroh
            except ImportError as exc:
                raise ImportError("the iroh transport needs the iroh package: pip install iroh") from exc
            _iroh_fastcopy.apply(iroh.iroh_ffi)
            why = _iroh_sync.refusal(iroh.iroh_ffi, _iroh_fastcopy.installed_version())
            if why is not None:
                log(f"sends go through the event loop thread (slower): {why}")
            _direct_calls = why is None
            _iroh = iroh
        return _iroh


def _bind_addrs(host: str, port: int) -> list[str]:
    """Socket addresses to bind: ``host`` and, for the other IP family, its loopback (or wildcard for a wildcard)
    where this machine has one."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError as exc:
        raise TransportError(f"iroh bind host {host!r} is not an IP address") from exc
    if ip.version == 4:
        other = "::" if ip.is_unspecified else "::1"
        return [f"{ip}:{port}"] + ([f"[{other}]:0"] if _can_bind(socket.AF_INET6, other) else [])
    other = "0.0.0.0" if ip.is_unspecified else "127.0.0.1"
    return [f"[{ip}]:{port}"] + ([f"{other}:0"] if _can_bind(socket.AF_INET, other) else [])


def _can_bind(family: socket.AddressFamily, host: str) -> bool:
    """Whether this machine has ``host`` (a container without IPv6, or with no network but its loopback, lacks ::1)."""
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.bind((host, 0))
        return True
    except OSError:
        return False


class IrohTransport(Transport):
    """One iroh endpoint. ``secret_key`` (hex, 32 bytes) fixes its identity (default: a fresh one); ``allowed`` is
    the list of endpoint ids (hex) that may connect; ``relay`` is ``disabled`` or ``default``; ``host``/``port`` the
    bind address (default loopback without relays, every interface with them); ``advertise_host`` replaces the
    direct addresses in the ticket (a container's reachable IP), ``advertise_port`` their port (a proxy in front of
    the socket: the packet-level network emulation)."""

    kind = "iroh"
    ip_protocol = "udp"  # what a port it binds is a port of (QUIC: a platform publishing it maps udp)

    @classmethod
    def plan_endpoints(cls, count: int, settings: JsonObject) -> list[JsonObject]:
        """A fresh secret key per endpoint, every endpoint allowing exactly the run's ``count`` endpoint ids."""
        unknown = sorted(set(settings) - {"relay"})
        if unknown:
            raise TransportError(f"iroh transport: unknown setting(s) {', '.join(unknown)} (known: relay)")
        relay = settings.get("relay") or "disabled"
        if relay not in RELAY_MODES:
            raise TransportError(f"iroh transport: relay {relay!r} is not one of {', '.join(RELAY_MODES)}")
        keys = [load_iroh().SecretKey.generate() for _ in range(count)]
        ids = [str(k.public()) for k in keys]
        return [{"secret_key": k.to_bytes().hex(), "allowed": ids, "relay": relay} for k in keys]

    @classmethod
    def identity(cls, opts: JsonObject) -> str:
        """The endpoint id of the endpoint with ``opts``' secret key."""
        secret = opts.get("secret_key")
        if not isinstance(secret, str):
            return ""
        return str(load_iroh().SecretKey.from_bytes(bytes.fromhex(secret)).public())

    @classmethod
    def identity_of(cls, address: str) -> str:
        """The endpoint id in the ticket: a received message's sender ticket names the connection's own endpoint."""
        iroh = load_iroh()
        try:
            return str(parse_address(iroh, address).id())
        except (TypeError, ValueError, iroh.IrohError):
            return ""

    @staticmethod
    def bulk_copy(enable: bool | None = None) -> str:
        """The bulk-copy fix's status line; ``True``/``False`` first applies/reverts it (for benchmarks)."""
        ffi = load_iroh().iroh_ffi
        if enable is True:
            _iroh_fastcopy.apply(ffi)
        elif enable is False:
            _iroh_fastcopy.revert()
        return _iroh_fastcopy.status()

    def __init__(
        self,
        secret_key: str | None = None,
        allowed: list[str] | None = None,
        relay: str = "disabled",
        host: str | None = None,
        port: int = 0,
        advertise_host: str | None = None,
        advertise_port: int | None = None,
        send_timeout: float | None = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        if relay not in RELAY_MODES:
            raise TransportError(f"iroh transport: relay {relay!r} is not one of {', '.join(RELAY_MODES)}")
        try:
            self._secret = bytes.fromhex(secret_key) if secret_key is not None else None
        except ValueError as exc:
            raise TransportError("iroh transport: secret_key is not hex") from exc
        if self._secret is not None and len(self._secret) != 32:
            raise TransportError(f"iroh transport: secret_key has {len(self._secret)} bytes, expected 32")
        self._allowed = frozenset(allowed) if allowed is not None else None
        self._relay = relay
        self._bind = _bind_addrs(host or ("127.0.0.1" if relay == "disabled" else "0.0.0.0"), port)
        self._advertise_host = advertise_host
        self._advertise_port = advertise_port
        self._send_timeout = send_timeout
        self._connect_timeout = connect_timeout
        self._iroh = load_iroh()
        self._direct = _direct_calls
        self._address: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session: Session | None = None
        # (sender address, frame) as the session reads them; None marks the transport closed
        self._incoming: queue.SimpleQueue[tuple[str, bytes] | None] = queue.SimpleQueue()
        self._state_lock = threading.Lock()
        self._connect_locks = [threading.Lock() for _ in range(CONNECT_LOCKS)]  # an address's is hash(address) % n
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind the endpoint and return its address (``iroh://<ticket>``). Calling it again returns the same."""
        with self._state_lock:
            self._check_open()
            if self._address is not None:
                return self._address
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, name="ppharness-iroh", daemon=True)
            thread.start()
            self._loop, self._thread = loop, thread
            try:
                session = self._session = self._call(self._open(), ONLINE_TIMEOUT_S + 10, "bind")
            except BaseException:
                self._stop_loop()
                raise
            self._address = session.address
            _live.add(self)
            return self._address

    async def _open(self) -> Session:
        from iroh import Preset  # loaded by load_iroh(): this is self._iroh.Preset

        iroh, bind = self._iroh, self._bind

        class _Preset(Preset):
            def __init__(self, relay: str) -> None:
                self.relay = relay

            def apply(self, builder: EndpointBuilder) -> None:
                if self.relay == "disabled":
                    builder.apply_minimal()
                else:
                    builder.apply_n0()
                for addr in bind:
                    builder.bind_addr(addr)

        mode = iroh.RelayMode.disabled() if self._relay == "disabled" else iroh.RelayMode.default_mode()
        options = iroh.EndpointOptions(
            preset=_Preset(self._relay),
            alpns=[ALPN],
            relay_mode=mode,
            **({"secret_key": self._secret} if self._secret is not None else {}),
        )
        try:
            endpoint = await iroh.Endpoint.bind(options)
        except iroh.IrohError as exc:
            raise ConnectFailed(f"iroh endpoint cannot bind {', '.join(bind)}: {_reason(exc)}") from exc
        if self._relay == "default":
            try:
                await asyncio.wait_for(endpoint.online(), ONLINE_TIMEOUT_S)
            except (TimeoutError, iroh.IrohError):
                log(f"no home relay within {ONLINE_TIMEOUT_S:g} s; the ticket carries direct addresses only")
        addr = endpoint.addr()
        if self._advertise_host is not None or self._advertise_port is not None:
            host = self._advertise_host or self._bind[0].rsplit(":", 1)[0].strip("[]")
            v6 = ":" in host
            port = self._advertise_port or next(
                s.rsplit(":", 1)[1] for s in endpoint.bound_sockets() if s.startswith("[") == v6
            )
            addr = iroh.EndpointAddr(endpoint.id(), addr.relay_url(), [f"[{host}]:{port}" if v6 else f"{host}:{port}"])
        address = SCHEME + str(iroh.EndpointTicket.from_addr(addr))
        session = Session(iroh, endpoint, address, self._allowed, self._incoming, self._run_blocking)
        session.spawn(session.accept_loop())
        return session

    @property
    def address(self) -> str:
        if self._address is None:
            raise TransportError("iroh transport is not started: call start() first")
        return self._address

    @property
    def endpoint_id(self) -> str:
        """This endpoint's id (hex): what other endpoints put in their allow-lists. Known from start() on."""
        if self._session is None:
            raise TransportError("iroh transport is not started: call start() first")
        return self._session.endpoint_id

    @property
    def refused(self) -> list[str]:
        """Endpoint ids whose connections were refused (not in the allow-list, or over a connection cap; '' for a
        handshake refused or failed before the id was known), oldest first: the most recent
        ``transports.bounds.RECENT_REFUSALS``."""
        return list(self._session.refused) if self._session is not None else []

    @property
    def refused_total(self) -> int:
        """How many connections were refused since start."""
        return self._session.refusals.total if self._session is not None else 0

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        self._incoming.put(None)
        if self._session is not None:
            try:
                self._call(self._session.shutdown(LINGER_S), LINGER_S + 5, "close")
            except TransportError:
                pass
        self._stop_loop()

    def _stop_loop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        if not thread.is_alive():
            loop.close()

    # --- frames ---------------------------------------------------------------------------------------------------

    def send_frame(self, address: str, frame: bytes) -> None:
        self._check_ready()
        if len(frame) > codec.HEADER.size + codec.MAX_FRAME_BYTES:
            raise CodecError(f"frame of {len(frame)} bytes exceeds the {codec.MAX_FRAME_BYTES}-byte limit; not sent")
        if address == self._address:
            self._incoming.put((address, bytes(frame)))
            return
        assert self._session is not None  # started: _check_ready() passed
        peer = self._session.peers.get(address) or self._connect(address)
        prefix = PREFIX.pack(len(frame))
        with peer.lock:
            if peer.error is not None:
                raise peer.error
            try:
                if len(frame) <= INLINE_BYTES:
                    self._write(peer.stream, prefix + frame)
                else:
                    self._write(peer.stream, prefix)
                    self._write(peer.stream, frame)
            except (self._iroh.IrohError, TimeoutError, concurrent.futures.TimeoutError, RuntimeError) as exc:
                if self._closed:
                    raise TransportClosed(f"iroh transport {self._address} is closed") from exc
                if isinstance(exc, self._iroh.IrohError):
                    peer.error = PeerClosed(
                        f"iroh peer {address} (endpoint {peer.endpoint_id}): sending failed: {_reason(exc)}"
                    )
                elif isinstance(exc, RuntimeError):
                    peer.error = TransportError(f"iroh peer {address}: sending failed: {exc}")
                else:
                    peer.error = ConnectFailed(
                        f"cannot send to {address}: the peer took nothing for "
                        f"{self._send_timeout:g} s (not reading or unreachable)"
                    )
                log(str(peer.error))
                raise peer.error from exc

    def _write(self, stream: SendStream, data: bytes) -> None:
        self._run_blocking(stream.write_all(data), self._send_timeout)

    def _run_blocking(self, coro: Coroutine[Any, Any, _T], timeout: float | None = None) -> _T:
        """Run one binding coroutine to completion: on this thread when the binding allows it, else on the loop."""
        if self._direct and _iroh_sync.can_call():
            return _iroh_sync.call(coro, timeout)
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def recv_frame(self, timeout: float | None = None) -> tuple[str, bytes]:
        self._check_ready()
        try:
            if timeout is None:
                item = self._incoming.get()
            elif timeout <= 0:
                item = self._incoming.get_nowait()
            else:
                item = self._incoming.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"{self._address}: nothing arrived within {timeout} s") from None
        if item is None or self._closed:
            self._incoming.put(None)
            raise TransportClosed(f"iroh transport {self._address} is closed")
        return item

    # --- internals ------------------------------------------------------------------------------------------------

    def _connect(self, address: str) -> Peer:
        assert self._session is not None  # started: send_frame checked
        with self._connect_locks[hash(address) % CONNECT_LOCKS]:
            peer = self._session.peers.get(address)
            if peer is not None:
                return peer
            try:
                target = parse_address(self._iroh, address)
            except (self._iroh.IrohError, TypeError) as exc:
                raise ConnectFailed(
                    f"cannot connect to {address!r}: not an iroh endpoint ticket ({_reason(exc)})"
                ) from exc
            remote = str(target.id())
            if self._allowed is not None and remote not in self._allowed:
                raise ConnectFailed(f"cannot connect to {address}: endpoint {remote} is not in this run's allow-list")
            coro = self._session.connect(address, target, remote, self._connect_timeout)
            return self._call(coro, self._connect_timeout + 5, f"connect to {address}")

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float, what: str) -> _T:
        """Run ``coro`` on the loop thread and wait for its result, mapping failures into the error tree."""
        assert self._loop is not None
        try:
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        except RuntimeError as exc:
            coro.close()
            raise TransportClosed(f"iroh transport {self._address} is closed ({what})") from exc
        try:
            return future.result(timeout)
        except TransportError:
            raise
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            raise ConnectFailed(f"iroh transport: {what} did not finish within {timeout:g} s") from exc
        except self._iroh.IrohError as exc:
            raise TransportError(f"iroh transport: {what} failed: {_reason(exc)}") from exc

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"iroh transport {self._address or '(not started)'} is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if self._address is None:
            raise TransportError("iroh transport is not started: call start() first")


def _reason(exc: BaseException) -> str:
    return iroh_reason(exc)
