"""The exponent-code study (`benchmarks/exponent_code_bounds.py`) on exponents whose answers are known."""

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from exponent_code_bounds import (fixed_width_bits, group_extent, group_modes, group_window,  # noqa: E402
                                  resident_bytes, study, widen)


def _kv(exps: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """BF16 values with exponents `exps` (int, any shape) and random signs and mantissas."""
    gen = torch.Generator().manual_seed(seed)
    low = torch.randint(0, 256, exps.shape, generator=gen)  # sign << 7 | mantissa
    bits = ((low >> 7) << 15) | (exps.long() << 7) | (low & 0x7F)
    return (bits - 65536 * (bits >= 32768)).to(torch.int16).view(torch.bfloat16)


def test_one_exponent_per_channel_costs_the_tags_and_planes_only():
    exps = torch.full((1, 2, 1, 64, 16), 127)
    r = study(_kv(exps))["rows"]
    assert r["gaac"]["exponent_bits"] == (2 + 3 * 8) / 8 and r["gaac"]["modes"]["3bit"] == 1
    assert r["gaac_2bit_mode"]["exponent_bits"] == (2 + 2 * 8) / 8 and r["gaac_2bit_mode"]["modes"]["2bit"] == 1
    # a table that saw 32 equal exponents: log2(33 / 32) bits each; the context model about as little
    assert abs(r["static_entropy"]["exponent_bits"] - math.log2(33 / 32)) < 1e-9
    assert r["context_entropy"]["exponent_bits"] < 0.1
    assert r["gaac"]["bits_per_element"] == 8 + 3.25 and r["gaac"]["bytes_vs_gaac"] == 1


def test_uniform_exponents_cost_their_entropy():
    gen = torch.Generator().manual_seed(1)
    four = 128 + torch.randint(0, 4, (1, 2, 1, 2048, 16), generator=gen)  # 2 bits of entropy, in every window
    r = study(_kv(four))["rows"]
    assert abs(r["static_entropy"]["exponent_bits"] - 2) < 0.01
    assert abs(r["context_entropy"]["exponent_bits"] - 2) < 0.05  # independent tokens: no context to use
    assert r["gaac_2bit_mode"]["modes"]["2bit"] == 1 and r["gaac"]["modes"]["3bit"] == 1
    sixteen = 120 + torch.randint(0, 16, (1, 2, 1, 2048, 16), generator=gen)  # a group of 8 rarely fits 8 values
    r16 = study(_kv(sixteen))["rows"]
    assert r16["gaac"]["modes"]["4bit"] > 0.9 and r16["gaac"]["modes"]["raw"] == 0
    assert abs(r16["static_entropy"]["exponent_bits"] - 4) < 0.02


def test_group_window_holds_the_most_whole_groups():
    # channel 0: groups spanning [10, 12] x3 and [20, 23] x1; channel 1: [0, 0] and [250, 253]
    lo = torch.tensor([[10, 0], [10, 250], [10, 250], [20, 250]])
    hi = torch.tensor([[12, 0], [12, 253], [12, 253], [23, 253]])
    base = group_window(lo, hi, 4)
    assert base.tolist() == [9, 250]  # [9, 13) holds channel 0's three (the lowest such base), [250, 254) channel 1's
    bits, share = fixed_width_bits(lo, hi, torch.tensor([8, 248]).to(torch.uint8),
                                   torch.tensor([8, 240]).to(torch.uint8), base)
    # [20, 23] is past [8, 16) but in [8, 24): 4-bit; [0, 0] is in no window of channel 1: raw
    assert share == {"2bit": 6 / 8, "3bit": 0.0, "4bit": 1 / 8, "raw": 1 / 8}
    assert bits == (2 + 24 - 6 + 8 / 8 + 40 / 8) / 8


def test_group_extent_takes_groups_of_eight_tokens_of_one_channel():
    e = torch.arange(32).reshape(1, 1, 1, 16, 2)  # token t, channel c: 2t + c
    lo, hi = group_extent(e)
    assert lo.flatten().tolist() == [0, 1, 16, 17] and hi.flatten().tolist() == [14, 15, 30, 31]


def test_resident_bytes_of_the_format_as_is_match_the_caches_choice():
    from gaac_hf.calibrate import (choose_escape_capacity, exponent_histogram, exponents, resident_bytes_per_tile,
                                   tile_escape_bytes, windows_from_histogram)

    gen = torch.Generator().manual_seed(2)
    kv = (torch.randn(2, 2, 1, 256, 64, generator=gen) * torch.rand(1, 1, 1, 1, 64, generator=gen) * 4).bfloat16()
    base3, base4 = windows_from_histogram(exponent_histogram(kv), 2)
    lo, hi = group_extent(exponents(kv))
    r = resident_bytes(group_modes(lo, hi, base3, base4), False)
    esc = tile_escape_bytes(kv, base3, base4)
    cap = choose_escape_capacity(esc, 64)
    assert r["capacity"] == cap and abs(r["bytes_per_tile"] - resident_bytes_per_tile(esc, 64, cap).item()) < 1e-9
    # with a 2-bit mode, every group of one channel in its window: 2 code planes, the third in the escape area
    two = resident_bytes(torch.zeros(1, 4, 64, dtype=torch.int64), True)
    assert two == {"capacity": 0, "bytes_per_tile": 1024 + 256 + 32 + 4, "raw_tile_share": 0.0}
    three = resident_bytes(torch.ones(1, 4, 64, dtype=torch.int64), True)  # plane 2 as escapes: 128 bytes a tile
    assert three["capacity"] == 128 and three["bytes_per_tile"] == 1312 + 128 + 4


def test_widen_puts_streams_side_by_side():
    modes = torch.stack([torch.zeros(4, 64), torch.ones(4, 64), 2 * torch.ones(4, 64)]).reshape(1, 3, 1, 4, 64)
    wide = widen(modes.long(), 128)
    assert wide.shape == (1, 4, 128)  # the third stream has no partner
    assert wide[0, :, :64].eq(0).all() and wide[0, :, 64:].eq(1).all()


def test_group_window_aligns_and_skips():
    lo = torch.tensor([[11], [11], [28]])
    hi = torch.tensor([[13], [13], [31]])
    assert group_window(lo, hi, 4).tolist() == [10]  # bases 10 and 11 hold both; the lowest
    assert group_window(lo, hi, 4, align=2).tolist() == [10]
    assert group_window(lo, hi, 4, align=4).tolist() == [28]  # no multiple of 4 in [10, 11]: [28, 32) holds one
    skip = torch.tensor([[True], [True], [False]])
    assert group_window(lo, hi, 4, skip=skip).tolist() == [28]
