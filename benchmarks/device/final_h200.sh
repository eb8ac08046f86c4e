#!/usr/bin/env bash
# One H200 call: the GPU tests (CUDA kernel, Triton kernels, static cache, generate) and benchmarks/generate.py.
#   device run, carry [".bench"]; results under $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q ${TESTS:-tests/test_gaac_cuda_ops.py tests/test_gaac_gpu_static_cache.py tests/test_gaac_gpu_generate.py} \
  2>&1 | tee "$OUT/gpu_tests.log" | tail -15
timeout ${GEN_TIMEOUT:-330} python3 benchmarks/generate.py --contexts ${CONTEXTS:-16384 65536 131072} ${GEN_ARGS:-} --out "$OUT/generate_h200.json" \
  2>&1 | tee "$OUT/generate.log" | tail -25
