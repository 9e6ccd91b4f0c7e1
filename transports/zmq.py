"""ZeroMQ transport: one PULL socket bound per endpoint, one cached PUSH socket per destination, all over CURVE.

A message on the wire is a 2-part zmq multipart message ``[sender address (utf-8), codec frame]``.

Only members talk to a run. Every endpoint has a CURVE key pair (ZeroMQ's elliptic-curve authentication and
encryption, RFC 26); its address carries its public key (``tcp://host:port?curve=<hex public key>``), so dialling an
address also authenticates the endpoint behind it. The PULL socket is a CURVE server whose ZAP handler (RFC 27, a
thread of this transport) admits only client keys on the ``allowed`` list (``plan_endpoints`` makes one key pair per
run member and gives every member the run's list); any other key is refused during the handshake, logged on stderr
with its key and address (``transports.bounds.RefusalLog``: the first few distinct keys, then counts), and kept in
``refused``: nothing it sends is delivered. A member's messages are stamped by ZeroMQ with the key it authenticated
with, and the sender address a message names must carry that same key, so a member cannot pose as another: a message
that does is dropped and logged. Without ``allowed`` (a transport built by
hand, e.g. in a benchmark) any key may connect, and the sender check still holds. Guarantees:

- delivery is reliable and in order per sender -> receiver pair while both stay up (zmq's TCP PUSH/PULL);
- each transport has its own ``zmq.Context``, so several transports in one process are independent;
- ``send_frame`` queues without waiting for the peer; when ``SNDHWM`` frames are queued for one destination it blocks
  up to ``send_timeout`` seconds, then raises ``ConnectFailed`` (the peer is down, never came up, or stopped reading);
  an address zmq cannot parse or dial raises ``ConnectFailed`` at once;
- ``recv_frame(None)`` waits forever, ``recv_frame(0)`` (or a negative timeout) does not wait, otherwise it waits up to
  ``timeout`` seconds; it raises ``TransportTimeout`` when nothing arrived; a message that is not exactly 2 parts, or
  whose sender part is not utf-8, is consumed and raised as ``CodecError``;
- sending is serialised by a lock, so any thread may send; one thread at a time receives; ``close()`` from another
  thread makes a blocked ``recv_frame`` raise ``TransportClosed`` within ``POLL_SLICE_S``;
- ``close()`` gives queued outgoing frames up to ``LINGER_MS`` to flush, closes every socket and terminates the
  context; it is idempotent, and any later use raises ``TransportClosed``;
- every ``zmq.ZMQError`` surfaces as a ``ppharness.errors`` type (``raise ... from``), never as a pyzmq type.

What a peer can make an endpoint spend is bounded: a connection that has not finished the CURVE handshake within
``HANDSHAKE_IVL_MS`` is closed; accepted connections are capped in total and per remote host (a quarter of the
process's file limit, at most ``MAX_CONNECTIONS``; ``MAX_CONNECTIONS_PER_HOST``): the socket monitor sees each one
accepted and one over a cap is shut down at once, counted in ``shed`` and logged with the refusals; at most
``MAX_PUSH_SOCKETS`` destinations keep a PUSH socket (the least recently used one is closed, its queue given
``LINGER_MS`` to flush); ``start()`` raises the process's soft limit on open files to the hard limit.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterator

try:
    import zmq
    import zmq.utils.monitor
    from zmq.utils import z85
except ImportError as exc:  # pragma: no cover - pyzmq is a declared dependency
    raise ImportError("the zmq transport needs pyzmq: pip install pyzmq") from exc

from ppharness.errors import CodecError, ConnectFailed, TransportClosed, TransportError, TransportTimeout
from ppharness.seams.transport import JsonObject, Transport
from ppharness.trace.drops import PROCESS_DROPS
from ppharness.wire import codec
from transports.bounds import ConnectionCaps, RefusalLog, raise_open_file_limit

SNDHWM = 1000
LINGER_MS = 2000
POLL_SLICE_S = 0.1
MAX_MESSAGE_BYTES = codec.HEADER.size + codec.MAX_FRAME_BYTES

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's authentication handler (RFC 27)
KEY_PARAM = "?curve="
HANDSHAKE_IVL_MS = 2000  # a connection that has not finished the CURVE handshake by then is closed
MAX_CONNECTIONS = 512  # accepted connections open at once (and at most a quarter of the process's file limit)
MAX_CONNECTIONS_PER_HOST = 128  # accepted connections open at once from one remote host
MAX_PUSH_SOCKETS = 256  # destinations with an open PUSH socket
RECOUNT_EVERY_S = 1.0  # how often a full cap rechecks the connections it counts (a monitor event may be lost)

_WILDCARD_HOSTS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
_CLOSED_ERRNOS = frozenset({zmq.ETERM, zmq.ENOTSOCK})
_CONNECT_ERRNOS = frozenset(
    {
        zmq.EINVAL,
        zmq.EPROTONOSUPPORT,
        zmq.ENOCOMPATPROTO,
        zmq.EADDRINUSE,
        zmq.EADDRNOTAVAIL,
        zmq.EHOSTUNREACH,
        zmq.ECONNREFUSED,
    }
)


def _host_part(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def split_address(address: str) -> tuple[str, str]:
    """``tcp://host:port?curve=<hex>`` -> (``tcp://host:port``, hex public key); the key is '' when absent."""
    endpoint, _, key = address.partition(KEY_PARAM)
    return endpoint, key


def _log(text: str) -> None:
    print(f"[ppharness zmq] {text}", file=sys.stderr, flush=True)


def _z85_to_hex(key: str | bytes) -> str:
    return z85.decode(key).hex()


def _remote_host(fd: int, port: int) -> str | None:
    """The remote host of the TCP connection on ``fd`` when it is one accepted on local ``port``, else None."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None  # closed, or no descriptor left to look at it with
    with sock:
        try:
            if sock.getsockname()[1] != port:
                return None
            return str(sock.getpeername()[0])
        except (OSError, IndexError):
            return None


def _shut_down(fd: int) -> None:
    """End the connection on ``fd`` (libzmq's I/O thread then sees it end and closes the descriptor itself)."""
    with contextlib.suppress(OSError):
        sock = socket.socket(fileno=os.dup(fd))
        with sock:
            sock.shutdown(socket.SHUT_RDWR)


class ZmqTransport(Transport):
    """An endpoint bound on ``tcp://host:port`` (``port=0``: a free port the OS picks).

    ``advertise_host`` is the host peers dial when it differs from the bind host (bind ``0.0.0.0`` inside a container,
    advertise its reachable IP); a wildcard bind host without it is refused, since peers cannot dial a wildcard.
    ``advertise_port`` is the port peers dial when it differs from the bound one (a port the platform publishes in
    front of the socket, as vast.ai maps a container port to another public port); without it the address names the
    bound port.
    ``send_timeout`` bounds how long ``send_frame`` blocks on a full queue (``None``: forever). ``secret_key`` (z85)
    fixes the endpoint's CURVE identity (default: a fresh key pair); ``allowed`` lists the public keys (hex) that may
    connect (default: any).
    """

    kind = "zmq"
    ip_protocol = "tcp"  # what a port it binds is a port of (a platform publishing it maps this protocol)

    @classmethod
    def plan_endpoints(cls, count: int, settings: JsonObject) -> list[JsonObject]:
        """A fresh CURVE key pair per endpoint, every endpoint admitting exactly the run's ``count`` public keys."""
        unknown = sorted(k for k, v in settings.items() if v is not None)
        if unknown:
            raise TransportError(f"zmq transport: unknown setting(s) {', '.join(unknown)} (it has none)")
        pairs = [zmq.curve_keypair() for _ in range(count)]
        allowed = [_z85_to_hex(public) for public, _ in pairs]
        return [{"secret_key": secret.decode("ascii"), "allowed": allowed} for _, secret in pairs]

    @classmethod
    def identity(cls, opts: JsonObject) -> str:
        """The CURVE public key (hex) of the endpoint with ``opts``' secret key."""
        secret = opts.get("secret_key")
        return _z85_to_hex(zmq.curve_public(secret.encode("ascii"))) if isinstance(secret, str) else ""

    @classmethod
    def identity_of(cls, address: str) -> str:
        return split_address(address)[1].lower()

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        send_timeout: float | None = 30.0,
        secret_key: str | None = None,
        allowed: list[str] | None = None,
        advertise_port: int | None = None,
    ) -> None:
        advertised = host if advertise_host is None else advertise_host
        if advertised in _WILDCARD_HOSTS:
            raise TransportError(f"bind host {host!r} is a wildcard peers cannot dial: pass advertise_host")
        if advertise_port is not None and (
            isinstance(advertise_port, bool) or not isinstance(advertise_port, int) or not 1 <= advertise_port <= 65535
        ):
            raise TransportError(f"zmq transport: advertise_port {advertise_port!r} is not a TCP port (1-65535)")
        try:
            if secret_key is None:
                public, secret = zmq.curve_keypair()
            else:
                secret = secret_key.encode("ascii")
                public = zmq.curve_public(secret)
        except (ValueError, UnicodeError, zmq.ZMQError) as exc:
            raise TransportError(
                f"zmq transport: secret_key is not a z85 CURVE secret key ({type(exc).__name__})"
            ) from None
        self._public, self._secret = public, secret
        self.public_key = _z85_to_hex(public)
        self._allowed = None if allowed is None else frozenset(k.lower() for k in allowed)
        self._refusals = RefusalLog(_log, lambda: self._address or self._host)
        self.forged = 0  # messages dropped because the sender they named was not the key they came with
        self._caps = ConnectionCaps(MAX_CONNECTIONS, MAX_CONNECTIONS_PER_HOST)
        self._accepted: dict[int, str] = {}  # file descriptor of an accepted connection -> its remote host
        self._bound_port = 0
        self._recounted = 0.0
        self._accept_errors: set[int] = set()
        self._zap: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._zap_thread: threading.Thread | None = None
        self._host = host
        self._port = port
        self._advertise_host = advertised
        self._advertise_port = advertise_port
        self._send_timeout_ms = -1 if send_timeout is None else max(0, int(send_timeout * 1000))
        self._address: str | None = None
        self._address_bytes = b""
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pull: zmq.Socket[bytes] | None = None
        self._pushes: OrderedDict[str, zmq.Socket[bytes]] = OrderedDict()  # least recently used first
        self._state_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind the PULL socket and return ``tcp://<advertise_host>:<advertise_port or the bound port>``. Calling it
        again returns the same."""
        with self._state_lock:
            self._check_open()
            if self._address is not None:
                return self._address
            port = "*" if self._port == 0 else str(self._port)
            endpoint = f"tcp://{_host_part(self._host)}:{port}"
            total = max(16, min(MAX_CONNECTIONS, raise_open_file_limit() // 4))
            self._caps = ConnectionCaps(total, min(MAX_CONNECTIONS_PER_HOST, total))
            ctx = pull = None
            try:
                with self._map_errors("bind", endpoint):
                    ctx = zmq.Context()
                    self._start_zap(ctx)
                    pull = ctx.socket(zmq.PULL)
                    pull.setsockopt(zmq.LINGER, 0)
                    pull.curve_server = True
                    pull.curve_secretkey = self._secret
                    pull.curve_publickey = self._public
                    pull.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)
                    pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                    pull.setsockopt(zmq.IPV6, int(":" in self._host or ":" in self._advertise_host))
                    self._watch_handshakes(pull)
                    pull.bind(endpoint)
                    bound = pull.getsockopt_string(zmq.LAST_ENDPOINT)
                    self._bound_port = int(bound.rsplit(":", 1)[1])
            except BaseException:
                if pull is not None:
                    pull.close(linger=0)
                if ctx is not None:
                    self._stop_zap(ctx)
                raise
            self._ctx, self._pull = ctx, pull
            port = bound.rsplit(":", 1)[1] if self._advertise_port is None else str(self._advertise_port)
            self._address = f"tcp://{_host_part(self._advertise_host)}:{port}{KEY_PARAM}{self.public_key}"
            self._address_bytes = self._address.encode()
            return self._address

    @property
    def address(self) -> str:
        if self._address is None:
            raise TransportError("zmq transport is not started: call start() first")
        return self._address

    @property
    def refused(self) -> deque[str]:
        """What was refused, most recent last (bounded): a stranger's hex key, '' for a failed handshake, ``host <ip>``
        for a connection over the caps."""
        return self._refusals.recent

    @property
    def refused_total(self) -> int:
        """How many connections were refused since start."""
        return self._refusals.total

    @property
    def shed(self) -> int:
        """How many accepted connections were shut down because a connection cap was reached."""
        return self._caps.shed

    def close(self) -> None:
        with self._state_lock:
            if self._closed:
                return
            self._closed = True
        with self._recv_lock, self._send_lock:
            for push in self._pushes.values():
                push.close(linger=LINGER_MS)
            self._pushes.clear()
            if self._pull is not None:
                self._pull.close(linger=0)
            if self._ctx is not None:
                self._stop_zap(self._ctx)
        self._refusals.flush()

    # --- frames ---------------------------------------------------------------------------------------------------

    def send_frame(self, address: str, frame: bytes) -> None:
        with self._send_lock:
            self._check_ready()
            push = self._pushes.get(address)
            if push is None:
                push = self._connect(address)
            else:
                self._pushes.move_to_end(address)
            with self._map_errors("send to", address):
                push.send_multipart([self._address_bytes, frame], copy=False)

    def recv_frame(self, timeout: float | None = None) -> tuple[str, bytes]:
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while True:
            with self._recv_lock:
                self._check_ready()
                assert self._pull is not None
                wait = POLL_SLICE_S if deadline is None else min(POLL_SLICE_S, max(0.0, deadline - time.monotonic()))
                with self._map_errors("receive on", self._address):
                    frames = None
                    if self._pull.poll(int(wait * 1000)):
                        with contextlib.suppress(zmq.Again):  # a readiness event with no whole message behind it
                            frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=False)
                    if frames is not None and self._genuine(frames):
                        parts = [f.bytes for f in frames]
                        break
            if deadline is not None and time.monotonic() >= deadline:
                raise TransportTimeout(f"{self._address}: nothing arrived within {timeout} s")
        if len(parts) != 2:
            sizes = ", ".join(str(len(p)) for p in parts)
            raise CodecError(
                f"{self._address}: malformed zmq message of {len(parts)} parts ({sizes} bytes), "
                "expected 2 [sender address, frame]"
            )
        try:
            sender = parts[0].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CodecError(f"{self._address}: sender address part is not utf-8: {parts[0][:64]!r}") from exc
        return sender, parts[1]

    # --- authentication -------------------------------------------------------------------------------------------

    def _genuine(self, frames: list[zmq.Frame]) -> bool:
        """Whether a received message names as its sender the key it authenticated with; otherwise drop and log."""
        authenticated = str(frames[0].get("User-Id")) if frames else ""  # a string property: the ZAP user id
        try:
            claimed = split_address(frames[0].bytes.decode("utf-8"))[1] if len(frames) == 2 else authenticated
        except UnicodeDecodeError:
            claimed = authenticated  # the codec path reports the bad sender part
        if claimed.lower() == authenticated:
            return True
        self.forged += 1
        line = (
            f"{self._address}: dropped a message from key {authenticated[:16]}... naming another sender "
            f"({frames[0].bytes[:120]!r})"
        )
        PROCESS_DROPS.drop(_log, line, "a frame naming another sender", f"curve key {authenticated[:16]}")
        return False

    def _start_zap(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        """Bind this context's ZAP handler and serve it from a thread until the context ends."""
        self._zap = ctx.socket(zmq.REP)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        self._zap_thread = threading.Thread(target=self._serve_zap, args=(self._zap,), name="zmq-zap", daemon=True)

    def _watch_handshakes(self, pull: zmq.Socket[bytes]) -> None:
        """Start the ZAP thread, also watching ``pull`` for handshakes that fail before ZAP is asked (a peer without
        CURVE, or one that dialled with another server key)."""
        self._monitor = pull.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_ACCEPTED
            | zmq.EVENT_ACCEPT_FAILED
            | zmq.EVENT_DISCONNECTED
        )
        assert self._zap_thread is not None
        self._zap_thread.start()

    def _stop_zap(self, ctx: zmq.Context[zmq.Socket[bytes]]) -> None:
        ctx.term()  # ends the ZAP thread's recv with ETERM; it closes its socket
        if self._zap_thread is not None:
            self._zap_thread.join(timeout=5)

    def _serve_zap(self, sock: zmq.Socket[bytes]) -> None:
        monitor = self._monitor
        assert monitor is not None, "_watch_handshakes() opens the monitor socket before it starts this thread"
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if sock in ready:
                    sock.send_multipart(self._zap_reply(sock.recv_multipart()))
                if monitor in ready:
                    event = zmq.utils.monitor.parse_monitor_message(monitor.recv_multipart())
                    self._on_event(event["event"], int(event["value"]))
        except zmq.ZMQError:
            pass  # the context was terminated: the transport is closing
        finally:
            sock.close(linger=0)
            monitor.close(linger=0)

    def _zap_reply(self, request: list[bytes]) -> list[bytes]:
        """Answer one ZAP request: 200 with the client's hex key as its user id for a member, 400 otherwise."""
        if len(request) < 6:
            return [b"1.0", request[1] if len(request) > 1 else b"", b"400", b"malformed request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism, *credentials = request
        if version != b"1.0" or mechanism != b"CURVE" or len(credentials) != 1 or len(credentials[0]) != 32:
            self._refuse(address.decode("utf-8", "replace"), "", f"mechanism {mechanism[:16]!r} instead of CURVE")
            return [b"1.0", request_id, b"400", b"CURVE only", b"", b""]
        key = credentials[0].hex()
        if self._allowed is not None and key not in self._allowed:
            self._refuse(address.decode("utf-8", "replace"), key, "not a member of this run")
            return [b"1.0", request_id, b"400", b"not a member of this run", b"", b""]
        return [b"1.0", request_id, b"200", b"OK", key.encode("ascii"), b""]

    def _refuse(self, peer: str, key: str, why: str) -> None:
        self._refusals.refuse(
            key, f"refused a connection from {peer or 'an unknown address'} (key {key or '-'}): {why}"
        )

    # --- connection caps (on the ZAP thread) ----------------------------------------------------------------------

    def _on_event(self, event: int, value: int) -> None:
        """One socket monitor event of the PULL socket: ``value`` is the connection's file descriptor for accepted and
        disconnected connections, an errno for a failed accept."""
        if event == zmq.EVENT_ACCEPTED:
            self._admit(value)
        elif event == zmq.EVENT_DISCONNECTED:
            host = self._accepted.pop(value, None)
            if host is not None:
                self._caps.release(host)
        elif event == zmq.EVENT_ACCEPT_FAILED:
            if value not in self._accept_errors and len(self._accept_errors) < 16:
                self._accept_errors.add(value)
                _log(f"{self._address or self._host}: could not accept a connection: {os.strerror(value)}")
        else:
            self._refuse(
                "",
                "",
                f"the security handshake failed ({zmq.Event(event).name}: no CURVE, or another server key)",
            )

    def _admit(self, fd: int) -> None:
        """Count a connection just accepted on ``fd`` against the caps; shut it down when one is reached."""
        host = _remote_host(fd, self._bound_port)
        if host is None:
            return  # already closed (its descriptor may now be another socket's)
        stale = self._accepted.pop(fd, None)
        if stale is not None:
            self._caps.release(stale)
        why = self._caps.refusal(host)
        if why is not None and self._recount():
            why = self._caps.refusal(host)
        if why is None:
            self._caps.add(host)
            self._accepted[fd] = host
            return
        self._caps.shed += 1
        _shut_down(fd)
        self._refuse(host, f"host {host}", f"over the connection caps ({why})")

    def _recount(self) -> bool:
        """Forget counted connections whose descriptor no longer holds the connection counted (at most once per
        ``RECOUNT_EVERY_S``); whether any was forgotten."""
        now = time.monotonic()
        if now - self._recounted < RECOUNT_EVERY_S:
            return False
        self._recounted = now
        gone = [fd for fd, host in self._accepted.items() if _remote_host(fd, self._bound_port) != host]
        for fd in gone:
            self._caps.release(self._accepted.pop(fd))
        return bool(gone)

    # --- internals ------------------------------------------------------------------------------------------------

    def _connect(self, address: str) -> zmq.Socket[bytes]:
        assert self._ctx is not None
        endpoint, key = split_address(address)
        try:
            server_key = z85.encode(bytes.fromhex(key)) if len(key) == 64 else None
        except ValueError:
            server_key = None
        if server_key is None:
            raise ConnectFailed(
                f"cannot connect to {address}: not a ppharness zmq address (it carries no CURVE key: "
                f"expected tcp://host:port{KEY_PARAM}<64 hex digits>)"
            )
        while len(self._pushes) >= MAX_PUSH_SOCKETS:
            _, oldest = self._pushes.popitem(last=False)
            oldest.close(linger=LINGER_MS)
        with self._map_errors("connect to", address):
            push = self._ctx.socket(zmq.PUSH)
            try:
                push.curve_serverkey = server_key
                push.curve_publickey = self._public
                push.curve_secretkey = self._secret
                push.setsockopt(zmq.SNDHWM, SNDHWM)
                push.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                push.setsockopt(zmq.LINGER, LINGER_MS)
                push.setsockopt(zmq.IPV6, int(address.startswith("tcp://[")))
                push.connect(endpoint)
            except BaseException:
                push.close(linger=0)
                raise
        self._pushes[address] = push
        return push

    @contextlib.contextmanager
    def _map_errors(self, action: str, peer: str | None) -> Iterator[None]:
        """Translate ``zmq.ZMQError`` into the ppharness error tree, naming ``action`` and ``peer``."""
        try:
            yield
        except zmq.ZMQError as exc:
            where = f"{action} {peer}" if peer else action
            if exc.errno in _CLOSED_ERRNOS:
                raise TransportClosed(f"zmq transport {self._address or self._host} is closed ({where})") from exc
            if exc.errno == zmq.EAGAIN and action == "send to":
                raise ConnectFailed(
                    f"cannot {where}: {SNDHWM} frames already queued and none taken for "
                    f"{self._send_timeout_ms / 1000:g} s (peer down, never started, or not reading)"
                ) from exc
            if exc.errno == zmq.EAGAIN:
                raise TransportTimeout(f"cannot {where}: nothing to read ({exc})") from exc
            if exc.errno in _CONNECT_ERRNOS:
                raise ConnectFailed(f"cannot {where}: {exc}") from exc
            raise TransportError(f"cannot {where}: {exc}") from exc

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"zmq transport {self._address or self._host} is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if self._address is None:
            raise TransportError("zmq transport is not started: call start() first")
