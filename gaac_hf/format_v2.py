"""Reference encoder and decoder of the GAAC bitstream, format version 2 (docs/format.md, "Format version 2").

Version 2 splits a BF16 value at its byte boundary: the low byte (exponent bit 0 and the 7 mantissa bits) is kept
verbatim, the high byte's 7 exponent bits are coded against windows that start at even exponents, and the sign is
bit-plane 0. Units, groups, modes, the slot's section sizes and the escape bytes per mode are version 1's
(`format.py`, `codec.py`); tiles of 64 and 128 channels are stored in the order the CUDA kernel's mma fragments
consume them (`to_fragment_order`), narrower tiles in plane order. The caches store version 2 where the CUDA kernel
reads it (`gaac_cuda.plan(format_version=3)`, the fragment-order layout; `gaac_hf.cache_inputs.choose_format`); the Triton
encode / append / expand kernels are tested against this module bit for bit.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from .codec import (
    check_bf16,
    from_groups,
    group_bases,
    group_modes,
    pack_bits,
    pack_slots,
    to_groups,
    unpack_bits,
    unpack_slots,
)
from .format import BLOCK_TOKENS

FORMAT_VERSION = 2
ESCAPE_ORDER = "planes"  # plane-3 bytes of the wide groups, then planes 4..7 of the raw ones (`codec.escape_positions`)
FRAGMENT_CHANNELS = (64, 128)  # tiles stored in fragment order; narrower ones in plane order


def check_even_windows(base3: torch.Tensor, base4: torch.Tensor) -> None:
    """Version 2 codes the 7 high exponent bits, so every window starts at an even exponent."""
    for name, base in (("base3", base3), ("base4", base4)):
        if bool((base.to(torch.int32) & 1).any()):
            raise ValueError(f"format version 2 needs windows that start at even exponents; {name} has odd starts "
                             "(calibrate with even windows)")


def encode_tiles(x: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, capacity: int):
    """BF16 tiles `[..., 16, C]` and even windows `[..., C]` (uint8, broadcastable) -> (slots uint8
    `[..., slot_bytes]` in plane order, fits bool `[...]`, modes `[..., G]`). Where `fits` is False the escape
    area is truncated (the tile is stored raw)."""
    check_bf16(x)
    check_even_windows(base3, base4)
    c = x.shape[-1]
    lead = x.shape[:-2]
    base3, base4 = base3.expand(*lead, c), base4.expand(*lead, c)
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    exponent, low, sign = (bits >> 7) & 0xFF, bits & 0xFF, (bits >> 15) & 1
    mode = group_modes(exponent, base3, base4)  # version 1's rules: even windows cover the same exponents
    half = group_bases(mode, base3, base4, exponent.shape) >> 1
    code = (to_groups(exponent >> 1) - half) & 0x7F  # [..., G, 8]
    planes = torch.stack([pack_bits(to_groups(sign))] + [pack_bits((code >> p) & 1) for p in range(7)], -2)
    slots, total = pack_slots(low, planes, mode, capacity, ESCAPE_ORDER)
    return slots, total <= capacity, mode


def decode_tiles(slots: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, channels: int) -> torch.Tensor:
    """Slots `[..., slot_bytes]` (uint8, plane order) -> the BF16 tiles `[..., 16, C]`, bit-exactly."""
    check_even_windows(base3, base4)
    low, planes, mode = unpack_slots(slots, channels, ESCAPE_ORDER)  # plane 0: signs, 1 + p: code bit p
    lead = slots.shape[:-1]
    code = sum(planes[..., 1 + p, :, :] << p for p in range(7))  # [..., G, 8]
    shape = (*lead, BLOCK_TOKENS, channels)
    half = group_bases(mode, base3.expand(*lead, channels), base4.expand(*lead, channels), shape) >> 1
    high = from_groups((planes[..., 0, :, :] << 7) | ((code + half) & 0x7F), channels)
    return ((high << 8) | low).to(torch.int16).view(torch.bfloat16)


@functools.lru_cache(maxsize=None)
def fragment_maps(c: int, is_v: bool):
    """The fragment order of a `c`-channel K (or V) tile: for every byte of the low-byte area its source element
    (token * C + channel), and for every bit of the sign / code words its source (plane 0..2, group, token bit).
    Returns numpy (low_src [16 C], bit_plane, bit_group, bit_token [48 C])."""
    if c not in FRAGMENT_CHANNELS:
        raise ValueError(f"the fragment order covers tiles of {FRAGMENT_CHANNELS} channels, not {c}")
    n = c // 8  # words of 4 elements per lane
    nks, nvw = c // 16, c // 32
    low_src = np.full(16 * c, -1, dtype=np.int64)
    nbits = 48 * c
    plane, group, tbit = (np.full(nbits, -1, dtype=np.int64) for _ in range(3))

    def put(word, lane, bit, pl, gi, tb):
        at = ((word * 32 + lane) * 4 + bit // 8) * 8 + bit % 8
        assert plane[at] < 0
        plane[at], group[at], tbit[at] = pl, gi, tb

    for lane in range(32):
        g, t = lane // 4, lane % 4
        for q in range(n):
            for b in range(4):
                if is_v:  # word q = 4 j + 2 h + k: channels 4w + 2k, 4w + 2k + 1 x tokens 8h + 2t, 8h + 2t + 1
                    j, h, k = q // 4, (q % 4) // 2, q % 2
                    ch, tok = 4 * (g * nvw + j) + 2 * k + (b >> 1), 8 * h + 2 * t + (b & 1)
                else:  # word q = 8 s4 + 4 h + i: channels 4w .. 4w + 3 of token 8h + g, w = t NKS + 4 s4 + i
                    s4, h, i = q // 8, (q // 4) % 2, q % 4
                    ch, tok = 4 * (t * nks + 4 * s4 + i) + b, 8 * h + g
                at = ((q // 4) * 32 + lane) * 16 + (q % 4) * 4 + b
                assert low_src[at] < 0
                low_src[at] = tok * c + ch
                gi, tb = (tok // 8) * c + ch, tok % 8
                mk, y = q // 4, q % 4
                sign_bit = [8 * b + 7, (8 * b + 10) % 32, 8 * b + 5, 8 * b + 6][y]
                put(mk, lane, sign_bit, 0, gi, tb)
                if y < 2:
                    code_word, c0 = mk, 8 * b + 3 * y
                else:
                    code_word, c0 = n // 4 + mk // 2, 8 * b + 2 * (2 * (mk % 2) + y - 2)
                put(code_word, lane, c0, 1, gi, tb)
                put(code_word, lane, c0 + 1, 2, gi, tb)
    assert (low_src >= 0).all() and (plane >= 0).all()
    return low_src, plane, group, tbit


@functools.lru_cache(maxsize=None)
def fragment_destinations(c: int, is_v: bool) -> np.ndarray:
    """`fragment_maps` inverted, per element `e = token * C + channel` of a K (or V) tile: int32 `[3, 16 C]`, the
    byte offset of its low byte in the low-byte area, the bit of its sign and the bit of its code bit 0 in the
    plane area (bit `8 * byte + k`; code bit 1 is the next bit). What an encoder that scatters needs."""
    low_src, plane, group, tbit = fragment_maps(c, is_v)
    out = np.full((3, 16 * c), -1, dtype=np.int64)
    out[0, low_src] = np.arange(16 * c)
    element = (group // c) * 8 * c + tbit * c + group % c
    for row, pl in ((1, 0), (2, 1)):
        at = np.nonzero(plane == pl)[0]
        out[row, element[at]] = at
    code1 = np.nonzero(plane == 2)[0]
    assert (out >= 0).all() and (out[2, element[code1]] + 1 == code1).all()  # code bit 1 next to bit 0
    return out.astype(np.int32)


def plane_bit_sources(c: int, is_v: bool) -> np.ndarray:
    """For each bit of the fragment-order plane area (`48 C`), its bit in the plane-order planes:
    `(plane * 2C + group) * 8 + token bit`."""
    _, plane, group, tbit = fragment_maps(c, is_v)
    return (plane * 2 * c + group) * 8 + tbit


def _maps(c: int, is_v: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    return _device_maps(c, is_v, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _device_maps(c: int, is_v: bool, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.from_numpy(fragment_maps(c, is_v)[0]).to(device),
            torch.from_numpy(plane_bit_sources(c, is_v)).to(device))


def to_fragment_order(slots: torch.Tensor, c: int, is_v: bool) -> torch.Tensor:
    """Slots `[..., slot_bytes]` of K (or V) tiles in plane order -> fragment order: the low bytes and the sign /
    code planes permuted (tags and escapes unchanged)."""
    low_src, bit_src = _maps(c, is_v, slots.device)
    n_low, n_planes = 16 * c, 3 * 2 * c
    bits = unpack_bits(slots[..., n_low:n_low + n_planes]).reshape(*slots.shape[:-1], -1)
    words = pack_bits(bits.index_select(-1, bit_src).reshape(*slots.shape[:-1], n_planes, 8)).to(torch.uint8)
    return torch.cat([slots[..., :n_low].index_select(-1, low_src), words, slots[..., n_low + n_planes:]], -1)


def from_fragment_order(slots: torch.Tensor, c: int, is_v: bool) -> torch.Tensor:
    """The inverse of `to_fragment_order`."""
    low_src, bit_src = _maps(c, is_v, slots.device)
    n_low, n_planes = 16 * c, 3 * 2 * c
    low = torch.empty_like(slots[..., :n_low])
    low[..., low_src] = slots[..., :n_low]
    bits = unpack_bits(slots[..., n_low:n_low + n_planes]).reshape(*slots.shape[:-1], -1)
    planes = torch.empty_like(bits)
    planes[..., bit_src] = bits
    words = pack_bits(planes.reshape(*slots.shape[:-1], n_planes, 8)).to(torch.uint8)
    return torch.cat([low, words, slots[..., n_low + n_planes:]], -1)


def encode(x: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, capacity: int, is_v: bool):
    """`encode_tiles`, stored as version 2 stores a tile: fragment order for 64- and 128-channel tiles."""
    slots, fits, mode = encode_tiles(x, base3, base4, capacity)
    if x.shape[-1] in FRAGMENT_CHANNELS:
        slots = to_fragment_order(slots, x.shape[-1], is_v)
    return slots, fits, mode


def decode(slots: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, channels: int, is_v: bool) -> torch.Tensor:
    """The inverse of `encode` for tiles that fit their slot."""
    if channels in FRAGMENT_CHANNELS:
        slots = from_fragment_order(slots, channels, is_v)
    return decode_tiles(slots, base3, base4, channels)


def fragment_map(c: int, device) -> torch.Tensor | None:
    """What the Triton kernels take to write and read the fragment order, for K and V tiles: int32 `[2, 6, 16 C]` on
    `device`, per tile kind rows 0..2 = `fragment_destinations` (per element: its low byte's offset, its sign's and
    its code bit 0's bit in the plane area) and rows 3..5 = for each of the plane area's 48 C bits its source bit in
    the plane-order planes (`plane * 2C * 8 + group * 8 + token bit`); None for tiles stored in plane order."""
    if c not in FRAGMENT_CHANNELS:
        return None
    return _fragment_map(c, str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _fragment_map(c: int, device: str) -> torch.Tensor:
    rows = [np.concatenate([fragment_destinations(c, is_v), plane_bit_sources(c, is_v).reshape(3, 16 * c)])
            .astype(np.int32) for is_v in (False, True)]
    return torch.from_numpy(np.stack(rows)).to(device).contiguous()


def encode_kv(tiles: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, capacity: int):
    """`encode` of tiles `[..., P, 16, C]` whose first P / 2 positions are K tiles and the rest V tiles (the cache's
    position order), bases `[P, C]` -> (slots `[..., P, slot_bytes]`, fits `[..., P]`, modes `[..., P, G]`)."""
    slots, fits, mode = encode_tiles(tiles, base3, base4, capacity)
    c = tiles.shape[-1]
    if c in FRAGMENT_CHANNELS:
        p = slots.shape[-2]
        slots = torch.cat([to_fragment_order(slots[..., :p // 2, :], c, False),
                           to_fragment_order(slots[..., p // 2:, :], c, True)], -2)
    return slots, fits, mode


def decode_slots(slots: torch.Tensor, is_v: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor,
                 channels: int) -> torch.Tensor:
    """Stored slots `[N, slot_bytes]` with bases `[N, C]` and `is_v` bool `[N]` (V tiles: their own fragment
    order) -> BF16 tiles `[N, 16, C]`."""
    if channels in FRAGMENT_CHANNELS and slots.shape[0]:
        plane = torch.empty_like(slots)
        for v in (False, True):
            at = (is_v == v).nonzero().reshape(-1)
            if at.numel():
                plane[at] = from_fragment_order(slots[at], channels, v)
        slots = plane
    return decode_tiles(slots, base3, base4, channels)

