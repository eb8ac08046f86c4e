#!/usr/bin/env bash
# The Llama-3.1-8B-architecture part of multi_gpu_h200x2.sh alone (no SmolLM2 upload needed).
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
t0=$(date +%s)
python3 benchmarks/multi_gpu.py device-map --model llama8b --context 65536 --new-tokens 24 --model-dir /tmp/llama8b --out $OUT/multi_gpu_llama8b_device_map.json 2>&1 | grep -v -i warn | tail -3
echo "llama8b device_map done at $(( $(date +%s) - t0 )) s"
torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp --model llama8b --model-dir /tmp/llama8b --calibration /tmp/llama8b/gaac-calibration --context 65536 --new-tokens 24 --out $OUT/multi_gpu_llama8b_tp.json 2>&1 | grep -v -i warn | tail -4
echo "llama8b tp done at $(( $(date +%s) - t0 )) s"
