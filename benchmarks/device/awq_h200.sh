#!/usr/bin/env bash
# Issue 15 part 1 on one H200 (device tool, kind nvidia-h200): an AWQ W4A16 Llama-3.1-8B-architecture checkpoint
# (random weights, packed there, no download) through transformers' AWQ integration, eager decode steps at 16K
# context with DynamicCache and GAACCache, BF16 activations (benchmarks/awq_h200.py).
#
# The H200 has no package index: gptqmodel and the five of its needs that the image lacks travel as source
# distributions and are built there (pypcre compiles a C extension with the image's gcc/cmake/ninja; the other five
# are pure Python). Once, here, in the repo root (about 2 MB):
#   grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --no-binary :all: -d .whl/awq gptqmodel==7.6.0 pypcre==0.6.4 logbar==0.4.15 \
#       device-smi==0.5.7 tokenicer==0.0.14 defuser==0.0.28
#   python3 -m pip download --no-deps --only-binary :all: -d .whl/awq setuptools==80.9.0
# (setuptools: their sdists want >=79,<83; the image's own version is not known here.) The image already has what
# else gptqmodel imports (threadpoolctl, protobuf, numpy, accelerate, safetensors); it does not need datasets, pyarrow,
# torchao or maturin to load and run an AWQ model. This install was rehearsed offline on Python 3.12 (CPU).
#
# Then, with carry [".whl"]:
#   bash benchmarks/device/awq_h200.sh torch_awq   # gptqmodel's torch kernel (dequantizes per call), no JIT build
#   bash benchmarks/device/awq_h200.sh prewarm     # JIT-builds gptqmodel's Marlin FP16 and BF16 extensions with nvcc
#                                                  # (about 2 min each on its authors' host) into ~/.cache/gptqmodel
#   bash benchmarks/device/awq_h200.sh marlin      # Marlin, BF16 activations (call right after prewarm, same machine)
# A call installs ~1-2 min (skipped when /tmp/site already has gptqmodel), writes the checkpoint ~1 min (kept in
# /tmp/llama8b-awq for the next call on a warm machine), loads it, calibrates on 4K tokens, then runs a 16K prefill +
# 24 decode steps three times. Results: $OUT/awq_h200_<backend>.json.
set -uo pipefail
step=${1:?usage: awq_h200.sh torch_awq|prewarm|marlin|auto}
export PYTHONPATH=$PWD:$PWD/benchmarks:/tmp/site PYTHONUNBUFFERED=1 GAAC_HF_CACHE=/tmp/gaac_cache
# importing gptqmodel sets PYTORCH_ALLOC_CONF (expandable segments, split limit) when unset: keep torch's default
export GPTQMODEL_CPU_WORKERS=4 MAX_JOBS=16 PYTORCH_ALLOC_CONF=expandable_segments:False
t0=$(date +%s)
if [ ! -d /tmp/site/gptqmodel ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then  # the project's other carried wheels, as the other device scripts do
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/build \
      .whl/awq/setuptools-*.whl
  PYTHONPATH=/tmp/build python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
      --target /tmp/site .whl/awq/*.tar.gz || { echo "building the carried sdists failed"; exit 1; }
fi
python3 -c "import torch, transformers, gptqmodel, pcre; print(torch.__version__, transformers.__version__, \
gptqmodel.__version__, torch.cuda.get_device_name(0))" 2>&1 | grep -v -i warn | tail -2
echo "installed at $(( $(date +%s) - t0 )) s"
left=$(( 570 - ($(date +%s) - t0) ))
if [ "$step" = prewarm ]; then
  timeout $left python3 -c "import torch; from gptqmodel.utils.marlin import prewarm_marlin_extension as p; \
print('marlin fp16', p(torch.float16)); print('marlin bf16', p(torch.bfloat16))" 2>&1 | grep -i "marlin\|error" | tail -4
  echo "prewarm done at $(( $(date +%s) - t0 )) s"
  exit 0
fi
timeout $left python3 benchmarks/awq_h200.py --model-dir /tmp/llama8b-awq --backend "$step" --context 16384 \
    --new-tokens 24 --out "$OUT/awq_h200_$step.json" 2>&1 | grep -v -i "warn\|info\|it/s\]\|chunk/s\]" | tail -12
echo "done at $(( $(date +%s) - t0 )) s"
ls -la "$OUT"
