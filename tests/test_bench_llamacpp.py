"""``bench gpu``'s llama.cpp contender and packed-weights floor, on the CPU: llama-bench's JSON, the tools' lookup
and its errors, the subprocess path end to end through fake ``llama-bench`` and ``llama-quantize`` scripts, the
report, and the bytes one decode position reads of a GGUF file, counted independently from its tensors."""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

import gguf
import pytest
from click.testing import CliRunner

from ppharness.benchmarks import gpu as gpu_bench
from ppharness.benchmarks import llamacpp, packed_floor
from ppharness.benchmarks.gpu import Contender, GpuBench
from ppharness.benchmarks.llamacpp import LlamaCppRun, Tools
from ppharness.cli import main as cli_main
from ppharness.errors import HarnessError
from ppharness.model.synthetic.spec import ModelSpec
from ppharness.model.synthetic.writer import make_synthetic

# stdout of `llama-bench -m model.gguf -p 0 -n 128 -ngl 99 -r 3 -o json` in the format of llama-bench's json_printer
# (tools/llama-bench/llama-bench.cpp: test::get_fields(), then samples_ns and samples_ts), one decode test
SAMPLE = """[
  {
    "build_commit": "4f3a1c2",
    "build_number": 6523,
    "cpu_info": "AMD EPYC 9654 96-Core Processor",
    "gpu_info": "NVIDIA H200",
    "backends": "CUDA",
    "model_filename": "/tmp/ppcache/synthetic-16x2048-v128256-s0.gguf",
    "model_type": "llama 1B F16",
    "model_size": 2471645184,
    "model_n_params": 1235814400,
    "n_batch": 2048,
    "n_ubatch": 512,
    "n_threads": 16,
    "cpu_mask": "0x0",
    "cpu_strict": false,
    "poll": 50,
    "type_k": "f16",
    "type_v": "f16",
    "n_gpu_layers": 99,
    "n_cpu_moe": 0,
    "split_mode": "layer",
    "main_gpu": 0,
    "no_kv_offload": false,
    "flash_attn": -1,
    "devices": "auto",
    "tensor_split": "0.00",
    "tensor_buft_overrides": "none",
    "load_mode": "mmap",
    "embeddings": false,
    "no_op_offload": 0,
    "no_host": false,
    "fit_target": 0,
    "fit_min_ctx": 0,
    "n_prompt": 0,
    "n_gen": 128,
    "n_depth": 0,
    "test_time": "2026-12-04T10:12:33Z",
    "avg_ns": 199295512,
    "stddev_ns": 612303,
    "avg_ts": 642.264125,
    "stddev_ts": 1.972466,
    "samples_ns": [ 198621837, 199448925, 199815774 ],
    "samples_ts": [ 644.44, 641.769, 640.583 ]
  }
]
"""


def test_llama_bench_json_is_parsed():
    s = llamacpp.parse_bench_json(SAMPLE)
    assert s.avg_ts == pytest.approx(642.264125) and s.stddev_ts == pytest.approx(1.972466)
    assert s.samples_ts == [644.44, 641.769, 640.583] and s.n_gen == 128
    assert s.model_type == "llama 1B F16" and s.model_size == 2471645184 and s.backends == "CUDA"
    assert s.gpu_info == "NVIDIA H200" and s.build == "4f3a1c2 (6523)"
    # log lines before the array (an older build printing to stdout) are stepped over
    assert llamacpp.parse_bench_json("ggml_cuda_init: found 1 CUDA devices\nmain: loading\n" + SAMPLE).avg_ts > 600


def test_llama_bench_json_without_means_or_decode_test():
    doc = json.loads(SAMPLE)
    for k in ("avg_ts", "stddev_ts", "samples_ts"):
        del doc[0][k]
    s = llamacpp.parse_bench_json(json.dumps(doc))  # tokens/s from samples_ns and n_gen
    assert s.samples_ts == pytest.approx([1e9 * 128 / ns for ns in doc[0]["samples_ns"]])
    assert s.avg_ts == pytest.approx(sum(s.samples_ts) / 3)
    prompt = json.loads(SAMPLE)
    prompt[0] |= {"n_prompt": 512, "n_gen": 0}
    with pytest.raises(ValueError, match="no decode test"):
        llamacpp.parse_bench_json(json.dumps(prompt))
    with pytest.raises(ValueError, match="no JSON array"):
        llamacpp.parse_bench_json("error: failed to load model\n")


def _exe(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text or "#!/bin/sh\nexit 0\n")
    path.chmod(0o755)
    return path


def test_a_directory_without_llama_bench_is_refused_naming_where_and_how(tmp_path):
    (tmp_path / "tools" / "llama-bench").mkdir(parents=True)  # the source tree's folder of that name: not it
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-bench").write_text("not executable")
    with pytest.raises(HarnessError) as err:
        llamacpp.find_tools(tmp_path, need_quantize=False)
    msg = str(err.value)
    assert "no executable llama-bench" in msg and str(tmp_path / "build" / "bin" / "llama-bench") in msg
    assert "build.sh ARCHIVE DEST cuda" in msg
    with pytest.raises(HarnessError, match="not a directory"):
        llamacpp.find_tools(tmp_path / "absent", need_quantize=False)


def test_the_tools_are_found_where_a_build_puts_them(tmp_path):
    bench = _exe(tmp_path / "build" / "bin" / "llama-bench")
    assert llamacpp.find_tools(tmp_path, need_quantize=False) == Tools(bench, None)
    with pytest.raises(HarnessError, match="llama-quantize is not"):
        llamacpp.find_tools(tmp_path, need_quantize=True)
    quantize = _exe(tmp_path / "elsewhere" / "deep" / "llama-quantize")  # anywhere under DIR
    assert llamacpp.find_tools(tmp_path, need_quantize=True) == Tools(bench, quantize)
    direct = _exe(tmp_path / "flat" / "llama-bench")
    assert llamacpp.find_tools(tmp_path / "flat", need_quantize=False).bench == direct


def test_types_are_llama_quantize_names():
    assert llamacpp.parse_types(" f16, q8_0,Q4_K_M,f16") == ["F16", "Q8_0", "Q4_K_M"]
    with pytest.raises(HarnessError, match="unknown type.*Q9_9.*Q4_K_M"):
        llamacpp.parse_types("f16,q9_9")
    assert llamacpp.synthetic_file_type("synthetic:tiny") == "F16"


FAKE_BENCH = """#!{python}
# a stand-in for llama-bench: logs its arguments, then answers by the model file's name
import json, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(["bench"] + args) + "\\n")
model = args[args.index("-m") + 1]
n, r = int(args[args.index("-n") + 1]), int(args[args.index("-r") + 1])
print("llama_model_loader: loaded meta data", file=sys.stderr)
if model.endswith(".q8_0.gguf"):
    print("ggml_cuda_init: found 1 CUDA devices", file=sys.stderr)
    print("llama_model_load: error loading model: tensor type 8 not supported", file=sys.stderr)
    sys.exit(3)
if model.endswith(".q4_k_m.gguf"):
    time.sleep(30)
doc = json.loads({sample!r})
doc[0].update(model_filename=model, n_gen=n, samples_ts=[500.0 + i for i in range(r)], avg_ts=500.0 + (r - 1) / 2)
print(json.dumps(doc, indent=2))
"""

FAKE_QUANTIZE = """#!{python}
# a stand-in for llama-quantize: logs its arguments and copies the file
import json, shutil, sys
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(json.dumps(["quantize"] + args) + "\\n")
src, dst, kind = [a for a in args if not a.startswith("--")]
shutil.copyfile(src, dst)
"""


@pytest.fixture
def fake_build(tmp_path):
    """A llama.cpp "build" of two Python scripts, and the log of their calls."""
    log = tmp_path / "calls.jsonl"
    fmt = {"python": sys.executable, "log": str(log), "sample": SAMPLE}
    _exe(tmp_path / "llama.cpp" / "build" / "bin" / "llama-bench", FAKE_BENCH.format(**fmt))
    _exe(tmp_path / "llama.cpp" / "build" / "bin" / "llama-quantize", FAKE_QUANTIZE.format(**fmt))

    def calls() -> list[list[str]]:
        return [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []

    return tmp_path / "llama.cpp", calls


@pytest.fixture(scope="module")
def tiny_file(tmp_path_factory):
    return make_synthetic(ModelSpec(blocks=2), tmp_path_factory.mktemp("model") / "tiny.gguf")


def test_llama_bench_runs_on_the_file_and_its_quantised_copies(fake_build, tiny_file, tmp_path):
    """The file's own type as it is, Q8_0 quantised once into the files directory (its llama-bench fails: a failed
    entry with stderr's last lines), Q4_K_M past its timeout: the F16 figures stand."""
    build, calls = fake_build
    tools = llamacpp.find_tools(build, need_quantize=True)
    files = tmp_path / "files"
    lines: list[str] = []
    runs = llamacpp.run_llamacpp(
        tools, tiny_file, ["F16", "Q8_0", "Q4_K_M"], files, 16, 3, lines.append, bench_timeout=2
    )
    f16, q8, q4 = runs
    assert f16.file == str(tiny_file) and not f16.quantised and not f16.error
    assert f16.tok_s == pytest.approx(501.0) and f16.samples_tok_s == [500.0, 501.0, 502.0]
    assert f16.model_type == "llama 1B F16" and f16.file_bytes == tiny_file.stat().st_size
    assert f16.command == [str(tools.bench), "-m", str(tiny_file), "-p", "0", "-n", "16", "-ngl", "99", "-r", "3"] + [
        "-o",
        "json",
    ]
    assert q8.quantised and q8.file == str(files / "tiny.q8_0.gguf") and Path(q8.file).is_file()
    assert q8.tok_s is None and "exited 3" in q8.error and "tensor type 8 not supported" in q8.error
    assert "did not finish in 2 s" in q4.error and q4.tok_s is None
    quantised = [c for c in calls() if c[0] == "quantize"]
    assert quantised == [
        ["quantize", str(tiny_file), str(files / "tiny.q8_0.gguf") + f".{os.getpid()}.tmp", "Q8_0"],
        ["quantize", str(tiny_file), str(files / "tiny.q4_k_m.gguf") + f".{os.getpid()}.tmp", "Q4_K_M"],
    ]
    assert not list(files.glob("*.tmp")) and any("FAILED" in ln for ln in lines)
    assert any("quantising tiny.gguf to Q8_0" in ln for ln in lines)

    # a second run makes nothing again
    lines.clear()
    again = llamacpp.run_llamacpp(tools, tiny_file, ["Q8_0"], files, 16, 1, lines.append)
    assert "exited 3" in again[0].error and len([c for c in calls() if c[0] == "quantize"]) == 2
    assert any("Q8_0: reusing" in ln for ln in lines)


def test_the_report_sets_llama_cpp_beside_the_others():
    runs = [
        LlamaCppRun("F16", "/m.gguf", False, 2**30, 128, 3, tok_s=400.0, stddev_tok_s=2.0, samples_tok_s=[398, 402]),
        LlamaCppRun("Q8_0", "/m.q8_0.gguf", True, 2**29, tok_s=500.0, samples_tok_s=[500.0], read_bytes=2**29),
        LlamaCppRun("Q4_K_M", "", True, error="llama-quantize to Q4_K_M exited 1; stderr's last lines:\nno space"),
    ]
    runs[0].read_bytes, runs[0].floor_tok_s = 2**30, 4000.0
    one = Contender("tinygrad, one process", decode_tok_s=[200.0], ttft_cold_s=1.0, ttft_warm_s=[0.1])
    res = GpuBench("cuda", "m", 32, 128, contenders=[one], llamacpp=runs)
    res.contenders += [Contender(r.name, decode_tok_s=list(r.samples_tok_s), error=r.error) for r in runs]
    res.packed_floor = packed_floor.PackedFloor(
        "m",
        packed_floor.DecodeBytes("/m.gguf", 2**30, 2**29, 0, 2**29, 4096, 0, 0, 2**30),
        packed_floor.CopyBandwidth(4000.0, "a copy", 2**30),
        *packed_floor.floor_of(2**30, 4000.0),
    )
    text = gpu_bench.report(res)
    print(text)
    rows = {ln[:44].strip(): ln[44:].split() for ln in text.splitlines()[2:6]}
    assert rows["llama.cpp F16 (llama-bench)"][:2] == ["400.0", "2.00"]  # the median sample, x 1-proc
    assert rows["llama.cpp Q8_0 (llama-bench)"][:4] == ["500.0", "2.50", "-", "-"]  # no TTFT measured
    assert rows["llama.cpp Q4_K_M (llama-bench)"][0] == "FAILED"
    assert "llama-bench -p 0 -n 128 -ngl 99 -r 3" in text and "400.0 ± 2.0" in text
    assert "FAILED: llama-quantize to Q4_K_M exited 1" in text and "no space" in text
    header = next(ln for ln in text.splitlines() if ln.strip().startswith("F16"))
    assert header.split() == ["F16", "Q8_0", "Q4_K_M"]
    ratio = next(ln for ln in text.splitlines() if ln.startswith("1-proc / llama.cpp"))
    assert ratio.split()[-3:] == ["0.50", "0.40", "FAILED"]
    assert "packed floor: 1024.0 MiB" in text and "3725.3 tok/s" in text  # 4000 GB/s over 2**30 bytes
    assert json.dumps(asdict(res))  # the JSON takes it all


def test_a_missing_llama_bench_fails_the_command_before_any_work(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli_main, ["bench", "gpu", "--device", "cpu", "--preset", "tiny", "--llamacpp", str(empty), "--out", str(out)]
    )
    assert result.exit_code == 1, result.output
    assert "no executable llama-bench" in result.output and "build.sh" in result.output
    assert not out.exists()
    alone = CliRunner().invoke(cli_main, ["bench", "gpu", "--llamacpp-types", "q8_0", "--out", str(out)])
    assert alone.exit_code == 2 and "need --llamacpp DIR" in alone.output


# --- the packed floor: bytes one decode position reads -------------------------------------------------------------


def _reader_tensors(path: Path) -> dict[str, tuple[int, list[int]]]:
    """name -> (bytes as stored, dims innermost first) by the gguf package's reader, not ppharness's."""
    r = gguf.GGUFReader(path)
    return {t.name: (int(t.n_bytes), [int(d) for d in t.shape]) for t in r.tensors}


@pytest.mark.parametrize(("wtype", "tied"), [("f16", False), ("f16", True), ("q8_0", False)])
def test_a_dense_model_reads_every_block_the_head_and_one_embedding_row(tmp_path, wtype, tied):
    spec = ModelSpec(blocks=2, type=wtype, tied_embeddings=tied)
    path = make_synthetic(spec, tmp_path / "dense.gguf")
    got = packed_floor.decode_read_bytes(path)

    # from the spec: a matrix of r x c weights is r * c * 2 bytes in F16, r * c / 32 * 34 in Q8_0; norms are F32
    def mat(r: int, c: int) -> int:
        return r * c * 2 if wtype == "f16" else r * c // 32 * 34

    d, f, hd = spec.dim, spec.ffn, spec.dim // spec.heads
    block = mat(spec.heads * hd, d) + 2 * mat(spec.kv_heads * hd, d) + mat(d, spec.heads * hd) + 3 * mat(f, d)
    block += 2 * d * 4  # attn_norm, ffn_norm
    head, row = mat(spec.vocab, d), mat(1, d)
    assert got.blocks == spec.blocks * block and got.head == head and got.embedding_row == row
    assert got.experts == 0 and got.experts_used == 0 and got.other == d * 4  # output_norm
    assert got.total == spec.blocks * block + head + row + d * 4

    # from the file, by another reader: everything but the embedding (except one of its rows; all of it if tied)
    tensors = _reader_tensors(path)
    embd = tensors["token_embd.weight"][0]
    assert got.tensor_bytes == sum(b for b, _ in tensors.values())
    assert got.total == got.tensor_bytes - embd + embd // spec.vocab + (embd if tied else 0)


@pytest.mark.parametrize("arch", ["qwen3moe", "qwen2moe"])
def test_a_moe_model_reads_only_the_used_experts(tmp_path, arch):
    shared = 64 if arch == "qwen2moe" else 0
    spec = ModelSpec(blocks=3, arch=arch, experts=8, experts_used=2, expert_ffn=96, shared_ffn=shared)
    path = make_synthetic(spec, tmp_path / "moe.gguf")
    got = packed_floor.decode_read_bytes(path)
    tensors = _reader_tensors(path)
    exps = {n: t for n, t in tensors.items() if "_exps" in n}
    assert len(exps) == 3 * spec.blocks and all(dims[-1] == 8 for _, dims in exps.values())
    # each routed expert of each of the 3 expert tensors: expert_ffn x dim F16 weights; 2 of the 8 are read
    assert (
        got.experts == spec.blocks * 3 * 2 * (spec.expert_ffn * spec.dim * 2) == sum(b for b, _ in exps.values()) // 4
    )
    assert got.experts_used == 2
    rest = {n: b for n, (b, _) in tensors.items() if n.startswith("blk.") and n not in exps}
    assert got.blocks == sum(rest.values())  # attention, norms, the router (and the shared expert)
    assert any("ffn_gate_inp" in n for n in rest) and (not shared or any("shexp" in n for n in rest))
    embd, _ = tensors["token_embd.weight"]
    everything = sum(b for b, _ in tensors.values())
    assert got.total == everything - embd + embd // spec.vocab - sum(b for b, _ in exps.values()) * 6 // 8


def test_the_floor_is_bytes_over_bandwidth():
    ms, tok_s = packed_floor.floor_of(2 * 10**9, 4000.0)  # 2 GB at 4 TB/s: 0.5 ms
    assert ms == pytest.approx(0.5) and tok_s == pytest.approx(2000.0)
    assert packed_floor.floor_of(10**9, None) == (None, None)


def test_the_copy_bandwidth_is_measured_with_tinygrad_where_no_pytorch_is(tmp_path):
    bw = packed_floor.copy_bandwidth("cpu", n_bytes=8 << 20)
    assert bw.gb_s and 0.1 < bw.gb_s < 10_000 and "tinygrad copy kernel of 8 MiB" in bw.method, bw
    assert math.isfinite(bw.gb_s)


@pytest.mark.slow  # about 40 s on two cores: the single process and a 2-stage chain compile on the CPU
def test_bench_gpu_runs_llama_cpp_and_the_packed_floor_end_to_end(fake_build, tmp_path):
    """`ppharness bench gpu --device cpu --preset tiny` with the fake build: llama-bench on the file the single
    process decodes (and on a quantised copy), the packed floor, every contender in the JSON and the table."""
    import subprocess

    build, calls = fake_build
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "ppharness.cli", "bench", "gpu", "--device", "cpu", "--preset", "tiny"]
        + ["--stages", "2", "--transport", "zmq", "--tokens", "8", "--prompt-tokens", "8", "--repeats", "1"]
        + ["--no-hf", "--no-block", "--llamacpp", str(build), "--llamacpp-types", "f16,q8_0", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-4000:]
    doc = json.loads((out / "gpu-bench.json").read_text())
    f16, q8 = doc["llamacpp"]
    assert f16["tok_s"] and not f16["error"] and q8["error"] and "exited 3" in q8["error"]  # the fake fails on Q8_0
    benched = [c[c.index("-m") + 1] for c in calls() if c[0] == "bench"]
    assert benched == [f16["file"], q8["file"]] and f16["file"] == doc["packed_floor"]["read"]["path"]
    assert f16["one_process_over_llamacpp"] == pytest.approx(doc["contenders"][0]["decode_tok_s"][0] / f16["tok_s"])
    assert doc["packed_floor"]["tok_s"] and f16["floor_tok_s"] == pytest.approx(doc["packed_floor"]["tok_s"])
    names = [c["name"] for c in doc["contenders"]]
    assert names[1:3] == ["llama.cpp F16 (llama-bench)", "llama.cpp Q8_0 (llama-bench)"]
    assert "tinygrad, 2-stage chain, zmq" in names  # the chain ran after llama.cpp's failure
    assert "packed floor:" in run.stdout and "1-proc / llama.cpp" in run.stdout


def test_the_copy_bandwidth_prefers_pytorch_and_falls_back_to_tinygrad(monkeypatch):
    monkeypatch.setattr(packed_floor.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(packed_floor, "_tinygrad_copy_here", lambda n: (100.0, f"tinygrad {n}"))
    monkeypatch.setattr(packed_floor, "_torch_copy", lambda n: (4000.0, "PyTorch copy_"))
    assert packed_floor.copy_bandwidth("cuda", 1 << 20) == packed_floor.CopyBandwidth(4000.0, "PyTorch copy_", 1 << 20)
    monkeypatch.setattr(packed_floor, "_torch_copy", lambda n: (None, "PyTorch sees no CUDA GPU"))
    bw = packed_floor.copy_bandwidth("cuda", 1 << 20)
    assert bw.gb_s == 100.0 and bw.method == f"tinygrad {1 << 20} (PyTorch: PyTorch sees no CUDA GPU)"

    def broken(n: int) -> tuple[float, str]:
        raise RuntimeError("no device")

    monkeypatch.setattr(packed_floor, "_tinygrad_copy_here", broken)
    bw = packed_floor.copy_bandwidth("cuda", 1 << 20)  # never raises: no figure, and why
    assert bw.gb_s is None and "no CUDA GPU" in bw.method and "RuntimeError: no device" in bw.method
