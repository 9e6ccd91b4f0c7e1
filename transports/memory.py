"""In-process transport: endpoints are inboxes (``queue.Queue``) in a hub, addressed ``memory://<name>``.

Frames still go through ``ppharness.wire.codec`` (the base class encodes and decodes), so tests on this transport
exercise the real wire format without sockets. Guarantees:

- delivery is reliable and in order per sender -> receiver pair; every method is thread-safe;
- sending to an address that no started, open endpoint holds raises ``ConnectFailed`` naming the address;
- ``recv_frame(None)`` waits forever, ``recv_frame(0)`` (or a negative timeout) does not wait, otherwise it waits up to
  ``timeout`` seconds; it raises ``TransportTimeout`` when nothing arrived;
- after ``close()`` every method raises ``TransportClosed``, and a ``recv_frame`` blocked in another thread wakes up and
  raises it too; ``close()`` is idempotent and removes the endpoint from its hub (frames still queued are dropped).
"""

from __future__ import annotations

import itertools
import queue
import threading

from ppharness.errors import ConnectFailed, TransportClosed, TransportError, TransportTimeout
from ppharness.seams.transport import Transport

SCHEME = "memory://"


class MemoryHub:
    """A process-local directory of memory endpoints: address -> inbox. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[str, queue.Queue[tuple[str, bytes] | None]] = {}

    def register(self, address: str, inbox: queue.Queue[tuple[str, bytes] | None]) -> None:
        """Make ``address`` reachable; ``ConnectFailed`` if another endpoint holds it."""
        with self._lock:
            if address in self._inboxes:
                raise ConnectFailed(f"cannot bind {address}: another memory endpoint holds it")
            self._inboxes[address] = inbox

    def unregister(self, address: str, inbox: queue.Queue[tuple[str, bytes] | None]) -> None:
        """Forget ``address`` if ``inbox`` still holds it."""
        with self._lock:
            if self._inboxes.get(address) is inbox:
                del self._inboxes[address]

    def inbox(self, address: str) -> queue.Queue[tuple[str, bytes] | None]:
        """The inbox at ``address``; ``ConnectFailed`` if no open endpoint holds it."""
        with self._lock:
            try:
                return self._inboxes[address]
            except KeyError:
                raise ConnectFailed(f"no memory endpoint at {address} (never started, or closed)") from None

    def addresses(self) -> list[str]:
        """The addresses currently reachable."""
        with self._lock:
            return sorted(self._inboxes)


DEFAULT_HUB = MemoryHub()
_names = itertools.count()


class MemoryTransport(Transport):
    """One endpoint on ``hub`` (the module's ``DEFAULT_HUB`` when None) named ``name`` (a unique one when None)."""

    kind = "memory"
    one_process = True

    def __init__(self, hub: MemoryHub | None = None, name: str | None = None) -> None:
        self._hub = DEFAULT_HUB if hub is None else hub
        self._address = SCHEME + (f"endpoint-{next(_names)}" if name is None else name)
        self._inbox: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._started = False
        self._closed = False

    def start(self) -> str:
        """Register on the hub and return ``memory://<name>``. Calling it again returns the same address."""
        with self._lock:
            self._check_open()
            if not self._started:
                self._hub.register(self._address, self._inbox)
                self._started = True
        return self._address

    @property
    def address(self) -> str:
        return self._address

    def send_frame(self, address: str, frame: bytes) -> None:
        self._check_ready()
        self._hub.inbox(address).put((self._address, bytes(frame)))

    def recv_frame(self, timeout: float | None = None) -> tuple[str, bytes]:
        self._check_ready()
        try:
            if timeout is None:
                item = self._inbox.get()
            elif timeout <= 0:
                item = self._inbox.get_nowait()
            else:
                item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"{self._address}: nothing arrived within {timeout} s") from None
        if item is None:
            self._inbox.put(None)
            raise TransportClosed(f"{self._address} was closed while waiting to receive")
        return item

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._hub.unregister(self._address, self._inbox)
        self._inbox.put(None)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportClosed(f"{self._address} is closed")

    def _check_ready(self) -> None:
        self._check_open()
        if not self._started:
            raise TransportError(f"{self._address} is not started: call start() first")
