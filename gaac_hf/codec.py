"""Reference GAAC encoder and decoder in torch: the oracle every kernel is tested against.

Vectorized over any leading dimensions, on any device. Layout and rules are in `format.py` / docs/format.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .format import (
    BLOCK_TOKENS,
    CODE_PLANES_IN_STREAM,
    ESCAPE_BYTES_PER_GROUP,
    GROUP_SIZE,
    MODE_3BIT,
    MODE_4BIT,
    MODE_RAW,
    TileLayout,
    tile_split,
)

# Element order inside a group: "token" = 8 tokens of one channel (the format's), "channel" = 8 channels of one
# token (the other candidate, kept for the measurement in docs/format.md).
FORMAT_GROUPING = "token"


def check_bf16(x: torch.Tensor, what: str = "KV") -> None:
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the GAAC codec is lossless for BF16 only; {what} has dtype {x.dtype}")


def split_fields(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 -> (8-bit exponent, sign<<7 | mantissa), both int32."""
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    return (bits >> 7) & 0xFF, ((bits >> 8) & 0x80) | (bits & 0x7F)


def join_fields(exponent: torch.Tensor, signmant: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_fields`: int32 fields -> BF16."""
    bits = ((signmant & 0x80) << 8) | (exponent << 7) | (signmant & 0x7F)
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(torch.bfloat16)


def to_groups(t: torch.Tensor, grouping: str = FORMAT_GROUPING) -> torch.Tensor:
    """`[..., 16, C]` -> `[..., G, 8]` in group order."""
    *lead, tokens, channels = t.shape
    if grouping == "token":
        return t.reshape(*lead, tokens // GROUP_SIZE, GROUP_SIZE, channels).transpose(-1, -2).reshape(
            *lead, tokens * channels // GROUP_SIZE, GROUP_SIZE)
    if grouping == "channel":
        return t.reshape(*lead, tokens * channels // GROUP_SIZE, GROUP_SIZE)
    raise ValueError(f"unknown grouping {grouping!r}")


def from_groups(t: torch.Tensor, channels: int, grouping: str = FORMAT_GROUPING) -> torch.Tensor:
    """`[..., G, 8]` -> `[..., 16, C]`, inverse of `to_groups`."""
    *lead, groups, _ = t.shape
    tokens = groups * GROUP_SIZE // channels
    if grouping == "token":
        return t.reshape(*lead, tokens // GROUP_SIZE, channels, GROUP_SIZE).transpose(-1, -2).reshape(
            *lead, tokens, channels)
    if grouping == "channel":
        return t.reshape(*lead, tokens, channels)
    raise ValueError(f"unknown grouping {grouping!r}")


def group_modes(exponent: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor,
                grouping: str = FORMAT_GROUPING) -> torch.Tensor:
    """Mode of every group of `[..., 16, C]` exponents under per-channel bases `[..., C]` -> `[..., G]` int32."""
    shape = exponent.shape
    e = to_groups(exponent, grouping)
    b3 = to_groups(base3.to(torch.int32).unsqueeze(-2).expand(shape), grouping)
    b4 = to_groups(base4.to(torch.int32).unsqueeze(-2).expand(shape), grouping)
    d3, d4 = e - b3, e - b4
    fit3 = ((d3 >= 0) & (d3 < 8)).all(-1)
    fit4 = ((d4 >= 0) & (d4 < 16)).all(-1)
    return torch.where(fit3, MODE_3BIT, torch.where(fit4, MODE_4BIT, MODE_RAW)).to(torch.int32)


def escape_bytes(modes: torch.Tensor) -> torch.Tensor:
    """Escape bytes needed by each tile, from its group modes `[..., G]`."""
    weights = torch.tensor(ESCAPE_BYTES_PER_GROUP, dtype=torch.int32, device=modes.device)
    return weights[modes.long()].sum(-1, dtype=torch.int32)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """`[..., n, 8]` of 0/1 -> `[..., n]` bytes, element i in bit i."""
    shifts = torch.arange(8, device=bits.device, dtype=torch.int32)
    return (bits.to(torch.int32) << shifts).sum(-1, dtype=torch.int32)


def unpack_bits(bytes_: torch.Tensor) -> torch.Tensor:
    """`[..., n]` bytes -> `[..., n, 8]` bits."""
    shifts = torch.arange(8, device=bytes_.device, dtype=torch.int32)
    return (bytes_.to(torch.int32).unsqueeze(-1) >> shifts) & 1


def group_bases(mode: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, shape) -> torch.Tensor:
    b3 = to_groups(base3.to(torch.int32).unsqueeze(-2).expand(shape))
    b4 = to_groups(base4.to(torch.int32).unsqueeze(-2).expand(shape))
    m = mode.unsqueeze(-1)
    return torch.where(m == MODE_3BIT, b3, torch.where(m == MODE_4BIT, b4, torch.zeros_like(b3)))


def escape_offsets(mode: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.tensor(ESCAPE_BYTES_PER_GROUP, dtype=torch.int32, device=mode.device)[mode.long()]
    return torch.cumsum(weights, -1) - weights, weights


ESCAPE_ORDERS = ("groups", "planes")


def escape_positions(mode: torch.Tensor, order: str = "groups") -> tuple[torch.Tensor, torch.Tensor]:
    """Where each group's escaped planes 3..7 lie in the escape area: int32 `[..., G, 5]` (byte index, or -1 where
    the group has no such byte) and the escape bytes of each tile `[...]`. `order` "groups" (format version 1): each
    group's bytes together, in group order; "planes" (format version 2): first the plane-3 byte of every wide group
    (4-bit and raw) in group order, then planes 4..7 of every raw group, 4 bytes each in group order (a reader finds a
    plane-3 byte by one rank over the wide tags, whatever the raw groups)."""
    if order not in ESCAPE_ORDERS:
        raise ValueError(f"escape order is one of {ESCAPE_ORDERS}, not {order!r}")
    offsets, weights = escape_offsets(mode)
    k = torch.arange(5, device=mode.device, dtype=torch.int32)
    if order == "groups":
        pos = offsets.unsqueeze(-1) + k
        return torch.where(k < weights.unsqueeze(-1), pos, -1), weights.sum(-1)
    wide = (mode >= MODE_4BIT).to(torch.int32)
    raw = (mode == MODE_RAW).to(torch.int32)
    n_wide = wide.sum(-1, keepdim=True)
    rank_wide = torch.cumsum(wide, -1) - wide
    rank_raw = torch.cumsum(raw, -1) - raw
    pos = torch.where(k == 0, rank_wide.unsqueeze(-1), (n_wide + 4 * rank_raw).unsqueeze(-1) + k - 1)
    has = torch.where(k == 0, wide.unsqueeze(-1), raw.unsqueeze(-1)) == 1
    return torch.where(has, pos, -1), weights.sum(-1)


@dataclass
class EncodedTiles:
    """Output of `encode_tiles` for tiles `[..., 16, C]`."""

    slots: torch.Tensor  # uint8 [..., slot_bytes]; escape area truncated to capacity where `fits` is False
    fits: torch.Tensor  # bool [...]: escape bytes <= capacity, i.e. the tile goes to a slot (else raw BF16)
    escape_bytes: torch.Tensor  # int32 [...]
    modes: torch.Tensor  # int32 [..., G]


def pack_slots(verbatim: torch.Tensor, planes: torch.Tensor, mode: torch.Tensor, escape_capacity: int,
               escape_order: str = "groups"):
    """The slot container, shared by the format versions: the verbatim byte of every element `[..., 16, C]`, the 8
    bit-planes of every group `[..., 8, G]` (planes 0-2 stored, 3 escaped by wide groups, 3-7 by raw ones) and the
    modes `[..., G]` -> `(slots uint8 [..., slot_bytes], escape bytes int32 [...])`; escapes past the capacity are
    cut (such a tile does not fit its slot). `escape_order`: see `escape_positions`."""
    *lead, _, channels = verbatim.shape
    layout = TileLayout(channels, escape_capacity)
    tags = torch.stack([(mode >= MODE_4BIT), (mode == MODE_RAW)], -2)  # [..., 2, G]
    tags = pack_bits(tags.reshape(*lead, 2, layout.tag_plane_bytes, 8)).reshape(*lead, 2 * layout.tag_plane_bytes)
    positions, total = escape_positions(mode, escape_order)
    values = planes[..., CODE_PLANES_IN_STREAM:, :].transpose(-1, -2)  # [..., G, 5]: planes 3..7 of each group
    dump = max(5 * layout.groups, escape_capacity)  # every escape byte of a tile lies below this index
    index = torch.where(positions >= 0, positions, dump)
    area = torch.zeros(*lead, dump + 1, dtype=torch.int32, device=mode.device)
    area.scatter_(-1, index.reshape(*lead, 5 * layout.groups).long(), values.reshape(*lead, 5 * layout.groups))
    pad = torch.zeros(*lead, layout.escape_offset - layout.tags_end,
                      dtype=torch.int32, device=mode.device)  # zero bytes that align the escape area (C = 16 only)
    slots = torch.cat(
        [verbatim.reshape(*lead, layout.elements),
         planes[..., :CODE_PLANES_IN_STREAM, :].reshape(*lead, CODE_PLANES_IN_STREAM * layout.groups), tags, pad,
         area[..., :escape_capacity]], -1).to(torch.uint8)
    return slots, total


def unpack_slots(slots: torch.Tensor, channels: int, escape_order: str = "groups"):
    """The inverse of `pack_slots` for slots that fit: `(verbatim int32 [..., 16, C], planes int32 [..., 8, G, 8]
    (bit i of group g's plane p: element i), modes [..., G])`, escaped planes 0 where a group has none. A corrupt
    slot (a raw tag without its wide tag, more escapes than the slot holds) raises `ValueError`."""
    if slots.dtype != torch.uint8:
        raise TypeError(f"slots must be uint8, got {slots.dtype}")
    layout = TileLayout.of_slot_bytes(channels, slots.shape[-1])
    lead = slots.shape[:-1]
    s = slots.to(torch.int32)
    verbatim = s[..., :layout.planes_offset].reshape(*lead, BLOCK_TOKENS, channels)
    stored = s[..., layout.planes_offset:layout.tags_offset].reshape(*lead, CODE_PLANES_IN_STREAM, layout.groups)
    tags = unpack_bits(s[..., layout.tags_offset:layout.tags_end].reshape(*lead, 2, layout.tag_plane_bytes)).reshape(
        *lead, 2, layout.groups)
    wide, raw = tags[..., 0, :], tags[..., 1, :]
    if bool((raw > wide).any()):
        raise ValueError("corrupt GAAC slot: a mode tag has the raw bit without the wide bit")
    mode = wide + raw
    positions, total = escape_positions(mode, escape_order)
    if bool((total > layout.escape_capacity).any()):
        raise ValueError("corrupt GAAC slot: its mode tags need more escape bytes than the slot holds")
    area = torch.nn.functional.pad(s[..., layout.escape_offset:], (0, 1))  # (a capacity of 0 still gathers)
    index = positions.clamp(min=0).reshape(*lead, 5 * layout.groups)
    values = torch.gather(area, -1, index.long()).reshape(*lead, layout.groups, 5)
    values = torch.where(positions >= 0, values, 0)
    planes = torch.cat([stored, values.transpose(-1, -2)], -2)  # [..., 8, G]
    return verbatim, unpack_bits(planes), mode


def encode_tiles(x: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, escape_capacity: int) -> EncodedTiles:
    """Encode BF16 tiles `[..., 16, C]` (C = 16, 32, 64 or 128) with per-channel bases `[..., C]` (uint8,
    broadcastable)."""
    check_bf16(x)
    if x.dim() < 2 or x.shape[-2] != BLOCK_TOKENS:
        raise ValueError(f"tiles must have shape [..., {BLOCK_TOKENS}, C]; got {tuple(x.shape)}")
    layout = TileLayout(x.shape[-1], escape_capacity)
    lead = x.shape[:-2]
    base3 = base3.expand(*lead, layout.channels)
    base4 = base4.expand(*lead, layout.channels)
    exponent, signmant = split_fields(x)
    mode = group_modes(exponent, base3, base4)
    code = (to_groups(exponent) - group_bases(mode, base3, base4, exponent.shape)) & 0xFF  # [..., G, 8]
    planes = torch.stack([pack_bits((code >> p) & 1) for p in range(8)], -2)  # [..., 8, G]
    slots, total = pack_slots(signmant, planes, mode, escape_capacity)
    return EncodedTiles(slots, total <= escape_capacity, total, mode)


def decode_tiles(slots: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, channels: int) -> torch.Tensor:
    """Decode slots `[..., slot_bytes]` (uint8) back to BF16 tiles `[..., 16, C]`, bit-exactly."""
    signmant, planes, mode = unpack_slots(slots, channels)
    lead = slots.shape[:-1]
    code = sum(planes[..., p, :, :] << p for p in range(8))  # [..., G, 8]
    shape = (*lead, BLOCK_TOKENS, channels)
    exponent = from_groups((code + group_bases(mode, base3.expand(*lead, channels), base4.expand(*lead, channels),
                                                shape)) & 0xFF, channels)
    return join_fields(exponent, signmant)


def split_head(x: torch.Tensor) -> torch.Tensor:
    """`[..., T, head_dim]` -> `[..., tiles, T, C]`: head dim 256 becomes two 128-channel halves."""
    n, c = tile_split(x.shape[-1])
    return x.reshape(*x.shape[:-1], n, c).movedim(-2, -3)


def merge_head(x: torch.Tensor) -> torch.Tensor:
    """Inverse of `split_head`."""
    return x.movedim(-3, -2).reshape(*x.shape[:-3], x.shape[-2], x.shape[-3] * x.shape[-1])
