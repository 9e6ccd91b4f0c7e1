"""The GGUF reader against truncated, corrupt and hostile files: every path that opens a GGUF (``GGUFFile`` for
computing, planning and ``model info``; ``read_header`` for ``scenario check``) refuses each one with ``ModelError``
naming the file and what is wrong, never another exception, never a nonsense size accepted, and in bounded time.
**Property**: random truncations and byte flips of a small real synthetic GGUF either load or raise ``ModelError``."""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppharness.cli import main as cli
from ppharness.errors import ModelError
from ppharness.model.gguf.header import read_gguf, read_header
from ppharness.model.gguf.metadata import MAX_VOCAB
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.synthetic.spec import ModelSpec
from ppharness.model.synthetic.writer import make_synthetic

U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10
_FMT = {0: "B", 1: "b", 2: "H", 3: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", 11: "q", 12: "d"}
READERS: dict[str, Callable[[Path], object]] = {"GGUFFile": GGUFFile, "read_header": read_header}
SLOW_READ_S = 2.0  # a file this small is read (or refused) far faster than this


# --- a GGUF written byte by byte --------------------------------------------------------------------------------------


def _string(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        itype, items = value
        return struct.pack("<IQ", itype, len(items)) + b"".join(_value(itype, v) for v in items)
    return struct.pack("<" + _FMT[vtype], value)


def gguf_bytes(kv: dict[str, tuple[int, Any]], tensors: list[tuple[str, tuple[int, ...], int, bytes]]) -> bytes:
    """A version-3 GGUF of ``kv`` (key -> (value type, value)) and ``tensors`` ((name, ne, ggml type, data))."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)))
    for key, (vtype, value) in kv.items():
        out += _string(key) + struct.pack("<I", vtype) + _value(vtype, value)
    offset = 0
    for name, ne, ggml_type, data in tensors:
        out += _string(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", d) for d in ne)
        out += struct.pack("<IQ", ggml_type, offset)
        offset += -(-len(data) // 32) * 32
    out += bytes(-len(out) % 32)
    for _, _, _, data in tensors:
        out += data + bytes(-len(data) % 32)
    return bytes(out)


def parts_of(path: Path) -> tuple[dict[str, tuple[int, Any]], list[tuple[str, tuple[int, ...], int, bytes]]]:
    """A real GGUF's key-values and tensors, read with the ``gguf`` package (the reference reader)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    kv: dict[str, tuple[int, Any]] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = int(field.types[0])
        value = field.contents()
        kv[key] = (vtype, (int(field.types[1]), value) if vtype == ARRAY else value)
    tensors = [(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), bytes(t.data)) for t in reader.tensors]
    return kv, tensors


@pytest.fixture(scope="module")
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real synthetic GGUF (two blocks, vocabulary 300)."""
    spec = ModelSpec(blocks=2, dim=16, ffn=32, heads=2, kv_heads=1, vocab=300)
    return make_synthetic(spec, tmp_path_factory.mktemp("gguf") / "real.gguf")


@pytest.fixture(scope="module")
def parts(real: Path) -> tuple[dict[str, tuple[int, Any]], list[tuple[str, tuple[int, ...], int, bytes]]]:
    return parts_of(real)


def variant(tmp_path: Path, parts: Any, name: str = "bad.gguf", **changes: Any) -> Path:
    """The real file with ``changes`` (key with dots as double underscores -> (type, value), or None to drop)."""
    kv, tensors = dict(parts[0]), list(parts[1])
    for key, change in changes.items():
        key = key.replace("__", ".")
        if change is None:
            kv.pop(key)
        else:
            kv[key] = change
    path = tmp_path / name
    path.write_bytes(gguf_bytes(kv, tensors))
    return path


def refused(reader: Callable[[Path], object], path: Path) -> str:
    """The message of the ``ModelError`` reading ``path`` raises (anything else fails the test), within bounded time."""
    t0 = time.monotonic()
    with pytest.raises(ModelError) as info:
        reader(path)
    assert time.monotonic() - t0 < SLOW_READ_S, f"refusing {path.name} took {time.monotonic() - t0:.1f} s"
    message = str(info.value)
    assert str(path) in message, f"the error does not name the file: {message}"
    return message


# --- the builder is faithful ------------------------------------------------------------------------------------------


def test_a_file_rebuilt_byte_by_byte_loads_as_the_original(real, parts, tmp_path):
    copy = variant(tmp_path, parts, "copy.gguf")
    original, rebuilt = GGUFFile(real), GGUFFile(copy)
    assert rebuilt.config == original.config
    for name in original.names():
        assert (rebuilt.tensor(name) == original.tensor(name)).all()
    assert read_header(copy) == read_header(real)


# --- the probed corruptions, on both readers --------------------------------------------------------------------------


@pytest.mark.parametrize("reader", READERS)
def test_a_truncated_file_is_refused(reader, real, tmp_path):
    data = real.read_bytes()
    for n in (0, 4, 20, 100, len(data) // 3, len(data) - 1):
        path = tmp_path / f"cut{n}.gguf"
        path.write_bytes(data[:n])
        message = refused(READERS[reader], path)
        assert "truncated or corrupt" in message or "not a GGUF file" in message or "not a readable GGUF" in message


@pytest.mark.parametrize("reader", READERS)
def test_a_key_value_count_beyond_the_file_is_refused(reader, real, tmp_path):
    data = bytearray(real.read_bytes())
    for count in (2**63, 2**32, 10**6):
        struct.pack_into("<Q", data, 16, count)
        path = tmp_path / "kv.gguf"
        path.write_bytes(bytes(data))
        assert "key-value pairs" in refused(READERS[reader], path)


@pytest.mark.parametrize("reader", READERS)
def test_a_tensor_count_beyond_the_file_is_refused(reader, real, tmp_path):
    data = bytearray(real.read_bytes())
    struct.pack_into("<Q", data, 8, 2**40)
    path = tmp_path / "tensors.gguf"
    path.write_bytes(bytes(data))
    assert "tensors" in refused(READERS[reader], path)


BAD_METADATA = {
    "no heads": ({"llama__attention__head_count": (U32, 0)}, "llama.attention.head_count = 0 is out of range"),
    "eos as text": ({"tokenizer__ggml__eos_token_id": (STRING, "eos")}, "eos_token_id = 'eos' is not an integer"),
    "eos outside the vocabulary": ({"tokenizer__ggml__eos_token_id": (U32, 300)}, "eos_token_id = 300 is out of"),
    "a huge width": ({"llama__embedding_length": (U64, 2**63)}, "llama.embedding_length = 9223372036854775808 is out"),
    "blocks as a float": ({"llama__block_count": (F32, 2.0)}, "llama.block_count = 2.0 is not an integer"),
    "a negative context": ({"llama__context_length": (I32, -1)}, "llama.context_length = -1 is out of range"),
    "kv heads not dividing": ({"llama__attention__head_count_kv": (U32, 3)}, "head_count_kv = 3 is not a divisor"),
    "an epsilon of 0": ({"llama__attention__layer_norm_rms_epsilon": (F32, 0.0)}, "epsilon = 0.0 is out of range"),
    "a NaN rope base": ({"llama__rope__freq_base": (F32, float("nan"))}, "freq_base = nan is not a finite number"),
    "tokens as numbers": ({"tokenizer__ggml__tokens": (ARRAY, (U32, [1, 2]))}, "tokens = 'an array of 2' is not an"),
    "token types too few": ({"tokenizer__ggml__token_type": (ARRAY, (I32, [1] * 7))}, "7 entries' is not one per"),
    "no architecture": ({"general__architecture": None}, "lacks 'general.architecture'"),
    "add_bos as a number": ({"tokenizer__ggml__add_bos_token": (U32, 1)}, "add_bos_token = 1 is not true or false"),
}


@pytest.mark.parametrize("reader", READERS)
@pytest.mark.parametrize("case", BAD_METADATA)
def test_metadata_of_the_wrong_type_or_out_of_range_is_refused(reader, case, parts, tmp_path):
    changes, expected = BAD_METADATA[case]
    message = refused(READERS[reader], variant(tmp_path, parts, **changes))
    assert expected in message
    assert "download or convert it again" in message  # the fix


def test_a_vocabulary_beyond_the_limit_is_refused_fast_without_decoding_it(parts, tmp_path):
    """2.5 M one-byte tokens (22 MB): refused by their count, not read for a minute and gigabytes."""
    n = 2_500_000
    kv, tensors = parts
    raw = gguf_bytes({k: v for k, v in kv.items() if k != "tokenizer.ggml.tokens"}, tensors)
    tokens = (
        _string("tokenizer.ggml.tokens") + struct.pack("<IIQ", ARRAY, STRING, n) + (struct.pack("<Q", 1) + b"a") * n
    )
    at = 24  # the first key, right after the header: the tokens go before it, the key-value count one more
    path = tmp_path / "vocab.gguf"
    path.write_bytes(raw[:16] + struct.pack("<Q", len(kv)) + tokens + raw[at:])
    for reader in READERS.values():
        message = refused(reader, path)
        assert f"2,500,000 entries of tokenizer.ggml.tokens is above the limit of {MAX_VOCAB:,}" in message


def test_tensors_outside_the_file_or_of_impossible_shape_are_refused(parts, tmp_path):
    kv, tensors = parts
    name, ne, ggml_type, data = tensors[0]
    cases = {
        "data cut": [*tensors[:-1], (tensors[-1][0], tensors[-1][1], tensors[-1][2], tensors[-1][3][:8])],
        "huge dims": [(name, (2**40, 2**40), ggml_type, data), *tensors[1:]],
        "zero dim": [(name, (0, ne[1]), ggml_type, data), *tensors[1:]],
        "five dims": [(name, (*ne, 1, 1, 1), ggml_type, data), *tensors[1:]],
        "unknown type": [(name, ne, 77, data), *tensors[1:]],
        "twice": [*tensors, tensors[0]],
    }
    expected = {
        "data cut": "outside the file",
        "huge dims": "do not fit",
        "zero dim": "do not fit",
        "five dims": "5 dimensions",
        "unknown type": "unknown ggml type 77",
        "twice": "appears twice",
    }
    for case, listed in cases.items():
        path = tmp_path / f"{case.replace(' ', '-')}.gguf"
        path.write_bytes(gguf_bytes(kv, listed))
        for reader in READERS.values():
            assert expected[case] in refused(reader, path), case


def test_an_embedding_whose_shape_disagrees_with_the_metadata_is_refused(parts, tmp_path):
    kv, tensors = parts
    swapped = [(n, tuple(reversed(ne)) if n == "token_embd.weight" else ne, t, d) for n, ne, t, d in tensors]
    path = tmp_path / "embd.gguf"
    path.write_bytes(gguf_bytes(kv, swapped))
    assert "token_embd.weight has dimensions [300, 16], but the metadata says [16, 300]" in refused(GGUFFile, path)


def test_model_info_refuses_a_corrupt_file_in_words(parts, tmp_path):
    path = variant(tmp_path, parts, llama__attention__head_count=(U32, 0))
    result = CliRunner().invoke(cli, ["model", "info", str(path)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)  # fail(), not a traceback
    assert "llama.attention.head_count = 0 is out of range" in result.output


# --- property: random truncations and byte flips ----------------------------------------------------------------------


def _either_loads_or_refuses(path: Path) -> str:
    """Open ``path`` with both readers; when ``GGUFFile`` opens it, read every tensor and build the tokenizer.
    ``ModelError`` is the only exception allowed; every step bounded in time."""
    outcome = []
    for name, reader in READERS.items():
        t0 = time.monotonic()
        try:
            opened = reader(path)
            if isinstance(opened, GGUFFile):
                for tensor in opened.names():
                    opened.tensor(tensor)
                opened.tokenizer.encode("hello")
            outcome.append(f"{name} loads")
        except ModelError:
            outcome.append(f"{name} refuses")
        assert time.monotonic() - t0 < SLOW_READ_S, f"{name} took {time.monotonic() - t0:.1f} s on {path}"
    return ", ".join(outcome)


def _header_length(path: Path) -> int:
    """Where the tensors' data starts: flips before it change the metadata or the tensor infos."""
    contents = read_gguf(path)
    return min(t.offset for t in contents.tensors)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_random_corruption_loads_or_raises_model_error(real, tmp_path, data):
    raw = bytearray(real.read_bytes())
    header = _header_length(real)
    cut = data.draw(st.one_of(st.none(), st.integers(0, len(raw))), label="truncate at")
    flips = data.draw(
        st.lists(st.tuples(st.integers(0, header - 1), st.integers(1, 255)), max_size=4), label="xor flips"
    )
    for pos, mask in flips:
        raw[pos] ^= mask
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(bytes(raw if cut is None else raw[:cut]))
    _either_loads_or_refuses(path)


def test_seeded_single_byte_flips_of_the_header_load_or_raise_model_error(real, tmp_path):
    """Flips spread over the whole header (a seeded sample, the same every run): most are refused, none escapes."""
    raw = real.read_bytes()
    header = _header_length(real)
    rng = random.Random(20261203)
    outcomes: dict[str, int] = {}
    for i in range(300):
        pos = rng.randrange(header)
        flipped = bytearray(raw)
        flipped[pos] ^= 1 << rng.randrange(8)
        path = tmp_path / f"flip{i}.gguf"
        path.write_bytes(bytes(flipped))
        outcome = _either_loads_or_refuses(path)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        path.unlink()
    assert sum(n for o, n in outcomes.items() if "refuses" in o) > 0, outcomes
