"""ZeroMQ transport: one PULL socket bound per endpoint, one cached PUSH socket per destination.

A message on the wire is a 2-part zmq multipart message ``[sender address (utf-8), codec frame]``. Guarantees:

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
import threading
import time
from collections.abc import Iterator

try:
    import zmq
except ImportError as exc:  # pragma: no cover - pyzmq is a declared dependency
    raise ImportError("the zmq transport needs pyzmq: pip install pyzmq") from exc

from ppharness import codec
from ppharness.errors import CodecError, ConnectFailed, TransportClosed, TransportError, TransportTimeout
from transports.base import Transport

SNDHWM = 1000
LINGER_MS = 2000
POLL_SLICE_S = 0.1
MAX_MESSAGE_BYTES = codec.HEADER.size + codec.MAX_FRAME_BYTES

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


class ZmqTransport(Transport):
    """An endpoint bound on ``tcp://host:port`` (``port=0``: a free port the OS picks).

    ``advertise_host`` is the host peers dial when it differs from the bind host (bind ``0.0.0.0`` inside a container,
    advertise its reachable IP); a wildcard bind host without it is refused, since peers cannot dial a wildcard.
    ``send_timeout`` bounds how long ``send_frame`` blocks on a full queue (``None``: forever).
    """

    kind = "zmq"

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        send_timeout: float | None = 30.0,
    ) -> None:
        advertised = host if advertise_host is None else advertise_host
        if advertised in _WILDCARD_HOSTS:
            raise TransportError(f"bind host {host!r} is a wildcard peers cannot dial: pass advertise_host")
        self._host = host
        self._port = port
        self._advertise_host = advertised
        self._send_timeout_ms = -1 if send_timeout is None else max(0, int(send_timeout * 1000))
        self._address: str | None = None
        self._address_bytes = b""
        self._ctx: zmq.Context | None = None
        self._pull: zmq.Socket | None = None
        self._pushes: dict[str, zmq.Socket] = {}
        self._state_lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._closed = False

    # --- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind the PULL socket and return ``tcp://<advertise_host>:<port>``. Calling it again returns the same."""
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
                    pull = ctx.socket(zmq.PULL)
                    pull.setsockopt(zmq.LINGER, 0)
                    pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
                    pull.setsockopt(zmq.IPV6, int(":" in self._host or ":" in self._advertise_host))
                    pull.bind(endpoint)
                    bound = pull.getsockopt_string(zmq.LAST_ENDPOINT)
            except BaseException:
                if pull is not None:
                    pull.close(linger=0)
                if ctx is not None:
                    ctx.term()
                raise
            self._ctx, self._pull = ctx, pull
            self._address = f"tcp://{_host_part(self._advertise_host)}:{bound.rsplit(':', 1)[1]}"
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
                self._ctx.term()

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
                    if self._pull.poll(int(wait * 1000)):
                        parts = self._pull.recv_multipart(zmq.NOBLOCK)
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

    # --- internals ------------------------------------------------------------------------------------------------

    def _connect(self, address: str) -> zmq.Socket:
        assert self._ctx is not None
        with self._map_errors("connect to", address):
            push = self._ctx.socket(zmq.PUSH)
            try:
                push.setsockopt(zmq.SNDHWM, SNDHWM)
                push.setsockopt(zmq.SNDTIMEO, self._send_timeout_ms)
                push.setsockopt(zmq.LINGER, LINGER_MS)
                push.setsockopt(zmq.IPV6, int(address.startswith("tcp://[")))
                push.connect(address)
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
