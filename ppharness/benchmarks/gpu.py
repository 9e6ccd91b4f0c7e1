"""``ppharness bench gpu``: the chain on an accelerator, against single-process tinygrad and HF transformers.

One run on one machine: a synthetic GGUF with llama-3.2-1B dimensions (built once), single-process tinygrad decode
(the oracle path), the N-stage chain for each N and transport with every stage process on the same GPU, and with
every stage co-located in one process (``ppharness.run.node.colocated``), and, where PyTorch and transformers are
installed, HF transformers' greedy decode of a LlamaForCausalLM of the same dimensions
(random weights, bf16, dynamic and static cache): the reference a user would pick instead. Figures: decode tokens/s
(``tokens`` after a ``prompt_tokens`` prompt), time to first token cold (first request: kernels compile) and warm,
accelerator memory per stage, the chain's per-token breakdown, and whether the chain's first tokens equal the
single-process oracle's. Medians over ``repeats``.

Beside them, optionally: llama.cpp's ``llama-bench`` on the very file the single process decodes and on copies
``llama-quantize`` makes of it (``llamacpp.py``), and the packed-weights floor: the bytes of the file, as stored, that
one token reads over the device's copy bandwidth measured in the same run (``packed_floor.py``).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import msgspec

from ppharness.benchmarks import llamacpp as llamacpp_bench
from ppharness.benchmarks import packed_floor as packed_bench
from ppharness.benchmarks.chain import COLOCATED, _scenario
from ppharness.benchmarks.floor import BlockCost, block_cost
from ppharness.benchmarks.llamacpp import LlamaCppRun
from ppharness.benchmarks.packed_floor import PackedFloor
from ppharness.benchmarks.provenance import stamped
from ppharness.errors import HarnessError
from ppharness.model.decode.oracle import oracle_decode
from ppharness.model.decode.rules import warm_up
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.layers import kernels
from ppharness.model.sources.files import resolve_model
from ppharness.run.node.node import device_bytes
from ppharness.run.seed.client import Job
from ppharness.run.seed.orchestrator import Chain, decode_span, decode_tok_s
from ppharness.scenario.schema import scenario_from_args

if TYPE_CHECKING:
    from ppharness.model.decode.oracle import OracleResult
    from ppharness.model.gguf.config import ModelConfig


class Tokenizer(Protocol):
    """What ``prompt_of`` needs of a tokenizer (a GGUF file's, ``GGUFFile.tokenizer``)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Contender:
    name: str
    decode_tok_s: list[float] = field(default_factory=list)
    ttft_cold_s: float = 0.0
    ttft_warm_s: list[float] = field(default_factory=list)
    device_mib: list[float] = field(default_factory=list)  # per stage (one entry for a single process)
    tokens_match_oracle: bool | None = None  # tokens and every stage-boundary hidden state, bit for bit
    mismatch: str = ""  # what differs, when they do not match
    breakdown_ms: dict[str, float] = field(default_factory=dict)  # p50 per trace component (chains only)
    error: str = ""  # a contender that failed (llama.cpp): what failed; the others' figures stand

    def median_tok_s(self) -> float:
        return statistics.median(self.decode_tok_s) if self.decode_tok_s else 0.0


@dataclass
class GpuBench:
    device: str
    model: str
    prompt_tokens: int
    tokens: int
    contenders: list[Contender] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    block: BlockCost | None = None  # one decode block vs the PyTorch fp16 GEMV floor (benchmarks/floor.py)
    kernels: str = ""  # the kernel table every process compiled with (PPHARNESS_KERNELS), or tinygrad's heuristic
    packed_floor: PackedFloor | None = None  # the file's bytes as stored per token / copy bandwidth (packed_floor.py)
    llamacpp: list[LlamaCppRun] = field(default_factory=list)  # llama-bench on the same file (llamacpp.py)


def prompt_of(tokenizer: Tokenizer, bos: int | None, n: int) -> str:
    """A prompt that tokenizes to exactly ``n`` tokens with the BOS (words of a fixed text, trimmed)."""
    words = (
        "the pipeline stage sends its hidden state to the next stage over the wide area network and waits "
        "for the token to come back "
    ).split()
    text, i = "", 0
    target = n - (1 if bos is not None else 0)
    while len(tokenizer.encode(text)) < target:
        text += (" " if text else "") + words[i % len(words)]
        i += 1
    ids = tokenizer.encode(text)[:target]
    out = tokenizer.decode(ids)
    if len(tokenizer.encode(out)) != target:  # a cut inside a merge: fall back to single characters
        out = "a" * target
    return out


def run_gpu_bench(
    device: str,
    preset: str,
    stage_counts: list[int],
    transports: list[str],
    tokens: int,
    prompt_tokens: int,
    repeats: int,
    out_dir: str,
    hf: bool,
    progress: Callable[[str], None],
    in_flight: int = 1,
    block: bool = True,
    batched: bool = False,
    max_batch: int = 0,
    llamacpp: str | None = None,
    llamacpp_types: str = "f16",
    llamacpp_files: str = "",
    packed: bool = True,
) -> GpuBench:
    """``in_flight`` above 1: each chain also serves that many requests at once (every stage keeps a KV cache per
    request), reported as a contender of its own with the aggregate decode tokens/s, and HF transformers decodes a
    batch of as many. ``batched``: the chains run batched (``serving.batched``); the single process also runs as a
    batched slice (a batch of one row: the price of batch-invariant kernels), which is then the oracle every chain's
    answers are held to, bit for bit.

    ``llamacpp``: a llama.cpp build directory; llama-bench then decodes the same file as each of ``llamacpp_types``
    (comma-separated llama-quantize types; the file's own type is the file as it is, another is quantised once into
    ``llamacpp_files``, default ``out_dir``), each a contender; a failure there is a failed contender, never the
    bench's. ``packed``: the packed-weights floor (``packed_floor.py``) of the file and of each llama.cpp file."""
    tools, types = None, []
    if llamacpp:  # refused now, before minutes of work: the types and the tools they need
        types = llamacpp_bench.parse_types(llamacpp_types)
        own = llamacpp_bench.synthetic_file_type(f"synthetic:{preset}")
        tools = llamacpp_bench.find_tools(llamacpp, need_quantize=any(t != own for t in types))
    os.environ["DEV"] = device.upper()  # this process and every stage process it starts; tinygrad, imported
    # when the first slice is built (ppharness.model.engine.slicing), takes its device from it

    progress(f"model: synthetic {preset} (built once into the cache)")
    path = str(resolve_model(f"synthetic:{preset}"))
    f = GGUFFile(path)
    cfg = f.config
    max_context = prompt_tokens + tokens + 16
    prompt = prompt_of(f.tokenizer, cfg.bos_id, prompt_tokens)
    res = GpuBench(
        device=device,
        model=f"{preset}: {cfg.blocks} blocks, dim {cfg.dim}, FFN {cfg.ffn}, "
        f"{cfg.heads}/{cfg.kv_heads} heads, vocab {cfg.vocab}",
        prompt_tokens=prompt_tokens,
        tokens=tokens,
    )

    progress("single process: loading and compiling")
    one, oracle = _one_process("tinygrad, one process", f, path, prompt, tokens, max_context, repeats, False)
    one.device_mib = [device_bytes() / 2**20]
    res.contenders.append(one)
    if batched:  # the oracle of batched chains: the same kernels as theirs
        progress("single process, batched slice: loading and compiling")
        name = "tinygrad, one process, batch-invariant kernels"
        inv, oracle = _one_process(name, f, path, prompt, tokens, max_context, repeats, True)
        res.contenders.append(inv)
        progress(f"{inv.name}: {inv.median_tok_s():.1f} tok/s")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / "gpu-bench.json").write_text(json.dumps(stamped(asdict(res)), indent=2))

    save()
    progress(f"single process: {one.median_tok_s():.1f} tok/s")
    pinning = kernels.active()
    res.kernels = pinning.summary() if pinning else "tinygrad's heuristic (no kernel table: PPHARNESS_KERNELS unset)"
    if block:
        res.block = block_cost(f"synthetic:{preset}", path, progress=progress)
    save()
    copy = None
    if packed:  # never raises: a floor it cannot measure is a missing figure
        copy = packed_bench.copy_bandwidth(device, progress=progress)
        try:
            res.packed_floor = packed_bench.packed_floor(f"synthetic:{preset}", path, copy)
        except HarnessError as exc:
            res.notes.append(f"packed floor skipped: {exc}")
        if res.packed_floor is not None and res.packed_floor.tok_s:
            progress(f"packed floor: {res.packed_floor.tok_s:.1f} tok/s ({copy.gb_s:.0f} GB/s device copy)")
        save()
    if tools is not None:  # every failure there is a failed contender (run_llamacpp catches them)
        files = llamacpp_files or out_dir
        res.llamacpp = llamacpp_bench.run_llamacpp(tools, path, types, files, tokens, repeats, progress)
        for r in res.llamacpp:
            _llamacpp_floor(r, copy)
            if r.tok_s and one.median_tok_s():
                r.one_process_over_llamacpp = one.median_tok_s() / r.tok_s
            res.contenders.append(Contender(r.name, decode_tok_s=list(r.samples_tok_s), error=r.error))
        save()

    for n in stage_counts:
        for kind in [*transports, COLOCATED]:
            c = Contender(f"tinygrad, {n}-stage chain, {kind}")
            progress(f"{c.name}: starting")
            scenario = _scenario(preset, n, "zmq" if kind == COLOCATED else kind, tokens, max_context)
            if kind == COLOCATED:  # every stage in one process on the GPU, the hidden state left on it
                scenario = scenario_from_args(base=scenario, colocated=True)
            if in_flight > 1 or batched:
                scenario = msgspec.structs.replace(
                    scenario,
                    serving=msgspec.structs.replace(
                        scenario.serving, slots=in_flight, batched=batched, max_batch=max_batch
                    ),
                )
            how = ", batched" if batched else ""
            c.name += how
            many = Contender(f"tinygrad, {n}-stage chain, {kind}{how}, {in_flight} in flight")
            with Chain(scenario, progress=lambda _: None, trace=True) as chain:
                t0 = time.monotonic()
                resp, request_s = chain.request(prompt, tokens)
                c.ttft_cold_s = request_s - decode_span(resp)
                verdict = chain.verdict(resp, oracle)
                c.tokens_match_oracle = verdict.exact
                c.mismatch = "" if verdict.exact else verdict.describe(resp.token_ids, oracle.token_ids)
                for _ in range(repeats):  # the verdict was the first request's: no digests (a host copy per hop)
                    resp, request_s = chain.request(prompt, tokens, digests=False)
                    c.decode_tok_s.append(decode_tok_s(resp))
                    c.ttft_warm_s.append(request_s - decode_span(resp))
                c.breakdown_ms = chain.trace_of(resp).p50_parts()
                progress(f"{c.name}: {c.median_tok_s():.1f} tok/s ({time.monotonic() - t0:.0f} s)")
                if in_flight > 1:
                    _serve_many(chain, many, prompt, tokens, in_flight, repeats, oracle.token_ids, progress)
            c.device_mib = [s.device_bytes / 2**20 for s in chain.reports]
            res.contenders.append(c)
            if in_flight > 1:
                many.device_mib = c.device_mib
                res.contenders.append(many)
            save()

    if hf:
        res.contenders += hf_reference(cfg, prompt_tokens, tokens, repeats, progress, res.notes)
        if in_flight > 1:
            res.contenders += hf_reference(cfg, prompt_tokens, tokens, repeats, progress, res.notes, in_flight)
    save()
    _plot(res, out / "gpu-bench.png")
    return res


def _llamacpp_floor(run: LlamaCppRun, copy: packed_bench.CopyBandwidth | None) -> None:
    """What one decode position reads of ``run``'s file, and its packed floor at ``copy``'s bandwidth."""
    if not run.file:
        return
    try:
        run.read_bytes = packed_bench.decode_read_bytes(run.file).total
    except HarnessError:  # a file this reader refuses: no floor for it, the figures stand
        return
    _, run.floor_tok_s = packed_bench.floor_of(run.read_bytes, copy.gb_s if copy else None)


def _one_process(
    name: str,
    f: GGUFFile,
    path: str,
    prompt: str,
    tokens: int,
    max_context: int,
    repeats: int,
    batched: bool,
) -> tuple[Contender, OracleResult]:
    """The unsplit model in this process (a batched slice when ``batched``): its answer with every boundary (the
    oracle), then ``repeats`` timed decodes."""
    # taps compile the same kernels as a slice without them
    single = ModelSlice(f, 0, f.config.blocks, True, True, max_context, taps=True, batched=batched)
    warm_up(single)
    c = Contender(name)
    oracle = oracle_decode(path, prompt, tokens, max_context, model=single, boundaries=True)
    c.ttft_cold_s = oracle.ttft_s
    for _ in range(repeats):
        r = oracle_decode(path, prompt, tokens, max_context, model=single)
        c.decode_tok_s.append(r.decode_tok_s)
        c.ttft_warm_s.append(r.ttft_s)
    return c, oracle


def _serve_many(
    chain: Chain,
    c: Contender,
    prompt: str,
    tokens: int,
    in_flight: int,
    repeats: int,
    expected: list[int],
    progress: Callable[[str], None],
) -> None:
    """``in_flight`` requests sent at once, ``repeats`` times: aggregate decode tokens/s (every token after each
    request's first, over the time from the first of them to the last token), every answer checked."""

    c.tokens_match_oracle = True
    for _ in range(repeats):
        served = chain.serve([Job(prompt, tokens)] * in_flight)
        for s in served:
            if s.response is None:
                raise HarnessError(f"{c.name}: a request was refused: {s.refused}")
            if s.response.token_ids != expected:
                c.tokens_match_oracle = False
                c.mismatch = f"a request answered {s.response.token_ids[:8]}..., the oracle {expected[:8]}..."
        first = min(s.token_at[0] for s in served)
        last = max(s.token_at[-1] for s in served)
        c.decode_tok_s.append(sum(len(s.token_at) - 1 for s in served) / (last - first))
        c.ttft_warm_s.append(statistics.median(s.ttft_s for s in served))
    progress(f"{c.name}: {c.median_tok_s():.1f} tok/s aggregate")


def hf_reference(
    cfg: ModelConfig,
    prompt_tokens: int,
    tokens: int,
    repeats: int,
    progress: Callable[[str], None],
    notes: list[str],
    batch: int = 1,
) -> list[Contender]:
    """HF transformers greedy decode of a random LlamaForCausalLM with the same dimensions, bf16, on the GPU: one
    request, or a batch of ``batch`` (aggregate decode tokens/s)."""
    # optional packages, absent from the test install: mypy cannot find them there (the ignores), and checks this
    # code against their own types where they are installed (unused-ignore then)
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
        from transformers import LlamaConfig, LlamaForCausalLM  # type: ignore[import-not-found, unused-ignore]
    except ImportError as exc:
        notes.append(f"HF transformers reference skipped: {exc}")
        return []
    hf_cfg = LlamaConfig(
        vocab_size=cfg.vocab,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.blocks,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=prompt_tokens + tokens + 16,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tied,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialise on the GPU: random init of 1 B parameters on the host takes minutes
        model = LlamaForCausalLM(hf_cfg).to(dtype=torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab, (batch, prompt_tokens), device="cuda")
    out = []
    for cache in ("dynamic", "static"):
        how = "compiled by generate" if cache == "static" else "eager"
        c = Contender(f"HF transformers bf16, {cache} cache ({how})" + (f", batch {batch}" if batch > 1 else ""))
        kw: dict[str, object] = {"do_sample": False, "pad_token_id": 0}
        if cache == "static":
            kw["cache_implementation"] = "static"

        def timed(new: int, kw: dict[str, object] = kw) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        progress(f"{c.name}: warming up")
        c.ttft_cold_s = timed(1)
        for _ in range(repeats):
            t1, tn = timed(1), timed(tokens)
            c.ttft_warm_s.append(t1)
            c.decode_tok_s.append(batch * (tokens - 1) / (tn - t1) if tn > t1 else 0.0)
        c.device_mib = [torch.cuda.max_memory_allocated() / 2**20]
        progress(f"{c.name}: {c.median_tok_s():.1f} tok/s")
        out.append(c)
    return out


def report(res: GpuBench) -> str:
    base = res.contenders[0].median_tok_s() if res.contenders else 0.0
    lines = [
        f"device {res.device}; model {res.model}; {res.tokens} tokens after a {res.prompt_tokens}-token prompt "
        "(medians)",
        f"{'contender':<44} {'tok/s':>8} {'x 1-proc':>9} {'TTFT cold':>10} {'TTFT warm':>10} {'= oracle':>9} "
        f"{'device MiB per stage'}",
    ]
    for c in res.contenders:
        if c.error:
            lines.append(f"{c.name:<44} {'FAILED':>8} (below)")
            continue
        match = "" if c.tokens_match_oracle is None else ("yes" if c.tokens_match_oracle else "NO")
        if c.ttft_warm_s or c.ttft_cold_s:
            warm = statistics.median(c.ttft_warm_s) if c.ttft_warm_s else float("nan")
            ttft = f"{c.ttft_cold_s:>9.2f}s {warm * 1000:>8.0f}ms"
        else:  # not measured (llama-bench times decode only)
            ttft = f"{'-':>10} {'-':>10}"
        lines.append(
            f"{c.name:<44} {c.median_tok_s():>8.1f} {c.median_tok_s() / base if base else 0:>9.2f} "
            f"{ttft} {match:>9} {', '.join(f'{m:.0f}' for m in c.device_mib)}"
        )
    for c in res.contenders:
        if c.breakdown_ms:
            parts = sorted(((k, v) for k, v in c.breakdown_ms.items() if k != "per token"), key=lambda kv: -kv[1])
            lines.append(
                f"\n{c.name}: per token p50 {c.breakdown_ms['per token']:.2f} ms; largest parts: "
                + ", ".join(f"{k} {v:.2f}" for k, v in parts[:8])
            )
    for c in res.contenders:
        if c.mismatch:
            lines.append(f"\n{c.name}: MISMATCH: {c.mismatch}")
    if res.block is not None:
        b = res.block
        floor = f"{b.floor_block_ms:.4f} ms ({b.ratio:.2f}x)" if b.floor_block_ms and b.ratio else b.floor_note
        lines.append(
            f"\ndecode block (a middle stage's step, fitted over {', '.join(map(str, b.medians_ms))} blocks): "
            f"tinygrad {b.tinygrad_block_ms:.4f} ms per block, fixed {b.tinygrad_fixed_ms:.4f} ms per step; "
            f"PyTorch fp16 GEMV floor {floor}"
        )
        lines += [f"  floor: {b.floor_note}"] if b.floor_block_ms else []
    if res.packed_floor is not None:
        lines += packed_bench.report(res.packed_floor, base)
    if res.llamacpp:
        lines += llamacpp_report(res.llamacpp, res.tokens, base)
    if res.kernels:
        lines.append(f"kernels: {res.kernels}")
    lines += res.notes
    return "\n".join(lines)


def llamacpp_report(runs: list[LlamaCppRun], tokens: int, one_tok_s: float) -> list[str]:
    """llama.cpp's section of the report: a column per type, then each failure with its stderr's last lines."""
    mib = 2**20

    def row(label: str, cell: Callable[[LlamaCppRun], str | None]) -> str:
        return f"{label:<24}" + "".join(f"{'FAILED' if r.error else cell(r) or '-':>18}" for r in runs)

    def ratio(a: float | None, b: float | None) -> str | None:
        return f"{a / b:.2f}" if a and b else None

    repeats = runs[0].repeats if runs else 0
    lines = [
        f"\nllama.cpp on the same GGUF (llama-bench -p 0 -n {tokens} -ngl 99 -r {repeats}):",
        f"{'':<24}" + "".join(f"{r.type:>18}" for r in runs),
        row("tok/s (mean ± sd)", lambda r: f"{r.tok_s or 0:.1f} ± {r.stddev_tok_s or 0:.1f}"),
        row("file MiB", lambda r: f"{r.file_bytes / mib:.0f}" + (" (quantised)" if r.quantised else "")),
        row("MiB read per token", lambda r: f"{r.read_bytes / mib:.1f}" if r.read_bytes else None),
        row("packed floor tok/s", lambda r: f"{r.floor_tok_s:.1f}" if r.floor_tok_s else None),
        row("llama.cpp / floor", lambda r: ratio(r.tok_s, r.floor_tok_s)),
        row("1-proc / llama.cpp", lambda r: ratio(one_tok_s, r.tok_s)),
    ]
    done = [r for r in runs if not r.error]
    if done:
        r = done[0]
        lines.append(
            f"  llama.cpp build {r.build or '?'}, backends {r.backends or '?'}, {r.gpu_info or 'no GPU named'}; "
            f"1-proc: tinygrad, one process, {one_tok_s:.1f} tok/s on the bench's file"
        )
    for r in runs:
        if r.error:
            lines.append(f"  {r.name} FAILED: " + r.error.replace("\n", "\n    "))
    return lines


def _plot(res: GpuBench, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    names = [c.name for c in res.contenders]
    ax.barh(names, [c.median_tok_s() for c in res.contenders], color="tab:blue")
    ax.set_xlabel("decode tokens/s (median)")
    ax.set_title(f"{res.model} on {res.device}")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
