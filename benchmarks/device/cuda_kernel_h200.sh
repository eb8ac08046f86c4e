#!/usr/bin/env bash
# One H200 call: GPU tests of the CUDA decode kernel, then the attention benchmark with the CUDA kernel.
#   device run, carry [".bench"] (real SmolLM2 KV, see benchmarks/attention.py), optional ".whl" for FA3/FlashInfer
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" .whl/*.whl && export PYTHONPATH="$S" FLASHINFER_CUDA_ARCH_LIST=9.0a
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
MODE=${1:-all}
if [ "$MODE" != bench ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -x tests/test_gaac_cuda_ops.py 2>&1 | tee "$OUT/test_cuda_ops.log" | tail -25
fi
if [ "$MODE" != test ]; then
  timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/attention.py --real-kv .bench/real_kv_2k.safetensors ${BENCH_ARGS:---no-triton --shapes 2 --cuda-sweep} \
    --out "$OUT/attention.json" 2>&1 | tee "$OUT/attention.log" | tail -30
fi
