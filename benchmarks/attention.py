"""Decode attention on GAAC-compressed KV vs BF16 baselines, on one GPU, in one process.

KV carries real exponent statistics: channels of SmolLM2-135M-Instruct's captured KV (a `.safetensors` of
`[layers, 2, heads, tokens, 64]`, see --real-kv) laid out to the benchmarked head shapes, windows and slot capacity
calibrated on that data, so the 3-bit / 4-bit / raw mix is the real one. Checks correctness first (fused kernel on
compressed KV bit-identical to the same kernel on plain KV; close to fp64 attention), then times every variant with
`triton.testing.do_bench` (median) over rotating buffers, and reports achieved GB/s over the bytes each must read.

    python benchmarks/capture_real_kv.py --out .bench/real_kv_2k.safetensors   # on the CPU, once
    python benchmarks/attention.py --real-kv .bench/real_kv_2k.safetensors --out benchmarks/results/attention.json
"""

import argparse
import json
import platform
import time

import torch
import triton
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel

from gaac_hf.calibrate import choose_escape_capacity, exponent_histogram, windows_from_histogram
from gaac_hf.codec import encode_tiles, escape_bytes, group_modes, split_fields, split_head
from gaac_hf import ops
from gaac_hf.format import TileLayout, tile_split
import gaac_cuda
from triton_ops.gaac_attention import fused_compressed_attention, fused_plain_attention, plain_as_raw_tiles
from triton_ops.gaac_decode import expand_tiles

SHAPES = [  # (name, query heads, kv heads, head_dim, batch, context)
    ("llama8b", 32, 8, 128, 1, 16384), ("llama8b", 32, 8, 128, 1, 32768), ("llama8b", 32, 8, 128, 1, 65536),
    ("llama8b", 32, 8, 128, 1, 131072), ("llama8b", 32, 8, 128, 2, 65536), ("llama8b", 32, 8, 128, 4, 65536),
    ("llama8b", 32, 8, 128, 8, 16384), ("qwen3-32b", 64, 8, 128, 1, 65536), ("smollm2", 9, 3, 64, 1, 65536),
]


# the `gaac_cuda.plan` options with an off/on sweep, and their command-line flags (args attribute)
SWEEP_FLAGS = {"swizzle": "swizzle_sweep", "dense_slots": "dense_slots_sweep"}


def real_kv(pool: torch.Tensor, batch: int, heads: int, length: int, head_dim: int, gen) -> tuple:
    """K and V `[B, H, L, D]` whose channels are real captured KV channels (64 at a time), tiled along tokens."""
    n_layers, _, n_heads, t_src, c_src = pool.shape
    out = []
    for kv in range(2):
        parts = []
        for _ in range(head_dim // c_src):
            idx = torch.randint(0, n_layers * n_heads, (batch * heads,), generator=gen)
            src = pool[:, kv].reshape(n_layers * n_heads, t_src, c_src)[idx]  # [B*H, T, 64]
            reps = -(-length // t_src)
            parts.append(src.repeat(1, reps, 1)[:, :length])
        out.append(torch.cat(parts, -1).reshape(batch, heads, length, head_dim))
    return out


def lay_out(slots: torch.Tensor, fits: torch.Tensor, tiles: torch.Tensor) -> tuple:
    """Slot pool, raw pool and block table (>= 0 a slot, -1 - i raw tile i) as GAACCache lays them out, from every
    tile's encoded slot, whether it fits its slot, and the BF16 tiles."""
    dev = tiles.device
    raw_pool = tiles[~fits].contiguous()
    if raw_pool.shape[0] == 0:
        raw_pool = torch.zeros(1, 16, tiles.shape[-1], dtype=torch.bfloat16, device=dev)
    table = torch.empty(fits.shape, dtype=torch.int32, device=dev)
    table[fits] = torch.arange(int(fits.sum()), dtype=torch.int32, device=dev)
    table[~fits] = -1 - torch.arange(int((~fits).sum()), dtype=torch.int32, device=dev)
    return slots[fits].contiguous(), raw_pool, table


def compress(k, v, capacity=None, format_version=1):
    """Calibrate windows and capacity on this KV, encode, and lay out pools + table as GAACCache does (format version
    2: even windows and the caches' own encoder, `gaac_hf.ops.encode`, which writes the fragment order). `capacity`:
    the slots' escape capacity (None: the calibration's choice on the first 512 blocks; -1: the largest any tile
    needs, so no tile is raw)."""
    b, h, s, d = k.shape
    c = tile_split(d)[1]
    n = s // 16
    hist = exponent_histogram(torch.stack([k, v]).transpose(1, 2).reshape(1, 2, h, b * s, d))  # [1, 2, H, D, 256]
    base3, base4 = windows_from_histogram(hist[0], format_version)  # [2, H, D]
    shape = (2, h, d // c, c)
    b3, b4 = base3.reshape(shape), base4.reshape(shape)
    kv = torch.stack([k, v], 2)[:, :, :, : n * 16]  # [B, H, 2, n*16, D]
    tiles = split_head(kv.reshape(b, h, 2, n, 16, d).permute(0, 3, 2, 1, 4, 5))  # [B, n, 2, H, T, 16, C]
    if capacity is None:
        sample = tiles[:, : min(n, 512)]
        e = split_fields(sample)[0]
        esc = escape_bytes(group_modes(e, b3, b4))
        capacity = choose_escape_capacity(esc.reshape(-1), c)
    elif capacity < 0:
        need = max(int(escape_bytes(group_modes(split_fields(tiles[:, j:j + 512])[0], b3, b4)).max())
                   for j in range(0, n, 512))
        capacity = -(-need // 16) * 16
    slots, fits, modes = [], [], torch.zeros(3, dtype=torch.int64, device=k.device)
    step = max(1, 16384 // (2 * h * (d // c)))
    p = 2 * h * (d // c)
    for j in range(0, n, step):
        if format_version == 2:
            part = tiles[:, j:j + step]
            sl, ft, counts = ops.encode(part.reshape(b, part.shape[1], p, 16, c), b3.reshape(p, c), b4.reshape(p, c),
                                        capacity, 2)
            slots.append(sl.reshape(*part.shape[:-2], -1))
            fits.append(ft.reshape(part.shape[:-2]))
            modes += counts.reshape(-1, 3).sum(0)
            continue
        enc = encode_tiles(tiles[:, j:j + step], b3, b4, capacity)
        slots.append(enc.slots)
        fits.append(enc.fits)
        modes += torch.bincount(enc.modes.reshape(-1).long(), minlength=3)
    slots, fits = torch.cat(slots, 1), torch.cat(fits, 1)
    slot_pool, raw_pool, table = lay_out(slots, fits, tiles)
    layout = TileLayout(c, capacity)
    info = {"escape_capacity": capacity, "slot_tiles": int(fits.sum()), "raw_tiles": int((~fits).sum()),
            "mode_shares": (modes.double() / modes.sum()).tolist(),
            "bytes": int(fits.sum()) * layout.slot_bytes + int((~fits).sum()) * layout.raw_bytes + table.numel() * 4
            + 2 * k[:, :, n * 16:].numel() * 2}
    return (slot_pool, raw_pool, table, k[:, :, n * 16:].contiguous(), v[:, :, n * 16:].contiguous(),
            base3.contiguous(), base4.contiguous()), info


def capture_graph(fn) -> torch.cuda.CUDAGraph:
    """`fn()` run once (compiles, plans), then captured into a CUDA graph for replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_graph(fn, n_buffers, reps=20):
    """Median µs per call of `fn` replayed from a CUDA graph (no host launch cost), rotating over the buffers."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(n_buffers):
            fn(i)  # warm up (compiles, plans) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for i in range(n_buffers):
                fn(i)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (reps * n_buffers))
    return sorted(times)[len(times) // 2]


def bench(fn, n_buffers):
    state = {"i": 0}

    def call():
        fn(state["i"] % n_buffers)
        state["i"] += 1

    return triton.testing.do_bench(call, warmup=50, rep=200, return_mode="median") * 1000  # µs


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    p.add_argument("--out", default="benchmarks/results/attention.json")
    p.add_argument("--buffers", type=int, default=3)
    p.add_argument("--shapes", default="all")
    p.add_argument("--flex-shapes", default="0,2,3,8", help="indices of SHAPES that also time FlexAttention "
                   "(each needs a torch.compile)")
    p.add_argument("--breakdown-shape", type=int, default=2, help="shape for the leave-one-stage-out breakdown")
    p.add_argument("--cuda-sweep", action="store_true", help="sweep the CUDA kernel's ring depth, warps and splits")
    p.add_argument("--twin-sweep", action="store_true", help="sweep the CUDA twin's ring depth and warps per CTA")
    p.add_argument("--swizzle-sweep", action="store_true",
                   help="time the CUDA twin with plain and swizzled BF16 rows in shared memory")
    p.add_argument("--dense-slots-sweep", action="store_true",
                   help="time the CUDA kernel with slots staged as stored (one bulk copy) and with padded rows")
    p.add_argument("--no-triton", action="store_true", help="skip the Triton kernel (fused, twin, breakdown)")
    p.add_argument("--graphs", action="store_true", help="also time the CUDA kernel and the baselines replayed from "
                   "CUDA graphs (GPU time without host launch cost)")
    args = p.parse_args()
    dev = torch.device("cuda")
    pool = load_file(args.real_kv)["kv"].to(dev)
    gen = torch.Generator().manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "python": platform.python_version(), "rows": []}
    shapes = SHAPES if args.shapes == "all" else [SHAPES[int(i)] for i in args.shapes.split(",")]
    print(f"{results['gpu']}, torch {torch.__version__}, triton {triton.__version__}")
    for name, hq, hkv, d, b, s in shapes:
        t0 = time.time()
        k, v = real_kv(pool.cpu(), b, hkv, s, d, gen)
        k, v = k.to(dev), v.to(dev)
        packed, info = compress(k, v)
        layout = TileLayout(tile_split(d)[1], info["escape_capacity"])
        scale = d ** -0.5
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        # correctness on this data
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.float()[:, :, None], k.float(), v.float(), scale=scale, enable_gqa=True)[:, :, 0]
        identical = rel = None
        if not args.no_triton:
            got = fused_compressed_attention(q, *packed[:5], packed[5], packed[6], scale, layout)
            plain = fused_plain_attention(q, k, v, scale, layout)
            identical = torch.equal(got.view(torch.int16), plain.view(torch.int16))
            rel = ((got.float() - ref).norm() / ref.norm()).item()
        # rotating buffers: copies at other addresses
        bufs = [(packed, k, v)] + [(tuple(x.clone() for x in packed), k.clone(), v.clone())
                                   for _ in range(args.buffers - 1)]
        plains = [] if args.no_triton else [plain_as_raw_tiles(bk, bv, layout.channels) for _, bk, bv in bufs]
        q4 = q[:, :, None]
        bf16_bytes = 2 * k.numel() * 2
        gaac_bytes = info["bytes"]
        times = {}

        def run_gaac(i):
            pk = bufs[i][0]
            fused_compressed_attention(q, *pk[:5], pk[5], pk[6], scale, layout)

        def run_plain(i):
            fused_plain_attention(q, bufs[i][1], bufs[i][2], scale, layout, plain=plains[i])

        def sdpa(backend):
            def run(i):
                with sdpa_kernel(backend):
                    torch.nn.functional.scaled_dot_product_attention(q4, bufs[i][1], bufs[i][2], scale=scale,
                                                                     enable_gqa=True)
            return run


        def run_decomp(i):
            pk = bufs[i][0]
            slot_pool, raw_pool, table, tk, tv, b3, b4 = pk
            n = table.shape[1]
            c = raw_pool.shape[-1]
            period = table.shape[2] * table.shape[3] * table.shape[4]
            tiles = expand_tiles(table.reshape(b, n, period), slot_pool, raw_pool, b3.reshape(period, c),
                                 b4.reshape(period, c), layout)
            kv = tiles.reshape(b, n, 2, hkv, d // c, 16, c).permute(0, 2, 3, 1, 5, 4, 6).reshape(b, 2, hkv, n * 16, d)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                torch.nn.functional.scaled_dot_product_attention(q4, kv[:, 0], kv[:, 1], scale=scale, enable_gqa=True)

        variants = {}
        cuda_info = {}
        if gaac_cuda.available(dev):
            kv_len = torch.full((b,), s, dtype=torch.int32, device=dev)
            pc = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes)
            pp = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True)
            got_c = gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale, layout, pc)
            twin = gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, pp)
            kc = pc.kernels(dev)[0]
            cuda_info = {"bit_identical_to_twin": torch.equal(got_c.view(torch.int16), twin.view(torch.int16)),
                         "rel_err_vs_fp32": ((got_c.float() - ref).norm() / ref.norm()).item(),
                         "nsplit": pc.nsplit, "registers": kc.registers, "smem_per_cta": pc.smem,
                         "ctas_per_sm": kc.blocks_per_sm(pc.warps * 32, pc.smem), "stages": pc.stages,
                         "warps": pc.warps, "twin_registers": pp.kernels(dev)[0].registers}

            def run_cuda(i, pc=pc, layout=layout, kv_len=kv_len):
                pk = bufs[i][0]
                gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, None, scale, layout, pc)

            def run_twin(i, pp=pp, kv_len=kv_len):
                gaac_cuda.plain_decode_attention(q, bufs[i][1], bufs[i][2], kv_len, None, scale, pp)
            variants.update({"gaac_cuda": (run_cuda, gaac_bytes), "cuda_same_kernel_bf16": (run_twin, bf16_bytes)})
            # format version 2, what the caches store on Hopper (even windows, the caches' encoder): the kernel's
            # format 3, bit-identical to the same twin at the same split count
            packed2, info2 = compress(k, v, format_version=2)
            layout2 = TileLayout(tile_split(d)[1], info2["escape_capacity"])
            if d in ops.CUDA_V2_HEAD_DIMS:
                pc2 = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout2.slot_bytes, format_version=3,
                                     nsplit=pp.nsplit)
                got2 = gaac_cuda.decode_attention(q, *packed2[:5], packed2[5], packed2[6], kv_len, None, scale,
                                                  layout2, pc2)
                cuda_info.update(v2_bit_identical_to_twin=torch.equal(got2.view(torch.int16), twin.view(torch.int16)),
                                 v2_registers=pc2.kernels(dev)[0].registers, v2_smem_per_cta=pc2.smem, v2=info2)
                bufs2 = [packed2] + [tuple(x.clone() for x in packed2) for _ in range(args.buffers - 1)]

                def run_cuda_v2(i, pc2=pc2, layout2=layout2, kv_len=kv_len, bufs2=bufs2):
                    pk = bufs2[i]
                    gaac_cuda.decode_attention(q, *pk[:5], pk[5], pk[6], kv_len, None, scale, layout2, pc2)
                variants["gaac_cuda_v2"] = (run_cuda_v2, info2["bytes"])
            if SHAPES.index((name, hq, hkv, d, b, s)) == args.breakdown_shape:
                def run_variant(skip, combine):
                    pv = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, skip=skip,
                                        nsplit=pc.nsplit)
                    return lambda i: gaac_cuda.decode_attention(q, *bufs[i][0][:5], bufs[i][0][5], bufs[i][0][6],
                                                                kv_len, None, scale, layout, pv, combine=combine)
                timer = bench_graph if args.graphs else bench
                cuda_info["breakdown_us"] = {
                    label: timer(run_variant(skip, combine), args.buffers)
                    for label, skip, combine in (("full", 0, True), ("split_kernel_only", 0, False),
                                                 ("no_math", 1, False), ("no_reconstruction", 2, False),
                                                 ("loads_only", 3, False))}
                print("cuda breakdown", cuda_info["breakdown_us"], flush=True)
            if args.cuda_sweep and s == 65536 and b == 1 and hq == 32:
                sweep = {}
                for stages, warps, min_ctas, mult in ((2, 4, 1, 1), (2, 4, 1, 2 / 3), (2, 4, 1, 4 / 3), (3, 4, 1, 1),
                                                      (2, 4, 4, 4 / 3), (2, 8, 1, 1), (3, 8, 1, 1), (4, 4, 1, 1)):
                    key = f"stages{stages}_warps{warps}_minctas{min_ctas}_split{mult}x"
                    try:
                        pcs = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes,
                                             stages=stages, warps=warps, min_ctas=min_ctas)
                        pcm = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes,
                                             stages=stages, warps=warps, min_ctas=min_ctas,
                                             nsplit=max(1, int(pcs.nsplit * mult)))
                        us = (bench_graph if args.graphs else bench)(lambda i, pcm=pcm: gaac_cuda.decode_attention(
                            q, *bufs[i][0][:5], bufs[i][0][5], bufs[i][0][6], kv_len, None, scale, layout,
                            pcm), args.buffers)
                        sweep[key] = {"us": us, "nsplit": pcm.nsplit, "registers": pcm.kernels(dev)[0].registers}
                    except Exception as e:  # noqa: BLE001 - a variant may not fit in shared memory
                        sweep[key] = f"{type(e).__name__}: {e}"[:120]
                cuda_info["sweep_us"] = sweep
                print("cuda sweep", sweep, flush=True)
            def time_pair(pc_, pp_):
                """Graph-replayed (--graphs) or do_bench µs of GAAC planned `pc_` and of its twin planned `pp_`."""
                timer = bench_graph if args.graphs else bench
                return {"gaac_us": timer(lambda i: gaac_cuda.decode_attention(
                            q, *bufs[i][0][:5], bufs[i][0][5], bufs[i][0][6], kv_len, None, scale, layout, pc_),
                            args.buffers),
                        "twin_us": timer(lambda i: gaac_cuda.plain_decode_attention(
                            q, bufs[i][1], bufs[i][2], kv_len, None, scale, pp_), args.buffers)}

            def option_sweep(option):
                """GAAC and its twin planned with `option` off and on (the twin with the same split count): same
                bits, error, registers, both times, and the loads-only variant at the breakdown shape."""
                rows = {}
                timer = bench_graph if args.graphs else bench
                for on in (False, True):
                    # (the one-warp kernel's options: its plans on and off)
                    po = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes,
                                        **{option: on})
                    ppo = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, nsplit=po.nsplit,
                                         **{option: on})
                    go = gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale, layout,
                                                    po)
                    to = gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, ppo)
                    row = {"nsplit": po.nsplit,
                           "bit_identical_to_twin": torch.equal(go.view(torch.int16), to.view(torch.int16)),
                           "rel_err_vs_fp32": ((go.float() - ref).norm() / ref.norm()).item(),
                           "registers": po.kernels(dev)[0].registers,
                           **time_pair(po, ppo)}
                    if SHAPES.index((name, hq, hkv, d, b, s)) == args.breakdown_shape:
                        pv = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, skip=3,
                                            **{option: on})
                        row["loads_only_us"] = timer(lambda i, pv=pv: gaac_cuda.decode_attention(
                            q, *bufs[i][0][:5], bufs[i][0][5], bufs[i][0][6], kv_len, None, scale, layout, pv,
                            combine=False), args.buffers)
                    rows[f"{option}_{int(on)}"] = row
                cuda_info[f"{option}_us"] = rows
                print(option, rows, flush=True)

            # one option off and on, GAAC and its twin alike (plain-KV options leave the compressed plans as they are,
            # compressed-KV options the twin's): swizzled twin rows, slots staged as stored
            for option, flag in SWEEP_FLAGS.items():
                if getattr(args, flag):
                    option_sweep(option)
            if args.twin_sweep and s == 65536 and b == 1 and hq == 32:
                # the twin's ring depth and CTA shape (its bits depend on the split count alone, kept)
                twin_sweep = {}
                for stages, warps in ((2, 4), (3, 4), (4, 4), (3, 2), (4, 2), (2, 8)):
                    key = f"stages{stages}_warps{warps}"
                    try:
                        ppv = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, stages=stages, warps=warps,
                                             nsplit=pc.nsplit)
                        same = torch.equal(gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, scale, ppv)
                                           .view(torch.int16), twin.view(torch.int16))
                        us = (bench_graph if args.graphs else bench)(lambda i, ppv=ppv: gaac_cuda.plain_decode_attention(
                            q, bufs[i][1], bufs[i][2], kv_len, None, scale, ppv), args.buffers)
                        twin_sweep[key] = {"us": us, "bits_equal": same, "registers": ppv.kernels(dev)[0].registers,
                                           "ctas_per_sm": ppv.kernels(dev)[0].blocks_per_sm(ppv.warps * 32, ppv.smem)}
                    except Exception as e:  # noqa: BLE001 - a variant may not fit in shared memory
                        twin_sweep[key] = f"{type(e).__name__}: {e}"[:120]
                cuda_info["twin_sweep_us"] = twin_sweep
                print("twin sweep", twin_sweep, flush=True)
        if not args.no_triton:
            variants.update({"gaac_fused": (run_gaac, gaac_bytes), "triton_same_kernel_bf16": (run_plain, bf16_bytes),
                             "decompress_then_cudnn": (run_decomp, gaac_bytes)})
        variants.update({"cudnn_sdpa": (sdpa(SDPBackend.CUDNN_ATTENTION), bf16_bytes),
                         "flash_sdpa": (sdpa(SDPBackend.FLASH_ATTENTION), bf16_bytes)})
        shape_index = SHAPES.index((name, hq, hkv, d, b, s))
        variants.update(external_baselines(q, bufs, scale, bf16_bytes, b,
                                           shape_index in {int(x) for x in args.flex_shapes.split(",") if x}))
        for vname, (fn, nbytes) in variants.items():
            try:
                us = bench(fn, args.buffers)
                times[vname] = {"us": us, "GBps": nbytes / us / 1e3}
            except Exception as e:  # a backend may not support a shape
                times[vname] = {"error": f"{type(e).__name__}: {e}"[:200]}
            if args.graphs and vname in GRAPH_VARIANTS:
                try:  # the same call replayed from a CUDA graph: GPU time without host launch cost
                    us = bench_graph(fn, args.buffers)
                    times[vname + "_graph"] = {"us": us, "GBps": nbytes / us / 1e3}
                except Exception as e:  # noqa: BLE001 - not every backend captures
                    times[vname + "_graph"] = {"error": f"{type(e).__name__}: {e}"[:200]}
        base = min(t["us"] for kname, t in times.items() if "us" in t and kname in BASELINES)
        best_name = min((kname for kname in BASELINES if "us" in times.get(kname, {})), key=lambda k2: times[k2]["us"])
        ours = next((k2 for k2 in ("gaac_cuda_v2_graph", "gaac_cuda_v2", "gaac_cuda_graph", "gaac_cuda", "gaac_fused")
                     if "us" in times.get(k2, {})))
        row = {"model": name, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "batch": b, "context": s,
               "bit_identical_to_plain": identical, "rel_err_vs_fp32": rel, "bf16_bytes": bf16_bytes,
               "gaac_bytes": gaac_bytes, **info, "cuda": cuda_info, "times": times,
               "best_baseline": best_name, "gaac_kernel": ours,
               "speedup_vs_best_baseline": base / times[ours]["us"] if "us" in times[ours] else None}
        for sfx in ("", "_graph"):
            if "us" in times.get("cuda_same_kernel_bf16" + sfx, {}) and "us" in times.get("cudnn_sdpa" + sfx, {}):
                row["twin_vs_cudnn" + sfx] = times["cudnn_sdpa" + sfx]["us"] / times["cuda_same_kernel_bf16" + sfx]["us"]
        if shape_index == args.breakdown_shape and not args.no_triton:
            row["breakdown_us"] = {
                label: bench(lambda i, st=st: fused_compressed_attention(q, *bufs[i][0][:5], bufs[i][0][5],
                                                                         bufs[i][0][6], scale, layout, stages=st),
                             args.buffers)
                for label, st in (("full", ("recon", "math")), ("no_reconstruction", ("math",)),
                                  ("no_math", ("recon",)), ("loads_only", ()))}
        results["rows"].append(row)
        tm = {k2: (f"{t['us']:.1f}us {t['GBps']:.0f}GB/s" if "us" in t else "err") for k2, t in times.items()}
        print(f"{name} {b}x{s} triton_ok={identical} cuda={cuda_info} ratio={bf16_bytes / gaac_bytes:.3f} {tm} "
              f"speedup={row['speedup_vs_best_baseline']:.3f} ({time.time() - t0:.0f}s)", flush=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        bufs = plains = k = v = packed = variants = None  # free before the next shape
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(table(results))


BASELINES = ("cudnn_sdpa", "flash_sdpa", "fa3", "flashinfer", "flex_attention", "cudnn_sdpa_graph",
             "flash_sdpa_graph", "fa3_graph", "flashinfer_graph")
GRAPH_VARIANTS = ("gaac_cuda", "gaac_cuda_v2", "cuda_same_kernel_bf16", "cudnn_sdpa", "flash_sdpa", "fa3",
                  "flashinfer")


def table(results) -> str:
    cols = ["gaac_cuda_v2_graph", "gaac_cuda_graph", "cudnn_sdpa_graph", "flash_sdpa_graph", "fa3_graph",
            "flashinfer_graph", "cuda_same_kernel_bf16_graph", "gaac_cuda_v2", "gaac_cuda", "cudnn_sdpa", "flash_sdpa",
            "fa3", "flashinfer", "flex_attention",
            "cuda_same_kernel_bf16", "gaac_fused", "triton_same_kernel_bf16", "decompress_then_cudnn"]
    cols = [c for c in cols if any("us" in r["times"].get(c, {}) for r in results["rows"])]
    out = ["| q/kv/dim, batch x context | " + " | ".join(f"{c} µs (GB/s)" for c in cols) + " | GAAC vs best |",
           "|---" * (len(cols) + 2) + "|"]
    for r in results["rows"]:
        t = r["times"]
        cell = lambda k: f"{t[k]['us']:.1f} ({t[k]['GBps']:.0f})" if "us" in t.get(k, {}) else "-"  # noqa: E731
        out.append(f"| {r['q_heads']}/{r['kv_heads']}/{r['head_dim']}, {r['batch']} x {r['context'] // 1024}K | "
                   + " | ".join(cell(c) for c in cols)
                   + f" | {r['speedup_vs_best_baseline']:.2f}x ({r['best_baseline']}) |")
    return "\n".join(out)


def external_baselines(q, bufs, scale, nbytes, batch, flex: bool) -> dict:
    """FA3, FlashInfer and FlexAttention on the same BF16 KV, where installed (see ../shared/gpu/README.md)."""
    out = {}
    try:
        import fa3_fwd_interface
        nhd = [(bk.transpose(1, 2).contiguous(), bv.transpose(1, 2).contiguous()) for _, bk, bv in bufs]
        q_nhd = q[:, None]

        def fa3(i):
            fa3_fwd_interface.flash_attn_with_kvcache(q_nhd, nhd[i][0], nhd[i][1], softmax_scale=scale, causal=False)
        out["fa3"] = (fa3, nbytes)
    except Exception as e:  # noqa: BLE001 - not installed, or the shape is unsupported
        print("fa3 unavailable:", type(e).__name__, str(e)[:120])
    if batch == 1:
        try:
            import flashinfer
            nhd1 = [(bk[0].transpose(0, 1).contiguous(), bv[0].transpose(0, 1).contiguous()) for _, bk, bv in bufs]

            def fi(i):
                flashinfer.single_decode_with_kv_cache(q[0], nhd1[i][0], nhd1[i][1], kv_layout="NHD",
                                                       sm_scale=scale)
            out["flashinfer"] = (fi, nbytes)
        except Exception as e:  # noqa: BLE001
            print("flashinfer unavailable:", type(e).__name__, str(e)[:120])
    if flex:
        try:
            from torch.nn.attention.flex_attention import flex_attention
            compiled = torch.compile(flex_attention, dynamic=False)
            q4 = q[:, :, None]

            def fx(i):
                compiled(q4, bufs[i][1], bufs[i][2], scale=scale, enable_gqa=True)
            out["flex_attention"] = (fx, nbytes)
        except Exception as e:  # noqa: BLE001
            print("flex unavailable:", type(e).__name__, str(e)[:120])
    return out


if __name__ == "__main__":
    main()
