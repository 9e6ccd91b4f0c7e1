"""The packed-weights floor of a decode position: the bytes a GGUF file's weights occupy *as stored* that one token
reads, over the device's copy bandwidth measured in the same run.

Beside ``floor.py``'s fp16 GEMV floor (the same shapes as fp16 matrices, read by cuBLAS), this floor takes the file's
own encoding: an F16 file reads 2 bytes a weight, a Q8_0 file 34 bytes per 32, a Q4_K_M file about 4.8 bits. What
one decode position reads (``decode_read_bytes``):

- every tensor of every block (``blk.N.*``: attention, norms, a dense FFN, a MoE block's router and shared expert),
  except the routed experts (``*_exps``), of which only ``experts_used`` experts' bytes count;
- the output head (``output.weight``; a model with tied embeddings reads the whole ``token_embd.weight`` as its head)
  and one row of ``token_embd.weight`` (the token's embedding, counted once more when tied);
- every other tensor as a whole (the final norm, rope frequency factors).

The KV cache and the activations are left out (a few hundred KB at bench lengths), so no engine can beat the floor.
The bandwidth is that of a device-to-device copy of a large buffer (``copy_bandwidth``): PyTorch's ``copy_`` timed
by CUDA events where PyTorch with CUDA is installed (in a process of its own, as ``floor.py``), else tinygrad's copy
kernel on the bench's device; a copy reads N bytes and writes N, and the bandwidth is 2N over its median time (as
CUDA's ``bandwidthTest`` reports device-to-device), the rate the memory moves bytes at.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ppharness.benchmarks.floor import measured_apart
from ppharness.model.gguf.header import read_gguf

COPY_BYTES = 1 << 30  # each of the copy's two buffers on an accelerator: far above any L2 cache
COPY_BYTES_CPU = 64 << 20  # on the host (a CPU device): above its last-level cache, quick to run
COPY_TIMEOUT_S = 300


@dataclass
class DecodeBytes:
    """What one decode position reads of a GGUF file's tensors, as stored (module docstring), by part."""

    path: str
    total: int
    blocks: int  # blk.* tensors other than the routed experts
    experts: int  # the routed experts: experts_used of each *_exps tensor's experts
    head: int  # output.weight, or the whole token_embd.weight when the embeddings are tied
    embedding_row: int  # one row of token_embd.weight
    other: int  # every other tensor (the final norm, rope factors)
    experts_used: int  # 0 for a dense model
    tensor_bytes: int  # every tensor of the file, as stored


def decode_read_bytes(path: str | Path) -> DecodeBytes:
    """The bytes of ``path``'s tensors, as stored, that one decode position reads (module docstring).
    ``ModelError`` for a file that is not a readable GGUF."""
    contents = read_gguf(path, arrays=False)
    arch = contents.kv.get("general.architecture", "")
    used = int(contents.kv.get(f"{arch}.expert_used_count", 0) or 0)
    names = {t.name for t in contents.tensors}
    blocks = experts = head = row = other = 0
    for t in contents.tensors:
        if t.name == "token_embd.weight":
            row += t.n_bytes // (t.dims[-1] if len(t.dims) >= 2 else 1)  # rows are the outermost dimension
            if "output.weight" not in names:  # tied: the embedding is the head too
                head += t.n_bytes
        elif t.name == "output.weight":
            head += t.n_bytes
        elif "_exps." in t.name and len(t.dims) >= 2:  # stacked routed experts: one per outermost index
            n_experts = t.dims[-1]
            experts += t.n_bytes // n_experts * (min(used, n_experts) if used else n_experts)
        elif t.name.startswith("blk."):
            blocks += t.n_bytes
        else:
            other += t.n_bytes
    return DecodeBytes(
        path=str(path),
        total=blocks + experts + head + row + other,
        blocks=blocks,
        experts=experts,
        head=head,
        embedding_row=row,
        other=other,
        experts_used=used,
        tensor_bytes=sum(t.n_bytes for t in contents.tensors),
    )


@dataclass
class CopyBandwidth:
    gb_s: float | None  # None: not measured (``method`` says why)
    method: str
    buffer_bytes: int


@dataclass
class PackedFloor:
    model: str
    read: DecodeBytes
    copy: CopyBandwidth
    ms_per_token: float | None = None
    tok_s: float | None = None
    notes: list[str] = field(default_factory=list)


def floor_of(read_bytes: int, gb_s: float | None) -> tuple[float | None, float | None]:
    """(ms per token, tokens/s) of reading ``read_bytes`` at ``gb_s``; (None, None) without a bandwidth."""
    if not gb_s or gb_s <= 0 or read_bytes <= 0:
        return None, None
    ms = read_bytes / (gb_s * 1e9) * 1e3
    return ms, 1e3 / ms


def packed_floor(model: str, path: str | Path, copy: CopyBandwidth) -> PackedFloor:
    """``path``'s packed floor at the bandwidth ``copy`` measured."""
    read = decode_read_bytes(path)
    ms, tok_s = floor_of(read.total, copy.gb_s)
    return PackedFloor(model=model, read=read, copy=copy, ms_per_token=ms, tok_s=tok_s)


def copy_bandwidth(
    device: str,
    n_bytes: int | None = None,
    use_torch: bool = True,
    progress: Callable[[str], None] | None = None,
) -> CopyBandwidth:
    """The device's copy bandwidth (module docstring): PyTorch's on a CUDA device where it is installed, else
    tinygrad's on its device (``DEV``); never raises, ``gb_s`` None with the reason when neither could measure."""
    say = progress or (lambda _: None)
    host = device.lower() in ("cpu", "clang", "llvm")
    n = n_bytes or (COPY_BYTES_CPU if host else COPY_BYTES)
    why: list[str] = []
    if use_torch and not host:
        if importlib.util.find_spec("torch") is None:
            why.append("no PyTorch here")
        else:
            say(f"packed floor: timing a {n / 2**20:.0f} MiB device-to-device copy with PyTorch")
            gb_s, note = _torch_copy(n)
            if gb_s:
                return CopyBandwidth(gb_s, note, n)
            why.append(note)
    say(f"packed floor: timing a {n / 2**20:.0f} MiB device-to-device copy with tinygrad")
    try:
        gb_s, note = _tinygrad_copy_here(n)
    except Exception as exc:  # any failure of the measurement is a missing figure, not a failed bench
        why.append(f"tinygrad's copy failed: {type(exc).__name__}: {exc}")
        return CopyBandwidth(None, "; ".join(why), n)
    return CopyBandwidth(gb_s, note + (f" (PyTorch: {'; '.join(why)})" if why else ""), n)


def _torch_copy(n_bytes: int) -> tuple[float | None, str]:
    """PyTorch's copy bandwidth, measured in a process of its own (``floor.measured_apart``)."""
    return measured_apart("ppharness.benchmarks.packed_floor", str(n_bytes), "PyTorch's copy", COPY_TIMEOUT_S)


def _torch_copy_here(n_bytes: int, copies: int = 10, trials: int = 7) -> tuple[float | None, str]:
    try:
        import torch  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None, "no PyTorch here"
    if not torch.cuda.is_available():
        return None, "PyTorch sees no CUDA GPU"
    dev = torch.device("cuda")
    src = torch.ones(n_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(copies):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / copies)
    s = statistics.median(times)
    gb_s = 2 * n_bytes / s / 1e9
    note = (
        f"PyTorch {torch.__version__} copy_ of {n_bytes / 2**20:.0f} MiB on {torch.cuda.get_device_name(dev)}, "
        f"median of {trials} x {copies}: {s * 1e3:.3f} ms, {gb_s:.0f} GB/s (read + write)"
    )
    return gb_s, note


def _tinygrad_copy_here(n_bytes: int, copies: int = 5, trials: int = 5) -> tuple[float, str]:
    """tinygrad's copy kernel (``dst.assign(src)``) on its device, ``copies`` queued per synchronisation so that
    Python's scheduling overlaps the device's work."""
    from tinygrad.device import Device
    from tinygrad.dtype import dtypes
    from tinygrad.tensor import Tensor

    n = max(1, n_bytes // 4)
    src = Tensor.empty(n, dtype=dtypes.uint32).contiguous().realize()
    dst = Tensor.empty(n, dtype=dtypes.uint32).contiguous().realize()
    sync: Callable[[], None] = Device[src.device if isinstance(src.device, str) else src.device[0]].synchronize
    for _ in range(2):
        dst.assign(src).realize()
    sync()
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        for _ in range(copies):
            dst.assign(src).realize()
        sync()
        times.append((time.perf_counter() - t0) / copies)
    s = statistics.median(times)
    gb_s = 2 * n * 4 / s / 1e9
    note = (
        f"tinygrad copy kernel of {n * 4 / 2**20:.0f} MiB on {src.device}, median of {trials} x {copies} "
        f"(host-timed): {s * 1e3:.3f} ms, {gb_s:.0f} GB/s (read + write)"
    )
    return gb_s, note


def report(floor: PackedFloor, one_process_tok_s: float = 0.0) -> list[str]:
    """The floor's lines for ``bench gpu``'s report."""
    r, mib = floor.read, 2**20
    parts = f"blocks {r.blocks / mib:.1f}"
    if r.experts_used:
        parts += f", routed experts {r.experts / mib:.1f} ({r.experts_used} per block)"
    parts += f", head {r.head / mib:.1f}, embedding row {r.embedding_row / mib:.3f}, other {r.other / mib:.3f}"
    lines = [
        f"\npacked floor: {r.total / mib:.1f} MiB of the file's {r.tensor_bytes / mib:.1f} MiB read per token ({parts})"
    ]
    if floor.ms_per_token and floor.tok_s:
        rate = ""
        if one_process_tok_s:
            rate = f"; one process {one_process_tok_s:.1f} tok/s = {one_process_tok_s / floor.tok_s:.2f} of it"
        lines.append(
            f"  at {floor.copy.gb_s:.0f} GB/s device copy: {floor.ms_per_token:.4f} ms/token, "
            f"{floor.tok_s:.1f} tok/s{rate}"
        )
    else:
        lines.append("  no copy bandwidth, no floor")
    lines.append(f"  copy: {floor.copy.method}")
    lines += [f"  note: {n}" for n in floor.notes]
    return lines


if __name__ == "__main__":  # _torch_copy's measuring process: the buffer's bytes in, [GB/s, note] as JSON out
    print(json.dumps(_torch_copy_here(int(sys.argv[1]))))
