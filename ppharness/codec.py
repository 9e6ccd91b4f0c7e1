"""Binary framing of messages and packing of hidden states.

A frame is an 8-byte header followed by a msgpack body::

    b"PP" | protocol version (u16, big-endian) | body length (u32, big-endian) | msgpack(Message)

Byte fields (the hidden state) are msgpack ``bin`` values: raw little-endian tensor bytes, no base64. The codec never
sees a socket; transports hand it whole frames. Every way a frame can be bad raises ``CodecError`` naming what was
wrong, so a receiver can log and drop it and keep serving.
"""

from __future__ import annotations

import struct

import msgspec
import numpy as np

from ppharness.errors import CodecError
from ppharness.messages import PROTOCOL_VERSION, Message, StageActivation

MAGIC = b"PP"
HEADER = struct.Struct(">2sHI")
MAX_FRAME_BYTES = 256 * 1024 * 1024

WIRE_DTYPES = ("f16", "bf16", "f32")

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """Message -> one frame (header + msgpack body)."""
    buf = bytearray(HEADER.size)
    _encoder.encode_into(msg, buf, HEADER.size)
    body_len = len(buf) - HEADER.size
    if body_len > MAX_FRAME_BYTES:
        raise CodecError(f"frame body of {body_len} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    HEADER.pack_into(buf, 0, MAGIC, PROTOCOL_VERSION, body_len)
    return bytes(buf)


def decode(frame: bytes | bytearray | memoryview, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """One frame -> Message. Raises CodecError (never anything else) for any bad frame."""
    frame = memoryview(frame)
    if len(frame) < HEADER.size:
        raise CodecError(f"truncated frame: {len(frame)} bytes is shorter than the {HEADER.size}-byte header")
    magic, version, body_len = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise CodecError(f"malformed frame: magic {bytes(magic)!r} is not {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise CodecError(f"wrong protocol version {version}: this node speaks version {PROTOCOL_VERSION}")
    if body_len > max_bytes:
        raise CodecError(f"oversized frame: body of {body_len} bytes exceeds the {max_bytes}-byte limit")
    actual = len(frame) - HEADER.size
    if actual < body_len:
        raise CodecError(f"truncated frame: header announces {body_len} body bytes, {actual} arrived")
    if actual > body_len:
        raise CodecError(f"malformed frame: {actual - body_len} bytes after the announced {body_len}-byte body")
    try:
        return _decoder.decode(frame[HEADER.size :])
    except msgspec.ValidationError as exc:
        raise CodecError(f"malformed message: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise CodecError(f"malformed msgpack body: {exc}") from exc
    except RecursionError as exc:
        raise CodecError(f"malformed msgpack body: nested too deeply ({exc})") from exc
    except UnicodeDecodeError as exc:
        raise CodecError(f"malformed msgpack body: a string is not utf-8 ({exc})") from exc


# --- hidden states --------------------------------------------------------------------------------------------------

_NUMPY_WIRE = {"f16": np.dtype("<f2"), "f32": np.dtype("<f4"), "bf16": np.dtype("<u2")}


def pack_hidden(x: np.ndarray, wire_dtype: str) -> tuple[bytes, tuple[int, ...]]:
    """A float array -> raw little-endian bytes in ``wire_dtype``. f16/f32 are exact for an fp16 model; bf16 rounds."""
    if wire_dtype not in _NUMPY_WIRE:
        raise CodecError(f"unknown wire dtype {wire_dtype!r}: expected one of {', '.join(WIRE_DTYPES)}")
    if wire_dtype == "bf16":
        f32 = np.ascontiguousarray(x, dtype="<f4")
        bits = f32.view("<u4")
        # round to nearest even on the 16 dropped bits; a NaN becomes the quiet NaN of its sign (rounding its mantissa
        # could carry it to inf)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        bits = np.where(np.isnan(f32), (bits >> 16) | 0x7FC0, rounded)
        return bits.astype("<u2").tobytes(), tuple(x.shape)
    return np.ascontiguousarray(x, dtype=_NUMPY_WIRE[wire_dtype]).tobytes(), tuple(x.shape)


def unpack_hidden(msg: StageActivation) -> np.ndarray:
    """The activation's bytes -> a float16 array of ``msg.shape``; a size or dtype mismatch is a CodecError."""
    if msg.dtype not in _NUMPY_WIRE:
        raise CodecError(f"activation for {msg.request_id!r} has unknown wire dtype {msg.dtype!r}")
    wire = _NUMPY_WIRE[msg.dtype]
    n = 1
    for d in msg.shape:
        if d < 0:
            raise CodecError(f"activation for {msg.request_id!r} has negative dimension in shape {msg.shape}")
        n *= d
    if n * wire.itemsize != len(msg.hidden):
        raise CodecError(
            f"activation for {msg.request_id!r}: shape {msg.shape} in {msg.dtype} needs {n * wire.itemsize} bytes, "
            f"got {len(msg.hidden)}"
        )
    arr = np.frombuffer(msg.hidden, dtype=wire).reshape(msg.shape)
    if msg.dtype == "bf16":
        arr = (arr.astype("<u4") << 16).view("<f4")
        # bf16 rounding can carry a finite fp16 value past the fp16 maximum: saturate it there instead of making it inf
        f16_max = float(np.finfo(np.float16).max)
        arr = np.where(np.isinf(arr), arr, np.clip(arr, -f16_max, f16_max))
    return arr.astype(np.float16)
