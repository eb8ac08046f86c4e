"""Decode kernel: GAAC block-table entries -> BF16 tiles (for prefill over cached history and other attentions)."""

import torch
import triton
import triton.language as tl

from .device import on_device_of
from .tile import tile_rows


@triton.jit
def _decode_kernel(entry_ptr, slot_ptr, raw_ptr, b3_ptr, b4_ptr, out_ptr, PERIOD, SLOT_BYTES,
                   C: tl.constexpr):
    pid = tl.program_id(0)
    gq = tl.arange(0, 2)[:, None, None]  # the two halves of the block
    i = tl.arange(0, 8)[None, :, None]
    c = tl.arange(0, C)[None, None, :]
    entry = tl.load(entry_ptr + pid + gq * 0)
    kind = pid % PERIOD  # which (K|V, head, tile) this entry belongs to: selects the bases
    b3 = tl.load(b3_ptr + kind * C + c).to(tl.uint32)
    b4 = tl.load(b4_ptr + kind * C + c).to(tl.uint32)
    rows = tile_rows(slot_ptr, raw_ptr, entry, gq < 2, b3, b4, SLOT_BYTES, 16 * C, C, 1, C)
    tl.store(out_ptr + pid.to(tl.int64) * 16 * C + (gq * 8 + i) * C + c, rows)


def gaac_decode(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
                base4: torch.Tensor) -> torch.Tensor:
    """Decode tiles named by `table` `[..., P]` int32 (slot index >= 0, else -1 - raw index) to BF16 `[..., P, 16, C]`.

    `base3`/`base4` uint8 `[P, C]`: the bases of each of the last axis' P positions (e.g. P = 2 * H * tiles).
    """
    channels = raw_pool.shape[-1]
    period = base3.shape[0]
    if table.shape[-1] != period or base3.shape != (period, channels):
        raise ValueError(f"table {tuple(table.shape)} and bases {tuple(base3.shape)} do not line up")
    entries = table.reshape(-1).contiguous()
    out = torch.empty(*table.shape, 16, channels, dtype=torch.bfloat16, device=table.device)
    if entries.numel():
        with on_device_of(entries):
            _decode_kernel[(entries.numel(),)](entries, slot_pool, raw_pool, base3.contiguous(), base4.contiguous(), out,
                                               period, slot_pool.shape[-1], C=channels)
    return out
