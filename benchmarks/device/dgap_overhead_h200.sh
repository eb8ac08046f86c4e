#!/usr/bin/env bash
# Issue 14: the DGAP processor's cost per decode step at 8K on an H200, in one device call (kind nvidia-h200, about
# 6 minutes, nothing carried: the model is SmolLM2-135M's architecture built from benchmarks/device/
# smollm2-135m-config.json with random weights and a random prompt, since step time depends on neither).
#   run(command="bash benchmarks/device/dgap_overhead_h200.sh", kind="nvidia-h200", timeout_s=480)
# 1. the DGAP GPU tests (Triton step against the torch step, its CUDA graph; the torch step's graph; the caller's
#    capture);
# 2. eager decode steps, LowBitCache and DynamicCache: reference / fused (torch) / fused_graph (torch step in its own
#    graph, the session-4 default) / triton (Triton step) / graph (Triton step in its own graph, the default), shipped
#    K2V2 artifact; GPU kernels and host launches per call of each;
# 3. captured decode steps (StaticCache, torch.compile mode="reduce-overhead", fullgraph=True): the processor compiled
#    into the step and its own graph after it, for the Triton step and the torch step; each processor graph's GPU
#    time and GPU kernel count.
# Results: $OUT/dgap_overhead_h200{,_captured}.json and $OUT/dgap_*.log -> benchmarks/results/.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_dgap_triton_step.py tests/test_dgap_fused_step.py \
  2>&1 | tail -15 | tee "$OUT/dgap_gpu_tests.log"
echo "tests done at $(( $(date +%s) - t0 )) s"
B="python3 benchmarks/dgap_overhead.py --device cuda --context 8000 --config-json benchmarks/device/smollm2-135m-config.json"
B="$B --random-prompt --artifact hub_configs/dgap-SmolLM2-135M-Instruct --precision K2V2"
timeout 120 $B --mode eager --steps 64 --out "$OUT/dgap_overhead_h200.json" 2>&1 | grep -v -i warn | tail -8 \
  | tee "$OUT/dgap_eager.log"
echo "eager done at $(( $(date +%s) - t0 )) s"
timeout $(( 450 - $(date +%s) + t0 )) $B --mode captured --steps 64 --out "$OUT/dgap_overhead_h200_captured.json" \
  2>&1 | grep -v -i warn | tail -14 | tee "$OUT/dgap_captured.log"
echo "captured done at $(( $(date +%s) - t0 )) s"
ls -la "$OUT"
