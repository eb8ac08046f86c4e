"""What issue 12's speed targets ask of the read rate, from a committed warps_probe JSON (no GPU needed).

A target "GAAC >= x times cuDNN" at a shape is a time (cuDNN's / x); over the compressed bytes GAAC must read, that
time is a read rate, compared here with the rate cuDNN itself reaches on its BF16 bytes in the same run, and with the
run's builds that skip stages (their bits differ; `--set bounds` or `--set evict` columns such as `gaac_loads_only`).
Where the run has the zero-decode build (`gaac_zero_decode`, `--set bounds` since session 32: the kernel's copies,
table entries, ring waits, start and combine, with no tags, prepass, tiles or softmax), it also gives the decode
budget: the target's time less that build's, against what decoding costs the default build now (its time less the
same). A budget at or below zero means the target is out of reach of this kernel's copy pipeline and frame whatever
the decoding costs. Prints a table and writes JSON:

    python benchmarks/target_rates.py benchmarks/results/warps_probe_evict_s30b.json \\
        --out benchmarks/results/target_rates_s31.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

TARGETS = {  # issue 12: (query heads, kv heads, head_dim, batch, context) -> x cuDNN
    (32, 8, 128, 1, 65536): 1.35, (32, 8, 128, 1, 131072): 1.35, (32, 8, 128, 4, 65536): 1.30,
    (64, 8, 128, 1, 65536): 1.30, (32, 8, 128, 1, 16384): 1.20}


def parse_shape(label: str) -> tuple[int, int, int, int, int]:
    """"32/8/128 4x65536" -> (32, 8, 128, 4, 65536)."""
    heads, rows = label.split()
    hq, hkv, d = (int(x) for x in heads.split("/"))
    b, s = (int(x) for x in rows.split("x"))
    return hq, hkv, d, b, s


def rates(probe: dict) -> list[dict]:
    out = []
    for r in probe["rows"]:
        shape = parse_shape(r["shape"])
        if shape not in TARGETS:
            continue
        _, hkv, d, b, s = shape
        bf16 = b * hkv * s * d * 2 * 2  # K and V, BF16
        target_us = r["cudnn_us"] / TARGETS[shape]
        need = r["bytes"] / target_us / 1e6
        cudnn = bf16 / r["cudnn_us"] / 1e6
        builds = {k: v["us"] for k, v in r.items() if isinstance(v, dict) and "us" in v and k.startswith("gaac")}
        zero = builds.get("gaac_zero_decode")
        budget = {} if zero is None else {"decode_budget_us": target_us - zero,
                                          "decode_cost_us": builds["gaac"] - zero if "gaac" in builds else None}
        out.append({**budget, "shape": r["shape"], "target_x": TARGETS[shape], "cudnn_us": r["cudnn_us"],
                    "target_us": target_us, "gaac_bytes": r["bytes"], "bf16_bytes": bf16,
                    "bytes_ratio": bf16 / r["bytes"], "needed_tb_per_s": need, "cudnn_tb_per_s": cudnn,
                    "needed_vs_cudnn_rate": need / cudnn, "builds_us": builds,
                    "builds_meeting_target": sorted(k for k, us in builds.items() if us <= target_us)})
    return out


def _budget(r: dict) -> str:
    if "decode_budget_us" not in r:
        return "—"
    cost = r["decode_cost_us"]
    return f"{r['decode_budget_us']:.1f} / {'—' if cost is None else f'{cost:.1f}'}"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("probe", help="a warps_probe.py JSON")
    p.add_argument("--out", default="")
    args = p.parse_args()
    probe = json.loads(Path(args.probe).read_text())
    rows = rates(probe)
    print(f"{args.probe} ({probe.get('gpu', '?')})")
    print("| shape | target | target µs | GAAC bytes / BF16 | GAAC TB/s needed | cuDNN TB/s (BF16) | needed / cuDNN's | "
          "builds (µs) | meeting the target | decode budget / cost now (µs) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        builds = ", ".join(f"{k} {us:.1f}" for k, us in r["builds_us"].items())
        print(f"| {r['shape']} | {r['target_x']:.2f}× | {r['target_us']:.1f} | 1 / {r['bytes_ratio']:.3f} | "
              f"{r['needed_tb_per_s']:.2f} | {r['cudnn_tb_per_s']:.2f} | {r['needed_vs_cudnn_rate']:.2f} | {builds} | "
              f"{', '.join(r['builds_meeting_target']) or 'none'} | {_budget(r)} |")
    if args.out:
        res = {"probe": args.probe, "gpu": probe.get("gpu"), "rows": rows,
               "command": " ".join(["python", "benchmarks/target_rates.py", *sys.argv[1:]])}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
