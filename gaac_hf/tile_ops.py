"""Tiles <-> slots and block tables <-> K/V, on the device's backend: `encode` (tiles -> slots), `expand_tiles` /
`expand_kv` (entries -> tiles or K/V), `tiles_of` / `blocks_of` (K/V <-> the block table's tile order). The Triton
kernels on CUDA, the torch codec / `cpu_decode` elsewhere, bit-identical; format version 1 or 2."""

from __future__ import annotations

import torch

from . import format_v2
from .backends import slot_layout, tile_layout
from .codec import encode_tiles
from .cpu_decode import expand_into
from .format import BLOCK_TOKENS, tile_split


def encode(tiles: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, capacity: int, format_version: int = 1):
    """BF16 tiles `[..., P, 16, C]` (positions: K tiles, then V tiles), bases uint8 `[P, C]` -> `(slots [..., P,
    slot_bytes], fits [..., P], mode counts int32 [..., P, 3])`, in format version `format_version` (2: the bases
    are even windows, the caller's check)."""
    c = tiles.shape[-1]
    if tiles.is_cuda:
        from triton_ops.gaac_encode import gaac_encode

        frag = format_v2.fragment_map(c, tiles.device) if format_version == 2 else None
        slots, esc, counts = gaac_encode(tiles, base3, base4, tile_layout(c, capacity), format_version, frag)
        return slots, esc <= capacity, counts
    if format_version == 2:
        slots, fits, modes = format_v2.encode_kv(tiles, base3, base4, capacity)
        counts = torch.stack([(modes == m).sum(-1, dtype=torch.int32) for m in range(3)], -1)
        return slots, fits, counts
    enc = encode_tiles(tiles, base3, base4, capacity)
    counts = torch.stack([(enc.modes == m).sum(-1, dtype=torch.int32) for m in range(3)], -1)
    return enc.slots, enc.fits, counts


def expand_tiles(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
                 base4: torch.Tensor, format_version: int = 1) -> torch.Tensor:
    """Entries `[..., P]` (slot >= 0, else -1 - raw; positions: K tiles, then V tiles) with bases uint8 `[P, C]` ->
    BF16 tiles `[..., P, 16, C]`."""
    channels = raw_pool.shape[-1]
    if format_version == 2:
        return _expand_tiles_v2(table, slot_pool, raw_pool, base3, base4)
    if table.is_cuda:
        from triton_ops.gaac_decode import expand_tiles as triton_expand_tiles

        return triton_expand_tiles(table, slot_pool, raw_pool, base3, base4,
                                   slot_layout(channels, slot_pool.shape[-1]))
    lead, p = table.shape[:-1], table.shape[-1]
    n = table.numel() // max(p, 1)
    out = torch.empty(*lead, p, BLOCK_TOKENS, channels, dtype=raw_pool.dtype)
    expand_into(table.reshape(1, n, 1, 1, p), slot_pool, raw_pool, base3, base4,
                out.view(1, n, 1, 1, p, BLOCK_TOKENS, channels))
    return out


def _expand_tiles_v2(table, slot_pool, raw_pool, base3, base4) -> torch.Tensor:
    """`expand_tiles` of format version 2: the Triton kernel on CUDA, else the torch reference decoder
    (`format_v2.decode_slots`; the CPU path reads version 2 only where a user forces it)."""
    lead, p = table.shape[:-1], table.shape[-1]
    c = raw_pool.shape[-1]
    if table.is_cuda:
        from triton_ops.gaac_decode import expand_tiles_v2

        return expand_tiles_v2(table, slot_pool, raw_pool, base3, base4, slot_layout(c, slot_pool.shape[-1]),
                               format_v2.fragment_map(c, table.device))
    flat = table.reshape(-1).long()
    pos = torch.arange(flat.numel(), device=flat.device) % max(p, 1)
    out = torch.empty(flat.numel(), BLOCK_TOKENS, c, dtype=raw_pool.dtype, device=raw_pool.device)
    fit = flat >= 0
    at, raw_at = fit.nonzero().reshape(-1), (~fit).nonzero().reshape(-1)
    if at.numel():
        where = pos[at]
        out[at] = format_v2.decode_slots(slot_pool[flat[at]], where >= p // 2, base3[where], base4[where], c)
    if raw_at.numel():
        out[raw_at] = raw_pool[-1 - flat[raw_at]]
    return out.reshape(*lead, p, BLOCK_TOKENS, c)


def expand_kv(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
              base4: torch.Tensor, tail_k: torch.Tensor | None = None,
              tail_v: torch.Tensor | None = None, format_version: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries `[B, n, 2, H, tiles]` with bases uint8 `[2 * H * tiles, C]` (then the BF16 tails `[B, H, s, D]`, if
    given) -> contiguous K, V `[B, H, n * 16 + s, D]`.

    On the CPU the decoder writes every tile straight to its place in one `[2, B, H, S, D]` buffer, whose halves are
    K and V (no `blocks_of` permute, no concatenation with the tail)."""
    b, n, _, h, t = table.shape
    c = raw_pool.shape[-1]
    if table.is_cuda or format_version == 2:
        kv = blocks_of(expand_tiles(table.reshape(b, n, 2 * h * t), slot_pool, raw_pool, base3, base4,
                                    format_version), h)
        if tail_k is None:
            return kv[:, 0], kv[:, 1]
        return torch.cat([kv[:, 0], tail_k], -2), torch.cat([kv[:, 1], tail_v], -2)
    s = 0 if tail_k is None else tail_k.shape[2]
    length, d = n * BLOCK_TOKENS + s, t * c
    buf = torch.empty(2, b, h, length, d, dtype=raw_pool.dtype)
    out = buf.as_strided((b, n, 2, h, t, BLOCK_TOKENS, c),
                         (h * length * d, BLOCK_TOKENS * d, b * h * length * d, length * d, c, d, 1))
    expand_into(table, slot_pool, raw_pool, base3, base4, out)
    if s:
        buf[0, :, :, n * BLOCK_TOKENS:] = tail_k
        buf[1, :, :, n * BLOCK_TOKENS:] = tail_v
    return buf[0], buf[1]


def tiles_of(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K, V `[B, H, n * 16, D]` -> tiles `[B, n, 2 * H * tiles, 16, C]` (position order of the block table)."""
    b, h, s, d = k.shape
    c = tile_split(d)[1]
    x = torch.stack([k, v], 1).reshape(b, 2, h, s // BLOCK_TOKENS, BLOCK_TOKENS, d // c, c)
    return x.permute(0, 3, 1, 2, 5, 4, 6).reshape(b, s // BLOCK_TOKENS, 2 * h * (d // c), BLOCK_TOKENS, c)


def blocks_of(tiles: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `tiles_of`: `[B, n, 2 * H * tiles, 16, C]` -> KV `[B, 2, H, n * 16, D]`."""
    b, n, p, _, c = tiles.shape
    t = p // (2 * heads)
    x = tiles.reshape(b, n, 2, heads, t, BLOCK_TOKENS, c).permute(0, 2, 3, 1, 5, 4, 6)
    return x.reshape(b, 2, heads, n * BLOCK_TOKENS, t * c)
