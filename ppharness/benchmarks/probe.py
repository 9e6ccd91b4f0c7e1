"""Measuring this machine as a plan's device: per-token decode time against the number of blocks, fitted to a line;
and the transport's cost per hop in a running chain.

For each k in ``blocks`` a middle-stage slice of k blocks (no embedding, no head: a float16 hidden state (1, 1, dim)
in, one out) is built on tinygrad's default device, its decode step compiled (``warm_up``), and ``tokens`` decode
steps timed; the median of each k is fitted by least squares to t(k) = a + b·k. The intercept ``a`` is the fixed cost
per token of a node (``overhead_ms``: dispatch, copies in and out); the slope ``b`` is one block. The slices start at
the model's first block, or at its first mixture-of-experts block for a MoE model (its leading dense blocks are not
what it is made of), so that ``b`` is one MoE block: its dense part, the router, the routing on the host and the
chosen experts. The device's speed and memory bandwidth are both set so that one block of this model takes ``b``:
``gflops`` = the block's FLOPs per token / b and ``bandwidth_gbs`` = the bytes a token reads in it (every weight of a
dense block; a MoE block's dense part and ``active`` experts, as ``ppharness.plan.predict.cost`` counts them) / b, so
whichever bound the cost model picks, it predicts what was measured here. The device's ``measured`` names this
engine (``ppharness.plan.provenance.engine_id``), this machine, the day and the measurement.

A prompt's prefill is not a captured step: the runtime lowers its graph on every call, which costs far more than its
FLOPs on a short prompt, and a batch of tokens goes through a block much faster than as many decode steps. Each
slice's prefill is timed (after one that compiles) at two prompt lengths, ``PREFILL_TOKENS``, and fitted to
t(k, P) = a + k·(c + d·P): ``prefill_ms`` = a, ``prefill_block_ms`` = c, and ``prefill_gflops`` = a block's FLOPs per
token / d (``ppharness.plan.predict.simulate`` uses them for the time to first token).

The cost per hop (``probe_hop``, a cluster's ``hop_ms``) is measured in a running chain, not as a loopback round trip:
the model split in two stages in this process, each a ``Stage`` turning its own loop on a thread of its own over a
ZeroMQ endpoint, serves one request with tracing on; the trace's ``hop 0->1`` rows (from stage 0's send of a hidden
state to stage 1's receipt of it, what ``ppharness.trace.report`` calls a hop and the simulator's hop rows predict)
over the decode tokens give the median. The stages share one interpreter, so a stage that wakes for a message may
wait for the other's thread to give up the interpreter lock; separate processes (a real run) do not.
"""

from __future__ import annotations

import importlib
import math
import os
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import msgspec
import numpy as np

from ppharness.errors import ModelError, PlanError, StageError, TransportTimeout
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers import kernels
from ppharness.model.layers.moe import routing_entropy
from ppharness.plan.graph import model_graph
from ppharness.plan.lang.document import ID_NAME, Block, Device
from ppharness.plan.predict.cost import dense_part
from ppharness.plan.provenance import measured_here
from ppharness.plan.stages import ENTRY, names_of
from ppharness.registry import transport_class
from ppharness.run.inprocess import load_slices, run_inprocess
from ppharness.run.loop import Loop
from ppharness.run.node.colocated import GroupInbox, LocalEndpoint, Mail
from ppharness.run.stage.stage import Stage
from ppharness.seams.transport import Received, Transport
from ppharness.trace.report import Trace, build_trace, percentile
from ppharness.trace.tracer import Tracer
from ppharness.wire.messages import Error, InferenceRequest, InferenceResponse, Message, TraceReport

PREFILL_TOKENS = (8, 32)  # the prompt lengths the prefill is timed with
PREFILL_REPEATS = 3  # timed prefills per slice, after the one that compiles
BLOCK_COUNTS = (1, 2, 4)  # the slices a probe times, as many of them as the model has blocks for
PROBE_FORMAT = "ppharness-probe/1"  # ``probe_record``'s JSON
HOP_PROMPT = "Pipeline parallel inference splits a model's blocks into stages."
HOP_WAIT_S = 600.0  # the longest the hop's request may take (compiling a prompt's prefill included)


def read_bytes(block: Block) -> int:
    """The weight bytes one decode token reads in ``block``: all of a dense block's; a MoE block's dense part and its
    ``active`` routed experts."""
    x = block.experts
    return dense_part(block)[1] + x.active * x.bytes_per_expert if x.count else block.weight_bytes


def block_counts(blocks: int, first: int = 0) -> tuple[int, ...]:
    """The slice sizes of ``BLOCK_COUNTS`` a model of ``blocks`` blocks has room for from block ``first``."""
    return tuple(k for k in BLOCK_COUNTS if first + k <= blocks)


def first_timed_block(model_path: str) -> int:
    """Where a probe's slices start: the first mixture-of-experts block of a MoE model, else 0."""
    cfg = GGUFFile(model_path).config
    return min(cfg.moe_blocks) if cfg.moe else 0


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
    source: str = ""  # the model, as the graph names it
    first_block: int = 0  # the slices' first block (a MoE model's first MoE block)
    moe: bool = False  # the timed blocks are mixture-of-experts blocks
    block_read_bytes: float = 0.0  # weight bytes a decode token reads in one timed block (``read_bytes``)
    block_flops: float = 0.0  # FLOPs per decode token of one timed block

    @property
    def probe_report(self) -> str:
        """The fit for people: each k's median, a, b and r²."""
        d = self.device
        kind = f"MoE blocks from block {self.first_block}" if self.moe else f"blocks from block {self.first_block}"
        lines = [
            f"probe of {d.id} on tinygrad {self.backend}: {self.tokens} decode steps per slice ({kind}), median ms "
            "per step",
            *(f"  {k:>3} block(s): {ms:.4f} ms" for k, ms in self.medians_ms.items()),
            f"  fit t(k) = a + b·k: a = {self.a_ms:.4f} ms, b = {self.b_ms:.4f} ms per block, r² = {self.r2:.4f}",
            f"  device: overhead {d.overhead_ms:.4f} ms, {d.gflops:.3f} GFLOP/s, {d.bandwidth_gbs or 0:.3f} GB/s "
            f"({self.block_read_bytes / 2**20:.2f} MiB read per block), memory {d.memory / (1 << 30):.2f} GiB "
            "available",
            "  prefill: "
            + ", ".join(f"{k} block(s) x {p} tokens {ms:.1f} ms" for (k, p), ms in self.prefill_ms.items())
            + f"; fit {d.prefill_ms:.1f} ms + {d.prefill_block_ms:.1f} ms per block + a block's tokens at "
            f"{d.prefill_gflops or 0:.3f} GFLOP/s",
            f"  kernels: {self.kernels or 'tinygrad heuristic'}",
        ]
        if d.measured is not None:
            lines.append(f"  measured with engine {d.measured.engine} on {d.measured.date}: {d.measured.hardware}")
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
    blocks: tuple[int, ...] = BLOCK_COUNTS,
    tokens: int = 32,
    max_context: int | None = None,
    source: str = "",
    progress: Callable[[str], None] | None = None,
    how: str = "",
) -> ProbeFit:
    """Time decode on this machine for slices of k blocks of ``model_path`` (from its first block, or its first MoE
    block), k in ``blocks``, and fit the line (see the module's docstring). ``source`` names the model in the graph
    (default: the path); ``progress`` hears what is being timed; ``how`` goes into the device's ``measured`` (default:
    what was timed)."""
    # the model runtime (tinygrad) loads when a probe runs, not with the CLI
    from tinygrad.device import Device as TinyDevice

    say = progress or (lambda _: None)
    if not ID_NAME.match(device_id):
        raise PlanError(f"device id {device_id!r}: use lower-case letters, digits, - and _ (1 to 63)")
    if tokens < 1:
        raise PlanError(f"a probe times at least one decode step, not {tokens}")
    f = GGUFFile(model_path)
    cfg = f.config
    lo = min(cfg.moe_blocks) if cfg.moe else 0
    ks = sorted(set(blocks))
    if len(ks) < 2 or ks[0] < 1 or lo + ks[-1] > cfg.blocks:
        raise PlanError(
            f"probe block counts {list(blocks)}: give at least two different counts from 1 to the {cfg.blocks - lo} "
            f"block(s) the model has from block {lo}"
        )
    first_position = 4  # warm_up decodes positions 1, 2 and 3
    context = min(cfg.context, max_context or max(64, first_position + tokens + 1))
    if first_position + tokens > context:
        raise PlanError(f"{tokens} decode steps need a context of {first_position + tokens}, not {context}")
    x = np.random.default_rng(0).standard_normal((1, 1, cfg.dim)).astype(np.float16)
    say(f"probe: compiling slices of {', '.join(map(str, ks))} block(s) from block {lo}")
    models = {k: ModelSlice(f, lo, lo + k, first=False, last=False, max_context=context) for k in ks}
    for model in models.values():
        warm_up(model)
    say(f"probe: timing {tokens} decode steps per slice")
    steps: dict[int, list[float]] = {k: [] for k in ks}
    for pos in range(first_position, first_position + tokens):
        for k, model in models.items():  # interleaved, so that noise on a shared machine hits every k alike
            t0 = time.perf_counter()
            model.decode(x, pos)
            steps[k].append((time.perf_counter() - t0) * 1e3)
    medians = {k: statistics.median(v) for k, v in steps.items()}
    a, b, r2 = fit_line([float(k) for k in ks], [medians[k] for k in ks])
    # a prompt's prefill: not a captured step, so the runtime lowers it each time
    say(f"probe: timing prefills of {' and '.join(map(str, PREFILL_TOKENS))} tokens")
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
    used = graph.blocks[lo : lo + ks[-1]]
    flops = sum(blk.flops for blk in used) / len(used)
    nbytes = sum(read_bytes(blk) for blk in used) / len(used)
    slope_s = max(b, 1e-6) / 1e3
    backend = str(TinyDevice.DEFAULT)
    pinning = kernels.active()
    table = pinning.summary() if pinning else "tinygrad's heuristic (no kernel table: PPHARNESS_KERNELS unset)"
    what = how or (
        f"ppharness plan probe --model {graph.source[:120]}: {tokens} decode steps per slice of "
        f"{', '.join(map(str, ks))} block(s) from block {lo}, t(k) = a + b·k; {table[:120]}"
    )
    device = Device(
        id=device_id,
        memory=available_memory(),
        gflops=flops / slope_s / 1e9,
        bandwidth_gbs=nbytes / slope_s / 1e9,
        overhead_ms=max(a, 0.0),
        prefill_ms=max((a0 + a1) / 2, 0.0),
        prefill_block_ms=max(b0 - p0 * per_token, 0.0),
        prefill_gflops=flops / (per_token / 1e3) / 1e9,
        region=None,
        measured=measured_here(backend, what),
    )
    return ProbeFit(
        device,
        backend,
        tokens,
        medians,
        a,
        b,
        r2,
        prefill_medians,
        table,
        graph.source,
        lo,
        cfg.moe,
        nbytes,
        flops,
    )


def probe(
    model_path: str,
    device_id: str = "this",
    blocks: tuple[int, ...] = BLOCK_COUNTS,
    tokens: int = 32,
    max_context: int | None = None,
    source: str = "",
) -> Device:
    """This machine as a plan's Device, measured on ``model_path`` (``probe_fit(...).probe_report`` says how)."""
    return probe_fit(model_path, device_id, blocks, tokens, max_context, source).device


@dataclass(frozen=True)
class HopFit:
    """What ``probe_hop`` measured: the transport's cost per hop in a running two-stage chain."""

    hop_ms: float  # median ``hop 0->1`` over the decode tokens: a hidden state from stage 0's send to stage 1
    token_hop_ms: float  # median ``hop 1->0``: the sampled token back to stage 0
    p90_ms: float  # the 90th percentile of ``hop 0->1``
    samples: int  # decode tokens whose hops were traced
    activation_bytes: int  # one hidden state's frame on the wire
    transport: str = "zmq"
    source: str = ""
    handoff_ms: float = math.nan  # median ``hop 0->1`` of the same two stages co-located in one process

    @property
    def report(self) -> str:
        return (
            f"hop in a running chain of two stages here ({self.transport}, {self.samples} decode tokens): hidden state "
            f"{self.hop_ms:.3f} ms median ({self.p90_ms:.3f} ms p90, {self.activation_bytes} bytes), token back "
            f"{self.token_hop_ms:.3f} ms; the same stages co-located in one process: {self.handoff_ms:.3f} ms"
        )


def probe_hop(
    model_path: str,
    tokens: int = 32,
    max_context: int = 256,
    source: str = "",
    progress: Callable[[str], None] | None = None,
) -> HopFit:
    """The transport's cost per hop in a running chain on this machine (the module's docstring): ``model_path`` in
    two stages (blocks split in half), each a Stage turning its own loop on a thread over a ZeroMQ endpoint, serves
    one request of ``tokens`` decode tokens, traced; the medians of its hop rows. Then the same two stages co-located
    on one loop (``ppharness.run.node.colocated``): the median of their hand-over (a cluster's ``handoff_ms``)."""
    say = progress or (lambda _: None)
    if tokens < 2:
        raise PlanError(f"a hop's median needs at least 2 decode tokens, not {tokens}")
    f = GGUFFile(model_path)
    n = f.config.blocks
    if n < 2:
        raise PlanError(f"{model_path}: a model of one block cannot be split into the two stages of a chain")
    context = min(f.config.context, max(max_context, tokens + 64))
    say(f"hop: loading and compiling two stages (blocks 0..{n // 2} and {n // 2}..{n})")
    slices = load_slices(f, [(0, n // 2), (n // 2, n)], context)
    # tinygrad compiles on the thread that made its kernel cache's connection, this one: the prompt's prefill is
    # compiled by a first request and captured by a second, so that the threads below only replay compiled steps
    for _ in range(2):
        run_inprocess(f, slices, HOP_PROMPT, 2)
    say(f"hop: one request of {tokens} decode tokens through the chain, then through the chain in one process")
    trace = _traced_chain(f, slices, tokens, colocated=False)
    together = _traced_chain(f, slices, tokens, colocated=True)
    handoff = [r.parts["hop 0->1"] for r in together.decode if "hop 0->1" in r.parts]
    forward = [r.parts["hop 0->1"] for r in trace.decode if "hop 0->1" in r.parts]
    back = [r.parts["hop 1->0"] for r in trace.decode if "hop 1->0" in r.parts]
    if len(forward) < 2:
        raise PlanError(f"the chain traced {len(forward)} decode hop(s); a median needs at least 2")
    size = max((r.hop_bytes.get("0->1", 0) for r in trace.decode), default=0)
    return HopFit(
        statistics.median(forward),
        statistics.median(back) if back else math.nan,
        percentile(forward, 90),
        len(forward),
        size,
        "zmq",
        source or str(model_path),
        statistics.median(handoff) if handoff else math.nan,
    )


def _traced_chain(f: GGUFFile, slices: list[Any], tokens: int, colocated: bool) -> Trace:
    """One traced request of ``tokens`` decode tokens through two stages over ZeroMQ endpoints: each stage on a loop
    of its own on a thread, or (``colocated``) both on one loop, handing over in the process
    (``ppharness.run.node.colocated``)."""
    zmq = transport_class("zmq")
    mail = Mail()
    ends: list[Transport] = [zmq() for _ in range(3)]
    if colocated:
        ends[:2] = [LocalEndpoint(end, mail) for end in ends[:2]]
    try:
        addresses = [t.start() for t in ends]
        client = ends[2]
        names = {name: addresses[i] for i in range(2) for name in names_of(i, 2)}
        tracers = [Tracer(), Tracer()]
        stages = [
            Stage(
                i,
                2,
                slices[i],
                ends[i],
                names,
                "probe-hop",
                tokenizer=f.tokenizer,
                log=lambda _: None,
                tracer=tracers[i],
                seed=client.address,
                keep_digests=False,
            )
            for i in range(2)
        ]
        stop = threading.Event()
        failures: list[BaseException] = []
        inbox = GroupInbox(mail, cast("list[LocalEndpoint]", ends[:2])) if colocated else None

        def serve(members: list[int]) -> None:
            loop = Loop(inbox if inbox is not None else ends[members[0]], lambda _: None)
            for i in members:
                stages[i].serve_on(loop)

            def handle(sender: str, msg: Message, rx: Received | None) -> bool:
                stages[inbox.member if inbox is not None else members[0]].handle(sender, msg, rx)
                return False

            try:
                loop.wait(handle, None, "the stages' messages", done=stop.is_set)
            except BaseException as exc:  # handed to the caller below
                failures.append(exc)

        groups = [[0, 1]] if colocated else [[0], [1]]
        threads = [threading.Thread(target=serve, args=(g,), name="probe-hop", daemon=True) for g in groups]
        for thread in threads:
            thread.start()
        try:
            request = InferenceRequest(client.address, HOP_PROMPT, tokens + 1, request_id="probe-hop")
            client.send(names[ENTRY], request)
            response = _response(client, failures)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=10)
        reports = [TraceReport(stage=i, request_id="probe-hop", spans=tracers[i].take("probe-hop")) for i in (0, 1)]
    finally:
        for end in ends:
            end.close()
    return build_trace(reports, {}, response, 2)


def _response(client: Transport, failures: list[BaseException]) -> InferenceResponse:
    """The chain's answer to the probe's request, as ``client`` receives it; raises what a stage raised."""
    deadline = time.monotonic() + HOP_WAIT_S
    while time.monotonic() < deadline:
        if failures:
            raise StageError(f"a stage of the probe's chain failed: {failures[0]}") from failures[0]
        try:
            _, msg = client.recv(0.2)
        except TransportTimeout:  # nothing yet: look at the stages again
            continue
        if isinstance(msg, Error):
            raise StageError(f"stage {msg.stage}: {msg.reason}")
        if isinstance(msg, InferenceResponse):
            return msg
    raise StageError(f"the probe's chain did not answer in {HOP_WAIT_S:g} s")


def probe_record(fit: ProbeFit | None, hop: HopFit | None) -> dict[str, Any]:
    """What a probe measured as JSON data (``ppharness plan probe --json``; ``ppharness.plan.consumer`` reads it):
    the device entry with its ``measured``, the fit, and the hop when measured."""
    out: dict[str, Any] = {"format": PROBE_FORMAT}
    if fit is not None:
        out |= {
            "model": fit.source,
            "backend": fit.backend,
            "moe": fit.moe,
            "first_block": fit.first_block,
            "tokens": fit.tokens,
            "medians_ms": {str(k): v for k, v in fit.medians_ms.items()},
            "fixed_ms": fit.a_ms,
            "block_ms": fit.b_ms,
            "r2": fit.r2,
            "block_read_bytes": fit.block_read_bytes,
            "block_flops": fit.block_flops,
            "kernels": fit.kernels,
            "device": msgspec.to_builtins(fit.device),
        }
    if hop is not None:
        out["hop"] = {
            "hop_ms": hop.hop_ms,
            "token_hop_ms": hop.token_hop_ms,
            "p90_ms": hop.p90_ms,
            "samples": hop.samples,
            "activation_bytes": hop.activation_bytes,
            "transport": hop.transport,
            "model": hop.source,
            "handoff_ms": hop.handoff_ms,
        }
    return out


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
