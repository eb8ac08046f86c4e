"""Why the one-warp CUDA kernel's warps of one SM finish apart (15 µs at 1x64K, 60 µs at 4x64K, session 15): per-warp
globaltimer stamps of format version 2 (the kernel's format 3) on real-statistics KV, grouped by what could decide a
warp's pace: its CTA's rank among the CTAs of its SM (launch order), its warp index in the CTA (which scheduler it
shares with whom), its kv head (mode mix) and its split's unit count. Graph-replayed like the timings; raw stamps and
the grouped medians as JSON:

    python benchmarks/warp_finish_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes 1,2 --out $OUT/warp_finish.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaac_cuda  # noqa: E402
from benchmarks.attention import capture_graph  # noqa: E402
from benchmarks.format_v2_probe import compress_v2, probe_args, probe_shapes, save_probe  # noqa: E402


def grouped(done: torch.Tensor, key: torch.Tensor) -> dict:
    """Median and max finish time (µs) per value of `key`."""
    return {int(k): [round(float(done[key == k].median()), 2), round(float(done[key == k].max()), 2),
                     int((key == k).sum())] for k in key.unique()}


def main():
    args = probe_args(__doc__, "1,2", "benchmarks/results/warp_finish_probe.json")
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for (hq, hkv, d, b, s), k, v, q, scale, kv_len in probe_shapes(args, dev):
        packed, layout, _ = compress_v2(k, v)
        pp = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True)
        pt = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, format_version=3,
                            nsplit=pp.nsplit, trace=True)
        tr = torch.full((gaac_cuda.trace_size(pt),), -(2 ** 62), dtype=torch.int64, device=dev)

        g = capture_graph(lambda: gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale,
                                                              layout, pt, trace=tr))
        for _ in range(5):
            g.replay()
        torch.cuda.synchronize()
        items = pt.items
        st = tr[: 4 * items].view(items, 4).cpu().double()
        t0 = st[:, 0].min()
        entry, first, done = ((st[:, i] - t0) / 1e3 for i in range(3))
        sm = st[:, 3].long()
        item = torch.arange(items)
        cta, warp = item // 4, item % 4
        head = item // pt.nsplit % hkv
        # rank of the warp's CTA among the CTAs on its SM, by block index (the launch order)
        rank = torch.zeros(items, dtype=torch.long)
        for smi in sm.unique():
            on = sm == smi
            ctas = cta[on].unique()  # sorted
            rank[on] = torch.searchsorted(ctas, cta[on])
        nb = -(-s // 16)
        per = -(-nb // pt.nsplit)  # units per split (the kernel's even split; the last splits may be short)
        units = (nb - (item % pt.nsplit) * per).clamp(0, per)
        row = {"shape": f"{hq}/{hkv}/{d} {b}x{s}", "nsplit": pt.nsplit, "items": items,
               "done_by_cta_rank_on_sm": grouped(done, rank), "done_by_warp_in_cta": grouped(done, warp),
               "done_by_kv_head": grouped(done, head), "done_by_units": grouped(done, units),
               "entry_by_cta_rank_on_sm": grouped(entry, rank), "first_by_cta_rank_on_sm": grouped(first, rank),
               "raw": {"sm": sm.tolist(), "entry": [round(x, 3) for x in entry.tolist()],
                       "first": [round(x, 3) for x in first.tolist()], "done": [round(x, 3) for x in done.tolist()]}}
        res["rows"].append(row)
        print(json.dumps({k2: v2 for k2, v2 in row.items() if k2 != "raw"}), flush=True)
    save_probe(res, args, "warp_finish_probe.py", indent=None)


if __name__ == "__main__":
    main()
