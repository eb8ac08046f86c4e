"""The reference codec round-trips every BF16 bit pattern, in every mode, at every group position."""

import pytest
import torch

from gaac_hf.codec import (
    decode_tiles,
    encode_tiles,
    from_groups,
    merge_head,
    split_fields,
    split_head,
    to_groups,
)
from gaac_hf.format import MODE_3BIT, MODE_4BIT, MODE_RAW, TileLayout

ALL_SIGNMANT = torch.arange(256, dtype=torch.int32)


def bits(x):
    return x.view(torch.int16)


def tiles_of_exponent(e: int, channels: int, roll: int) -> torch.Tensor:
    """One tile per call: every element has exponent `e`; sign+mantissa runs over all 256 values, rolled."""
    idx = (torch.arange(16 * channels, dtype=torch.int32) * 7 + roll) % 256
    sm = ALL_SIGNMANT[idx].reshape(16, channels)
    b = ((sm & 0x80) << 8) | (e << 7) | (sm & 0x7F)
    return torch.where(b >= 0x8000, b - 0x10000, b).to(torch.int16).view(torch.bfloat16)


def forced_bases(e: torch.Tensor, mode: int, channels: int):
    """Per-channel bases that put exponents `e` (one per tile) into `mode`, at every offset inside the window."""
    c = torch.arange(channels)
    off3, off4 = c % 8, c % 16
    e = e[:, None]
    if mode == MODE_3BIT:
        b3 = (e - off3).clamp(0, 248)
        b4 = torch.where(e >= 128, e - 64, e + 64).clamp(0, 240)  # anywhere, 3-bit wins
    elif mode == MODE_4BIT:
        b4 = (e - off4).clamp(0, 240)
        b3 = torch.where(e >= 128, e - 100, e + 100).clamp(0, 248)  # window away from e
    else:
        b3 = torch.where(e >= 128, e - 100, e + 100).clamp(0, 248)
        b4 = torch.where(e >= 128, e - 100, e + 100).clamp(0, 240)
    return b3.to(torch.uint8), b4.to(torch.uint8)


@pytest.mark.parametrize("channels", [16, 32, 64, 128])
@pytest.mark.parametrize("mode", [MODE_3BIT, MODE_4BIT, MODE_RAW])
def test_every_bf16_pattern_round_trips_in_every_mode(channels, mode):
    exps = torch.arange(256)
    seen = torch.zeros(65536, dtype=torch.bool)
    for roll in range(8):  # each pattern lands on all 8 positions of a group and many channels
        x = torch.stack([tiles_of_exponent(int(e), channels, roll * 37) for e in exps])
        b3, b4 = forced_bases(exps, mode, channels)
        enc = encode_tiles(x, b3, b4, escape_capacity=5 * 2 * channels)
        assert (enc.modes == mode).all(), "bases did not force the intended mode"
        assert enc.fits.all()
        y = decode_tiles(enc.slots, b3, b4, channels)
        assert torch.equal(bits(y), bits(x))
        seen[(bits(x).to(torch.int32) & 0xFFFF).reshape(-1).long()] = True
    assert seen.all(), "not every one of the 65,536 patterns was exercised"


def test_special_values_round_trip_with_realistic_windows():
    specials = torch.tensor([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x0080,
                             0x7F7F, 0xFF7F, 0x3F80, 0xBF80], dtype=torch.int32)
    x = torch.randn(3, 16, 128).to(torch.bfloat16)
    flat = bits(x).reshape(3, -1)
    pos = torch.randperm(16 * 128)[: specials.numel()]
    flat[:, pos] = torch.where(specials >= 0x8000, specials - 0x10000, specials).to(torch.int16)
    b3 = torch.full((128,), 123, dtype=torch.uint8)
    b4 = torch.full((128,), 118, dtype=torch.uint8)
    enc = encode_tiles(x, b3, b4, escape_capacity=1280)
    assert (enc.modes == MODE_RAW).any()
    assert torch.equal(bits(decode_tiles(enc.slots, b3, b4, 128)), bits(x))


def random_tiles(n, channels, gen, scale_spread=8.0):
    scale = torch.exp2(torch.randint(-12, 12, (n, 1, channels), generator=gen).float())
    noise = torch.randn(n, 16, channels, generator=gen) * (1 + scale_spread * torch.rand(n, 16, 1, generator=gen))
    return (noise * scale).to(torch.bfloat16)


@pytest.mark.parametrize("channels", [64, 128])
@pytest.mark.parametrize("seed", range(4))
def test_random_blocks_with_foreign_windows_round_trip(channels, seed):
    """Windows calibrated for other data only change the mode mix and the size, never the values."""
    gen = torch.Generator().manual_seed(seed)
    x = random_tiles(64, channels, gen)
    b3 = torch.randint(0, 249, (channels,), generator=gen, dtype=torch.int32).to(torch.uint8)
    b4 = torch.randint(0, 241, (channels,), generator=gen, dtype=torch.int32).to(torch.uint8)
    enc = encode_tiles(x, b3, b4, escape_capacity=5 * 2 * channels)
    assert torch.equal(bits(decode_tiles(enc.slots, b3, b4, channels)), bits(x))
    # the modes are what the rule says: the exponents of a 3-bit group all sit in the 8-wide window
    e = split_fields(x)[0]
    grouped, base = to_groups(e), to_groups(b3.to(torch.int32).expand(16, channels))
    in3 = ((grouped - base >= 0) & (grouped - base < 8)).all(-1)
    assert torch.equal(in3, enc.modes == MODE_3BIT)


def test_mixed_modes_and_escape_accounting():
    gen = torch.Generator().manual_seed(1)
    x = random_tiles(32, 128, gen, scale_spread=0.0)
    e = split_fields(x)[0]
    hist = torch.stack([torch.bincount(e[..., c].reshape(-1), minlength=256) for c in range(128)])
    from gaac_hf.calibrate import windows_from_histogram

    b3, b4 = windows_from_histogram(hist)
    enc = encode_tiles(x, b3, b4, escape_capacity=0)
    counts = torch.bincount(enc.modes.reshape(-1), minlength=3)
    assert (counts > 0).all(), counts  # a real mix
    expected = (enc.modes == MODE_4BIT).sum(-1) + 5 * (enc.modes == MODE_RAW).sum(-1)
    assert torch.equal(enc.escape_bytes, expected.to(torch.int32))
    assert torch.equal(enc.fits, expected == 0)
    # with room for every escape, all tiles fit and decode exactly
    enc = encode_tiles(x, b3, b4, escape_capacity=1280)
    assert enc.fits.all()
    assert torch.equal(bits(decode_tiles(enc.slots, b3, b4, 128)), bits(x))


def test_slot_layout_sizes_match_the_format():
    layout = TileLayout(128, 128)
    assert (layout.planes_offset, layout.tags_offset, layout.escape_offset, layout.slot_bytes) == (
        2048, 2048 + 768, 2048 + 768 + 64, 3008)
    assert TileLayout(64, 32).slot_bytes == 1024 + 384 + 32 + 32
    # 16-channel tiles: 8 tag bytes, then 8 zero bytes so that the escape area stays 16-byte aligned
    small = TileLayout(16, 16)
    assert (small.tags_offset, small.tags_end, small.escape_offset, small.slot_bytes) == (352, 360, 368, 384)
    assert TileLayout(32, 0).escape_offset == 512 + 192 + 16
    y = torch.randn(3, 16, 16).to(torch.bfloat16)
    zz = torch.zeros(16, dtype=torch.uint8)
    assert (encode_tiles(y, zz, zz, 16).slots[:, 360:368] == 0).all()
    with pytest.raises(ValueError, match="16, 32, 64, 128 channels"):
        TileLayout(48, 0)
    x = torch.randn(2, 16, 64).to(torch.bfloat16)
    z = torch.zeros(64, dtype=torch.uint8)
    assert encode_tiles(x, z, z, 32).slots.shape == (2, TileLayout(64, 32).slot_bytes)


def test_grouping_views_are_inverse():
    t = torch.arange(16 * 64).reshape(16, 64)
    for grouping in ("token", "channel"):
        g = to_groups(t, grouping)
        assert g.shape == (128, 8)
        assert torch.equal(from_groups(g, 64, grouping), t)
    # token grouping: group g = h * C + c holds tokens 8h..8h+7 of channel c
    g = to_groups(t, "token")
    assert torch.equal(g[64 + 5], t[8:16, 5])


def test_head_dim_256_is_two_halves():
    x = torch.randn(2, 3, 16, 256).to(torch.bfloat16)
    tiles = split_head(x)
    assert tiles.shape == (2, 3, 2, 16, 128)
    assert torch.equal(bits(tiles[:, :, 1]), bits(x[..., 128:]))
    assert torch.equal(bits(merge_head(tiles)), bits(x))


def test_non_bf16_input_is_rejected():
    z = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(TypeError, match="BF16"):
        encode_tiles(torch.zeros(1, 16, 128, dtype=torch.float16), z, z, 0)
    with pytest.raises(TypeError, match="BF16"):
        encode_tiles(torch.zeros(1, 16, 128, dtype=torch.float32), z, z, 0)


def test_unsupported_shapes_are_rejected():
    z = torch.zeros(96, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16, 32, 64, 128 channels"):  # a head of 96 is 3 tiles of 32, not one tile
        encode_tiles(torch.zeros(1, 16, 96, dtype=torch.bfloat16), z, z, 0)
    with pytest.raises(ValueError, match="head_dim 72"):
        split_head(torch.zeros(1, 16, 72, dtype=torch.bfloat16))
    assert split_head(torch.zeros(1, 16, 80, dtype=torch.bfloat16)).shape == (1, 5, 16, 16)
    with pytest.raises(ValueError, match="16"):
        z128 = torch.zeros(128, dtype=torch.uint8)
        encode_tiles(torch.zeros(1, 8, 128, dtype=torch.bfloat16), z128, z128, 0)


def test_corrupt_slots_are_detected():
    x = torch.randn(1, 16, 64).to(torch.bfloat16)
    z = torch.full((64,), 120, dtype=torch.uint8)
    enc = encode_tiles(x, z, z, 16)
    bad = enc.slots.clone()
    layout = TileLayout(64, 16)
    bad[0, layout.tags_offset + layout.tag_plane_bytes] = 0xFF  # raw bits without wide bits
    bad[0, layout.tags_offset] = 0x00
    with pytest.raises(ValueError, match="corrupt"):
        decode_tiles(bad, z, z, 64)
    bad = enc.slots.clone()
    bad[0, layout.tags_offset: layout.escape_offset] = 0xFF  # every group raw: far more escapes than 16 bytes
    with pytest.raises(ValueError, match="corrupt"):
        decode_tiles(bad, z, z, 64)
