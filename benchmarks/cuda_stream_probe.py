"""Where the CUDA decode kernel's time goes besides the inner loop, at 1 x 64K (Llama-3.1-8B heads, H200):
per-warp globaltimer stamps (launch ramp, first-unit latency, finish spread, combine start), the streaming
variants (loads only, split counts, ring depth), and a plain grid-stride read of the same bytes as the streaming
reference. Graph-replayed medians, JSON + a table.

    python benchmarks/cuda_stream_probe.py --real-kv .bench/real_kv_2k.safetensors --out $OUT/cuda_stream_probe.json
"""

import argparse
import ctypes
import json
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, "benchmarks")
from attention import bench_graph, compress, real_kv  # noqa: E402

import gaac_cuda  # noqa: E402
from gaac_cuda import nvrtc  # noqa: E402
from gaac_hf.format import TileLayout  # noqa: E402

STREAM_SRC = r"""
struct StreamParams { const uint4* src; unsigned long long n; unsigned int* out; };
extern "C" __global__ void stream_read(const StreamParams p) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < p.n;
       i += (unsigned long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(p.src + i);
    acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) p.out[0] = 1u;  // keeps the loads
}
"""


class _StreamParams(ctypes.Structure):
    _fields_ = [("src", ctypes.c_void_p), ("n", ctypes.c_ulonglong), ("out", ctypes.c_void_p)]


def stream_reader(dev, blocks_per_sm, threads=256):
    kernel = nvrtc.get_kernel(STREAM_SRC, [], "stream_read", dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sink = torch.zeros(1, dtype=torch.int32, device=dev)

    def run(buf):
        prm = _StreamParams(buf.data_ptr(), buf.numel() // 16, sink.data_ptr())
        kernel.launch(sms * blocks_per_sm, threads, 0, prm)
    return run


def trace_summary(tr, p):
    """Stamps (ns) -> µs relative to the first warp's entry; the finish spread by kv-head and by SM."""
    items = p.items
    st = tr[: 4 * items].view(items, 4).double()
    head = torch.arange(items) // p.nsplit % p.kv_heads
    live = st[:, 1] > -1e17  # splits that had units (empty ones never wait for data)
    st, head = st[live], head[live]
    t0 = st[:, 0].min()
    entry, first, done = (st[:, 0] - t0) / 1e3, (st[:, 1] - t0) / 1e3, (st[:, 2] - t0) / 1e3
    sm = st[:, 3].long()
    comb = (tr[4 * items:].double() - t0) / 1e3
    q = lambda x, f: float(x.quantile(f))  # noqa: E731
    out = {"entry_last_us": q(entry, 1.0), "entry_p50_us": q(entry, 0.5),
           "first_unit_latency_p50_us": q(first - entry, 0.5), "first_unit_latency_max_us": q(first - entry, 1.0),
           "done_min_us": q(done, 0.0), "done_p10_us": q(done, 0.1), "done_p50_us": q(done, 0.5),
           "done_p90_us": q(done, 0.9), "done_max_us": q(done, 1.0),
           "warp_busy_p50_us": q(done - entry, 0.5), "warp_busy_max_us": q(done - entry, 1.0),
           "done_p50_by_kv_head_us": [q(done[head == h], 0.5) for h in range(p.kv_heads)]}
    n_sm = int(sm.max()) + 1
    sm_max = torch.full((n_sm,), float("-inf"), dtype=torch.float64).scatter_reduce(0, sm, done, "amax")
    sm_min = torch.full((n_sm,), float("inf"), dtype=torch.float64).scatter_reduce(0, sm, done, "amin")
    seen = torch.isfinite(sm_max)
    sm_max, sm_min = sm_max[seen], sm_min[seen]
    # is the spread between SMs (where a warp runs) or within them (what it reads)?
    out.update(sm_count=int(seen.sum()), sm_last_done_p10_us=q(sm_max, 0.1), sm_last_done_p50_us=q(sm_max, 0.5),
               sm_last_done_max_us=q(sm_max, 1.0), within_sm_spread_p50_us=q(sm_max - sm_min, 0.5),
               within_sm_spread_max_us=q(sm_max - sm_min, 1.0))
    if comb.numel() and bool((comb > -1e6).all()):
        out.update(combine_first_start_us=q(comb, 0.0), combine_last_start_us=q(comb, 1.0))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    ap.add_argument("--out", default="benchmarks/results/cuda_stream_probe.json")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--buffers", type=int, default=3)
    args = ap.parse_args()
    dev = torch.device("cuda")
    b, hq, hkv, d, s = 1, 32, 8, 128, args.context
    k, v = real_kv(load_file(args.real_kv)["kv"], b, hkv, s, d, torch.Generator().manual_seed(0))
    k, v = k.to(dev), v.to(dev)
    packed, info = compress(k, v)
    layout = TileLayout(d, info["escape_capacity"])
    q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
    kv_len = torch.full((b,), s, dtype=torch.int32, device=dev)
    bufs = [(packed, k, v)] + [(tuple(x.clone() for x in packed), k.clone(), v.clone())
                               for _ in range(args.buffers - 1)]
    scale = d ** -0.5
    gaac_bytes, bf16_bytes = info["bytes"], 4 * k.numel()
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "context": s, "gaac_bytes": gaac_bytes,
           "bf16_bytes": bf16_bytes, "times_us": {}, "traces": {}, "checks": {}}
    base = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes)
    plain_base = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True)
    res["default_nsplit"] = base.nsplit

    def gaac(pl, combine=True, trace=None):
        return lambda i: gaac_cuda.decode_attention(q, *bufs[i][0][:5], bufs[i][0][5], bufs[i][0][6], kv_len, None,
                                                    scale, layout, pl, combine=combine, trace=trace)

    def twin(pl, trace=None):
        return lambda i: gaac_cuda.plain_decode_attention(q, bufs[i][1], bufs[i][2], kv_len, None, scale, pl,
                                                          trace=trace)

    def gplan(**kw):
        kw.setdefault("nsplit", base.nsplit)
        return gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, **kw)

    def pplan(**kw):
        kw.setdefault("nsplit", plain_base.nsplit)
        return gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, plain=True, **kw)

    ref = gaac(base)(0)
    res["checks"]["twin_same_bits"] = torch.equal(twin(plain_base)(0).view(torch.int16), ref.view(torch.int16))

    variants = {"full": (gaac(base), gaac_bytes), "split_only": (gaac(base, combine=False), gaac_bytes),
                "loads_only": (gaac(gplan(skip=3), combine=False), gaac_bytes),
                "twin": (twin(plain_base), bf16_bytes), "twin_no_math": (twin(pplan(skip=1)), bf16_bytes)}
    for ns in (132, 264, 396):
        variants[f"loads_only_nsplit{ns}"] = (gaac(gplan(skip=3, nsplit=ns), combine=False), gaac_bytes)
    variants["loads_only_stages3"] = (gaac(gplan(skip=3, stages=3), combine=False), gaac_bytes)
    pool_bytes = [bb[0][0] for bb in bufs]  # the slot pools (nearly all of the compressed bytes)
    kv_flat = [torch.cat([bb[1].reshape(-1), bb[2].reshape(-1)]).view(torch.uint8) for bb in bufs]
    for bps in (4, 8):
        rd = stream_reader(dev, bps)
        variants[f"stream_read_slots_{bps}x256"] = (lambda i, rd=rd: rd(pool_bytes[i]), pool_bytes[0].numel())
        variants[f"stream_read_bf16_{bps}x256"] = (lambda i, rd=rd: rd(kv_flat[i]), kv_flat[0].numel())
    for name, (fn, nbytes) in variants.items():
        try:
            us = bench_graph(fn, args.buffers)
            res["times_us"][name] = {"us": us, "TBps": nbytes / us / 1e6}
        except Exception as e:  # noqa: BLE001 - a variant may not fit
            res["times_us"][name] = {"error": f"{type(e).__name__}: {e}"[:160]}
        print(name, res["times_us"][name], flush=True)

    # per-warp stamps, replayed from a graph like the timings
    lo = lambda p_, trace: gaac(p_, combine=False, trace=trace)  # noqa: E731
    for name, mk, pl in (("full", gaac, gplan(trace=True)), ("loads_only", lo, gplan(trace=True, skip=3)),
                         ("twin", twin, pplan(trace=True))):
        tr = torch.full((gaac_cuda.trace_size(pl),), -(2 ** 62), dtype=torch.int64, device=dev)
        fn = mk(pl, trace=tr)
        fn(0)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(args.buffers):
                fn(i)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        res["traces"][name] = trace_summary(tr.cpu(), pl)
        print(name, res["traces"][name], flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print("| variant | µs | TB/s |\n|---|---|---|")
    for name, t in res["times_us"].items():
        print(f"| {name} | {t.get('us', float('nan')):.1f} | {t.get('TBps', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
