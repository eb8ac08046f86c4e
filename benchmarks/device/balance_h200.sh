#!/usr/bin/env bash
# H200 calls (written in sessions 15-16, for the next), each under the device's 10-minute limit; carry [".bench"]:
#   `bash benchmarks/device/balance_h200.sh probe`: the GPU tests of the rank-balanced splits, the combine block size
#     and programmatic dependent launch, then benchmarks/balance_probe.py (kernel variants, twins planned alike, cuDNN);
#   `... generate`: the GPU tests of CapturedStep / replayed graphs, then the compiled step at 64K/128K with the
#     balance on (GAAC_HF_CUDA_BALANCE=1: compressed KV and its twin alike) and the same caches under CapturedStep;
#   `... replay`: the compiled variants through gaac_hf.graph_replay's backend (generate's path, less host work).
# BALANCE=0 / PDL=1 in the environment switch the process defaults (after the probe says which is faster).
# Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
MODE=${1:-probe}
export GAAC_HF_CUDA_BALANCE=${BALANCE:-1} GAAC_HF_CUDA_PDL=${PDL:-0}
if [ "$MODE" = probe ]; then
  GAAC_HF_CUDA_BALANCE=0 timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q tests/test_gaac_cuda_ops.py \
    -k "balanced or combine or pdl" 2>&1 | tee "$OUT/gpu_tests_probe.log" | tail -5
  GAAC_HF_CUDA_BALANCE=0 timeout ${PROBE_TIMEOUT:-390} python3 benchmarks/balance_probe.py \
    --real-kv .bench/real_kv_2k.safetensors --shapes ${PROBE_SHAPES:-1,0,2,3} --out "$OUT/balance_probe.json" 2>&1 \
    | tee "$OUT/balance_probe.log" | tail -8
fi
if [ "$MODE" = generate ]; then
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q tests/test_gaac_captured_step.py -k "gpu_" 2>&1 \
    | tee "$OUT/gpu_tests_captured.log" | tail -5
  timeout ${GEN_TIMEOUT:-420} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants gaac twin captured captured-twin --skip-module-guards \
    --out "$OUT/generate_balanced.json" 2>&1 | tee "$OUT/generate_balanced.log" | grep -E "ms/step|lossless|speedup|\| " | tail -14
fi
if [ "$MODE" = replay ]; then
  timeout ${GEN_TIMEOUT:-540} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants ${VARIANTS:-gaac twin} --skip-module-guards --graphs replay \
    --out "$OUT/generate_replay.json" 2>&1 | tee "$OUT/generate_replay.log" | grep -E "ms/step|lossless|speedup|\| " | tail -12
fi
