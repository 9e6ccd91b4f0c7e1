"""One-process decode of one GGUF file: the median per-token time and the device bytes of the weights held.

usage: python engine.py FILE {packed,f16} TOKENS   (CUDA=1 for the GPU)
"""

import json
import os
import statistics
import sys
import time

import numpy as np

from ppharness.model.engine.slicing import ModelSlice
from ppharness.model.gguf_file import GGUFFile

path, weights, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
t0 = time.perf_counter()
f = GGUFFile(path)
m = ModelSlice(f, 0, f.config.blocks, True, True, max_context=512, weights=weights)
load = time.perf_counter() - t0
prompt = [int(x) for x in np.random.default_rng(0).integers(10, f.config.vocab - 10, 32)]
t1 = time.perf_counter()
tok = m.prefill(prompt)
prefill = time.perf_counter() - t1
times, toks = [], [tok]
for pos in range(len(prompt), len(prompt) + tokens):
    t = time.perf_counter()
    tok = m.decode([tok], pos)
    times.append(time.perf_counter() - t)
    toks.append(tok)
steady = times[3:]
out = {
    "file": os.path.basename(path),
    "weights": weights,
    "fused": getattr(m, "fused", None),
    "load_s": round(load, 1),
    "prefill_s": round(prefill, 2),
    "ms_per_token_median": round(statistics.median(steady) * 1e3, 4),
    "tok_s": round(1 / statistics.median(steady), 1),
    "weight_bytes": m.weight_bytes,
    "tokens": toks[:16],
}
print(json.dumps(out), flush=True)
