// Fused split-K decode attention over GAAC-compressed KV (format versions 1 and 2), for Hopper (sm_90a).
//
// One warp is one split: a contiguous range of "units" (finalized 16-token blocks, then the BF16 tail) of one
// (batch row, kv-head). Each warp streams its units through its own shared-memory ring: a slot is one
// `cp.async.bulk` (tags, planes and escapes together), a raw tile / plain block / tail is 16 row copies, all
// completing on one mbarrier per stage. The warp then rebuilds BF16 straight into mma.sync m16n8k16 fragments
// (swap-AB in both products, so every tile is operand A and the query heads of the group are N = 8 columns):
//
//   scores  S^T[token, head] = K[token, k] . Q^T[k, head]   K is operand A (16 tokens of the block x 16 channels),
//                                                           Q^T operand B (at most 8 query heads of the kv-head)
//   output  O^T[ch, head] += V^T[ch, token] . P^T[token, head]   V^T is operand A (16 channels x 16 tokens); P^T,
//                                                           operand B, is the S^T accumulator (bf16) through one
//                                                           `movmatrix` transpose per 8 tokens
//
// The reduction index of the score mma is permuted consistently in K and Q: the k pairs of a thread are channels
// (c, c+2) and (c+1, c+3) of a 4-channel word, so a word of 4 exponent bytes and the word of 4 sign+mantissa bytes
// of one token give both BF16 pairs with one shift, one sign-replicating byte permute and one bit-select each.
// Exponent bytes come from the code bit-planes: 4 rotates + 4 masked ORs bring bit `token` of every plane byte to
// the code, one add applies the base. Per slot, a prepass turns the mode tags into per-group bases and dense
// plane-3 bytes in scratch shared memory: escape offsets by one warp scan of popcounts for the K and V tiles
// together, and a lane's plane-3 escapes by one byte permute of an 8-byte window (format 1's raw groups: a loop, off
// the common path; format 3 stores every plane-3 byte before the raw groups' other planes, so the window serves all).
//
// Plain BF16 KV (GAAC_PLAIN) runs the same code from the fragment registers on: the bit-exact twin.
// Bitstream: docs/format.md; offsets come from the launcher (gaac_hf/format.py is the one definition).
//
// Compile-time configuration (NVRTC -D): GAAC_C (64|128 channels per tile), GAAC_TILES (tiles per head: 1|2),
// GAAC_PLAIN (0|1), GAAC_STAGES (ring depth), GAAC_WARPS, GAAC_MIN_CTAS (register budget), GAAC_SWIZZLE (plain KV:
// swizzled BF16 rows), VT_WORDS (V words per vector load), GAAC_DENSE_SLOT (compressed KV: slots staged as stored),
// GAAC_FAST_ISSUE (compressed KV staged as stored: the common unit's copies issued by lane 0 alone), GAAC_STAGED_O
// (the one-warp kernel's partial outputs staged in shared memory and written as 16-byte stores), GAAC_CTA_MERGE (the
// one-warp kernel's splits merged per CTA and group before they leave the SM; session 22), and for the benchmarks
// GAAC_LANE_ENTRIES (the split's table entries held by the lanes in chunks of 32 units, read by shuffles), GAAC_SKIP
// (leave-one-stage-out breakdown; bit 0: no tensor-core math, bit 1: no reconstruction; format 3 only: bit 2 no code
// bit 2 of 4-bit groups, bit 3 no raw-group patch; bit 4: no prepass, the tiles read stale scratch; bit 5: no tag scan either, offsets
// 0 and no raw group; bit 6: the prepass on a split's first unit only, later units read its plausible but wrong
// scratch: bounds for a slot format whose lanes own their groups; one-warp kernel: bit 7 no tile code at all, one
// word of each tile read; bit 8 no softmax and no rescale), GAAC_TRACE (globaltimer stamps,
// benchmarks/cuda_stream_probe.py) and GAAC_FORMAT (1: format version 1; 3: format version 2 as stored, in fragment
// order, see k_tile_f3).
// The options are measured alternatives (benchmarks/results/attention_cuda.md; the rejected ones, removed in sessions
// 11, 14, 19 and 20, are in git history); the launcher's defaults are the fastest.
#ifndef GAAC_SKIP
#define GAAC_SKIP 0
#endif
#ifndef GAAC_TRACE  // benchmark probe: per-warp globaltimer stamps into Params::trace
#define GAAC_TRACE 0
#endif
#ifndef GAAC_PDL  // programmatic dependent launch (plan(pdl=True)): each kernel waits for the one before it on the
#define GAAC_PDL 0  // stream before touching global memory (griddepcontrol.wait), and the split kernels let their
#endif              // dependents (the combine) launch as their CTAs start, so the combine's CTAs wait on the SMs
#ifndef GAAC_FORMAT  // slot format: 1 (format version 1) or 3 (format version 2 in fragment order; docs/format.md)
#define GAAC_FORMAT 1
#endif
#if GAAC_FORMAT != 1 && GAAC_FORMAT != 3
#error "GAAC_FORMAT is 1 or 3 (the plane-order prototype 2 was removed in session 14)"
#endif
#ifndef GAAC_MIN_CTAS  // register budget: CTAs of GAAC_WARPS warps that must fit on one SM
#define GAAC_MIN_CTAS 1
#endif
#ifndef GAAC_SWIZZLE  // plain KV (the twin): BF16 rows staged with an XOR swizzle of their 16-byte chunks (1)
#define GAAC_SWIZZLE 0
#endif
#define SWZ (GAAC_PLAIN && GAAC_SWIZZLE)
#ifndef GAAC_CTA_MERGE  // the one-warp kernel's splits merged per CTA before they leave (1: each CTA writes one partial
#define GAAC_CTA_MERGE 0  // per (row, kv-head) it holds, and the combine merges those) or one partial per split (0)
#endif
#define CTA_MERGE GAAC_CTA_MERGE
#ifndef GAAC_FUSED_COMBINE  // with GAAC_CTA_MERGE: the last CTA of each group to finish merges the group's partials
#define GAAC_FUSED_COMBINE 0  // into the output (1; no combine kernel) or the combine kernel does (0)
#endif
#define FUSED_COMBINE (GAAC_FUSED_COMBINE && CTA_MERGE)
// The one-warp kernel over plain KV (the twin at head_dim 256, or when asked for): K and V of a stage on their own
// barriers, each re-issued as soon as its tile is read (measured faster for the twin, slower for compressed KV:
// benchmarks/results/attention_cuda.md, sessions 7 and 24).
#define SPLITBAR GAAC_PLAIN
// Per-warp header: stage barriers and slot bits, then the ring. 128 bytes, so every bulk copy lands on a 128-byte
// aligned shared-memory destination: the compressed kernel's 64-byte header put them 64 bytes off and cost a quarter
// of the copy pipeline's rate (1x64K, the copies alone: 56.2 -> 46.9 us; benchmarks/frame_probe.py, session 25).
// (GAAC_HDR=64: that build, for the probes.)
#ifndef GAAC_HDR
#define GAAC_HDR 128
#endif
#define HDR GAAC_HDR
#ifndef GAAC_LANE_ENTRIES  // (benchmark option, session 24) compressed KV at one tile per head: the split's table
#define GAAC_LANE_ENTRIES 0  // entries held by the lanes, lane i those of unit 32 c + i of the current chunk c of 32
#endif                       // units (and of the next, loaded 32 units ahead), read by shuffles (1); or one global
#define LANE_ENTRIES (GAAC_LANE_ENTRIES && !GAAC_PLAIN && TILES == 1 && !SPLITBAR)  // load per unit, one ahead (0)
#ifndef VT_WORDS  // V words decoded per vector load in v_tile (all NVW at once, or halves)
#define VT_WORDS NVW
#endif

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
typedef long long i64;

#define NEG_INF (-__int_as_float(0x7f800000))

#define C GAAC_C
#define TILES GAAC_TILES
#define D (C * TILES)
#define NKS (C / 16)   // k-slices of 16 channels per tile (score mma)
#define NVW (C / 32)   // V words (4 channels) per thread per tile
#define NVM (C / 16)   // m-tiles of 16 channels per tile (output mma)
#define G (2 * C)      // groups per tile
#define GPL (G / 32)   // groups per lane in the prepass
#ifndef GAAC_DENSE_SLOT  // compressed KV: a slot staged as it is stored, by one bulk copy (1), or with its sign+mantissa
#define GAAC_DENSE_SLOT 0  // rows padded by 16 bytes against bank conflicts, 16-byte cp.async per lane for them (0)
#endif
#ifndef GAAC_FAST_ISSUE  // compressed KV staged as stored, one tile per head: a unit whose K and V are both slots
#define GAAC_FAST_ISSUE 1  // (not the tail, no raw tile) is issued by lane 0 alone, two bulk copies (1), or by the
#endif                     // general path that handles every kind of tile (0; same copies, same bits)
#define FAST_ISSUE (GAAC_FAST_ISSUE && !GAAC_PLAIN && GAAC_DENSE_SLOT && TILES == 1)
#define SM_ROW (C + (GAAC_DENSE_SLOT ? 0 : 16))  // a slot's sign+mantissa row in shared memory
#define SM_SECTION (16 * SM_ROW)     // where the slot's group section (planes, tags, escapes) starts in the buffer
#define SECTION_SHIFT (SM_SECTION - 16 * C)  // slot offset -> buffer offset, for offsets past the sign+mantissa

struct Params {
  const u16* q;        // [B, Hq, D]
  const u8* slots;     // [n_slots, slot_bytes]
  const u16* raw;      // [n_raw, 16, C]
  const int* table;    // [B, NB_cap, 2, H, TILES]
  const u16* kv_k;     // tail K (compressed) or plain K, [B, H, rows, D] with strides kv_s*
  const u16* kv_v;
  const u8* base3;     // [2, H, D]
  const u8* base4;
  const int* kv_len;   // [B]
  const u8* mask;      // [B, mask_len] (1 = attend) or null
  float* part_o;       // [items, rep, D]
  float* part_ml;      // [items, rep, 2]
  u16* out;            // [B, Hq, D]
  unsigned long long* trace;  // GAAC_TRACE: [items, 4] split stamps (entry, first unit ready, done, SM), combine starts
  const void* spare;    // unused (the rank-weighted splits' table until session 28): it keeps the offsets of the
                        // fields after it, and with them the code of every build as measured (dropping it changes
                        // register allocation)
  i64 slot_bytes;
  i64 table_sb;        // table stride per batch row, in int32
  i64 kv_sb, kv_sh, kv_ss;  // strides of kv_k / kv_v in elements
  i64 mask_sb;
  int batch, heads, rep, nsplit;
  int spare1;          // unused (the table's block capacity for the strided splits of session 27, measured slower
                       // and removed in session 29): it keeps the offsets of the fields after it
  int buf_bytes;       // bytes of one tile buffer in the ring
  int warp_bytes;      // shared memory per warp
  int planes_off, tags_off, esc_off;  // slot layout (format.py)
  float qk_scale;      // softmax scale * log2(e)
  int* counters;       // GAAC_FUSED_COMBINE: [B * H] CTAs of each group done (zero between launches: self-resetting)
};

// `plan(const_layout=True)`: the plan's ring layout (GAAC_BUF_BYTES, GAAC_WARP_BYTES) and, for compressed KV, its
// slot size (GAAC_SLOT_BYTES; the sections' offsets follow from C as in docs/format.md, checked against
// gaac_hf.format.TileLayout by test_const_layout_offsets_match_the_format) as compile-time constants, folded into
// shared-memory offsets and copy sizes; else read from Params (the launcher fills both; it refuses a pool whose slot
// size is not the plan's)
#ifdef GAAC_BUF_BYTES
#define BUF_BYTES GAAC_BUF_BYTES
#define WARP_BYTES GAAC_WARP_BYTES
#else
#define BUF_BYTES p.buf_bytes
#define WARP_BYTES p.warp_bytes
#endif
#ifdef GAAC_SLOT_BYTES
#define SLOT_BYTES ((i64)GAAC_SLOT_BYTES)
#define PLANES_OFF (16 * C)
#define TAGS_OFF (22 * C)
#define ESC_OFF (22 * C + C / 2)
#else
#define SLOT_BYTES p.slot_bytes
#define PLANES_OFF p.planes_off
#define TAGS_OFF p.tags_off
#define ESC_OFF p.esc_off
#endif

__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// GAAC_PDL: wait until the grids this one depends on have completed and their writes are visible (a no-op for a
// launch without the programmatic attribute); and let the dependent grid be scheduled.
__device__ __forceinline__ void grid_dependency_wait() {
  if (GAAC_PDL) asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void launch_dependents() {
  if (GAAC_PDL) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
  u32 done;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
__device__ __forceinline__ void bulk_copy(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}
// The common unit's slot copies carry an L2 evict-first policy (the KV is read once per call, and the partials, table
// and query stay in L2): session 30 on the H200 (warps_probe_evict_s30a/b.json, two runs, us default -> evict-first):
// 1x16K 23.5 -> 22.7 and 23.3 -> 22.6, 9/3/64 1x64K 21.4 -> 20.7 and 21.2 -> 20.6, 1x64K 57.2 -> 56.8 and 57.4 ->
// 57.0, the other shapes within +-1% (1x128K 105.5 -> 105.5 and 104.7 -> 105.7). GAAC_EVICT_FIRST=0: the default policy.
#ifndef GAAC_EVICT_FIRST
#define GAAC_EVICT_FIRST 1
#endif
__device__ __forceinline__ void bulk_copy_once(u32 dst, const void* src, u32 bytes, u32 bar) {
#if GAAC_EVICT_FIRST
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
      ::"r"(dst), "l"(src), "r"(bytes), "r"(bar), "l"(pol)
      : "memory");
#else
  bulk_copy(dst, src, bytes, bar);
#endif
}
__device__ __forceinline__ void cp_async16(u32 dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
// arrive on the mbarrier once this thread's earlier cp.async copies have landed (counted in the barrier's init)
__device__ __forceinline__ void cp_async_arrive(u32 bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void fence_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (GAAC_SKIP & 1) {  // breakdown variant: keep every operand alive (so their reconstruction stays), no tensor-core
    d[0] = __int_as_float(__float_as_int(d[0]) ^ a0 ^ a1 ^ a2 ^ a3 ^ b0 ^ b1);  // work (before session 8 only b0, b1:
    return;                                    // the compiler then dropped most of the reconstruction as dead code)
  }
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
__device__ __forceinline__ float exp2_(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ u32 lds(const u8* p) { return *reinterpret_cast<const u32*>(p); }

// Format 1: plane p holds bit p of the exponent code.
// Bit `i` of every byte lane of planes 0..NP-1 -> bit p of that lane (the lane's code).
template <int NP>
__device__ __forceinline__ u32 codes(const u32 (&pl)[8], int i) {
  u32 c = 0;
#pragma unroll
  for (int p = 0; p < NP; ++p) c |= __funnelshift_r(pl[p], pl[p], (i - p) & 31) & (0x01010101u << p);
  return c;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {  // PTX default mode: bit 3 of a nibble replicates sign
  u32 r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
// (a & m) | (b & ~m) in one LOP3
__device__ __forceinline__ u32 bitsel(u32 a, u32 b, u32 m) {
  u32 r;
  asm("lop3.b32 %0, %1, %2, %3, 0xE4;" : "=r"(r) : "r"(a), "r"(b), "r"(m));
  return r;
}
#define BF16_SM_BITS 0x807F807Fu  // sign and mantissa bits of a BF16 pair

// Exponent bytes e and sign|mantissa bytes sm of channels c0..c3 of one token -> BF16 pairs lo = (c0, c2) and
// hi = (c1, c3): the sign-replicating permute puts sm in the low byte and its sign in the high byte of each half,
// the shifted exponent bytes fill bits 7..14 of each half.
__device__ __forceinline__ void merge(u32 e, u32 sm, u32& lo, u32& hi) {
  lo = bitsel(prmt(sm, 0u, 0xA280u), e << 7, BF16_SM_BITS);
  hi = bitsel(prmt(sm, 0u, 0xB391u), e >> 1, BF16_SM_BITS);
}
// Natural BF16 pairs (c0, c1), (c2, c3) -> the score mma's k order (c0, c2), (c1, c3).
__device__ __forceinline__ void kpairs(u32 w01, u32 w23, u32& lo, u32& hi) {
  lo = prmt(w01, w23, 0x5410u);
  hi = prmt(w01, w23, 0x7632u);
}

// Swizzled 16-byte chunk of BF16 row `row` (0..15) of a staged plain tile (SWZ): the fragment loads of k_tile and
// v_tile then hit 8 different bank quads in every quarter-warp (dense rows of 2C bytes map every row to the same
// banks: 4-way conflicts). C = 128 (16 chunks per row): K reads chunks 4t + 0..3 of rows g, V chunks 2g, 2g + 1 of
// rows 2t, 2t + 1; C = 64 (8 chunks): the plain XOR with the row.
__device__ __forceinline__ int swz(int row, int chunk) {
  if (C == 128) return chunk ^ (((row ^ (row >> 1)) & 1) | ((chunk >> 2) & 2) | (row & 4));
  return chunk ^ (row & 7);
}
struct RowSwizzle {  // per-thread byte offsets of its swizzled fragment chunks (SWZ), fixed for the whole split
  u32 k[2][2];       // k_tile: [k-slice group s4][chunk of the pair], rows g (+ 8 h as an immediate)
  u32 v[2][2];       // v_tile: [row 2t + r][chunk of the pair], (+ 8 h rows as an immediate)
};

// Byte mask (0xFF per set bit) of the 4 low bits of n, one bit per byte lane.
__device__ __forceinline__ u32 spread4(u32 n) { return (n * 0x00204081u) & 0x01010101u; }
__device__ __forceinline__ u32 lane_mask(u32 n) { return spread4(n) * 0xFFu; }

struct Scratch {  // per-warp dense group data of the slot being read
  u8* base;       // [G] base of each group (base3, base4 or 0 by mode)
  u8* planes;     // [5][G] planes 3..7 of each group (0 where the mode has no such plane; 4..7 only if any raw)
  u8* raw;        // [G] 0xFF for a raw group, else 0
  // format 3, V tiles (whose prepass does not write `base` and planes[0]): each group's base twice (a V word holds
  // 2 tokens of 2 channels), over base and planes[0], and its plane-3 bits of even, then of odd tokens at even bits
  u8* base2;      // [2G]
  u8* p3eo;       // [2G] after the overlay
  u8* ov;         // format 3: [4G] code bits 3..6 of raw elements in fragment order (f3_overlay), over planes 4..7
};
#if GAAC_FORMAT == 3
#define SCRATCH_GROUPS 8  // base, plane 3, the overlay (4 bits per element), p3eo
#if !GAAC_DENSE_SLOT
#error "GAAC_FORMAT 3 (fragment-order slots) is staged as stored: GAAC_DENSE_SLOT=1"
#endif
#else
#define SCRATCH_GROUPS 7
#endif
__device__ __forceinline__ void scratch_at(Scratch& s, u8* at) {
  s.base = at;
  s.planes = s.base + G;
  s.raw = s.planes + 5 * G;
  s.base2 = s.base;
  s.ov = s.planes + G;
  s.p3eo = GAAC_FORMAT == 3 ? s.ov + 4 * G : s.raw + G;
}

// Mode tags of a lane's groups (lane L owns groups L*GPL .. L*GPL + GPL-1) and their escape bytes.
struct LaneTags {
  u32 wb, rb;  // wide and raw bits of the lane's groups
  int off;     // escape offset of the lane's first group
  bool any_raw;  // any raw group in the tile (warp-uniform)
};
__device__ __forceinline__ void load_tags(const Params& p, const u8* slot, int lane, LaneTags& lt) {
  const u8* tags = slot + SECTION_SHIFT + TAGS_OFF;
  if (GPL == 8) {
    lt.wb = tags[lane];
    lt.rb = tags[G / 8 + lane];
  } else {
    lt.wb = (tags[lane >> 1] >> ((lane & 1) * 4)) & 0xF;
    lt.rb = (tags[G / 8 + (lane >> 1)] >> ((lane & 1) * 4)) & 0xF;
  }
}
// Escape offsets of the K and V tiles of one unit by one warp scan (counts packed in 16-bit halves; a tile that is
// not a slot counts nothing). Format 1: each group's escape bytes together (1 per wide group, 4 more per raw one);
// format 3 (version 2): the plane-3 bytes of the wide groups come first, so a lane's offset counts those alone.
__device__ __forceinline__ void scan_tags(LaneTags& k, LaneTags& v, int lane) {
  constexpr u32 RAW_BYTES = GAAC_FORMAT == 3 ? 0u : 4u;  // bytes a raw group adds to the lane's plane-3 run
  const u32 ck = __popc(k.wb) + RAW_BYTES * __popc(k.rb), cv = __popc(v.wb) + RAW_BYTES * __popc(v.rb);
  const u32 cnt = ck | (cv << 16);
  u32 incl = cnt;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const u32 x = __shfl_up_sync(0xffffffffu, incl, d);
    if (lane >= d) incl += x;
  }
  const u32 excl = incl - cnt;
  k.off = excl & 0xFFFF;
  v.off = excl >> 16;
  k.any_raw = __any_sync(0xffffffffu, k.rb != 0);
  v.any_raw = __any_sync(0xffffffffu, v.rb != 0);
}

// Plane-3 escape bytes of NW words of 4 groups (group k: bit k of the tag bits wb) when none of them is raw: the
// wide groups' bytes are popc(wb) consecutive escape bytes from `off`, group k takes byte rank(k) = popc(wb below
// k) of that window, by one byte permute per word. Reads stay in the buffer whatever the tags say.
template <int NW>
__device__ __forceinline__ void plane3_window(const Params& p, const u8* esc, u32 wb, int off, u32 (&p3)[NW]) {
  const int o = min(off, BUF_BYTES - SECTION_SHIFT - ESC_OFF - 12);
  const u32* wp = reinterpret_cast<const u32*>(esc + (o & ~3));
  const u32 sh = 8 * (o & 3);
  const u32 w0 = wp[0], w1 = wp[1], w2 = wp[2];
  const u32 lo = __funnelshift_r(w0, w1, sh), hi = __funnelshift_r(w1, w2, sh);
  u32 below = 0;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    const u32 n = (wb >> (4 * w)) & 0xF;
    const u32 bits = spread4(n);
    const u32 rank = bits * 0x01010100u + below * 0x01010101u;  // byte k: popc(wb below group 4w + k)
    const u32 x = rank | (rank >> 4);                            // bytes 0, 2: nibbles rank0|rank1, rank2|rank3
    p3[w] = prmt(lo, hi, prmt(x, 0u, 0x4420u)) & (bits * 0xFFu);
    below += __popc(n);
  }
}

#define F3_OVERLAY (GAAC_FORMAT == 3)
// Raw group gi with plane bytes e4 (planes 4..7) into the overlay: lanes 0..7 OR in token 8 h + b = lane of channel
// ch (bit b of each plane byte, gathered into bits 0..3); unsigned index math (the divisions are shifts).
template <bool IS_V>
__device__ __forceinline__ void f3_scatter(const Scratch& s, int lane, u32 gi, u32 e4) {
  if (lane < 8) {
    const u32 b = lane, h = gi / C, ch = gi % C, w = ch >> 2;
    const u32 nib = ((((e4 >> b) & 0x01010101u) * 0x00204081u) >> 21) & 0xFu;
    u32 at, e;
    if (IS_V) {  // channels 4w + 2k2 + (e >> 1) x tokens 8h + 2t + (e & 1), w = g NVW + j
      const u32 j = w % NVW, k2 = (ch >> 1) & 1;
      at = ((j / 2) * 32 + 4 * (w / NVW) + b / 2) * 16 + 4 * (2 * (j % 2) + k2);
      e = 2 * (ch & 1) + (b & 1);
    } else {  // channels 4w .. 4w + 3 of token 8h + g, w = t NKS + 4 s4 + i
      at = (((w % NKS) / 4) * 32 + 4 * b + w / NKS) * 16 + 4 * (w % 4);
      e = ch & 3;
    }
    const u32 v = nib << (8 * e + 3);
    atomicOr(reinterpret_cast<u32*>(s.ov + at), h ? __funnelshift_l(v, v, 4) : v);
  }
}
// Format 3: the raw groups' code bits 3..6 (planes 4..7) scattered into an overlay in fragment order, C/16 words
// per lane in C/64 16-byte chunks (chunk x of lane L at (x * 32 + L) * 16). A word holds two of the lane's fragment
// words, A at bits 3..6 of each byte and B rotated left by 4 (so bits 7 and 0..2 of the next byte): K chunk s4, word
// i: A = word (s4, h = 0, i), B = (s4, h = 1, i); V chunk j / 2, word 2 (j % 2) + k: A = (j, h = 0, k), B = (j, h = 1,
// k). The tile takes A as x & M and B as rotr(x, 4) & M (M = 0x78787878) and adds it with the group base (disjoint
// bits: a raw group's base is 0, every other group's overlay bits are 0). Only in tiles with a raw group: the lanes
// zero their own words, then the warp takes the owner lanes of raw groups one at a time (one shuffle brings the
// owner's raw bits; the escape offset is warp-uniform, so every lane reads a group's 4 plane bytes itself) and lanes
// 0..7 OR in token b = lane (atomically: two V tokens, or two groups, share a word). (Until session 29 the owner
// broadcast each group and its bytes by two shuffles: 1-3% slower on the H200, warps_probe_ov_s29*.json.)
// The 4 plane bytes of the r-th raw group (in group order, which is the loop's order) are escape bytes
// n_wide + 4r .. + 3: every wide group's plane-3 byte comes first (format version 2's escape order).
template <bool IS_V>
__device__ __forceinline__ void f3_overlay(const u8* esc, int esc_max, const Scratch& s, int lane, const LaneTags& lt) {
#pragma unroll
  for (int x = 0; x < C / 64; ++x) *reinterpret_cast<uint4*>(s.ov + (x * 32 + lane) * 16) = make_uint4(0, 0, 0, 0);
  __syncwarp();
  int o = __shfl_sync(0xffffffffu, lt.off + __popc(lt.wb), 31);  // the tile's plane-3 bytes: where planes 4..7 start
  // the owner lanes of raw groups one at a time (one shuffle brings the owner's raw bits), their groups in order; the
  // escape offset is warp-uniform, so every lane reads the group's 4 plane bytes itself (two aligned words)
#pragma unroll 1
  for (u32 who = __ballot_sync(0xffffffffu, lt.rb != 0); who; who &= who - 1) {
    const int src = __ffs(who) - 1;
#pragma unroll 1
    for (u32 srb = __shfl_sync(0xffffffffu, lt.rb, src); srb; srb &= srb - 1, o += 4) {
      const int oc = min(o, esc_max);
      const u32* wp = reinterpret_cast<const u32*>(esc + (oc & ~3));
      f3_scatter<IS_V>(s, lane, src * GPL + __ffs(srb) - 1, __funnelshift_r(wp[0], wp[1], 8 * (oc & 3)));
    }
  }
}
__device__ __forceinline__ u32 f3_ov(u32 x, int h) { return (h ? __funnelshift_r(x, x, 4) : x) & 0x78787878u; }

// The lane's groups into the scratch: per group its base (base3, base4 or 0 by mode) and plane-3 byte p3 (format 3's
// V tiles: both doubled and split by token parity, over base2 and p3eo), format 1's raw masks.
template <bool IS_V>
__device__ __forceinline__ void group_words(const Scratch& s, const u32 (&p3)[GPL / 4], const u32 (&b3)[GPL / 4],
                                            const u32 (&b4)[GPL / 4], int lane, const LaneTags& lt) {
  const u32 wb = lt.wb, rb = lt.rb;
#pragma unroll
  for (int w = 0; w < GPL / 4; ++w) {
    const u32 wm = lane_mask((wb >> (4 * w)) & 0xF), rm = lane_mask((rb >> (4 * w)) & 0xF);
    const int g0 = lane * GPL + 4 * w;
    const u32 bw = bitsel(b4[w], b3[w], wm) & ~rm;
    if (GAAC_FORMAT == 3 && IS_V) {  // V words of format 3: (2 tokens) x (2 channels)
      *reinterpret_cast<uint2*>(s.base2 + 2 * g0) = make_uint2(prmt(bw, 0u, 0x1100u), prmt(bw, 0u, 0x3322u));
      const u32 ev = p3[w] & 0x55555555u, od = (p3[w] >> 1) & 0x55555555u;
      *reinterpret_cast<uint2*>(s.p3eo + 2 * g0) = make_uint2(prmt(ev, od, 0x5140u), prmt(ev, od, 0x7362u));
    } else {
      *reinterpret_cast<u32*>(s.base + g0) = bw;
      *reinterpret_cast<u32*>(s.planes + g0) = p3[w];
    }
    if (lt.any_raw && !F3_OVERLAY) *reinterpret_cast<u32*>(s.raw + g0) = rm;
  }
}

// Prepass over one slot in shared memory: bases and dense escape planes per group into the scratch.
template <bool IS_V = false>
__device__ __forceinline__ void prepass(const Params& p, const u8* slot, const Scratch& s, const u32 (&b3)[GPL / 4],
                                        const u32 (&b4)[GPL / 4], int lane, const LaneTags& lt) {
  const u8* esc = slot + SECTION_SHIFT + ESC_OFF;
  const u32 wb = lt.wb, rb = lt.rb;
  const int off = lt.off;
  u32 p3[GPL / 4];
  if (GAAC_FORMAT == 3 || rb == 0) {  // the lane's plane-3 bytes are consecutive (format 3: always)
    plane3_window(p, esc, wb, off, p3);
  } else {
    unsigned long long acc = 0;  // (a 64-bit word, not an array: dynamic indices would go to local memory)
    const int esc_max = BUF_BYTES - SECTION_SHIFT - ESC_OFF - 5;
    for (u32 rem = wb; rem; rem &= rem - 1) {
      const int k = __ffs(rem) - 1;
      const u32 bl = (1u << k) - 1;
      const int o = min(off + __popc(wb & bl) + 4 * __popc(rb & bl), esc_max);
      acc |= (unsigned long long)esc[o] << (8 * k);
    }
#pragma unroll
    for (int w = 0; w < GPL / 4; ++w) p3[w] = (u32)(acc >> (32 * w));
  }
  group_words<IS_V>(s, p3, b3, b4, lane, lt);
  if (F3_OVERLAY) {
    if (lt.any_raw) f3_overlay<IS_V>(esc, BUF_BYTES - SECTION_SHIFT - ESC_OFF - 4, s, lane, lt);
  } else if (lt.any_raw) {  // planes 4..7 of raw groups: the 4 escape bytes after plane 3
    const int esc_max = BUF_BYTES - SECTION_SHIFT - ESC_OFF - 5;
    unsigned long long hi[4] = {0, 0, 0, 0};
    for (u32 rem = rb; rem; rem &= rem - 1) {
      const int k = __ffs(rem) - 1;
      const u32 bl = (1u << k) - 1;
      const int o = min(off + __popc(wb & bl) + 4 * __popc(rb & bl), esc_max);
#pragma unroll
      for (int j = 0; j < 4; ++j) hi[j] |= (unsigned long long)esc[o + 1 + j] << (8 * k);
    }
#pragma unroll
    for (int w = 0; w < GPL / 4; ++w)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<u32*>(s.planes + (1 + j) * G + lane * GPL + 4 * w) = (u32)(hi[j] >> (32 * w));
  }
}


// N consecutive 32-bit words from shared memory in one vector load (the caller guarantees 4N-byte alignment).
template <int N>
__device__ __forceinline__ void ldv(const u8* ptr, u32 (&w)[N]) {
  if (N == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(ptr), x = *reinterpret_cast<const uint4*>(ptr + 16);
    w[0] = v.x, w[1] = v.y, w[2 % N] = v.z, w[3 % N] = v.w, w[4 % N] = x.x, w[5 % N] = x.y, w[6 % N] = x.z,
    w[7 % N] = x.w;
  } else if (N == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(ptr);
    w[0] = v.x, w[1] = v.y, w[2 % N] = v.z, w[3 % N] = v.w;
  } else if (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(ptr);
    w[0] = v.x, w[1 % N] = v.y;
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) w[i] = lds(ptr + 4 * i);
  }
}

// Group-level words of N consecutive words (4 groups each) from group `g0` on: planes 0..NP-1 and bases.
template <int NP, int N>
struct GroupWords {
  u32 pl[8][N];
  u32 base[N];
  __device__ __forceinline__ GroupWords(const Params& p, const u8* slot, const Scratch& s, int g0) {
    const u8* planes = slot + SECTION_SHIFT + PLANES_OFF;
    ldv<N>(planes + g0, pl[0]);
    ldv<N>(planes + G + g0, pl[1]);
    ldv<N>(planes + 2 * G + g0, pl[2]);
#pragma unroll
    for (int j = 3; j < 8; ++j) {
      if (j < NP) ldv<N>(s.planes + (j - 3) * G + g0, pl[j]);
      else {
#pragma unroll
        for (int i = 0; i < N; ++i) pl[j][i] = 0u;
      }
    }
    ldv<N>(s.base + g0, base);
  }
  // exponent bytes of word i for token bit `bit`
  __device__ __forceinline__ u32 exponents(int i, int bit) const {
    u32 w[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = pl[j][i];
    return codes<NP>(w, bit) + base[i];
  }
  // raw groups of word i (byte mask `rm`): the full 8-bit code from planes 0..7 (base 0). Rare, so kept off the
  // common path: a lane branches here only when one of its groups is raw.
  __device__ __forceinline__ u32 fix_raw(const Scratch& s, int g0, int i, int bit, u32 e, u32 rm) const {
    u32 w[8];
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = pl[j][i];
#pragma unroll
    for (int j = 4; j < 8; ++j) w[j] = lds(s.planes + (j - 3) * G + g0 + 4 * i);
    return (e & ~rm) | (codes<8>(w, bit) & rm);
  }
};

// Format 3 (fragment-order byte-split prototype, benchmarks/format_v2_probe.py): the format-2 information stored in
// the order the fragments consume it. A lane's elements of a tile form C/8 words of 4 elements (K: word q = 8 s4 +
// 4 h + i is channels 4w .. 4w + 3 of token 8h + g, w = t NKS + 4 s4 + i; V: word q = 4 j + 2 h + k is channels
// 4w + 2k, 4w + 2k + 1 x tokens 8h + 2t, 8h + 2t + 1, w = g NVW + j). Low bytes: 16-byte chunk q / 4 of the lane at
// (chunk * 32 + lane) * 16. Signs and 2-bit codes: C/32 mixed words M and C/64 code words P per lane, word x at
// planes_off + (x * 32 + lane) * 4. Word q's type y = q % 4 and M word q / 4: y = 0 keeps sign|code at bits 7|0..1 of
// each byte (one mask), y = 1 the same after a rotate by 3, y = 2 / 3 only its signs (bits 5 / 6 of each byte, one
// shift), their codes in P word q / 8 at bits 2r, 2r + 1 of each byte, r = 2 ((q / 4) % 2) + y - 2.
template <int Y, int R>
__device__ __forceinline__ u32 f3_high(u32 mw, u32 pw, u32 b2) {  // sign | code bit 2 | code bits 0..1, per byte
  if (Y == 0) return (mw & 0x83838383u) | b2;
  if (Y == 1) return (__funnelshift_r(mw, mw, 3) & 0x83838383u) | b2;
  const u32 sb = ((mw << (Y == 2 ? 2 : 1)) & 0x80808080u) | b2;
  return ((R ? __funnelshift_r(pw, pw, 2 * R) : pw) & 0x03030303u) | sb;
}
// The high bytes of a pair of words of types (YA, RA), (YB, RB): code bit 2 from the plane-3 scratch words xa, xb
// (token bit at `rot` + 2), plus the group bases oa, ob.
// va, vb: the overlay's code bits 3..6, one more term of the same add.
template <int YA, int RA, int YB, int RB>
__device__ __forceinline__ void f3_pair(u32 mw, u32 pw, u32 xa, u32 xb, u32 oa, u32 ob, u32 rot, u32& ha, u32& hb,
                                        u32 va = 0u, u32 vb = 0u) {
  const u32 ba = (GAAC_SKIP & 4) ? 0u : __funnelshift_r(xa, xa, rot) & 0x04040404u;
  const u32 bb = (GAAC_SKIP & 4) ? 0u : __funnelshift_r(xb, xb, rot) & 0x04040404u;
  ha = f3_high<YA, RA>(mw, pw, ba) + oa + va;
  hb = f3_high<YB, RB>(mw, pw, bb) + ob + vb;
}
__device__ __forceinline__ void f3_words(const Params& p, const u8* buf, int lane, u32 (&mw)[C / 32], u32 (&pw)[C / 64]) {
  const u8* words = buf + SECTION_SHIFT + PLANES_OFF + 4 * lane;
#pragma unroll
  for (int x = 0; x < C / 32; ++x) mw[x] = lds(words + 128 * x);
#pragma unroll
  for (int x = 0; x < C / 64; ++x) pw[x] = lds(words + 128 * (C / 32 + x));
}
// The tile's high bytes are built first for all of a lane's words, then the byte permutes and mmas follow. Raw groups
// (0.2% of the groups, but in ~40% of the tiles of real KV): their code bits 3..6 come from the overlay (f3_overlay)
// in the same add as the bases, and the caller runs a separate inlined copy for tiles that have any (so the other copy
// never touches the overlay; one copy for both was slower, 77.5 against 74.8 us, session 13, removed in session 28;
// patching them per word by a call or branch-free over such a tile was slower too: sessions 12-13, git history).
__device__ __forceinline__ void k_tile_f3(const Params& p, const u8* buf, const Scratch& s, int lane, int g, int t,
                                          const u32 (&qb)[NKS][2], float (&sc)[2][4], bool any_raw) {
  u32 mw[C / 32], pw[C / 64];
  f3_words(p, buf, lane, mw, pw);
  const u32 rot = (g - 2) & 31;
  constexpr int NC = NKS / 2;  // 16-byte chunks of 4 words per lane: chunk kc = 2 s4 + h
  u32 H[NC][4], X[4] = {0u, 0u, 0u, 0u};  // X: the overlay words of chunk pair s4
#pragma unroll
  for (int kc = 0; kc < NC; ++kc) {
    const int s4 = kc / 2, h = kc % 2;
    const int g0 = h * C + 4 * (t * NKS + 4 * s4);
    u32 O[4], P3[4];
    ldv<4>(s.base + g0, O);
    ldv<4>(s.planes + g0, P3);
    if (F3_OVERLAY && h == 0 && any_raw && !(GAAC_SKIP & 8)) ldv<4>(s.ov + (s4 * 32 + lane) * 16, X);
    const u32 m = mw[kc], q = pw[s4];
    f3_pair<0, 0, 1, 0>(m, q, P3[0], P3[1], O[0], O[1], rot, H[kc][0], H[kc][1], f3_ov(X[0], h), f3_ov(X[1], h));
    if (h == 0)
      f3_pair<2, 0, 3, 1>(m, q, P3[2], P3[3], O[2], O[3], rot, H[kc][2], H[kc][3], f3_ov(X[2], h), f3_ov(X[3], h));
    else
      f3_pair<2, 2, 3, 3>(m, q, P3[2], P3[3], O[2], O[3], rot, H[kc][2], H[kc][3], f3_ov(X[2], h), f3_ov(X[3], h));
  }
#pragma unroll
  for (int s4 = 0; s4 < NKS / 4; ++s4) {
    u32 lo[2][4], hi[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      u32 L[4];
      ldv<4>(buf + ((2 * s4 + h) * 32 + lane) * 16, L);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        lo[h][i] = prmt(L[i], H[2 * s4 + h][i], 0x6240u);
        hi[h][i] = prmt(L[i], H[2 * s4 + h][i], 0x7351u);
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int sl = 4 * s4 + i;
      mma(sc[sl & 1], lo[0][i], lo[1][i], hi[0][i], hi[1][i], qb[sl][0], qb[sl][1]);
    }
  }
}
__device__ __forceinline__ void v_tile_f3(const Params& p, const u8* buf, const Scratch& s, int lane, int g, int t,
                                          const u32 (&pb)[2], float (&o)[NVM][4], bool any_raw) {
  u32 mw[C / 32], pw[C / 64];
  f3_words(p, buf, lane, mw, pw);
  const u32 rot = (2 * t - 2) & 31;
  u32 H[NVW][2][2], X[4] = {0u, 0u, 0u, 0u};  // [j][h][k]; X: the overlay words of j, j + 1 (j even)
#pragma unroll
  for (int j = 0; j < NVW; ++j) {
    const int w = g * NVW + j;
    const u32 m = mw[j], q = pw[j / 2];
    if (F3_OVERLAY && j % 2 == 0 && any_raw && !(GAAC_SKIP & 8)) ldv<4>(s.ov + ((j / 2) * 32 + lane) * 16, X);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gd = 2 * (h * C + 4 * w);
      u32 O[2], P[2];
      ldv<2>(s.base2 + gd, O);
      ldv<2>(s.p3eo + gd, P);
      const u32 va = f3_ov(X[2 * (j % 2)], h), vb = f3_ov(X[2 * (j % 2) + 1], h);
      if (h == 0) f3_pair<0, 0, 1, 0>(m, q, P[0], P[1], O[0], O[1], rot, H[j][h][0], H[j][h][1], va, vb);
      else if (j % 2 == 0) f3_pair<2, 0, 3, 1>(m, q, P[0], P[1], O[0], O[1], rot, H[j][h][0], H[j][h][1], va, vb);
      else f3_pair<2, 2, 3, 3>(m, q, P[0], P[1], O[0], O[1], rot, H[j][h][0], H[j][h][1], va, vb);
    }
  }
#pragma unroll
  for (int j = 0; j < NVW; ++j) {
    u32 L[4];
    ldv<4>(buf + (j * 32 + lane) * 16, L);
    u32 a[2][2][2];  // [h][k][channel 4w + 2k + c]: tokens 8h + 2t, 8h + 2t + 1
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        a[h][k][0] = prmt(L[2 * h + k], H[j][h][k], 0x5140u);
        a[h][k][1] = prmt(L[2 * h + k], H[j][h][k], 0x7362u);
      }
#pragma unroll
    for (int k = 0; k < 2; ++k) mma(o[2 * j + k], a[0][k][0], a[0][k][1], a[1][k][0], a[1][k][1], pb[0], pb[1]);
  }
}

// Scores of one tile: k-slice s of thread (g, t) is word w = t*NKS + s (channels 4w..4w+3) of tokens g and g+8
// (operand A rows g, g+8) and of query head g (operand B column g). KIND 0: BF16 rows (raw tile, plain block,
// tail); 4: slot (raw groups, if any, patched per word).
template <int KIND>
__device__ __forceinline__ void k_tile(const Params& p, const u8* buf, const Scratch& s, int g, int t,
                                       const u32 (&qb)[NKS][2], float (&sc)[2][4], bool any_raw,
                                       const RowSwizzle& sw) {
  if (KIND == 4 && GAAC_FORMAT == 3) {
    if (F3_OVERLAY && any_raw) k_tile_f3(p, buf, s, 4 * g + t, g, t, qb, sc, true);
    else k_tile_f3(p, buf, s, 4 * g + t, g, t, qb, sc, F3_OVERLAY ? false : any_raw);
    return;
  }
  constexpr int NV = 4;  // words per vector load
#pragma unroll
  for (int s4 = 0; s4 < NKS / NV; ++s4) {
    const int w0 = t * NKS + NV * s4;
    u32 lo[2][NV], hi[2][NV];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int tok = 8 * h + g;
      if (KIND == 0) {
        u32 r[2 * NV];
        if (SWZ) {
          u32 a[4], c[4];
          ldv<4>(buf + h * 8 * 2 * C + sw.k[s4 % 2][0], a);
          ldv<4>(buf + h * 8 * 2 * C + sw.k[s4 % 2][1], c);
#pragma unroll
          for (int i = 0; i < 4; ++i) r[i] = a[i], r[4 + i] = c[i];
        } else {
          ldv<2 * NV>(buf + tok * 2 * C + 8 * w0, r);
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) kpairs(r[2 * i], r[2 * i + 1], lo[h][i], hi[h][i]);
      } else {
        const int g0 = h * C + 4 * w0;
        const GroupWords<4, NV> gw(p, buf, s, g0);
        u32 sm[NV], e[NV];
        ldv<NV>(buf + tok * SM_ROW + 4 * w0, sm);
#pragma unroll
        for (int i = 0; i < NV; ++i) e[i] = gw.exponents(i, g);
        if (any_raw) {
          u32 rm[NV];
          ldv<NV>(s.raw + g0, rm);
          if ((rm[0] | rm[1 % NV] | rm[2 % NV] | rm[3 % NV]) != 0) {
#pragma unroll
            for (int i = 0; i < NV; ++i)
              if (rm[i]) e[i] = gw.fix_raw(s, g0, i, g, e[i], rm[i]);
          }
        }
#pragma unroll
        for (int i = 0; i < NV; ++i) merge(e[i], sm[i], lo[h][i], hi[h][i]);
      }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i) {
      const int sl = NV * s4 + i;
      mma(sc[sl & 1], lo[0][i], lo[1][i], hi[0][i], hi[1][i], qb[sl][0], qb[sl][1]);  // two chains
    }
  }
}

// A BF16-row V tile (raw tile, plain block, tail) in two steps: v_load reads thread (g, t)'s words of tokens
// 8h + 2t, 8h + 2t + 1 (channels 4w..4w+3, w = g*NVW + j) into registers, v_math pairs them into operand A (V^T, two
// tokens of one channel per register) and runs the output mma.
__device__ __forceinline__ void v_load(const u8* buf, int g, int t, const RowSwizzle& sw, u32 (&ra)[2][2 * NVW],
                                       u32 (&rc)[2][2 * NVW]) {
  const int w0 = g * NVW;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int ta = 8 * h + 2 * t;
    if (SWZ) {  // 2 NVW words = one chunk (C = 64) or two (C = 128) per row
      u32 a[4], c[4];
      ldv<4>(buf + h * 8 * 2 * C + sw.v[0][0], a);
      ldv<4>(buf + h * 8 * 2 * C + sw.v[1][0], c);
#pragma unroll
      for (int i = 0; i < 4; ++i) ra[h][i % (2 * NVW)] = a[i], rc[h][i % (2 * NVW)] = c[i];
      if (2 * NVW == 8) {
        ldv<4>(buf + h * 8 * 2 * C + sw.v[0][1], a);
        ldv<4>(buf + h * 8 * 2 * C + sw.v[1][1], c);
#pragma unroll
        for (int i = 0; i < 4; ++i) ra[h][(4 + i) % (2 * NVW)] = a[i], rc[h][(4 + i) % (2 * NVW)] = c[i];
      }
    } else {
      ldv<2 * NVW>(buf + ta * 2 * C + 8 * w0, ra[h]);
      ldv<2 * NVW>(buf + (ta + 1) * 2 * C + 8 * w0, rc[h]);
    }
  }
}
__device__ __forceinline__ void v_math(const u32 (&ra)[2][2 * NVW], const u32 (&rc)[2][2 * NVW], const u32 (&pb)[2],
                                       float (&o)[NVM][4]) {
  u32 vb[2][NVW][4];  // [half][word][channel c0..c3]: tokens (ta, ta + 1) of one channel
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int j = 0; j < NVW; ++j) {
      vb[h][j][0] = prmt(ra[h][2 * j], rc[h][2 * j], 0x5410u);
      vb[h][j][1] = prmt(ra[h][2 * j], rc[h][2 * j], 0x7632u);
      vb[h][j][2] = prmt(ra[h][2 * j + 1], rc[h][2 * j + 1], 0x5410u);
      vb[h][j][3] = prmt(ra[h][2 * j + 1], rc[h][2 * j + 1], 0x7632u);
    }
  // m-tile 2j + k: row g = channel 4w + 2k, row g + 8 = channel 4w + 2k + 1 of this thread group's word w
#pragma unroll
  for (int j = 0; j < NVW; ++j)
#pragma unroll
    for (int k = 0; k < 2; ++k)
      mma(o[2 * j + k], vb[0][j][2 * k], vb[0][j][2 * k + 1], vb[1][j][2 * k], vb[1][j][2 * k + 1], pb[0], pb[1]);
}

// Output of one tile: thread (g, t) builds operand A (V^T) for channels 4w..4w+3 (w = g*NVW + j) and tokens
// 8h+2t, 8h+2t+1 of both halves, two tokens of one channel per register.
template <int KIND>
__device__ __forceinline__ void v_tile(const Params& p, const u8* buf, const Scratch& s, int g, int t,
                                       const u32 (&pb)[2], float (&o)[NVM][4], bool any_raw, const RowSwizzle& sw) {
  if (KIND == 4 && GAAC_FORMAT == 3) {
    if (F3_OVERLAY && any_raw) v_tile_f3(p, buf, s, 4 * g + t, g, t, pb, o, true);
    else v_tile_f3(p, buf, s, 4 * g + t, g, t, pb, o, F3_OVERLAY ? false : any_raw);
    return;
  }
  if (KIND == 0) {
    u32 ra[2][2 * NVW], rc[2][2 * NVW];
    v_load(buf, g, t, sw, ra, rc);
    v_math(ra, rc, pb, o);
    return;
  }
  constexpr int NV = VT_WORDS;  // words per vector load
#pragma unroll
  for (int j0 = 0; j0 < NVW; j0 += NV) {
    const int w0 = g * NVW + j0;
    u32 vb[2][NV][4];  // [half][word][channel c0..c3]: tokens (ta, ta + 1) of one channel
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int ta = 8 * h + 2 * t;
      const int g0 = h * C + 4 * w0;
      const GroupWords<4, NV> gw(p, buf, s, g0);
      u32 sa[NV], sb[NV], ea[NV], eb[NV];
      ldv<NV>(buf + ta * SM_ROW + 4 * w0, sa);
      ldv<NV>(buf + (ta + 1) * SM_ROW + 4 * w0, sb);
#pragma unroll
      for (int j = 0; j < NV; ++j)
        ea[j] = gw.exponents(j, 2 * t), eb[j] = gw.exponents(j, 2 * t + 1);
      if (any_raw) {
        u32 rm[NV];
        ldv<NV>(s.raw + g0, rm);
        u32 any = 0;
#pragma unroll
        for (int j = 0; j < NV; ++j) any |= rm[j];
        if (any) {
#pragma unroll
          for (int j = 0; j < NV; ++j)
            if (rm[j]) {
              ea[j] = gw.fix_raw(s, g0, j, 2 * t, ea[j], rm[j]);
              eb[j] = gw.fix_raw(s, g0, j, 2 * t + 1, eb[j], rm[j]);
            }
        }
      }
#pragma unroll
      for (int j = 0; j < NV; ++j) {
        u32 alo, ahi, blo, bhi;  // (c0, c2) and (c1, c3) of tokens ta, ta + 1
        merge(ea[j], sa[j], alo, ahi);
        merge(eb[j], sb[j], blo, bhi);
        vb[h][j][0] = prmt(alo, blo, 0x5410u);
        vb[h][j][2] = prmt(alo, blo, 0x7632u);
        vb[h][j][1] = prmt(ahi, bhi, 0x5410u);
        vb[h][j][3] = prmt(ahi, bhi, 0x7632u);
      }
    }

    // m-tile 2j + k: row g = channel 4w + 2k, row g + 8 = channel 4w + 2k + 1 of this thread group's word w
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
      for (int k = 0; k < 2; ++k)
        mma(o[2 * (j0 + j) + k], vb[0][j][2 * k], vb[0][j][2 * k + 1], vb[1][j][2 * k], vb[1][j][2 * k + 1], pb[0],
            pb[1]);
  }
}

__device__ __forceinline__ u32 transpose8x8(u32 x) {  // an 8x8 b16 fragment (row = lane/4) -> its transpose
  u32 r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

// A padding mask's bytes of tokens g and g + 8 of a unit (0: masked; tokens past `valid` read as masked, never
// loaded). The one-warp kernel loads them when it issues the unit's copies, so the softmax never waits on a global
// load (in the captured step every layer gets a mask: a load per unit on the critical path cost ~5 us at 64K).
struct UnitMask {
  u32 a, b;
};
__device__ __forceinline__ UnitMask unit_mask(const u8* mrow, int u, int g, int valid) {
  UnitMask mk = {1u, 1u};
  if (mrow) {
    mk.a = g < valid ? (u32)mrow[16 * u + g] : 0u;
    mk.b = g + 8 < valid ? (u32)mrow[16 * u + g + 8] : 0u;
  }
  return mk;
}
// Online softmax (base 2) of heads 2t, 2t+1 over one unit's 16 tokens (thread: tokens g, g + 8; reduced over g):
// running max m and this thread's sum l updated, the factors alpha that rescale the output, and P^T as operand B of
// the output mma (k = tokens, n = head g) from the S^T layout (row = token g, columns = heads 2t, 2t+1).
__device__ __forceinline__ void softmax_unit(const float (&sc2)[2][4], float qk_scale, int valid, bool masked,
                                             UnitMask mk, int g, float (&m)[2], float (&l)[2], float (&alpha)[2],
                                             u32 (&pb)[2]) {
  float x[4];
#pragma unroll
  for (int c = 0; c < 4; ++c) x[c] = (sc2[0][c] + sc2[1][c]) * qk_scale;
  if (valid < 16 || masked) {  // the tail or a padding mask (warp-uniform): mask the scores
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int tok = g + 8 * (c >> 1);
      bool ok = tok < valid;
      if (masked) ok = ok && ((c >> 1) ? mk.b : mk.a) != 0;
      if (!ok) x[c] = NEG_INF;
    }
  }
  float pr[4];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    float mx = fmaxf(x[j], x[2 + j]);
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 8));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 16));
    const float mn = fmaxf(m[j], mx);
    const float ms = mn == NEG_INF ? 0.f : mn;
    alpha[j] = exp2_(m[j] - ms);
    pr[j] = exp2_(x[j] - ms);
    pr[2 + j] = exp2_(x[2 + j] - ms);
    l[j] = l[j] * alpha[j] + (pr[j] + pr[2 + j]);
    m[j] = mn;
  }
  pb[0] = transpose8x8(pack_bf16(pr[0], pr[1]));
  pb[1] = transpose8x8(pack_bf16(pr[2], pr[3]));
}
// O^T (columns = heads 2t, 2t+1) times alpha when the running max moved (rare late in a split)
__device__ __forceinline__ void rescale_o(float (&o)[TILES][NVM][4], const float (&alpha)[2]) {
  if (alpha[0] != 1.f || alpha[1] != 1.f) {
#pragma unroll
    for (int T = 0; T < TILES; ++T)
#pragma unroll
      for (int n = 0; n < NVM; ++n) {
        o[T][n][0] *= alpha[0];
        o[T][n][1] *= alpha[1];
        o[T][n][2] *= alpha[0];
        o[T][n][3] *= alpha[1];
      }
  }
}

// Partial results of split `item`: max and denominator of each head (the thread's sums reduced over g) ...
__device__ __forceinline__ void sum_over_g(float (&l)[2]) {  // a thread's token sums -> its heads' sums
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l[j] += __shfl_xor_sync(0xffffffffu, l[j], 4);
    l[j] += __shfl_xor_sync(0xffffffffu, l[j], 8);
    l[j] += __shfl_xor_sync(0xffffffffu, l[j], 16);
  }
}
__device__ __forceinline__ void write_ml(const Params& p, int item, int g, int t, const float (&m)[2], float (&l)[2]) {
  sum_over_g(l);
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int head = 2 * t + c;
    if (head >= p.rep || g != 0) continue;
    const i64 row = (i64)item * p.rep + head;
    p.part_ml[2 * row] = m[c];
    p.part_ml[2 * row + 1] = l[c];
  }
}
// ... and the unnormalized output O^T: put(head, ch, value of channel ch, value of ch + 1) for every valid head of
// the thread (heads 2t, 2t + 1) and its channel pairs (rows g and g + 8 of m-tile n: channels
// 4(g NVW + n/2) + 2(n % 2) + 0, 1)
template <typename Put>
__device__ __forceinline__ void o_pairs(const Params& p, int g, int t, const float (&o)[TILES][NVM][4], Put put) {
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int head = 2 * t + c;
    if (head >= p.rep) continue;
#pragma unroll
    for (int T = 0; T < TILES; ++T)
#pragma unroll
      for (int n = 0; n < NVM; ++n) put(head, T * C + 4 * (g * NVW + n / 2) + 2 * (n % 2), o[T][n][c], o[T][n][2 + c]);
  }
}
// from the fragments: per warp store instruction 4 bytes into each of 32 different sectors
__device__ __forceinline__ void write_o(const Params& p, int item, int g, int t, const float (&o)[TILES][NVM][4]) {
  o_pairs(p, g, t, o, [&](int head, int ch, float x, float y) {
    float* po = p.part_o + ((i64)item * p.rep + head) * D;
    po[ch] = x;
    po[ch + 1] = y;
  });
}
// ... or (GAAC_STAGED_O, the one-warp kernel's default) put in row order in `stage`, rep x D floats of the warp's
// shared memory (its drained ring: one stage alone, K and V buffers of at least 16 x C bytes per tile, holds the
// 4 x 8 x D bytes of eight heads), and written as 16-byte stores, a whole head row per warp store. Same values,
// same places.
#ifndef GAAC_STAGED_O
#define GAAC_STAGED_O 1
#endif
__device__ __forceinline__ void write_o_staged(const Params& p, int item, int g, int t,
                                               const float (&o)[TILES][NVM][4], float* stage) {
  __syncwarp();  // every lane is past its last read of the ring
  o_pairs(p, g, t, o, [&](int head, int ch, float x, float y) {
    *reinterpret_cast<float2*>(stage + head * D + ch) = make_float2(x, y);
  });
  __syncwarp();
  const float4* from = reinterpret_cast<const float4*>(stage);
  float4* to = reinterpret_cast<float4*>(p.part_o + (i64)item * p.rep * D);
  for (int i = 4 * g + t; i < p.rep * (D / 4); i += 32) to[i] = from[i];
}

__device__ __forceinline__ void add_scaled(float4& acc, const float4& x, float w) {  // acc += x w
  acc.x += x.x * w;
  acc.y += x.y * w;
  acc.z += x.z * w;
  acc.w += x.w * w;
}

// GAAC_CTA_MERGE: the splits of group grp = b * heads + hk are items grp * nsplit .. + nsplit - 1, warp w of CTA c
// holds item c * GAAC_WARPS + w, so the group's partials are those of CTAs first_cta .. last_cta, at rows
// grp * cta_parts_cap + (c - first_cta) (the launcher allocates batch * heads * cta_parts_cap of them).
__device__ __forceinline__ int first_cta(const Params& p, int grp) { return (int)((i64)grp * p.nsplit / GAAC_WARPS); }
__device__ __forceinline__ int last_cta(const Params& p, int grp) {
  return (int)(((i64)grp + 1) * p.nsplit - 1) / GAAC_WARPS;
}
__device__ __forceinline__ int cta_parts_cap(const Params& p) { return p.nsplit / GAAC_WARPS + 2; }

#if FUSED_COMBINE
// GAAC_FUSED_COMBINE: after its partials of groups g0 .. g1 are written, the CTA counts itself done for each of them
// (one lane of warp 0 per group, an atomic on Params::counters after a fence); the CTA that completes a group's count
// resets it and merges the group's partials, in CTA order, into the BF16 output: out[b, hk rep + head, ch] for every
// head and channel, four channels per thread, FUSED_UNROLL partials per round of loads with all of them in flight.
// (16 or 24 partials per round, and sets of threads each over a share of the partials merged in order through shared
// memory, were slower: session 23, benchmarks/results/warps_probe_fused2_s23.json; git history: commit f2e92a0)
#define FUSED_UNROLL 8
// a group's partials (rows part0 .. part0 + parts - 1) merged into the running (mw, den, acc) of one head's channels
// 4 c4 .. 4 c4 + 3, in partial order, FUSED_UNROLL loads per round all in flight
__device__ __forceinline__ void merge_parts(const Params& p, i64 part0, int parts, int head, int c4, float& mw,
                                            float& den, float4& acc) {
#pragma unroll 1
  for (int s0 = 0; s0 < parts; s0 += FUSED_UNROLL) {
    float2 ml[FUSED_UNROLL];
    float4 po[FUSED_UNROLL];
#pragma unroll
    for (int k = 0; k < FUSED_UNROLL; ++k) {
      const bool in = s0 + k < parts;
      const i64 row = (part0 + s0 + k) * p.rep + head;
      ml[k] = in ? __ldcg(reinterpret_cast<const float2*>(p.part_ml) + row) : make_float2(NEG_INF, 0.f);
      po[k] = in ? __ldcg(reinterpret_cast<const float4*>(p.part_o + row * D) + c4) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    float mx = mw;
#pragma unroll
    for (int k = 0; k < FUSED_UNROLL; ++k) mx = fmaxf(mx, ml[k].x);
    if (mx != NEG_INF) {
      const float a = exp2_(mw - mx);
      den *= a;
      acc = make_float4(acc.x * a, acc.y * a, acc.z * a, acc.w * a);
#pragma unroll
      for (int k = 0; k < FUSED_UNROLL; ++k) {  // partials in CTA order
        const float w = exp2_(ml[k].x - mx);
        den += ml[k].y * w;
        add_scaled(acc, po[k], w);
      }
      mw = mx;
    }
  }
}

// one head's channels 4 c4 .. 4 c4 + 3 of group grp into the BF16 output: acc / den, or 0 for a row that attends to
// nothing (as the combine kernel)
__device__ __forceinline__ void store_out(const Params& p, int grp, int head, int c4, const float4& acc, float den) {
  const bool any = den > 0.f;
  u32 lo, hi;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(lo) : "f"(any ? acc.y / den : 0.f), "f"(any ? acc.x / den : 0.f));
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(hi) : "f"(any ? acc.w / den : 0.f), "f"(any ? acc.z / den : 0.f));
  const int b = grp / p.heads, hk = grp % p.heads;
  u16* out = p.out + ((i64)b * p.heads * p.rep + (i64)hk * p.rep + head) * D + 4 * c4;
  *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
}

__device__ __forceinline__ void fused_combine(const Params& p, u8* smem, int warp, int lane, int live, int g0, int g1) {
  __threadfence();  // this CTA's partials are visible before its count is
  u32* flag = reinterpret_cast<u32*>(smem + HDR) + 8 * D + 16;  // warp 0's ring, past its staged rows and statistics
  asm volatile("bar.sync 1, %0;" ::"r"(32 * live) : "memory");
  if (warp == 0) {
    bool last = false;
    if (lane <= g1 - g0) {
      const int grp = g0 + lane;
      const int parts = last_cta(p, grp) - first_cta(p, grp) + 1;
      last = atomicAdd(p.counters + grp, 1) == parts - 1;
      if (last) p.counters[grp] = 0;  // every CTA of the group has counted: ready for the next launch
    }
    const u32 bits = __ballot_sync(0xffffffffu, last);
    if (lane == 0) *flag = bits;
  }
  asm volatile("bar.sync 1, %0;" ::"r"(32 * live) : "memory");
  const u32 bits = *flag;
  if (!bits) return;
  __threadfence();  // the other CTAs' partials, after their counts
  const int rows4 = p.rep * (D / 4);
#pragma unroll 1
  for (int i = 0; i <= g1 - g0; ++i) {
    if (!((bits >> i) & 1)) continue;
    const int grp = g0 + i;
    const int parts = last_cta(p, grp) - first_cta(p, grp) + 1;
    const i64 part0 = (i64)grp * cta_parts_cap(p);
#pragma unroll 1
    for (int e = warp * 32 + lane; e < rows4; e += 32 * live) {
      const int head = e / (D / 4), c4 = e % (D / 4);
      float mw = NEG_INF, den = 0.f;
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      merge_parts(p, part0, parts, head, c4, mw, den, acc);
      store_out(p, grp, head, c4, acc, den);
    }
  }
}
#endif

// GAAC_CTA_MERGE: the CTA's live warps (items below the total) merge their splits per group before anything leaves
// the SM. Each warp puts its unnormalized output rows (rep x D fp32, row order) and per head (max, denominator) in
// its drained ring; after a named barrier over the live warps, the CTA's threads merge each group's warps in warp
// order, four channels per thread, and write one partial per group with 16-byte stores: the combine then reads
// about nsplit / GAAC_WARPS + 1 partials per group instead of nsplit. The same code for compressed KV and its twin,
// so the same bits.
__device__ __forceinline__ void cta_merge(const Params& p, u8* smem, int warp, int lane, int g, int t,
                                          const float (&m)[2], float (&l)[2], const float (&o)[TILES][NVM][4]) {
  sum_over_g(l);
  constexpr int ML = 8 * D;  // a warp's statistics after its (at most 8) output rows
  float* mine = reinterpret_cast<float*>(smem + warp * WARP_BYTES + HDR);
  __syncwarp();  // every lane is past its last read of the ring
  o_pairs(p, g, t, o, [&](int head, int ch, float x, float y) {
    *reinterpret_cast<float2*>(mine + head * D + ch) = make_float2(x, y);
  });
#pragma unroll
  for (int c = 0; c < 2; ++c)
    if (g == 0 && 2 * t + c < p.rep) *reinterpret_cast<float2*>(mine + ML + 2 * (2 * t + c)) = make_float2(m[c], l[c]);
  const int item0 = blockIdx.x * GAAC_WARPS;
  const int live = min(GAAC_WARPS, p.batch * p.heads * p.nsplit - item0);
  asm volatile("bar.sync 1, %0;" ::"r"(32 * live) : "memory");
  const int g0 = item0 / p.nsplit, g1 = (item0 + live - 1) / p.nsplit;
  const int rows4 = p.rep * (D / 4);
#pragma unroll 1
  for (int grp = g0; grp <= g1; ++grp) {
    const int wa = max(grp * p.nsplit - item0, 0), wb = min((grp + 1) * p.nsplit - item0, live);
    const i64 part = (i64)grp * cta_parts_cap(p) + (blockIdx.x - first_cta(p, grp));
#pragma unroll 1
    for (int e = warp * 32 + lane; e < rows4; e += 32 * live) {
      const int head = e / (D / 4), c4 = e % (D / 4);
      float mx = NEG_INF;
#pragma unroll 1
      for (int w = wa; w < wb; ++w)
        mx = fmaxf(mx, reinterpret_cast<const float*>(smem + w * WARP_BYTES + HDR)[ML + 2 * head]);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      float den = 0.f;
      if (mx != NEG_INF) {
#pragma unroll 1
        for (int w = wa; w < wb; ++w) {  // warps in order
          const float* at = reinterpret_cast<const float*>(smem + w * WARP_BYTES + HDR);
          const float2 st = *reinterpret_cast<const float2*>(at + ML + 2 * head);
          const float sc = exp2_(st.x - mx);
          den += st.y * sc;
          add_scaled(acc, *reinterpret_cast<const float4*>(at + head * D + 4 * c4), sc);
        }
      }
      reinterpret_cast<float4*>(p.part_o + (part * p.rep + head) * D)[c4] = acc;
      if (c4 == 0) reinterpret_cast<float2*>(p.part_ml)[part * p.rep + head] = make_float2(mx, den);
    }
  }
#if FUSED_COMBINE
  fused_combine(p, smem, warp, lane, live, g0, g1);
#endif
}

// Query fragments of kv-head hk of row b (operand B of the score mma): column g = query head g; k pairs (c0, c2),
// (c1, c3) of word w = t*NKS + s (channels 4w..4w+3), as the K fragments pair them.
__device__ __forceinline__ void load_query(const Params& p, int b, int hk, int g, int t, u32 (&qb)[TILES][NKS][2]) {
  const u16* q0 = p.q + ((i64)b * p.heads * p.rep + (i64)hk * p.rep + g) * D;
#pragma unroll
  for (int T = 0; T < TILES; ++T)
#pragma unroll
    for (int sl = 0; sl < NKS; ++sl) {
      const int ch = T * C + 4 * (t * NKS + sl);
      const u32 q01 = g < p.rep ? *reinterpret_cast<const u32*>(q0 + ch) : 0u;
      const u32 q23 = g < p.rep ? *reinterpret_cast<const u32*>(q0 + ch + 2) : 0u;
      kpairs(q01, q23, qb[T][sl][0], qb[T][sl][1]);
    }
}
// Windows of the prepass lane's groups (channels (lane*GPL) % C ..) of kv-head hk, per K|V and tile, as given: the
// windows' starts (even for format 3, which halves them here).
__device__ __forceinline__ void load_bases(const Params& p, int hk, int lane, u32 (&b3)[2][TILES][GPL / 4],
                                           u32 (&b4)[2][TILES][GPL / 4]) {
#pragma unroll
  for (int kv = 0; kv < 2; ++kv)
#pragma unroll
    for (int T = 0; T < TILES; ++T)
#pragma unroll
      for (int w = 0; w < GPL / 4; ++w) {
        const i64 at = ((i64)kv * p.heads + hk) * D + T * C + (lane * GPL + 4 * w) % C;
        // the byte-split formats code e >> 1 against the even windows: half of each base, once per split
        const u32 x3 = GAAC_PLAIN ? 0u : *reinterpret_cast<const u32*>(p.base3 + at);
        const u32 x4 = GAAC_PLAIN ? 0u : *reinterpret_cast<const u32*>(p.base4 + at);
        b3[kv][T][w] = GAAC_FORMAT == 1 ? x3 : (x3 >> 1) & 0x7F7F7F7Fu;
        b4[kv][T][w] = GAAC_FORMAT == 1 ? x4 : (x4 >> 1) & 0x7F7F7F7Fu;
      }
}

extern "C" __global__ void __launch_bounds__(GAAC_WARPS * 32, GAAC_MIN_CTAS) gaac_decode_split(const Params p) {
  extern __shared__ __align__(128) u8 smem[];
  launch_dependents();
  grid_dependency_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int total = p.batch * p.heads * p.nsplit;
  const int item = blockIdx.x * GAAC_WARPS + warp;
  if (item >= total) return;

  u8* ws = smem + warp * WARP_BYTES;
  const u32 bars = smem_u32(ws);
  u8* ring = ws + HDR;
  Scratch scr;  // bases, planes 3..7 and raw masks of the slot being read, after the ring
  scratch_at(scr, ring + GAAC_STAGES * 2 * TILES * BUF_BYTES);
  if (lane == 0) {
#pragma unroll
    for (int st = 0; st < (SPLITBAR ? 2 : 1) * GAAC_STAGES; ++st)
      mbar_init(bars + 8 * st, 33);  // lane 0's expect_tx + 32 cp.async arrivals
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  u32 phases = 0;  // parity of each stage's barrier

  const int b = item / (p.heads * p.nsplit), hk = (item / p.nsplit) % p.heads, split = item % p.nsplit;
  if (GAAC_TRACE && lane == 0) {
    u32 sm;
    asm volatile("mov.u32 %0, %smid;" : "=r"(sm));
    p.trace[4 * item] = gtimer();
    p.trace[4 * item + 3] = sm;
  }

  const int* trow = p.table + (i64)b * p.table_sb;
  const int tstride = 2 * p.heads * TILES;
  const int len = p.kv_len[b];
  const int nb = len >> 4, tl = len & 15;
  const int units = nb + (tl > 0 ? 1 : 0);
  // the split's units: a contiguous range of ceil(units / nsplit), u0 .. u0 + n - 1
  const int per = (units + p.nsplit - 1) / p.nsplit;
  const int u0 = min(units, split * per), n = min(units, u0 + per) - u0;

  u32 qb[TILES][NKS][2];
  u32 b3[2][TILES][GPL / 4], b4[2][TILES][GPL / 4];
  load_query(p, b, hk, g, t, qb);
  load_bases(p, hk, lane, b3, b4);

  // the lane's first sign+mantissa chunk in a slot's buffer (issue_kv's 16-byte copies)
  const u32 sm_lane = (lane / (C / 16)) * SM_ROW + 16 * (lane % (C / 16));
  // rows of a BF16 tile: plain blocks at row 16u of the plain KV; the compressed tail at row 0 of the tail
  auto rows_src = [&](int kv, int u, int T) -> const u16* {
    const u16* base = kv ? p.kv_v : p.kv_k;
    const i64 row0 = GAAC_PLAIN ? (i64)16 * u : 0;
    return base + (i64)b * p.kv_sb + (i64)hk * p.kv_sh + row0 * p.kv_ss + T * C;
  };
  // compressed KV: where a raw tile (table entry ent < 0) lies in the raw pool
  auto raw_src = [&](int ent) -> const u8* {
    return reinterpret_cast<const u8*>(p.raw + (i64)(-1 - ent) * 16 * C);
  };
  // slot bits of each stage (SPLITBAR: K's, then V's); the barriers of stage st: bars + 8 st, and with
  // SPLITBAR K's at bars + 8 st, V's at bars + 8 (STAGES + st)
  volatile u32* kinds = reinterpret_cast<volatile u32*>(ws + 8 * (SPLITBAR ? 2 : 1) * GAAC_STAGES);
  auto entry = [&](int u, int kv, int T) -> int {
    return (GAAC_PLAIN || u >= nb) ? 0 : trow[(i64)u * tstride + (kv * p.heads + hk) * TILES + T];
  };
  // kind of a tile: 1 = slot, 0 = BF16 rows (raw tile, plain block, tail)
  // Stage copies of unit u into ring stage st. A slot: its sign+mantissa rows by 16-byte cp.async into rows padded
  // to C + 16 bytes (conflict-free fragment loads), its group section (planes, tags, escapes) by one bulk copy. A
  // raw tile: one 16 x 2C-byte bulk copy. Plain blocks and the tail: 16-byte cp.async per lane, rows past the valid
  // ones zero-filled. The stage's mbarrier completes on lane 0's expect_tx (bulk bytes) plus all 32 lanes' cp.async
  // arrivals. Per-lane offsets are fixed: chunk c = lane + 32 i of a tile is sign+mantissa row c / (C/16), column
  // c % (C/16), or BF16 row c / (C/8), column c % (C/8); the loops step by immediates.
  constexpr int SM_STEP = (32 / (C / 16)) * SM_ROW;  // buffer bytes between a lane's sign+mantissa chunks
  constexpr int BF_ROWS = 32 / (C / 8);              // BF16 rows between a lane's chunks
  const int bf_row = lane / (C / 8), bf_col = 16 * (lane % (C / 8));
  // SWZ: the fragment loads' swizzled offsets (sw), and the lane's chunk of BF16 row bf_row + BF_ROWS i lands at
  // swo[i % 4] + i BF_ROWS 2C (the swizzle depends on the row's 3 low bits, which repeat with i % 4)
  RowSwizzle sw;
#pragma unroll
  for (int s4 = 0; s4 < 2; ++s4)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int ck = (t * NKS + 4 * s4) / 2 + k;  // k_tile's words t NKS + 4 s4 .. + 7 of row g
      sw.k[s4][k] = SWZ ? (u32)(g * 2 * C + 16 * swz(g, ck % (C / 8))) : 0u;
      const int row = 2 * t + s4;                 // v_tile's rows 2t, 2t + 1, chunks (8 g NVW) / 16 + k
      const int cv = (g * NVW) / 2 + k;
      sw.v[s4][k] = SWZ ? (u32)(row * 2 * C + 16 * swz(row, cv % (C / 8))) : 0u;
    }
  u32 swo[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = bf_row + BF_ROWS * i;
    swo[i] = SWZ ? (u32)(row * 2 * C + 16 * swz(row, lane % (C / 8)) - i * BF_ROWS * 2 * C)
                 : (u32)(bf_row * 2 * C + bf_col);
  }
  // copies of tensors kv0 .. kv1 - 1 (0 = K, 1 = V) of unit u into stage st, completing on barrier `bar`, slot bits
  // into kinds[ki]
  auto issue_kv = [&](int u, int st, const int (&e)[2][TILES], int kv0, int kv1, u32 bar, int ki) {
    const bool tail = u >= nb;
#if FAST_ISSUE
    // the common unit (warp-uniform: every lane holds the same entries): K and V slots, lane 0's expect_tx and two
    // bulk copies, then 32 plain arrivals where the general path has 32 cp.async arrivals (no cp.async here); the
    // proxy fence stays (the warp-specialized producer without one overwrote a stage still being read, session 20)
    // (compressed KV on split barriers as well, each half issued alone, was measured slower in sessions 7 and 24)
    if (!tail && e[0][0] >= 0 && e[1][0] >= 0) {  // (kv0, kv1) = (0, 2): SPLITBAR is plain KV only
      if (lane == 0) kinds[ki] = 3u;
      fence_async();
      if (lane == 0) {
        const u32 dst = smem_u32(ring + st * 2 * BUF_BYTES);
        mbar_expect(bar, 2u * (u32)SLOT_BYTES);
        bulk_copy_once(dst, p.slots + (i64)e[0][0] * SLOT_BYTES, (u32)SLOT_BYTES, bar);
        bulk_copy_once(dst + BUF_BYTES, p.slots + (i64)e[1][0] * SLOT_BYTES, (u32)SLOT_BYTES, bar);
      }
      mbar_arrive(bar);
      return;
    }
#endif
    const int valid = tail ? tl : 16;
    // (plain blocks by bulk copy were measured slower than 16-byte cp.async per lane: 89.9 vs 87.0 us at 1x64K)
    const bool bulk_rows = !GAAC_PLAIN && !tail;
    u32 bytes = 0, slots = 0;
#pragma unroll
    for (int kv = kv0; kv < kv1; ++kv)
#pragma unroll
      for (int T = 0; T < TILES; ++T) {
        if (!GAAC_PLAIN && !tail && e[kv][T] >= 0) {
          bytes += (u32)(GAAC_DENSE_SLOT ? SLOT_BYTES : SLOT_BYTES - 16 * C);
          slots |= 1u << (kv * TILES + T);
        } else if (bulk_rows) {
          bytes += 32 * C;
        }
      }
    if (lane == 0) kinds[ki] = slots;  // read by the consumer after the stage's barrier (and a __syncwarp)
    fence_async();
    if (lane == 0) mbar_expect(bar, bytes);
#pragma unroll
    for (int kv = kv0; kv < kv1; ++kv)
#pragma unroll
      for (int T = 0; T < TILES; ++T) {
        u8* dst = ring + (st * 2 * TILES + kv * TILES + T) * BUF_BYTES;
        const int ent = e[kv][T];
        if (!GAAC_PLAIN && !tail && ent >= 0) {
          const u8* src = p.slots + (i64)ent * SLOT_BYTES;
          // (one bulk copy per sign+mantissa row, 16 lanes, was tried: a bulk copy takes uniform operands, so the
          // compiler issues the 16 copies one lane at a time, ~8 instructions each)
          // (16-byte cp.async per lane, L2 prefetches ahead of the ring and an L2 evict_first hint were measured
          // slower in session 19: benchmarks/results/copy_path_probe_s19.json)
          if (GAAC_DENSE_SLOT) {  // the whole slot as stored (rows dense: 2-way conflicts in the fragment loads)
            if (lane == kv * TILES + T) bulk_copy(smem_u32(dst), src, (u32)SLOT_BYTES, bar);
          } else {
            const u8* sl = src + 16 * lane;
            const u32 dl = smem_u32(dst) + sm_lane;
#pragma unroll
            for (int i = 0; i < C / 32; ++i) cp_async16(dl + i * SM_STEP, sl + 512 * i);
            if (lane == kv * TILES + T)
              bulk_copy(smem_u32(dst + SM_SECTION), src + 16 * C, (u32)(SLOT_BYTES - 16 * C), bar);
          }
        } else if (bulk_rows) {
          const u8* src = GAAC_PLAIN ? reinterpret_cast<const u8*>(rows_src(kv, u, T)) : raw_src(ent);
          if (lane == kv * TILES + T) bulk_copy(smem_u32(dst), src, 32 * C, bar);
        } else {
          const i64 row_bytes = 2 * p.kv_ss;
          const u8* sl = reinterpret_cast<const u8*>(rows_src(kv, u, T)) + bf_row * row_bytes + bf_col;
#pragma unroll
          for (int i = 0; i < C / 16; ++i) {
            u8* dl = dst + swo[i % 4] + i * BF_ROWS * 2 * C;
            if (bf_row + BF_ROWS * i < valid) cp_async16(smem_u32(dl), sl + i * BF_ROWS * row_bytes);
            else *reinterpret_cast<uint4*>(dl) = make_uint4(0, 0, 0, 0);
          }
        }
      }
    cp_async_arrive(bar);
  };
  // the whole stage on its one barrier, or (SPLITBAR) tensor kv's half on that half's barrier and slot bits
#if SPLITBAR
  auto issue_half = [&](int u, int st, const int (&e)[2][TILES], int kv) {
    issue_kv(u, st, e, kv, kv + 1, bars + 8 * (kv * GAAC_STAGES + st), kv * GAAC_STAGES + st);
  };
#else
  auto issue = [&](int u, int st, const int (&e)[2][TILES]) { issue_kv(u, st, e, 0, 2, bars + 8 * st, st); };
#endif

  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};  // of heads 2t, 2t+1 (l: this thread's tokens only)
  float o[TILES][NVM][4];  // O^T: rows = channels, columns = heads 2t, 2t+1
#pragma unroll
  for (int T = 0; T < TILES; ++T)
#pragma unroll
    for (int n = 0; n < NVM; ++n)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[T][n][c] = 0.f;

  // table entries are loaded one issue ahead, so no issue waits on a global load
#if LANE_ENTRIES
  // (LANE_ENTRIES) from the lanes' chunks: called for j = 0, 1, 2, ... in order, it moves to chunk j / 32 at j % 32 == 0
  // and loads the chunk after it, so each chunk's loads have 32 units to land
  auto chunk_entries = [&](int c, int& ek, int& ev) {
    const int jc = 32 * c + lane;
    ek = jc < n ? entry(u0 + jc, 0, 0) : 0;
    ev = jc < n ? entry(u0 + jc, 1, 0) : 0;
  };
  int cur_k, cur_v, nxt_k, nxt_v;
  chunk_entries(0, cur_k, cur_v);
  chunk_entries(1, nxt_k, nxt_v);
  auto load_entries = [&](int j, int (&e)[2][TILES]) {  // of the split's j-th unit
    if (j > 0 && (j & 31) == 0) {
      cur_k = nxt_k, cur_v = nxt_v;
      chunk_entries(j / 32 + 1, nxt_k, nxt_v);
    }
    e[0][0] = __shfl_sync(~0u, cur_k, j & 31);
    e[1][0] = __shfl_sync(~0u, cur_v, j & 31);
  };
#else
  auto load_entries = [&](int j, int (&e)[2][TILES]) {  // of the split's j-th unit
#pragma unroll
    for (int kv = 0; kv < 2; ++kv)
#pragma unroll
      for (int T = 0; T < TILES; ++T) e[kv][T] = j < n ? entry(u0 + j, kv, T) : 0;
  };
#endif
  int ent[2][TILES];
  load_entries(0, ent);
#if SPLITBAR
  // stage st's V half re-issued with the split's unit j + STAGES (its last reader is done)
  auto reissue_v = [&](int j, int st) {
    if (j + GAAC_STAGES < n) {
      issue_half(u0 + (j + GAAC_STAGES), st, ent, 1);
      load_entries(j + GAAC_STAGES + 1, ent);
    }
  };
#endif
  const u8* mrow = p.mask ? p.mask + (i64)b * p.mask_sb : nullptr;
  constexpr bool DECODE = !GAAC_PLAIN && !(GAAC_SKIP & 2);

  // one loop for the prologue and the steady state: iteration j issues the split's unit j + STAGES - 1, then
  // consumes its unit j. SPLITBAR: the prologue issues units 0 .. STAGES - 1 and iteration j re-issues the
  // K (V) half of its stage with unit j + STAGES as soon as its K (V) tile is read, so a stage's K copies are in
  // flight while its V tile is still being consumed.
  // the mask bytes of the units in the ring, oldest first, loaded as their copies are issued (padding masks only)
  UnitMask mq[GAAC_STAGES];
  auto queue_mask = [&](int i, int j) {  // mq[i] = the mask bytes of the split's j-th unit
    if (mrow) mq[i] = unit_mask(mrow, u0 + j, g, u0 + j >= nb ? tl : 16);
  };
#pragma unroll
  for (int i = 0; i < GAAC_STAGES; ++i) mq[i] = {1u, 1u};
#if SPLITBAR
#pragma unroll
  for (int i = 0; i < GAAC_STAGES; ++i) {
    if (i < n) {
      issue_half(u0 + i, i, ent, 0);
      issue_half(u0 + i, i, ent, 1);
      load_entries(i + 1, ent);
      queue_mask(i, i);
    }
  }
  for (int j = 0; j < n; ++j) {
#else
  for (int j = -(GAAC_STAGES - 1); j < n; ++j) {
    const int next = j + GAAC_STAGES - 1;
#pragma unroll
    for (int i = 0; i + 1 < GAAC_STAGES; ++i) mq[i] = mq[i + 1];
    if (next < n) {
      issue(u0 + next, next % GAAC_STAGES, ent);
      load_entries(next + 1, ent);
      queue_mask(GAAC_STAGES - 1, next);
    }
    if (j < 0) continue;
#endif
    const int u = u0 + j;
    const int st = j % GAAC_STAGES;
    if (!GAAC_PLAIN && !LANE_ENTRIES && lane == 0 && u + 8 < nb)
      asm volatile("prefetch.global.L1 [%0];" ::"l"(trow + (i64)(u + 8) * tstride));
    mbar_wait(bars + 8 * st, (phases >> st) & 1);
#if SPLITBAR
    mbar_wait(bars + 8 * (GAAC_STAGES + st), (phases >> st) & 1);
    const u32 slots_here = kinds[st] | kinds[GAAC_STAGES + st];
#else
    const u32 slots_here = kinds[st];
#endif
    phases ^= 1u << st;
    if (GAAC_TRACE && lane == 0 && j == 0) p.trace[4 * item + 1] = gtimer();
    const bool tail = u >= nb;
    const int valid = tail ? tl : 16;

    // mode tags and escape offsets of the unit's slots: one scan for the K and V tile of each T
    LaneTags tk[TILES], tv[TILES];
#pragma unroll
    for (int T = 0; T < TILES; ++T) {
      tk[T].wb = tk[T].rb = tv[T].wb = tv[T].rb = 0;
      if (DECODE && (slots_here & ((1u << T) | (1u << (TILES + T))))) {
        if ((slots_here >> T) & 1) load_tags(p, ring + (st * 2 * TILES + T) * BUF_BYTES, lane, tk[T]);
        if ((slots_here >> (TILES + T)) & 1)
          load_tags(p, ring + (st * 2 * TILES + TILES + T) * BUF_BYTES, lane, tv[T]);
        if (GAAC_SKIP & 32) tk[T].off = tv[T].off = 0, tk[T].any_raw = tv[T].any_raw = false;
        else scan_tags(tk[T], tv[T], lane);
      }
    }

    const bool pre = !(GAAC_SKIP & 16) && (!(GAAC_SKIP & 64) || j == 0);  // (breakdown options leave it out)

    // S^T (even, odd k-slices): tokens g, g + 8 x heads 2t, 2t + 1
    float sc2[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
    for (int T = 0; T < TILES; ++T) {
      const u8* buf = ring + (st * 2 * TILES + T) * BUF_BYTES;
      if (GAAC_SKIP & 128) {  // (breakdown) one word of the tile read, as the copy-pipeline probe reads
        sc2[0][0] = __uint_as_float(lds(buf + 4 * lane) & 0x3f000000u);
      } else if (DECODE && ((slots_here >> T) & 1)) {
        if (pre) prepass(p, buf, scr, b3[0][T], b4[0][T], lane, tk[T]);
        __syncwarp();
        k_tile<4>(p, buf, scr, g, t, qb[T], sc2, tk[T].any_raw, sw);
        __syncwarp();
      } else {
        k_tile<0>(p, buf, scr, g, t, qb[T], sc2, false, sw);
      }
    }
#if SPLITBAR
    __syncwarp();  // every lane has read the stage's K tiles
    if (j + GAAC_STAGES < n) issue_half(u0 + (j + GAAC_STAGES), st, ent, 0);
#endif
    // online softmax (base 2) of heads 2t, 2t+1 over the 16 tokens, then the output rescaled if the max moved
    u32 pb[2] = {__float_as_uint(sc2[0][0]), 0u};
    float alpha[2];
    if (!(GAAC_SKIP & 256)) {  // (breakdown: bit 8 leaves the softmax and the rescale out)
      softmax_unit(sc2, p.qk_scale, valid, mrow != nullptr, mq[0], g,
                   m, l, alpha, pb);
      rescale_o(o, alpha);
    }
#pragma unroll
    for (int T = 0; T < TILES; ++T) {
      const u8* buf = ring + (st * 2 * TILES + TILES + T) * BUF_BYTES;
      if (GAAC_SKIP & 128) {
        o[T][0][0] += __uint_as_float((lds(buf + 4 * lane) ^ pb[0]) & 0x3f000000u);
      } else if (DECODE && ((slots_here >> (TILES + T)) & 1)) {
        if (pre) prepass<true>(p, buf, scr, b3[1][T], b4[1][T], lane, tv[T]);
        __syncwarp();
        v_tile<4>(p, buf, scr, g, t, pb, o[T], tv[T].any_raw, sw);
        __syncwarp();
      } else {
        v_tile<0>(p, buf, scr, g, t, pb, o[T], false, sw);
      }
    }
    __syncwarp();
#if SPLITBAR
    reissue_v(j, st);
#pragma unroll
    for (int i = 0; i + 1 < GAAC_STAGES; ++i) mq[i] = mq[i + 1];
    if (j + GAAC_STAGES < n) queue_mask(GAAC_STAGES - 1, j + GAAC_STAGES);
#endif
  }

  // partial results of this split, or (GAAC_CTA_MERGE) of the CTA's splits of each group
#if CTA_MERGE
  cta_merge(p, smem, warp, lane, g, t, m, l, o);
#else
  write_ml(p, item, g, t, m, l);
  if (GAAC_STAGED_O) write_o_staged(p, item, g, t, o, reinterpret_cast<float*>(ring));  // (every unit waited for)
  else write_o(p, item, g, t, o);
#endif
  if (GAAC_TRACE && lane == 0) p.trace[4 * item + 2] = gtimer();
}

// out[b, hq, 32c .. 32c + 31] = merge of the nsplit partials of (b, hq) for one chunk c of 32 channels. One block of
// COMBINE_WARPS warps per (row, query head, chunk) (lane = channel): warp w takes splits w, w + COMBINE_WARPS, ...,
// COMBINE_UNROLL of them per round with all their loads in flight (one round up to 256 splits), merged into the warp's
// running max / sum / denominator; then warp 0 merges the warps in a fixed order (the same bits for compressed KV and
// its plain twin). One dependent round of global loads instead of a max pass and a sum pass.
#ifndef GAAC_COMBINE_WARPS  // warps per combine block (the plan's combine_warps; the launch's block size)
#define GAAC_COMBINE_WARPS 16
#endif
#define COMBINE_WARPS GAAC_COMBINE_WARPS
#define COMBINE_UNROLL 16
extern "C" __global__ void __launch_bounds__(COMBINE_WARPS * 32) gaac_combine(const Params p) {
  __shared__ float red[COMBINE_WARPS][2];
  __shared__ float part[COMBINE_WARPS][32];
  grid_dependency_wait();  // the split kernel's partials
  constexpr int CHUNKS = D / 32;
  const int chunk = blockIdx.x % CHUNKS, hq = (blockIdx.x / CHUNKS) % (p.heads * p.rep);
  const int b = blockIdx.x / (CHUNKS * p.heads * p.rep);
  const int hk = hq / p.rep, r = hq % p.rep;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int ch = 32 * chunk + lane;
  if (GAAC_TRACE && threadIdx.x == 0) p.trace[4 * (i64)p.batch * p.heads * p.nsplit + blockIdx.x] = gtimer();
  const int grp = b * p.heads + hk;
#if CTA_MERGE  // one partial per CTA that held splits of (b, hk), in CTA order
  const i64 item0 = (i64)grp * cta_parts_cap(p);
  const int nparts = last_cta(p, grp) - first_cta(p, grp) + 1;
#else
  const i64 item0 = (i64)grp * p.nsplit;
  const int nparts = p.nsplit;
#endif
  float mw = NEG_INF, acc = 0.f, den = 0.f;
  for (int s0 = warp; s0 < nparts; s0 += COMBINE_WARPS * COMBINE_UNROLL) {
    float ml[COMBINE_UNROLL][2], po[COMBINE_UNROLL];
    {  // the partials' loads from two running pointers, one float2 per partial's statistics (82 registers; an index
      // per load took 121 and was 0.3-0.7 us slower, session 22)
      const i64 row0 = (item0 + s0) * p.rep + r, step = (i64)COMBINE_WARPS * p.rep;
      const float2* mp = reinterpret_cast<const float2*>(p.part_ml) + row0;
      const float* op = p.part_o + row0 * D + ch;
#pragma unroll
      for (int k = 0; k < COMBINE_UNROLL; ++k) {
        const bool in = s0 + k * COMBINE_WARPS < nparts;
        const float2 x = in ? mp[k * step] : make_float2(NEG_INF, 0.f);
        ml[k][0] = x.x;
        ml[k][1] = x.y;
        po[k] = in ? op[k * step * D] : 0.f;
      }
    }
    float mx = mw;
#pragma unroll
    for (int k = 0; k < COMBINE_UNROLL; ++k) mx = fmaxf(mx, ml[k][0]);
    if (mx != NEG_INF) {  // warp-uniform: every lane reads the same splits' statistics
      const float a = exp2_(mw - mx);
      acc *= a;
      den *= a;
#pragma unroll
      for (int k = 0; k < COMBINE_UNROLL; ++k) {  // splits in increasing order
        const float w = exp2_(ml[k][0] - mx);
        den += ml[k][1] * w;
        acc += po[k] * w;
      }
      mw = mx;
    }
  }
  part[warp][lane] = acc;
  if (lane == 0) red[warp][0] = mw, red[warp][1] = den;
  __syncthreads();
  if (warp == 0) {
    float mx = NEG_INF;
#pragma unroll
    for (int w = 0; w < COMBINE_WARPS; ++w) mx = fmaxf(mx, red[w][0]);
    float a = 0.f, l = 0.f;
    if (mx != NEG_INF) {
#pragma unroll
      for (int w = 0; w < COMBINE_WARPS; ++w) {
        const float sc = exp2_(red[w][0] - mx);
        a += part[w][lane] * sc;
        l += red[w][1] * sc;
      }
    }
    const float y = l > 0.f ? a / l : 0.f;
    u16 bits;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(bits) : "f"(y));
    p.out[((i64)b * p.heads * p.rep + hq) * D + ch] = bits;
  }
}
