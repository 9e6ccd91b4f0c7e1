#!/usr/bin/env bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PPHARNESS_CACHE=/tmp/ppcache PYTHONUNBUFFERED=1
python3 - <<'PY' | tee -a $OUT/bw.txt
import torch, statistics
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda"); y = torch.empty_like(x)
ts = []
for _ in range(20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); y.copy_(x); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
print("copy GB/s (read+write)", round(2 * (1 << 30) / statistics.median(ts) / 1e9, 1))
PY
for src in synthetic:kimi-tiny synthetic:qwen3-30b-a3b,blocks=1; do
  F=$(python3 -c "from ppharness.model.sources.files import resolve_model; print(resolve_model('$src'))") || continue
  python3 -c "from ppharness.benchmarks.packed_floor import decode_read_bytes; print('$src', 'read bytes', decode_read_bytes('$F'))" | tee -a $OUT/bw.txt
  CUDA=1 timeout 70 python3 docs/gpu-bench-runs/2026-12-04/engine.py $F f16 48 2>&1 | tail -1 | tee -a $OUT/engine.jsonl
done
