#!/usr/bin/env bash
# One short H200 call (session 18): Nsight Compute's speed-of-light, memory, warp-state and occupancy sections of the
# CUDA decode kernel at 1 x 64K (benchmarks/device/profile_cuda_kernel.py: format version 2 at the plan's defaults)
# for the full kernel, its loads-only build (GAAC_SKIP=3) and the plain twin. Carry [".bench"].
# Output: $OUT/ncu_quick_{gaac,loads,twin}.txt
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for v in gaac:0 loads:3 twin:plain; do
  name=${v%%:*}; arg=${v#*:}
  timeout ${NCU_TIMEOUT:-80} ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats -k regex:gaac_decode_split -c 1 \
    python3 benchmarks/device/profile_cuda_kernel.py $arg > "$OUT/ncu_quick_$name.txt" 2>&1
  grep -E "DRAM Throughput|Duration|Memory Throughput|Warp Cycles Per Issued|Achieved Occupancy" \
    "$OUT/ncu_quick_$name.txt" | head -6
done
