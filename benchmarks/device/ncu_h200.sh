#!/usr/bin/env bash
# One H200 call: Nsight Compute on the CUDA decode kernel at 1 x 64K (benchmarks/device/profile_cuda_kernel.py):
# the full section set for the GAAC kernel and its plain twin, and the per-SASS-line source counters of both
# (stall reasons per instruction). Carry [".bench/real_kv_2k.safetensors"]. Output: $OUT/ncu_{gaac,twin}{,_source}.txt
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for v in gaac twin; do
  arg=0; [ $v = twin ] && arg=plain
  timeout 150 ncu --clock-control none --set full -k regex:gaac_decode_split -c 1 -o /tmp/ncu_$v \
    python3 benchmarks/device/profile_cuda_kernel.py $arg > "$OUT/ncu_${v}_run.log" 2>&1
  ncu --import /tmp/ncu_$v.ncu-rep --page details --print-details all > "$OUT/ncu_$v.txt" 2>&1
  ncu --import /tmp/ncu_$v.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_${v}_source.csv" 2>&1
  gzip -f "$OUT/ncu_${v}_source.csv"
  tail -3 "$OUT/ncu_${v}_run.log"; wc -c "$OUT/ncu_$v.txt"
done
ls -la "$OUT"
