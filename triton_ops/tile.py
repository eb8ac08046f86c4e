"""Device-side reconstruction of GAAC tiles, shared by the decode and the fused attention kernels.

Bitstream: docs/format.md (format version 1). `load_kv_rows` returns rows of BF16 KV for a set of 16-token
blocks of one (batch row, K|V, kv-head, tile), from a slot (GAAC code) or a raw BF16 tile, as the block table says.
"""

import triton
import triton.language as tl


@triton.jit
def _bit(byte, i):
    return (byte >> i) & 1


@triton.jit
def load_kv_rows(slot_ptr, raw_ptr, entry, t, c, b3, b4, valid, SLOT_BYTES, RAW_TILE, RAW_ROW,
                 C: tl.constexpr):
    """Reconstruct BF16 `[R, C]` for rows whose tile table entry is `entry` `[R]` and token-in-block `t` `[R]`.

    `c` `[C]` channel ids; `b3`, `b4` `[C]` int32 bases of this (K|V, head, tile); `valid` `[R]` row mask.
    A slot tile (entry >= 0) is decoded from its code in registers; a raw tile (entry < 0, raw index
    `-1 - entry`) is read as BF16 at `raw_ptr + index * RAW_TILE + t * RAW_ROW + c` (elements).
    Slot and raw geometry are run-time values, so the kernel compiled for compressed KV is the very same one that
    reads plain KV as raw tiles.
    """
    G: tl.constexpr = 2 * C
    PLANES: tl.constexpr = 16 * C
    TAGS: tl.constexpr = PLANES + 3 * G
    TAG_PLANE: tl.constexpr = G // 8
    ESC: tl.constexpr = TAGS + 2 * TAG_PLANE

    in_slot = (entry >= 0) & valid
    in_raw = (entry < 0) & valid
    base = tl.where(in_slot, entry, 0).to(tl.int64)[:, None] * SLOT_BYTES  # [R, 1]
    rbase = tl.where(in_raw, -1 - entry, 0).to(tl.int64)[:, None] * RAW_TILE
    ms = in_slot[:, None]
    t2 = t[:, None]
    c2 = c[None, :]
    half = t2 // 8
    i = t2 % 8
    g = half * C + c2  # group of each element
    sm = tl.load(slot_ptr + base + t2 * C + c2, mask=ms, other=0).to(tl.int32)
    code = _bit(tl.load(slot_ptr + base + PLANES + g, mask=ms, other=0).to(tl.int32), i)
    code |= _bit(tl.load(slot_ptr + base + PLANES + G + g, mask=ms, other=0).to(tl.int32), i) << 1
    code |= _bit(tl.load(slot_ptr + base + PLANES + 2 * G + g, mask=ms, other=0).to(tl.int32), i) << 2
    # mode tags of this element's group, and of the same channel run in half 0 (for the prefix sum)
    gb = g // 8
    gs = g % 8
    wide = _bit(tl.load(slot_ptr + base + TAGS + gb, mask=ms, other=0).to(tl.int32), gs)
    raw = _bit(tl.load(slot_ptr + base + TAGS + TAG_PLANE + gb, mask=ms, other=0).to(tl.int32), gs)
    w = wide + 4 * raw  # escape bytes of the group: 0, 1 or 5
    g0 = c2 + 0 * t2
    w0 = _bit(tl.load(slot_ptr + base + TAGS + g0 // 8, mask=ms, other=0).to(tl.int32), g0 % 8) \
        + 4 * _bit(tl.load(slot_ptr + base + TAGS + TAG_PLANE + g0 // 8, mask=ms, other=0).to(tl.int32), g0 % 8)
    # exclusive prefix sum over groups in group order: within the half, plus all of half 0 for half 1
    off = tl.cumsum(w, axis=1) - w + tl.where(half == 1, tl.sum(w0, axis=1)[:, None], 0)
    esc = slot_ptr + base + ESC + off
    code |= _bit(tl.load(esc, mask=ms & (wide == 1), other=0).to(tl.int32), i) << 3
    for k in tl.static_range(1, 5):
        code |= _bit(tl.load(esc + k, mask=ms & (raw == 1), other=0).to(tl.int32), i) << (3 + k)
    bias = tl.where(raw == 1, 0, tl.where(wide == 1, b4[None, :], b3[None, :]))
    e = (code + bias) & 0xFF
    bits = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    bits = tl.where(bits >= 0x8000, bits - 0x10000, bits).to(tl.int16)
    decoded = bits.to(tl.bfloat16, bitcast=True)
    rawv = tl.load(raw_ptr + rbase + t2 * RAW_ROW + c2, mask=in_raw[:, None], other=0.0)
    return tl.where(ms, decoded, rawv)
