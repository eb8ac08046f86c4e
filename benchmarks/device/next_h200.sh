#!/usr/bin/env bash
# H200 calls, each under the device's 10-minute limit; carry [".bench"] (`python benchmarks/capture_real_kv.py` makes it
# on the CPU). Session 19 ran `baselines`, `stream`, `stages`, `phases`, `verify`, `eager` (results
# benchmarks/results/*_s19*); sessions 17-18 ran `tests`, `probe`, `step`, `ncu`.
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
#   `... warps16` (session 19, not yet run; first next session): more warps per scheduler — the GPU bit test of
#     `plan(slot_ring=True)` (buffers sized for a slot; raw tiles and the tail read from global memory), then the
#     kernel at 12 / 14 / 15 / 16 warps per SM with slot-sized buffers on a pool without raw tiles
#     (warps_probe.py --set warps16) and the slot ring on the caches' pools (--set slot_ring). If 14-16 warps win,
#     make the slot ring the default (plan, attention.py; rerun tests/test_gaac_cuda_ops.py and the GPU tests).
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
if [ "$MODE" = warps16 ]; then  # session 19 (not yet run): the slot ring's GPU bits first, then 12 / 14 / 15 / 16
  # warps per SM with slot-sized buffers (pool without raw tiles), then the slot ring on the caches' pools
  timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q tests/test_gaac_cuda_ops.py -k "fragment_order_prototype" 2>&1 \
    | tail -3 | tee "$OUT/gpu_test_slot_ring.log"
  timeout ${PROBE_TIMEOUT:-240} python3 benchmarks/warps_probe.py --set warps16 --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,2,0,3 --out "$OUT/warps_probe_warps16.json" 2>&1 | tee "$OUT/warps_probe_warps16.log" | tail -7
  timeout ${RING_TIMEOUT:-180} python3 benchmarks/warps_probe.py --set slot_ring --real-kv .bench/real_kv_2k.safetensors \
    --shapes 1,2,0,3 --out "$OUT/warps_probe_slot_ring.json" 2>&1 | tee "$OUT/warps_probe_slot_ring.log" | tail -7
  timeout ${OPS_TIMEOUT:-100} python3 benchmarks/cache_ops.py --device cuda --context 65536 \
    --out "$OUT/cache_ops_h200.json" 2>&1 | tail -4  # the eager finalization without the old benchmark's sweep
fi
