#!/usr/bin/env bash
# H200 calls, each under the device's 10-minute limit; carry [".bench"] (`python benchmarks/capture_real_kv.py` makes it
# on the CPU). Session 19 ran `baselines`, `stream`, `stages`, `phases`, `verify`, `eager` (results
# benchmarks/results/*_s19*); sessions 17-18 ran `tests`, `probe`, `step`, `ncu`. Session 20 ran `warps16` (removed
# since), `ncusrc` (twice), `issue`, `fence`. Session 21: see below; first next session: `lean`.
#   `bash benchmarks/device/next_h200.sh tests`: the GPU tests of the static cache, generate, CapturedStep and replay,
#     then the format-3 leave-one-stage-out breakdown at 1x64K (benchmarks/format_v2_probe.py).
#   `... step`: the compiled and captured decode step at 64K / 128K with each step's GPU time by kernel kind, then the
#     captured variants with inductor's autotuned matrix products, then the replay backend if time is left.
#   `... baselines`: compiled StaticCache, eager DynamicCache + flash and eager GAACCache beside the captured GAAC step
#     (the >=2x target), then benchmarks/cache_ops.py on the GPU.
#   `... stream`: benchmarks/stream_probe.py (the copy pipeline alone), the captured pair at 64K / 128K and the eager
#     steps with --python-profile.
#   `... stages` / `... phases`: the stream probe with emulated work per unit; benchmarks/split_phases_probe.py (where a
#     split's time goes, globaltimer stamps) and a third ring stage at head_dim 64 (warps_probe.py --set stages).
#   `... verify`: the eager step with its Python profile, then the GPU tests of the kernels, head dims and generate.
#   `... eager`: eager DynamicCache + flash against eager GAACCache, 24 steps each at 16K / 64K / 128K, cache_ops.py.
#   `... ncu`: benchmarks/device/ncu_h200.sh (Nsight Compute, full set and per-SASS-line stalls) and warps_probe.py
#     --set next (benchmarks/device/ncu_quick_h200.sh returns in about a minute).
#   `... captured` (session 20; ran in session 21): the captured GAAC step and its twin at 64K / 128K.
#   Session 21 ran `captured`, `prepass`, `pipelined` (twice), `clocks`, `staged` (results benchmarks/results/*_s21*).
#   Session 22 ran `lean` (its combine options are gone since: the lean loads became the only combine), `merge`,
#   `rule`, `pipelined`, `mask` and `tests`. Session 23: `fused` (the combine inside the split kernel), `fused2` (its
#   load rounds; removed since), `verify23`, `const`. Session 24: `heads` (plan(const_heads=True): no gain, removed
#   since), `first` (a split's second unit requested once its first has landed: no gain, removed since), `pace`,
#   `encode`, `append`. Session 25: `entries`, `frame2`, `frame3` (twice), `aligned`, `lines`, `srclines` (its
#   probe set and kernel option GAAC_SRC_LINES removed since: slower), `final25`, `rering` (1x64K only). First next session:
#   `slotring` (prepared: the slot-sized ring with a third stage), then `rering` (its other shapes and ncu).
#   Session 26: `slotring` (slower; its mode, set and kernel option removed since), `ncu26` (Nsight Compute at the
#   aligned default), `s26` (IMAD base adds, lazy running max, 2-stage slot ring in 16 warps: removed since),
#   `bounds` (prepass, scan and softmax bounds on the aligned ring).
#   Session 29 ran `ov` (the options prepared in sessions 26-27: GAAC_OV_UNIFORM became the default, the rest were
#   removed, with the `ov`, `ovtests` and `ovstep` modes: commit 9ac4bdc has them), `ovtests` (the static caches'
#   crop failed on transformers 5.17: fixed), `ovstep`, `bounds128` at all six shapes. `gputests` (new): every GPU test.
#   Session 30 ran `tail` and `l2pf` (both options slower and removed, with their modes), `evict` twice (the slot
#   copies' L2 evict-first policy became the default); its budget ran out after 24 GPU tests of the static caches'
#   file, so every GPU test at the session-30 default is still to run (`gputests`, inside `s31` below).
#   Session 31 had no device machine (every start refused). Sessions 32, 33 and 34 had none either. First next session, carry
#   [".bench"]: `bounds32` (SHAPES=1,4,2: the default, the bounds builds with the new zero-decode build, and cuDNN, on
#   one machine, whichever card it is: the device tool now lends H100s as well, and an H100's table is new - its HBM is
#   slower against the same SM, so the kernel's instruction pace matters less there; compare within the call only),
#   then `s31` (every GPU test), then `SHAPES=5,0,3 bash ... bounds32`; then, on the same warm machine and if it is an
#   H100, `fa3` (carry [".whl"]): FA3 graph-replayed beside cuDNN and flash SDPA, which card's best baseline is.
#   `fence` (session 20: the warp-specialized kernel's race probe) was removed with that kernel in session 28.
#   `... issue` (session 20): the GPU tests of tests/test_gaac_cuda_ops.py, then warps_probe.py --set issue (the
#     common unit's copies issued by lane 0 alone, the default, against the general issue path). Session 19's
#     `warps16` mode ran first in session 20 (slot-sized rings at 14-16 warps: slower) and was removed.
# Results under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:${PYTHONPATH:-}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
MODE=${1:-tests}
if [ "$MODE" = tests ]; then
  timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q tests/test_gaac_gpu_static_cache.py tests/test_gaac_gpu_generate.py \
    tests/test_gaac_captured_step.py tests/test_gaac_compile_settings.py -k "gpu" 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -5
  timeout ${PROBE_TIMEOUT:-120} python3 benchmarks/format_v2_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1 --out "$OUT/breakdown.json" 2>&1 | tee "$OUT/breakdown.log" | tail -4
fi
if [ "$MODE" = step ]; then
  timeout ${GEN_TIMEOUT:-280} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants gaac twin captured captured-twin --skip-module-guards \
    --out "$OUT/generate_profiled.json" 2>&1 | tee "$OUT/generate_profiled.log" | grep -E "GPU|ms/step|lossless|\| " | tail -16
  timeout ${TUNED_TIMEOUT:-200} python3 benchmarks/generate.py --contexts 65536 --steps 10 --warmup 3 --reps 10 \
    --variants captured captured-twin --skip-module-guards \
    --inductor '{"max_autotune": true, "coordinate_descent_tuning": true}' \
    --out "$OUT/generate_autotuned.json" 2>&1 | tee "$OUT/generate_autotuned.log" | grep -E "GPU|ms/step|lossless|\| " | tail -8
  timeout ${REPLAY_TIMEOUT:-100} python3 benchmarks/generate.py --contexts 65536 --steps 10 --warmup 3 --reps 10 \
    --variants gaac twin --skip-module-guards --graphs replay \
    --out "$OUT/generate_replay.json" 2>&1 | tee "$OUT/generate_replay.log" | grep -E "ms/step|lossless|\| " | tail -6
fi
if [ "$MODE" = probe ]; then  # session 18: the test fixed after its first GPU run, then where the slots lie
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q tests/test_gaac_captured_step.py -k "raw_pool_growth" 2>&1 \
    | tail -3 | tee "$OUT/gpu_test_growth.log"
  timeout ${PROBE_TIMEOUT:-200} python3 benchmarks/slot_order_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,2,0 --out "$OUT/slot_order_probe.json" 2>&1 | tee "$OUT/slot_order_probe.log" | tail -6
  timeout ${NEXT_TIMEOUT:-150} python3 benchmarks/warps_probe.py --set next --real-kv .bench/real_kv_2k.safetensors \
    --shapes 0,3 --out "$OUT/warps_probe_next.json" 2>&1 | tee "$OUT/warps_probe_next.log" | tail -5
fi
if [ "$MODE" = baselines ]; then  # the >=2x target's baselines at today's defaults, and issue 13 item 5 on the GPU
  timeout ${GEN_TIMEOUT:-400} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants captured static dynamic eager-gaac --skip-module-guards \
    --out "$OUT/generate_baselines.json" 2>&1 | tee "$OUT/generate_baselines.log" | grep -E "ms/step|\| " | tail -10
  timeout ${OPS_TIMEOUT:-120} python3 benchmarks/cache_ops.py --device cuda --context 65536 \
    --out "$OUT/cache_ops_h200.json" 2>&1 | tail -4
fi
if [ "$MODE" = ncu ]; then
  timeout 400 bash benchmarks/device/ncu_h200.sh
  timeout ${PROBE_TIMEOUT:-120} python3 benchmarks/warps_probe.py --set next --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,0,2,3 --out "$OUT/warps_probe_next.json" 2>&1 | tail -7  # (8 files come back: no log)
fi
if [ "$MODE" = stream ]; then  # session 19: the copy pipeline alone, then the captured step at 128K (refilled) and
  # the eager steps' Python profile (issue 13 item 5)
  timeout ${STREAM_TIMEOUT:-120} python3 benchmarks/stream_probe.py --out "$OUT/stream_probe.json" 2>&1 \
    | tee "$OUT/stream_probe.log" | tail -16
  timeout ${GEN_TIMEOUT:-420} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants captured captured-twin dynamic eager-gaac --skip-module-guards \
    --python-profile --out "$OUT/generate_captured.json" 2>&1 | tee "$OUT/generate_captured.log" \
    | grep -E "ms/step|lossless|\| " | tail -14
fi
if [ "$MODE" = stages ]; then  # session 19: the copy pipeline with emulated work per unit, 2 vs 3 ring stages; the
  # kernel with a third stage at 12 warps where it fits (head_dim 64)
  timeout ${STREAM_TIMEOUT:-150} python3 benchmarks/stream_probe.py --out "$OUT/stream_probe.json" 2>&1 \
    | tee "$OUT/stream_probe.log" | tail -24
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/warps_probe.py --set stages --real-kv .bench/real_kv_2k.safetensors \
    --shapes 3 --out "$OUT/warps_probe_stages.json" 2>&1 | tee "$OUT/warps_probe_stages.log" | tail -4
fi
if [ "$MODE" = phases ]; then  # session 19: where the split's time goes (globaltimer stamps: entry, first unit
  # ready, done; combine starts) for the default kernel and its loads-only build; the third stage at head_dim 64
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/split_phases_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes 1,0 --out "$OUT/phases.json" 2>&1 | tee "$OUT/phases.log" | tail -5
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/warps_probe.py --set stages --real-kv .bench/real_kv_2k.safetensors \
    --shapes 3 --out "$OUT/warps_probe_stages.json" 2>&1 | tee "$OUT/warps_probe_stages.log" | tail -4
fi
if [ "$MODE" = verify ]; then  # session 19: the eager step's host work after its cuts (issue 13 item 5), then the GPU
  # tests of the kernels, head dims and eager generate (the launcher and record changes)
  timeout ${GEN_TIMEOUT:-150} python3 benchmarks/generate.py --contexts 65536 --steps 10 --warmup 3 --eager-steps 5 \
    --reps 10 --variants dynamic eager-gaac --skip-module-guards --python-profile \
    --out "$OUT/generate_eager.json" 2>&1 | tee "$OUT/generate_eager.log" | grep -E "ms/step" | tail -4
  timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -x tests/test_gaac_gpu_generate.py tests/test_gaac_head_dims.py \
    tests/test_gaac_cuda_ops.py -k "(gpu or cuda) and not compiles and not sass" 2>&1 | tee "$OUT/gpu_tests_verify.log" | tail -4
fi
if [ "$MODE" = eager ]; then  # session 19: eager DynamicCache + flash against eager GAACCache, more steps (issue 13
  # item 5), then the eager update's ops on the GPU
  timeout ${GEN_TIMEOUT:-200} python3 benchmarks/generate.py --contexts 16384 65536 131072 --steps 10 --warmup 3 \
    --eager-steps 24 --reps 10 --variants dynamic eager-gaac --skip-module-guards \
    --out "$OUT/generate_eager.json" 2>&1 | tee "$OUT/generate_eager.log" | grep -E "ms/step" | tail -6
  timeout ${OPS_TIMEOUT:-100} python3 benchmarks/cache_ops.py --device cuda --context 65536 \
    --out "$OUT/cache_ops_h200.json" 2>&1 | tail -4
fi
if [ "$MODE" = captured ]; then  # session 20 (not yet run): the captured GAAC step and its twin at 64K / 128K with
  # the fast issue path, each step's GPU time by kernel kind (issue 13's 1.10x / 1.15x targets)
  timeout ${GEN_TIMEOUT:-420} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants captured captured-twin --skip-module-guards \
    --out "$OUT/generate_captured.json" 2>&1 | tee "$OUT/generate_captured.log" | grep -E "GPU|ms/step|lossless|\| " | tail -12
fi
if [ "$MODE" = prepass ]; then  # session 21: the prepass / tag scan bounds (wrong bits by design), loads + math and
  # loads alone, at 1x64K, 4x64K, 1x128K, 1x16K and 9/3/64
  timeout ${PROBE_TIMEOUT:-420} python3 benchmarks/warps_probe.py --set prepass --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,2,4,0,3} --out "$OUT/warps_probe_prepass.json" 2>&1 | tee "$OUT/warps_probe_prepass.log" | tail -30
fi
if [ "$MODE" = pipelined ]; then  # session 21: the captured pair at 64K / 128K, also timed back to back with no host
  # sync between steps (pipelined_ms), then the prepass set at the 64q/8kv 1x64K target shape
  timeout ${GEN_TIMEOUT:-300} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants captured captured-twin --skip-module-guards \
    --out "$OUT/generate_pipelined.json" 2>&1 | tee "$OUT/generate_pipelined.log" | grep -E "pipelined|ms/step|lossless|\| " | tail -14
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/warps_probe.py --set prepass --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-5} --out "$OUT/warps_probe_prepass_64q.json" 2>&1 | tee "$OUT/warps_probe_prepass_64q.log" | tail -4
fi
if [ "$MODE" = clocks ]; then  # session 21: the SM clock and power while the kernels run alone (warps_probe.py, 1x64K)
  # and inside the captured step at 64K: does the step's lower clock slow the instruction-bound GAAC kernel more
  # than the copy-bound twin? (phases: date stamps in clocks_phases.log)
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 100 \
    > "$OUT/clocks.csv" 2>&1 &
  SMI=$!
  date +"%T.%N probe start" > "$OUT/clocks_phases.log"
  timeout ${PROBE_TIMEOUT:-120} python3 benchmarks/warps_probe.py --set issue --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1 --buffers 3 --out "$OUT/warps_probe_clocks.json" 2>&1 | tail -3
  date +"%T.%N probe end" >> "$OUT/clocks_phases.log"
  timeout ${GEN_TIMEOUT:-200} python3 benchmarks/generate.py --contexts 65536 --steps 40 --warmup 3 --reps 10 \
    --variants captured captured-twin --skip-module-guards --out "$OUT/generate_clocks.json" 2>&1 \
    | while IFS= read -r line; do echo "$(date +%T.%N) $line"; done > "$OUT/generate_clocks.log"
  grep -E "ms/step|pipelined" "$OUT/generate_clocks.log"
  kill $SMI
fi
if [ "$MODE" = staged ]; then  # session 21: partial outputs by 16-byte stores (GAAC_STAGED_O) against the direct
  # 4-byte stores, GAAC and twin, six shapes; then the GPU tests of the kernels, head dims and generate
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/warps_probe.py --set staged_o --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,5,4,2,0,3} --out "$OUT/warps_probe_staged_o.json" 2>&1 | tee "$OUT/warps_probe_staged_o.log" | tail -9
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q tests/test_gaac_cuda_ops.py tests/test_gaac_head_dims.py \
    tests/test_gaac_gpu_generate.py -k "(gpu or cuda) and not compiles and not sass" 2>&1 \
    | tee "$OUT/gpu_tests_staged.log" | tail -4
fi
if [ "$MODE" = merge ]; then  # session 22: the CUDA kernel's GPU tests (the lean combine is now the only one; the
  # new CTA merge against its twin and the reference), then warps_probe.py --set cta_merge at six shapes
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q tests/test_gaac_cuda_ops.py -k "not compiles and not sass" 2>&1 \
    | tee "$OUT/gpu_tests_merge.log" | tail -4
  timeout ${PROBE_TIMEOUT:-330} python3 benchmarks/warps_probe.py --set cta_merge --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,5,0,3,2,4} --out "$OUT/warps_probe_cta_merge.json" 2>&1 | tee "$OUT/warps_probe_cta_merge.log" | tail -9
fi
if [ "$MODE" = rule ]; then  # session 22: the merge where it pays as the plans' default: the GPU tests of the kernel,
  # head dims and generate, then the default against the unmerged plans at the shapes it changes (and 1x64K)
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q tests/test_gaac_cuda_ops.py tests/test_gaac_head_dims.py \
    tests/test_gaac_gpu_generate.py -k "(gpu or cuda or cta_merge) and not compiles and not sass" 2>&1 \
    | tee "$OUT/gpu_tests_rule.log" | tail -4
  timeout ${PROBE_TIMEOUT:-200} python3 benchmarks/warps_probe.py --set merge_rule --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-5,3,2,1} --out "$OUT/warps_probe_merge_rule.json" 2>&1 | tee "$OUT/warps_probe_merge_rule.log" | tail -6
fi
if [ "$MODE" = mask ]; then  # session 22: the padding mask's bytes loaded with the unit's copies: the GPU tests with
  # masks, the kernel with an all-ones mask (as the captured step passes) against no mask and the old placement, then
  # the captured pair at 64K / 128K (issue 13)
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q tests/test_gaac_cuda_ops.py -k \
    "cuda_compressed_equals_plain_twin or format_2_slots or cta_merge_equals" 2>&1 | tee "$OUT/gpu_tests_mask.log" | tail -3
  timeout ${PROBE_TIMEOUT:-200} python3 benchmarks/warps_probe.py --set mask --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,4,5,0} --out "$OUT/warps_probe_mask.json" 2>&1 | tee "$OUT/warps_probe_mask.log" | tail -6
  timeout ${GEN_TIMEOUT:-200} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} --steps 10 \
    --warmup 3 --eager-steps 3 --reps 10 --variants captured captured-twin --skip-module-guards \
    --out "$OUT/generate_mask.json" 2>&1 | tee "$OUT/generate_mask.log" | grep -E "pipelined|ms/step|lossless|\| " | tail -14
fi
if [ "$MODE" = fused ]; then  # prepared in session 22, not yet run: the combine inside the split kernel (the last CTA
  # of each group merges; plan(fused_combine=True)): its GPU tests, the kernel against the CTA merge alone and the
  # default at six shapes, then the captured pair at 64K with every plan fused (GAAC_HF_CUDA_CTA_MERGE=1
  # GAAC_HF_CUDA_FUSED_COMBINE=1) if the probe says so
  timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q tests/test_gaac_cuda_ops.py -k "fused or cta_merge" 2>&1 \
    | tee "$OUT/gpu_tests_fused.log" | tail -3
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/warps_probe.py --set fused --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,4,5,0,3,2} --out "$OUT/warps_probe_fused.json" 2>&1 | tee "$OUT/warps_probe_fused.log" | tail -8
  GAAC_HF_CUDA_CTA_MERGE=1 GAAC_HF_CUDA_FUSED_COMBINE=1 timeout ${GEN_TIMEOUT:-150} python3 benchmarks/generate.py \
    --contexts ${CONTEXTS:-65536} --steps 10 --warmup 3 --eager-steps 3 --reps 10 --variants captured captured-twin \
    --skip-module-guards --out "$OUT/generate_fused.json" 2>&1 | tee "$OUT/generate_fused.log" \
    | grep -E "pipelined|ms/step|lossless|\| " | tail -8
fi
if [ "$MODE" = verify23 ]; then  # session 23: the GPU tests after the fused combine became a default (64/8, 4x64K and
  # other shapes whose combine kernel would launch more blocks than SMs); PART=1: kernels, head dims, eager generate;
  # PART=2: static cache, generate, captured step, compile settings
  if [ "${PART:-1}" = 1 ]; then
    timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q tests/test_gaac_gpu_generate.py tests/test_gaac_head_dims.py \
      tests/test_gaac_cuda_ops.py -k "(gpu or cuda) and not compiles and not sass" 2>&1 | tee "$OUT/gpu_tests_verify23_1.log" | tail -4
  else
    timeout ${TEST_TIMEOUT:-560} python3 -m pytest -q tests/test_gaac_gpu_static_cache.py tests/test_gaac_gpu_generate.py \
      tests/test_gaac_captured_step.py tests/test_gaac_compile_settings.py -k "gpu" 2>&1 \
      | tee "$OUT/gpu_tests_verify23_2.log" | tail -5
  fi
fi
if [ "$MODE" = const ]; then  # session 23: the layout compiled in (plan(const_layout=True)): its GPU bit tests, the probe
  # at five shapes, then the eager-generate GPU tests with it on for every plan (GAAC_HF_CUDA_CONST_LAYOUT=1)
  timeout ${TEST_TIMEOUT:-100} python3 -m pytest -q tests/test_gaac_cuda_ops.py -k "const" 2>&1 \
    | tee "$OUT/gpu_tests_const.log" | tail -3
  timeout ${PROBE_TIMEOUT:-200} python3 benchmarks/warps_probe.py --set const --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,5,2,0,3,4} --out "$OUT/warps_probe_const.json" 2>&1 | tee "$OUT/warps_probe_const.log" | tail -9
  GAAC_HF_CUDA_CONST_LAYOUT=1 timeout ${GEN_TIMEOUT:-150} python3 -m pytest -q -x tests/test_gaac_gpu_generate.py \
    tests/test_gaac_head_dims.py -k "gpu or cuda" 2>&1 | tee "$OUT/gpu_tests_const_generate.log" | tail -3
fi
if [ "$MODE" = pace ]; then  # session 24: is the last-warp spread a property of the SMs (sm_pace_probe.py: no); and
  # compressed KV on split barriers (warps_probe.py --set splitbar: slower at six shapes, removed since)
  timeout ${PACE_TIMEOUT:-150} python3 benchmarks/sm_pace_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,4 --out "$OUT/sm_pace.json" 2>&1 | tee "$OUT/sm_pace.log" | tail -3
fi
if [ "$MODE" = encode ]; then  # session 24: the fragment-order slot writer gathers its plane bits with tl.gather (no
  # staging through global memory): the GPU tests of the append / encode paths and lossless generate, then the
  # captured pair at 64K / 128K (the finalizing _append_kernel's time is the p90 of its spread)
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q tests/test_gaac_gpu_static_cache.py tests/test_gaac_gpu_generate.py \
    -k "gpu" 2>&1 | tee "$OUT/gpu_tests_encode.log" | tail -3
  timeout ${GEN_TIMEOUT:-200} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} \
    --steps 10 --warmup 3 --eager-steps 3 --reps 10 --variants captured captured-twin --skip-module-guards \
    --out "$OUT/generate_encode.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/generate_encode.log" \
    | grep -E "pipelined|ms/step|lossless|_append_kernel|\| " | cut -c1-400 | tail -14
fi
if [ "$MODE" = append ]; then  # session 24: the static cache's append kernel alone (benchmarks/append_probe.py), then
  # Nsight Compute on its finalizing launch (the second of two: warp states, source counters, per-SASS-line stalls)
  timeout ${PROBE_TIMEOUT:-100} python3 benchmarks/append_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --out "$OUT/append_probe.json" 2>&1 | tail -12
  timeout 150 ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    --section LaunchStats --section InstructionStats -k regex:_append_kernel -s 1 -c 1 -o /tmp/ncu_append \
    python3 benchmarks/append_probe.py --real-kv .bench/real_kv_2k.safetensors --ncu > "$OUT/ncu_append.log" 2>&1
  ncu --import /tmp/ncu_append.ncu-rep --page details --print-details all > "$OUT/ncu_append_details.txt" 2>&1
  ncu --import /tmp/ncu_append.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_append_source.csv" 2>&1
  grep -E "Duration|Warp Cycles Per Issued|Executed Instructions  |Registers Per|Block Size|Grid Size" \
    "$OUT/ncu_append_details.txt" | head -8
fi
if [ "$MODE" = entries ]; then  # prepared in session 24: the split's table entries held by the lanes (GAAC_LANE_ENTRIES=1):
  # its GPU bit tests, then the probe at six shapes beside the loads-only builds with and without it
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q tests/test_gaac_cuda_ops.py -k "lane_entries" 2>&1 \
    | tee "$OUT/gpu_tests_entries.log" | tail -3
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/warps_probe.py --set entries --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,5,2,0,3,4} --out "$OUT/warps_probe_entries.json" 2>&1 | tee "$OUT/warps_probe_entries.log" | tail -9
  # the loads-only frame stripped towards the bare copy pipeline, traced (warps_probe.py --set frame), and the bare
  # pipeline itself at 1x64K
  timeout ${FRAME_TIMEOUT:-150} python3 benchmarks/warps_probe.py --set frame --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,0 --out "$OUT/warps_probe_frame.json" 2>&1 | tail -4
  timeout ${STREAM_TIMEOUT:-100} python3 benchmarks/stream_probe.py --variants pool_bulk,pool_bulk_d1000,pool_bulk_d2000 \
    --out "$OUT/stream_probe.json" 2>&1 | tail -6
  # head_dim 64 (SmolLM2's 9/3/64) at 16 warps per CTA (warps_probe.py --set w16)
  timeout ${W16_TIMEOUT:-100} python3 benchmarks/warps_probe.py --set w16 --real-kv .bench/real_kv_2k.safetensors \
    --shapes 3 --out "$OUT/warps_probe_w16.json" 2>&1 | tail -4
fi
if [ "$MODE" = frame2 ]; then  # session 25: where the stripped build's 12 us over the bare copy pipeline go: the split
  # kernel alone (default, stripped, stripped without PDL; traced) and the bare pipeline traced, with the kernel's
  # shared-memory layout and its real block table
  timeout ${FRAME_TIMEOUT:-200} python3 benchmarks/warps_probe.py --set frame2 --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1} --out "$OUT/warps_probe_frame2.json" 2>&1 | tee "$OUT/warps_probe_frame2.log" | tail -4
  timeout ${STREAM_TIMEOUT:-150} python3 benchmarks/stream_probe.py --trace --real-kv .bench/real_kv_2k.safetensors \
    --variants pool_bulk,pool_bulk_ksmem,pool_real,pool_real_ksmem,pool_bulk_d2000,rows_cpasync \
    --out "$OUT/stream_probe_frame2.json" 2>&1 | tee "$OUT/stream_probe_frame2.log" | tail -9
fi
if [ "$MODE" = frame3 ]; then  # session 25: the stripped split kernel and the bare pipeline in one process, traced, on
  # the same cache (benchmarks/frame_probe.py)
  timeout ${FRAME_TIMEOUT:-300} python3 benchmarks/frame_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --out "$OUT/frame_probe.json" 2>&1 | tee "$OUT/frame_probe.log" | tail -${FRAME_TAIL:-14}
  if [ -n "${HDR:-}" ]; then
    timeout ${HDR_TIMEOUT:-250} python3 benchmarks/warps_probe.py --set hdr --real-kv .bench/real_kv_2k.safetensors \
      --shapes ${SHAPES:-1,5,2,0,3,4} --out "$OUT/warps_probe_hdr.json" 2>&1 | tee "$OUT/warps_probe_hdr.log" | tail -9
  fi
fi
if [ "$MODE" = aligned ]; then  # session 25, after the 128-byte aligned ring became the default: the copy pipeline
  # with a misaligned global source (head_dim 64's slots), the leave-one-stage-out breakdown, the split phases and
  # the captured pair
  timeout ${STREAM_TIMEOUT:-100} python3 benchmarks/stream_probe.py --trace --real-kv .bench/real_kv_2k.safetensors \
    --variants pool_real_ksmem,pool_real_ksmem_hdr64,pool_real_ksmem_src64 \
    --out "$OUT/stream_probe_aligned.json" 2>&1 | tail -4
  timeout ${PROBE_TIMEOUT:-150} python3 benchmarks/format_v2_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,0,2,3} --out "$OUT/breakdown_aligned.json" 2>&1 | tee "$OUT/breakdown_aligned.log" | tail -6
  timeout ${PHASES_TIMEOUT:-100} python3 benchmarks/split_phases_probe.py --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,0 --out "$OUT/phases_aligned.json" 2>&1 | tail -3
  timeout ${GEN_TIMEOUT:-200} python3 benchmarks/generate.py --contexts ${CONTEXTS:-65536 131072} \
    --steps 10 --warmup 3 --eager-steps 3 --reps 10 --variants captured captured-twin --skip-module-guards \
    --out "$OUT/generate_aligned.json" 2>&1 | grep -v "it/s\]" | tee "$OUT/generate_aligned.log" \
    | grep -E "ms/step|lossless|\| " | cut -c1-300 | tail -10
fi
if [ "$MODE" = lines ]; then  # session 25: misaligned slots in global memory read as the 128-byte lines around them
  timeout ${STREAM_TIMEOUT:-100} python3 benchmarks/stream_probe.py --trace --real-kv .bench/real_kv_2k.safetensors \
    --variants pool_real_ksmem,pool_real_ksmem_src64,pool_real_ksmem_src64_head,pool_real_ksmem_src64_lines \
    --out "$OUT/stream_probe_lines.json" 2>&1 | tail -5
fi
if [ "$MODE" = final25 ]; then  # session 25's final kernel (128-byte aligned ring): the pool-offset bit test, lossless
  # generate and the captured step's GPU tests
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q tests/test_gaac_cuda_ops.py tests/test_gaac_gpu_generate.py \
    tests/test_gaac_captured_step.py -k "off_a_line or gpu" 2>&1 | tee "$OUT/gpu_tests_final.log" | tail -3
fi
if [ "$MODE" = rering ]; then  # prepared in session 25: ring depths and CTA shapes measured before under misaligned
  # copies, again on the 128-byte aligned ring (warps_probe.py --set rering; 1x64K ran at the end of session 25:
  # warps_probe_rering_1x64k_s25.json, none faster), then Nsight Compute's picture of the
  # default at 1x64K (where the instruction stream shows again: split kernel 55.2 us against its bare copies' 46.9)
  timeout ${PROBE_TIMEOUT:-330} python3 benchmarks/warps_probe.py --set rering --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-3,0,2,4} --out "$OUT/warps_probe_rering.json" 2>&1 | tee "$OUT/warps_probe_rering.log" | tail -8
  timeout ${NCU_TIMEOUT:-240} bash benchmarks/device/ncu_quick_h200.sh
fi
if [ "$MODE" = ncu26 ]; then  # session 26: Nsight Compute's full set and per-SASS-line stalls of the aligned default
  # at 1x64K (GAAC only), then the speed-of-light sections of its loads-only build
  timeout 200 ncu --clock-control none --set full -k regex:gaac_decode_split -c 1 -o /tmp/ncu_gaac \
    python3 benchmarks/device/profile_cuda_kernel.py 0 > "$OUT/ncu_gaac_run.log" 2>&1
  ncu --import /tmp/ncu_gaac.ncu-rep --page details --print-details all > "$OUT/ncu_gaac.txt" 2>&1
  ncu --import /tmp/ncu_gaac.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_gaac_source.csv" 2>&1
  gzip -f "$OUT/ncu_gaac_source.csv"; tail -2 "$OUT/ncu_gaac_run.log"
  grep -E "DRAM Throughput|Duration|Warp Cycles Per Issued|Issue Slots Busy|Achieved Occupancy" "$OUT/ncu_gaac.txt" | head -8
  timeout 80 ncu --clock-control none --section SpeedOfLight --section WarpStateStats --section LaunchStats \
    -k regex:gaac_decode_split -c 1 python3 benchmarks/device/profile_cuda_kernel.py 3 > "$OUT/ncu_loads.txt" 2>&1
  grep -E "DRAM Throughput|Duration|Warp Cycles Per Issued" "$OUT/ncu_loads.txt" | head -4
fi
if [ "$MODE" = bounds ]; then  # session 26: the prepass / scan / softmax bounds on the aligned ring (warps_probe --set bounds)
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/warps_probe.py --set bounds --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,2,3} --out "$OUT/warps_probe_bounds.json" 2>&1 | tee "$OUT/warps_probe_bounds.log" | tail -6
fi
if [ "$MODE" = gputests ]; then  # session 29: every GPU test of the kernel, the static caches and generate (each file
  # on its own timeout; about 4 minutes in all on the H200)
  timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q tests/test_gaac_cuda_ops.py 2>&1 | tail -3 | tee "$OUT/gpu_cuda_ops.log"
  timeout ${STATIC_TIMEOUT:-200} python3 -m pytest -q tests/test_gaac_gpu_static_cache.py 2>&1 | tail -3 \
    | tee "$OUT/gpu_static_cache.log"
  timeout ${GEN_TIMEOUT:-200} python3 -m pytest -q tests/test_gaac_gpu_generate.py 2>&1 | tail -3 | tee "$OUT/gpu_generate.log"
fi
# (`tail`, session 30: the tail chunks' GPU tests and warps_probe --set tail; ran once, option removed: commit 2a71a29)
# (`l2pf`, session 30: warps_probe --set l2pf; ran once, option removed: commit e937023 has it)
if [ "$MODE" = evict ]; then  # session 30: the slot copies with an L2 evict-first policy (warps_probe.py --set evict)
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/warps_probe.py --set evict --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-1,4,2,5,0,3} --out "$OUT/warps_probe_evict.json" 2>&1 | tee "$OUT/warps_probe_evict.log" | tail -8
fi
if [ "$MODE" = s31 ]; then  # prepared in session 31 (no device that session): every GPU test at the session-30
  # default and the NVRTC disk cache's GPU test (about 6 minutes; the bounds moved to `bounds32` in session 32, since
  # the tests and six shapes of the bounds set do not fit one 10-minute call)
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total --format=csv | tee "$OUT/gpu_clocks.txt"
  bash "$0" gputests
  timeout 120 python3 -m pytest -q tests/test_gaac_nvrtc_cache.py 2>&1 | tail -3 | tee "$OUT/gpu_nvrtc_cache.log"
fi
if [ "$MODE" = bounds32 ]; then  # prepared in session 32: the bounds set with the zero-decode build (no tags, scan,
  # prepass, tiles or softmax: the kernel's copies, entries, waits, start and combine) at three shapes per call,
  # SHAPES=1,4,2 first (1x64K, 1x128K, 64/8), then SHAPES=5,0,3 (4x64K, 1x16K, 9/3/64); the card's clocks beside it
  # (H100 or H200: the JSON and gpu.txt say which). Then `python benchmarks/target_rates.py <json>`: the decode budget.
  SH=${SHAPES:-1,4,2}
  nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem,memory.total --format=csv | tee "$OUT/gpu_clocks.txt"
  timeout ${PROBE_TIMEOUT:-540} python3 benchmarks/warps_probe.py --set bounds --real-kv .bench/real_kv_2k.safetensors \
    --shapes "$SH" --out "$OUT/warps_probe_bounds_s32_${SH//,/}.json" 2>&1 \
    | tee "$OUT/warps_probe_bounds_s32_${SH//,/}.log" | tail -10
  python3 benchmarks/target_rates.py "$OUT/warps_probe_bounds_s32_${SH//,/}.json" \
    --out "$OUT/target_rates_s32_${SH//,/}.json" 2>&1 | tail -5
fi
if [ "$MODE" = fa3 ]; then  # prepared in session 31: FA3 beside cuDNN and flash SDPA, all graph-replayed, at the six
  # shapes (benchmarks/attention.py --graphs --no-triton). On the H200 sessions 6 and 10 timed FA3 and FlashInfer
  # graph-replayed and cuDNN was the fastest at every shape; on an H100 nothing says so yet. Carry [".whl"] (the fa3-fwd wheel, 27.6 MB: `pip download --no-deps
  # --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_24_x86_64 -d .whl
  # fa3-fwd==0.0.3`); .bench (46 MB; with the wheel over the 64 MiB carry) must be on the machine already, from an
  # earlier call of this warm machine that carried it (e.g. `s31`).
  if [ ! -f .bench/real_kv_2k.safetensors ]; then
    echo "no .bench/real_kv_2k.safetensors here: run a mode that carries [\".bench\"] on this warm machine first"; exit 1
  fi
  S=$(mktemp -d); python3 -m pip install -q --no-index --no-deps --no-compile --target "$S" .whl/fa3_fwd*.whl \
    && export PYTHONPATH="$S:$PYTHONPATH"
  python3 -c "import fa3_fwd_interface; print('fa3', fa3_fwd_interface.__file__)" 2>&1 | tee "$OUT/fa3_import.txt"
  timeout ${BASE_TIMEOUT:-500} python3 benchmarks/attention.py --real-kv .bench/real_kv_2k.safetensors --no-triton \
    --graphs --shapes ${ASHAPES:-2,3,5,7,0,8} --flex-shapes "" --out "$OUT/attention_fa3_s31.json" 2>&1 \
    | tee "$OUT/attention_fa3_s31.log" | tail -12
fi
if [ "$MODE" = bounds128 ]; then  # session 27; run in session 29 (SHAPES=4,1, then 5,2,0,3): the bounds set (loads
  # only, stripped) - what the kernel reaches without its tile code where the targets ask 1.20-1.35x (attention_cuda.md)
  timeout ${PROBE_TIMEOUT:-300} python3 benchmarks/warps_probe.py --set bounds --real-kv .bench/real_kv_2k.safetensors \
    --shapes ${SHAPES:-4,1} --out "$OUT/warps_probe_bounds128.json" 2>&1 | tee "$OUT/warps_probe_bounds128.log" | tail -5
fi
if [ "$MODE" = issue ]; then  # session 20: the common unit's copy issue by lane 0 alone (GAAC_FAST_ISSUE, default)
  # against the general path; the GPU bit tests of the CUDA kernel first
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q tests/test_gaac_cuda_ops.py 2>&1 \
    | tail -3 | tee "$OUT/gpu_tests_cuda_ops.log"
  timeout ${PROBE_TIMEOUT:-200} python3 benchmarks/warps_probe.py --set issue --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,2,0,3 --out "$OUT/warps_probe_issue.json" 2>&1 | tee "$OUT/warps_probe_issue.log" | tail -7
fi
if [ "$MODE" = ncusrc ]; then  # session 20: per-SASS-line source counters of the default GAAC kernel at 1x64K (where
  # the ~1,000 warp instructions per unit go today; summarize with benchmarks/ncu_source_summary.py --sass)
  timeout 200 ncu --clock-control none --section SourceCounters --section WarpStateStats --section SpeedOfLight \
    -k regex:gaac_decode_split -c 1 -o /tmp/ncu_src python3 benchmarks/device/profile_cuda_kernel.py 0 \
    > "$OUT/ncu_src_run.log" 2>&1; tail -3 "$OUT/ncu_src_run.log"
  ncu --import /tmp/ncu_src.ncu-rep --page details --print-details all > "$OUT/ncu_src_details.txt" 2>&1
  ncu --import /tmp/ncu_src.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_src_source.csv" 2>&1
  gzip -f "$OUT/ncu_src_source.csv"; grep -E "Duration|Warp Cycles Per Issued|Executed Ipc" "$OUT/ncu_src_details.txt"
fi
