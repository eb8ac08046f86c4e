"""Device-side reconstruction of GAAC tiles, shared by the decode and the fused attention kernels.

Bitstream: docs/format.md (format version 1). `tile_rows` returns the BF16 rows of NB consecutive 16-token blocks of
one (batch row, K|V, kv-head, tile) as `[2 * NB, 8, C]`: axis 0 is a group row (block `q // 2`, half `q % 2`),
axis 1 the token within the half block (the element of the group), axis 2 the channel. In that shape everything a
group shares (its code-plane bytes, mode, base and escape bytes) is a `[2 * NB, 1, C]` tensor that broadcasts over
axis 1 without moving data, and the per-element work is a handful of 32-bit integer operations:

    x    = (word >> i) & 0x01010101          word: code planes 0-3 of the group in bytes 0-3; i: element index
    e24  = x * 0x01020408 + (base << 24)     the multiply gathers bits 0, 8, 16, 24 into bits 24-27
    bf16 = (sm * 0x101) & 0x807F | (e24 >> 17) & 0x7F80

(`sm * 0x101` puts the sign at bit 15 and the mantissa at bits 0-6.) Raw groups, rare, add planes 4-7 the same way
in a branch taken only when the NB blocks hold one. The exclusive prefix sum of escape bytes is done per group.
"""

import triton
import triton.language as tl

GATHER = 0x01020408  # bits 0, 8, 16, 24 of a word -> bits 24, 25, 26, 27 of the product (no carries)


@triton.jit
def _u32(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.uint32)


@triton.jit
def _slot_rows(slot_ptr, entry, live, b3, b4, SLOT_BYTES, NB: tl.constexpr, C: tl.constexpr,
               RECON: tl.constexpr):
    """BF16 bits (uint32) `[2NB, 8, C]` of slot tiles; `entry`, `live` `[2NB, 1, 1]`; `b3`, `b4` uint32 `[1, 1, C]`."""
    G: tl.constexpr = 2 * C
    PLANES: tl.constexpr = 16 * C
    TAGS: tl.constexpr = PLANES + 3 * G
    TAG_PLANE: tl.constexpr = G // 8
    ESC: tl.constexpr = TAGS + 2 * TAG_PLANE
    gq = tl.arange(0, 2 * NB)[:, None, None]
    i = tl.arange(0, 8)[None, :, None].to(tl.uint32)
    c = tl.arange(0, C)[None, None, :]
    half = gq % 2
    base = slot_ptr + tl.where(live, entry, 0).to(tl.int64) * SLOT_BYTES  # [2NB, 1, 1]
    g = half * C + c  # group index within the tile, [2NB, 1, C]
    word = _u32(base + PLANES + g, live) | (_u32(base + PLANES + G + g, live) << 8) \
        | (_u32(base + PLANES + 2 * G + g, live) << 16)
    sh = (g % 8).to(tl.uint32)
    wide = (_u32(base + TAGS + g // 8, live) >> sh) & 1
    raw = (_u32(base + TAGS + TAG_PLANE + g // 8, live) >> sh) & 1
    w = wide + 4 * raw  # escape bytes of each group: 0, 1 or 5
    # escape bytes of all half-0 groups of the block, needed by its half-1 row
    c0 = c + 0 * half
    sh0 = (c0 % 8).to(tl.uint32)
    w0 = ((_u32(base + TAGS + c0 // 8, live) >> sh0) & 1) + 4 * ((_u32(base + TAGS + TAG_PLANE + c0 // 8, live) >> sh0) & 1)
    off = tl.cumsum(w, axis=2) - w + half.to(tl.uint32) * tl.sum(w0, axis=2, keep_dims=True)
    esc = base + ESC + off
    word |= _u32(esc, live & (wide == 1)) << 24
    sm = _u32(base + (half * 8 + i) * C + c, live)  # [2NB, 8, C]
    if RECON:
        bias = tl.where(raw == 1, 0, tl.where(wide == 1, b4, b3)) << 24
        e24 = ((word >> i) & 0x01010101) * GATHER + bias
        if tl.max(tl.max(tl.max(raw, axis=2), axis=1), axis=0) > 0:  # planes 4-7 of raw groups
            m = live & (raw == 1)
            word2 = _u32(esc + 1, m) | (_u32(esc + 2, m) << 8) | (_u32(esc + 3, m) << 16) | (_u32(esc + 4, m) << 24)
            e24 += (((word2 >> i) & 0x01010101) * GATHER) << 4
        bits = ((sm * 0x101) & 0x807F) | ((e24 >> 17) & 0x7F80)
    else:  # benchmark variant: the same bytes read, no per-element reconstruction
        mix = word ^ (word >> 8) ^ (word >> 16) ^ (word >> 24)
        bits = sm | ((mix & 0x3F) << 8)
    return bits


@triton.jit
def tile_rows(slot_ptr, raw_ptr, entry, live, b3, b4, SLOT_BYTES, RAW_TILE, RAW_ROW,
              NB: tl.constexpr, C: tl.constexpr, RECON: tl.constexpr = True):
    """BF16 `[2NB, 8, C]` rows of NB blocks whose tile-table entries are `entry` `[2NB, 1, 1]` (one per group row;
    `live`: the block exists).

    `b3`, `b4` `[1, 1, C]` uint32: the bases of this (K|V, head, tile). A slot tile (entry >= 0) is decoded; a raw
    tile (entry < 0, raw index `-1 - entry`) is read at `raw_ptr + index * RAW_TILE + t * RAW_ROW + c` (elements).
    Slot and raw geometry are run-time values, so the kernel compiled for compressed KV is the very one that reads
    plain KV presented as raw tiles.
    """
    gq = tl.arange(0, 2 * NB)[:, None, None]
    i = tl.arange(0, 8)[None, :, None]
    c = tl.arange(0, C)[None, None, :]
    in_slot = live & (entry >= 0)
    in_raw = live & (entry < 0)
    out = tl.zeros([2 * NB, 8, C], tl.bfloat16)
    if tl.max(tl.max(tl.max(in_slot.to(tl.int32), axis=2), axis=1), axis=0) > 0:
        bits = _slot_rows(slot_ptr, entry, in_slot, b3, b4, SLOT_BYTES, NB, C, RECON)
        out = bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    if tl.max(tl.max(tl.max(in_raw.to(tl.int32), axis=2), axis=1), axis=0) > 0:
        rb = tl.where(in_raw, -1 - entry, 0).to(tl.int64) * RAW_TILE
        rows = ((gq % 2) * 8 + i).to(tl.int64) * RAW_ROW
        rawv = tl.load(raw_ptr + rb + rows + c, mask=in_raw, other=0.0)
        out = tl.where(in_raw, rawv, out)
    return out
