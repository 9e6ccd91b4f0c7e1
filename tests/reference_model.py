"""An independent reference model for the tests: the llama, qwen2, qwen3, qwen3moe and qwen2moe architectures in numpy,
float32, written from their definitions and read from the GGUF file with the ``gguf`` package alone. Nothing here comes
from ``ppharness.model`` or tinygrad: it is what the project's model is checked against
(``tests/test_reference_model.py``).

The definitions, as llama.cpp computes them (``src/llama-model.cpp``: ``llm_build_llama``, ``llm_build_qwen3moe``,
``llm_build_qwen2moe``, ``llama_model_rope_type``; ``src/models/qwen2.cpp``, ``src/models/qwen3.cpp``;
``src/llama-graph.cpp``: ``build_norm``, ``build_ffn``, ``build_moe_ffn``, ``build_attn``; ggml's ``rope`` with its
``freq_factors``), and as HF transformers' ``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM`` and ``Qwen2MoeForCausalLM`` do:

- every block: ``h = x + attention(rmsnorm(x))``, ``out = h + ffn(rmsnorm(h))``; then ``rmsnorm`` with
  ``output_norm`` and the head ``output`` (``token_embd`` when the file ties them). RMS norm:
  ``x / sqrt(mean(x^2) + eps) * w`` with the file's ``attention.layer_norm_rms_epsilon``.
- attention: ``q, k, v`` projections (plus their biases where the file has them: qwen2, qwen2moe; HF's
  ``q_proj``/``k_proj``/``v_proj`` with ``bias=True``, llama.cpp's ``build_qkv`` adding ``wq_b``/``wk_b``/``wv_b``),
  qwen3's and qwen3moe's RMS norm of each head's queries and keys (``attn_q_norm``, ``attn_k_norm``: one weight of
  the head's width, over each head's ``head_dim`` values, HF's ``q_norm``/``k_norm`` on the
  ``(..., heads, head_dim)`` view) before the rotation, the rotary embedding, causal softmax attention with scale
  ``1/sqrt(head_dim)``, query head ``h`` reading key/value head ``h // (heads / kv_heads)`` (grouped-query
  attention: HF's ``repeat_kv``, ggml's broadcast), the output projection from ``heads * head_dim``. ``head_dim`` is
  the file's ``attention.key_length`` where it has one (HF's ``head_dim``: Qwen3-0.6B's 128 with 16 heads in a width
  of 1024), else ``embedding_length / head_count``.
- the rotary embedding: pair ``i`` of a head (``i < n_rot/2``) turns by ``position * base^(-2i/n_rot) / factor_i``,
  ``factor_i`` the file's ``rope_freqs.weight[i]`` (Llama-3's frequency factors; 1 without the tensor): ggml divides
  each pair's angle by its factor. Which coordinates make a pair is the architecture's ``rope_type``: llama is
  ``LLAMA_ROPE_TYPE_NORM``, the pair ``(x[2i], x[2i+1])``; qwen2, qwen3, qwen2moe and qwen3moe are
  ``LLAMA_ROPE_TYPE_NEOX``, the pair ``(x[i], x[i + n_rot/2])``, HF's ``rotate_half`` (their converters store HF's
  rows as they are). A llama GGUF is made that way: llama.cpp's converter permutes HF's query and key rows
  (``LlamaModel.permute``: ``(heads, 2, hd/2) -> (heads, hd/2, 2)``) so that adjacent pairs in the file are HF's
  ``(i, i + hd/2)``; the file's rows are used as they are here (``tests/test_reference_model.py`` checks the
  equivalence with HF's convention on the un-permuted rows).
- dense feed-forward (llama, qwen2, qwen3): ``down(silu(gate x) * up x)``.
- mixture of experts (qwen3moe, qwen2moe; ``build_moe_ffn`` with softmax gating): router logits from
  ``ffn_gate_inp`` (stored F32, used F32), softmax over every expert, the top ``expert_used_count`` (ties to the lower
  index), their probabilities as weights -- renormalised to sum 1 for qwen3moe (``norm_w = true`` in
  ``llm_build_qwen3moe``; HF's ``norm_topk_prob``, true in Qwen3-MoE's configs), not for qwen2moe (``norm_w = false``;
  HF's ``Qwen2MoeConfig.norm_topk_prob`` defaults to false) -- each chosen expert ``down_e(silu(gate_e x) * up_e x)``;
  qwen2moe adds the shared expert ``down_s(silu(gate_s x) * up_s x)`` times ``sigmoid(ffn_gate_inp_shexp . x)``.

Every activation is float32 (the rotation angles are computed in float64 and their cosines and sines rounded to
float32). The forward pass is the whole sequence at once, causal: the logits at position ``t`` are the next-token
logits after ``ids[:t+1]``. Every tensor of the file must be used: a tensor this reference does not know is refused
(as llama.cpp refuses a file with tensors its graph does not take), never silently dropped.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np

if TYPE_CHECKING:
    from numpy.typing import NDArray

F32 = np.float32


@dataclass(frozen=True)
class Arch:
    """What distinguishes the architectures this reference computes."""

    neox: bool  # rotary pairs (i, i + n/2) (NEOX) instead of (2i, 2i+1) (NORM)
    moe: bool  # every block's feed-forward part is a mixture of experts
    renormalise: bool  # top-k weights renormalised to sum 1
    qk_norm: bool  # RMS norm of each head's queries and keys before the rotation
    shared_expert: bool  # a shared expert gated by sigmoid(ffn_gate_inp_shexp . x)
    rope_factors: bool  # reads rope_freqs.weight (llama.cpp's llama graph does; the qwen graphs do not)
    biases: bool = True  # adds the projections' biases where the file has them (every graph here does)


ARCHS = {
    "llama": Arch(neox=False, moe=False, renormalise=False, qk_norm=False, shared_expert=False, rope_factors=True),
    "qwen2": Arch(neox=True, moe=False, renormalise=False, qk_norm=False, shared_expert=False, rope_factors=False),
    "qwen3": Arch(neox=True, moe=False, renormalise=False, qk_norm=True, shared_expert=False, rope_factors=False),
    "qwen3moe": Arch(neox=True, moe=True, renormalise=True, qk_norm=True, shared_expert=False, rope_factors=False),
    "qwen2moe": Arch(neox=True, moe=True, renormalise=False, qk_norm=False, shared_expert=True, rope_factors=False),
}


def rmsnorm(x: NDArray[np.float32], w: NDArray[np.float32], eps: float) -> NDArray[np.float32]:
    return (x / np.sqrt((x * x).mean(-1, keepdims=True) + F32(eps)) * w).astype(F32)


def silu(x: NDArray[np.float32]) -> NDArray[np.float32]:
    return (x / (F32(1) + np.exp(-x))).astype(F32)


def softmax(x: NDArray[np.float32]) -> NDArray[np.float32]:
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(F32)


def rope_angles(positions: NDArray[Any], n_rot: int, base: float, factors: NDArray[Any] | None) -> NDArray[np.float64]:
    """(T, n_rot/2) angles: pair ``i`` at position ``p`` turns by ``p * base^(-2i/n_rot) / factors[i]``."""
    inv_freq = base ** (-np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    if factors is not None:
        inv_freq = inv_freq / np.asarray(factors, dtype=np.float64)
    return np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]


def rope(x: NDArray[np.float32], angles: NDArray[np.float64], neox: bool) -> NDArray[np.float32]:
    """The rotary embedding of ``x`` (T, heads, head_dim) by ``angles`` (T, n_rot/2): the first ``n_rot`` coordinates
    of each head turn in pairs, ``(x[2i], x[2i+1])`` (NORM) or ``(x[i], x[i + n_rot/2])`` (NEOX); the rest pass."""
    half = angles.shape[-1]
    cos, sin = np.cos(angles).astype(F32)[:, None, :], np.sin(angles).astype(F32)[:, None, :]
    out = x.astype(F32).copy()
    if neox:
        a, b = x[..., :half], x[..., half : 2 * half]
        out[..., :half], out[..., half : 2 * half] = a * cos - b * sin, a * sin + b * cos
    else:
        a, b = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2], out[..., 1 : 2 * half : 2] = a * cos - b * sin, a * sin + b * cos
    return out


class ReferenceModel:
    """A GGUF file of an architecture in ``ARCHS``, every weight as float32 (dequantised by ``gguf.quants`` where the
    file stores it quantised), in numpy's (out, in) layout."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        reader = gguf.GGUFReader(str(self.path))
        self.kv: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        self.arch_name = str(self.kv["general.architecture"])
        if self.arch_name not in ARCHS:
            raise ValueError(f"{self.path}: the reference does not compute architecture {self.arch_name!r}")
        self.arch = ARCHS[self.arch_name]
        scaling = str(self.key("rope.scaling.type", "none"))
        if scaling != "none":
            raise ValueError(f"{self.path}: rope scaling {scaling!r} is not in the reference")
        self.dim = int(self.key("embedding_length"))
        self.blocks = int(self.key("block_count"))
        self.heads = int(self.key("attention.head_count"))
        self.kv_heads = int(self.key("attention.head_count_kv", self.heads))
        self.head_dim = int(self.key("attention.key_length", self.dim // self.heads))
        if int(self.key("attention.value_length", self.head_dim)) != self.head_dim:
            raise ValueError(f"{self.path}: key and value widths differ; not in the reference")
        self.n_rot = int(self.key("rope.dimension_count", self.head_dim))
        self.base = float(self.key("rope.freq_base", 10000.0))
        self.eps = float(self.key("attention.layer_norm_rms_epsilon"))
        self.experts = int(self.key("expert_count", 0))
        self.experts_used = int(self.key("expert_used_count", 0))
        self._tensors = {t.name: t for t in reader.tensors}
        self._unused = set(self._tensors)
        self.factors = (
            self.tensor("rope_freqs.weight") if self.arch.rope_factors and self.has("rope_freqs.weight") else None
        )
        if self.factors is not None and self.factors.shape != (self.n_rot // 2,):
            raise ValueError(f"{self.path}: rope_freqs.weight has shape {self.factors.shape}, not ({self.n_rot // 2},)")
        self.token_embd = self.tensor("token_embd.weight")
        self.output_norm = self.tensor("output_norm.weight")
        self.output = self.tensor("output.weight") if self.has("output.weight") else self.token_embd
        self.block_weights = [self._block(i) for i in range(self.blocks)]
        self.routing: dict[int, tuple[NDArray[np.int64], NDArray[np.float32]]] = {}  # of the last forward
        self.follow: dict[int, NDArray[np.int64]] = {}
        self.follow_margin = 0.0
        if self._unused:
            raise ValueError(f"{self.path}: tensors the reference does not use: {sorted(self._unused)[:8]}")

    def key(self, name: str, default: Any = None) -> Any:
        value = self.kv.get(f"{self.arch_name}.{name}", default)
        if value is None:
            raise KeyError(f"{self.path}: metadata {self.arch_name}.{name} is missing")
        return value

    def has(self, name: str) -> bool:
        return name in self._tensors

    def tensor(self, name: str) -> NDArray[np.float32]:
        """A tensor as float32 in numpy's layout (GGUF lists dimensions innermost first)."""
        t = self._tensors[name]
        self._unused.discard(name)
        shape = [int(d) for d in reversed(t.shape)]
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            data = np.asarray(t.data, dtype=F32)
        else:
            data = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).astype(F32)
        return np.ascontiguousarray(data.reshape(shape))

    def _block(self, i: int) -> dict[str, NDArray[np.float32]]:
        names = ["attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight"]
        names += ["attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"]  # where the file has them
        if self.arch.qk_norm:
            names += ["attn_q_norm.weight", "attn_k_norm.weight"]
        names.append("ffn_norm.weight")
        if self.arch.moe:
            names += ["ffn_gate_inp.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"]
            if self.arch.shared_expert:
                names += ["ffn_gate_inp_shexp.weight", "ffn_gate_shexp.weight", "ffn_up_shexp.weight"]
                names.append("ffn_down_shexp.weight")
        else:
            names += ["ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"]
        optional = {"attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_output.bias"}
        out = {}
        for n in names:
            if n in optional and not self.has(f"blk.{i}.{n}"):
                continue
            out[n] = self.tensor(f"blk.{i}.{n}")
        return out

    # --- the forward pass -------------------------------------------------------------------------------------------

    def attention(self, i: int, x: NDArray[np.float32]) -> NDArray[np.float32]:
        """Block ``i``'s attention output (before the residual add) for positions 0..T-1 of the normed input ``x``."""
        w = self.block_weights[i]
        t, hd = x.shape[0], self.head_dim

        def project(name: str, inp: NDArray[np.float32]) -> NDArray[np.float32]:
            y = inp @ w[f"{name}.weight"].T
            return y + w[f"{name}.bias"] if self.arch.biases and f"{name}.bias" in w else y

        q = project("attn_q", x).reshape(t, self.heads, hd)
        k = project("attn_k", x).reshape(t, self.kv_heads, hd)
        v = project("attn_v", x).reshape(t, self.kv_heads, hd)
        if self.arch.qk_norm:
            q, k = rmsnorm(q, w["attn_q_norm.weight"], self.eps), rmsnorm(k, w["attn_k_norm.weight"], self.eps)
        angles = rope_angles(np.arange(t), self.n_rot, self.base, self.factors)
        q, k = rope(q, angles, self.arch.neox), rope(k, angles, self.arch.neox)
        group = self.heads // self.kv_heads
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # query head h reads kv head h // group
        scores = np.einsum("thd,shd->hts", q, k) * F32(1.0 / np.sqrt(hd))
        scores = np.where(np.tril(np.ones((t, t), dtype=bool))[None], scores, F32(-np.inf))
        o = np.einsum("hts,shd->thd", softmax(scores), v).reshape(t, self.heads * hd)
        return project("attn_output", o).astype(F32)

    def route(self, i: int, x: NDArray[np.float32]) -> tuple[NDArray[np.int64], NDArray[np.float32]]:
        """Block ``i``'s routing of the normed rows ``x``: (T, k) expert ids, best first, and their weights.

        Records, per row, the experts it chose and the router-logit gap between the last chosen expert and the first
        left out in ``self.routing[i]``. Where ``self.follow`` gives block ``i`` other experts for a row whose gap is
        below ``self.follow_margin`` (a routing near-tie), those experts are used instead, weighted by their own
        probabilities: the model teacher-forced on another implementation's tie-breaks."""
        logits = (x @ self.block_weights[i]["ffn_gate_inp.weight"].T).astype(F32)
        probs = softmax(logits)
        order = np.argsort(-probs, axis=-1, kind="stable")
        k = self.experts_used
        ids = order[:, :k]
        gap = np.full(len(x), np.inf, dtype=F32)
        if k < self.experts:
            gap = (
                np.take_along_axis(logits, order[:, k - 1 : k], -1)
                - np.take_along_axis(logits, order[:, k:], -1)[:, :1]
            )[:, 0]
        self.routing[i] = (ids, gap)
        if i in self.follow:
            other = self.follow[i][: len(x)]
            differs = np.array([set(a.tolist()) != set(b.tolist()) for a, b in zip(ids, other)])
            ids = np.where((differs & (gap < self.follow_margin))[:, None], other, ids)
        weights = np.take_along_axis(probs, ids, -1)
        if self.arch.renormalise:
            weights = weights / weights.sum(-1, keepdims=True)
        return ids, weights.astype(F32)

    def feed_forward(self, i: int, x: NDArray[np.float32]) -> NDArray[np.float32]:
        """Block ``i``'s feed-forward output (before the residual add) for the normed rows ``x``."""
        w = self.block_weights[i]
        if not self.arch.moe:
            return (silu(x @ w["ffn_gate.weight"].T) * (x @ w["ffn_up.weight"].T)) @ w["ffn_down.weight"].T
        ids, weights = self.route(i, x)
        gate, up, down = w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"], w["ffn_down_exps.weight"]
        out = np.zeros_like(x)
        for e in np.unique(ids):
            rows, slot = np.nonzero(ids == e)
            xe = x[rows]
            y = (silu(xe @ gate[e].T) * (xe @ up[e].T)) @ down[e].T
            out[rows] += weights[rows, slot][:, None] * y
        if self.arch.shared_expert:
            gate_in = 1 / (1 + np.exp(-(x @ w["ffn_gate_inp_shexp.weight"].reshape(-1))))  # (T,)
            y = (silu(x @ w["ffn_gate_shexp.weight"].T) * (x @ w["ffn_up_shexp.weight"].T)) @ w[
                "ffn_down_shexp.weight"
            ].T
            out += gate_in[:, None].astype(F32) * y
        return out.astype(F32)

    def forward(
        self,
        ids: list[int] | NDArray[Any],
        follow: dict[int, NDArray[np.int64]] | None = None,
        margin: float = 0.0,
    ) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """The sequence ``ids`` from position 0, causal: (the last block's output (T, D), the logits (T, vocab)); a
        MoE model's own routing of every position in ``self.routing`` (block -> (ids (T, k), gaps (T,))). ``follow``
        (block -> (T, k) experts) is another implementation's routing, taken where the reference's gap is below
        ``margin``."""
        self.follow_margin = margin
        self.routing = {}
        self.follow = dict(follow or {})
        h = self.token_embd[np.asarray(ids, dtype=np.int64)].astype(F32)
        for i in range(self.blocks):
            w = self.block_weights[i]
            h = h + self.attention(i, rmsnorm(h, w["attn_norm.weight"], self.eps))
            h = h + self.feed_forward(i, rmsnorm(h, w["ffn_norm.weight"], self.eps))
        logits = rmsnorm(h, self.output_norm, self.eps) @ self.output.T
        return h.astype(F32), logits.astype(F32)

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """The reference's own greedy continuation of ``ids``: ``n`` tokens, the whole sequence recomputed each step."""
        seq = list(ids)
        for _ in range(n):
            seq.append(int(self.forward(seq)[1][-1].argmax()))
        return seq[len(ids) :]
