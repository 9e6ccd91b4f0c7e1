"""Binary framing of messages and packing of hidden states.

A frame is an 8-byte header followed by a msgpack body::

    b"PP" | protocol version (u16, big-endian) | body length (u32, big-endian) | msgpack(Message)

Byte fields (the hidden state) are msgpack ``bin`` values: raw little-endian tensor bytes, no base64. The codec never
sees a socket; transports hand it whole frames. Every way a frame can be bad raises ``CodecError`` naming what was
wrong, so a receiver can log and drop it and keep serving.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import cast

import msgspec
import numpy as np
from numpy.typing import NDArray

from ppharness.errors import CodecError
from ppharness.model.engine.hidden import Hidden
from ppharness.wire.messages import MESSAGE_TYPES, PROTOCOL_VERSION, ActivationRows, Message, StageActivation

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
    body = frame[HEADER.size :]
    try:
        return _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise CodecError(f"malformed message: {_diagnose(_not_a_message, body)}") from exc
    except RecursionError as exc:
        raise CodecError("malformed msgpack body: nested too deeply") from exc
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise CodecError(f"malformed msgpack body: {_diagnose(_not_msgpack, body)}") from exc


# --- what was wrong with a body the decoder refused, in this project's words (the library's text is the cause) ------

_BY_TAG: dict[str, type[Message]] = {str(cls.__struct_config__.tag): cls for cls in MESSAGE_TYPES}  # tag: class name
_TAG_FIELD = MESSAGE_TYPES[0].__struct_config__.tag_field
_WALK_LIMIT = 1 << 20  # msgpack items examined at most when explaining a bad body
_DEEP = 1000  # nesting levels past which a refused body is called too deep


def _diagnose(explain: Callable[[memoryview], str], body: memoryview) -> str:
    try:
        return explain(body)
    except Exception:  # the explanation is best effort; the frame is refused either way
        return "not a valid message"


def _not_msgpack(body: memoryview) -> str:
    """Why a body is not msgpack: a byte that starts no value, a string that is not UTF-8, a value cut short, nesting
    deeper than a decoder follows."""
    data = bytes(body)
    pos = items = depth = deepest = 0
    open_counts = [1]  # values still to read at each open nesting level: the body is one value
    while open_counts and items < _WALK_LIMIT:
        if open_counts[-1] == 0:
            open_counts.pop()
            depth -= 1
            continue
        if pos >= len(data):
            return "the body ends inside a value"
        items += 1
        open_counts[-1] -= 1
        b = data[pos]
        size, children, is_str = _item(data, pos, b)
        if size is None:
            return f"byte 0x{b:02x} at offset {pos} does not start a msgpack value"
        head, payload = size
        if pos + head + payload > len(data):
            return "the body ends inside a value"
        if is_str:
            try:
                data[pos + head : pos + head + payload].decode("utf-8")
            except UnicodeDecodeError:
                return f"the string at offset {pos} is not UTF-8"
        if children:
            open_counts.append(children)
            depth += 1
            deepest = max(deepest, depth)
        pos += head + payload
    if deepest >= _DEEP:
        return "nested too deeply"
    if not open_counts and pos < len(data):
        return f"{len(data) - pos} bytes after the value"
    return "not valid msgpack"


def _item(data: bytes, pos: int, b: int) -> tuple[tuple[int, int] | None, int, bool]:
    """(header bytes, payload bytes) of the msgpack item at ``pos``, how many values it contains, whether it is a
    string; (None, 0, False) for a byte that starts no item."""

    def n(width: int) -> int:
        return int.from_bytes(data[pos + 1 : pos + 1 + width], "big")

    if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
        return (1, 0), 0, False
    if 0x80 <= b <= 0x8F:
        return (1, 0), 2 * (b & 0x0F), False
    if 0x90 <= b <= 0x9F:
        return (1, 0), b & 0x0F, False
    if 0xA0 <= b <= 0xBF:
        return (1, b & 0x1F), 0, True
    fixed = {
        0xCA: 4,
        0xCB: 8,
        0xCC: 1,
        0xCD: 2,
        0xCE: 4,
        0xCF: 8,
        0xD0: 1,
        0xD1: 2,
        0xD2: 4,
        0xD3: 8,
        0xD4: 2,
        0xD5: 3,
        0xD6: 5,
        0xD7: 9,
        0xD8: 17,
    }
    if b in fixed:
        return (1, fixed[b]), 0, False
    sized = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
    if b in sized:
        return (1 + sized[b], n(sized[b])), 0, b >= 0xD9
    ext = {0xC7: 1, 0xC8: 2, 0xC9: 4}
    if b in ext:
        return (2 + ext[b], n(ext[b])), 0, False
    if b in (0xDC, 0xDD):
        width = 2 if b == 0xDC else 4
        return (1 + width, 0), n(width), False
    if b in (0xDE, 0xDF):
        width = 2 if b == 0xDE else 4
        return (1 + width, 0), 2 * n(width), False
    return None, 0, False  # 0xC1: never used


def _not_a_message(body: memoryview) -> str:
    """Why well-formed msgpack is not one of the messages: not a map, no or an unknown type, a missing, unknown or
    mistyped field."""
    try:
        raw = msgspec.msgpack.decode(body)
    except msgspec.DecodeError:
        return _not_msgpack(body)
    if not isinstance(raw, dict):
        return f"the body is {_kind(raw)}, not a map"
    if _TAG_FIELD not in raw:
        return f"no {_TAG_FIELD!r} field"
    tag = raw[_TAG_FIELD]
    cls = _BY_TAG.get(tag) if isinstance(tag, str) else None
    if cls is None:
        return f"unknown message type {tag!r}: expected one of {', '.join(_BY_TAG)}"
    fields = msgspec.structs.fields(cls)
    names = {f.encode_name for f in fields}
    unknown = [str(k) for k in raw if k != _TAG_FIELD and k not in names]
    if unknown:
        return f"{tag} has no field(s) {', '.join(map(repr, unknown))}"
    missing = [f.encode_name for f in fields if f.required and f.encode_name not in raw]
    if missing:
        return f"{tag} lacks the field(s) {', '.join(map(repr, missing))}"
    for f in fields:
        if f.encode_name in raw:
            try:
                msgspec.convert(raw[f.encode_name], f.type)
            except msgspec.ValidationError:
                value = raw[f.encode_name]
                if isinstance(value, (list, dict)):
                    return f"{tag}.{f.encode_name} is not a valid {_type_name(f.type)}"
                return f"{tag}.{f.encode_name} must be {_type_name(f.type)}, not {_kind(value)}"
    return f"not a valid {tag}"


def _kind(value: object) -> str:
    return {
        dict: "a map",
        list: "an array",
        str: "a string",
        bytes: "binary",
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        type(None): "nil",
    }.get(type(value), type(value).__name__)


def _type_name(tp: object) -> str:
    return tp.__name__ if isinstance(tp, type) else str(tp).replace("typing.", "")


# --- hidden states --------------------------------------------------------------------------------------------------

_WireScalar = np.float16 | np.float32 | np.uint16  # bf16 travels as the upper 16 bits of a float32, in a uint16
_NUMPY_WIRE: dict[str, np.dtype[_WireScalar]] = {
    "f16": np.dtype("<f2"),
    "f32": np.dtype("<f4"),
    "bf16": np.dtype("<u2"),
}


def pack_hidden(x: Hidden | NDArray[np.floating], wire_dtype: str) -> tuple[bytes, tuple[int, ...]]:
    """A hidden state (a handle, copied to the host here, or a float array) -> raw little-endian bytes in
    ``wire_dtype``, and its shape. f16/f32 are exact for an fp16 model; bf16 rounds."""
    if isinstance(x, Hidden):
        x = x.host()
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


def pack_activation(
    hidden: Hidden,
    wire_dtype: str,
    *,
    request_id: str,
    position: int,
    is_prefill: bool,
    plan_id: str,
    epoch: int,
) -> StageActivation:
    """The StageActivation carrying ``hidden`` (rows, positions, width) from ``position``, packed in ``wire_dtype``."""
    msg = header(
        hidden,
        wire_dtype,
        request_id=request_id,
        position=position,
        is_prefill=is_prefill,
        plan_id=plan_id,
        epoch=epoch,
    )
    return cast(StageActivation, attach(msg, hidden))


def header(
    hidden: Hidden,
    wire_dtype: str,
    *,
    request_id: str,
    position: int,
    is_prefill: bool,
    plan_id: str,
    epoch: int,
) -> StageActivation:
    """The StageActivation for ``hidden`` without its bytes: what travels with the handle beside it
    (``Transport.send``'s ``tensor``), packed by ``attach`` only where it leaves the process."""
    if wire_dtype not in _NUMPY_WIRE:
        raise CodecError(f"unknown wire dtype {wire_dtype!r}: expected one of {', '.join(WIRE_DTYPES)}")
    shape = hidden.shape
    return StageActivation(
        request_id=request_id,
        position=position,
        hidden=b"",
        seq_len=shape[1],
        is_prefill=is_prefill,
        shape=shape,
        dtype=wire_dtype,
        plan_id=plan_id,
        epoch=epoch,
    )


def attach(msg: Message, tensor: Hidden) -> Message:
    """A header (a StageActivation or ActivationRows whose ``hidden`` is empty) with ``tensor`` packed into it in the
    header's wire dtype: the message as it goes on the wire."""
    if not isinstance(msg, StageActivation | ActivationRows):
        raise CodecError(f"a hidden state travels with an activation, not with {type(msg).__name__}")
    data, shape = pack_hidden(tensor, msg.dtype)
    if tuple(shape) != tuple(msg.shape):
        raise CodecError(f"the hidden state's shape {shape} is not its header's {tuple(msg.shape)}")
    return msgspec.structs.replace(msg, hidden=data)


def unpack_hidden(msg: StageActivation) -> NDArray[np.float16]:
    """The activation's bytes -> a float16 array of ``msg.shape``; a size or dtype mismatch is a CodecError."""
    return unpack_tensor(msg.hidden, msg.shape, msg.dtype, f"activation for {msg.request_id!r}")


def unpack_tensor(data: bytes, shape: tuple[int, ...], dtype: str, what: str) -> NDArray[np.float16]:
    """Raw bytes in wire dtype ``dtype`` -> a float16 array of ``shape``; a size or dtype mismatch is a CodecError
    naming ``what``."""
    if dtype not in _NUMPY_WIRE:
        raise CodecError(f"{what} has unknown wire dtype {dtype!r}")
    wire = _NUMPY_WIRE[dtype]
    n = 1
    for d in shape:
        if d < 0:
            raise CodecError(f"{what} has negative dimension in shape {shape}")
        n *= d
    if n * wire.itemsize != len(data):
        raise CodecError(f"{what}: shape {shape} in {dtype} needs {n * wire.itemsize} bytes, got {len(data)}")
    arr = np.frombuffer(data, dtype=wire).reshape(shape)
    if dtype == "bf16":
        arr = (arr.astype("<u4") << 16).view("<f4")
        # bf16 rounding can carry a finite fp16 value past the fp16 maximum: saturate it there instead of making it inf
        f16_max = float(np.finfo(np.float16).max)
        arr = np.where(np.isinf(arr), arr, np.clip(arr, -f16_max, f16_max))
    return arr.astype(np.float16)
