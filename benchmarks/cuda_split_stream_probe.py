"""How fast the H200 streams K and V in the decode kernel's request pattern, with nothing else in the way.

The twin kernel (plain BF16, no reconstruction) reaches 3.1-3.3 TB/s and waits on its stage barrier (ncu, session 6:
DRAM 68%, 18% of its stall samples on the barrier) while a grid-stride read of the same bytes reaches ~4.25 TB/s. This
probe reads the Llama-3.1-8B 1 x 64K K and V (268 MB) the way a split-K decode kernel does: one wave of warps, each
streaming its own contiguous share of K and of V through a shared-memory ring of `stages` x 2 x `unit` bytes, one
mbarrier per stage; the consumer only touches one 16-byte word per lane per stage. Variants: the unit of one copy
(4 KB = one 16-token block of 128 channels, the kernel's today, up to 32 KB), the ring depth, the copy instruction
(16-byte `cp.async` by every lane, or one `cp.async.bulk` per tensor by one lane) and the warps per CTA; CTAs per SM
follow from shared memory. If larger units or deeper rings stream near the bare read here, the next kernel's producer
should copy larger boxes; if not, the split-per-warp pattern itself is the limit.

    python benchmarks/cuda_split_stream_probe.py --out $OUT/cuda_split_stream_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys

import torch

sys.path.insert(0, "benchmarks")

SOURCE = r"""
// -DUNIT=<bytes per tensor per stage> -DSTAGES=<ring depth> -DBULK=<0|1> -DWARPS=<warps per CTA>
typedef unsigned int u32;
typedef unsigned long long u64;
struct Params { const unsigned char* k; const unsigned char* v; u64 per_split; int nsplit; u32* out; };

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32) split_stream(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int item = blockIdx.x * WARPS + warp;
  if (item >= p.nsplit) return;
  unsigned char* ring = smem + (size_t)warp * (STAGES * 2 * UNIT + 64);
  const u32 bars = smem_u32(ring + STAGES * 2 * UNIT);
  if (lane == 0) {
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bars + 8 * s), "r"(BULK ? 1 : 33));
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  const u64 base = (u64)item * p.per_split;
  const int n = (int)(p.per_split / UNIT);
  u32 phases = 0;
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int j = -(STAGES - 1); j < n; ++j) {
    const int next = j + STAGES - 1;
    if (next < n) {
      const int st = next % STAGES;
      const u32 bar = bars + 8 * st;
      const u64 off = base + (u64)next * UNIT;
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      for (int kv = 0; kv < 2; ++kv) {
        const unsigned char* src = (kv ? p.v : p.k) + off;
        const u32 dst = smem_u32(ring + (st * 2 + kv) * UNIT);
        if (BULK) {
          if (lane == 0) {
            if (kv == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(2 * UNIT) : "memory");
            asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                         ::"r"(dst), "l"(src), "r"(UNIT), "r"(bar) : "memory");
          }
        } else {
#pragma unroll
          for (int i = 0; i < UNIT / 512; ++i)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 512 * i + 16 * lane),
                         "l"(src + 512 * i + 16 * lane) : "memory");
        }
      }
      if (!BULK) asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
      if (!BULK && lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
    }
    if (j < 0) continue;
    const int st = j % STAGES;
    mbar_wait(bars + 8 * st, (phases >> st) & 1);
    phases ^= 1u << st;
    const uint4 w = *reinterpret_cast<const uint4*>(ring + st * 2 * UNIT + 16 * lane);
    acc.x ^= w.x; acc.y ^= w.y; acc.z ^= w.z; acc.w ^= w.w;
    __syncwarp();
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) p.out[0] = 1u;  // keeps the loads
}
"""


class _Params(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("v", ctypes.c_void_p), ("per_split", ctypes.c_ulonglong),
                ("nsplit", ctypes.c_int), ("out", ctypes.c_void_p)]


def options(unit: int, stages: int, bulk: bool, warps: int) -> list[str]:
    if unit % 512:
        raise ValueError(f"unit {unit}: a multiple of 512 bytes (32 lanes x 16)")
    return [f"-DUNIT={unit}", f"-DSTAGES={stages}", f"-DBULK={int(bulk)}", f"-DWARPS={warps}"]


def smem_per_cta(unit: int, stages: int, warps: int) -> int:
    return warps * (stages * 2 * unit + 64)


VARIANTS = [(unit, stages, bulk, warps) for unit in (4096, 8192, 16384, 32768) for stages in (2, 3, 4)
            for bulk in (False, True) for warps in (1, 2, 4) if smem_per_cta(unit, stages, warps) <= 227 * 1024]


def main(argv=None) -> None:
    from attention import bench_graph  # noqa: PLC0415  (needs CUDA)
    from cuda_stream_probe import stream_reader  # noqa: PLC0415

    from gaac_cuda import nvrtc  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--buffers", type=int, default=2, help="rotating copies of K and V")
    ap.add_argument("--out", default="benchmarks/results/cuda_split_stream_probe.json")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    elems = args.heads * args.tokens * args.head_dim
    bufs = [(torch.randint(0, 2 ** 15, (elems,), dtype=torch.int16, device=dev),
             torch.randint(0, 2 ** 15, (elems,), dtype=torch.int16, device=dev)) for _ in range(args.buffers)]
    total = 2 * elems * 2
    sink = torch.zeros(1, dtype=torch.int32, device=dev)
    res = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "bytes": total,
           "command": "python benchmarks/cuda_split_stream_probe.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "variants": {}}
    whole = [torch.cat([k, v]).view(torch.uint8) for k, v in bufs]  # stream_reader counts bytes
    rd = stream_reader(dev, 4)
    us = bench_graph(lambda i: rd(whole[i]), args.buffers)
    res["grid_stride_read"] = {"us": us, "TBps": total / us / 1e6}
    print(f"grid-stride read: {us:.1f} us, {total / us / 1e6:.2f} TB/s", flush=True)
    for unit, stages, bulk, warps in VARIANTS:
        key = f"unit{unit // 1024}k_stages{stages}_{'bulk' if bulk else 'cpasync'}_warps{warps}"
        try:
            kern = nvrtc.get_kernel(SOURCE, options(unit, stages, bulk, warps), "split_stream", dev)
            smem = smem_per_cta(unit, stages, warps)
            ctas = kern.blocks_per_sm(warps * 32, smem)
            nsplit = sms * ctas * warps  # one wave
            per_split = (elems * 2 // nsplit) // unit * unit
            grid = sms * ctas

            def run(i, kern=kern, per_split=per_split, nsplit=nsplit, grid=grid, smem=smem, warps=warps):
                prm = _Params(bufs[i][0].data_ptr(), bufs[i][1].data_ptr(), per_split, nsplit, sink.data_ptr())
                kern.launch(grid, warps * 32, smem, prm)
            us = bench_graph(run, args.buffers)
            read = 2 * per_split * nsplit
            res["variants"][key] = {"us": us, "TBps": read / us / 1e6, "ctas_per_sm": ctas, "warps_per_sm": ctas * warps,
                                    "bytes_in_flight_per_sm": ctas * warps * (stages - 1) * 2 * unit,
                                    "bytes_read": read}
            print(f"{key:36s} {us:7.1f} us {read / us / 1e6:5.2f} TB/s  ({ctas * warps} warps/SM)", flush=True)
        except Exception as e:  # noqa: BLE001 - one variant failing must not lose the others
            res["variants"][key] = {"error": f"{type(e).__name__}: {e}"[:200]}
            print(key, "FAILED", e, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
