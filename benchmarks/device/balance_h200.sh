#!/usr/bin/env bash
# H200 calls (written in sessions 15-16, for the next), each under the device's 10-minute limit; carry [".bench"]:
#   `bash benchmarks/device/balance_h200.sh probe`: the GPU tests of the rank-balanced splits, the combine block size
#     and programmatic dependent launch, then benchmarks/balance_probe.py (kernel variants, twins planned alike, cuDNN);
#   `... generate`: the GPU tests of CapturedStep / replayed graphs, then the compiled step at 64K/128K at the
#     process defaults (compressed KV and its twin alike) and the same caches under CapturedStep;
#   `... replay`: the compiled variants through gaac_hf.graph_replay's backend (generate's path, less host work).
#   `... warps` (session 17): the CUDA kernel's GPU tests (ops, head dims) at the new defaults (12-warp CTAs, PDL),
#     benchmarks/warps_probe.py, and benchmarks/attention.py at the defaults (the issue-12 table);
#   `... generate` (session 17): also runs `replay` after the compiled and captured variants (VARIANTS, CONTEXTS).
# BALANCE=1 / PDL=0 in the environment switch the process defaults (off / on since session 17).
# Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
MODE=${1:-probe}
export GAAC_HF_CUDA_BALANCE=${BALANCE:-0} GAAC_HF_CUDA_PDL=${PDL:-1}
if [ "$MODE" = probe ]; then
  GAAC_HF_CUDA_BALANCE=0 timeout ${TEST_TIMEOUT:-180} python3 -m pytest -q tests/test_gaac_cuda_ops.py \
    -k "balanced or combine or pdl" 2>&1 | tee "$OUT/gpu_tests_probe.log" | tail -5
  GAAC_HF_CUDA_BALANCE=0 timeout ${PROBE_TIMEOUT:-390} python3 benchmarks/balance_probe.py \
    --real-kv .bench/real_kv_2k.safetensors --shapes ${PROBE_SHAPES:-1,0,2,3} --out "$OUT/balance_probe.json" 2>&1 \
    | tee "$OUT/balance_probe.log" | tail -8
fi
if [ "$MODE" = warps ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q tests/test_gaac_cuda_ops.py tests/test_gaac_head_dims.py 2>&1 \
    | tee "$OUT/gpu_tests_warps.log" | tail -4
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/warps_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${PROBE_SHAPES:-1,0,2,3} --out "$OUT/warps_probe.json" 2>&1 | tee "$OUT/warps_probe.log" | tail -7
  timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/attention.py --real-kv .bench/real_kv_2k.safetensors --graphs \
    --no-triton --shapes 0,2,3,5,7,8 --out "$OUT/attention_cuda.json" 2>&1 | tee "$OUT/attention_cuda.log" | tail -9
fi
if [ "$MODE" = generate ]; then
  timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q tests/test_gaac_captured_step.py -k "gpu_" 2>&1 \
    | tee "$OUT/gpu_tests_captured.log" | tail -5
  timeout ${GEN_TIMEOUT:-270} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants gaac twin captured captured-twin --skip-module-guards \
    --out "$OUT/generate_captured.json" 2>&1 | tee "$OUT/generate_captured.log" | grep -E "ms/step|lossless|speedup|\| " | tail -14
fi
if [ "$MODE" = replay ] || [ "$MODE" = generate ]; then
  timeout ${REPLAY_TIMEOUT:-200} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants ${VARIANTS:-gaac twin} --skip-module-guards --graphs replay \
    --out "$OUT/generate_replay.json" 2>&1 | tee "$OUT/generate_replay.log" | grep -E "ms/step|lossless|speedup|\| " | tail -12
fi
