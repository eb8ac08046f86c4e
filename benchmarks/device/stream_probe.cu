// Copy-pipeline microbenchmark (benchmarks/stream_probe.py, issue 12): one CTA per SM of W warps; each warp moves
// its run of units from global into its own STAGES-deep shared-memory ring, as the decode kernel's one-warp path does
// (same mbarriers: lane 0's expect_tx plus 32 cp.async arrivals), and does nothing with them but read one word. A
// unit is CHUNKS chunks of `chunk` bytes at byte offsets `offs[unit * CHUNKS + c]` of `src`; a chunk is staged by one
// cp.async.bulk from lane 0 (CPASYNC 0) or by 16-byte cp.async from every lane (CPASYNC 1).
typedef unsigned int u32;
typedef unsigned long long u64;

#ifndef CHUNKS
#define CHUNKS 2
#endif
#ifndef STAGES
#define STAGES 2
#endif
#ifndef CPASYNC
#define CPASYNC 0
#endif
#ifndef DELAY  // cycles each warp spins per unit after its data arrived: the decode kernel's work on it, emulated
#define DELAY 0
#endif

struct Params {
  const unsigned char* src;
  const long long* offs;  // [units * CHUNKS] byte offsets
  u32* sink;              // [warps]: what each warp read (keeps the reads)
  int per_warp;           // units per warp (the last warps may have fewer)
  int units;
  u32 chunk;              // bytes per chunk, a multiple of 16
  u32 stage_bytes;        // >= CHUNKS * chunk_gap, a multiple of 128
  u32 chunk_gap;          // bytes from one chunk's start to the next in a stage (>= chunk)
  u32 warp_bytes;         // bytes of shared memory per warp (>= STAGES * stage_bytes, a multiple of 128)
  u64* trace;             // [warps * 3] globaltimer ns (entry, first unit landed, done), or null
  u32 ring_off;           // bytes from the warp's region to its ring (the decode kernel's header: 64)
};

__device__ __forceinline__ u64 gtimer() {
  u64 t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void wait_parity(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

extern "C" __global__ void __launch_bounds__(1024, 1) stream_probe(const Params p) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int W = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int gw = blockIdx.x * W + warp;
  if (p.trace && lane == 0) p.trace[3 * gw] = gtimer();
  unsigned char* ring = smem + (size_t)warp * p.warp_bytes + p.ring_off;
  u64* bars = reinterpret_cast<u64*>(smem + (size_t)W * p.warp_bytes) + warp * STAGES;
  if (lane == 0)
    for (int s = 0; s < STAGES; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bars + s)), "r"(33));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();
  const int u0 = gw * p.per_warp;
  const int n = max(0, min(p.per_warp, p.units - u0));
  u32 phases = 0, acc = 0;
  auto issue = [&](int j, int st) {
    const u32 bar = smem_u32(bars + st);
    const u32 dst = smem_u32(ring + st * p.stage_bytes);
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    if (lane == 0)
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar),
                   "r"(CPASYNC ? 0u : CHUNKS * p.chunk)
                   : "memory");
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
      const unsigned char* src = p.src + p.offs[(long long)(u0 + j) * CHUNKS + c];
      if (CPASYNC) {
#pragma unroll 1
        for (u32 k = lane; k < p.chunk / 16; k += 32)
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + c * p.chunk_gap + 16 * k),
                       "l"(src + 16 * k)
                       : "memory");
      } else if (lane == 0) {
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                dst + c * p.chunk_gap),
            "l"(src), "r"(p.chunk), "r"(bar)
            : "memory");
      }
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
  };
  for (int j = -(STAGES - 1); j < n; ++j) {
    const int next = j + STAGES - 1;
    if (next < n) issue(next, next % STAGES);
    if (j < 0) continue;
    const int st = j % STAGES;
    wait_parity(smem_u32(bars + st), (phases >> st) & 1);
    phases ^= 1u << st;
    if (p.trace && lane == 0 && j == 0) p.trace[3 * gw + 1] = gtimer();
    acc ^= reinterpret_cast<const u32*>(ring + st * p.stage_bytes)[lane];
    if (DELAY) {
      const long long t0 = clock64();
      while (clock64() - t0 < DELAY) acc += 1;
    }
    __syncwarp();
  }
  if (n > 0) p.sink[gw * 32 + lane] = acc;
  if (p.trace && lane == 0) p.trace[3 * gw + 2] = n > 0 ? gtimer() : 0ull;
}
