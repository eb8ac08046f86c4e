"""How many slots in flight per SM the one-warp kernel's loads need (issue 12), on format-3 slots.

The one-warp kernel's copies are latency-bound: each warp keeps `stages` units in flight, and loads alone take the
same ~62 us at 1x64K whether 12 warps hold 2 stages or 8 warps hold 3 (session 13). A stage's tile buffers are sized
for a raw BF16 tile (4,096 bytes at 128 channels) while a slot is ~2,940, so a quarter of the ring carries nothing.
This probe encodes the KV with an escape capacity that no tile exceeds (no raw tiles: the slots grow a little), so
the buffers can be exactly a slot, and times deeper rings at the shared-memory budget: 1-, 2- and 4-warp CTAs,
2-4 stages. Every variant is checked bit for bit against the plain twin at its own split count (one wave of its
warps per SM), with its loads alone (`GAAC_SKIP=3`) beside it:

    python benchmarks/ring_depth_probe.py --real-kv .bench/real_kv_2k.safetensors --out $OUT/ring.json
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
from benchmarks.format_v2_probe import compress_v2, cudnn_us, probe_args, probe_shapes, save_probe  # noqa: E402

# label, capacity (None: calibrated, -1: no raw tiles), compact buffers, warps per CTA, stages, CTAs per SM
# (what fits 228 KB of shared memory per SM, 1 KB of it reserved per CTA, at head_dim 128 and ~3 KB slots)
VARIANTS = (("default", None, False, 4, 2, 3), ("no_raw_tiles", -1, False, 4, 2, 3),
            ("compact_w4_s2", -1, True, 4, 2, 3), ("compact_w1_s3", -1, True, 1, 3, 11),
            ("compact_w2_s3", -1, True, 2, 3, 5), ("compact_w4_s3", -1, True, 4, 3, 2),
            ("compact_w4_s4", -1, True, 4, 4, 2), ("compact_w1_s4", -1, True, 1, 4, 8))


def main():
    args = probe_args(__doc__, "1,3,2", "benchmarks/results/ring_depth_probe.json")
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for (hq, hkv, d, b, s), k, v, q, scale, kv_len in probe_shapes(args, dev):
        t0 = time.time()
        encoded = {cap: compress_v2(k, v, capacity=cap) for cap in (None, -1)}
        pp = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True)
        row = {"shape": f"{hq}/{hkv}/{d} {b}x{s}", "bf16_bytes": 4 * k.numel(), "twin_nsplit": pp.nsplit}
        for label, cap, compact, warps, stages, ctas in VARIANTS:
            packed, layout, info = encoded[cap]
            assert not compact or info["raw_tiles"] == 0, info
            nsplit = pp.nsplit * warps * ctas // 12
            compact_bytes = -(-(layout.slot_bytes + 112 + gaac_cuda.ESCAPE_SLACK) // 128) * 128
            kw = dict(warps=warps, stages=stages, min_ctas=ctas, format_version=3, nsplit=nsplit,
                      slot_bytes=layout.slot_bytes, buf_bytes=compact_bytes if compact else None)
            pc = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, **kw)
            got = gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale, layout, pc)
            twin = gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, gaac_cuda.plan(
                b, hkv, hq // hkv, d, s, dev, plain=True, nsplit=nsplit))
            bufs = [packed] + [tuple(x.clone() for x in packed) for _ in range(args.buffers - 1)]

            def run(i, pc=pc, layout=layout, bufs=bufs):
                pk = bufs[i]
                gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, None, scale, layout, pc)
            us = bench_graph(run, args.buffers)
            pl = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, skip=3, **kw)
            loads = bench_graph(lambda i, pl=pl, run=run: run(i, pc=pl), args.buffers)
            entry = {"bit_identical_to_twin": torch.equal(got.view(torch.int16), twin.view(torch.int16)),
                     "us": us, "loads_only_us": loads, "nsplit": nsplit, "bytes": info["bytes"],
                     "ratio": round(row["bf16_bytes"] / info["bytes"], 4), "slot_bytes": layout.slot_bytes,
                     "raw_tiles": info["raw_tiles"], "tb_per_s": round(info["bytes"] / us / 1e6, 3),
                     "loads_tb_per_s": round(info["bytes"] / loads / 1e6, 3), "smem_per_cta": pc.smem,
                     "registers": pc.kernels(dev)[0].registers}
            row[label] = entry
            print(label, json.dumps(entry), flush=True)
        kvs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(args.buffers - 1)]
        row["cudnn_us"] = cudnn_us(q, kvs, scale, args.buffers)
        res["rows"].append(row)
        print(row["shape"], f"cuDNN {row['cudnn_us']:.1f} us ({time.time() - t0:.0f}s)", flush=True)
        del encoded, bufs, kvs
        torch.cuda.empty_cache()
    labels = [x[0] for x in VARIANTS]
    print("\n| shape | " + " | ".join(labels) + " | cuDNN |")
    print("|---" * (len(labels) + 2) + "|")
    for r in res["rows"]:
        cells = [f"{r[lab]['us']:.1f} / {r[lab]['loads_only_us']:.1f}"
                 + ("" if r[lab]["bit_identical_to_twin"] else " (BITS DIFFER)") for lab in labels]
        print(f"| {r['shape']} | " + " | ".join(cells) + f" | {r['cudnn_us']:.1f} |")
    save_probe(res, args, "ring_depth_probe.py")


if __name__ == "__main__":
    main()
