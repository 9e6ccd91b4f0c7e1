"""ZeroMQ transport: one PULL socket bound per endpoint, one cached PUSH socket per destination, all over CURVE.

A message on the wire is a 2-part zmq multipart message ``[sender address (utf-8), codec frame]``.

Only members talk to a run. Every endpoint has a CURVE key pair (ZeroMQ's elliptic-curve authentication and
encryption, RFC 26); its address carries its public key (``tcp://host:port?curve=<hex public key>``), so dialling an
address also authenticates the endpoint behind it. The PULL socket is a CURVE server whose ZAP handler (RFC 27, a
thread of this transport) admits only client keys on the ``allowed`` list (``plan_endpoints`` makes one key pair per
run member and gives every member the run's list); any other key is refused during the handshake, logged on stderr
with its key and address, and counted in ``refused``: nothing it sends is delivered. A member's messages are stamped
by ZeroMQ with the key it authenticated with, and the sender address a message names must carry that same key, so a
member cannot pose as another: a message that does is dropped and logged. Without ``allowed`` (a transport built by
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
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator

try:
    import zmq
    import zmq.utils.monitor
    from zmq.utils import z85
except ImportError as exc:  # pragma: no cover - pyzmq is a declared dependency
    raise ImportError("the zmq transport needs pyzmq: pip install pyzmq") from exc

from ppharness.errors import CodecError, ConnectFailed, TransportClosed, TransportError, TransportTimeout
from ppharness.seams.transport import JsonObject, Transport
from ppharness.wire import codec

SNDHWM = 1000
LINGER_MS = 2000
POLL_SLICE_S = 0.1
MAX_MESSAGE_BYTES = codec.HEADER.size + codec.MAX_FRAME_BYTES

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's authentication handler (RFC 27)
KEY_PARAM = "?curve="
MAX_REFUSAL_LOGS = 32  # distinct refused keys logged one line each; later ones are counted

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
        self.refused: deque[str] = deque(maxlen=256)  # hex keys refused at the handshake, most recent last
        self.forged = 0  # messages dropped because the sender they named was not the key they came with
        self._refusals_logged: set[str] = set()
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
        self._pushes: dict[str, zmq.Socket[bytes]] = {}
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
                    self._watch_handshakes(pull)
                    pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                    pull.setsockopt(zmq.IPV6, int(":" in self._host or ":" in self._advertise_host))
                    pull.bind(endpoint)
                    bound = pull.getsockopt_string(zmq.LAST_ENDPOINT)
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

    # --- frames ---------------------------------------------------------------------------------------------------

    def send_frame(self, address: str, frame: bytes) -> None:
        with self._send_lock:
            self._check_ready()
            push = self._pushes.get(address) or self._connect(address)
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
        _log(
            f"{self._address}: dropped a message from key {authenticated[:16]}... naming another sender "
            f"({frames[0].bytes[:120]!r})"
        )
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
            zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
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
                    self._refuse(
                        "",
                        "",
                        f"the security handshake failed ({zmq.Event(event['event']).name}: no "
                        "CURVE, or another server key)",
                    )
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
        self.refused.append(key)
        if key in self._refusals_logged:
            return
        if len(self._refusals_logged) < MAX_REFUSAL_LOGS:
            self._refusals_logged.add(key)
            _log(
                f"{self._address or self._host}: refused a connection from {peer or 'an unknown address'} "
                f"(key {key or '-'}): {why}"
            )
        elif len(self._refusals_logged) == MAX_REFUSAL_LOGS:
            self._refusals_logged.add("")
            _log(f"{self._address or self._host}: refusing more strangers; no longer logging each one")

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
