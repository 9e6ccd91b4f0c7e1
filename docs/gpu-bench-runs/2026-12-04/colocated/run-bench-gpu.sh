#!/usr/bin/env bash
# co-located stages on the H200: bench gpu's chains (separate processes over zmq, and co-located in one process)
# beside one process, tuned kernels; $1: preset, $2: stages, $3: tokens
preset=${1:-llama-3.2-1b}; stages=${2:-5}; tokens=${3:-128}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PPHARNESS_CACHE=/tmp/ppcache PYTHONUNBUFFERED=1 CUDA=1
export PPHARNESS_KERNELS=$PWD/scenarios/kernels/h200-cuda-tinygrad-0.12.0-beam2.json
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $OUT/log.txt
timeout 560 python3 -m ppharness.cli bench gpu --device cuda --preset "$preset" --stages "$stages" --transport zmq \
  --tokens "$tokens" --repeats 3 --no-hf --no-block --no-packed-floor --out $OUT/bench 2>&1 | tee -a $OUT/log.txt | tail -40
