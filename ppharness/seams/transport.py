"""The Transport seam: how stages talk.

A transport owns one local address and delivers whole messages, **reliably and in order per sender→receiver pair**
(no gaps, no duplicates on a healthy connection). It is message-oriented: ``send`` takes a Message, ``recv`` returns the
sender's address and the Message. Framing and encoding are ``ppharness.wire.codec``'s; a transport moves frames.

Failures, by cause (all from ``ppharness.errors``):

- ``TransportClosed``: *you* closed this transport and then used it.
- ``PeerClosed`` / ``ConnectFailed``: the peer is gone or could not be reached.
- ``TransportTimeout``: ``recv`` waited its bounded time and nothing came.
- ``CodecError``: a frame arrived but was bad. ``recv`` raises it *after* consuming the frame, so the caller can log it
  and call ``recv`` again: one bad frame never wedges or crashes a receiver.

Every message goes through ``send`` and ``receive`` (``recv`` is ``receive`` without the timings), traced or not: they
report when encoding and the hand-over happened and the frame's size, which is all a trace needs (three clock reads per
message, tens of nanoseconds against a hop's hundreds of microseconds).

A hidden state travels beside its message as a handle (``send(address, header, tensor)``: the header is an activation
whose ``hidden`` bytes are still empty). A transport that crosses a process boundary packs it into the message here,
through the codec, in the header's wire dtype; one whose endpoints share a process (``ppharness.run.node.colocated``)
hands the handle itself over, and the receiver finds it in ``Received.tensor``.
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import Any, ClassVar, NamedTuple, Self

from ppharness.model.engine.hidden import Hidden
from ppharness.trace.tracer import now_ns
from ppharness.wire import codec
from ppharness.wire.messages import Message

JsonObject = dict[str, Any]  # constructor options and settings: JSON objects (they reach a node as PP_TRANSPORT_OPTS)


class Sent(NamedTuple):
    """One sent message: when its encoding began and ended and when the frame was handed over (``now_ns`` clock),
    and the frame's size in bytes."""

    encode_start_ns: int
    encode_end_ns: int
    sent_ns: int
    nbytes: int


class Received(NamedTuple):
    """One received message, its sender, when its frame was taken from the transport and when decoding ended
    (``now_ns`` clock), and the frame's size in bytes."""

    sender: str
    message: Message
    arrived_ns: int
    decoded_ns: int
    nbytes: int
    # a hidden state handed over in the process, beside its message (whose ``hidden`` bytes are then empty)
    tensor: Hidden | None = None


class Transport(abc.ABC):
    """One endpoint. ``start()`` binds and returns the address peers use to reach it."""

    kind: ClassVar[str] = "abstract"
    # whether its endpoints reach each other only within one process (no provider can run a chain over it); the
    # scenario fields the kind adds to its ``transport`` section are named in ``ppharness.registry``
    one_process: ClassVar[bool] = False

    @classmethod
    def plan_endpoints(cls, count: int, settings: JsonObject) -> list[JsonObject]:
        """Constructor options for the ``count`` endpoints of one run: index 0 is the seed (the orchestrator), the
        rest are the nodes in stage order. ``settings`` are the scenario's transport settings for this kind.

        The default ignores the settings; a transport with per-run identities (keys, allow-lists) creates them here.
        Options must be JSON-serialisable: they reach a node as ``PP_TRANSPORT_OPTS``.
        """
        return [{} for _ in range(count)]

    @classmethod
    def identity(cls, opts: JsonObject) -> str:
        """The public identity (its key) that an endpoint made from ``opts``, one of ``plan_endpoints``', authenticates
        with: what binds a member of the run to the role it was made for. '' for a transport without identities."""
        return ""

    @classmethod
    def identity_of(cls, address: str) -> str:
        """The identity a sender's address carries: the one the endpoint that received from it authenticated (a
        message's sender is always the address of the key it came with). '' when it carries none."""
        return ""

    @abc.abstractmethod
    def start(self) -> str:
        """Bind and return this endpoint's address (e.g. ``tcp://127.0.0.1:5555``)."""

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """The address returned by ``start``."""

    @abc.abstractmethod
    def send_frame(self, address: str, frame: bytes) -> None:
        """Queue one encoded frame for the endpoint at ``address``. Does not wait for the peer to process it."""

    @abc.abstractmethod
    def recv_frame(self, timeout: float | None = None) -> tuple[str, bytes]:
        """Wait up to ``timeout`` seconds (``None``: forever; ``0``: don't wait) for the next frame."""

    def send(self, address: str, msg: Message, tensor: Hidden | None = None) -> Sent:
        """Encode ``msg`` (with ``tensor``: an activation's header, the hidden state packed into it first, in the
        header's wire dtype) and queue it for ``address``; when that happened, and the frame's size."""
        t0 = now_ns()
        if tensor is not None:
            msg = codec.attach(msg, tensor)
        frame = codec.encode(msg)
        t1 = now_ns()
        self.send_frame(address, frame)
        return Sent(t0, t1, now_ns(), len(frame))

    def receive(self, timeout: float | None = None) -> Received:
        """The next message, its sender's address, when it arrived and was decoded. A bad frame is consumed, then
        raised as ``CodecError``."""
        sender, frame = self.recv_frame(timeout)
        arrived = now_ns()
        msg = codec.decode(frame)
        return Received(sender, msg, arrived, now_ns(), len(frame))

    def recv(self, timeout: float | None = None) -> tuple[str, Message]:
        """The next message and its sender's address (``receive`` without the timings)."""
        got = self.receive(timeout)
        return got.sender, got.message

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets. Idempotent."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
