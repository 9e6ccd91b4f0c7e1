"""Measuring this machine as a plan's device: per-token decode time against the number of blocks, fitted to a line.

For each k in ``blocks`` a middle-stage slice of the first k blocks (no embedding, no head: a float16 hidden state
(1, 1, dim) in, one out) is built on tinygrad's default device, its decode step compiled (``warm_up``), and ``tokens``
decode steps timed; the median of each k is fitted by least squares to t(k) = a + b·k. The intercept ``a`` is the
fixed cost per token of a node (``overhead_ms``: dispatch, copies in and out); the slope ``b`` is one block. The
device's speed and memory bandwidth are both set so that one block of this model takes ``b``: ``gflops`` = the block's
FLOPs / b and ``bandwidth_gbs`` = its weight bytes / b, so whichever bound the cost model picks, it predicts what was
measured here.

A prompt's prefill is not a captured step: the runtime lowers its graph on every call, which costs far more than its
FLOPs on a short prompt, and a batch of tokens goes through a block much faster than as many decode steps. Each
slice's prefill is timed (after one that compiles) at two prompt lengths, ``PREFILL_TOKENS``, and fitted to
t(k, P) = a + k·(c + d·P): ``prefill_ms`` = a, ``prefill_block_ms`` = c, and ``prefill_gflops`` = a block's FLOPs per
token / d (``ppharness.plan.simulate`` uses them for the time to first token).
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ppharness.errors import ModelError, PlanError
from ppharness.model import kernels
from ppharness.model.decoding import warm_up
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.moe import routing_entropy
from ppharness.model.slicing import ModelSlice
from ppharness.plan.doc import ID_NAME, Device
from ppharness.plan.graph import model_graph

PREFILL_TOKENS = (8, 32)  # the prompt lengths the prefill is timed with
PREFILL_REPEATS = 3  # timed prefills per slice, after the one that compiles


@dataclass(frozen=True)
class ProbeFit:
    """What ``probe_fit`` measured: per k, the median decode step; the line through them; the device it gives."""

    device: Device
    backend: str  # tinygrad's device: CPU, CUDA, ...
    tokens: int
    medians_ms: dict[int, float]  # k blocks -> median ms per decode step
    a_ms: float  # intercept: fixed cost per token
    b_ms: float  # slope: one block
    r2: float
    prefill_ms: dict[tuple[int, int], float]  # (k blocks, P tokens) -> median ms per prefill
    kernels: str = ""  # the kernel table the slices compiled with (PPHARNESS_KERNELS), or tinygrad's heuristic

    @property
    def probe_report(self) -> str:
        """The fit for people: each k's median, a, b and r²."""
        d = self.device
        lines = [
            f"probe of {d.id} on tinygrad {self.backend}: {self.tokens} decode steps per slice, median ms per step",
            *(f"  {k:>3} block(s): {ms:.4f} ms" for k, ms in self.medians_ms.items()),
            f"  fit t(k) = a + b·k: a = {self.a_ms:.4f} ms, b = {self.b_ms:.4f} ms per block, r² = {self.r2:.4f}",
            f"  device: overhead {d.overhead_ms:.4f} ms, {d.gflops:.3f} GFLOP/s, {d.bandwidth_gbs or 0:.3f} GB/s, "
            f"memory {d.memory / (1 << 30):.2f} GiB available",
            "  prefill: "
            + ", ".join(f"{k} block(s) x {p} tokens {ms:.1f} ms" for (k, p), ms in self.prefill_ms.items())
            + f"; fit {d.prefill_ms:.1f} ms + {d.prefill_block_ms:.1f} ms per block + a block's tokens at "
            f"{d.prefill_gflops or 0:.3f} GFLOP/s",
            f"  kernels: {self.kernels or 'tinygrad heuristic'}",
        ]
        if self.b_ms <= 0 or self.a_ms < 0:
            lines.append("  note: the fit's slope or intercept was not positive (noise); clamped")
        return "\n".join(lines)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float, float]:
    """Least squares y = a + b·x: (a, b, r²); r² is 1 when the points lie on the line (or all ys are equal and fit)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise PlanError("a probe needs at least two different block counts to fit a line")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    a = my - b * mx
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    r2 = 1 - ss_res / ss_tot if ss_tot > 0 else (1.0 if ss_res == 0 else 0.0)
    return a, b, r2


def available_memory() -> int:
    """Bytes of memory available on this machine now: psutil's figure when installed, else /proc/meminfo's
    MemAvailable, else the free physical pages."""
    try:
        psutil = importlib.import_module("psutil")
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0


def probe_fit(
    model_path: str,
    device_id: str = "this",
    blocks: tuple[int, ...] = (1, 2, 4),
    tokens: int = 32,
    max_context: int | None = None,
    source: str = "",
) -> ProbeFit:
    """Time decode on this machine for slices of the first k blocks of ``model_path``, k in ``blocks``, and fit the
    line (see the module's docstring). ``source`` names the model in the graph (default: the path)."""
    # the model runtime (tinygrad) loads when a probe runs, not with the CLI
    from tinygrad.device import Device as TinyDevice

    if not ID_NAME.match(device_id):
        raise PlanError(f"device id {device_id!r}: use lower-case letters, digits, - and _ (1 to 63)")
    if tokens < 1:
        raise PlanError(f"a probe times at least one decode step, not {tokens}")
    f = GGUFFile(model_path)
    cfg = f.config
    ks = sorted(set(blocks))
    if len(ks) < 2 or ks[0] < 1 or ks[-1] > cfg.blocks:
        raise PlanError(
            f"probe block counts {list(blocks)}: give at least two different counts from 1 to the model's {cfg.blocks}"
        )
    first_position = 4  # warm_up decodes positions 1, 2 and 3
    context = min(cfg.context, max_context or max(64, first_position + tokens + 1))
    if first_position + tokens > context:
        raise PlanError(f"{tokens} decode steps need a context of {first_position + tokens}, not {context}")
    x = np.random.default_rng(0).standard_normal((1, 1, cfg.dim)).astype(np.float16)
    models = {k: ModelSlice(f, 0, k, first=False, last=False, max_context=context) for k in ks}
    for model in models.values():
        warm_up(model)
    steps: dict[int, list[float]] = {k: [] for k in ks}
    for pos in range(first_position, first_position + tokens):
        for k, model in models.items():  # interleaved, so that noise on a shared machine hits every k alike
            t0 = time.perf_counter()
            model.decode(x, pos)
            steps[k].append((time.perf_counter() - t0) * 1e3)
    medians = {k: statistics.median(v) for k, v in steps.items()}
    a, b, r2 = fit_line([float(k) for k in ks], [medians[k] for k in ks])
    # a prompt's prefill: not a captured step, so the runtime lowers it each time
    prefills: dict[tuple[int, int], list[float]] = {(k, p): [] for p in PREFILL_TOKENS for k in ks}
    for p in PREFILL_TOKENS:
        prompt = np.random.default_rng(1).standard_normal((1, p, cfg.dim)).astype(np.float16)
        for rep in range(PREFILL_REPEATS + 1):
            for k, model in models.items():
                t0 = time.perf_counter()
                model.prefill(prompt)
                if rep:  # the first one compiles the kernels
                    prefills[(k, p)].append((time.perf_counter() - t0) * 1e3)
    del models
    prefill_medians = {key: statistics.median(v) for key, v in prefills.items()}
    # per prompt length, a line in k; then the slope's growth with P is one block's cost per prompt token
    lines = {p: fit_line([float(k) for k in ks], [prefill_medians[(k, p)] for k in ks]) for p in PREFILL_TOKENS}
    (p0, (a0, b0, _)), (p1, (a1, b1, _)) = sorted(lines.items())
    per_token = max((b1 - b0) / (p1 - p0), 1e-6)
    graph = model_graph(model_path, source or str(model_path), context)
    used = graph.blocks[: ks[-1]]
    flops = sum(blk.flops for blk in used) / len(used)
    weight_bytes = sum(blk.weight_bytes for blk in used) / len(used)
    slope_s = max(b, 1e-6) / 1e3
    device = Device(
        id=device_id,
        memory=available_memory(),
        gflops=flops / slope_s / 1e9,
        bandwidth_gbs=weight_bytes / slope_s / 1e9,
        overhead_ms=max(a, 0.0),
        prefill_ms=max((a0 + a1) / 2, 0.0),
        prefill_block_ms=max(b0 - p0 * per_token, 0.0),
        prefill_gflops=flops / (per_token / 1e3) / 1e9,
        region=None,
    )
    pinning = kernels.active()
    table = pinning.summary() if pinning else "tinygrad's heuristic (no kernel table: PPHARNESS_KERNELS unset)"
    return ProbeFit(device, str(TinyDevice.DEFAULT), tokens, medians, a, b, r2, prefill_medians, table)


def probe(
    model_path: str,
    device_id: str = "this",
    blocks: tuple[int, ...] = (1, 2, 4),
    tokens: int = 32,
    max_context: int | None = None,
    source: str = "",
) -> Device:
    """This machine as a plan's Device, measured on ``model_path`` (``probe_fit(...).probe_report`` says how)."""
    return probe_fit(model_path, device_id, blocks, tokens, max_context, source).device


ROUTING_PROMPTS = (
    "Pipeline parallel inference splits a model's blocks into stages.",
    "The quick brown fox jumps over the lazy dog; héllo wörld, 1234567890.",
    "Experts live on other machines, and every MoE layer fans a token's activation out to the chosen experts.",
)


def probe_routing(
    model_path: str, prompts: tuple[str, ...] = ROUTING_PROMPTS, tokens: int = 32, max_context: int = 256
) -> tuple[dict[int, list[float]], int]:
    """How often each routed expert of each MoE block is chosen when the whole model (in this process) reads
    ``prompts`` and greedily generates ``tokens`` after each: block -> frequency per expert (the share of routed
    tokens that chose it; a block's frequencies add up to its active count), and the number of tokens routed."""
    f = GGUFFile(model_path)
    cfg = f.config
    if not cfg.moe:
        raise ModelError(f"{model_path}: a {cfg.arch} model without experts has no routing to measure")
    model = ModelSlice(f, 0, cfg.blocks, True, True, max_context)
    counts = {b: np.zeros(cfg.experts, dtype=np.int64) for b in sorted(cfg.moe_blocks)}
    routed = 0

    def run(x: list[int], position: int) -> int:
        nonlocal routed
        gen = model.step(x, position)
        try:
            call = next(gen)
            while True:
                np.add.at(counts[call.layer], call.routing.ids.reshape(-1), 1)
                if call.layer == min(counts):
                    routed += call.routing.ids.shape[0]
                call = gen.send(model.answer(call))
        except StopIteration as stop:
            token: int = stop.value
            return token

    tok = f.tokenizer
    for prompt in prompts:
        ids = ([cfg.bos_id] if cfg.bos_id is not None else []) + tok.encode(prompt)
        ids = ids[: max_context - tokens - 1]
        token = run(ids, 0)
        for i in range(tokens - 1):
            token = run([token], len(ids) + i)
    return {b: [float(c) / routed for c in v] for b, v in counts.items()}, routed


def routing_report(freqs: dict[int, list[float]], routed: int) -> str:
    """Per block: the hottest and coldest expert's share, and how even the routing is (entropy over its maximum)."""
    lines = [f"routing of {routed} token(s) per MoE block (frequency: share of tokens that chose the expert)"]
    for block, f in freqs.items():
        entropy = routing_entropy(f)
        hot, cold = max(range(len(f)), key=f.__getitem__), min(range(len(f)), key=f.__getitem__)
        lines.append(
            f"  block {block}: hottest expert {hot} {f[hot]:.3f}, coldest {cold} {f[cold]:.3f}, evenness "
            f"{entropy / math.log2(len(f)):.2f} (1 = uniform)"
        )
    return "\n".join(lines)
