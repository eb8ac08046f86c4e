"""The tag-free slot study (`benchmarks/format_channel_modes.py`) on synthetic KV whose answers are known."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from format_channel_modes import study  # noqa: E402


def kv_with_exponents(e: torch.Tensor) -> torch.Tensor:
    """BF16 values with exponent bytes `e` (sign and mantissa zero)."""
    return (e.to(torch.int32) << 7).to(torch.int16).view(torch.bfloat16)


def test_all_narrow_groups_need_no_fourth_plane():
    gen = torch.Generator().manual_seed(0)
    e = 122 + torch.randint(0, 4, (1, 2, 1, 64, 16), generator=gen)  # every channel well inside an 8-wide window
    res = study(kv_with_exponents(e))
    assert res["group_modes"]["3-bit"] == 1.0
    first = res["fixed_layout"][0]  # threshold 0: no channel has a wide group
    assert first["four_bit_channels"] == 0 and first["raw_tiles"] == 0 and first["bits_per_element"] == 11.0


def test_one_wide_channel_goes_four_bit_or_raw():
    gen = torch.Generator().manual_seed(1)
    e = 122 + torch.randint(0, 4, (1, 2, 1, 64, 16), generator=gen)
    e[..., 3] = 121 + torch.randint(0, 14, (1, 2, 1, 64), generator=gen)  # channel 3 spans 16 exponents:
    e[..., 0::8, 3], e[..., 1::8, 3] = 120, 135  # every group of it needs the 4-bit window [120, 136)
    res = study(kv_with_exponents(e))
    assert res["group_modes"]["4-bit"] == 1 / 16 and res["group_modes"]["raw"] == 0
    at0 = res["fixed_layout"][0]
    assert at0["four_bit_channels"] == 1 / 16 and at0["raw_tiles"] == 0  # channel 3 (of 16) coded with 4 bits
    assert at0["bits_per_element"] == round(11 + 1 / 16, 3)
    assert res["fixed_layout"][-1]["raw_tiles"] == 1.0  # every channel at 3 bits: every late tile raw
