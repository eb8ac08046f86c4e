"""Summarize Nsight Compute's per-SASS-line source counters (`ncu --page source --csv --print-source sass`, as
`benchmarks/device/ncu_h200.sh` writes them): warp instructions per opcode and per 16-token unit, with their share of
the stall samples, and the instructions that collect the most stall samples (with their stall reasons).

    python benchmarks/ncu_source_summary.py benchmarks/results/ncu_s6_twin_source.csv.gz --units 32768
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import json
import re

STALLS = ("stall_long_sb", "stall_mio", "stall_short_sb", "stall_wait", "stall_math", "stall_not_selected",
          "stall_branch_resolving", "stall_no_inst", "stall_lg", "stall_dispatch")


def read(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        rows = list(csv.reader(f))
    header = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    names = rows[header]
    return [dict(zip(names, r)) for r in rows[header + 1:] if len(r) == len(names)]


def num(x: str) -> int:
    return int(x) if x and x.lstrip("-").isdigit() else 0


def summarize(rows: list[dict], units: int, top: int) -> dict:
    executed, samples = collections.Counter(), collections.Counter()
    for r in rows:
        op = re.sub(r"^@!?U?P\w+\s+", "", r["Source"].strip()).split(" ")[0].split(".")[0] or "?"
        executed[op] += num(r["Instructions Executed"])
        samples[op] += num(r["Warp Stall Sampling (All Samples)"])
    total, total_samples = sum(executed.values()), sum(samples.values())
    hot = sorted(rows, key=lambda r: -num(r["Warp Stall Sampling (All Samples)"]))[:top]
    return {
        "warp_instructions": total, "per_unit": round(total / units, 1), "stall_samples": total_samples,
        "opcodes": [{"op": op, "per_unit": round(n / units, 1), "share": round(n / total, 4),
                     "stall_share": round(samples[op] / max(1, total_samples), 4)}
                    for op, n in executed.most_common(20)],
        "hot": [{"address": r["Address"][-5:], "sass": r["Source"].strip(),
                 "stall_share": round(num(r["Warp Stall Sampling (All Samples)"]) / max(1, total_samples), 4),
                 "reasons": {k[6:]: num(r[k]) for k in STALLS if num(r.get(k, "0"))}} for r in hot],
        "predicated_off_per_unit": round(sum(num(r["Instructions Executed"]) for r in rows
                                             if r["Source"].strip().startswith("@!PT")) / units, 1),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu source-page CSV (.csv or .csv.gz)")
    p.add_argument("--units", type=int, required=True, help="16-token units the kernel read (blocks x kv-heads)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--out", help="also write the summary as JSON")
    args = p.parse_args(argv)
    s = summarize(read(args.csv), args.units, args.top)
    print(f"{s['warp_instructions']:,} warp instructions, {s['per_unit']} per unit, "
          f"{s['predicated_off_per_unit']} of them @!PT padding")
    print("| opcode | per unit | share | stall share |\n|---|---|---|---|")
    for o in s["opcodes"]:
        print(f"| {o['op']} | {o['per_unit']} | {100 * o['share']:.1f}% | {100 * o['stall_share']:.1f}% |")
    print("\nmost stalled instructions:")
    for h in s["hot"]:
        print(f"  {100 * h['stall_share']:5.1f}%  {h['sass'][:64]:64s} {h['reasons']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
