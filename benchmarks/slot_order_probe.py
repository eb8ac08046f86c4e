"""Is the compressed kernel's copy pipeline limited by where the slots lie? (issue 12, session 18)

Session 18's leave-one-stage-out breakdown at the 12-warp default (`format_v2_probe_s18_breakdown.json`) put the
1x64K kernel at 63.7 us with its loads alone at 61.7: reconstruction and math are hidden, the copies set the time,
and they move the 193 MB of slots at 3.1 TB/s where the plain twin's copies move 268 MB in 70 us. The caches place a
block's slots of every head together (a split's consecutive units lie 2 x kv_heads slots apart); a head-major pool
(each (row, K/V, head) run of units contiguous, `format_v2_probe.head_major`) reads like the twin's rows. Session 13
found no difference when the kernel was compute-bound; this probe asks again now that it is not: per shape, the
full kernel and its loads-only build (`skip=3`, wrong results by design) on both pools, the twin and its loads-only
build (`skip=1`), and cuDNN, graph-replayed over rotating buffers. Bits of both full compressed runs against the twin.

    python benchmarks/slot_order_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes 1,2,0 --out $OUT/so.json
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
from benchmarks.format_v2_probe import (  # noqa: E402
    compress_v2, cudnn_us, head_major, probe_args, probe_shapes, save_probe)


def main():
    args = probe_args(__doc__, "1,2,0", "benchmarks/results/slot_order_probe.json")
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for (hq, hkv, d, b, s), k, v, q, scale, kv_len in probe_shapes(args, dev):
        t0 = time.time()
        packed, layout, info = compress_v2(k, v)
        pools = {"cache_order": packed, "head_major": head_major(packed)}
        row = {"shape": f"{hq}/{hkv}/{d} {b}x{s}", "bytes": info["bytes"], "bf16_bytes": 4 * k.numel()}
        kvs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(args.buffers - 1)]
        for skip, key in ((0, "twin_us"), (1, "twin_loads_only_us")):
            pl = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, skip=skip)
            if not skip:  # the bits every full compressed run is checked against
                want = gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, pl)
            row[key] = bench_graph(lambda i, pl=pl: gaac_cuda.plain_decode_attention(
                q, kvs[i][0], kvs[i][1], kv_len, None, scale, pl), args.buffers)
        for name, pk0 in pools.items():
            bufs = [pk0] + [tuple(x.clone() for x in pk0) for _ in range(args.buffers - 1)]
            entry = {}
            for skip, key in ((0, "us"), (3, "loads_only_us")):
                pl = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, format_version=3,
                                    skip=skip)

                def run(i, pl=pl, bufs=bufs):
                    pk = bufs[i]
                    return gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, None, scale, layout, pl)
                if not skip:
                    entry["bit_identical_to_twin"] = torch.equal(run(0).view(torch.int16), want.view(torch.int16))
                entry[key] = bench_graph(run, args.buffers)
            entry["tb_per_s"] = round(info["bytes"] / entry["us"] / 1e6, 3)
            entry["loads_tb_per_s"] = round(info["bytes"] / entry["loads_only_us"] / 1e6, 3)
            row[name] = entry
            del bufs
        row["cudnn_us"] = cudnn_us(q, kvs, scale, args.buffers)
        row["twin_loads_tb_per_s"] = round(row["bf16_bytes"] / row["twin_loads_only_us"] / 1e6, 3)
        res["rows"].append(row)
        print(json.dumps(row), f"({time.time() - t0:.0f}s)", flush=True)
        pools = packed = kvs = None  # free the pools before the next shape
        torch.cuda.empty_cache()
    print("\n| shape | cache order (loads only) | head-major (loads only) | twin (loads only) | cuDNN |")
    print("|---|---|---|---|---|")
    for r in res["rows"]:
        c, h = r["cache_order"], r["head_major"]
        print(f"| {r['shape']} | {c['us']:.1f} ({c['loads_only_us']:.1f}) | {h['us']:.1f} ({h['loads_only_us']:.1f}) "
              f"| {r['twin_us']:.1f} ({r['twin_loads_only_us']:.1f}) | {r['cudnn_us']:.1f} |")
    save_probe(res, args, "slot_order_probe.py")


if __name__ == "__main__":
    main()
