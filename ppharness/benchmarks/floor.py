"""``ppharness bench block``: one decode block of a model on this machine's accelerator, against the practical floor.

tinygrad's side is ``plan probe``'s fit (``ppharness.benchmarks.probe.probe_fit``): a middle stage's decode step (a
hidden state in, one out, copied to the host as a stage does) timed for slices of k blocks and fitted to t(k) = a + b·k,
so ``b`` is one block and ``a`` the fixed cost a stage pays per token. A kernel table named by ``PPHARNESS_KERNELS``
applies as in every other process.

The floor is what the same weights cost read once by PyTorch's fp16 GEMV (cuBLAS) on the same GPU, launched from a
CUDA graph so that no launch overhead counts: for every weight matrix a block reads at one decode position — each 2-D
tensor of ``blk.N``, each head's slice of a per-head 3-D tensor, and the chosen ``experts_used`` of each expert
tensor — one matrix-vector product of its shape. Norms, the KV cache (a few hundred KB at these lengths) and the
router's top-k are left out, so the floor is a little below what any engine can reach. Several copies of the block's
weights, together at least four times the GPU's L2 cache, are read in turn so that every read comes from memory.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from ppharness.benchmarks.probe import probe_fit
from ppharness.errors import HarnessError
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers import kernels

if TYPE_CHECKING:
    from collections.abc import Callable

GEMV = tuple[int, int, int]  # (rows out, columns in, how many such products per block)


@dataclass
class BlockCost:
    model: str
    block: int  # the block whose shapes the floor reads (the first MoE block of a MoE model)
    weight_mib: float  # what the floor reads per block
    tinygrad_block_ms: float  # the probe's slope b
    tinygrad_fixed_ms: float  # the probe's intercept a: a stage's fixed cost per token
    medians_ms: dict[int, float]  # k blocks -> median ms per decode step
    kernels: str  # the kernel table in use, or tinygrad's heuristic
    floor_block_ms: float | None = None  # None: no CUDA PyTorch here
    floor_note: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        return self.tinygrad_block_ms / self.floor_block_ms if self.floor_block_ms else None


def block_gemvs(f: GGUFFile, block: int) -> list[GEMV]:
    """The matrix-vector products one decode position of ``block`` needs, from the file's tensor shapes (module
    docstring). GGUF stores a 2-D weight as (columns in, rows out), innermost first."""
    used = max(1, f.config.experts_used)
    out: list[GEMV] = []
    for name, shape in f.shapes().items():
        if not name.startswith(f"blk.{block}.") or len(shape) < 2:
            continue
        cols, rows = shape[0], shape[1]
        many = 1 if len(shape) == 2 else (used if "_exps" in name else math.prod(shape[2:]))
        out.append((rows, cols, many))
    return out


def _block_to_time(f: GGUFFile) -> int:
    """The first MoE block of a MoE model (its dense leading blocks are not what the model is made of), else 0."""
    moe = f.config.moe_blocks
    return min(moe) if moe else 0


def torch_floor_ms(gemvs: list[GEMV]) -> tuple[float | None, str]:
    """Median ms per block of ``gemvs`` as fp16 cuBLAS GEMVs replayed from a CUDA graph; (None, why) without a CUDA
    PyTorch."""
    return measured_apart("ppharness.benchmarks.floor", json.dumps(gemvs), "the floor's measurement", 600)


def measured_apart(module: str, arg: str, what: str, timeout_s: float) -> tuple[float | None, str]:
    """``python -m module arg`` run in a process of its own (tinygrad's CUDA context, current in this one, is not
    PyTorch's), whose last line of output is ``[value, note]`` as JSON; (None, why) where it fails or overruns."""
    try:
        done = subprocess.run([sys.executable, "-m", module, arg], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"{what} did not finish in {timeout_s:g} s"
    if done.returncode != 0:
        return None, f"{what} failed: {done.stderr.strip()[-400:]}"
    value, note = json.loads(done.stdout.strip().splitlines()[-1])
    return value, note


def _torch_floor_here(gemvs: list[GEMV], replays: int = 50, trials: int = 7) -> tuple[float | None, str]:
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None, "no PyTorch here: the floor needs PyTorch with CUDA"
    if not torch.cuda.is_available():
        return None, "PyTorch sees no CUDA GPU: no floor"
    dev = torch.device("cuda")
    block_bytes = sum(r * c * n * 2 for r, c, n in gemvs)
    l2 = int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 64 << 20))
    copies = max(2, math.ceil(4 * l2 / max(block_bytes, 1)))
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [
        [torch.randn(r, c, dtype=torch.float16, device=dev, generator=gen) for r, c, n in gemvs for _ in range(n)]
        for _ in range(copies)
    ]
    xs = {c: torch.randn(c, dtype=torch.float16, device=dev, generator=gen) for _, c, _ in gemvs}
    outs: list[object] = []

    def run() -> None:
        outs.clear()
        for ws in weights:
            for w in ws:
                outs.append(torch.mv(w, xs[w.shape[1]]))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    per_block = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        per_block.append(start.elapsed_time(end) / replays / copies)
    ms = statistics.median(per_block)
    name = torch.cuda.get_device_name(dev)
    note = (
        f"PyTorch {torch.__version__} fp16 GEMV from a CUDA graph on {name}: {block_bytes / 2**20:.1f} MiB per block "
        f"at {block_bytes / ms / 1e6:.0f} GB/s ({copies} copies of the block's weights, {len(gemvs)} shapes)"
    )
    return ms, note


def block_cost(
    source: str, model_path: str, tokens: int = 32, floor: bool = True, progress: Callable[[str], None] | None = None
) -> BlockCost:
    """One decode block of ``model_path`` by the probe's fit, and (``floor``) the PyTorch floor of its shapes."""
    say = progress or (lambda _: None)
    f = GGUFFile(model_path)
    cfg = f.config
    ks = tuple(k for k in (1, 2, 4) if k <= cfg.blocks)
    if len(ks) < 2:
        raise HarnessError(f"{source}: a model of {cfg.blocks} block(s) has too few blocks to fit a block's cost")
    say(f"{source}: timing middle-stage slices of {', '.join(map(str, ks))} block(s)")
    fit = probe_fit(model_path, blocks=ks, tokens=tokens, source=source)
    pinning = kernels.active()
    block = _block_to_time(f)
    gemvs = block_gemvs(f, block)
    cost = BlockCost(
        model=source,
        block=block,
        weight_mib=sum(r * c * n * 2 for r, c, n in gemvs) / 2**20,
        tinygrad_block_ms=fit.b_ms,
        tinygrad_fixed_ms=fit.a_ms,
        medians_ms=fit.medians_ms,
        kernels=pinning.summary() if pinning else "tinygrad's heuristic (no kernel table: PPHARNESS_KERNELS unset)",
    )
    if fit.b_ms <= 0:
        cost.notes.append("the fit's slope was not positive (noise): compare the medians instead")
    if floor:
        say(f"{source}: the PyTorch floor of block {block}'s shapes")
        cost.floor_block_ms, cost.floor_note = torch_floor_ms(gemvs)
    return cost


def report(costs: list[BlockCost]) -> str:
    lines = [
        f"{'model':<44} {'MiB/block':>9} {'tinygrad ms/block':>17} {'floor ms/block':>14} {'x floor':>8} "
        f"{'fixed ms/step':>13}",
    ]
    for c in costs:
        floor = f"{c.floor_block_ms:.4f}" if c.floor_block_ms else "-"
        ratio = f"{c.ratio:.2f}" if c.ratio else "-"
        lines.append(
            f"{c.model[:44]:<44} {c.weight_mib:>9.1f} {c.tinygrad_block_ms:>17.4f} {floor:>14} {ratio:>8} "
            f"{c.tinygrad_fixed_ms:>13.4f}"
        )
    for c in costs:
        steps = ", ".join(f"{k} block(s) {ms:.4f} ms" for k, ms in c.medians_ms.items())
        lines.append(f"\n{c.model}: median step {steps}\n  kernels: {c.kernels}")
        lines += [f"  floor: {c.floor_note}"] if c.floor_note else []
        lines += [f"  note: {n}" for n in c.notes]
    return "\n".join(lines)


def as_json(costs: list[BlockCost]) -> list[dict[str, object]]:
    return [asdict(c) | {"ratio": c.ratio} for c in costs]


if __name__ == "__main__":  # torch_floor_ms's measuring process: the GEMVs as JSON in, [ms, note] as JSON out
    print(json.dumps(_torch_floor_here([(int(r), int(c), int(n)) for r, c, n in json.loads(sys.argv[1])])))
