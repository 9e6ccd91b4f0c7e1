"""Prefill in chunks of one size (``ppharness.model.engine.prefill``): a warm slice compiles nothing for a prompt of a
length it has not seen, and prompts of every length around the chunk size, and past the end of the context's last whole
chunk, give a split model the unsplit model's tokens and stage-boundary hidden states byte for byte."""

from __future__ import annotations

import pytest

from ppharness.errors import ModelError
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.prefill import CHUNK_ENV, chunk_size
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.sources.files import resolve_model
from ppharness.run.inprocess import load_slices


def test_a_warm_slice_compiles_nothing_for_a_new_prompt_length(monkeypatch: pytest.MonkeyPatch) -> None:
    from tinygrad.engine.realize import method_cache

    monkeypatch.setenv(CHUNK_ENV, "8")
    f = GGUFFile(resolve_model("synthetic:tiny"))
    model = ModelSlice(f, 0, f.config.blocks, True, True, 64)
    warm_up(model)
    compiled = len(method_cache)
    for length in (3, 8, 9, 17, 40):
        model.prefill(list(range(10, 10 + length)))
    assert len(method_cache) == compiled, (
        f"prefills of new lengths compiled {len(method_cache) - compiled} kernel(s) after the warm-up"
    )


def test_every_prompt_length_splits_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 8 over a context of 60: lengths 1 to 9 around one chunk, several chunks, and 58 positions, whose last
    chunk is moved back to fit the cache (52-60)."""
    monkeypatch.setenv(CHUNK_ENV, "8")
    f = GGUFFile(resolve_model("synthetic:tiny"))
    whole = load_slices(f, [(0, f.config.blocks)], 60, taps=True)[0]
    slices = load_slices(f, [(0, 3), (3, 6), (6, f.config.blocks)], 60)
    for length in (1, 7, 8, 9, 16, 23, 44, 58):
        ids = [(7 * i + 3 + length) % f.config.vocab for i in range(length)]
        first = whole.prefill(ids)
        taps = whole.tapped()
        x = ids
        for s in slices:
            out = s.prefill(x)
            if not s.last:
                assert out.shape == (1, length, f.config.dim), f"stage [{s.lo},{s.hi}) gave {out.shape}"
                assert out.tobytes() == taps[s.hi - 1].tobytes(), (
                    f"a prompt of {length}: the hidden state after block {s.hi - 1} differs from the unsplit model's"
                )
            x = out
        assert x == first, f"a prompt of {length}: the split model's first token {x}, the unsplit model's {first}"


def test_a_bad_chunk_size_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CHUNK_ENV, "zero")
    with pytest.raises(ModelError, match=CHUNK_ENV):
        chunk_size()
