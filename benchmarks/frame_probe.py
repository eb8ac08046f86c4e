"""Why does the decode kernel stream slower per unit than the bare copy pipeline? (issue 12, session 25)

Session 25's `warps_probe.py --set frame2` timed the split kernel alone (no combine) at 1x64K: the default 57.4 us,
a build stripped of everything but its copies (GAAC_SKIP 3|128|256 with the table entries from the lanes: one word
of each tile read, ~100 SASS instructions per unit, as `benchmarks/device/stream_probe.cu` does) 55.8 us, with
2.28 us per unit against the bare pipeline's 1.92 (`stream_probe.py --trace`, 47.2 us, the same slots through the
real block table and the kernel's shared-memory layout). The two ran in different processes on different buffers.
This probe runs both in one process, each traced, on the same 1x64K cache (real-statistics KV): the kernel builds,
then the bare pipeline over the cache's own slot pools (the benchmark's three rotating copies) and over one random
buffer, interleaved and repeated so a drift in the GPU's state shows as a drift, not as a difference.

    python benchmarks/frame_probe.py --real-kv .bench/real_kv_2k.safetensors --out $OUT/frame_probe.json
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
from benchmarks.probe_runner import finish_by_rank  # noqa: E402
from benchmarks.format_v2_probe import compress_v2, probe_args, probe_shapes  # noqa: E402
from benchmarks import stream_probe  # noqa: E402
from benchmarks.warps_probe import BARE  # noqa: E402

KERNELS = {  # label: plan options of the split kernel (timed without its combine)
    "gaac_split_only": {},
    "gaac_bare_split_only": BARE,
    # the ring after a 64-byte header (the default before session 25): every bulk copy's shared-memory destination 64
    # bytes off a 128-byte line (session 25's first runs: these were the defaults, and `_hdr128` the aligned builds)
    "gaac_split_only_hdr64": {"defines": ("GAAC_HDR=64",)},
    "gaac_bare_split_only_hdr64": {**BARE, "defines": BARE["defines"] + ("GAAC_HDR=64",)},
}


def main():
    args = probe_args(__doc__, "1", "benchmarks/results/frame_probe.json")
    args.shapes = "1"  # the stream probe's shape: 32/8/128 1x65536
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    (hq, hkv, d, b, s), k, v, q, scale, kv_len = next(probe_shapes(args, dev))
    packed, layout, info = compress_v2(k, v)
    del k, v
    bufs = [packed] + [tuple(x.clone() for x in packed) for _ in range(args.buffers - 1)]
    table = packed[2][0, :, :, :, 0].cpu()  # [n, K/V, H]
    rnd_span = stream_probe.BUFFERS * (-(-stream_probe.offsets("real", table)[2] // 4096) * 4096)
    rnd = torch.randint(0, 255, (rnd_span,), dtype=torch.uint8, device=dev)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
           "bytes": info["bytes"], "rounds": []}

    def kernel(label, kw):
        base = dict(slot_bytes=layout.slot_bytes, format_version=3, **kw)
        pl = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, **base)

        def run(i, pl=pl, trace=None):
            pk = bufs[i]
            return gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, None, scale, layout, pl,
                                              combine=False, trace=trace)

        run(0)
        us = bench_graph(run, len(bufs))
        pt = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, trace=True, **base)
        tr = torch.full((gaac_cuda.trace_size(pt),), -(2 ** 62), dtype=torch.int64, device=dev)
        for i in range(3):  # the third of three back-to-back launches, each on its own buffer
            run(i % len(bufs), pt, tr)
        torch.cuda.synchronize()
        return {"us": round(us, 2), "finish": finish_by_rank(tr, pt, hkv, s)}

    pools = [bk[0] for bk in bufs]
    for rnd_i in range(2):
        row = {}
        t0 = time.time()
        for label, kw in KERNELS.items():
            row[label] = kernel(label, kw)
        row["stream_cache_pools"] = stream_probe.run("pool_real_ksmem", dev, None, sms, table, True, srcs=pools)
        row["stream_random"] = stream_probe.run("pool_real_ksmem", dev, rnd, sms, table, True)
        row["stream_random_hdr64"] = stream_probe.run("pool_real_ksmem_hdr64", dev, rnd, sms, table, True)
        row["stream_random_3_buffers"] = stream_probe.run(
            "pool_real_ksmem", dev, None, sms, table, True,
            srcs=[rnd[i * (rnd_span // stream_probe.BUFFERS):] for i in range(3)])
        res["rounds"].append(row)
        print(f"round {rnd_i} ({time.time() - t0:.0f}s)", flush=True)
    print("\n| round | variant | us | first ready p50 / max | us per unit p50 | done p50 / max |\n|---|---|---|---|---|---|")
    for i, row in enumerate(res["rounds"]):
        for label, r in row.items():
            fin = r.get("finish")
            ph = {**fin["phases"], "done_p50_us": fin["done_p50_us"], "done_max_us": fin["done_max_us"]} if fin \
                else r["phases"]
            print(f"| {i} | {label} | {r['us']} | {stream_probe.phase_cells(ph)} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
