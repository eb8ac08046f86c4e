"""The probes' shared runner: kernel variants timed and bit-checked against their twins planned alike, on format version
2 as the caches store it (the kernel's format 3), real-statistics KV, graph-replayed, cuDNN beside them; traced
variants also give their warps' finish times by launch rank and their phases from the kernel's globaltimer stamps.
`warps_probe.py` and `split_phases_probe.py` name their variant sets and call `run_probe` (session 17's
`balance_probe.py`, whose rank-weighted splits were removed in session 28, held it until then).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import gaac_cuda  # noqa: E402
from benchmarks.attention import bench_graph  # noqa: E402
from benchmarks.format_v2_probe import compress_v2, cudnn_us, save_probe  # noqa: E402
from benchmarks.format_v2_probe import probe_shapes  # noqa: E402
from benchmarks.warp_finish_probe import grouped  # noqa: E402

# the plan options that change the bits (and kernel defines: some do; and the CTA's warps, which the CTA merge groups
# by): a twin planned alike matches
SPLIT_KEYS = ("combine_warps", "nsplit", "cta_merge", "fused_combine", "defines", "warps")


def finish_by_rank(tr: torch.Tensor, pl, hkv: int, tokens: int | None = None) -> dict:
    """Finish times (µs after the first entry) grouped by the launch rank of the warp's CTA on its SM, and by warp
    group (warp index in the CTA // 4) for CTAs of more than 4 warps."""
    items = pl.items
    st = tr[: 4 * items].view(items, 4).cpu().double()
    live = st[:, 1] > -1e17
    done = (st[:, 2] - st[:, 0].min()) / 1e3
    sm = st[:, 3].long()
    w = torch.arange(items)  # warp w of the grid ran item w
    cta, warp = w // pl.warps, w % pl.warps
    rank = torch.zeros(items, dtype=torch.long)
    for smi in sm[live].unique():
        on = (sm == smi) & live
        rank[on] = torch.searchsorted(cta[on].unique(), cta[on])
    out = {"done_max_us": round(float(done[live].max()), 2), "done_p50_us": round(float(done[live].median()), 2),
           "by_cta_rank": grouped(done[live], rank[live])}
    # how much a perfect dynamic balance could take off the finish (the splits start together, so their work ends at
    # the mean finish if shared out evenly), and whether the late splits cluster by KV head (content: raw tiles,
    # escapes) or not (pace)
    out["done_p10_us"], out["done_p90_us"] = (round(float(done[live].quantile(f)), 2) for f in (0.1, 0.9))
    out["done_mean_us"] = round(float(done[live].mean()), 2)
    out["balance_bound_us"] = round(out["done_max_us"] - out["done_mean_us"], 2)
    out["by_kv_head"] = grouped(done[live], ((w // pl.nsplit) % hkv)[live])
    if pl.warps > 4:
        out["by_warp_group"] = grouped(done[live], (warp // 4)[live])
    # the phases of a split (µs after the first entry): entry, first unit ready, done; the streaming part per unit
    # (done - ready over the split's units, splits of equal length ± 1) and the combine kernel's block starts
    t0 = st[:, 0].min()
    entry, ready = (st[:, 0] - t0) / 1e3, (st[:, 1] - t0) / 1e3
    units = -(-tokens // 16) / pl.nsplit if tokens else None
    q = lambda x, f: round(float(x[live].quantile(f)), 2)  # noqa: E731
    out["phases"] = {"entry_p50_us": q(entry, 0.5), "entry_max_us": q(entry, 1.0),
                     "first_ready_p50_us": q(ready - entry, 0.5), "first_ready_max_us": q(ready - entry, 1.0),
                     "stream_p50_us": q(done - ready, 0.5), "stream_max_us": q(done - ready, 1.0)}
    if units:
        out["phases"]["stream_us_per_unit_p50"] = round(out["phases"]["stream_p50_us"] / max(units - 1, 1), 3)
    comb = tr[4 * items:].cpu().double()
    comb = comb[comb > -1e17]
    if comb.numel():
        out["phases"]["combine_start_min_us"] = round(float((comb.min() - t0) / 1e3), 2)
        out["phases"]["combine_start_max_us"] = round(float((comb.max() - t0) / 1e3), 2)
    return out


def run_probe(args, gaac_variants: dict, twin_variants: dict, traced: tuple, script: str) -> None:
    """Time and bit-check `gaac_variants` (plan options of the compressed kernel; an "nsplit" key overrides the
    shape's split count, and the twin it is checked against is planned alike) and `twin_variants` on each shape of
    `args.shapes`, with cuDNN beside them; the variants in `traced` also run with globaltimer stamps."""
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for (hq, hkv, d, b, s), k, v, q, scale, kv_len in probe_shapes(args, dev):
        t0 = time.time()
        packed, layout, info = compress_v2(k, v)
        bufs = [packed] + [tuple(x.clone() for x in packed) for _ in range(args.buffers - 1)]
        kvs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(args.buffers - 1)]
        nsplit = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True).nsplit
        row = {"shape": f"{hq}/{hkv}/{d} {b}x{s}", "nsplit": nsplit, "bytes": info["bytes"]}

        ones = torch.ones(b, s, dtype=torch.bool, device=dev)  # a padding mask that masks nothing (the same bits)

        def gaac(pl, i=0, trace=None, mask=False, combine=True):
            pk = bufs[i]
            return gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, ones if mask else None, scale, layout,
                                              pl, combine=combine, trace=trace)

        def twin(pl, i=0, mask=False):
            return gaac_cuda.plain_decode_attention(q, kvs[i][0], kvs[i][1], kv_len, ones if mask else None, scale, pl)

        def splits(kw):  # the variant's plan options, with the shape's split count unless it brings its own (a value,
            # or a function of the shape's count); "mask": True (not a plan option) passes `ones`, "combine": False
            # times the split kernel alone
            n = kw.get("nsplit", nsplit)
            return {**{k2: v2 for k2, v2 in kw.items() if k2 not in ("mask", "combine")},
                    "nsplit": n(nsplit) if callable(n) else n}

        twins = {}  # the bits of the default twin, per value of the SPLIT_KEYS options

        def twin_bits(kw):
            split_kw = {k2: v2 for k2, v2 in splits(kw).items() if k2 in SPLIT_KEYS}
            key = tuple(sorted(split_kw.items()))
            if key not in twins:
                twins[key] = twin(gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, **split_kw))
            return twins[key]

        def gaac_variant(label, kw):
            pl = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, format_version=3,
                                **splits(kw))
            mk, cb = kw.get("mask", False), kw.get("combine", True)
            out = gaac(pl, mask=mk, combine=cb)
            want = twin_bits(kw)
            us = bench_graph(lambda i, pl=pl: gaac(pl, i, mask=mk, combine=cb), args.buffers)
            entry = {"us": us, "tb_per_s": round(info["bytes"] / us / 1e6, 3),
                     "bit_identical_to_twin": torch.equal(out.view(torch.int16), want.view(torch.int16))}
            if label not in traced:
                row[label] = entry
                print(row["shape"], label, json.dumps(entry), flush=True)
                return
            pt = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, format_version=3,
                                trace=True, **splits(kw))
            tr = torch.full((gaac_cuda.trace_size(pt),), -(2 ** 62), dtype=torch.int64, device=dev)
            gaac(pt, trace=tr, mask=mk, combine=cb)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                gaac(pt, trace=tr, mask=mk, combine=cb)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            entry["finish"] = finish_by_rank(tr, pt, hkv, s)
            row[label] = entry
            print(row["shape"], label, json.dumps(entry), flush=True)

        def failed(label, e):  # one variant that cannot run must not lose the others' numbers
            row[label] = {"error": f"{type(e).__name__}: {e}"[:500]}
            print(row["shape"], label, "FAILED", row[label]["error"], flush=True)

        for label, kw in twin_variants.items():
            try:
                pl = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, **splits(kw))
                mk = kw.get("mask", False)
                out = twin(pl, mask=mk)
                row[label] = {"us": bench_graph(lambda i, pl=pl, mk=mk: twin(pl, i, mask=mk), args.buffers),
                              "same_bits_as_default_twin": torch.equal(out.view(torch.int16),
                                                                  twin_bits(kw).view(torch.int16))}
            except Exception as e:  # noqa: BLE001
                failed(label, e)
        for label, kw in gaac_variants.items():
            try:
                gaac_variant(label, kw)
            except Exception as e:  # noqa: BLE001
                failed(label, e)
        row["cudnn_us"] = cudnn_us(q, kvs, scale, args.buffers)
        res["rows"].append(row)
        print(row["shape"], {k2: v2 for k2, v2 in row.items() if k2.startswith("twin") or k2 == "cudnn_us"},
              f"({time.time() - t0:.0f}s)", flush=True)
        bufs = kvs = packed = None  # free the pools before the next shape
        torch.cuda.empty_cache()
    labels = list(gaac_variants) + list(twin_variants)
    print("\n| shape | " + " | ".join(labels) + " | cuDNN |")
    print("|---" * (len(labels) + 2) + "|")
    for r in res["rows"]:
        cells = [("error" if "us" not in r.get(lab, {}) else f"{r[lab]['us']:.1f}")
                 + ("" if r.get(lab, {}).get("bit_identical_to_twin", True) else " BITS DIFFER") for lab in labels]
        print(f"| {r['shape']} | " + " | ".join(cells) + f" | {r['cudnn_us']:.1f} |")
    save_probe(res, args, script)
