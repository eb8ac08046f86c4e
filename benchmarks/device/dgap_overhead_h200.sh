#!/usr/bin/env bash
# Issue 14: the DGAP processor's cost per decode step at 8K on an H200, in one device call (kind nvidia-h200, about
# 4 minutes, nothing carried: the model is SmolLM2-135M's architecture built from benchmarks/device/
# smollm2-135m-config.json with random weights and a random prompt, since step time depends on neither).
#   run(command="bash benchmarks/device/dgap_overhead_h200.sh", timeout_s=300)
# 1. the DGAP GPU tests (fused step, its CUDA graph, the caller's capture);
# 2. eager decode steps, LowBitCache and DynamicCache: reference / fused / graph processor (shipped K2V2 artifact);
# 3. captured decode steps (StaticCache, torch.compile mode="reduce-overhead", fullgraph=True): the processor compiled
#    into the step, and the processor's own graph after it; the processor graph's GPU time.
# Results: $OUT/dgap_overhead_h200{,_captured}.json -> benchmarks/results/.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
t0=$(date +%s)
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_dgap_fused_step.py 2>&1 | tail -4 | tee "$OUT/dgap_gpu_tests.log"
B="python3 benchmarks/dgap_overhead.py --device cuda --context 8000 --config-json benchmarks/device/smollm2-135m-config.json"
B="$B --random-prompt --artifact hub_configs/dgap-SmolLM2-135M-Instruct --precision K2V2"
timeout 90 $B --mode eager --steps 64 --out "$OUT/dgap_overhead_h200.json" 2>&1 | grep -v -i warn | tail -6
echo "eager done at $(( $(date +%s) - t0 )) s"
timeout $(( 285 - $(date +%s) + t0 )) $B --mode captured --steps 64 --out "$OUT/dgap_overhead_h200_captured.json" \
  2>&1 | grep -v -i warn | tail -12
echo "captured done at $(( $(date +%s) - t0 )) s"
ls -la "$OUT"
