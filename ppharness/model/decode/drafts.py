"""Drafts for speculative decoding: what proposes the tokens a window asks the chain to verify
(``ppharness.run.stage.speculation``). A draft only ever changes the speed: the last stage keeps a drafted token only
where it equals the model's own greedy token, so a wrong draft costs a shorter window, never a different answer.

- ``ngram``: prompt lookup. The longest suffix of the prompt and answer so far (up to ``NGRAM_MAX`` tokens) that
  occurred before, and what followed its latest occurrence; no model.
- ``layers:N``: self-speculation. The model's own first N blocks, then its output norm and head, on stage 0: no other
  file (its blocks are loaded a second time, with a KV cache of their own).
- ``model:SOURCE``: a small GGUF with the same vocabulary, whole, on stage 0.

A draft is named ``KIND[:ARG][:K]``: ``ngram:8``, ``layers:4:6``, ``model:draft.gguf:4``; K, the most tokens a window
drafts, defaults to ``DEFAULT_K``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ppharness.errors import ModelError

if TYPE_CHECKING:
    from ppharness.model.engine.slicing import ModelSlice
    from ppharness.model.gguf_file import GGUFFile

DEFAULT_K = 4
MAX_K = 31  # a window is at most 32 rows: one compiled step per power of two up to it
NGRAM_MAX = 3  # the longest suffix prompt lookup matches
LOOKUP_SPAN = 4096  # prompt lookup searches the last tokens only: bounded work per window
KINDS = ("ngram", "layers", "model")


@dataclass(frozen=True)
class DraftSpec:
    """A parsed draft name: its kind, K, and the kind's argument (``layers``: how many blocks; ``model``: where the
    file is)."""

    kind: str
    k: int = DEFAULT_K
    layers: int = 0
    source: str = ""

    @property
    def text(self) -> str:
        arg = {"ngram": "", "layers": f":{self.layers}", "model": f":{self.source}"}[self.kind]
        return f"{self.kind}{arg}:{self.k}"


def parse_draft(text: str) -> DraftSpec:
    """``KIND[:ARG][:K]`` (module docstring) as a DraftSpec; ModelError saying what is wrong and what is expected."""
    usage = "expected ngram[:K], layers:N[:K] or model:SOURCE[:K] (K: the most tokens a window drafts, 1..31)"
    kind, _, rest = text.strip().partition(":")
    if kind not in KINDS:
        raise ModelError(f"draft {text!r}: unknown kind {kind!r}; {usage}")
    head, sep, tail = rest.rpartition(":")
    k_text = tail if tail.isdigit() and (sep or kind == "ngram") else ""
    arg = head if k_text else rest
    k = int(k_text) if k_text else DEFAULT_K
    if not 1 <= k <= MAX_K:
        raise ModelError(f"draft {text!r}: K = {k} is outside 1..{MAX_K}; {usage}")
    if kind == "ngram":
        if arg:
            raise ModelError(f"draft {text!r}: ngram takes only K; {usage}")
        return DraftSpec("ngram", k)
    if kind == "layers":
        if not arg.isdigit() or int(arg) < 1:
            raise ModelError(f"draft {text!r}: layers needs how many of the model's first blocks (N >= 1); {usage}")
        return DraftSpec("layers", k, layers=int(arg))
    if not arg:
        raise ModelError(f"draft {text!r}: model needs the draft model's file; {usage}")
    return DraftSpec("model", k, source=arg)


class Draft(Protocol):
    """What stage 0 drafts with: ``propose(slot, context, k)``, at most ``k`` tokens that may follow ``context`` (the
    prompt and the answer so far, then what earlier windows in flight drafted) for the request in ``slot``."""

    def propose(self, slot: int, context: Sequence[int], k: int) -> list[int]: ...


class NGramDraft:
    """Prompt lookup (module docstring): the longest suffix of ``context`` of at most ``NGRAM_MAX`` tokens that
    occurred before, and the tokens after its latest occurrence; a continuation that reaches the end of the context
    goes on copying what it proposed (a repeating answer is proposed round its cycle)."""

    def propose(self, slot: int, context: Sequence[int], k: int) -> list[int]:
        ctx = list(context[-LOOKUP_SPAN:])
        for n in range(min(NGRAM_MAX, len(ctx) - 1), 0, -1):
            suffix = ctx[-n:]
            for i in range(len(ctx) - n - 1, -1, -1):  # the latest earlier occurrence
                if ctx[i : i + n] == suffix:
                    out: list[int] = []
                    src = i + n
                    while len(out) < k:
                        out.append(ctx[src] if src < len(ctx) else out[src - len(ctx)])
                        src += 1
                    return out
        return []


class SliceDraft:
    """A draft model on stage 0 (``layers:N``: the model's first N blocks and head; ``model:SOURCE``: another file),
    greedy, one token at a time, with a KV cache per request slot. What each slot's cache holds is remembered
    (``seen``), so a proposal computes only the context it has not seen (after a window, what was accepted is kept
    and the rest recomputed)."""

    def __init__(self, model: ModelSlice):
        self.model = model
        self.seen: dict[int, list[int]] = {}

    def propose(self, slot: int, context: Sequence[int], k: int) -> list[int]:
        m = self.model
        ctx = list(context)
        if len(ctx) + k > m.max_context:
            k = m.max_context - len(ctx)
        if k < 1 or not ctx:
            return []
        seen = self.seen.get(slot, [])
        same = 0
        for a, b in zip(seen, ctx, strict=False):
            if a != b:
                break
            same += 1
        same = min(same, len(ctx) - 1)  # the last token is computed again: its output is the next token
        if same == 0:
            token = int(m.prefill(ctx, slot))
        else:
            token = 0
            for pos in range(same, len(ctx)):
                token = int(m.decode([ctx[pos]], pos, slot))  # type: ignore[arg-type]
        out = [token]
        while len(out) < k:
            out.append(int(m.decode([out[-1]], len(ctx) + len(out) - 1, slot)))  # type: ignore[arg-type]
        self.seen[slot] = ctx + out[:-1]
        return out


def build_draft(spec: DraftSpec, gguf_file: GGUFFile, max_context: int, slots: int) -> Draft:
    """The draft ``spec`` names, for stage 0 of ``gguf_file``'s chain (loaded and compiled here); ModelError for a
    draft that cannot serve this model (too many layers, another vocabulary)."""
    # imported here: an ngram draft needs no model code
    from ppharness.model.decode.rules import warm_up
    from ppharness.model.engine.slicing import ModelSlice
    from ppharness.model.gguf_file import GGUFFile
    from ppharness.model.sources.files import resolve_model

    if spec.kind == "ngram":
        return NGramDraft()
    cfg = gguf_file.config
    if spec.kind == "layers":
        if spec.layers >= cfg.blocks:
            raise ModelError(
                f"draft layers:{spec.layers}: the model has {cfg.blocks} blocks; a draft of its first N blocks needs "
                f"N < {cfg.blocks}"
            )
        model = ModelSlice(gguf_file, 0, spec.layers, True, True, max_context, slots=slots)
    else:
        other = GGUFFile(resolve_model(spec.source))
        if other.config.vocab != cfg.vocab or other.tokenizer.tokens != gguf_file.tokenizer.tokens:
            raise ModelError(
                f"draft model {spec.source}: its vocabulary ({other.config.vocab} tokens) is not the model's "
                f"({cfg.vocab}); a draft must tokenize as the model does"
            )
        model = ModelSlice(other, 0, other.config.blocks, True, True, max_context, slots=slots)
    warm_up(model)
    return SliceDraft(model)
