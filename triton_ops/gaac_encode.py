"""Encode kernel: BF16 tiles -> GAAC slots (block finalization), one program per tile.

Bitstream: docs/format.md. Output bits equal `gaac_hf.codec.encode_tiles` (the torch reference; format version 2:
`gaac_hf.format_v2.encode_tiles` in plane order, or `format_v2.encode_kv`, in fragment order, given the caller's
fragment map), including the escape area of tiles whose escapes overflow the slot (truncated to the capacity; such
tiles stay raw BF16).
"""

import functools

import torch
import triton
import triton.language as tl

from .device import on_device_of
from .layout import slot_constants


@triton.jit
def tile_modes(bits, b3, b4, C: tl.constexpr, VERSION: tl.constexpr = 1):
    """BF16 bits of one tile (int32 `[16, C]`) and its bases (int32 `[C]`) -> (the verbatim byte of each element
    `[16, C]`, the bit-plane bits `[2, 8, C]` (bit p: plane p), modes `[2, C]` (group (half h, channel c)), escape
    bytes of the tile). Version 1: sign+mantissa kept, planes = the 8-bit exponent code; version 2: the low byte kept,
    plane 0 = the sign, planes 1..7 = the code of the 7 high exponent bits against the halved (even) bases."""
    e = (bits >> 7) & 0xFF
    eg = tl.reshape(e, [2, 8, C])  # group (half h, channel c) = tokens 8h..8h+7 of channel c
    d3 = eg - b3[None, None, :]
    d4 = eg - b4[None, None, :]
    fit3 = (tl.min(d3, axis=1) >= 0) & (tl.max(d3, axis=1) < 8)
    fit4 = (tl.min(d4, axis=1) >= 0) & (tl.max(d4, axis=1) < 16)
    mode = tl.where(fit3, 0, tl.where(fit4, 1, 2))  # [2, C]
    base = tl.where(mode == 0, b3[None, :], tl.where(mode == 1, b4[None, :], 0))
    if VERSION == 2:
        sm = bits & 0xFF
        sign = tl.reshape((bits >> 15) & 1, [2, 8, C])
        code = sign | ((((eg >> 1) - (base[:, None, :] >> 1)) & 0x7F) << 1)
    else:
        sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
        code = (eg - base[:, None, :]) & 0xFF  # [2, 8, C]
    w = (mode >= 1).to(tl.int32) + 4 * (mode == 2).to(tl.int32)  # escape bytes per group
    total = tl.sum(tl.sum(w, axis=1), axis=0)
    return sm, code, mode, total


@triton.jit
def exclusive_rank(x, h):
    """Exclusive prefix sum over the groups in group order (half h, then channel) of `x` `[2, C]`."""
    first_half = tl.sum(tl.sum(tl.where(h == 0, x, 0), axis=1), axis=0)
    return tl.cumsum(x, axis=1) - x + tl.where(h == 1, first_half, 0)


@triton.jit
def escape_places(wide, raw, h, VERSION: tl.constexpr):
    """Where a group's escape bytes lie (`gaac_hf.codec.escape_positions`), from its tags `[2, C]` (half h): its
    plane-3 byte at `at3` and plane 3 + k at `at_hi + k`. Version 2: the plane-3 bytes of the wide groups first, then
    planes 4..7 of the raw groups; version 1: each group's bytes together, in group order."""
    if VERSION == 2:
        at3 = exclusive_rank(wide, h)
        at_hi = tl.sum(tl.sum(wide, axis=1), axis=0) + 4 * exclusive_rank(raw, h) - 1
    else:
        at3 = exclusive_rank(wide + 4 * raw, h)
        at_hi = at3
    return at3, at_hi


@triton.jit
def store_slot(out, sm, code, mode, CAPACITY, C: tl.constexpr, E_PAD: tl.constexpr, PLANES: tl.constexpr,
               TAGS: tl.constexpr, ESC: tl.constexpr, frag=None, FRAGMENT: tl.constexpr = False,
               VERSION: tl.constexpr = 1):
    """Write one tile's slot at `out` (uint8 pointer) from `tile_modes`' output; escapes past CAPACITY are cut.
    PLANES, TAGS, ESC: the slot layout's section offsets (from the caller: `triton_ops.layout`). FRAGMENT (format
    version 2): the low bytes and planes 0..2 go where `frag` (int32 `[6, 16 C]`: per element its low byte's offset,
    then per bit of the plane area its source bit in plane order) says, instead of token-major bytes and bit-planes:
    each plane word gathers its 32 bits from the codes in registers (`tl.gather`; no atomics, no staging in memory)."""
    G: tl.constexpr = 2 * C
    TAG_PLANE: tl.constexpr = G // 8
    t = tl.arange(0, 16)
    c = tl.arange(0, C)
    i = tl.arange(0, 8)[None, :, None]
    h = tl.arange(0, 2)[:, None]
    g = h * C + c[None, :]
    if FRAGMENT:
        # plane word r's bit b is bit `plane` of the code of element (half h, token bit i, channel c), which `frag`
        # names by its place in the plane-order planes: src = plane * 16 C + (h C + c) * 8 + i
        r = tl.arange(0, 2 * C)[:, None]  # plane word (3 C / 2 of them), bit b
        b = tl.arange(0, 32)[None, :]
        live = r < 3 * C // 2
        src = tl.load(frag + 48 * C + r * 32 + b, mask=live, other=0)
        grp = (src >> 3) % G
        el = ((grp // C) * 8 + (src & 7)) * C + grp % C  # its index in `code` [2, 8, C], row-major
        val = tl.gather(tl.reshape(code, [16 * C]), tl.reshape(el, [64 * C]), 0)
        bit = (tl.reshape(val, [2 * C, 32]) >> (src // (16 * C))) & 1
        words = (out + PLANES).to(tl.pointer_type(tl.int32))
        tl.store(words + tl.arange(0, 2 * C), tl.sum(bit << b, axis=1), mask=tl.arange(0, 2 * C) < 3 * C // 2)
        e = t[:, None] * C + c[None, :]  # element token * C + channel, as the map counts them
        tl.store(out + tl.load(frag + e), sm.to(tl.uint8))
    else:
        tl.store(out + t[:, None] * C + c[None, :], sm.to(tl.uint8))
        for p in tl.static_range(3):
            plane = tl.sum(((code >> p) & 1) << i, axis=1)
            tl.store(out + PLANES + p * G + g, plane.to(tl.uint8))
    wide = (mode >= 1).to(tl.int32)
    raw = (mode == 2).to(tl.int32)
    j = tl.arange(0, 8)[None, None, :]
    wide_bytes = tl.sum(tl.reshape(wide, [2, C // 8, 8]) << j, axis=2)  # [2, C/8]: byte g // 8, bit g % 8
    raw_bytes = tl.sum(tl.reshape(raw, [2, C // 8, 8]) << j, axis=2)
    k8 = tl.arange(0, C // 8)[None, :]
    tl.store(out + TAGS + h * (C // 8) + k8, wide_bytes.to(tl.uint8))
    tl.store(out + TAGS + TAG_PLANE + h * (C // 8) + k8, raw_bytes.to(tl.uint8))
    PAD: tl.constexpr = ESC - TAGS - 2 * TAG_PLANE  # zero bytes that align the escape area (16-channel tiles)
    if PAD > 0:
        z16 = tl.arange(0, 16)
        tl.store(out + TAGS + 2 * TAG_PLANE + z16, tl.zeros([16], tl.uint8), mask=z16 < PAD)

    at3, at_hi = escape_places(wide, raw, h, VERSION)
    ez = tl.arange(0, E_PAD)
    tl.store(out + ESC + ez, tl.zeros([E_PAD], tl.uint8), mask=ez < CAPACITY)
    tl.debug_barrier()  # the zero fill lands before the escape bytes
    plane3 = tl.sum(((code >> 3) & 1) << i, axis=1)
    tl.store(out + ESC + at3, plane3.to(tl.uint8), mask=(wide == 1) & (at3 < CAPACITY))
    for k in tl.static_range(1, 5):
        plane = tl.sum(((code >> (3 + k)) & 1) << i, axis=1)
        tl.store(out + ESC + at_hi + k, plane.to(tl.uint8), mask=(raw == 1) & (at_hi + k < CAPACITY))


@triton.jit
def mode_counts(mode):
    """Groups per mode of one tile (`[4]`, entry 3 unused)."""
    m = tl.arange(0, 4)
    return tl.sum(tl.sum((mode[:, :, None] == m[None, None, :]).to(tl.int32), axis=1), axis=0)


@triton.jit
def _encode_kernel(x_ptr, b3_ptr, b4_ptr, slot_ptr, esc_out, modes_out, frag_ptr, PERIOD, V_FROM, SLOT_BYTES,
                   CAPACITY, C: tl.constexpr, E_PAD: tl.constexpr, PLANES: tl.constexpr, TAGS: tl.constexpr,
                   ESC: tl.constexpr, VERSION: tl.constexpr, FRAGMENT: tl.constexpr):
    pid = tl.program_id(0)
    kind = pid % PERIOD
    frag = frag_ptr + (kind >= V_FROM).to(tl.int32) * 96 * C  # the V tiles' map follows the K tiles'
    out = slot_ptr + pid.to(tl.int64) * SLOT_BYTES
    t = tl.arange(0, 16)
    c = tl.arange(0, C)
    bits = tl.load(x_ptr + pid.to(tl.int64) * 16 * C + t[:, None] * C + c[None, :]).to(tl.int32) & 0xFFFF
    b3 = tl.load(b3_ptr + kind * C + c).to(tl.int32)
    b4 = tl.load(b4_ptr + kind * C + c).to(tl.int32)
    sm, code, mode, total = tile_modes(bits, b3, b4, C, VERSION)
    store_slot(out, sm, code, mode, CAPACITY, C, E_PAD, PLANES, TAGS, ESC, frag, FRAGMENT, VERSION)
    tl.store(esc_out + pid, total)
    m = tl.arange(0, 4)
    tl.store(modes_out + pid * 3 + m, mode_counts(mode), mask=m < 3)


@functools.lru_cache(maxsize=None)
def _placeholder(device: str) -> torch.Tensor:
    """A pointer the kernels never read (made once per device: no allocation inside a captured step)."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def check_fragment(fragment: torch.Tensor | None, channels: int, device, format_version: int = 2) -> torch.Tensor:
    """The fragment map of a launch: int32 `[2, 6, 16 C]` (K tiles, V tiles; `gaac_hf.format_v2.fragment_map`) on the
    tiles' device, or a placeholder where the slots are written in plane order (`fragment` None). Checks the format
    version too: 1 or 2, a fragment map with version 2 only."""
    if format_version not in (1, 2):
        raise ValueError(f"the GAAC kernels write and read format versions 1 and 2, not {format_version}")
    if fragment is not None and format_version != 2:
        raise ValueError("a fragment map orders version-2 slots only")
    if fragment is None:
        return _placeholder(str(torch.device(device)))
    if fragment.dtype != torch.int32 or fragment.shape != (2, 6, 16 * channels) or not fragment.is_contiguous() \
            or fragment.device != torch.device(device):
        raise ValueError(f"fragment must be a contiguous int32 [2, 6, {16 * channels}] map on {device}")
    return fragment


def gaac_encode(tiles: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, layout, format_version: int = 1,
                fragment: torch.Tensor | None = None, v_from: int | None = None):
    """Encode BF16 tiles `[..., P, 16, C]` with bases uint8 `[P, C]` (P = positions with their own windows, e.g.
    2 * H * tiles) into slots of `layout` (a `gaac_hf.format.TileLayout`, see `triton_ops.layout`). Returns
    `(slots uint8 [..., P, slot_bytes], escape_bytes int32 [..., P], mode_counts int32 [..., P, 3])`; a tile fits
    its slot iff escape_bytes <= layout.escape_capacity. `format_version` 2: the byte-split slots of
    `gaac_hf.format_v2` (even bases), in plane order, or, given `fragment` (the caller's map, int32 `[2, 6, 16 C]`:
    `format_v2.fragment_map`), in fragment order; positions `v_from..P-1` (default P / 2)
    are V tiles. The windows are not checked here (a caller's job: their parity is a host-side fact)."""
    if tiles.dtype != torch.bfloat16:
        raise TypeError(f"the GAAC encoder takes BF16 tiles, not {tiles.dtype}")
    *lead, period, tokens, channels = tiles.shape
    if tokens != 16 or base3.shape != (period, channels) or base4.shape != (period, channels):
        raise ValueError(f"tiles {tuple(tiles.shape)} and bases {tuple(base3.shape)} do not line up")
    frag = check_fragment(fragment, channels, tiles.device, format_version)
    offsets = slot_constants(layout, channels)
    slot_bytes, escape_capacity = layout.slot_bytes, layout.escape_capacity
    x = tiles.contiguous().view(torch.int16)
    n = x.numel() // (16 * channels)
    slots = torch.empty(*lead, period, slot_bytes, dtype=torch.uint8, device=tiles.device)
    esc = torch.empty(*lead, period, dtype=torch.int32, device=tiles.device)
    modes = torch.empty(*lead, period, 3, dtype=torch.int32, device=tiles.device)
    if n:
        with on_device_of(x):
            _encode_kernel[(n,)](x, base3.contiguous(), base4.contiguous(), slots, esc, modes, frag, period,
                                 period // 2 if v_from is None else v_from, slot_bytes, escape_capacity, C=channels,
                                 E_PAD=max(16, triton.next_power_of_2(escape_capacity)), VERSION=format_version,
                                 FRAGMENT=fragment is not None, **offsets)
    return slots, esc, modes
