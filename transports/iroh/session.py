"""The machinery of one iroh endpoint: accepting and dialling connections, reading streams, noticing peers that go.

Coroutines here run on the transport's loop thread; stream reads run on one thread per incoming stream, through the
``run`` function the transport gives (one blocking call of a binding coroutine); ``IrohTransport``
writes to the outgoing streams from the sending thread.

Wire protocol (ALPN ``ppharness/1``): one QUIC connection per pair of peers, reused in both directions; in each
direction one long-lived unidirectional stream carrying records ``u32 big-endian length | bytes``. The first record
of a stream is the sender's address (``iroh://<endpoint ticket>``, utf-8); every later record is one codec frame,
passed on as it came so the codec judges it. The ticket's endpoint id must be the connection's authenticated remote
id, so a peer cannot claim another's address; a stream that breaks the protocol (a bad first record, a record over
the size limit, an end inside a record) is logged and no longer read, and the other streams are unaffected.

What a peer can make an endpoint spend is bounded: at most ``MAX_HANDSHAKES`` incoming handshakes run at once (more
are refused before any crypto); connections are capped at ``MAX_CONNECTIONS`` in all and ``MAX_CONNECTIONS_PER_PEER``
per endpoint id, both ways (a send to another address of an endpoint already connected reuses that connection); a
connection carries at most ``MAX_STREAMS_PER_CONNECTION`` incoming streams at once (one reader thread each); at most
``MAX_PEERS`` outgoing streams are kept (failed ones are forgotten first). Refused connections are kept in a bounded
deque and logged through ``transports.bounds.RefusalLog`` (the first few distinct endpoint ids, then counts).

The path of each connection is logged on stderr: one line once a path is selected (direct, with the peer's socket
address, or through a relay) and one whenever the selected path changes kind or address, each naming both endpoint
ids and the round-trip time. The binding's snapshot (``Connection.paths()``) is read every ``PATH_POLL_S`` on the
loop thread while the connection lives; its push form (``watch_paths``) calls back on a Rust thread through an event
loop the binding keeps for the whole process, which would route every transport's binding calls to one loop.
"""

from __future__ import annotations

import asyncio
import queue
import struct
import sys
import threading
from collections import deque
from collections.abc import Awaitable, Coroutine
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from ppharness.errors import ConnectFailed, PeerClosed, TransportError
from ppharness.trace.drops import PROCESS_DROPS
from ppharness.wire import codec
from transports.bounds import ConnectionCaps, RefusalLog

if TYPE_CHECKING:  # the binding is imported when the first transport is made (transports.iroh.transport.load_iroh)
    from iroh import Connection, Endpoint, EndpointAddr, EndpointTicket, Incoming, RecvStream, SendStream

ALPN = b"ppharness/1"
MAX_RECORD = codec.HEADER.size + codec.MAX_FRAME_BYTES
MAX_HELLO = 4096
READ_CHUNK = 64 * 1024
CLOSE_CODE, CLOSE_REASON = 0, b"ppharness transport closed"
REFUSE_CODE, REFUSE_REASON = 403, b"ppharness: endpoint not invited to this run"
BUSY_CODE, BUSY_REASON = 429, b"ppharness: too many connections"
MAX_HANDSHAKES = 64  # incoming handshakes in progress at once
MAX_CONNECTIONS = 256  # connections open at once, both ways
MAX_CONNECTIONS_PER_PEER = 4  # connections open at once with one endpoint id
MAX_STREAMS_PER_CONNECTION = 4  # incoming streams open at once on one connection
MAX_PEERS = 512  # outgoing streams kept (one per address sent to)
HANDSHAKE_TIMEOUT_S = 10.0
PATH_POLL_S = 1.0

PREFIX = struct.Struct(">I")
SCHEME = "iroh://"

_T = TypeVar("_T")


class RunBlocking(Protocol):
    """Runs one binding coroutine to completion, blocking the calling thread, and returns its result."""

    def __call__(self, coro: Coroutine[Any, Any, _T], /) -> _T: ...


def log(text: str) -> None:
    """One line on stderr, written whole (lines of several threads never interleave)."""
    sys.stderr.write(f"[ppharness iroh] {text}\n")
    sys.stderr.flush()


def parse_address(iroh: ModuleType, address: str) -> EndpointAddr:
    """``iroh://<ticket>`` -> the ticket's EndpointAddr; raises iroh.IrohError or TypeError for anything else."""
    if not address.startswith(SCHEME):
        raise TypeError(f"an iroh address starts with {SCHEME}")
    ticket: EndpointTicket = iroh.EndpointTicket.from_string(address[len(SCHEME) :])
    return ticket.endpoint_addr()


def iroh_reason(exc: BaseException) -> str:
    """A one-line description of an iroh exception (its ``str`` is often empty)."""
    message = getattr(exc, "message", None)
    if callable(message):
        try:
            return str(message())
        except Exception:  # noqa: BLE001 - best effort: fall back to the repr
            pass
    return str(exc) or repr(exc)


class _BadStream(Exception):
    """A stream broke the record protocol; the reader logs it and stops reading that stream."""


@dataclass(eq=False)
class Peer:
    """The outgoing half towards one address: its connection and stream. Writers hold ``lock`` while writing, so
    records never interleave; ``error`` is set once the stream is unusable and then raised by every later send."""

    address: str
    endpoint_id: str
    conn: Connection
    stream: SendStream
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: TransportError | None = None


class Session:
    """Connections, streams and tasks of one endpoint. Coroutines run on the loop thread; each incoming stream is read
    by a thread of its own through ``run`` (a blocking call of one binding coroutine), which wakes straight from the
    Rust side and hands each record to ``incoming``."""

    def __init__(
        self,
        iroh: ModuleType,
        endpoint: Endpoint,
        address: str,
        allowed: frozenset[str] | None,
        incoming: queue.SimpleQueue[tuple[str, bytes] | None],
        run: RunBlocking,
    ) -> None:
        """``incoming`` receives ``(sender address, record)`` for every record read (None is the transport's own
        end-of-queue mark)."""
        self.iroh, self.endpoint, self.address = iroh, endpoint, address
        self.allowed, self.incoming, self.run = allowed, incoming, run
        self.endpoint_id = str(endpoint.id())
        self.peers: dict[str, Peer] = {}
        self.inbound: dict[str, Connection] = {}  # sender address -> its connection, one address per connection
        self.conns: dict[int, Connection] = {}
        self.remotes: dict[int, str] = {}  # connection's stable id -> its remote endpoint id
        self.refusals = RefusalLog(log, lambda: f"endpoint {self.endpoint_id}")
        self.caps = ConnectionCaps(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_PEER)
        self.handshaking = 0
        self.tasks: set[asyncio.Task[None]] = set()
        self.closing = False

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # --- incoming ---------------------------------------------------------------------------------------------

    async def accept_loop(self) -> None:
        while True:
            try:
                incoming = await self.endpoint.accept_next()
            except self.iroh.IrohError:
                return
            if incoming is None:
                return
            self.spawn(self._accept_one(incoming))

    @property
    def refused(self) -> deque[str]:
        """Endpoint ids refused ('' for a handshake refused before the id was known), most recent last (bounded)."""
        return self.refusals.recent

    async def _accept_one(self, incoming: Incoming) -> None:
        if self.handshaking >= MAX_HANDSHAKES:
            await _quietly(incoming.refuse())
            self.refusals.refuse("", f"refused a connection: {MAX_HANDSHAKES} handshakes already in progress")
            return
        self.handshaking += 1
        try:
            accepting = await incoming.accept()
            conn = await asyncio.wait_for(accepting.connect(), HANDSHAKE_TIMEOUT_S)
        except (TimeoutError, self.iroh.IrohError) as exc:
            if not self.closing:
                self.refusals.refuse("", f"an incoming handshake failed: {iroh_reason(exc)}")
            return
        finally:
            self.handshaking -= 1
        remote = str(conn.remote_id())
        if self.allowed is not None and remote not in self.allowed:
            self.refusals.refuse(
                remote,
                f"refused a connection from endpoint {remote}: not in this run's allow-list "
                f"of {len(self.allowed)} endpoint(s)",
            )
            conn.close(REFUSE_CODE, REFUSE_REASON)
            return
        why = self.caps.admit(remote)
        if why is not None:
            self.refusals.refuse(remote, f"refused a connection from endpoint {remote}: {why}")
            conn.close(BUSY_CODE, BUSY_REASON)
            return
        self.adopt(conn, remote)

    def adopt(self, conn: Connection, remote: str) -> None:
        """Serve a new connection (counted in ``caps`` by the caller): accept the peer's streams and notice when it
        closes."""
        conn.set_max_concurrent_uni_streams(MAX_STREAMS_PER_CONNECTION)
        self.conns[conn.stable_id()] = conn
        self.remotes[conn.stable_id()] = remote
        self.spawn(self._accept_streams(conn, remote))
        self.spawn(self._watch(conn, remote))
        self.spawn(self._watch_path(conn, remote))

    async def _watch_path(self, conn: Connection, remote: str) -> None:
        """Log the connection's selected path when one is first selected and whenever it changes (module docstring)."""
        shown: tuple[bool, str] | None = None
        conn_id = conn.stable_id()
        while conn_id in self.conns and not self.closing:
            try:
                selected = next((p for p in conn.paths() if p.is_selected), None)
            except Exception:  # noqa: BLE001 - best effort: a connection the binding no longer serves has no path
                return
            if selected is not None and (selected.is_relay, selected.remote_addr) != shown:
                now = _path_kind(selected.is_relay, selected.remote_addr)
                said = f"path {now}" if shown is None else f"path changed: now {now}, was {_path_kind(*shown)}"
                log(f"endpoint {self.endpoint_id} <-> endpoint {remote}: {said} (rtt {selected.rtt_ms} ms)")
                shown = (selected.is_relay, selected.remote_addr)
            await asyncio.sleep(PATH_POLL_S)

    async def _accept_streams(self, conn: Connection, remote: str) -> None:
        while True:
            try:
                stream = await conn.accept_uni()
            except self.iroh.IrohError:
                return
            threading.Thread(
                target=self._read_stream, args=(conn, stream, remote), name="ppharness-iroh-reader", daemon=True
            ).start()

    def _read_stream(self, conn: Connection, stream: RecvStream, remote: str) -> None:
        """Deliver one stream's records until it ends (runs on a thread of its own)."""
        reader = _RecordReader(stream, self.run)
        try:
            hello = reader.next(MAX_HELLO)
            if hello is None:
                return
            sender = self._check_hello(hello, remote)
            if sender not in self.inbound:  # one address per connection: a new one replaces the old
                for address in [a for a, c in list(self.inbound.items()) if c is conn]:
                    self.inbound.pop(address, None)
                self.inbound[sender] = conn
            put = self.incoming.put
            while (record := reader.next(MAX_RECORD)) is not None:
                put((sender, record))
        except _BadStream as exc:
            line = f"stopped reading a stream from endpoint {remote}: {exc}"
            PROCESS_DROPS.drop(log, line, "a stream that is not the run's", remote)  # bounded per process
            try:
                self.run(stream.stop(1))
            except (self.iroh.IrohError, RuntimeError):
                pass
        except (self.iroh.IrohError, RuntimeError):
            return

    def _check_hello(self, hello: bytes, remote: str) -> str:
        try:
            sender = hello.decode("utf-8")
            claimed = str(parse_address(self.iroh, sender).id())
        except (UnicodeDecodeError, TypeError, self.iroh.IrohError) as exc:
            raise _BadStream(f"its first record is not an iroh address ({iroh_reason(exc)})") from exc
        if claimed != remote:
            raise _BadStream(f"it claims the address of endpoint {claimed}, but the connection is from {remote}")
        return sender

    async def _watch(self, conn: Connection, remote: str) -> None:
        try:
            reason = await conn.closed()
        except self.iroh.IrohError as exc:
            reason = iroh_reason(exc)
        self.conns.pop(conn.stable_id(), None)
        if self.remotes.pop(conn.stable_id(), None) is not None:
            self.caps.release(remote)
        for address, c in list(self.inbound.items()):
            if c is conn:
                self.inbound.pop(address, None)
        for peer in self.peers.values():
            if peer.conn is conn and peer.error is None:
                self.fail(
                    peer,
                    PeerClosed(f"iroh peer {peer.address} (endpoint {remote}): the connection ended: {reason}"),
                    quiet=CLOSE_REASON.decode() in reason,
                )

    # --- outgoing ---------------------------------------------------------------------------------------------

    async def connect(self, address: str, target: EndpointAddr, remote: str, timeout: float) -> Peer:
        """The peer for ``address``: reuse a connection the peer opened to us, else dial; then say hello."""
        peer = self.peers.get(address)
        if peer is not None:
            return peer
        self._make_room_for_a_peer(address)
        conn = self.inbound.get(address) or next(
            (self.conns[i] for i, r in self.remotes.items() if r == remote and i in self.conns), None
        )
        try:
            if conn is None:
                why = self.caps.admit(remote)
                if why is not None:
                    raise ConnectFailed(f"cannot connect to {address} (endpoint {remote}): {why}")
                try:
                    conn = await asyncio.wait_for(self.endpoint.connect(target, ALPN), timeout)
                except BaseException:
                    self.caps.release(remote)
                    raise
                if str(conn.remote_id()) != remote:
                    self.caps.release(remote)
                    conn.close(REFUSE_CODE, REFUSE_REASON)
                    raise ConnectFailed(f"cannot connect to {address}: it answered as another endpoint")
                self.adopt(conn, remote)
            stream = await conn.open_uni()
            hello = self.address.encode()
            await asyncio.wait_for(stream.write_all(PREFIX.pack(len(hello)) + hello), timeout)
        except TimeoutError as exc:
            raise ConnectFailed(
                f"cannot connect to {address} (endpoint {remote}): no answer within {timeout:g} s "
                "(peer down, never started, or unreachable)"
            ) from exc
        except self.iroh.IrohError as exc:
            raise ConnectFailed(f"cannot connect to {address} (endpoint {remote}): {iroh_reason(exc)}") from exc
        return self.peers.setdefault(address, Peer(address, remote, conn, stream))

    def _make_room_for_a_peer(self, address: str) -> None:
        """Forget failed peers when ``MAX_PEERS`` are kept; refuse a new one when all of them are live."""
        if len(self.peers) < MAX_PEERS:
            return
        for key in [k for k, p in self.peers.items() if p.error is not None]:
            del self.peers[key]
        if len(self.peers) >= MAX_PEERS:
            raise ConnectFailed(
                f"cannot connect to {address}: this endpoint already sends to {MAX_PEERS} addresses, the most it keeps"
            )

    def fail(self, peer: Peer, error: TransportError, quiet: bool = False) -> None:
        peer.error = error
        if not quiet and not self.closing:
            log(str(error))

    # --- shutdown ---------------------------------------------------------------------------------------------

    async def shutdown(self, linger: float) -> None:
        """Finish every stream, wait up to ``linger`` s for the peers to acknowledge what was written, then close the
        connections and the endpoint."""
        loop = asyncio.get_running_loop()
        self.closing = True
        live = [p for p in self.peers.values() if p.error is None]
        for peer in live:
            await _quietly(peer.stream.finish())
        stopped = [loop.create_task(_quietly(p.stream.stopped())) for p in live]
        if stopped:
            await asyncio.wait(stopped, timeout=linger)
        for conn in list(self.conns.values()):
            conn.close(CLOSE_CODE, CLOSE_REASON)
        await _quietly(asyncio.wait_for(self.endpoint.close(), 2.0))
        self.refusals.flush()
        leftover = [t for t in (*self.tasks, *stopped) if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.wait(leftover, timeout=1.0)


def _path_kind(is_relay: bool, remote_addr: str) -> str:
    return f"through the relay {remote_addr}" if is_relay else f"direct to {remote_addr}"


async def _quietly(aw: Awaitable[object]) -> None:
    try:
        await aw
    except Exception:  # noqa: BLE001 - shutdown and stop are best effort: the peer may already be gone
        pass


class _RecordReader:
    """Length-prefixed records from one stream: one ``read`` usually brings whole records (several when the sender
    wrote them back to back); a record still incomplete once its length is known is finished with one
    ``read_exact``. ``run`` runs one binding coroutine to completion on the calling thread."""

    def __init__(self, stream: RecvStream, run: RunBlocking) -> None:
        self.stream, self.run = stream, run
        self.buf = b""
        self.pos = 0

    def next(self, limit: int) -> bytes | None:
        """The next record; None at a clean end of stream. Raises _BadStream for a record over ``limit`` bytes or a
        stream that ends inside a record."""
        while True:
            buf, pos = self.buf, self.pos
            if len(buf) - pos >= PREFIX.size:
                (n,) = PREFIX.unpack_from(buf, pos)
                if n > limit:
                    raise _BadStream(f"a record of {n} bytes exceeds the {limit}-byte limit")
                start, end = pos + PREFIX.size, pos + PREFIX.size + n
                if len(buf) >= end:
                    self.pos = end
                    return buf[start:end]
                rest = self.run(self.stream.read_exact(end - len(buf)))
                self.buf, self.pos = b"", 0
                return buf[start:] + rest
            chunk = self.run(self.stream.read(READ_CHUNK))
            if not chunk:
                if len(buf) > pos:
                    raise _BadStream(f"the stream ended inside a record ({len(buf) - pos} bytes left over)")
                return None
            self.buf, self.pos = buf[pos:] + chunk, 0
