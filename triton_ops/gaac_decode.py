"""Tile expansion kernel: GAAC block-table entries -> BF16 tiles (for prefill over cached history and other
attentions). The torch reference of the same job is `gaac_hf.codec.decode_tiles` / `gaac_hf.cpu_decode`."""

import torch
import triton
import triton.language as tl

from .device import interpreted, on_device_of
from .layout import slot_constants
from .gaac_encode import check_fragment, escape_places
from .tile import chunk_words, token_rows


@triton.jit
def _expand_kernel(entry_ptr, slot_ptr, slot_w_ptr, raw_w_ptr, b3_ptr, b4_ptr, out_ptr, PERIOD, SLOT_BYTES,
                   C: tl.constexpr, ASM: tl.constexpr, PLANES: tl.constexpr, TAGS: tl.constexpr,
                   ESC: tl.constexpr):
    pid = tl.program_id(0)
    one = tl.arange(0, 1)[:, None]
    w = tl.arange(0, C // 2)[None, :]
    c = tl.arange(0, C)[None, :]
    h = tl.arange(0, 2)[:, None]
    entry = tl.load(entry_ptr + pid + one)
    live = one < 1
    in_slot = live & (entry >= 0)
    in_raw = live & (entry < 0)
    any_slot = tl.max(tl.max(in_slot.to(tl.int32), axis=1), axis=0) > 0
    any_raw = tl.max(tl.max(in_raw.to(tl.int32), axis=1), axis=0) > 0
    kind = pid % PERIOD  # which (K|V, head, tile) this entry belongs to: selects the bases
    at = kind * (C // 4) + w % (C // 4)
    b3 = tl.load(b3_ptr + at).to(tl.uint32, bitcast=True)
    b4 = tl.load(b4_ptr + at).to(tl.uint32, bitcast=True)
    p0, p1, p2, p3, p4, p5, p6, p7, base, has_raw = chunk_words(slot_ptr, slot_w_ptr, entry, in_slot, b3, b4,
                                                                SLOT_BYTES, C, PLANES, TAGS, ESC)
    for I in tl.static_range(8):
        rows = token_rows(slot_w_ptr, raw_w_ptr, entry, live, in_slot, in_raw, any_slot, any_raw, p0, p1, p2, p3, p4,
                          p5, p6, p7, base, has_raw, SLOT_BYTES, 16 * C, C, I, 1, C, ASM, True)
        tl.store(out_ptr + pid.to(tl.int64) * 16 * C + (h * 8 + I) * C + c, rows)


def expand_tiles(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
                 base4: torch.Tensor, layout) -> torch.Tensor:
    """The BF16 tiles `[..., P, 16, C]` named by `table` `[..., P]` int32 (slot index >= 0, else -1 - raw index).

    `base3`/`base4` uint8 `[P, C]`: the bases of each of the last axis' P positions (e.g. P = 2 * H * tiles);
    `layout`: the slots' layout (a `gaac_hf.format.TileLayout`, see `triton_ops.layout`).
    """
    channels = raw_pool.shape[-1]
    period = base3.shape[0]
    if table.shape[-1] != period or base3.shape != (period, channels):
        raise ValueError(f"table {tuple(table.shape)} and bases {tuple(base3.shape)} do not line up")
    offsets = slot_constants(layout, channels, slot_pool.shape[-1])
    entries = table.reshape(-1).contiguous()
    out = torch.empty(*table.shape, 16, channels, dtype=torch.bfloat16, device=table.device)
    if entries.numel():
        with on_device_of(entries):
            _expand_kernel[(entries.numel(),)](
                entries, slot_pool, slot_pool.view(torch.int32), raw_pool.view(torch.int32),
                base3.contiguous().view(torch.int32), base4.contiguous().view(torch.int32), out, period,
                slot_pool.shape[-1], C=channels, ASM=not interpreted(), **offsets)
    return out


@triton.jit
def _expand_v2_kernel(entry_ptr, slot_ptr, raw_ptr, b3_ptr, b4_ptr, frag_ptr, out_ptr, PERIOD, V_FROM, SLOT_BYTES,
                      C: tl.constexpr, PLANES: tl.constexpr, TAGS: tl.constexpr, ESC: tl.constexpr,
                      FRAGMENT: tl.constexpr):
    """Format version 2: one program per entry; elements held as `[2, 8, C]` (half h, token bit i, channel c), i.e.
    token 8h + i of channel c, which is group h * C + c, bit i."""
    G: tl.constexpr = 2 * C
    pid = tl.program_id(0)
    h = tl.arange(0, 2)[:, None, None]
    i = tl.arange(0, 8)[None, :, None]
    c = tl.arange(0, C)[None, None, :]
    e = (h * 8 + i) * C + c  # token-major element index
    out = out_ptr + pid.to(tl.int64) * 16 * C
    entry = tl.load(entry_ptr + pid)
    if entry < 0:
        tl.store(out + e, tl.load(raw_ptr + (-1 - entry).to(tl.int64) * 16 * C + e))
    else:
        slot = slot_ptr + entry.to(tl.int64) * SLOT_BYTES
        g = h * C + c  # group of each element, [2, 1, C]
        if FRAGMENT:
            frag = frag_ptr + ((pid % PERIOD) >= V_FROM).to(tl.int32) * 96 * C
            low = tl.load(slot + tl.load(frag + e)).to(tl.int32)
            words = (slot + PLANES).to(tl.pointer_type(tl.int32))
            sign_at = tl.load(frag + 16 * C + e)
            code_at = tl.load(frag + 32 * C + e)
            sign = (tl.load(words + (sign_at >> 5)) >> (sign_at & 31)) & 1
            code = (tl.load(words + (code_at >> 5)) >> (code_at & 31)) & 3
        else:
            low = tl.load(slot + e).to(tl.int32)
            sign = (tl.load(slot + PLANES + g).to(tl.int32) >> i) & 1
            code = ((tl.load(slot + PLANES + G + g).to(tl.int32) >> i) & 1) | (
                ((tl.load(slot + PLANES + 2 * G + g).to(tl.int32) >> i) & 1) << 1)
        g2 = tl.arange(0, 2)[:, None] * C + tl.arange(0, C)[None, :]  # [2, C]
        wide = (tl.load(slot + TAGS + g2 // 8).to(tl.int32) >> (g2 % 8)) & 1
        raw = (tl.load(slot + TAGS + G // 8 + g2 // 8).to(tl.int32) >> (g2 % 8)) & 1
        at3, at_hi = escape_places(wide, raw, tl.arange(0, 2)[:, None], 2)
        p3 = tl.load(slot + ESC + at3, mask=wide == 1, other=0).to(tl.int32)
        high_bits = (p3[:, None, :] >> i) & 1  # code bit 2
        for k in tl.static_range(1, 5):
            pk = tl.load(slot + ESC + at_hi + k, mask=raw == 1, other=0).to(tl.int32)
            high_bits |= ((pk[:, None, :] >> i) & 1) << k
        code = code | (high_bits << 2)
        kind = pid % PERIOD
        cc = tl.arange(0, C)
        half3 = (tl.load(b3_ptr + kind * C + cc).to(tl.int32) >> 1)[None, :]
        half4 = (tl.load(b4_ptr + kind * C + cc).to(tl.int32) >> 1)[None, :]
        base = tl.where(raw == 1, 0, tl.where(wide == 1, half4, half3))  # [2, C]
        high = (sign << 7) | ((code + base[:, None, :]) & 0x7F)
        bits = (high << 8) | low
        tl.store(out + e, bits.to(tl.int16).to(tl.bfloat16, bitcast=True))


def expand_tiles_v2(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
                    base4: torch.Tensor, layout, fragment: torch.Tensor | None = None,
                    v_from: int | None = None) -> torch.Tensor:
    """`expand_tiles` of slots in format version 2 (`gaac_hf.format_v2`): in plane order, or, given `fragment`
    (the caller's map, int32 `[2, 6, 16 C]`, K then V tiles: `format_v2.fragment_map`), in that order; positions
    `v_from..P-1` of the last axis (default P / 2) are V tiles. The bases are the even windows."""
    channels = raw_pool.shape[-1]
    period = base3.shape[0]
    if table.shape[-1] != period or base3.shape != (period, channels):
        raise ValueError(f"table {tuple(table.shape)} and bases {tuple(base3.shape)} do not line up")
    offsets = slot_constants(layout, channels, slot_pool.shape[-1])
    frag = check_fragment(fragment, channels, table.device)
    entries = table.reshape(-1).contiguous()
    out = torch.empty(*table.shape, 16, channels, dtype=torch.bfloat16, device=table.device)
    if entries.numel():
        with on_device_of(entries):
            _expand_v2_kernel[(entries.numel(),)](
                entries, slot_pool, raw_pool, base3.contiguous(), base4.contiguous(), frag, out, period,
                period // 2 if v_from is None else v_from, slot_pool.shape[-1], C=channels,
                FRAGMENT=fragment is not None, **offsets)
    return out
