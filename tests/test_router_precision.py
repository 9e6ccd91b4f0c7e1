"""The router in fp32 (``Architecture.f32_tensors``), as llama.cpp and HF route: the logits a stage routes on the device
at every MoE block and every step of a generation, against the same logits computed in numpy from the file's F32 weights
(read with ``gguf`` alone), for qwen3moe, qwen2moe and deepseek2 (``kimi-tiny`` cut to 3 blocks: 384 experts, 8 per
token); the experts chosen from them; and qwen2moe's shared-expert gate, ``sigmoid(ffn_gate_inp_shexp . x)``.

The reference is exact (float64 from the stored float32 values): ``x = rmsnorm(h) * ffn_norm`` from the residual ``h``
the stage computed, each logit ``x . w_e`` with ``w_e`` a row of ``ffn_gate_inp``. The tolerance is a dot product's
rounding bound: ``|ours - exact| <= 1e-5 * sum_i |x_i w_ei|``. float32 arithmetic at these widths stays within 4e-7
of that sum; a router whose weights or input are rounded to fp16 is off by 3e-4 of it and more, and over a generation
on ``kimi-tiny`` it chooses other experts than the exact logits do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import gguf
import numpy as np
import pytest

from ppharness.model.arch import of_config
from ppharness.model.engine import slicing
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers import moe
from ppharness.model.layers.moe import Routing, route
from ppharness.model.sources.files import synthetic_path
from ppharness.model.synthetic.spec import parse_synthetic

if TYPE_CHECKING:
    from numpy.typing import NDArray

MAX_CONTEXT = 128
PROMPT = "Kimi K2 routes every token to eight of its 384 experts, and one shared expert. Héllo wörld."
DECODE_STEPS = 40
TOLERANCE = 1e-5  # of sum_i |x_i w_i|, for a logit sum_i x_i w_i
PRESETS = ["tiny-moe", "tiny-moe-shared", "tiny-deepseek", "kimi-tiny,blocks=3"]
F64 = np.float64


def model_file(preset: str) -> GGUFFile:
    return GGUFFile(synthetic_path(parse_synthetic(f"synthetic:{preset}")))


class Stored:
    """A GGUF file's F32 tensors and RMS norm epsilon, read with ``gguf`` alone."""

    def __init__(self, f: GGUFFile):
        reader = gguf.GGUFReader(str(f.path))
        self.tensors = {t.name: t for t in reader.tensors}
        arch = reader.fields["general.architecture"].contents()
        self.eps = float(reader.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents())

    def __call__(self, name: str) -> NDArray[np.float64]:
        """An F32 tensor's stored values, numpy (out, in) layout."""
        t = self.tensors[name]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32, f"{name} is stored as {t.tensor_type.name}, not F32"
        return np.asarray(t.data, dtype=F64).reshape([int(d) for d in reversed(t.shape)])

    def normed(self, layer: int, h: NDArray[Any]) -> NDArray[np.float64]:
        """Block ``layer``'s normed feed-forward input from its residual ``h`` (T, D)."""
        h = h.astype(F64)
        out: NDArray[np.float64] = h / np.sqrt((h * h).mean(-1, keepdims=True) + self.eps)
        return out * self(f"blk.{layer}.ffn_norm.weight")


def within(ours: NDArray[Any], x: NDArray[np.float64], w: NDArray[np.float64]) -> float:
    """How far the logits ``ours`` (T, E) are from the exact ``x @ w.T``, in units of the tolerance: <= 1 agrees."""
    return float((np.abs(ours.astype(F64) - x @ w.T) / (TOLERANCE * (np.abs(x) @ np.abs(w).T))).max())


@dataclass(frozen=True)
class Routed:
    """One MoE block at one step, as the stage computed it: the logits it gave ``route``, the routing, and the
    residual it gave ``combine``."""

    layer: int
    logits: NDArray[np.float32]
    routing: Routing
    residual: NDArray[np.float32]
    route_args: tuple[tuple[Any, ...], dict[str, Any]]


_generations: dict[str, list[Routed]] = {}


def generation(preset: str) -> list[Routed]:
    """Greedy decode of ``PROMPT`` (the prefill and ``DECODE_STEPS`` steps) through the unsplit model's ``step``,
    every MoE block's router seen where the stage hands it to ``route`` and ``combine``; once per preset."""
    if preset in _generations:
        return _generations[preset]
    f = model_file(preset)
    cfg = f.config
    routes: list[tuple[NDArray[np.float32], Routing, tuple[Any, ...], dict[str, Any]]] = []
    residuals: list[NDArray[np.float32]] = []
    layers: list[int] = []
    # the stage's routing arguments, for ``route`` on the exact logits
    args = (cfg.experts_used, cfg.norm_topk)
    kwargs = {"gating": cfg.gating, "groups": cfg.expert_groups, "groups_used": cfg.groups_used}
    kwargs["scale"] = cfg.routed_scale
    real_combine = slicing.combine_rows

    def seen_routed(layer: int, logits: NDArray[np.float32], routing: Routing) -> Routing:
        bias = of_config(cfg).router_bias
        extra = {"bias": f.vector(f"blk.{layer}.{bias}")} if bias and f.has(f"blk.{layer}.{bias}") else {}
        routes.append((logits.copy(), routing, args, kwargs | extra))
        return routing

    def seen_combine(h: NDArray[np.float32], *rest: Any) -> NDArray[np.float16]:
        residuals.append(h.copy())
        return real_combine(h, *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe, "routed", seen_routed)
        mp.setattr(slicing, "combine_rows", seen_combine)
        model = ModelSlice(f, 0, cfg.blocks, True, True, MAX_CONTEXT)
        ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + f.tokenizer.encode(PROMPT)
        x: Any = ids
        for step in range(DECODE_STEPS + 1):
            gen = model.step(x, 0 if step == 0 else len(ids) + step - 1)
            try:
                call = next(gen)
                while True:
                    layers.append(call.layer)
                    call = gen.send(model.answer(call))
            except StopIteration as stop:
                x = [stop.value]
    assert len(layers) == len(routes) == len(residuals) == (DECODE_STEPS + 1) * len(cfg.moe_blocks)
    out = [
        Routed(layer, logits, routing, h, (args, kwargs))
        for layer, (logits, routing, args, kwargs), h in zip(layers, routes, residuals, strict=True)
    ]
    _generations[preset] = out
    return out


# qwen3moe and deepseek2's routers in the default run; qwen2moe's and Kimi's (the same router code) with the slow tests
@pytest.mark.parametrize(
    "preset",
    [pytest.param(p, marks=pytest.mark.slow) if p in ("tiny-moe-shared", "kimi-tiny,blocks=3") else p for p in PRESETS],
)
def test_router_logits_are_fp32_at_every_step(preset: str) -> None:
    """The logits every MoE block feeds ``route`` over a prefill and 40 decode steps: float32, within float32
    rounding of the exact logits from the file's F32 router and norm weights."""
    f = model_file(preset)
    stored = Stored(f)
    worst = 0.0
    for r in generation(preset):
        assert r.logits.dtype == np.float32
        x = stored.normed(r.layer, r.residual.reshape(-1, f.config.dim))
        worst = max(worst, within(r.logits.reshape(len(x), -1), x, stored(f"blk.{r.layer}.ffn_gate_inp.weight")))
    assert worst <= 1, f"{preset}: router logits off by {worst:.3g}x the float32 tolerance ({TOLERANCE} sum |x w|)"


@pytest.mark.parametrize("preset", PRESETS)
def test_the_experts_chosen_are_those_of_the_exact_logits(preset: str) -> None:
    """Every row's chosen experts over the generation: the routing of the exact logits (the same ``route``, with the
    stage's own arguments: top-k, gating, selection bias, groups)."""
    f = model_file(preset)
    stored = Stored(f)
    other = []
    for n, r in enumerate(generation(preset)):
        x = stored.normed(r.layer, r.residual.reshape(-1, f.config.dim))
        exact = (x @ stored(f"blk.{r.layer}.ffn_gate_inp.weight").T).astype(np.float32)
        args, kwargs = r.route_args
        expected = route(exact, *args, **kwargs).ids
        rows = np.flatnonzero((np.sort(r.routing.ids) != np.sort(expected)).any(-1))
        other += [(n, r.layer, int(row)) for row in rows]
    assert not other, f"{preset}: (call, block, row) choosing other experts than the exact logits: {other[:8]}"


def test_qwen2moes_shared_expert_gate_is_fp32() -> None:
    """``sigmoid(ffn_gate_inp_shexp . x)`` from the fp32 normed input and the F32 gate weight: with the gate's
    weight zeroed the gated shared output is half the shared expert's, so the ratio of the two gives the gate."""
    from tinygrad.tensor import Tensor

    f = model_file("tiny-moe-shared")
    stored, layer = Stored(f), 1
    block = ModelSlice(f, layer, layer + 1, False, False, MAX_CONTEXT).blk[0]
    h = np.random.default_rng(5).standard_normal((1, 16, f.config.dim)).astype(np.float16)
    gated = block.moe_inputs(Tensor(h))[3].numpy()[0]  # (T, D): the shared expert's output times its gate
    weight = block.ffn_gate_inp_shexp.weight
    block.ffn_gate_inp_shexp.weight = Tensor.zeros(*weight.shape, dtype=weight.dtype).contiguous().realize()
    half = block.moe_inputs(Tensor(h))[3].numpy()[0]  # (T, D): the shared expert's output times sigmoid(0)
    block.ffn_gate_inp_shexp.weight = weight
    col = np.abs(half).argmax(-1)[:, None]
    gate = np.take_along_axis(gated, col, -1)[:, 0].astype(F64) / (2 * np.take_along_axis(half, col, -1)[:, 0])
    x, w = stored.normed(layer, h[0]), stored(f"blk.{layer}.ffn_gate_inp_shexp.weight")
    exact = 1 / (1 + np.exp(-(x @ w)))
    bound = TOLERANCE * exact * (1 - exact) * (np.abs(x) @ np.abs(w)) + 1e-6  # the logit's bound through sigmoid
    worst = float((np.abs(gate - exact) / bound).max())
    assert worst <= 1, f"the shared expert's gate is off by {worst:.3g}x the float32 tolerance"
