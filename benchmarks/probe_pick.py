"""Read a kernel probe's JSON (`warps_probe.py --set ...`) and say which kernel options to keep.

    python benchmarks/probe_pick.py benchmarks/results/warps_probe_bounds128_s29.json --set bounds

Prints, per variant, its time against the set's baseline variant (`gaac`) at every shape and against cuDNN, whether
its bits matched its twin everywhere, and the geometric-mean speedup over the shapes; then the `GAAC_*` defines of
the single-option variants that were bit-identical everywhere and faster than the baseline by more than `--margin`
in the geometric mean without losing more than `--worst` at any shape: the `DEFINES=` line for the next call
(`GAAC_HF_CUDA_DEFINES=...` for `benchmarks/generate.py`, as session 29's `ovstep` call did). A probe has no say on correctness beyond the bits it checked: the GPU bit
tests decide that. Writes nothing.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def variant_table(rows: list[dict], baseline: str = "gaac") -> dict:
    """{variant: {"speedup": {shape: baseline_us / us}, "vs_cudnn": {shape: cudnn_us / us}, "bits": all bit-identical,
    "geomean": geometric-mean speedup, "worst": smallest speedup}} over the rows that timed both."""
    out: dict = {}
    for row in rows:
        base = row.get(baseline, {}).get("us")
        for label, entry in row.items():
            if not isinstance(entry, dict) or "us" not in entry or label.startswith("twin"):
                continue
            v = out.setdefault(label, {"speedup": {}, "vs_cudnn": {}, "bits": True})
            if base:
                v["speedup"][row["shape"]] = base / entry["us"]
            if row.get("cudnn_us"):
                v["vs_cudnn"][row["shape"]] = row["cudnn_us"] / entry["us"]
            v["bits"] &= bool(entry.get("bit_identical_to_twin", True))
    for v in out.values():
        s = list(v["speedup"].values())
        v["geomean"] = math.exp(sum(math.log(x) for x in s) / len(s)) if s else float("nan")
        v["worst"] = min(s) if s else float("nan")
    return out


def pick(table: dict, defines: dict, margin: float = 0.005, worst: float = 0.98) -> list[str]:
    """The defines of single-option variants (`defines[label]` of length 1) that kept their bits everywhere, gained
    more than `margin` in the geometric mean and lost no more than `1 - worst` at any shape."""
    keep = []
    for label, v in table.items():
        d = defines.get(label, ())
        if len(d) == 1 and v["bits"] and v["geomean"] > 1 + margin and v["worst"] >= worst:
            keep.append(d[0])
    return keep


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", help="the probe's JSON")
    p.add_argument("--set", required=True, help="the warps_probe.py set the JSON was made with (its variants' defines)")
    p.add_argument("--margin", type=float, default=0.005)
    p.add_argument("--worst", type=float, default=0.98)
    args = p.parse_args(argv)
    rows = json.loads(Path(args.json).read_text())["rows"]
    from warps_probe import SETS

    defines = {label: tuple(kw.get("defines", ())) for label, kw in SETS[args.set][0].items()}
    table = variant_table(rows)
    shapes = [r["shape"] for r in rows]
    print("| variant | " + " | ".join(shapes) + " | geomean | bits |")
    print("|---" * (len(shapes) + 3) + "|")
    for label, v in table.items():
        cells = [f"{v['speedup'].get(s, float('nan')):.3f} ({v['vs_cudnn'].get(s, float('nan')):.2f}x)" for s in shapes]
        print(f"| {label} | " + " | ".join(cells) + f" | {v['geomean']:.3f} | {'ok' if v['bits'] else 'DIFFER'} |")
    keep = pick(table, defines, args.margin, args.worst)
    print("\n(speedup against the baseline variant; in brackets against cuDNN)")
    print("DEFINES=" + ",".join(keep) if keep else "no single option is faster with its bits intact")


if __name__ == "__main__":
    main()
