"""Summarize Nsight Compute's per-SASS-line source counters (`ncu --page source --csv --print-source sass`, as
`benchmarks/device/ncu_h200.sh` writes them): warp instructions per opcode and per 16-token unit, with their share of
the stall samples, and the instructions that collect the most stall samples (with their stall reasons).

    python benchmarks/ncu_source_summary.py benchmarks/results/ncu_s6_twin_source.csv.gz --units 32768

`--sass` attributes the executed instructions to the kernel's call sites: give the `nvdisasm -gi` listing of a local
`nvcc -cubin -lineinfo` build of the same source and options (ncu's SASS comes from NVRTC on the device, so the two
listings are aligned by opcode sequence; the share that aligns is reported) and `--source` the .cu file:

    nvcc -cubin -lineinfo -std=c++17 -gencode=arch=compute_90a,code=sm_90a <plan -D options> -x cu \
      gaac_cuda/kernels/decode_attention.cu -o k.cubin && nvdisasm -gi k.cubin > k.sass
    python benchmarks/ncu_source_summary.py <csv> --units 32768 --sass k.sass --source <the .cu> \\
      --function gaac_decode_split
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
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


def _opcode(sass: str) -> str:
    t = sass.strip().split()
    if t and t[0].startswith("@"):
        t = t[1:]
    return t[0].split(".")[0] if t else "?"


def sass_lines(listing: str, function: str) -> list[tuple[str, int | None]]:
    """(opcode, source line) of every instruction of `function` in an `nvdisasm -g` or `-gi` listing (the line is the
    outermost one nvdisasm names: with `-gi`, for force-inlined helpers, their call site in the kernel body)."""
    start = listing.index(f".text.{function}:")
    end = listing.find(".text.", start + len(function) + 7)
    line, out = None, []
    for ln in listing[start:end if end > 0 else None].splitlines():
        found = re.findall(r"line (\d+)", ln)
        if "//## File" in ln and found:
            line = int(found[-1])  # "line A inlined at ... line B": B, the outermost
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", ln)
        if m:
            out.append((m.group(2), line))
    return out


def by_call_site(rows: list[dict], lines: list[tuple[str, int | None]], source: list[str], units: int,
                 top: int = 20) -> dict:
    """Executed warp instructions per source line of the local listing, matched to the ncu rows by aligning the
    two opcode sequences (the unaligned share is reported, not guessed)."""
    ncu_ops = [_opcode(r["Source"]) for r in rows]
    counts = [num(r["Instructions Executed"]) for r in rows]
    samples = [num(r.get("Warp Stall Sampling (All Samples)", "0")) for r in rows]
    reasons = [c for c in (rows[0] if rows else {}) if c.startswith("stall_") and "Not Issued" not in c]
    sm = difflib.SequenceMatcher(None, ncu_ops, [op.split(".")[0] for op, _ in lines], autojunk=False)
    per_line, per_line_samples, matched = collections.Counter(), collections.Counter(), 0
    per_line_reasons = collections.defaultdict(collections.Counter)
    for a, b, n in sm.get_matching_blocks():
        for i in range(n):
            line = lines[b + i][1]
            if line is not None:
                per_line[line] += counts[a + i]
                per_line_samples[line] += samples[a + i]
                for c in reasons:
                    per_line_reasons[line][c[6:]] += num(rows[a + i].get(c, "0"))
                matched += counts[a + i]
    total, total_samples = max(1, sum(counts)), max(1, sum(samples))
    return {"aligned_share": round(matched / total, 4),
            "aligned_sample_share": round(sum(per_line_samples.values()) / total_samples, 4),
            "lines": [{"line": ln, "per_unit": round(c / units, 1), "share": round(c / total, 4),
                       # where the warps wait: this line's share of all stall samples, and its main reasons
                       "stall_share": round(per_line_samples[ln] / total_samples, 4),
                       "reasons": {k: v for k, v in per_line_reasons[ln].most_common(3) if v},
                       "source": source[ln - 1].strip()[:100] if 0 < ln <= len(source) else ""}
                      for ln, c in per_line.most_common(top)]}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv", help="ncu source-page CSV (.csv or .csv.gz)")
    p.add_argument("--units", type=int, required=True, help="16-token units the kernel read (blocks x kv-heads)")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--sass", help="nvdisasm -g listing of a local -lineinfo build (call-site attribution)")
    p.add_argument("--source", help="the kernel source the listing was built from")
    p.add_argument("--function", default="gaac_decode_split")
    p.add_argument("--out", help="also write the summary as JSON")
    args = p.parse_args(argv)
    rows = read(args.csv)
    s = summarize(rows, args.units, args.top)
    print(f"{s['warp_instructions']:,} warp instructions, {s['per_unit']} per unit, "
          f"{s['predicated_off_per_unit']} of them @!PT padding")
    print("| opcode | per unit | share | stall share |\n|---|---|---|---|")
    for o in s["opcodes"]:
        print(f"| {o['op']} | {o['per_unit']} | {100 * o['share']:.1f}% | {100 * o['stall_share']:.1f}% |")
    print("\nmost stalled instructions:")
    for h in s["hot"]:
        print(f"  {100 * h['stall_share']:5.1f}%  {h['sass'][:64]:64s} {h['reasons']}")
    if args.sass:
        with open(args.sass) as f:
            listing = f.read()
        source = open(args.source).read().splitlines() if args.source else []
        s["call_sites"] = by_call_site(rows, sass_lines(listing, args.function), source, args.units, args.top)
        print(f"\nper call site ({100 * s['call_sites']['aligned_share']:.1f}% of the executed instructions and "
              f"{100 * s['call_sites']['aligned_sample_share']:.1f}% of the stall samples aligned; stall share: where "
              f"the warps spend their time):")
        for c in s["call_sites"]["lines"]:
            print(f"  {c['per_unit']:7.1f} per unit {100 * c['stall_share']:5.1f}% of samples  L{c['line']}: "
                  f"{c['source'][:70]}  {c['reasons']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
