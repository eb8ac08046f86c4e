"""Which warp takes which split, measured: the CUDA kernel's work order (`GAAC_SPREAD`) on format version 2 as the
caches store it (the kernel's format 3), real-statistics KV, H200.

The one-warp kernel gives warp `w` of the grid split `w % nsplit` of kv head `w / nsplit` (order 0): one CTA's four
warps and an SM's three CTAs hold a few heads, and heads decode at different costs (their channels' 4-bit / raw
shares differ), so SMs holding costly heads finish last. Orders 1 and 2 interleave the heads warp by warp (2 also
turns by one head every second CTA, so that an SM's CTAs hold different heads). A split's partial result and where
it is written do not change: every order gives the twin's bits (checked here). Per-warp globaltimer stamps (the
kernel's `trace`) give the finish spread by kv head and by SM. Graph-replayed medians, JSON and a table:

    python benchmarks/split_order_probe.py --real-kv .bench/real_kv_2k.safetensors --out $OUT/split_order.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaac_cuda  # noqa: E402
from benchmarks.attention import bench_graph  # noqa: E402
from benchmarks.cuda_stream_probe import trace_summary  # noqa: E402
from benchmarks.format_v2_probe import SHAPES, compress_v2, probe_args, probe_shapes  # noqa: E402

ORDERS = (0, 1, 2)
TRACE_KEYS = ("done_p50_us", "done_max_us", "done_p50_by_kv_head_us", "sm_last_done_p10_us", "sm_last_done_max_us",
              "within_sm_spread_p50_us", "first_unit_latency_p50_us", "combine_first_start_us")


def main():
    args = probe_args(__doc__, "1,0,2,3", "benchmarks/results/split_order_probe.json")
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for (hq, hkv, d, b, s), k, v, q, scale, kv_len in probe_shapes(args, dev):
        t0 = time.time()
        packed, layout, info = compress_v2(k, v)
        pp = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, ws=0)
        twin = gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, pp)
        bufs = [packed] + [tuple(x.clone() for x in packed) for _ in range(args.buffers - 1)]
        row = {"shape": f"{hq}/{hkv}/{d} {b}x{s}", "nsplit": pp.nsplit, "bytes": info["bytes"],
               "mode_shares": [round(x, 5) for x in info["mode_shares"]]}

        def run(i, pc, combine=True, trace=None):
            pk = bufs[i]
            return gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, None, scale, layout, pc,
                                              combine=combine, trace=trace)

        for order in ORDERS:
            kw = dict(slot_bytes=layout.slot_bytes, format_version=3, nsplit=pp.nsplit, ws=0,
                      defines=(f"GAAC_SPREAD={order}",))
            pc = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, **kw)
            got = run(0, pc)
            us = bench_graph(lambda i, pc=pc: run(i, pc), args.buffers)
            entry = {"bit_identical_to_twin": torch.equal(got.view(torch.int16), twin.view(torch.int16)), "us": us,
                     "tb_per_s": round(info["bytes"] / us / 1e6, 3),
                     "split_only_us": bench_graph(lambda i, pc=pc: run(i, pc, combine=False), args.buffers)}
            pt = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, trace=True, **kw)
            tr = torch.full((gaac_cuda.trace_size(pt),), -(2 ** 62), dtype=torch.int64, device=dev)
            run(0, pt, trace=tr)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for i in range(args.buffers):
                    run(i, pt, trace=tr)
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            summary = trace_summary(tr.cpu(), pt)
            entry["trace"] = {key: summary.get(key) for key in TRACE_KEYS}
            row[f"order_{order}"] = entry
            print(row["shape"], order, json.dumps(entry), flush=True)
        row["twin_us"] = bench_graph(lambda i: gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, pp),
                                     args.buffers)
        res["rows"].append(row)
        print(f"({time.time() - t0:.0f}s)", flush=True)
        bufs = packed = None  # free the pools before the next shape
        torch.cuda.empty_cache()
    print("\n| shape | " + " | ".join(f"order {o} µs (split only; last SM done)" for o in ORDERS) + " |")
    print("|---" * (len(ORDERS) + 1) + "|")
    for r in res["rows"]:
        cells = []
        for o in ORDERS:
            e = r[f"order_{o}"]
            bad = "" if e["bit_identical_to_twin"] else " BITS DIFFER"
            cells.append(f"{e['us']:.1f} ({e['split_only_us']:.1f}; {e['trace']['sm_last_done_max_us']:.1f}){bad}")
        print(f"| {r['shape']} | " + " | ".join(cells) + " |")
    res["command"] = " ".join(["python", "benchmarks/split_order_probe.py", *sys.argv[1:]])
    res["shapes"] = [SHAPES[int(x)] for x in args.shapes.split(",")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
