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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
from numpy.typing import NDArray

from ppharness.errors import ModelError

if TYPE_CHECKING:  # tinygrad is imported when a slice is built, not with this module
    from tinygrad.apps.llm import SimpleTokenizer, TransformerBlock
    from tinygrad.device import Buffer
    from tinygrad.engine.realize import ExecItem
    from tinygrad.tensor import Tensor
    from tinygrad.uop.ops import UOp

_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")


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

    @staticmethod
    def from_kv(kv: dict[str, Any], tensor_names: set[str]) -> ModelConfig:
        try:
            arch = kv["general.architecture"]
            if f"{arch}.expert_count" in kv:
                raise ModelError(f"architecture {arch!r} with experts is not supported by this release of ppharness")
            dim, heads = int(kv[f"{arch}.embedding_length"]), int(kv[f"{arch}.attention.head_count"])
            return ModelConfig(
                arch=arch,
                blocks=int(kv[f"{arch}.block_count"]),
                dim=dim,
                ffn=int(kv[f"{arch}.feed_forward_length"]),
                heads=heads,
                kv_heads=int(kv.get(f"{arch}.attention.head_count_kv", heads)),
                head_dim=int(kv.get(f"{arch}.attention.key_length", dim // heads)),
                vocab=len(kv["tokenizer.ggml.tokens"]),
                context=int(kv[f"{arch}.context_length"]),
                rope_theta=float(kv.get(f"{arch}.rope.freq_base", 10000.0)),
                norm_eps=float(kv[f"{arch}.attention.layer_norm_rms_epsilon"]),
                bos_id=int(kv["tokenizer.ggml.bos_token_id"])
                if kv.get("tokenizer.ggml.add_bos_token", True) and "tokenizer.ggml.bos_token_id" in kv
                else None,
                eos_id=int(kv["tokenizer.ggml.eos_token_id"]),
                tied="output.weight" not in tensor_names,
            )
        except KeyError as exc:
            raise ModelError(f"GGUF metadata lacks {exc.args[0]!r}") from None


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

    def tensor(self, name: str) -> NDArray[np.float16]:
        """One tensor as float16 in tinygrad's (out, in) layout; llama Q/K rows reordered for half-split RoPE."""
        import gguf

        try:
            t = self._tensors[name]
        except KeyError:
            raise ModelError(f"{self.path}: tensor {name!r} is missing") from None
        if t.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.F32):
            arr = np.asarray(t.data)
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = arr.reshape(tuple(int(d) for d in reversed(t.shape))).astype(np.float16)
        cfg = self.config
        if cfg.arch == "llama" and (m := _BLK.match(name)) and m.group(2) in ("attn_q.weight", "attn_k.weight"):
            # interleaved -> half-split rotary layout, as tinygrad's Transformer.from_gguf does:
            # (n h two) d -> (n two h) d
            n = cfg.heads if m.group(2) == "attn_q.weight" else cfg.kv_heads
            d = arr.shape[-1]
            arr = arr.reshape(n, -1, 2, d).transpose(0, 2, 1, 3).reshape(-1, d)
        return np.ascontiguousarray(arr)

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
        if m and lo <= int(m.group(1)) < hi:
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
    ):
        from tinygrad import nn
        from tinygrad.engine.jit import TinyJit
        from tinygrad.uop.ops import UOp

        cfg = gguf_file.config
        if not 0 <= lo < hi <= cfg.blocks and not (lo == hi and first and last and cfg.blocks == 0):
            raise ModelError(f"block range [{lo}, {hi}) is not inside the model's {cfg.blocks} blocks")
        self.file, self.config, self.lo, self.hi, self.first, self.last = gguf_file, cfg, lo, hi, first, last
        self.max_context = min(max_context or cfg.context, cfg.context)
        self.taps = taps
        self._tapped: list[Tensor] = []  # with taps: every block's output of the last step (tinygrad tensors)
        self.blk = [
            _block_class()(
                cfg.dim, cfg.ffn, cfg.heads, cfg.kv_heads, cfg.norm_eps, cfg.head_dim, cfg.rope_theta, self.max_context
            )
            for _ in range(hi - lo)
        ]
        if first:
            self.token_embd = nn.Embedding(cfg.vocab, cfg.dim)
        if last:
            self.output_norm = nn.RMSNorm(cfg.dim, cfg.norm_eps)
            self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self._load(gguf_file)
        self._pos = UOp.variable("start_pos", 1, self.max_context - 1)
        self._jit = TinyJit(self._forward)
        self._decode_in: Tensor | None = None  # (1,1) ids or (1,1,D) hidden, reused by every decode step

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

    def _input(self, x: list[int] | NDArray[np.int32] | NDArray[np.float16]) -> Tensor:
        from tinygrad.tensor import Tensor

        if self.first:
            return Tensor([list(x)], dtype="int32")  # (1,T)
        return Tensor(np.ascontiguousarray(x, dtype=np.float16))  # (1,T,D)

    def prefill(self, x: list[int] | NDArray[np.float16]) -> NDArray[np.float16] | int:
        """Run positions [0, T). Ids (first stage) or hidden (1,T,D) in; hidden (1,T,D) or a token id out."""
        return self._output(self._forward(self._input(x), 0))

    def decode(self, x: list[int] | NDArray[np.float16], position: int) -> NDArray[np.float16] | int:
        """Run one position ``position >= 1`` through the compiled decode step.

        The step's input lives in one persistent device buffer that each call overwrites, so a token costs one copy in
        instead of a new tensor (and its allocation) per call.
        """
        if not 1 <= position < self.max_context:
            raise ModelError(f"position {position} is outside the context of {self.max_context}")
        arr = np.asarray(x, dtype=np.int32).reshape(1, 1) if self.first else np.asarray(x, dtype=np.float16)
        if self._decode_in is None:
            self._decode_in = self._input(arr if not self.first else arr[0]).realize()
        else:
            buf = cast("Buffer", self._decode_in.uop.base.realized)  # realized above, on one device
            buf.copyin(np.ascontiguousarray(arr).data.cast("B"))
        return self._output(self._jit(self._decode_in, self._pos.bind(position)))

    def decode_kernels(self) -> list[str]:
        """The source of every kernel the compiled decode step runs, in order, with kernel names left out (they number
        identical kernels apart within one process). Empty before the step is compiled."""
        captured = self._jit.captured
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

        walk(captured.jit_cache if captured is not None else [])
        return out

    def _output(self, out: Tensor | tuple[Tensor, ...]) -> NDArray[np.float16] | int:
        if isinstance(out, tuple):  # with taps: the step's output, then every block's
            out, *self._tapped = out
        return int(out.item()) if self.last else out.numpy()

    def tapped(self) -> dict[int, NDArray[np.float16]]:
        """With ``taps``: block index (in the file) -> its output (1,T,D) at the last prefill or decode step."""
        return {self.lo + i: t.numpy() for i, t in enumerate(self._tapped)}


@functools.cache
def _block_class() -> type[TransformerBlock]:
    """tinygrad's llama block whose output is an fp16 buffer: the block boundary of the module docstring."""
    from tinygrad.apps.llm import TransformerBlock

    class Block(TransformerBlock):
        def __call__(self, x: Tensor, start_pos: int | UOp) -> Tensor:
            return self._feed_forward(self._attention(x, start_pos)).cast("float16").contiguous()

    return Block
