#!/usr/bin/env bash
# H200 calls (written in session 15, for the next): `bash benchmarks/device/balance_h200.sh probe` runs the GPU tests of
# the rank-balanced splits and the combine block size, then benchmarks/balance_probe.py; `... generate` runs the
# compiled step at 64K/128K with the balance on (GAAC_HF_CUDA_BALANCE=1: compressed KV and its twin alike), and the
# same caches under gaac_hf.CapturedStep (session 16: one CUDA graph replayed with no Dynamo/Python per call);
# BALANCE=0 / PDL=1 in the environment switch the process defaults (after the probe says which is faster);
# `... replay` runs the compiled variants through gaac_hf.graph_replay's backend (generate's path, less host work).
#   device run, carry [".bench"]; results under $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
MODE=${1:-probe}
if [ "$MODE" = probe ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q tests/test_gaac_cuda_ops.py tests/test_gaac_captured_step.py \
    -k "balanced or combine or gpu_ or pdl" \
    2>&1 | tee "$OUT/gpu_tests_balance.log" | tail -5
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/balance_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${PROBE_SHAPES:-1,0,2,3} --out "$OUT/balance_probe.json" 2>&1 | tee "$OUT/balance_probe.log" | tail -8
fi
if [ "$MODE" = generate ]; then
  GAAC_HF_CUDA_BALANCE=${BALANCE:-1} GAAC_HF_CUDA_PDL=${PDL:-0} timeout ${GEN_TIMEOUT:-540} python3 benchmarks/generate.py \
    --contexts ${CONTEXTS:-65536 131072} --steps 10 --warmup 3 --eager-steps 3 --reps 10 \
    --variants gaac twin captured captured-twin --skip-module-guards \
    --out "$OUT/generate_balanced.json" 2>&1 | tee "$OUT/generate_balanced.log" | grep -E "ms/step|lossless|speedup|\| " | tail -12
fi
if [ "$MODE" = replay ]; then  # the compiled variants through gaac_hf's graph-replay backend instead of graph trees
  GAAC_HF_CUDA_BALANCE=${BALANCE:-1} GAAC_HF_CUDA_PDL=${PDL:-0} timeout ${GEN_TIMEOUT:-540} python3 benchmarks/generate.py \
    --contexts ${CONTEXTS:-65536 131072} --steps 10 --warmup 3 --eager-steps 3 --reps 10 \
    --variants ${VARIANTS:-gaac twin} --skip-module-guards --graphs replay \
    --out "$OUT/generate_replay.json" 2>&1 | tee "$OUT/generate_replay.log" | grep -E "ms/step|lossless|speedup|\| " | tail -12
fi

