"""The static cache's per-step append kernel on a GPU (issue 13): `triton_ops.gaac_append` at one layer of the
Llama-3.1-8B shape (batch 1, 8 KV heads, head_dim 128), format version 2 in fragment order as `GAACStaticCache`
stores it on Hopper, real-statistics KV. Graph-replayed µs of a step that only writes the tail row and of one that
completes the block (encodes K and V of every head into slots and writes the table), and the amortized cost per
decode step of a 32-layer model. Also run under Nsight Compute by `benchmarks/device/next_h200.sh append`.

    python benchmarks/append_probe.py --real-kv .bench/real_kv_2k.safetensors --out $OUT/append_probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.attention import bench_graph, real_kv  # noqa: E402
from gaac_hf.calibrate import choose_escape_capacity, exponent_histogram, tile_escape_bytes, windows_from_histogram  # noqa: E402,E501
from gaac_hf.format import TileLayout  # noqa: E402
from gaac_hf.format_v2 import fragment_map  # noqa: E402
from triton_ops.gaac_append import gaac_append  # noqa: E402

WARPS = (4, 8, 16)  # per program (one tile): the launcher's default first


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--out", default="benchmarks/results/append_probe.json")
    p.add_argument("--ncu", action="store_true", help="only two finalizing calls (for Nsight Compute), no timing")
    args = p.parse_args()
    dev = torch.device("cuda")
    b, h, d = 1, 8, 128
    k, v = real_kv(load_file(args.real_kv)["kv"], b, h, 2048, d, torch.Generator().manual_seed(0))
    kv = torch.stack([k[0], v[0]])[None]  # [1 layer, 2, H, T, D]
    b3, b4 = windows_from_histogram(exponent_histogram(kv), format_version=2)
    cap = choose_escape_capacity(tile_escape_bytes(kv, b3, b4).reshape(-1), d)
    layout = TileLayout(d, cap)
    frag = fragment_map(d, dev)
    n = 4 * 2 * h  # slots: room for the blocks the probe completes (later ones land in the scratch row)
    st = dict(tail_k=torch.zeros(b, h, 16, d, dtype=torch.bfloat16, device=dev),
              tail_v=torch.zeros(b, h, 16, d, dtype=torch.bfloat16, device=dev),
              slot_pool=torch.zeros(n + 1, layout.slot_bytes, dtype=torch.uint8, device=dev),
              raw_pool=torch.zeros(n + 1, 16, d, dtype=torch.bfloat16, device=dev),
              table=torch.full((b, 4, 2, h, 1), -1 - n, dtype=torch.int32, device=dev),
              slot_modes=torch.zeros(n + 1, 3, dtype=torch.int32, device=dev),
              raw_modes=torch.zeros(n + 1, 3, dtype=torch.int32, device=dev),
              counts=torch.zeros(2, dtype=torch.int32, device=dev))
    k, v = k.to(dev), v.to(dev)
    st["tail_k"].copy_(k[:, :, :16])
    st["tail_v"].copy_(v[:, :, :16])
    b3, b4 = b3.reshape(2 * h, d).to(dev), b4.reshape(2 * h, d).to(dev)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "kv_heads": h, "head_dim": d,
           "escape_capacity": cap, "slot_bytes": layout.slot_bytes}

    def step(length, kv_len, warps):
        gaac_append(k[:, :, length:length + 1], v[:, :, length:length + 1], st["tail_k"], st["tail_v"], kv_len,
                    b3, b4, st["slot_pool"], st["raw_pool"], st["table"], st["slot_modes"], st["raw_modes"],
                    st["counts"], layout, 2, frag, num_warps=warps)

    fin = torch.full((b,), 15, dtype=torch.int32, device=dev)  # tail row 15: completes block 0
    if args.ncu:
        for _ in range(2):
            step(15, fin, 4)
        torch.cuda.synchronize()
        return
    app = torch.full((b,), 7, dtype=torch.int32, device=dev)
    want = None
    for warps in WARPS:  # block 0 finalized once more at each width: the same slot bytes and table as with 4 warps
        for name in ("counts", "slot_pool", "raw_pool"):
            st[name].zero_()
        step(15, fin, warps)
        torch.cuda.synchronize()
        e = st["table"][:, 0].reshape(-1).long()  # block 0's entries (the pools fill in launch order)
        got = torch.cat([(e >= 0).to(torch.uint8), st["slot_pool"][e[e >= 0]].reshape(-1),
                         st["raw_pool"][-1 - e[e < 0]].reshape(-1).view(torch.uint8)])
        want = got.clone() if want is None else want
        res[f"warps_{warps}"] = {"append_us": round(bench_graph(lambda i: step(7, app, warps), 1, reps=50), 2),
                                 "finalize_us": round(bench_graph(lambda i: step(15, fin, warps), 1, reps=50), 2),
                                 "same_slots_as_4_warps": bool(torch.equal(got, want))}
        print(warps, res[f"warps_{warps}"], flush=True)
    res["append_us"], res["finalize_us"] = (res["warps_4"][x] for x in ("append_us", "finalize_us"))
    res["amortized_us_per_step"] = round(args.layers * ((15 * res["append_us"] + res["finalize_us"]) / 16), 1)
    res["finalization_extra_us_per_step"] = round(args.layers * (res["finalize_us"] - res["append_us"]) / 16, 1)
    print(json.dumps(res, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
