"""Device-side reconstruction of GAAC tiles, shared by the decode and the fused attention kernels.

Bitstream: docs/format.md (format version 1). `load_kv_rows` returns BF16 rows of NB consecutive 16-token blocks of
one (batch row, K|V, kv-head, tile), from slots (GAAC code, decoded in registers) or raw BF16 tiles, as the block
table says. Everything a group shares (its three code-plane bytes, its mode, its escape bytes) is loaded once per
group and broadcast to the group's 8 token rows; per element there is one byte load and a few shifts.
"""

import triton
import triton.language as tl


@triton.jit
def _to_rows(x, NB: tl.constexpr, C: tl.constexpr):
    """`[2 * NB, C]` per (block, half) -> `[16 * NB, C]` per token row (each half-block row repeated 8 times)."""
    return tl.reshape(tl.broadcast_to(tl.reshape(x, [2 * NB, 1, C]), [2 * NB, 8, C]), [16 * NB, C])


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def load_kv_rows(slot_ptr, raw_ptr, entry, ok, b3, b4, SLOT_BYTES, RAW_TILE, RAW_ROW,
                 NB: tl.constexpr, C: tl.constexpr):
    """BF16 `[16 * NB, C]` for NB blocks whose tile table entries are `entry` `[NB]` (`ok` `[NB]`: block exists).

    `b3`, `b4` `[C]` int32: the bases of this (K|V, head, tile). A slot tile (entry >= 0) is decoded; a raw tile
    (entry < 0, raw index `-1 - entry`) is read at `raw_ptr + index * RAW_TILE + t * RAW_ROW + c` (elements).
    Slot and raw geometry are run-time values, so the kernel compiled for compressed KV is the very one that reads
    plain KV presented as raw tiles.
    """
    G: tl.constexpr = 2 * C
    PLANES: tl.constexpr = 16 * C
    TAGS: tl.constexpr = PLANES + 3 * G
    TAG_PLANE: tl.constexpr = G // 8
    ESC: tl.constexpr = TAGS + 2 * TAG_PLANE
    c = tl.arange(0, C)
    r = tl.arange(0, 16 * NB)  # token rows: block r // 16, token r % 16
    gr = tl.arange(0, 2 * NB)  # group rows: block gr // 2, half gr % 2

    # per group row (block, half)
    e_g = tl.reshape(tl.broadcast_to(tl.reshape(entry, [NB, 1]), [NB, 2]), [2 * NB])
    ok_g = tl.reshape(tl.broadcast_to(tl.reshape(ok, [NB, 1]), [NB, 2]), [2 * NB])
    slot_g = (e_g >= 0) & ok_g
    raw_g = (e_g < 0) & ok_g
    e_r = tl.reshape(tl.broadcast_to(tl.reshape(entry, [NB, 1]), [NB, 16]), [16 * NB])
    ok_r = tl.reshape(tl.broadcast_to(tl.reshape(ok, [NB, 1]), [NB, 16]), [16 * NB])
    out = tl.zeros([16 * NB, C], tl.bfloat16)

    if tl.max(slot_g.to(tl.int32), axis=0) > 0:
        ms = slot_g[:, None]
        base = tl.where(slot_g, e_g, 0).to(tl.int64)[:, None] * SLOT_BYTES  # [2NB, 1]
        half = (gr % 2)[:, None]
        g = half * C + c[None, :]  # group index within the tile
        word = _byte(slot_ptr + base + PLANES + g, ms) \
            | (_byte(slot_ptr + base + PLANES + G + g, ms) << 8) \
            | (_byte(slot_ptr + base + PLANES + 2 * G + g, ms) << 16)
        wide = (_byte(slot_ptr + base + TAGS + g // 8, ms) >> (g % 8)) & 1
        raw = (_byte(slot_ptr + base + TAGS + TAG_PLANE + g // 8, ms) >> (g % 8)) & 1
        w = wide + 4 * raw  # escape bytes of each group: 0, 1 or 5
        c0 = c[None, :] + 0 * half
        w0 = ((_byte(slot_ptr + base + TAGS + c0 // 8, ms) >> (c0 % 8)) & 1) \
            + 4 * ((_byte(slot_ptr + base + TAGS + TAG_PLANE + c0 // 8, ms) >> (c0 % 8)) & 1)
        # exclusive prefix sum of escape bytes in group order (half 1 follows all of half 0)
        off = tl.cumsum(w, axis=1) - w + tl.where(half == 1, tl.sum(w0, axis=1)[:, None], 0)
        esc = slot_ptr + base + ESC + off
        word |= _byte(esc, ms & (wide == 1)) << 24
        bias = tl.where(raw == 1, 0, tl.where(wide == 1, b4[None, :], b3[None, :]))

        i = (r % 8)[:, None]
        x = _to_rows(word, NB, C) >> i  # bit p of the code now at bit 8p
        code = (x & 1) | ((x >> 7) & 2) | ((x >> 14) & 4) | ((x >> 21) & 8)
        if tl.max(tl.max(raw, axis=1), axis=0) > 0:  # planes 4-7 of raw groups
            word2 = _byte(esc + 1, ms & (raw == 1)) | (_byte(esc + 2, ms & (raw == 1)) << 8) \
                | (_byte(esc + 3, ms & (raw == 1)) << 16) | (_byte(esc + 4, ms & (raw == 1)) << 24)
            y = _to_rows(word2, NB, C) >> i
            code |= ((y & 1) << 4) | ((y >> 3) & 0x20) | ((y >> 10) & 0x40) | ((y >> 17) & 0x80)
        e = (code + _to_rows(bias, NB, C)) & 0xFF
        rbase = tl.where((e_r >= 0) & ok_r, e_r, 0).to(tl.int64)[:, None] * SLOT_BYTES
        sm = _byte(slot_ptr + rbase + (r % 16)[:, None] * C + c[None, :], ((e_r >= 0) & ok_r)[:, None])
        bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
        bits = tl.where(bits >= 0x8000, bits - 0x10000, bits).to(tl.int16)
        out = bits.to(tl.bfloat16, bitcast=True)

    if tl.max(raw_g.to(tl.int32), axis=0) > 0:
        in_raw = (e_r < 0) & ok_r
        rb = tl.where(in_raw, -1 - e_r, 0).to(tl.int64)[:, None] * RAW_TILE
        rawv = tl.load(raw_ptr + rb + (r % 16)[:, None].to(tl.int64) * RAW_ROW + c[None, :], mask=in_raw[:, None],
                       other=0.0)
        out = tl.where(in_raw[:, None], rawv, out)
    return out
