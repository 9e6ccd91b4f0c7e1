"""A stage's share of a llama-family GGUF model, on tinygrad. The only module that imports tinygrad's model API.

A stage owns ``(embed?, blocks [lo, hi), head?)``: the first stage the token embedding, the last the final norm and the
output head (the embedding matrix again when the model ties them). ``ModelSlice.load`` reads only those tensors from the
file (memory-mapped, dequantised by the ``gguf`` package when quantised) and renames ``blk.{lo+i}`` to ``blk.{i}`` in
one place, ``_local_name``. The unsplit model is the slice (embed, all blocks, head): the oracle runs the same code.

Split == unsplit, bit for bit, by construction: the model is defined with an fp16 residual stream at every block
boundary (each block's output is cast to fp16 and realised as its own buffer, as is the embedding's). tinygrad's own
block keeps the residual in fp32 (its attention computes in fp32), so an unsplit compiled step would carry fp32
between blocks while a split must round at the stage boundary; rounding at *every* boundary removes that difference.
A block's kernels then read an fp16 buffer and write one whatever precedes or follows it, so each block compiles to
the same kernels in the whole model and in any split (``tests/test_slicing.py`` compares the compiled kernels), and an
fp16 (or f32) wire carries a boundary's bytes exactly. ``taps=True`` keeps every boundary's hidden state of the last
step, which is how the tests compare the unsplit model with a split byte for byte.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError

if TYPE_CHECKING:  # tinygrad is imported when a slice is built, not with this module
    from collections.abc import Callable, Generator, Iterable, Mapping

    from tinygrad.apps.llm import SimpleTokenizer, TransformerBlock
    from tinygrad.device import Buffer
    from tinygrad.engine.jit import TinyJit
    from tinygrad.engine.realize import ExecItem
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

    from ppharness.model.moe import ExpertCall

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")
# mixture-of-experts architectures this model code computes, and whether each renormalises its top-k weights when
# the file does not say (llama.cpp's build_moe_ffn ``norm_w``)
PREFILL_STEPS = 32  # compiled prefill steps a slice keeps (one per request slot and prompt length), most recent first
MOE_ARCHS = {"qwen3moe": True, "qwen2moe": False, "deepseek2": False}


@dataclass(frozen=True)
class ModelConfig:
    """What a GGUF's metadata says about the model, in tinygrad's terms."""

    arch: str
    blocks: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rope_theta: float
    norm_eps: float
    bos_id: int | None
    eos_id: int
    tied: bool
    # mixture of experts (ppharness.model.moe): routed experts per MoE block, how many each token uses, one expert's
    # FFN width, the shared expert's width (0: none), whether the top-k weights are renormalised, and which blocks
    # are MoE blocks (those with a router); all empty for a dense model
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    norm_topk: bool = False
    moe_blocks: frozenset[int] = frozenset()
    qk_norm: int = 0  # RMS norm of each head's queries and keys (qwen3): the head dim, 0 for none
    qkv_bias: bool = False  # biases on the query, key and value projections (qwen2)
    # deepseek2 (ppharness.model.mla): the router's scoring, groups and scale, whether the shared experts are gated
    # (qwen2moe) or not, MLA's ranks and widths (``head_dim`` is then a head's key width, no-rope + rope), and YaRN
    gating: str = "softmax"
    expert_groups: int = 0
    groups_used: int = 0
    routed_scale: float = 1.0
    shared_gate: bool = True
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_dim: int = 0
    v_head_dim: int = 0
    yarn_factor: float = 0.0
    yarn_original_context: int = 0
    yarn_log_mul: float = 0.0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        return bool(self.moe_blocks)

    @staticmethod
    def from_kv(kv: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        try:
            arch = kv["general.architecture"]
            dim, heads = int(kv[f"{arch}.embedding_length"]), int(kv[f"{arch}.attention.head_count"])
            experts = int(kv.get(f"{arch}.expert_count", 0))
            moe_blocks = frozenset(
                int(m.group(1)) for n in tensor_names if (m := _BLK.match(n)) and m.group(2) == "ffn_gate_inp.weight"
            )
            if experts and arch not in MOE_ARCHS:
                raise ModelError(
                    f"architecture {arch!r} with experts is not supported; mixture-of-experts models load as "
                    f"{', '.join(MOE_ARCHS)}"
                )
            moe = dict(
                experts=experts,
                experts_used=int(kv[f"{arch}.expert_used_count"]) if experts else 0,
                expert_ffn=int(kv.get(f"{arch}.expert_feed_forward_length", kv[f"{arch}.feed_forward_length"]))
                if experts
                else 0,
                shared_ffn=int(kv.get(f"{arch}.expert_shared_feed_forward_length", 0))
                if any(n.endswith(".ffn_gate_shexp.weight") for n in tensor_names)
                else 0,
                norm_topk=bool(kv.get(f"{arch}.expert_weights_norm", MOE_ARCHS.get(arch, False))),
                moe_blocks=moe_blocks if experts else frozenset(),
            )
            q_norm = next((n for n in sorted(tensor_names) if n.endswith(".attn_q_norm.weight")), None)
            head_dim = int(kv.get(f"{arch}.attention.key_length", dim // heads))
            if arch == "deepseek2":
                mla = _deepseek2_kv(kv, tensor_names, moe)
                head_dim = int(mla["head_dim"])
            return ModelConfig(
                arch=arch,
                blocks=int(kv[f"{arch}.block_count"]),
                dim=dim,
                ffn=int(kv[f"{arch}.feed_forward_length"]),
                heads=heads,
                kv_heads=int(kv.get(f"{arch}.attention.head_count_kv", heads)),
                head_dim=head_dim,
                vocab=len(kv["tokenizer.ggml.tokens"]),
                context=int(kv[f"{arch}.context_length"]),
                rope_theta=float(kv.get(f"{arch}.rope.freq_base", 10000.0)),
                norm_eps=float(kv[f"{arch}.attention.layer_norm_rms_epsilon"]),
                bos_id=int(kv["tokenizer.ggml.bos_token_id"])
                if kv.get("tokenizer.ggml.add_bos_token", True) and "tokenizer.ggml.bos_token_id" in kv
                else None,
                eos_id=int(kv["tokenizer.ggml.eos_token_id"]),
                tied="output.weight" not in tensor_names,
                qk_norm=int(kv.get(f"{arch}.attention.key_length", dim // heads)) if q_norm else 0,
                qkv_bias=any(n.endswith(".attn_q.bias") for n in tensor_names),
                **moe,  # type: ignore[arg-type]
            )
        except KeyError as exc:
            raise ModelError(f"GGUF metadata lacks {exc.args[0]!r}") from None


def _deepseek2_kv(kv: dict[str, Any], tensor_names: set[str], moe: dict[str, Any]) -> dict[str, Any]:
    """deepseek2's keys, as llama.cpp's loader reads them, into ``moe`` (updated in place); returns the head's key
    width. A file from before llama.cpp computed MLA in the compressed space (one ``attn_kv_b`` per block instead of
    ``attn_k_b`` and ``attn_v_b``) is refused with what to do."""
    a = "deepseek2"
    if any(n.endswith(".attn_kv_b.weight") for n in tensor_names):
        raise ModelError(
            "this deepseek2 GGUF stores MLA's key/value up-projection as one attn_kv_b per block (llama.cpp's layout "
            "before April 2025); convert the model again with a current llama.cpp convert_hf_to_gguf.py, which "
            "writes attn_k_b and attn_v_b"
        )
    gating = int(kv.get(f"{a}.expert_gating_func", 0))
    shared = int(kv.get(f"{a}.expert_shared_count", 0))
    moe.update(
        gating="sigmoid" if gating == 2 else "softmax",  # 0 (not set): softmax, as llama.cpp for DeepSeek V2
        expert_groups=int(kv.get(f"{a}.expert_group_count", 0)),
        groups_used=int(kv.get(f"{a}.expert_group_used_count", 0)),
        routed_scale=float(kv.get(f"{a}.expert_weights_scale", 1.0)),
        shared_gate=False,
        shared_ffn=moe["expert_ffn"] * shared if moe["experts"] else 0,
        q_lora_rank=int(kv.get(f"{a}.attention.q_lora_rank", 0)),
        kv_lora_rank=int(kv[f"{a}.attention.kv_lora_rank"]),
        rope_dim=int(kv[f"{a}.rope.dimension_count"]),
        v_head_dim=int(kv.get(f"{a}.attention.value_length_mla", kv.get(f"{a}.attention.value_length", 0))),
    )
    if str(kv.get(f"{a}.rope.scaling.type", "none")) == "yarn":
        moe.update(
            yarn_factor=float(kv[f"{a}.rope.scaling.factor"]),
            yarn_original_context=int(kv[f"{a}.rope.scaling.original_context_length"]),
            yarn_log_mul=float(kv.get(f"{a}.rope.scaling.yarn_log_multiplier", 0.0)),
            yarn_beta_fast=float(kv.get(f"{a}.rope.scaling.yarn_beta_fast", 32.0)),
            yarn_beta_slow=float(kv.get(f"{a}.rope.scaling.yarn_beta_slow", 1.0)),
        )
    return {"head_dim": kv.get(f"{a}.attention.key_length_mla", kv[f"{a}.attention.key_length"])}


class GGUFFile:
    """A GGUF file opened memory-mapped: metadata now, tensors on demand (as float16 numpy arrays)."""

    def __init__(self, path: str | os.PathLike[str]):
        import gguf

        self.path = Path(path)
        try:
            self._reader = gguf.GGUFReader(str(self.path))
        except (OSError, ValueError) as exc:
            raise ModelError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        self.kv: dict[str, Any] = {k: f.contents() for k, f in self._reader.fields.items() if not k.startswith("GGUF.")}
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.config = ModelConfig.from_kv(self.kv, set(self._tensors))

    def tensor(self, name: str, rows: list[int] | None = None) -> NDArray[np.float16]:
        """One tensor as float16 in tinygrad's (out, in) layout; llama Q/K rows reordered for half-split RoPE.
        ``rows`` picks entries of the outermost dimension (experts of a stacked expert tensor) before anything is
        converted, so a node reads only the experts it holds."""
        import gguf

        try:
            t = self._tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: tensor {name!r} is missing") from None
        shape = tuple(int(d) for d in reversed(t.shape))
        data = np.asarray(t.data)  # the element shape (quantised: the last dimension in bytes)
        if rows is not None:
            data = data.reshape(shape[0], *data.shape[-(len(shape) - 1) :])[rows]
            shape = (len(rows), *shape[1:])
        if t.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            arr = data
        else:
            arr = gguf.quants.dequantize(data, t.tensor_type)
        arr = arr.reshape(shape).astype(np.float16)
        cfg = self.config
        if cfg.arch == "llama" and (m := _BLK.match(name)) and m.group(2) in ("attn_q.weight", "attn_k.weight"):
            # interleaved -> half-split rotary layout, as tinygrad's Transformer.from_gguf does:
            # (n h two) d -> (n two h) d
            n = cfg.heads if m.group(2) == "attn_q.weight" else cfg.kv_heads
            d = arr.shape[-1]
            arr = arr.reshape(n, -1, 2, d).transpose(0, 2, 1, 3).reshape(-1, d)
        return np.ascontiguousarray(arr)

    def vector(self, name: str) -> NDArray[np.float32]:
        """A 1-D F32 or F16 tensor as float32 (what a router's selection bias needs: not rounded to float16)."""
        try:
            t = self._tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: tensor {name!r} is missing") from None
        return np.asarray(t.data, dtype=np.float32).reshape(-1).copy()

    def names(self) -> list[str]:
        return list(self._tensors)

    @functools.cached_property
    def tokenizer(self) -> SimpleTokenizer:
        """The file's tokenizer, built once (building one compiles a large regex: most of a second)."""
        return tokenizer_from(self.kv)


def tokenizer_from(kv: dict[str, Any]) -> SimpleTokenizer:
    from tinygrad.apps.llm import SimpleTokenizer

    tokenizer: SimpleTokenizer = SimpleTokenizer.from_gguf_kv(kv)  # tinygrad leaves its return type unannotated
    return tokenizer


def _local_name(name: str, lo: int) -> str:
    """A file tensor name -> the slice's attribute path: ``blk.{lo+i}.x`` -> ``blk.{i}.x``; others unchanged."""
    m = _BLK.match(name)
    return f"blk.{int(m.group(1)) - lo}.{m.group(2)}" if m else name


def _file_name(local: str, lo: int) -> str:
    """The inverse of ``_local_name``."""
    m = _BLK.match(local)
    return f"blk.{int(m.group(1)) + lo}.{m.group(2)}" if m else local


def owned_tensors(names: list[str], lo: int, hi: int, first: bool, last: bool, tied: bool) -> dict[str, str]:
    """{slice name: file name} for what a stage holding blocks [lo, hi) loads."""
    out: dict[str, str] = {}
    for name in names:
        m = _BLK.match(name)
        if m and lo <= int(m.group(1)) < hi and not m.group(2).endswith("_exps.weight"):  # routed experts: a bank's
            out[_local_name(name, lo)] = name
    if first:
        out["token_embd.weight"] = "token_embd.weight"
    if last:
        out["output_norm.weight"] = "output_norm.weight"
        out["output.weight"] = "token_embd.weight" if tied else "output.weight"
    return out


class ModelSlice:
    """Blocks [lo, hi) of a model, plus the embedding when ``first`` and the final norm and head when ``last``.

    ``prefill(x, 0)`` and ``decode(x, pos)`` take token ids (first stage) or a hidden state, and return a hidden state
    (1, T, D) as fp16 numpy, or, on the last stage, the greedy next token id.

    A mixture-of-experts model (``ppharness.model.moe``) runs block by block: ``step(x, position)`` is a generator that
    yields an ``ExpertCall`` at each MoE block and takes back the chosen experts' outputs, so that a stage can send
    them to the expert nodes that hold them. ``experts`` says which routed experts of its blocks the slice holds
    itself (default: all of them); ``prefill``/``decode`` answer every call from those.

    Request slots: the slice keeps ``slots`` KV caches, one per request in flight, and every call names the slot it
    computes in (``slot=``, default 0). Each slot has its own compiled decode step (a TinyJit captures the cache buffers
    it writes), made of the same kernels as every other slot's, so which slot serves a request never changes a byte.
    """

    def __init__(
        self,
        gguf_file: GGUFFile,
        lo: int,
        hi: int,
        first: bool,
        last: bool,
        max_context: int | None = None,
        taps: bool = False,
        experts: Mapping[int, Iterable[int]] | None = None,
        slots: int = 1,
    ):
        from tinygrad import nn
        from tinygrad.engine.jit import TinyJit
        from tinygrad.uop.ops import UOp

        from ppharness.model.moe import ExpertBank, all_experts

        cfg = gguf_file.config
        if not 0 <= lo < hi <= cfg.blocks and not (lo == hi and first and last and cfg.blocks == 0):
            raise ModelError(f"block range [{lo}, {hi}) is not inside the model's {cfg.blocks} blocks")
        self.file, self.config, self.lo, self.hi, self.first, self.last = gguf_file, cfg, lo, hi, first, last
        self.max_context = min(max_context or cfg.context, cfg.context)
        if slots < 1:
            raise ModelError(f"a slice needs at least one request slot, not {slots}")
        self.slots, self._slot = slots, 0
        # the KV caches of the slots not in use, and (the last one) of the prefill's scratch slot
        self._caches: list[list[Tensor | None]] = [[] for _ in range(slots + 1)]
        self.taps = taps
        self._tapped: list[Tensor] = []  # with taps: every block's output of the last step (tinygrad tensors)
        max_ctx = self.max_context
        if cfg.mla:
            from ppharness.model.mla import deepseek2_block_class

            block_class = deepseek2_block_class()
        else:
            block_class = _moe_block_class()
        self.blk = (
            [block_class(cfg, self.max_context, lo + i in cfg.moe_blocks) for i in range(hi - lo)]
            if cfg.moe or cfg.mla
            else [
                _block_class()(
                    cfg.dim, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.norm_eps, cfg.head_dim, cfg.rope_theta, max_ctx
                )
                for _ in range(hi - lo)
            ]
        )
        if first:
            self.token_embd = nn.Embedding(cfg.vocab, cfg.dim)
        if last:
            self.output_norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = _DecodeLinear(nn.Linear(cfg.dim, cfg.vocab, bias=False))
        self._load(gguf_file)
        self._pos = UOp.variable("start_pos", 1, self.max_context - 1)
        self._jits = [TinyJit(self._forward) for _ in range(slots)]
        # prefill steps by prompt length: building and scheduling a prefill's graph costs far more than running it, so
        # a length that comes again replays the step compiled for it (the same kernels as a plain run). A prefill
        # computes in a scratch slot of its own, whose cache is then copied byte for byte into the request's slot, so
        # that one compiled step serves every slot.
        self._prefills: OrderedDict[int, TinyJit[Any]] = OrderedDict()
        self._decode_in: Tensor | None = None  # (1,1) ids or (1,1,D) hidden, reused by every decode step
        self._directs: list[_DirectStep | Literal[False] | None] = [
            None
        ] * slots  # each slot's lean call (None: not yet)
        # mixture of experts: the routed experts held here, one compiled step per block and one for the head, each
        # with its persistent decode input
        self.bank = ExpertBank(gguf_file, all_experts(gguf_file, lo, hi) if experts is None else experts)
        self.n_params += self.bank.n_params
        self._slot_steps = [
            [TinyJit(functools.partial(self._segment, i)) for i in range(hi - lo)] if cfg.moe else []
            for _ in range(slots)
        ]
        # the routers' selection biases (deepseek2's exp_probs_b), float32 as the file stores them
        self._bias = {
            lo + i: gguf_file.vector(f"blk.{lo + i}.exp_probs_b.bias")
            for i in range(hi - lo)
            if f"blk.{lo + i}.exp_probs_b.bias" in gguf_file._tensors
        }
        self._head_jit = TinyJit(self._head)
        self._inputs: dict[int, Tensor] = {}
        self._tapped_np: dict[int, NDArray[np.float16]] = {}

    def _load(self, f: GGUFFile) -> None:
        from tinygrad import nn
        from tinygrad.tensor import Tensor

        owned = owned_tensors(f.names(), self.lo, self.hi, self.first, self.last, self.config.tied)
        state = {local: Tensor(f.tensor(name)) for local, name in owned.items()}
        expected = nn.state.get_state_dict(self)
        missing = sorted(_file_name(k, self.lo) for k in set(expected) - set(state))
        if missing:
            raise ModelError(f"{f.path}: blocks [{self.lo}, {self.hi}) need tensors the file lacks: {missing[:5]}")
        for local, t in state.items():
            if local in expected and expected[local].shape != t.shape:
                raise ModelError(
                    f"{f.path}: tensor {owned[local]!r} has shape {t.shape}, the model needs {expected[local].shape}"
                )
        nn.state.load_state_dict(self, {k: v for k, v in state.items() if k in expected}, verbose=False, realize=False)
        params = nn.state.get_parameters(self)
        for p in params:
            p.replace(p.cast("float16").contiguous())
        Tensor.realize(*params)
        # what this stage holds, each file tensor once; a tied head on a stage without the embedding is reported apart
        sizes = {name: math.prod(int(d) for d in state[local].shape) for local, name in owned.items()}
        self.n_params = sum(sizes.values())
        self.tied_params = sizes["token_embd.weight"] if self.last and self.config.tied and not self.first else 0
        self.n_params -= self.tied_params

    def use(self, slot: int) -> None:
        """Compute in request slot ``slot`` from now on: its KV cache goes into the blocks (a slot never used before
        starts without one; the block makes it at the slot's first prefill)."""
        if not 0 <= slot <= self.slots:  # slot ``slots`` is the prefill's scratch slot
            raise ModelError(f"request slot {slot} is outside this slice's {self.slots} slot(s)")
        if slot == self._slot:
            return
        self._caches[self._slot] = [getattr(b, "cache_kv", None) for b in self.blk]
        for i, block in enumerate(self.blk):
            cache = self._caches[slot][i] if self._caches[slot] else None
            if cache is None:
                block.__dict__.pop("cache_kv", None)
            else:
                block.cache_kv = cache
        self._slot = slot

    @property
    def _jit(self) -> TinyJit[Any]:
        return self._jits[self._slot]

    @property
    def _steps(self) -> list[TinyJit[Any]]:
        return self._slot_steps[self._slot]

    def _forward(self, x: Tensor, start_pos: int | UOp) -> Tensor | tuple[Tensor, ...]:
        """The slice's step: (B,T) ids or a (B,T,D) fp16 hidden state in; a hidden state, or token ids on the last
        stage, out (with ``taps``, followed by every block's output)."""
        taps = []
        if self.first:
            x = self.token_embd(x).cast("float16").contiguous()  # (B,T) ids -> (B,T,D); a boundary like any other
        for block in self.blk:
            x = block(x, start_pos)  # (B,T,D) fp16, a buffer of its own
            taps.append(x)
        out = self.output(self.output_norm(x))[:, -1, :].argmax(-1) if self.last else x  # (B,) or (B,T,D)
        return (out, *taps) if self.taps else out

    def _segment(self, i: int, x: Tensor, start_pos: int | UOp) -> tuple[Tensor, ...]:
        """Block ``i`` of the slice (the embedding first on the first stage's block 0): a dense block's fp16 output,
        or a MoE block's part before its routed experts (``MoEBlock.pre``)."""
        if self.first and i == 0:
            x = self.token_embd(x).cast("float16").contiguous()
        block = self.blk[i]
        if getattr(block, "routed", False):
            return cast("tuple[Tensor, ...]", cast(Any, block).pre(x, start_pos))
        return (block(x, start_pos),)

    def _head(self, x: Tensor) -> Tensor:
        return self.output(self.output_norm(x))[:, -1, :].argmax(-1)

    def _run(self, key: int, x: NDArray[Any], position: int) -> list[NDArray[Any]]:
        """One piece of a MoE slice's step (``key``: a block index, -1 the head): at a prefill uncompiled, at a decode
        through its compiled step with a persistent input buffer. Its outputs as numpy arrays."""
        from tinygrad.tensor import Tensor

        outs: Tensor | tuple[Tensor, ...]
        if position == 0:
            t = Tensor(np.ascontiguousarray(x))
            outs = self._segment(key, t, 0) if key >= 0 else self._head(t)
        else:
            arr = np.ascontiguousarray(x)
            if key not in self._inputs:
                self._inputs[key] = Tensor(arr).realize()
            else:
                cast("Buffer", self._inputs[key].uop.base.realized).copyin(arr.data.cast("B"))
            if key >= 0:
                outs = self._steps[key](self._inputs[key], self._pos.bind(position))
            else:
                outs = self._head_jit(self._inputs[key])
        return [t.numpy() for t in (outs if isinstance(outs, tuple) else (outs,))]

    def step(
        self, x: list[int] | NDArray[np.float16], position: int, slot: int = 0
    ) -> Generator[ExpertCall, NDArray[np.float16], NDArray[np.float16] | int]:
        """A MoE slice's step at ``position`` (0: a prefill of every position of ``x``) in request slot ``slot``:
        yields one ``ExpertCall`` per MoE block and takes back the chosen experts' outputs; returns what
        ``prefill``/``decode`` return."""
        from ppharness.model.moe import ExpertCall, combine, route

        cfg = self.config
        self.use(slot)
        h: NDArray[Any] = (
            np.asarray(x, dtype=np.int32).reshape(1, -1) if self.first else np.asarray(x, dtype=np.float16)
        )
        for i, block in enumerate(self.blk):
            outs = self._run(i, h, position)
            if getattr(block, "routed", False):
                residual, normed, logits, *shared = outs
                t = residual.shape[1]
                routing = route(
                    logits.reshape(t, cfg.experts),
                    cfg.experts_used,
                    cfg.norm_topk,
                    gating=cfg.gating,
                    bias=self._bias.get(self.lo + i),
                    groups=cfg.expert_groups,
                    groups_used=cfg.groups_used,
                    scale=cfg.routed_scale,
                )
                got = yield ExpertCall(layer=self.lo + i, hidden=normed.reshape(t, cfg.dim), routing=routing)
                self.use(slot)  # whoever answered the call may have computed in another slot meanwhile
                gated = shared[0].reshape(t, cfg.dim) if shared else None
                h = combine(residual.reshape(t, cfg.dim), got, routing.weights, gated).reshape(1, t, cfg.dim)
            else:
                h = outs[0]
            if self.taps:
                self._tapped_np[self.lo + i] = h
        if self.last:
            return int(self._run(-1, h, position)[0].reshape(-1)[0])
        return cast("NDArray[np.float16]", h)

    def answer(self, call: ExpertCall, stand_in: bool = False) -> NDArray[np.float16]:
        """``call`` answered from the experts this slice holds (a ModelError naming one it does not; zeros for it
        with ``stand_in``, which only compiling the step before a request may use)."""
        missing = sorted(e for e in call.wanted() if not self.bank.holds(call.layer, e))
        if missing and not stand_in:
            raise ModelError(
                f"block {call.layer} routed a token to expert(s) {missing[:8]}, which this slice does not hold; "
                "run it with the expert nodes of its plan"
            )
        if not missing:
            return self.bank.answer(call.layer, call.hidden, call.routing.ids)
        out = np.zeros((*call.routing.ids.shape, self.config.dim), dtype=np.float16)
        for t, row in enumerate(call.routing.ids):
            for j, e in enumerate(row):
                if self.bank.holds(call.layer, int(e)):
                    out[t, j] = self.bank.run(call.layer, int(e), call.hidden[t])
        return out

    def _moe_step(
        self, x: list[int] | NDArray[np.float16], position: int, stand_in: bool = False
    ) -> NDArray[np.float16] | int:
        gen = self.step(x, position, self._slot)
        try:
            call = next(gen)
            while True:
                call = gen.send(self.answer(call, stand_in))
        except StopIteration as stop:
            return cast("NDArray[np.float16] | int", stop.value)

    def warm(self, x: list[int] | NDArray[np.float16], position: int, slot: int = 0) -> None:
        """One step to compile it before the first request; a MoE slice stands zeros in for experts held
        elsewhere (what it computes is thrown away)."""
        self.use(slot)
        if self.config.moe:
            self._moe_step(x, position, stand_in=True)
        elif position == 0:
            self.prefill(x, slot)
        else:
            self.decode(x, position, slot)

    def _input(self, x: list[int] | NDArray[np.int32] | NDArray[np.float16]) -> Tensor:
        from tinygrad.tensor import Tensor

        if self.first:
            return Tensor([list(x)], dtype="int32")  # (1,T)
        return Tensor(np.ascontiguousarray(x, dtype=np.float16))  # (1,T,D)

    def prefill(self, x: list[int] | NDArray[np.float16], slot: int = 0) -> NDArray[np.float16] | int:
        """Run positions [0, T) in request slot ``slot``. Ids (first stage) or hidden (1,T,D) in; hidden (1,T,D) or a
        token id out."""
        if not 0 <= slot < self.slots:
            raise ModelError(f"request slot {slot} is outside this slice's {self.slots} slot(s)")
        if self.config.moe:
            self.use(slot)
            return self._moe_step(x, 0)
        from tinygrad.engine.jit import TinyJit
        from tinygrad.tensor import Tensor

        t = self._input(x)
        length = int(t.shape[1])
        jit = self._prefills.pop(length, None)
        if jit is None:
            if len(self._prefills) >= PREFILL_STEPS:  # the least recently used length goes
                self._prefills.popitem(last=False)
            jit = TinyJit(self._forward)
        self._prefills[length] = jit
        self.use(self.slots)
        out = self._output(jit(t, 0))
        scratch = [cast("Tensor", b.cache_kv) for b in self.blk]
        self.use(slot)
        for block, src in zip(self.blk, scratch, strict=True):
            if not hasattr(block, "cache_kv"):  # the slot's first request: a cache of its own, like the scratch one
                block.cache_kv = Tensor.zeros(*src.shape, dtype=src.dtype, device=src.device).contiguous().realize()
            dst = cast("Buffer", block.cache_kv.uop.base.realized)
            dst.copyin(cast("Buffer", src.uop.base.realized).as_buffer())
        return out

    def decode(self, x: list[int] | NDArray[np.float16], position: int, slot: int = 0) -> NDArray[np.float16] | int:
        """Run one position ``position >= 1`` of request slot ``slot`` through the compiled decode step.

        The step's input lives in one persistent device buffer that each call overwrites, so a token costs one copy in
        instead of a new tensor (and its allocation) per call.
        """
        if not 1 <= position < self.max_context:
            raise ModelError(f"position {position} is outside the context of {self.max_context}")
        self.use(slot)
        if self.config.moe:
            return self._moe_step(x, position)
        arr = np.asarray(x, dtype=np.int32).reshape(1, 1) if self.first else np.asarray(x, dtype=np.float16)
        direct = self._directs[slot]
        if direct is None and self._jit.captured is not None:
            direct = self._directs[slot] = _DirectStep.of(self) or False
        if direct:
            out = direct(arr, position)
            self._tapped = direct.taps
            return out
        if self._decode_in is None:
            self._decode_in = self._input(arr if not self.first else arr[0]).realize()
        else:
            buf = cast("Buffer", self._decode_in.uop.base.realized)  # realized above, on one device
            buf.copyin(np.ascontiguousarray(arr).data.cast("B"))
        with _decode_context(self._decode_in.device):
            return self._output(self._jit(self._decode_in, self._pos.bind(position)))

    def decode_kernels(self) -> list[str]:
        """The source of every kernel the compiled decode step runs, in order, with kernel names left out (they number
        identical kernels apart within one process). Empty before the step is compiled."""
        out: list[str] = []

        def walk(items: list[ExecItem]) -> None:
            for item in items:
                prg = item.prg
                if prg is not None and hasattr(prg, "jit_cache"):  # a device graph (CUDA graph, ...) batching kernels
                    walk(prg.jit_cache)
                    continue
                program = getattr(prg, "p", None)  # a compiled kernel's ProgramSpec
                src = getattr(program, "src", None)
                out.append(
                    re.sub(rf"\b{re.escape(program.function_name)}\b", "kernel", src)
                    if program is not None and src
                    else type(prg).__name__
                )

        jits: list[TinyJit[Any]] = [self._jits[0], *self._slot_steps[0], self._head_jit]
        if self.bank.n:
            jits.append(self.bank._jit)
        for jit in jits:
            captured = jit.captured
            walk(captured.jit_cache if captured is not None else [])
        return out

    def _output(self, out: Tensor | tuple[Tensor, ...]) -> NDArray[np.float16] | int:
        if isinstance(out, tuple):  # with taps: the step's output, then every block's
            out, *self._tapped = out
        return int(out.item()) if self.last else out.numpy()

    def tapped(self) -> dict[int, NDArray[np.float16]]:
        """With ``taps``: block index (in the file) -> its output (1,T,D) at the last prefill or decode step."""
        if self.config.moe:
            return dict(self._tapped_np)
        return {self.lo + i: t.numpy() for i, t in enumerate(self._tapped)}


class _DirectStep:
    """A dense slice's compiled decode step called without the per-call work around it, for a device whose buffers
    are host memory (tinygrad's CPU device): the input is written straight into the step's input buffer, the
    captured kernels are replayed with the position bound, and the output is copied out of its buffer after one
    synchronisation. Same kernels, same buffers, so the same bits as ``TinyJit.__call__`` + ``Tensor.numpy()``.

    What it saves is a fixed cost per call, which a chain pays once per stage and the unsplit model once per token:
    TinyJit's argument analysis (UOp substitutions on every call), ``Buffer.copyin``, and ``Tensor.numpy()``, which
    schedules a (no-op) realize on the calling thread while holding the GIL that tinygrad's CPU worker thread needs
    to start the kernels just queued (on this machine 0.3-1 ms of a 2-block slice's step)."""

    def __init__(self, model: ModelSlice, inputs: NDArray[Any], outputs: NDArray[Any], in_buf: Buffer) -> None:
        from tinygrad.device import Device

        captured = model._jit.captured
        assert captured is not None
        self._captured, self._in, self._out, self._in_buf = captured, inputs, outputs, in_buf
        self._sync: Callable[[], None] = Device[in_buf.device].synchronize
        self._var: str = model._pos.expr
        self._last, self._shape = model.last, (1, 1, model.config.dim)
        ret = captured.ret
        self._taps = list(ret[1:]) if isinstance(ret, tuple) else []  # with taps: every block's output tensor

    @staticmethod
    def of(model: ModelSlice) -> _DirectStep | None:
        """The lean call of ``model``'s captured decode step, or None where it does not apply (another device, a
        step whose input or output is not a whole host-mapped buffer)."""
        captured = model._jit.captured
        if captured is None or model._decode_in is None or model.config.moe:
            return None
        from tinygrad.dtype import _to_np_dtype

        try:
            out = captured.ret[0] if isinstance(captured.ret, tuple) else captured.ret
            in_buf = cast("Buffer", model._decode_in.uop.base.realized)
            out_buf = cast("Buffer", out.uop.base.realized)
            if in_buf is None or out_buf is None or in_buf.device != "CPU" or out_buf.device != "CPU":
                return None
            if out.uop is not out.uop.base and out.uop.base.realized is not out_buf:
                return None
            want_in = (np.int32, 1) if model.first else (np.float16, model.config.dim)
            want_out = (np.int32, 1) if model.last else (np.float16, model.config.dim)
            if any(_to_np_dtype(b.dtype) is not w[0] for b, w in ((in_buf, want_in), (out_buf, want_out))):
                return None
            in_view = np.frombuffer(in_buf.as_buffer(force_zero_copy=True), dtype=want_in[0])
            out_view = np.frombuffer(out_buf.as_buffer(force_zero_copy=True), dtype=want_out[0])
        except (AssertionError, AttributeError, TypeError, ValueError):
            return None
        if in_view.size != want_in[1] or out_view.size != want_out[1] or in_buf.offset or out_buf.offset:
            return None
        return _DirectStep(model, in_view, out_view, in_buf)

    def __call__(self, x: NDArray[Any], position: int) -> NDArray[np.float16] | int:
        self._sync()  # nothing may still read the input buffer (a no-op after the last step)
        self._in[:] = x.reshape(-1)
        self._captured([self._in_buf], {self._var: position})
        self._sync()
        if self._last:
            return int(self._out[0])
        return self._out.copy().reshape(self._shape)

    @property
    def taps(self) -> list[Tensor]:
        return self._taps


def _on_cpu(device: str | tuple[str, ...]) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "CPU"


def _decode_context(device: str | tuple[str, ...]) -> Any:
    """What the decode step compiles under: on the CPU, tinygrad's vector code left to the C compiler
    (``DEVECTORIZE=0``), which turns ``_DecodeLinear``'s upcast rows into AVX vectors and fp16 loads into packed
    conversions instead of scalar code (about 3x fewer kernel cycles on ``synthetic:small``). Compile-time only: a
    replayed step runs what was compiled, and tinygrad keys its kernel cache by this setting."""
    import contextlib

    from tinygrad.helpers import Context

    return cast(Any, Context)(DEVECTORIZE=0) if _on_cpu(device) else contextlib.nullcontext()  # Context is unannotated


class _DecodeLinear:
    """``nn.Linear`` (same ``weight``/``bias`` names, so the same state dict) whose one-position product, a decode
    step's matrix-vector product, is a kernel of its own on the CPU with fixed optimisations: the output rows upcast
    by the largest of 16, 8, 4, 2 that divides them, each row's sum left in input order. tinygrad's heuristic leaves a
    matrix-vector product of fewer than 1024 rows one dependent chain of additions, and BEAM would pick by timing,
    which can differ between processes and machines; fixed options keep a block's kernels the same in every slice,
    process and machine. Other devices and prefills (more than one position) keep tinygrad's own choice."""

    def __init__(self, linear: Any):
        self.weight: Tensor = linear.weight
        self.bias: Tensor | None = linear.bias

    def __call__(self, x: Tensor) -> Tensor:
        from tinygrad.codegen.opt import Opt, OptOps

        y = x.linear(self.weight.transpose(), self.bias)
        rows = int(self.weight.shape[0])
        upcast = next((n for n in (16, 8, 4, 2) if rows % n == 0), 0)
        if x.shape[-2] != 1 or not upcast or not _on_cpu(self.weight.device):
            return y
        # the kernel's axes: 0 the output rows, then the reduction over the input
        return y.contiguous(arg=(Opt(OptOps.UPCAST, 0, upcast),))


@functools.cache
def _block_class() -> type[TransformerBlock]:
    """tinygrad's llama block whose output is an fp16 buffer: the block boundary of the module docstring. Its
    projections are ``_DecodeLinear``s."""
    from tinygrad.apps.llm import TransformerBlock

    class Block(TransformerBlock):
        def __init__(self, *args: Any):
            super().__init__(*args)
            for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
                setattr(self, name, _DecodeLinear(getattr(self, name)))

        def __call__(self, x: Tensor, start_pos: int | UOp) -> Tensor:
            return self._feed_forward(self._attention(x, start_pos)).cast("float16").contiguous()

    return Block


@functools.cache
def _moe_block_class() -> Any:
    """A block of a mixture-of-experts architecture (qwen3moe, qwen2moe): tinygrad's attention (with per-head q/k norm
    or q/k/v biases where the architecture has them); a MoE block computes only its part before the routed experts
    (``pre``), a dense block the whole block with the fp16 boundary."""
    from tinygrad import nn
    from tinygrad.apps.llm import TransformerBlock
    from tinygrad.tensor import Tensor

    class Vector:
        def __init__(self, n: int):
            self.weight = Tensor.zeros(n)

    class MoEBlock(TransformerBlock):
        def __init__(self, cfg: ModelConfig, max_context: int, routed: bool):
            super().__init__(
                cfg.dim,
                cfg.ffn,
                cfg.heads,
                cfg.kv_heads,
                cfg.norm_eps,
                cfg.head_dim,
                cfg.rope_theta,
                max_context,
                qk_norm=cfg.qk_norm,
            )
            self.routed = routed
            if cfg.qkv_bias:
                self.attn_q = nn.Linear(cfg.dim, cfg.heads * cfg.head_dim, bias=True)
                self.attn_k = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=True)
                self.attn_v = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=True)
            if routed:
                del self.ffn_gate, self.ffn_up, self.ffn_down
                self.ffn_gate_inp = nn.Linear(cfg.dim, cfg.experts, bias=False)
                self.shared = bool(cfg.shared_ffn)
                if self.shared:
                    self.ffn_gate_inp_shexp = Vector(cfg.dim)
                    self.ffn_gate_shexp = nn.Linear(cfg.dim, cfg.shared_ffn, bias=False)
                    self.ffn_up_shexp = nn.Linear(cfg.dim, cfg.shared_ffn, bias=False)
                    self.ffn_down_shexp = nn.Linear(cfg.shared_ffn, cfg.dim, bias=False)

        def __call__(self, x: Tensor, start_pos: int | UOp) -> Tensor:
            return self._feed_forward(self._attention(x, start_pos)).cast("float16").contiguous()

        def pre(self, x: Tensor, start_pos: int | UOp) -> tuple[Tensor, ...]:
            """Attention and what precedes the routed experts: the residual (fp32), the normed input of the experts
            (fp16), the router's logits (fp32), and with a shared expert its gated output (fp32)."""
            return self.moe_inputs(self._attention(x, start_pos))

        def moe_inputs(self, h: Tensor) -> tuple[Tensor, ...]:
            """From the residual ``h`` after attention: ``pre``'s outputs."""
            normed = self.ffn_norm(h).cast("float16").contiguous()
            out = [h.float().contiguous(), normed, self.ffn_gate_inp(normed).float().contiguous()]
            if self.shared:
                gate = (normed.float() * self.ffn_gate_inp_shexp.weight.float()).sum(-1, keepdim=True).sigmoid()
                act = cast(Any, self.ffn_gate_shexp(normed)).silu().contiguous()  # silu is unannotated
                y = self.ffn_down_shexp(act * self.ffn_up_shexp(normed))
                out.append((y.float() * gate).contiguous())
            return tuple(out)

    return MoEBlock
