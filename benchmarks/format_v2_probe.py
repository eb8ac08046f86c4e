"""The format-v2 question of issue 12, measured in the CUDA kernel: a byte-split slot prototype.

Format 1 (docs/format.md) keeps each element's sign+mantissa byte and codes its 8-bit exponent; the kernel then
rebuilds a BF16 pair with a byte permute, two shifts and two bit-selects per 4 elements, because the exponent
straddles the two bytes of a BF16. The prototype ("format 2") splits at the byte boundary instead: the BF16 low byte
(exponent bit 0 and the mantissa) is kept verbatim where format 1 keeps sign+mantissa, the high byte's 7 exponent bits
are coded against windows that start at even exponents (codes relative to base / 2, so a 3-bit window is a 2-bit code
of the high byte) and the sign is bit-plane 0. Sizes, section offsets, mode rules and escape bytes per mode are those
of format 1 (bit-planes 1-2 hold code bits 0-1; a 4-bit group escapes code bit 2, a raw group code bits 2-6), and a
pair is one byte permute. `benchmarks/tied_windows.py` measured what even windows cost in ratio (1.405x, 27.6%
resident saving on held-out SmolLM2 KV, against 1.409x / 27.9%).

"Format 3" is format 2's slots permuted into the order the kernel's mma fragments consume them
(`to_fragment_order`; the kernel's `k_tile_f3` / `v_tile_f3`): format version 2 of docs/format.md as the caches store
it on Hopper since session 14 (the plane-order format 2 kernel was removed then).

This script encodes the same real-statistics KV in formats 1 and 3 (format 3 with the caches' own encoder,
`benchmarks/attention.py`'s `compress(format_version=2)`), checks each
kernel variant (`VARIANTS`) bit for bit against the plain-BF16 twin at the
same split count (a variant with fewer than 12 warps per SM takes proportionally fewer splits, so it runs in one
wave), and times them and cuDNN, graph-replayed:

    python benchmarks/format_v2_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes 1,3,0,2 --out $OUT/probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaac_cuda  # noqa: E402
from benchmarks.attention import bench_graph, compress, real_kv  # noqa: E402
from gaac_hf.format import TileLayout, tile_split  # noqa: E402

SHAPES = [("llama8b", 32, 8, 128, 1, 16384), ("llama8b", 32, 8, 128, 1, 65536), ("llama8b", 32, 8, 128, 4, 65536),
          ("smollm2", 9, 3, 64, 1, 65536), ("llama8b", 32, 8, 128, 1, 131072), ("64q8kv", 64, 8, 128, 1, 65536)]


def head_major(packed: tuple) -> tuple:
    """The same slots with each (row, K/V, head) run of units contiguous in the pool (GAACCache allocates a block's
    slots of every head together, so one head's consecutive units lie 2 x heads slots apart); the table follows."""
    slot_pool, raw_pool, table, *rest = packed
    t = table.permute(0, 2, 3, 4, 1)  # [B, 2, H, T, n]: head-major order
    old = t[t >= 0]
    new_t = t.clone()
    new_t[t >= 0] = torch.arange(old.numel(), dtype=table.dtype, device=table.device)
    return (slot_pool[old.long()].contiguous(), raw_pool, new_t.permute(0, 4, 1, 2, 3).contiguous(), *rest)


def compress_v2(k: torch.Tensor, v: torch.Tensor, capacity: int | None = None):
    """Format version 2 as the caches store it (even windows, the caches' encoder: fragment order at 64/128 channels)
    -> (packed, layout, info): `benchmarks/attention.py`'s `compress` with the slot layout. `capacity`: see there."""
    packed, info = compress(k, v, capacity, format_version=2)
    return packed, TileLayout(tile_split(k.shape[-1])[1], info["escape_capacity"]), info


VARIANTS = (  # label, format, stages and CTAs of 4 warps per SM (0: the defaults), more compile-time defines
    ("format_1", 1, 0, 0, ()), ("format_3", 3, 0, 0, ()))
# Also measured, none the fastest (the kernel's format 2 and raw patches 1 / 2 removed in session 14): format 2,
# format 1/2/3 at ws 6, format 3 at ws 3 x 4 CTAs and with raw groups
# patched per word (raw_patch 1) in session 12 (format_v3_probe_s12_rawbf.json); format 3 with the branch-free patch
# (raw_patch 2) and with the overlay at ws 3 x 3,
# 5 x 2, 6 x 2 and 11 x 1 in session 13 (format_v3_probe_s13_overlay_first.json), and with each chunk pair fused
# into its mmas (removed, format_v3_probe_s13_overlay_second.json); the one-warp kernel with 3 stages at 2 CTAs
# per SM and without the duplicated tile code (GAAC_F3DUP=0, removed in session 28) (format_v3_probe_s13_dup.json); slots head-major in the
# pool (head_major, no faster: format_v3_probe_s13.json); the warp-specialized kernel (removed in session 28) at ws
# 2..6 at one wave (format_v3_probe_s13_ws.json); a dynamic split schedule, removed after measuring it (format_v3_probe_s13_dyn.json,
# format_v3_probe_s13_dyn_home.json; the kernel is in git history, commit 1d8ca1f).


def probe_args(doc: str, shapes: str, out: str, sets: tuple = ()) -> argparse.Namespace:
    """The command line of a probe over SHAPES on real-statistics KV (`sets`: named variant sets, the first the
    default, chosen with --set)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    p.add_argument("--buffers", type=int, default=3)
    p.add_argument("--shapes", default=shapes, help="indices into format_v2_probe.SHAPES")
    p.add_argument("--out", default=out)
    if sets:
        p.add_argument("--set", default=sets[0], choices=sets, help="the variant set")
    return p.parse_args()


def save_probe(res: dict, args: argparse.Namespace, script: str, indent: int | None = 1) -> None:
    """A probe's JSON with the command that made it, at `args.out`."""
    res["command"] = " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=indent) + "\n")


def cudnn_us(q: torch.Tensor, kvs: list, scale: float, buffers: int) -> float:
    """cuDNN SDPA's graph-replayed time on the BF16 KV pairs `kvs` (rotating), query `q` `[B, Hq, D]`: the baseline
    of every probe."""
    q4 = q.unsqueeze(2)

    def cudnn(i):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q4, kvs[i][0], kvs[i][1], scale=scale, enable_gqa=True)
    return bench_graph(cudnn, buffers)


def probe_shapes(args: argparse.Namespace, dev: torch.device):
    """Per shape of `args.shapes`: ((q heads, kv heads, head_dim, batch, tokens), K, V, q, scale, kv_len) on `dev`, K
    and V real KV channels tiled to the shape."""
    pool = load_file(args.real_kv)["kv"]
    gen = torch.Generator().manual_seed(0)
    for si in (int(x) for x in args.shapes.split(",")):
        _, hq, hkv, d, b, s = SHAPES[si]
        k, v = (t.to(dev) for t in real_kv(pool, b, hkv, s, d, gen))
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        yield (hq, hkv, d, b, s), k, v, q, d ** -0.5, torch.full((b,), s, dtype=torch.int32, device=dev)


def main():
    args = probe_args(__doc__, "0,1,2,3", "benchmarks/results/format_v2_probe.json")
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for (hq, hkv, d, b, s), k, v, q, scale, kv_len in probe_shapes(args, dev):
        t0 = time.time()
        p1, info1 = compress(k, v)
        l1 = TileLayout(tile_split(d)[1], info1["escape_capacity"])
        p3, l3, info3 = compress_v2(k, v)
        encoded = {1: (p1, l1, info1), 3: (p3, l3, info3)}
        pp = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True)
        twin = gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, pp)
        row = {"shape": f"{hq}/{hkv}/{d} {b}x{s}", "bf16_bytes": 4 * k.numel(), "nsplit": pp.nsplit}
        for label, fmt, stages, ctas, defines in VARIANTS:
            packed, layout, info = encoded[fmt]
            if label.endswith("_hm"):
                packed = head_major(packed)
            kw = dict(defines=defines) if not stages else dict(stages=stages, min_ctas=ctas, warps=4, defines=defines)
            warps_per_sm = 4 * ctas if stages else 12
            # one wave: the twin's splits fill 12 warps per SM; a variant with fewer warps per SM takes
            # proportionally fewer (whole CTAs) and is checked against the twin at that count
            nsplit = pp.nsplit if warps_per_sm == 12 else max(4, pp.nsplit * warps_per_sm // 12 // 4 * 4)
            pc = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, format_version=fmt,
                                nsplit=nsplit, **kw)
            got = gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale, layout, pc)
            # (the twin planned alike: CTA merge and fused combine as the variant's)
            alike = (pc.cta_merge, pc.fused_combine) == (pp.cta_merge, pp.fused_combine)
            want = twin if nsplit == pp.nsplit and alike else gaac_cuda.plain_decode_attention(
                q, k, v, kv_len, None, scale, gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, nsplit=nsplit,
                                                             cta_merge=pc.cta_merge,
                                                             fused_combine=pc.fused_combine))
            bufs = [packed] + [tuple(x.clone() for x in packed) for _ in range(args.buffers - 1)]

            def run(i, pc=pc, layout=layout, bufs=bufs, skip_plan=None):
                pk = bufs[i]
                gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, None, scale, layout, skip_plan or pc)
            us = bench_graph(run, args.buffers)
            entry = {"bit_identical_to_twin": torch.equal(got.view(torch.int16), want.view(torch.int16)),
                     "nsplit": nsplit,
                     "us": us, "bytes": info["bytes"], "ratio": round(row["bf16_bytes"] / info["bytes"], 4),
                     "tb_per_s": round(info["bytes"] / us / 1e6, 3), "escape_capacity": info["escape_capacity"],
                     "raw_tiles": info["raw_tiles"], "mode_shares": [round(x, 5) for x in info["mode_shares"]],
                     "registers": pc.kernels(dev)[0].registers, "smem": pc.smem}
            if (b, s, hq) == (1, 65536, 32):
                skips = ((1, "no_math_us"), (2, "no_reconstruction_us"), (3, "loads_only_us"))
                if fmt == 3:  # wrong results by design: what code bit 2 and the raw patch cost
                    skips += ((4, "no_code_bit2_us"), (8, "no_raw_patch_us"), (12, "neither_us"))
                for skip, key in skips:
                    pv = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes,
                                        format_version=fmt, nsplit=nsplit, skip=skip, **kw)
                    entry[key] = bench_graph(lambda i, pv=pv, run=run: run(i, skip_plan=pv), args.buffers)
            row[label] = entry
            print(label, json.dumps(entry), flush=True)
        row["twin_us"] = bench_graph(lambda i: gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, pp),
                                     args.buffers)
        pd = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True)
        row["twin_default_us"] = bench_graph(
            lambda i: gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, pd), args.buffers)
        kvs = [(k, v)] + [(k.clone(), v.clone()) for _ in range(args.buffers - 1)]
        try:
            row["cudnn_us"] = cudnn_us(q, kvs, scale, args.buffers)
        except RuntimeError as err:  # noqa: PERF203
            row["cudnn_us"] = None
            row["cudnn_error"] = str(err)[:200]
        best = min((row[lab]["us"], lab) for lab, *_ in VARIANTS if lab != "format_1" and row[lab]["bit_identical_to_twin"])
        row["best_prototype"] = best[1]
        row["speedup_best_vs_format_1"] = round(row["format_1"]["us"] / best[0], 3)
        if row["cudnn_us"]:
            row["best_vs_cudnn"] = round(row["cudnn_us"] / best[0], 3)
        res["rows"].append(row)
        print(json.dumps({k2: v2 for k2, v2 in row.items() if not isinstance(v2, dict)}), f"({time.time() - t0:.0f}s)",
              flush=True)
        del encoded, p1, p3, bufs, kvs
        torch.cuda.empty_cache()
    labels = [v[0] for v in VARIANTS]
    print("\n| shape | " + " | ".join(labels) + " | twin (one-warp / default) | cuDNN |")
    print("|---" * (len(labels) + 3) + "|")
    for r in res["rows"]:
        cells = [f"{r[lab]['us']:.1f}{'' if r[lab]['bit_identical_to_twin'] else ' (BITS DIFFER)'}" for lab in labels]
        print(f"| {r['shape']} | " + " | ".join(cells) + f" | {r['twin_us']:.1f} / {r['twin_default_us']:.1f} | "
              f"{r['cudnn_us'] or float('nan'):.1f} |")
    save_probe(res, args, "format_v2_probe.py")


if __name__ == "__main__":
    main()
