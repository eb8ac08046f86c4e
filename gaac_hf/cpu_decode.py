"""A fast torch decoder for the CPU path: slots -> BF16 tiles, bit-identical to `codec.decode_tiles` (the oracle).

`decode_tiles` is written to be read; this one is written to run: it works on bytes (uint8 arithmetic wraps mod 256
exactly as the format's exponent code does) and unpacks the bit planes eight elements at a time with a 256-entry
table that spreads the bits of a byte over the byte lanes of an int64 (SWAR). The escape area is read only when
some tile has 4-bit or raw groups. It trusts its input: slots come from the cache's own encoder (the oracle
checks mode tags for corruption; this path does not).
"""

from __future__ import annotations

import torch

from .format import BLOCK_TOKENS, CODE_PLANES_IN_STREAM, TileLayout

# byte v -> int64 whose byte lane i is bit i of v; and for a pair of bytes (lo | hi << 8): lane i holds bit i of lo
# in bit 0 and bit i of hi in bit 1 (planes 0 and 1 of a group in one lookup)
_SPREAD = torch.tensor([sum(((v >> i) & 1) << (8 * i) for i in range(8)) for v in range(256)], dtype=torch.int64)
_SPREAD2 = (_SPREAD[torch.arange(65536) & 0xFF] | (_SPREAD[torch.arange(65536) >> 8] << 1)).contiguous()


def _spread(b: torch.Tensor) -> torch.Tensor:
    return _SPREAD.index_select(0, b.reshape(-1).long()).reshape(b.shape)


def decode_slots(slots: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, channels: int) -> torch.Tensor:
    """Slots uint8 `[N, slot_bytes]` with per-tile bases uint8 `[N, C]` -> BF16 tiles `[N, 16, C]`."""
    n = slots.shape[0]
    layout = TileLayout(channels, slots.shape[-1] - TileLayout(channels, 0).fixed_bytes)
    c, g = channels, layout.groups
    if slots.device != _SPREAD.device:
        raise ValueError("decode_slots is the CPU decoder")
    planes = slots[:, layout.planes_offset:layout.tags_offset].reshape(n, CODE_PLANES_IN_STREAM, g)
    tags = slots[:, layout.tags_offset:layout.tags_end].reshape(n, 2, layout.tag_plane_bytes)
    mode_bits = _spread(tags).view(torch.uint8).reshape(n, 2, g)  # [N, 2 (wide, raw), G] of 0/1
    wide, raw = mode_bits[:, 0], mode_bits[:, 1]
    pair = planes[:, 0].to(torch.int32) | (planes[:, 1].to(torch.int32) << 8)
    code = _SPREAD2.index_select(0, pair.reshape(-1)).reshape(n, g) | (_spread(planes[:, 2]) << 2)  # 8 lanes
    if bool(wide.any()):  # 4-bit or raw groups: their escape bytes (planes 3..7), packed in group order
        weights = wide.to(torch.int32) + 4 * raw.to(torch.int32)
        offsets = (torch.cumsum(weights, -1) - weights).long()
        # a slot's escapes fit its capacity, so offset + 4 stays inside the area padded by 5
        area = torch.nn.functional.pad(slots[:, layout.escape_offset:], (0, 5))
        code |= _spread(torch.gather(area, 1, offsets) * wide) << 3
        rows = raw.any(-1).nonzero().reshape(-1)  # raw groups are rare: only their tiles
        if rows.numel():
            r, at, sub = raw[rows], offsets[rows], area[rows]
            extra = torch.zeros_like(code[rows])
            for j in range(1, 5):
                extra |= _spread(torch.gather(sub, 1, at + j) * r) << (3 + j)
            code.index_copy_(0, rows, code[rows] | extra)
    b3 = base3.expand(n, c).repeat(1, 2)
    b4 = base4.expand(n, c).repeat(1, 2)
    base = torch.where(raw.bool(), 0, torch.where(wide.bool(), b4, b3)).to(torch.uint8)
    # (code + base) mod 256 per element (uint8 wraps), then group order (g = h * C + c, lane i = token 8h + i)
    # -> token-major [N, 16, C]
    exp = (code.view(torch.uint8).reshape(n, g, 8) + base[:, :, None]).reshape(n, 2, c, 8).transpose(2, 3)
    exp = exp.reshape(n, BLOCK_TOKENS, c).to(torch.int16)
    # sign+mantissa byte, sign-extended: bit 15 = sign, bits 0-6 = mantissa after the mask
    sm = slots[:, :layout.planes_offset].view(torch.int8).reshape(n, BLOCK_TOKENS, c).to(torch.int16)
    return ((sm & -0x7F81) | (exp << 7)).view(torch.bfloat16)  # -0x7F81 = 0x807F as int16
