"""ppharness.wire.codec: framing (encode/decode) and hidden-state packing, by example and by property."""

from __future__ import annotations

import types
import typing

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ppharness.errors import CodecError
from ppharness.wire import codec
from ppharness.wire.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, NextToken, Shutdown, StageActivation

CHEAP_EXAMPLES = 8 * settings.default.max_examples  # examples here take microseconds: explore more

GOOD = NextToken(request_id="req-0001", token_id=12366, position=6, done=False, plan_id="plan-a")


def frame_of(body: bytes, version: int = PROTOCOL_VERSION, length: int | None = None) -> bytes:
    return codec.HEADER.pack(codec.MAGIC, version, len(body) if length is None else length) + body


def body_of(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def activation_of(x: np.ndarray, wire_dtype: str) -> StageActivation:
    hidden, shape = codec.pack_hidden(x, wire_dtype)
    seq_len = shape[1] if len(shape) > 1 else 0
    return StageActivation("req-0001", 0, hidden, seq_len, True, shape, wire_dtype, "plan-a")


# --- framing ----------------------------------------------------------------------------------------------------------


def test_frame_layout() -> None:
    frame = codec.encode(GOOD)
    magic, version, body_len = codec.HEADER.unpack_from(frame)
    assert (magic, version, body_len) == (b"PP", PROTOCOL_VERSION, len(frame) - 8)
    assert msgspec.msgpack.decode(frame[8:])["type"] == "NextToken"
    assert codec.decode(frame) == GOOD
    assert codec.decode(bytearray(frame)) == GOOD
    assert codec.decode(memoryview(frame)) == GOOD


def test_hidden_travels_as_msgpack_bin() -> None:
    raw = bytes(range(256)) * 4
    frame = codec.encode(StageActivation("r", 0, raw, 2, True, (1, 2, 256), "f16", "p"))
    assert raw in frame
    assert b"\xc5\x04\x00" + raw in frame  # bin 16, 1024 bytes


@pytest.mark.parametrize(
    ("frame", "problem"),
    [
        pytest.param(b"", r"truncated frame: 0 bytes is shorter than the 8-byte header", id="empty"),
        pytest.param(b"PP\x00\x01", r"truncated frame: 4 bytes is shorter than the 8-byte", id="truncated-header"),
        pytest.param(b"XY" + codec.encode(GOOD)[2:], r"magic b'XY' is not b'PP'", id="bad-magic"),
        pytest.param(
            frame_of(codec.encode(GOOD)[8:], version=PROTOCOL_VERSION + 1),
            rf"wrong protocol version {PROTOCOL_VERSION + 1}",
            id="wrong-version",
        ),
        pytest.param(
            frame_of(b"", length=codec.MAX_FRAME_BYTES + 1), r"oversized frame: body of 268435457 bytes", id="oversized"
        ),
        pytest.param(codec.encode(GOOD) + b"\x00\x00", r"2 bytes after the announced", id="trailing-bytes"),
        pytest.param(codec.encode(GOOD)[:-3], r"header announces \d+ body bytes, \d+ arrived", id="truncated-body"),
        pytest.param(
            frame_of(b"\xc1"),
            r"malformed msgpack body: byte 0xc1 at offset 0 does not start a msgpack value",
            id="garbage-msgpack",
        ),
        pytest.param(
            frame_of(body_of({"type": "Shutdown", "reason": "xyz"})[:-2]),
            r"malformed msgpack body: the body ends inside a value",
            id="cut-inside-a-value",
        ),
        pytest.param(
            frame_of(codec.encode(GOOD)[8:] + b"\x00"),
            r"malformed msgpack body: 1 bytes after the value",
            id="two-values",
        ),
        pytest.param(
            frame_of(body_of({"type": "Teleport", "to": "mars"})),
            r"malformed message: unknown message type 'Teleport': expected one of InferenceRequest, ",
            id="bad-tag",
        ),
        pytest.param(frame_of(body_of({"reason": "no tag"})), r"malformed message: no 'type' field", id="no-tag"),
        pytest.param(
            frame_of(body_of([1, 2, 3])), r"malformed message: the body is an array, not a map", id="not-a-map"
        ),
        pytest.param(
            frame_of(
                body_of(
                    {"type": "NextToken", "request_id": 7, "token_id": 1, "position": 0, "done": False, "plan_id": "p"}
                )
            ),
            r"malformed message: NextToken.request_id must be str, not an integer",
            id="wrong-field-type",
        ),
        pytest.param(
            frame_of(
                body_of(
                    {
                        "type": "StageActivation",
                        "request_id": "r",
                        "position": 0,
                        "hidden": b"",
                        "seq_len": 0,
                        "is_prefill": True,
                        "shape": ["a"],
                        "dtype": "f16",
                        "plan_id": "p",
                    }
                )
            ),
            r"malformed message: StageActivation.shape is not a valid tuple\[int, \.\.\.\]",
            id="wrong-element-type",
        ),
        pytest.param(
            frame_of(body_of({"type": "NextToken", "request_id": "r", "token_id": 1})),
            r"NextToken lacks the field\(s\) 'position', 'done', 'plan_id'",
            id="missing-field",
        ),
        pytest.param(
            frame_of(body_of({"type": "Shutdown", "reason": "", "extra": 1})),
            r"Shutdown has no field\(s\) 'extra'",
            id="unknown-field",
        ),
        pytest.param(
            frame_of(b"\x82" + body_of("pad") + b"\x91" * 100_000 + b"\xc0" + body_of("type") + body_of("Shutdown")),
            r"malformed msgpack body: nested too deeply",
            id="deep-nesting",
        ),
        pytest.param(
            frame_of(body_of({"type": "Shutdown", "reason": "x"})[:-1] + b"\xcd"),
            r"malformed msgpack body: the string at offset 22 is not UTF-8",
            id="not-utf8",
        ),
    ],
)
def test_decode_names_the_problem(frame: bytes, problem: str) -> None:
    with pytest.raises(CodecError, match=problem):
        codec.decode(frame)


def test_decode_respects_max_bytes() -> None:
    frame = codec.encode(Shutdown("x" * 100))
    with pytest.raises(CodecError, match="exceeds the 50-byte limit"):
        codec.decode(frame, max_bytes=50)


def test_encode_refuses_an_oversized_body(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(codec, "MAX_FRAME_BYTES", 64)
    codec.encode(Shutdown("short"))
    with pytest.raises(CodecError, match="exceeds the 64-byte limit"):
        codec.encode(Shutdown("x" * 100))


# --- hidden states ----------------------------------------------------------------------------------------------------


def _fp16_sample() -> np.ndarray:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((1, 5, 32)) * 50).astype(np.float16)
    specials = np.array([0.0, -0.0, 6.1e-05, 6e-08, 65504.0, -65504.0, 1 / 3, np.inf, -np.inf], dtype=np.float16)
    x[0, 0, : specials.size] = specials
    return x


@pytest.mark.parametrize("wire_dtype", ["f16", "f32"])
def test_f16_and_f32_round_trip_fp16_data_exactly(wire_dtype: str) -> None:
    x = _fp16_sample()
    msg = activation_of(x, wire_dtype)
    assert len(msg.hidden) == x.size * (2 if wire_dtype == "f16" else 4)
    y = codec.unpack_hidden(codec.decode(codec.encode(msg)))  # type: ignore[arg-type]
    assert y.dtype == np.float16 and y.shape == x.shape
    np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))


def test_bf16_round_trip_is_within_bf16_precision() -> None:
    x = _fp16_sample()
    y = codec.unpack_hidden(activation_of(x, "bf16"))
    assert y.dtype == np.float16 and y.shape == x.shape
    finite = np.isfinite(x)
    assert np.all(np.abs(y[finite].astype(np.float64) - x[finite]) <= 2**-8 * np.abs(x[finite].astype(np.float64)))
    np.testing.assert_array_equal(y[~finite], x[~finite])


def test_bf16_keeps_nan_and_inf_and_the_fp16_maximum_finite() -> None:
    bits = np.array([0x7C01, 0xFC01, 0x7E00, 0x7C00, 0xFC00, 0x7BFF, 0xFBFF], dtype=np.uint16)
    y = codec.unpack_hidden(activation_of(bits.view(np.float16), "bf16"))
    assert np.isnan(y[:3]).all()
    np.testing.assert_array_equal(y[3:], np.array([np.inf, -np.inf, 65504, -65504], dtype=np.float16))


def test_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-10], dtype=np.float32)
    hidden, _ = codec.pack_hidden(x, "bf16")
    np.testing.assert_array_equal(np.frombuffer(hidden, "<u2"), [0x3F80, 0x3F82, 0x3F81])


@pytest.mark.parametrize("wire_dtype", codec.WIRE_DTYPES)
def test_byte_count_mismatch_is_a_codec_error(wire_dtype: str) -> None:
    msg = activation_of(np.ones((1, 2, 4), np.float16), wire_dtype)
    for hidden in (msg.hidden[:-1], msg.hidden + b"\x00\x00"):
        with pytest.raises(CodecError, match=r"req-0001.*needs \d+ bytes, got \d+"):
            codec.unpack_hidden(msgspec.structs.replace(msg, hidden=hidden))
    with pytest.raises(CodecError, match="needs"):
        codec.unpack_hidden(msgspec.structs.replace(msg, shape=(1, 3, 4)))


def test_negative_dimension_is_a_codec_error() -> None:
    msg = activation_of(np.ones((1, 2, 4), np.float16), "f16")
    with pytest.raises(CodecError, match="negative dimension"):
        codec.unpack_hidden(msgspec.structs.replace(msg, shape=(-1, -2, 4)))


def test_unknown_wire_dtype_is_a_codec_error() -> None:
    with pytest.raises(CodecError, match=r"unknown wire dtype 'f8'.*f16, bf16, f32"):
        codec.pack_hidden(np.ones(4, np.float16), "f8")
    msg = activation_of(np.ones((1, 2, 4), np.float16), "f16")
    with pytest.raises(CodecError, match=r"req-0001.*unknown wire dtype 'int8'"):
        codec.unpack_hidden(msgspec.structs.replace(msg, dtype="int8"))


# --- properties -------------------------------------------------------------------------------------------------------

_INT = st.integers(min_value=-(2**63), max_value=2**64 - 1)


def strategy_for(tp: object) -> st.SearchStrategy[typing.Any]:
    """A small-sized strategy for a message field's type."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is str:
        return st.text(max_size=24)
    if tp is bool:
        return st.booleans()
    if tp is int:
        return _INT
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is bytes:
        return st.binary(max_size=64)
    if tp is type(None):
        return st.none()
    if origin is types.UnionType:
        return st.one_of(*(strategy_for(a) for a in args))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(strategy_for(args[0]), max_size=4).map(tuple)
    if origin is tuple:
        return st.tuples(*(strategy_for(a) for a in args))
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=6)
    if origin is dict:
        return st.dictionaries(strategy_for(args[0]), strategy_for(args[1]), max_size=4)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        hints = typing.get_type_hints(tp)
        return st.builds(tp, **{f: strategy_for(hints[f]) for f in tp.__struct_fields__})
    raise TypeError(f"no strategy for message field type {tp!r}: add one to strategy_for")


def message_strategy(cls: type) -> st.SearchStrategy[Message]:
    hints = typing.get_type_hints(cls)
    return st.builds(cls, **{name: strategy_for(hints[name]) for name in cls.__struct_fields__})


ANY_MESSAGE = st.one_of([message_strategy(cls) for cls in MESSAGE_TYPES])


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
@settings(deadline=None, max_examples=60)
@given(data=st.data())
def test_every_message_type_round_trips(cls: type, data: st.DataObject) -> None:
    msg = data.draw(message_strategy(cls))
    got = codec.decode(codec.encode(msg))
    assert type(got) is cls
    assert got == msg


FP16_ARRAYS = hnp.arrays(
    np.float16,
    st.tuples(st.integers(0, 1), st.integers(0, 8), st.integers(0, 16)),
    elements=st.floats(width=16, allow_nan=False, allow_infinity=False),
)


@settings(deadline=None)
@given(x=FP16_ARRAYS)
def test_fp16_arrays_round_trip_through_every_wire_dtype(x: np.ndarray) -> None:
    for wire_dtype in ("f16", "f32"):
        y = codec.unpack_hidden(activation_of(x, wire_dtype))
        assert y.dtype == np.float16 and y.shape == x.shape
        np.testing.assert_array_equal(y.view(np.uint16), x.view(np.uint16))
    y = codec.unpack_hidden(activation_of(x, "bf16"))
    assert y.dtype == np.float16 and y.shape == x.shape
    assert np.isfinite(y).all()
    error = np.abs(y.astype(np.float64) - x.astype(np.float64))
    assert (error <= 2**-8 * np.abs(x.astype(np.float64))).all()


def _decodes_or_codec_error(frame: bytes) -> None:
    try:
        msg = codec.decode(frame)
    except CodecError:
        return
    assert isinstance(msg, MESSAGE_TYPES)


@settings(max_examples=CHEAP_EXAMPLES)
@given(frame=st.binary(max_size=256))
def test_decode_of_arbitrary_bytes_raises_only_codec_error(frame: bytes) -> None:
    _decodes_or_codec_error(frame)


@settings(max_examples=CHEAP_EXAMPLES)
@given(body=st.binary(max_size=256))
def test_decode_of_arbitrary_body_under_a_valid_header_raises_only_codec_error(body: bytes) -> None:
    _decodes_or_codec_error(frame_of(body))


_MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | _INT | st.floats() | st.text(max_size=8) | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_TAGGED_MAPS = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    st.sampled_from([cls.__name__ for cls in MESSAGE_TYPES] + ["Nope"]),
    st.dictionaries(
        st.sampled_from(sorted({f for cls in MESSAGE_TYPES for f in cls.__struct_fields__})), _MSGPACK_VALUES
    ),
)


@settings(max_examples=CHEAP_EXAMPLES)
@given(obj=_MSGPACK_VALUES | _TAGGED_MAPS)
def test_decode_of_arbitrary_msgpack_raises_only_codec_error(obj: object) -> None:
    _decodes_or_codec_error(frame_of(body_of(obj)))


@settings(max_examples=CHEAP_EXAMPLES)
@given(msg=ANY_MESSAGE, data=st.data())
def test_decode_of_a_damaged_frame_raises_only_codec_error(msg: Message, data: st.DataObject) -> None:
    frame = codec.encode(msg)
    index = data.draw(st.integers(0, len(frame) - 1), label="index")
    flip = data.draw(st.integers(1, 255), label="xor")
    flipped = frame[:index] + bytes([frame[index] ^ flip]) + frame[index + 1 :]
    _decodes_or_codec_error(flipped)
    with pytest.raises(CodecError):
        codec.decode(frame[:index])
