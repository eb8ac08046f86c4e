"""Device-side reconstruction of GAAC tiles, shared by the tile expansion (`gaac_decode.expand_tiles`)
and the fused attention kernels. The slot's section offsets come from the caller (`triton_ops.layout`).

Bitstream: docs/format.md (format version 1). The kernels work on 32-bit words of four consecutive channels, so one
integer instruction handles four elements:

* `chunk_words` reads, for NB blocks of one (batch row, K|V, kv-head, tile), everything a group shares, as
  `[NB, C/2]` uint32 words (word w holds groups 4w..4w+3 of the tile, one per byte lane): code planes 0-7 (planes
  0-2 straight from the slot; plane 3 and planes 4-7 gathered from the escape area at offsets from an exclusive
  prefix sum over the mode tags) and the bases (base3, base4 or 0 by mode).
* `token_rows` then builds token `I` of both halves of every block (`[2NB, C]` BF16). With I a compile-time
  constant, bit I of plane p moves to bit p of each byte lane with one constant shift and one masked OR, the base is
  one add (no lane overflows: a code plus its base is the exponent, at most 255), and two byte permutes per pair of
  channels merge exponents with the stored sign+mantissa bytes into BF16 pairs (`prmt` on the GPU; the same
  function in plain integer operations under the Triton interpreter).

Raw tiles (entry < 0) are read as BF16 pairs from the raw pool in the same shapes, so compressed and plain KV go
through the same code from the merged words on.
"""

import triton
import triton.language as tl

LANE0 = tl.constexpr(0x01010101)  # bit 0 of each byte lane


@triton.jit
def _w(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _spread4(n):
    """Bits 0-3 of `n` -> bit 0 of byte lanes 0-3 (the partial products land on distinct bits: no carries)."""
    return (n * 0x00204081) & LANE0


@triton.jit
def chunk_words(slot_ptr, slot_w_ptr, entry, live, b3w, b4w, SLOT_BYTES, C: tl.constexpr, PLANES: tl.constexpr,
                TAGS: tl.constexpr, ESC: tl.constexpr):
    """Group-level words of the slot tiles at `entry` `[NB, 1]` (`live`: take part and are slots).

    `slot_ptr` / `slot_w_ptr`: the slot pool as bytes / as int32 words. `b3w`, `b4w` `[1, C/2]` uint32: the bases of
    the tile's channels for each word (channel `(4w) % C`). PLANES, TAGS, ESC: the slot layout's byte offsets of
    the code planes, the mode tags and the escape area (from the caller: `triton_ops.layout`). Returns planes
    P0..P7, the base word and whether any group is raw (planes 4-7 are zero otherwise)."""
    GW: tl.constexpr = C // 2  # words per tile row of groups (G = 2C groups, 4 per word)
    G: tl.constexpr = 2 * C
    w = tl.arange(0, GW)[None, :]
    slot = tl.where(live, entry, 0).to(tl.int64)
    sw = slot_w_ptr + slot * (SLOT_BYTES // 4)  # [NB, 1]
    p0 = _w(sw + PLANES // 4 + w, live)
    p1 = _w(sw + (PLANES + G) // 4 + w, live)
    p2 = _w(sw + (PLANES + 2 * G) // 4 + w, live)
    sh = ((w % 8) * 4).to(tl.uint32)  # groups 4w..4w+3 are bits 4(w%8).. of tag word w//8
    wide = _spread4((_w(sw + TAGS // 4 + w // 8, live) >> sh) & 0xF)
    raw = _spread4((_w(sw + (TAGS + G // 8) // 4 + w // 8, live) >> sh) & 0xF)
    lanes = wide + 4 * raw  # escape bytes of each group (0, 1 or 5) in its byte lane
    total = (lanes * LANE0) >> 24
    first = tl.cumsum(total, axis=1) - total  # escape offset of the word's first group
    before = lanes * 0x01010100  # byte k: escape bytes of lanes < k of the word
    esc = slot_ptr + slot * SLOT_BYTES + ESC + first  # [NB, GW]
    p3 = tl.zeros_like(p0)
    for k in tl.static_range(4):
        on = live & (((wide >> (8 * k)) & 1) == 1)
        p3 |= tl.load(esc + ((before >> (8 * k)) & 0xFF), mask=on, other=0).to(tl.uint32) << (8 * k)
    keep = (wide * 0xFF) ^ 0xFFFFFFFF
    base = ((b3w & keep) | (b4w & (wide * 0xFF))) & ((raw * 0xFF) ^ 0xFFFFFFFF)
    p4 = tl.zeros_like(p0)
    p5 = tl.zeros_like(p0)
    p6 = tl.zeros_like(p0)
    p7 = tl.zeros_like(p0)
    has_raw = tl.max(tl.max(raw, axis=1), axis=0) > 0
    if has_raw:
        for k in tl.static_range(4):
            on = live & (((raw >> (8 * k)) & 1) == 1)
            at = esc + ((before >> (8 * k)) & 0xFF)
            p4 |= tl.load(at + 1, mask=on, other=0).to(tl.uint32) << (8 * k)
            p5 |= tl.load(at + 2, mask=on, other=0).to(tl.uint32) << (8 * k)
            p6 |= tl.load(at + 3, mask=on, other=0).to(tl.uint32) << (8 * k)
            p7 |= tl.load(at + 4, mask=on, other=0).to(tl.uint32) << (8 * k)
    return p0, p1, p2, p3, p4, p5, p6, p7, base, has_raw


@triton.jit
def _bit(p, I: tl.constexpr, P: tl.constexpr):
    """Bit I of every byte lane of plane word `p`, moved to bit P of the lane."""
    if I >= P:
        x = p >> (I - P)
    else:
        x = p << (P - I)
    return x & (LANE0 << P)


@triton.jit
def _merge(s, e, ASM: tl.constexpr):
    """Sign+mantissa bytes `s` and exponent bytes `e` of four channels -> two words of BF16 pairs."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            """
            {
            .reg .b32 a, b, z;
            mov.b32 z, 0;
            prmt.b32 a, $2, z, 0x1100;
            prmt.b32 b, $3, z, 0x1404;
            shr.b32 b, b, 1;
            lop3.b32 $0, a, 0x807F807F, b, 0xEA;
            prmt.b32 a, $2, z, 0x3322;
            prmt.b32 b, $3, z, 0x3424;
            shr.b32 b, b, 1;
            lop3.b32 $1, a, 0x807F807F, b, 0xEA;
            }
            """, "=r,=r,r,r", [s, e], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        lo = (((s & 0xFF) | ((s & 0xFF00) << 8)) * 0x101 & 0x807F807F) \
            | (((e & 0xFF) | ((e & 0xFF00) << 8)) << 7)
        hi = ((((s >> 16) & 0xFF) | ((s >> 8) & 0xFF0000)) * 0x101 & 0x807F807F) \
            | ((((e >> 16) & 0xFF) | ((e >> 8) & 0xFF0000)) << 7)
    return lo, hi


@triton.jit
def slot_row_words(slot_w_ptr, entry, in_slot, SLOT_BYTES, I: tl.constexpr, NB: tl.constexpr, C: tl.constexpr):
    """Sign+mantissa words `[NB, C/2]` of token I of both halves of the slot tiles at `entry` (zero elsewhere)."""
    GW: tl.constexpr = C // 2
    QW: tl.constexpr = C // 4  # words per token row of a tile
    w = tl.arange(0, GW)[None, :]
    slot = tl.where(in_slot, entry, 0).to(tl.int64)
    return _w(slot_w_ptr + slot * (SLOT_BYTES // 4) + ((w // QW) * 8 + I) * QW + w % QW, in_slot)


@triton.jit
def token_rows(slot_w_ptr, raw_w_ptr, entry, live, in_slot, in_raw, any_slot, any_raw,
               p0, p1, p2, p3, p4, p5, p6, p7, base, has_raw, SLOT_BYTES, RAW_TILE, RAW_ROW,
               I: tl.constexpr, NB: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr, RECON: tl.constexpr,
               s=None):
    """BF16 `[2NB, C]`: token I of half 0 (even rows) and half 1 (odd rows) of each of the NB blocks.

    Row `2j + h` is token `8h + I` of block j. `s`: this slice's `slot_row_words`, if already loaded. Raw tiles are
    read at `raw + index * RAW_TILE + t * RAW_ROW + c` (BF16 elements; `raw_w_ptr` is the raw pool as int32 words)."""
    GW: tl.constexpr = C // 2
    QW: tl.constexpr = C // 4
    w = tl.arange(0, GW)[None, :]
    lo = tl.zeros([NB, GW], tl.uint32)
    hi = tl.zeros([NB, GW], tl.uint32)
    if s is None:
        s = slot_row_words(slot_w_ptr, entry, in_slot, SLOT_BYTES, I, NB, C)
    if any_slot:
        if RECON:
            e = _bit(p0, I, 0) | _bit(p1, I, 1) | _bit(p2, I, 2) | _bit(p3, I, 3)
            if has_raw:
                e |= _bit(p4, I, 4) | _bit(p5, I, 5) | _bit(p6, I, 6) | _bit(p7, I, 7)
            lo, hi = _merge(s, e + base, ASM)
        else:  # benchmark variant: the same words read, no per-element reconstruction
            lo = s ^ p0 ^ p2 ^ base
            hi = s ^ p1 ^ p3
    if any_raw:
        ri = tl.where(in_raw, -1 - entry, 0).to(tl.int64)
        at = raw_w_ptr + ri * (RAW_TILE // 2) + ((w // QW) * 8 + I) * (RAW_ROW // 2) + (w % QW) * 2
        lo = tl.where(in_raw, _w(at, in_raw), lo)
        hi = tl.where(in_raw, _w(at + 1, in_raw), hi)
    pairs = tl.reshape(tl.join(lo, hi), [NB, C])  # word j: channels 2j, 2j + 1 in group order
    halves = tl.join((pairs & 0xFFFF).to(tl.uint16), (pairs >> 16).to(tl.uint16))
    return tl.reshape(halves, [2 * NB, C]).to(tl.bfloat16, bitcast=True)


@triton.jit
def _prefetch_l2(ptrs, on):
    """`prefetch.global.L2` of the lines at `ptrs` where `on`: the bytes start moving without holding registers."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        "=r,l,r", [ptrs, on.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_tiles(slot_ptr, raw_ptr, entry, live, SLOT_BYTES, RAW_TILE, RAW_ROW, C: tl.constexpr,
                   SLOT_LINES: tl.constexpr):
    """Ask L2 for every 128-byte line of the tiles at `entry` `[NB, 1]` (slot or raw, as the entry says)."""
    k = tl.arange(0, SLOT_LINES)[None, :]
    slot = tl.where(live & (entry >= 0), entry, 0).to(tl.int64)
    _prefetch_l2(slot_ptr + slot * SLOT_BYTES + k * 128, live & (entry >= 0) & (k * 128 < SLOT_BYTES))
    LPR: tl.constexpr = (2 * C) // 128  # lines per BF16 row of the tile (C = 64 or 128)
    r = tl.arange(0, 16 * LPR)[None, :]
    ri = tl.where(live & (entry < 0), -1 - entry, 0).to(tl.int64)
    at = raw_ptr + ri * RAW_TILE + (r // LPR) * RAW_ROW + (r % LPR) * 64  # raw_ptr: BF16 elements
    _prefetch_l2(at, live & (entry < 0))
