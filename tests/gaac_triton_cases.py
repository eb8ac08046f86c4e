"""Builders shared by the Triton op tests: GAAC-compressed KV in the cache's storage classes."""

import torch

from gaac_hf.codec import encode_tiles, split_head
from gaac_hf.format import tile_split


def compress_kv(k: torch.Tensor, v: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, capacity: int,
                format_version: int = 1):
    """Plain K/V `[B, H, S, D]` -> (slot_pool, raw_pool, table `[B, n, 2, H, tiles]`, tail_k, tail_v, fits), the slots
    in `format_version` as the caches store it (version 2: the caches' encoder, `gaac_hf.ops.encode`; even windows)."""
    b, h, s, d = k.shape
    c = tile_split(d)[1]
    n = s // 16
    kv = torch.stack([k, v], 2)[:, :, :, : n * 16]  # [B, H, 2, n*16, D]
    tiles = split_head(kv.reshape(b, h, 2, n, 16, d).permute(0, 3, 2, 1, 4, 5))  # [B, n, 2, H, tiles, 16, C]
    shape = (2, h, d // c, c)
    if format_version == 2:
        from gaac_hf import ops

        p = 2 * h * (d // c)
        slots, fits, _ = ops.encode(tiles.reshape(b, n, p, 16, c), base3.reshape(p, c), base4.reshape(p, c),
                                    capacity, 2)
        slots, fits = slots.reshape(*tiles.shape[:-2], -1), fits.reshape(tiles.shape[:-2])
    else:
        enc = encode_tiles(tiles, base3.reshape(shape), base4.reshape(shape), capacity)
        slots, fits = enc.slots, enc.fits
    slot_pool = slots[fits]
    raw_pool = tiles[~fits]
    dev = k.device
    if slot_pool.shape[0] == 0:
        slot_pool = torch.zeros(1, slots.shape[-1], dtype=torch.uint8, device=dev)
    if raw_pool.shape[0] == 0:
        raw_pool = torch.zeros(1, 16, c, dtype=torch.bfloat16, device=dev)
    table = torch.empty(fits.shape, dtype=torch.int32, device=dev)
    table[fits] = torch.arange(int(fits.sum()), dtype=torch.int32, device=dev)
    table[~fits] = -1 - torch.arange(int((~fits).sum()), dtype=torch.int32, device=dev)
    return slot_pool, raw_pool, table, k[:, :, n * 16:], v[:, :, n * 16:], fits


def realistic_kv(b, h, s, d, gen, kind="mixed", even=False):
    """K/V with per-channel magnitudes (like real keys), and bases that give the requested mode mix (`even`: windows
    that start at even exponents, as format version 2 needs)."""
    scale = torch.exp2(torch.randint(-3, 4, (1, h, 1, d), generator=gen).float())
    k = (torch.randn(b, h, s, d, generator=gen) * scale).to(torch.bfloat16)
    v = torch.randn(b, h, s, d, generator=gen).to(torch.bfloat16)
    from gaac_hf.calibrate import exponent_histogram, windows_from_histogram

    hist = exponent_histogram(torch.stack([k, v], 1).transpose(0, 1).reshape(1, 2, h, b * s, d))
    base3, base4 = windows_from_histogram(hist[0], 2 if even else 1)  # [2, H, D]
    if kind == "raw":  # windows far from the data: every group raw
        base3 = torch.full_like(base3, 10)
        base4 = torch.full_like(base4, 10)
    elif kind == "4bit":  # 3-bit window useless, 4-bit window centred: 4-bit (or raw) groups
        base3 = torch.full_like(base3, 10)
    return k, v, base3, base4
