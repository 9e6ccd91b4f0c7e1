#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PPHARNESS_CACHE=/tmp/ppcache PYTHONUNBUFFERED=1 CUDA=1
python3 -c "import tokenizers, jinja2; print('tokenizers', tokenizers.__version__)" 2>&1 | tee -a $OUT/log.txt
python3 - <<'PY' 2>&1 | tee -a $OUT/log.txt
import time
from ppharness.model.sources.files import resolve_model
from ppharness.model.gguf_file import GGUFFile
from ppharness.run.inprocess import check_splits
prompt = "Pipeline parallel inference splits a model into stages; each stage keeps the KV cache of its own layers. " * 2
for src in ("synthetic:tiny", "synthetic:small,type=q4_k", "synthetic:tiny-qwen3", "synthetic:tiny-qwen2"):
    t0 = time.time()
    path = str(resolve_model(src))
    n = GGUFFile(path).config.blocks
    oracle, checks = check_splits(path, prompt, 24, [[(0, 1), (1, n // 2), (n // 2, n)]], 256)
    print(src, "prompt tokens", oracle.prompt_tokens, "ttft_ms", round(oracle.ttft_s * 1e3, 1), "decode", round(oracle.decode_tok_s, 1),
          [("MATCH" if c.exact else "MISMATCH", c.same_kernels) for c in checks], round(time.time() - t0, 1), "s", flush=True)
PY
F=$(python3 -c "from ppharness.model.sources.files import resolve_model; print(resolve_model('synthetic:llama-3.2-1b,type=q4_k'))")
python3 - "$F" <<'PY' 2>&1 | tee -a $OUT/log.txt
import sys, time, statistics
from ppharness.model.gguf_file import GGUFFile
from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.decode.rules import warm_up
f = GGUFFile(sys.argv[1]); t0 = time.time()
m = ModelSlice(f, 0, f.config.blocks, True, True, 512); warm_up(m); print("1b q4_k load+warm", round(time.time() - t0, 1))
for n in (30, 100, 300):
    ts = []
    for _ in range(5):
        t = time.time(); m.prefill(list(range(1000, 1000 + n))); ts.append(time.time() - t)
    print("1b q4_k prefill", n, "median ms", round(statistics.median(ts) * 1e3, 1), flush=True)
PY
