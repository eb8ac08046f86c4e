#!/usr/bin/env bash
# One H200 call (session 15): every GPU test of the CUDA kernel, the static cache and generate (format versions 1
# and 2), then the format-3 probe on real KV.   device run, carry [".bench"]; results under $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q --durations=12 ${TESTS:-tests/test_gaac_cuda_ops.py tests/test_gaac_head_dims.py tests/test_gaac_gpu_static_cache.py tests/test_gaac_gpu_generate.py} \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -v -E "^\s*$" | tail -40
timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/format_v2_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes ${PROBE_SHAPES:-1,3,0,2} \
  --out "$OUT/format_v2_probe.json" 2>&1 | tee "$OUT/probe.log" | tail -25
