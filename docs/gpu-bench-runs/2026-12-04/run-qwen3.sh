#!/usr/bin/env bash
src=$1; tokens=${2:-64}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PPHARNESS_CACHE=/tmp/ppcache PYTHONUNBUFFERED=1
(bash .llamacpp/build.sh .llamacpp/llama.cpp-src.tar.xz /tmp/lcpp cuda > $OUT/build.log 2>&1; echo "build exit $?" >> $OUT/build.log) &
build=$!
t=$(date +%s)
F=$(python3 -c "from ppharness.model.sources.files import resolve_model; print(resolve_model('$src'))") || exit 1
echo "model $F $(du -h $F | cut -f1) in $(( $(date +%s) - t )) s"
wait $build; tail -1 $OUT/build.log
B=/tmp/lcpp/build/bin
$B/llama-quantize $F /tmp/m-Q4_K_M.gguf Q4_K_M > /tmp/q.log 2>&1 || tail -5 /tmp/q.log
ls -la /tmp/m-*.gguf
run() { CUDA=1 timeout 200 python3 docs/gpu-bench-runs/2026-12-04/engine.py "$@" 2>&1 | tail -2 | tee -a $OUT/engine.jsonl; }
run /tmp/m-Q4_K_M.gguf packed $tokens
run $F f16 $tokens
for g in $F /tmp/m-Q4_K_M.gguf; do
  timeout 120 $B/llama-bench -m $g -p 0 -n $tokens -ngl 99 -r 3 -o md 2>/dev/null | grep -E "tg" | tee -a $OUT/llamabench.md
done
