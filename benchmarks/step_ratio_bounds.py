"""How far issue 13's last target (the captured GAAC step >= 1.10x / 1.15x its plain-BF16 twin at 64K / 128K) can
move at all, from committed H200 results (no GPU needed).

The captured step is the attention's split kernel per layer plus everything else: the matrix products, pointwise
kernels, the combine and the cache update. From a `benchmarks/generate.py` JSON with per-kernel GPU times (the
captured pair, `captured` and `captured-twin`):

- `rest` = the twin's back-to-back step less its split kernels: the part no attention kernel changes;
- `gaac_extra` = GAAC's step less its split kernels and that rest: what GAAC adds elsewhere (block finalization, its
  combine against the twin's);
- the split kernel time per layer GAAC would need for the target, with rest and extra as measured (and with no extra),
  and the read rate over its compressed bytes (`--probe`: a `warps_probe.py` JSON at 1 x context) that this means;
- the ratio bounds: GAAC's split kernel at its zero-decode build's time (`--zero-decode CONTEXT=US`, the build that only
  copies, e.g. session 25's frame probe at 1x64K or `warps_probe.py --set bounds`' `gaac_zero_decode`), and at the
  measured HBM read rate with no frame at all (`--hbm-tb-per-s`, ../shared/gpu/README.md: 4.30); each also with the
  model's matrix products reading its weights (the JSON's `param_bytes`) at that rate, both steps alike.

    python benchmarks/step_ratio_bounds.py benchmarks/results/generate_ov_defines_s29.json \\
        --probe benchmarks/results/warps_probe_bounds128_s29.json --zero-decode 65536=46.88 \\
        --out benchmarks/results/step_ratio_bounds_s32.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.target_rates import parse_shape  # noqa: E402

TARGETS = {65536: 1.10, 131072: 1.15}  # issue 13: the captured GAAC step against its twin
SPLIT = "gaac_decode_split"


def split_ms(variant: dict) -> tuple[float, float]:
    """(ms per step, calls per step) of the split kernel in a captured variant's profile."""
    for name, ms, calls in variant["gpu_kernels"]["top"]:
        if name == SPLIT:
            return ms, calls
    raise ValueError(f"no {SPLIT} among the profiled kernels: run generate.py with its GPU profile")


def _variant(ctx: dict, prefix: str) -> dict:
    found = [v for k, v in ctx.items() if k.startswith(prefix) and isinstance(v, dict)]
    if len(found) != 1:
        raise ValueError(f"expected one '{prefix}...' variant, found {len(found)}")
    return found[0]


def bounds(gen: dict, gaac_bytes: dict[int, int], zero_us: dict[int, float], hbm_tb_per_s: float) -> list[dict]:
    rows = []
    for key, ctx in gen["contexts"].items():
        context = int(key)
        gaac, twin = _variant(ctx, "captured GAAC"), _variant(ctx, "captured twin")
        g_step, t_step = gaac["pipelined_ms"], twin["pipelined_ms"]  # back to back: the targets' numbers
        g_split, layers = split_ms(gaac)
        t_split, _ = split_ms(twin)
        rest = t_step - t_split
        extra = g_step - g_split - rest
        matmul = twin["gpu_kernels"]["by_kind_ms"].get("matmul", 0.0)
        ideal_matmul = gen["param_bytes"] / (hbm_tb_per_s * 1e12) * 1e3  # ms: the weights read once at that rate
        lean_rest = rest - max(matmul - ideal_matmul, 0.0)

        def ratio(split_us: float, rest_ms: float) -> float:
            return (rest_ms + t_split) / (rest_ms + extra + layers * split_us / 1e3)

        row = {"context": context, "layers": layers, "gaac_step_ms": g_step, "twin_step_ms": t_step,
               "ratio_now": t_step / g_step, "gaac_split_us": g_split / layers * 1e3,
               "twin_split_us": t_split / layers * 1e3, "rest_ms": rest, "gaac_extra_ms": extra,
               "matmul_ms": matmul, "matmul_at_hbm_rate_ms": ideal_matmul, "target": TARGETS.get(context)}
        if row["target"]:
            need = (t_step / row["target"] - rest - extra) / layers * 1e3
            lean = (t_step / row["target"] - rest) / layers * 1e3  # had GAAC added nothing outside its kernel
            row["needed_split_us"], row["needed_split_us_no_extra"] = need, lean
            if context in gaac_bytes:
                row["gaac_bytes"] = gaac_bytes[context]
                row["needed_tb_per_s"] = gaac_bytes[context] / need / 1e6 if need > 0 else float("inf")
                row["needed_tb_per_s_no_extra"] = gaac_bytes[context] / lean / 1e6 if lean > 0 else float("inf")
        if context in zero_us:
            row["zero_decode_us"] = zero_us[context]
            row["ratio_zero_decode"] = ratio(zero_us[context], rest)
            row["ratio_zero_decode_matmul_at_hbm_rate"] = ratio(zero_us[context], lean_rest)
        if context in gaac_bytes:
            frameless = gaac_bytes[context] / (hbm_tb_per_s * 1e12) * 1e6
            row["copies_at_hbm_rate_us"] = frameless
            row["ratio_copies_at_hbm_rate"] = ratio(frameless, rest)
            row["ratio_copies_at_hbm_rate_matmul_at_hbm_rate"] = ratio(frameless, lean_rest)
        rows.append(row)
    return rows


def probe_bytes(probe: dict) -> dict[int, int]:
    """GAAC's bytes at batch 1 and head_dim 128 with 32 query heads, by context, from a warps_probe JSON."""
    out = {}
    for r in probe["rows"]:
        hq, hkv, d, b, s = parse_shape(r["shape"])
        if (hq, hkv, d, b) == (32, 8, 128, 1):
            out[s] = r["bytes"]
    return out


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else "—"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("generate", help="a benchmarks/generate.py JSON of the captured pair with GPU kernel times")
    p.add_argument("--probe", default="", help="a warps_probe.py JSON: GAAC's bytes at 1 x context")
    p.add_argument("--zero-decode", default="", help="CONTEXT=US,...: the zero-decode build's split kernel time")
    p.add_argument("--hbm-tb-per-s", type=float, default=4.30)
    p.add_argument("--out", default="")
    args = p.parse_args()
    gen = json.loads(Path(args.generate).read_text())
    nbytes = probe_bytes(json.loads(Path(args.probe).read_text())) if args.probe else {}
    zero = {int(k): float(v) for k, v in (x.split("=") for x in args.zero_decode.split(",") if x)}
    rows = bounds(gen, nbytes, zero, args.hbm_tb_per_s)
    print(f"{args.generate} ({gen.get('device', '?')})")
    print("| context | now | target | split µs now GAAC / twin | GAAC split µs needed | TB/s needed | "
          "zero-decode µs | bound: zero decode | same, matmuls at HBM rate | bound: copies at HBM rate, no frame | "
          "same, matmuls at HBM rate |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['ratio_now']:.3f}× | {r['target'] or '—'} | {r['gaac_split_us']:.1f} / "
              f"{r['twin_split_us']:.1f} | {_cell(r, 'needed_split_us', '.1f')} | {_cell(r, 'needed_tb_per_s', '.2f')} | "
              f"{_cell(r, 'zero_decode_us', '.1f')} | {_cell(r, 'ratio_zero_decode', '.3f')} | "
              f"{_cell(r, 'ratio_zero_decode_matmul_at_hbm_rate', '.3f')} | {_cell(r, 'ratio_copies_at_hbm_rate', '.3f')} | "
              f"{_cell(r, 'ratio_copies_at_hbm_rate_matmul_at_hbm_rate', '.3f')} |")
    if args.out:
        res = {"generate": args.generate, "probe": args.probe, "device": gen.get("device"),
               "hbm_tb_per_s": args.hbm_tb_per_s, "rows": rows,
               "command": " ".join(["python", "benchmarks/step_ratio_bounds.py", *sys.argv[1:]])}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
