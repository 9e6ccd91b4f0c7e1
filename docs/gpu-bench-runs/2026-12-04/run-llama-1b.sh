#!/usr/bin/env bash
# usage: bash .gpu/run.sh SYNTHETIC_SOURCE TOKENS   (on the GPU machine; results under $OUT)
src=$1; tokens=${2:-128}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PPHARNESS_CACHE=/tmp/ppcache PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
(bash .llamacpp/build.sh .llamacpp/llama.cpp-src.tar.xz /tmp/lcpp cuda > $OUT/build.log 2>&1; echo "build exit $?" >> $OUT/build.log) &
build=$!
t=$(date +%s)
F=$(python3 -c "from ppharness.model.sources.files import resolve_model; print(resolve_model('$src'))") || exit 1
echo "model $F $(du -h $F | cut -f1) in $(( $(date +%s) - t )) s"
wait $build; tail -3 $OUT/build.log
B=/tmp/lcpp/build/bin
for q in Q8_0 Q4_K_M; do $B/llama-quantize $F /tmp/m-$q.gguf $q > /tmp/q-$q.log 2>&1 || tail -5 /tmp/q-$q.log; done
ls -la /tmp/m-*.gguf
run() { CUDA=1 timeout 300 python3 docs/gpu-bench-runs/2026-12-04/engine.py "$@" 2>&1 | tail -3 | tee -a $OUT/engine.jsonl; }
run $F f16 $tokens
run /tmp/m-Q4_K_M.gguf packed $tokens
run /tmp/m-Q8_0.gguf packed $tokens
run /tmp/m-Q4_K_M.gguf f16 $tokens
for g in $F /tmp/m-Q8_0.gguf /tmp/m-Q4_K_M.gguf; do
  timeout 240 $B/llama-bench -m $g -p 0 -n $tokens -ngl 99 -r 3 -o md 2>/dev/null | grep -E "tg|model" | tee -a $OUT/llamabench.md
done
