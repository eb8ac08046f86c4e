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

# byte v -> int64 whose byte lane i is bit i of v
_SPREAD = torch.tensor([sum(((v >> i) & 1) << (8 * i) for i in range(8)) for v in range(256)], dtype=torch.int64)


def _spread(b: torch.Tensor) -> torch.Tensor:
    return _SPREAD.index_select(0, b.reshape(-1).long()).reshape(b.shape)


def decode_slots(slots: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, channels: int) -> torch.Tensor:
    """Slots uint8 `[N, slot_bytes]` with per-tile bases uint8 `[N, C]` -> BF16 tiles `[N, 16, C]`."""
    n = slots.shape[0]
    layout = TileLayout(channels, slots.shape[-1] - TileLayout(channels, 0).fixed_bytes)
    c, g = channels, layout.groups
    if slots.device != _SPREAD.device:
        raise ValueError("decode_slots is the CPU decoder")
    sm = slots[:, :layout.planes_offset].reshape(n, BLOCK_TOKENS, c)
    planes = slots[:, layout.planes_offset:layout.tags_offset].reshape(n, CODE_PLANES_IN_STREAM, g)
    tags = slots[:, layout.tags_offset:layout.escape_offset].reshape(n, 2, layout.tag_plane_bytes)
    mode_bits = _spread(tags).view(torch.uint8).reshape(n, 2, g)  # [N, 2 (wide, raw), G] of 0/1
    wide, raw = mode_bits[:, 0], mode_bits[:, 1]
    code = _spread(planes[:, 0]) | (_spread(planes[:, 1]) << 1) | (_spread(planes[:, 2]) << 2)  # [N, G] x 8 lanes
    if bool(wide.any()):  # 4-bit or raw groups: their escape bytes (planes 3..7), packed in group order
        w, r = wide.to(torch.int32), raw.to(torch.int32)
        weights = w + 4 * r
        offsets = (torch.cumsum(weights, -1) - weights).long()
        # a slot's escapes fit its capacity, so offset + 4 stays inside the area padded by 5
        area = torch.nn.functional.pad(slots[:, layout.escape_offset:], (0, 5))
        code |= _spread(torch.gather(area, 1, offsets) * wide) << 3
        if bool(raw.any()):
            for j in range(1, 5):
                code |= _spread(torch.gather(area, 1, offsets + j) * raw) << (3 + j)
    b3 = base3.expand(n, c).repeat(1, 2)
    b4 = base4.expand(n, c).repeat(1, 2)
    base = torch.where(raw.bool(), 0, torch.where(wide.bool(), b4, b3)).to(torch.int64) * _ONES  # [N, G] x 8
    exp = _add_lanes(code, base)  # (code + base) mod 256 in every lane
    # group order (g = h * C + c, lane i = token 8h + i) -> token-major bytes [N, 16, C]
    exp = exp.view(torch.uint8).reshape(n, 2, c, 8).transpose(2, 3).reshape(n, BLOCK_TOKENS * c // 8, 8)
    exp = exp.contiguous().view(torch.int64).reshape(n, BLOCK_TOKENS * c // 8)
    smw = sm.reshape(n, BLOCK_TOKENS * c).view(torch.int64)
    hi = (smw & _HIGH) | ((exp >> 1) & _LOW)  # sign, exponent bits 7..1
    lo = ((exp << 7) & _HIGH) | (smw & _LOW)  # exponent bit 0, mantissa
    out = torch.stack([lo.view(torch.uint8), hi.view(torch.uint8)], -1)  # little endian BF16
    return out.view(torch.bfloat16).reshape(n, BLOCK_TOKENS, c)


_ONES = 0x0101010101010101
_HIGH = -0x7F7F7F7F7F7F7F80  # 0x8080808080808080 as int64
_LOW = 0x7F7F7F7F7F7F7F7F


def _add_lanes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Byte-lane-wise `(a + b) mod 256` of int64 words (no carry crosses a lane)."""
    return ((a & _LOW) + (b & _LOW)) ^ ((a ^ b) & _HIGH)
