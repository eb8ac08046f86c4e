"""The format-2 reference (`gaac_hf/format_v2.py`): byte-split slots round-trip bit for bit at every tile width, in
plane order and in the CUDA kernel's fragment order; bad windows and corrupt slots get clear errors."""

import pytest
import torch

from gaac_hf.format import MODE_3BIT, MODE_4BIT, MODE_RAW, TileLayout
from gaac_hf.format_v2 import (
    decode,
    decode_tiles,
    encode,
    encode_tiles,
    from_fragment_order,
    to_fragment_order,
)


def tiles(c, n=6, seed=0):
    """BF16 tiles `[n, 16, c]` with per-channel scales, exact zeros, subnormal-range and huge values (raw groups),
    and even windows around the bulk of each channel's exponents."""
    gen = torch.Generator().manual_seed(seed + c)
    scale = torch.exp2(torch.randint(-8, 6, (c,), generator=gen).float())
    x = torch.randn(n, 16, c, generator=gen) * scale
    x[0, 3, :5] = 0.0
    x[1, 9, 2] = -1e-35
    x[2, 4, c - 1] = 6e4
    x = x.to(torch.bfloat16)
    e = (x.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    base3 = ((e.reshape(-1, c).float().median(0).values.to(torch.int32) - 4) & ~1).clamp(min=0)
    base4 = ((base3 - 4) & ~1).clamp(min=0)
    return x, base3.to(torch.uint8), base4.to(torch.uint8)


@pytest.mark.parametrize("c", [16, 32, 64, 128])
@pytest.mark.parametrize("is_v", [False, True])
def test_round_trip_is_bit_exact(c, is_v):
    x, b3, b4 = tiles(c)
    slots, fits, mode = encode(x, b3, b4, 512, is_v)
    assert fits.all() and slots.dtype == torch.uint8 and slots.shape[-1] == TileLayout(c, 512).slot_bytes
    assert all((mode == m).any() for m in (MODE_3BIT, MODE_4BIT, MODE_RAW))
    got = decode(slots, b3, b4, c, is_v)
    assert torch.equal(got.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("c", [64, 128])
@pytest.mark.parametrize("is_v", [False, True])
def test_fragment_order_is_a_permutation_of_the_plane_order(c, is_v):
    x, b3, b4 = tiles(c, seed=1)
    plain, _, _ = encode_tiles(x, b3, b4, 256)
    frag = to_fragment_order(plain, c, is_v)
    assert not torch.equal(frag, plain)
    assert torch.equal(from_fragment_order(frag, c, is_v), plain)
    # the same low bytes and the same set bits, moved: nothing lost, nothing duplicated
    assert torch.equal(frag[..., :16 * c].sort(-1).values, plain[..., :16 * c].sort(-1).values)
    pop = lambda t: sum(((t.to(torch.int32) >> b) & 1).sum() for b in range(8))  # noqa: E731
    assert pop(frag) == pop(plain)


def test_a_tile_over_its_capacity_does_not_fit():
    x, b3, b4 = tiles(64, seed=2)
    _, fits, _ = encode_tiles(x, b3, b4, 0)
    assert not fits[:3].any()  # the tiles with zeros / outliers need escape bytes


def test_odd_windows_are_rejected():
    x, b3, b4 = tiles(32)
    with pytest.raises(ValueError, match="even exponents"):
        encode_tiles(x, b3 | 1, b4, 128)
    slots, _, _ = encode_tiles(x, b3, b4, 128)
    with pytest.raises(ValueError, match="even exponents"):
        decode_tiles(slots, b3, b4 | 1, 32)


def test_corrupt_slots_are_rejected():
    x, b3, b4 = tiles(32)
    slots, _, _ = encode_tiles(x, b3, b4, 128)
    layout = TileLayout(32, 128)
    bad = slots.clone()
    bad[..., layout.tags_offset + layout.tag_plane_bytes] = 0xFF  # raw bits without the wide bits
    bad[..., layout.tags_offset] = 0
    with pytest.raises(ValueError, match="raw bit without the wide bit"):
        decode_tiles(bad, b3, b4, 32)
    with pytest.raises(TypeError, match="uint8"):
        decode_tiles(slots.to(torch.int16), b3, b4, 32)


def test_escapes_are_ordered_by_plane():
    """Version 2's escape area: the plane-3 byte of every wide group (4-bit and raw) in group order, then planes
    4..7 of the raw groups, 4 bytes each (version 1: each group's bytes together)."""
    from gaac_hf.codec import escape_positions

    mode = torch.tensor([[0, 1, 2, 0, 1, 2, 1, 0]])
    pos, total = escape_positions(mode, "planes")
    assert total.tolist() == [5 + 4 * 2]
    assert pos[0, :, 0].tolist() == [-1, 0, 1, -1, 2, 3, 4, -1]  # plane 3: rank among the 5 wide groups
    assert pos[0, 2].tolist() == [1, 5, 6, 7, 8] and pos[0, 5].tolist() == [3, 9, 10, 11, 12]
    assert (pos[0, [0, 1, 3, 4, 6, 7], 1:] == -1).all()
    v1, total1 = escape_positions(mode, "groups")
    assert total1.tolist() == total.tolist() and v1[0, 2].tolist() == [1, 2, 3, 4, 5]
    # the slot bytes follow it: a raw group's code bits 2..6 sit at those places
    x, b3, b4 = tiles(64, 3)
    slots, fits, modes = encode_tiles(x, b3, b4, 1280)
    from gaac_hf.codec import unpack_bits

    layout = TileLayout(64, 1280)
    code = ((x.view(torch.int16).to(torch.int32) >> 8) & 0x7F)  # e >> 1, the raw groups' code (base 0)
    for t in range(3):  # each of these tiles has a raw group (a zero, a tiny and a huge value)
        p, _ = escape_positions(modes[t], "planes")
        raw = (modes[t] == 2).nonzero().reshape(-1)
        assert raw.numel()
        g = int(raw[0])
        area = slots[t, layout.escape_offset:]
        want = code[t].reshape(2, 8, 64).transpose(1, 2).reshape(128, 8)[g]  # group g's 8 codes
        for k in range(5):
            assert unpack_bits(area[p[g, k]]).tolist() == ((want >> (2 + k)) & 1).tolist()
