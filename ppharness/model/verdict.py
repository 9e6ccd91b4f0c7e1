"""Will a GGUF file load here? The answer from its header alone, before anything starts.

``judge_file(path)`` reads the file's metadata and tensor infos with its arrays stepped over
(``ppharness.model.gguf.header``: a vocabulary of 200k tokens and its merges in a fraction of a second) and decides
what the engine decides when it loads the file, and what it would only find out later (building the tokenizer, or
packing a matrix on a node):

- the architecture (``general.architecture``) is one the engine computes (``ppharness.model.arch``);
- every tensor is one that architecture computes with, and no metadata key changes the computation in a way it does
  not implement (``ppharness.model.support.check_file``);
- the metadata has every key the engine reads (``ppharness.model.arch.read_config``);
- every matrix is stored in a type the engine holds (``ppharness.model.formats.codecs.check_format``);
- the tokenizer is one the engine builds (``ppharness.model.text.tokenizer.tokenizer_problem``).

The ``LoadVerdict`` holds the answer (``loads``, ``reasons``) and the facts ``ppharness model info`` shows.
``refuse_unloadable(source)`` is the check every entry point makes before it starts anything: ``ModelError`` for a
local path with no file behind it or a file that does not load; a synthetic source is always supported (its spec is
the engine's own) and a URL is judged once it is downloaded.
"""

from __future__ import annotations

import functools
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ppharness.errors import ModelError
from ppharness.model.arch import of_file, read_config
from ppharness.model.formats.codecs import CODECS, known
from ppharness.model.formats.table import type_name
from ppharness.model.gguf.header import GGUFContents, read_gguf
from ppharness.model.gguf.metadata import SkippedArray
from ppharness.model.gguf.names import moe_blocks
from ppharness.model.support import check_file
from ppharness.model.text.tokenizer import tokenizer_problem

# what to do about a file that does not load
FIX = (
    "use a model file of an architecture, tensor types and tokenizer this engine supports (docs/models.md, "
    '"Will my file load?"; `ppharness model info FILE` shows what a file is)'
)

# the dimensions shown for every architecture: (the name shown, the metadata key after "{arch}.")
DIMENSIONS = (
    ("blocks", "block_count"),
    ("dim", "embedding_length"),
    ("ffn", "feed_forward_length"),
    ("heads", "attention.head_count"),
    ("kv_heads", "attention.head_count_kv"),
    ("context", "context_length"),
    ("rope_theta", "rope.freq_base"),
    ("norm_eps", "attention.layer_norm_rms_epsilon"),
)
# a rope scaling's, shown when the file scales its rope
ROPE_SCALING = (
    ("rope_scaling", "rope.scaling.type"),
    ("rope_scaling_factor", "rope.scaling.factor"),
    ("rope_original_context", "rope.scaling.original_context_length"),
)
# a mixture of experts', shown when the file has routed experts
EXPERTS = (
    ("experts", "expert_count"),
    ("experts_used", "expert_used_count"),
    ("expert_ffn", "expert_feed_forward_length"),
    ("shared_experts", "expert_shared_count"),
    ("shared_ffn", "expert_shared_feed_forward_length"),
    ("dense_blocks", "leading_dense_block_count"),
    ("expert_groups", "expert_group_count"),
    ("groups_used", "expert_group_used_count"),
)
# multi-head latent attention's (deepseek2), shown when the file has them
LATENT = (("q_lora_rank", "attention.q_lora_rank"), ("kv_lora_rank", "attention.kv_lora_rank"))

_TOKENS = "tokenizer.ggml.tokens"


@dataclass(frozen=True)
class LoadVerdict:
    """Whether the engine runs a GGUF file (``loads``; ``reasons`` why not, each in one line) and what the file is:
    its architecture, parameter count, the dimensions that mean something for it (``fields``, in the order shown),
    its tensor types with their counts (most first), its tokenizer and vocabulary, and whether it has a chat
    template."""

    path: str
    file_bytes: int
    arch: str
    parameters: int
    fields: dict[str, Any]
    tensor_types: dict[str, int]
    tokenizer: str | None  # tokenizer.ggml.model
    tokenizer_pre: str | None  # tokenizer.ggml.pre
    vocab: int | None
    chat_template: bool
    reasons: list[str] = field(default_factory=list)

    @property
    def loads(self) -> bool:
        return not self.reasons

    def refusal(self) -> str:
        """Why the file does not load, naming it, with the fix."""
        return f"{self.path}: this engine cannot run this file: {'; '.join(self.reasons)} — {FIX}"

    def refuse(self) -> None:
        """``ModelError`` (``refusal``) unless the file loads."""
        if not self.loads:
            raise ModelError(self.refusal())


def judge_file(path: str | os.PathLike[str]) -> LoadVerdict:
    """The verdict on the GGUF file at ``path`` from its header; ``ModelError`` for a missing file or one that is not a
    readable, sane GGUF (``read_gguf``'s words). Read once per process while the file is unchanged."""
    name = str(Path(path))
    return _judged(name, *_stat(name))


def read_header_contents(path: str | os.PathLike[str]) -> GGUFContents:
    """The file's metadata and tensor infos, its arrays stepped over (``read_gguf(path, arrays=False)``), read once
    per process while the file is unchanged."""
    name = str(Path(path))
    return _contents(name, *_stat(name))


def _stat(path: str) -> tuple[int, int]:
    """The file's size and modification time: what tells its versions apart."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise ModelError(f"{path}: no such file ({exc.strerror}) — give the path of a GGUF file") from None
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _contents(path: str, size: int, mtime_ns: int) -> GGUFContents:
    return read_gguf(path, arrays=False)


@functools.lru_cache(maxsize=8)
def _judged(path: str, size: int, mtime_ns: int) -> LoadVerdict:
    return judge(_contents(path, size, mtime_ns))


def refuse_unloadable(source: str) -> None:
    """``ModelError`` when ``source`` (a model source as ``resolve_model`` takes it) is a local path with no file
    behind it, or a file this engine cannot run; nothing for a synthetic spec (always supported) or a URL (judged once
    downloaded)."""
    if source.startswith("synthetic:") or "://" in source:
        return
    path = Path(source).expanduser()
    if not path.is_file():
        raise ModelError(
            f"{source}: no such file ({path.resolve()}) — give the path of a GGUF file, an http(s) URL or "
            "synthetic:PRESET"
        )
    judge_file(path).refuse()


def judge(contents: GGUFContents) -> LoadVerdict:
    """The verdict on a file read with its arrays stepped over (``read_gguf(path, arrays=False)``)."""
    kv, path = contents.kv, contents.path
    arch = str(kv["general.architecture"])  # read_gguf checks it is there, a text
    names = {t.name for t in contents.tensors}
    types = Counter(t.type for t in contents.tensors)
    tokens = kv.get(_TOKENS)
    vocab = tokens.count if isinstance(tokens, SkippedArray) else len(tokens) if isinstance(tokens, list) else None
    reasons = _architecture_problems(contents, arch, names, vocab)
    for ggml_type in sorted(types):  # the matrices, held as they are stored (a vector is unpacked where it is read)
        matrices = [t.name for t in contents.tensors if t.type == ggml_type and len(t.dims) >= 2]
        if matrices and ggml_type not in CODECS:
            more = f" and {len(matrices) - 1:,} more" if len(matrices) > 1 else ""
            reasons.append(
                f"tensor {matrices[0]!r}{more} stored as {type_name(ggml_type)}, which this engine does not "
                f"compute with (it reads {known()}) — quantise the model to one of those (llama-quantize Q4_K_M, "
                "Q5_K_M, Q6_K, Q8_0)"
            )
    problem = tokenizer_problem(kv)
    if problem:
        reasons.append(problem)
    pre = kv.get("tokenizer.ggml.pre")
    return LoadVerdict(
        path=path,
        file_bytes=contents.size,
        arch=arch,
        parameters=sum(math.prod(t.dims) for t in contents.tensors),
        fields=_fields(kv, arch, names, vocab),
        tensor_types={type_name(t): n for t, n in types.most_common()},
        tokenizer=str(kv["tokenizer.ggml.model"]) if "tokenizer.ggml.model" in kv else None,
        tokenizer_pre=str(pre) if pre is not None else None,
        vocab=vocab,
        chat_template=isinstance(kv.get("tokenizer.chat_template"), str),
        reasons=reasons,
    )


def _architecture_problems(contents: GGUFContents, arch: str, names: set[str], vocab: int | None) -> list[str]:
    """What the architecture refuses: an unknown one; tensors or keys it does not compute with; a key it needs that
    the file lacks."""
    kv, path = contents.kv, contents.path
    try:
        architecture = of_file(arch, int(kv.get(f"{arch}.expert_count", 0)))
    except ModelError as exc:
        return [str(exc)]
    try:
        check_file(path, architecture, kv, names)
        if vocab is not None:
            # ModelConfig reads the keys every model needs; the vocabulary's texts are not read from the header, so
            # it reads stand-ins of the vocabulary's length (they only decide which tokens end generation)
            read_config({**kv, _TOKENS: [""] * vocab}, names)
    except ModelError as exc:
        return [str(exc).removeprefix(f"{path}: ")]
    except KeyError as exc:
        return [f"GGUF metadata lacks {exc.args[0]!r}"]
    except (ArithmeticError, LookupError, TypeError, ValueError) as exc:  # as GGUFFile: what the checks do not foresee
        return [f"the GGUF metadata does not describe a model this engine computes ({type(exc).__name__}: {exc})"]
    return []


def _fields(kv: dict[str, Any], arch: str, names: set[str], vocab: int | None) -> dict[str, Any]:
    """The dimensions that mean something for this file: every architecture's, then its rope scaling, routed
    experts and latent attention where it has them; each only where the file states it."""

    def get(suffix: str) -> Any:
        return kv.get(f"{arch}.{suffix}")

    dim, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length") or (dim // heads if isinstance(dim, int) and heads else None)
    out: dict[str, Any] = {}
    for key, suffix in DIMENSIONS:
        if get(suffix) is not None:
            out[key] = get(suffix)
        if key == "kv_heads" and head_dim is not None:
            out["head_dim"] = head_dim
            for own, width in (("v_head_dim", "attention.value_length"), ("rope_dim", "rope.dimension_count")):
                if get(width) is not None and get(width) != head_dim:  # a value head or rotary width of its own
                    out[own] = get(width)
    if vocab is not None:
        out["vocab"] = vocab
    out["tied"] = "output.weight" not in names
    if str(get("rope.scaling.type") or "none").lower() != "none":
        out |= {k: get(s) for k, s in ROPE_SCALING if get(s) is not None}
    if get("expert_count"):
        out |= {k: get(s) for k, s in EXPERTS if get(s) is not None}
        out["moe_blocks"] = sorted(moe_blocks(names))
    out |= {k: get(s) for k, s in LATENT if get(s)}
    return out
