"""The GAAC bitstream, defined once. `docs/format.md` is the prose version of this file.

A *tile* is the coding unit: 16 tokens x C channels of one (layer, K|V, kv-head), C = 16, 32, 64 or 128: the
largest of these that divides the head dim, which must be a multiple of 16. Head dims 64 and 128 are one tile per
block, 256 two tiles of 128 (channels 0-127 and 128-255), 80 five tiles of 16, 96 three of 32; tiles are coded
independently.
Elements are grouped in runs of 8 tokens of one channel (group g = h * C + c holds tokens 8h..8h+7 of channel c);
see docs/format.md for the measurement behind that choice.

Slot layout of one tile (all offsets in bytes, every section 16-byte aligned):

    [ sign+mantissa  16*C ][ code planes 0-2  3*G ][ mode tags  G/4 (+ pad) ][ escape area  E ]      G = 2*C groups

(the tags end on a 16-byte boundary for every C but 16, where 8 zero bytes pad them)

* sign+mantissa: one byte per element, `sign << 7 | mantissa`, token-major (`[16][C]`, like the KV itself).
* code planes: plane p (p = 0, 1, 2) holds bit p of every element's exponent code; byte g of a plane belongs
  to group g and its bit i to the group's element i (token 8h+i).
* mode tags: two bit-planes of G bits each, `wide` (mode is 4-bit or raw) then `raw`; bit g%8 of byte g//8.
  Mode 3-bit = (0,0), 4-bit = (1,0), raw = (1,1); (0,1) is invalid.
* escape area: for each group in group order, 1 byte (plane 3) if it is 4-bit, 5 bytes (planes 3-7) if it is raw,
  packed without gaps from offset 0; E, the slot's escape capacity, is fixed per calibration (multiple of 16).
  A tile whose escape bytes exceed E is not stored in a slot at all: it stays a raw BF16 tile.

Exponent code: with `e` the 8-bit BF16 exponent of an element in channel c, the group's mode picks the base
(`base3[c]` for 3-bit, `base4[c]` for 4-bit, 0 for raw) and the code is `(e - base) mod 256`; reconstruction is
`e = (code + base) mod 256`. A group is 3-bit if every `e - base3[c]` lies in [0, 8), else 4-bit if every
`e - base4[c]` lies in [0, 16), else raw. Sign and mantissa are kept verbatim, so every BF16 bit pattern round-trips.
"""

from __future__ import annotations

from dataclasses import dataclass

FORMAT_VERSION = 1
BLOCK_TOKENS = 16
GROUP_SIZE = 8
TILE_CHANNELS = (16, 32, 64, 128)
ALIGN = 16

MODE_3BIT, MODE_4BIT, MODE_RAW = 0, 1, 2
MODE_NAMES = ("3-bit", "4-bit", "raw")
ESCAPE_BYTES_PER_GROUP = (0, 1, 5)  # indexed by mode
CODE_PLANES_IN_STREAM = 3  # planes 0-2 are always stored; plane 3 (4-bit) and planes 3-7 (raw) are escapes


def tile_split(head_dim: int) -> tuple[int, int]:
    """Return `(tiles_per_head, channels_per_tile)` for a head dim: the widest tile of TILE_CHANNELS that divides it."""
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % TILE_CHANNELS[0]:
        raise ValueError(f"GAAC supports head dims that are positive multiples of {TILE_CHANNELS[0]}; this model has "
                         f"head_dim {head_dim}")
    channels = max(c for c in TILE_CHANNELS if head_dim % c == 0)
    return head_dim // channels, channels


@dataclass(frozen=True)
class TileLayout:
    """Byte offsets of one tile's slot."""

    channels: int
    escape_capacity: int

    def __post_init__(self):
        if self.channels not in TILE_CHANNELS:
            raise ValueError(f"a tile has {', '.join(map(str, TILE_CHANNELS))} channels, not {self.channels}")
        if self.escape_capacity < 0 or self.escape_capacity % ALIGN:
            raise ValueError(f"escape capacity must be a non-negative multiple of {ALIGN}, not {self.escape_capacity}")

    @classmethod
    def of_slot_bytes(cls, channels: int, slot_bytes: int) -> "TileLayout":
        """The layout whose slots are `slot_bytes` long (e.g. a slot pool's row size)."""
        capacity = slot_bytes - cls(channels, 0).fixed_bytes
        if capacity < 0:
            raise ValueError(f"{slot_bytes}-byte slots are shorter than the fixed part of a {channels}-channel slot")
        return cls(channels, capacity)

    @property
    def elements(self) -> int:
        return BLOCK_TOKENS * self.channels

    @property
    def groups(self) -> int:
        return self.elements // GROUP_SIZE

    @property
    def signmant_offset(self) -> int:
        return 0

    @property
    def planes_offset(self) -> int:
        return self.elements

    @property
    def tags_offset(self) -> int:
        return self.planes_offset + CODE_PLANES_IN_STREAM * self.groups

    @property
    def tag_plane_bytes(self) -> int:
        return self.groups // 8

    @property
    def tags_end(self) -> int:
        """End of the mode tags; zero padding up to `escape_offset` follows (16-channel tiles only)."""
        return self.tags_offset + 2 * self.tag_plane_bytes

    @property
    def escape_offset(self) -> int:
        return -(-self.tags_end // ALIGN) * ALIGN

    @property
    def fixed_bytes(self) -> int:
        """Bytes of a slot before its escape area (sign+mantissa, code planes, mode tags)."""
        return self.escape_offset

    @property
    def slot_bytes(self) -> int:
        return self.escape_offset + self.escape_capacity

    @property
    def raw_bytes(self) -> int:
        """Bytes of the tile kept as raw BF16."""
        return 2 * self.elements


# Bytes of one block-table entry (int32: slot index, or -1 - raw index for a raw tile).
BLOCK_TABLE_ENTRY_BYTES = 4
