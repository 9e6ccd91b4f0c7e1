"""A stage's share of a llama-family GGUF model, on tinygrad: ``ModelSlice``. Its blocks are its architecture's
(``ppharness.model.arch``); this module computes any of them.

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

import contextlib
import functools
import math
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError
from ppharness.model.engine import hidden
from ppharness.model.engine.batched import BatchedRows
from ppharness.model.engine.direct import DirectStep
from ppharness.model.engine.expert_bank import ExpertBank, all_experts
from ppharness.model.engine.prefill import Prefill
from ppharness.model.formats.packed import Packed, PackedEmbedding
from ppharness.model.gguf.names import BLOCK_TENSOR
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers import moe
from ppharness.model.layers.kernels import kernel_sources, pin_from_env
from ppharness.model.layers.linear import DecodeLinear, decode_context, on_cpu
from ppharness.model.layers.moe import ExpertCall, Routing, combine_on_device, combine_rows, route_on_device
from ppharness.model.layers.rows import Rows, widths

if TYPE_CHECKING:  # tinygrad is imported when a slice is built, not with this module
    from collections.abc import Generator, Iterable, Mapping

    from tinygrad.device import Buffer
    from tinygrad.engine.jit import TinyJit
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

R = TypeVar("R")  # what a driven step returns

# how a slice holds a matrix the file stores quantised or as BF16: as the file packs it, unpacked inside the kernel
# that reads it (``ppharness.model.formats.packed``), or dequantised to float16 at load (the engine's former way, kept
# to measure against; F16 and F32 matrices are float16 either way)
WEIGHTS = ("packed", "f16")


def _local_name(name: str, lo: int) -> str:
    """A file tensor name -> the slice's attribute path: ``blk.{lo+i}.x`` -> ``blk.{i}.x``; others unchanged."""
    m = BLOCK_TENSOR.match(name)
    return f"blk.{int(m.group(1)) - lo}.{m.group(2)}" if m else name


def _file_name(local: str, lo: int) -> str:
    """The inverse of ``_local_name``."""
    m = BLOCK_TENSOR.match(local)
    return f"blk.{int(m.group(1)) + lo}.{m.group(2)}" if m else local


def owned_tensors(names: list[str], lo: int, hi: int, first: bool, last: bool, tied: bool) -> dict[str, str]:
    """{slice name: file name} for what a stage holding blocks [lo, hi) loads."""
    out: dict[str, str] = {}
    for name in names:
        m = BLOCK_TENSOR.match(name)
        if m and lo <= int(m.group(1)) < hi and not m.group(2).endswith("_exps.weight"):  # routed experts: a bank's
            out[_local_name(name, lo)] = name
    if first:
        out["token_embd.weight"] = "token_embd.weight"
    if last:
        out["output_norm.weight"] = "output_norm.weight"
        out["output.weight"] = "token_embd.weight" if tied else "output.weight"
    return out


class ModelSlice(BatchedRows):
    """Blocks [lo, hi) of a model, plus the embedding when ``first`` and the final norm and head when ``last``.

    ``prefill(x, 0)`` and ``decode(x, pos)`` take token ids (first stage) or a hidden state, and return a hidden state
    (1, T, D) as fp16 numpy, or, on the last stage, the greedy next token id.

    A mixture-of-experts slice that holds every routed expert of its blocks (``experts`` None, the default) decodes
    like a dense one, in one compiled device step: each MoE block routes on the device, reads its chosen experts by
    id and combines them there, with no host round trip (``fused``). Its prefill, a batched slice's rows, and a slice
    whose experts live on other nodes run block by block: ``step(x, position)`` is a generator that yields an
    ``ExpertCall`` at each MoE block (the routing the device computed) and takes back the chosen experts' outputs, so
    that a stage can send them to the expert nodes that hold them; ``prefill``/``decode`` answer every call from the
    experts the slice holds. Both ways run the same kernels for a block (``_moe_block``), so they give the same bits;
    ``fused=False`` keeps a slice on the generator (to watch its routing).

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
        batched: bool = False,
        weights: str = "packed",
        fused: bool = True,
    ):
        from tinygrad import nn
        from tinygrad.engine.jit import TinyJit
        from tinygrad.tensor import Tensor
        from tinygrad.uop.ops import UOp

        pin_from_env()  # a kernel table named by PPHARNESS_KERNELS: every process compiles the same kernels
        cfg = gguf_file.config
        if not 0 <= lo < hi <= cfg.blocks and not (lo == hi and first and last and cfg.blocks == 0):
            raise ModelError(f"block range [{lo}, {hi}) is not inside the model's {cfg.blocks} blocks")
        self.file, self.config, self.lo, self.hi, self.first, self.last = gguf_file, cfg, lo, hi, first, last
        self.moe = cfg.moe  # its blocks route experts
        if weights not in WEIGHTS:
            raise ModelError(f"weights {weights!r}: expected one of {', '.join(WEIGHTS)}")
        self.weights = weights
        self.max_context = min(max_context or cfg.context, cfg.context)
        if slots < 1:
            raise ModelError(f"a slice needs at least one request slot, not {slots}")
        self.slots, self._slot = slots, 0
        # batched: decode steps run several slots' rows at once with batch-invariant kernels
        # (ppharness.model.layers.rows); each block keeps every slot's KV cache in one tensor, and a prefill computes in
        # the scratch slot and is copied into its slot's region
        self.batched = batched
        # the KV caches of the slots not in use, and (the last one) of the prefill's scratch slot
        self._caches: list[list[Tensor | None]] = [[] for _ in range(slots + 1)]
        self.taps = taps
        self._tapped: list[Tensor] = []  # with taps: every block's output of the last step (tinygrad tensors)
        self.architecture = arch = gguf_file.architecture
        self.blk = [arch.block(cfg, self.max_context, lo + i) for i in range(hi - lo)]
        if first:
            self.token_embd = nn.Embedding(cfg.vocab, cfg.dim)
        if last:
            self.output_norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = DecodeLinear(nn.Linear(cfg.dim, cfg.vocab, bias=False))
        self._load(gguf_file)
        self._pos = UOp.variable("start_pos", 1, self.max_context - 1)
        self._jits = [TinyJit(self._forward) for _ in range(slots)]
        # the prefill: chunks of one size through one compiled step (``ppharness.model.engine.prefill``), in a scratch
        # slot of its own whose cache is then copied byte for byte into the request's slot, so that it serves every slot
        self._prefill = Prefill(self)
        self._decode_in: Tensor | None = None  # (1,1) ids or (1,1,D) hidden, reused by every decode step
        self.device_out = False  # decode outputs left on the device for a co-located next stage (hidden.left_on_device)
        self._directs: list[DirectStep | Literal[False] | None] = [
            None
        ] * slots  # each slot's lean call (None: not yet)
        # mixture of experts: the routed experts held here, one compiled step per block and one for the head, each
        # with its persistent decode input
        self.bank = ExpertBank(gguf_file, all_experts(gguf_file, lo, hi) if experts is None else experts, weights)
        self.n_params += self.bank.n_params
        self.weight_bytes += self.bank.weight_bytes
        self._slot_steps = [
            [TinyJit(functools.partial(self._segment, i)) for i in range(hi - lo)] if cfg.moe else []
            for _ in range(slots)
        ]
        # the routers' selection biases (deepseek2's exp_probs_b), float32 as the file stores them
        bias = arch.router_bias
        self._bias = {
            lo + i: gguf_file.vector(f"blk.{lo + i}.{bias}")
            for i in range(hi - lo)
            if bias and gguf_file.has(f"blk.{lo + i}.{bias}")
        }
        self._bias_t = {layer: Tensor(b).realize() for layer, b in self._bias.items()}  # the same, on the device
        # a slice holding every expert of its MoE blocks decodes each in one device step, experts and all (``fused``)
        whole = all(self.bank.whole(lo + i, cfg.experts) for i in range(hi - lo) if lo + i in cfg.moe_blocks)
        self.fused = fused and cfg.moe and not batched and whole
        self._head_jit = TinyJit(self._head)
        self._inputs: dict[int, Tensor] = {}
        # batched: one compiled step per batch width (and, for a MoE slice, one per block and width), with the step's
        # persistent inputs (rows, positions) per width and the batch's length variable
        self._length = UOp.variable("length", 1, self.max_context)
        self._row_jits = {w: TinyJit(self._forward_rows) for w in widths(slots)} if batched else {}
        self._row_steps = (
            {w: [TinyJit(functools.partial(self._segment_rows, i)) for i in range(hi - lo)] for w in widths(slots)}
            if batched and cfg.moe
            else {}
        )
        self._row_heads = {w: TinyJit(self._head) for w in widths(slots)} if batched and cfg.moe else {}
        self._row_in: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self._tapped_np: dict[int, NDArray[np.float16]] = {}

    def _load(self, f: GGUFFile) -> None:
        from tinygrad import nn
        from tinygrad.tensor import Tensor

        owned = owned_tensors(f.names(), self.lo, self.hi, self.first, self.last, self.config.tied)
        # every parameter fp16, but those the architecture computes with in fp32 (a MoE block's router and its norm)
        f32 = {local for local, name in owned.items() if self.architecture.keeps_f32(self.config, name)}
        packed = self._load_packed(f, owned, f32) if self.weights == "packed" else {}
        state = {
            local: Tensor(f.tensor_f32(name) if local in f32 else f.tensor(name))
            for local, name in owned.items()
            if local not in packed
        }
        expected = nn.state.get_state_dict(self)
        missing = sorted(_file_name(k, self.lo) for k in set(expected) - set(state))
        if missing:
            raise ModelError(f"{f.path}: blocks [{self.lo}, {self.hi}) need tensors the file lacks: {missing[:5]}")
        bias = self.architecture.router_bias  # read apart, in float32 (``self._bias``)
        unused = sorted(owned[k] for k in set(state) - set(expected) if not (bias and k.endswith(bias)))
        if unused:  # a tensor the architecture declares (``support.check_file``) but its blocks do not compute with
            raise ModelError(f"{f.path}: blocks [{self.lo}, {self.hi}) do not compute with tensors {unused[:5]}")
        for local, t in state.items():
            if local in expected and expected[local].shape != t.shape:
                raise ModelError(
                    f"{f.path}: tensor {owned[local]!r} has shape {t.shape}, the model needs {expected[local].shape}"
                )
        nn.state.load_state_dict(self, {k: v for k, v in state.items() if k in expected}, verbose=False, realize=False)
        params = nn.state.get_state_dict(self)
        for local, p in params.items():
            p.replace(p.cast("float32" if local in f32 else "float16").contiguous())
        Tensor.realize(*params.values())
        # what this stage holds, each file tensor once; a tied head on a stage without the embedding is reported apart
        sizes = {name: math.prod(int(d) for d in state[local].shape) for local, name in owned.items() if local in state}
        sizes |= {owned[local]: math.prod(p.shape) for local, p in packed.items()}
        self.n_params = sum(sizes.values())
        self.tied_params = sizes["token_embd.weight"] if self.last and self.config.tied and not self.first else 0
        self.n_params -= self.tied_params
        held = {owned[local]: p.nbytes for local, p in packed.items()}
        held |= {owned[k]: v.nbytes() for k, v in params.items() if k in owned}
        self.weight_bytes = sum(held.values())  # the device bytes of this slice's weights, each file tensor once

    def _load_packed(self, f: GGUFFile, owned: dict[str, str], f32: set[str]) -> dict[str, Packed]:
        """Every owned matrix the file stores in a packed type (``ppharness.model.formats.packed``) that a projection or
        the embedding reads, loaded as it is packed and put in place of the module's float16 weight; {local name:
        Packed}. A tied head shares the embedding's bytes."""
        from tinygrad import nn

        out: dict[str, Packed] = {}
        loaded: dict[str, Packed] = {}
        for local, name in owned.items():
            if local in f32 or not local.endswith(".weight"):
                continue
            path = local.split(".")[:-1]
            parent, module = self._module(path[:-1]), self._module(path)
            if not isinstance(module, (nn.Linear, DecodeLinear, nn.Embedding)):
                continue  # read whole by its block (deepseek2's per-head k_b / v_b): held as float16
            packed = loaded.get(name) or f.packed(name)
            if packed is None:
                continue
            loaded[name] = out[local] = packed
            if isinstance(module, nn.Embedding):
                module = PackedEmbedding(packed)
            else:
                module = module if isinstance(module, DecodeLinear) else DecodeLinear(module)
                module.weight = packed
            if isinstance(parent, list):
                parent[int(path[-1])] = module
            else:
                setattr(parent, path[-1], module)
        return out

    def _module(self, path: list[str]) -> Any:
        """The object at a state-dict path's parts (``blk.0.attn_q`` -> ``self.blk[0].attn_q``)."""
        obj: Any = self
        for part in path:
            obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part)
        return obj

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

    def _forward_rows(self, x: Tensor, pos: Tensor, length: UOp) -> Tensor | tuple[Tensor, ...]:
        """The slice's batched decode step: (W,1) ids or (W,1,D) hidden rows, row r in slot r at ``pos[r]``."""
        return self._forward(x, Rows(pos, length))

    def _segment_rows(self, i: int, x: Tensor, pos: Tensor, length: UOp) -> tuple[Tensor, ...]:
        return self._segment(i, x, Rows(pos, length))

    def _forward(self, x: Tensor, start_pos: int | UOp | Rows) -> Tensor | tuple[Tensor, ...]:
        """The slice's step: (B,T) ids or a (B,T,D) fp16 hidden state in; a hidden state, or token ids on the last
        stage, out (with ``taps``, followed by every block's output)."""
        taps = []
        if self.first:
            x = self.token_embd(x).cast("float16").contiguous()  # (B,T) ids -> (B,T,D); a boundary like any other
        for i, block in enumerate(self.blk):
            # (B,T,D) fp16, a buffer of its own; a MoE block's routed experts computed here too (``fused``)
            x = self._moe_block(i, x, start_pos) if getattr(block, "routed", False) else block(x, start_pos)
            taps.append(x)
        out = self.output(self.output_norm(x))[:, -1, :].argmax(-1) if self.last else x  # (B,) or (B,T,D)
        return (out, *taps) if self.taps else out

    def _segment(self, i: int, x: Tensor, start_pos: int | UOp | Rows) -> tuple[Tensor, ...]:
        """Block ``i`` of the slice (the embedding first on the first stage's block 0): a dense block's fp16 output,
        or a MoE block's part before its routed experts (``MoEBlock.pre``)."""
        if self.first and i == 0:
            x = self.token_embd(x).cast("float16").contiguous()
        block = self.blk[i]
        if getattr(block, "routed", False):
            return self._routed_pre(i, x, start_pos)
        return (block(x, start_pos),)

    def _routed_pre(self, i: int, x: Tensor, start_pos: int | UOp | Rows) -> tuple[Tensor, ...]:
        """A MoE block up to its routed experts, routing included: the residual (fp32), the experts' normed input
        (fp16), the router's logits (fp32), the chosen experts (int32) and their weights (fp32), then the shared
        experts' output (fp32) where there are some; each (B,T,...), a buffer of its own."""
        cfg = self.config
        residual, half, logits, *shared = cast(Any, self.blk[i]).pre(x, start_pos)
        ids, weights = route_on_device(
            logits.reshape(-1, cfg.experts),
            cfg.experts_used,
            cfg.norm_topk,
            gating=cfg.gating,
            bias=self._bias_t.get(self.lo + i),
            groups=cfg.expert_groups,
            groups_used=cfg.groups_used,
            scale=cfg.routed_scale,
        )
        lead = tuple(int(d) for d in logits.shape[:-1])
        return (residual, half, logits, ids.reshape(*lead, -1), weights.reshape(*lead, -1), *shared)

    def _moe_block(self, i: int, x: Tensor, start_pos: int | UOp | Rows) -> Tensor:
        """MoE block ``i`` at one decode position in one device step (a ``fused`` slice): its part before the
        routed experts and the routing (``_routed_pre``), the chosen experts by the bank's own step
        (``ExpertBank.rows``, their slots computed on the device) and the combine (``combine_on_device``): the
        kernels that the block's generator step (``step``) runs in pieces, so the two give the same bits."""
        cfg = self.config
        d, k = cfg.dim, cfg.experts_used
        residual, half, _, ids, weights, *shared = self._routed_pre(i, x, start_pos)
        outs = self.bank.rows(self.lo + i, half.reshape(1, d), ids.reshape(k)).reshape(1, k, d)  # slot e: expert e
        gated = shared[0].reshape(1, d) if shared else None
        return combine_on_device(residual.reshape(1, d), outs, weights.reshape(1, k), gated).reshape(1, 1, d)

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
        cfg = self.config
        self.use(slot)
        self._tapped = []
        h: NDArray[Any] = (
            np.asarray(x, dtype=np.int32).reshape(1, -1) if self.first else np.asarray(x, dtype=np.float16)
        )
        for i, block in enumerate(self.blk):
            outs = self._run(i, h, position)
            if getattr(block, "routed", False):
                residual, normed, logits, ids, weights, *shared = outs
                t, k = residual.shape[1], cfg.experts_used
                routing = moe.routed(
                    self.lo + i,
                    logits.reshape(t, cfg.experts),
                    Routing(ids=ids.reshape(t, k).astype(np.int64), weights=weights.reshape(t, k)),
                )
                got = yield ExpertCall(layer=self.lo + i, hidden=normed.reshape(t, cfg.dim), routing=routing)
                self.use(slot)  # whoever answered the call may have computed in another slot meanwhile
                gated = shared[0].reshape(t, cfg.dim) if shared else None
                h = combine_rows(residual.reshape(t, cfg.dim), got, routing.weights, gated).reshape(1, t, cfg.dim)
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

    def _answered(self, gen: Generator[ExpertCall, NDArray[np.float16], R], stand_in: bool = False) -> R:
        """What a MoE step (``step``, ``prefill_step``, ``rows_step``) returns, its expert calls answered from the
        experts this slice holds (``stand_in``: as ``answer``'s)."""
        try:
            call = next(gen)
            while True:
                call = gen.send(self.answer(call, stand_in))
        except StopIteration as stop:
            out: R = stop.value
            return out

    def _moe_step(
        self, x: list[int] | NDArray[np.float16], position: int, stand_in: bool = False
    ) -> NDArray[np.float16] | int:
        return self._answered(self.step(x, position, self._slot), stand_in)

    def warm(self, x: list[int] | NDArray[np.float16], position: int, slot: int = 0) -> None:
        """One step to compile it before the first request; a MoE slice stands zeros in for experts held
        elsewhere (what it computes is thrown away)."""
        self.use(slot)
        if self.batched and position > 0:
            self.decode_rows([x], [position], [slot], stand_in=self.moe)
        elif self.batched and self.moe:
            self.use(self.slots)
            self._moe_step(x, 0, stand_in=True)
            self._store(slot)
        elif self.moe and not (self.fused and position > 0):
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
        if self.moe:
            return self._answered(self.prefill_step(x, slot))
        from tinygrad.tensor import Tensor

        self.use(self.slots)  # the chunks compute in the scratch slot
        out: NDArray[np.float16] | int
        out, taps = self._prefill.run(x)
        self._tapped, self._tapped_np = [], {self.lo + i: t for i, t in enumerate(taps)}
        if self.batched:
            self._store(slot)
            return out
        scratch = [cast("Tensor", b.cache_kv) for b in self.blk]
        self.use(slot)
        for block, src in zip(self.blk, scratch, strict=True):
            if not hasattr(block, "cache_kv"):  # the slot's first request: a cache of its own, like the scratch one
                block.cache_kv = Tensor.zeros(*src.shape, dtype=src.dtype, device=src.device).contiguous().realize()
            dst = cast("Buffer", block.cache_kv.uop.base.realized)
            dst.copyin(cast("Buffer", src.uop.base.realized).as_buffer())
        return out

    def warm_prefill(self, length: int) -> bool:
        """Compile and capture the prefill chunk step before a prompt comes, in the scratch slot only: no request's
        cache is touched (``ppharness.model.engine.prefill``: one step serves every prompt length). False where there is
        nothing to warm (a mixture-of-experts slice, whose prefill is not one captured step, or a length outside the
        context)."""
        if self.moe or not 0 < length < self.max_context:
            return False
        if not self._prefill.compiled:
            previous = self._slot
            self.use(self.slots)
            self._prefill.warm()
            self.use(previous)
        return True

    def decode(
        self, x: list[int] | NDArray[np.float16] | Tensor, position: int, slot: int = 0
    ) -> NDArray[np.float16] | Tensor | int:
        """Run one position ``position >= 1`` of request slot ``slot`` through the compiled decode step.

        The step's input lives in one persistent device buffer that each call overwrites, so a token costs one copy in
        instead of a new tensor (and its allocation) per call. ``x`` may be a co-located stage's output left on the
        device, and with ``device_out`` the output stays there too (``ppharness.model.engine.hidden``).
        """
        if not 1 <= position < self.max_context:
            raise ModelError(f"position {position} is outside the context of {self.max_context}")
        if hidden.left_on_device(x):  # a co-located stage's output, left on its device
            if self.batched or (self.moe and not self.fused) or self._decode_in is None:
                return self.decode(x.numpy(), position, slot)
            self.use(slot)
            hidden.copy(self._decode_in, x)
            with decode_context(self._decode_in.device) if not self.moe else contextlib.nullcontext():
                return self._output(self._jit(self._decode_in, self._pos.bind(position)))
        if self.batched:  # one request is a batch of one row: the same kernels as in any batch
            return self.decode_rows([x], [position], [slot])[0]
        self.use(slot)
        if self.moe and not self.fused:
            return self._moe_step(x, position)
        arr = np.asarray(x, dtype=np.int32).reshape(1, 1) if self.first else np.asarray(x, dtype=np.float16)
        direct = self._directs[slot]
        if direct is None and self._jit.captured is not None:
            lean = (
                None
                if self.moe and not self.fused
                else DirectStep.of(
                    self._jit.captured, self._decode_in, self._pos.expr, self.first, self.last, self.config.dim
                )
            )
            direct = self._directs[slot] = lean or False
        self._tapped_np = {}  # a fused MoE step's taps are its tensors' (``tapped``)
        if direct:
            out = direct(arr, position)
            self._tapped = direct.taps
            return out
        if self._decode_in is None:
            self._decode_in = self._input(arr if not self.first else arr[0]).realize()
        else:
            buf = cast("Buffer", self._decode_in.uop.base.realized)  # realized above, on one device
            buf.copyin(np.ascontiguousarray(arr).data.cast("B"))
        # a MoE slice's step compiles as its generator step's pieces (and every expert bank) do: without the CPU's
        # decode setting, so that both give the same bits
        with decode_context(self._decode_in.device) if not self.moe else contextlib.nullcontext():
            return self._output(self._jit(self._decode_in, self._pos.bind(position)))

    def decode_kernels(self) -> list[str]:
        """The source of every kernel the compiled decode step (blocks, then the head on the last stage) runs, in order,
        with kernel names left out (they number identical kernels apart within one process). Empty before the step is
        compiled. The expert bank's step is apart: ``bank_kernels``."""
        return kernel_sources([self._jits[0], *self._slot_steps[0], self._head_jit])

    def bank_kernels(self) -> list[str]:
        """The kernels of this slice's expert bank step (the same code for every MoE block: the first block's that ran;
        empty where none ran)."""
        steps = [jit for _, jit in sorted(self.bank._jits.items()) if jit.captured is not None]
        return kernel_sources(steps[:1])  # every block's step is the same code

    def _output(self, out: Tensor | tuple[Tensor, ...]) -> NDArray[np.float16] | Tensor | int:
        if isinstance(out, tuple):  # with taps: the step's output, then every block's
            out, *self._tapped = out
        if self.last:
            return int(out.item())
        kept = self.device_out and not on_cpu(out.device)  # ppharness.model.engine.hidden (CPU buffers are host memory)
        return out if kept else out.numpy()

    def tapped(self) -> dict[int, NDArray[np.float16]]:
        """With ``taps``: block index (in the file) -> its output (1,T,D) at the last prefill or decode step."""
        if self._tapped_np:  # a MoE step run in pieces (``step``)
            return dict(self._tapped_np)
        return {self.lo + i: t.numpy() for i, t in enumerate(self._tapped)}
