"""Tile expansion kernel: GAAC block-table entries -> BF16 tiles (for prefill over cached history and other
attentions). The torch reference of the same job is `gaac_hf.codec.decode_tiles` / `gaac_hf.cpu_decode`."""

import torch
import triton
import triton.language as tl

from .device import interpreted, on_device_of
from .layout import slot_constants
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
