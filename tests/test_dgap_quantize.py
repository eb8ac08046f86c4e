"""Packed low-bit quantizers (dgap_hf.quantize) and precision names."""

import math

import pytest
import torch

from dgap_hf.precision import UnknownPrecisionError, normalize_precision, parse_precision
from dgap_hf.quantize import (
    BITS, dequantize_groups, dequantize_keys, dequantize_values, minmax_error_bound, minmax_error_bound_from_range,
    pack_bits, quantize_groups, quantize_keys, quantize_values, relative_error_bound, unpack_bits,
)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("bits", BITS)
def test_pack_unpack_round_trip(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (3, 5, 32), generator=g, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 32 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits), codes)
    if bits == 2:  # layout: code i of a byte at bit 2 i
        assert pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).item() == 1 | 2 << 2 | 3 << 4


def _key_groups(x, g):  # [B, H, S, D] -> [B, H, S/G, D, G], the groups quantize_keys uses
    b, h, s, d = x.shape
    return x.reshape(b, h, s // g, g, d).transpose(-1, -2)


@pytest.mark.parametrize("bits", BITS)
def test_minmax_error_bounds_per_bit_width(bits):
    g = torch.Generator().manual_seed(10 + bits)
    # per-channel scales and offsets, as in real keys (outlier channels)
    x = torch.randn(2, 3, 64, 64, generator=g) * torch.rand(64, generator=g) * 4 + torch.randn(64, generator=g)
    qk = quantize_keys(x, bits, 32, one_bit_mode="minmax")
    assert qk.packed.shape == (2, 3, 2, 64, 32 * bits // 8) and qk.scale.dtype == torch.bfloat16
    y = dequantize_keys(qk, torch.float32)
    err = (x - y).abs()
    groups, gerr = _key_groups(x, 32), _key_groups(err, 32).amax(-1)
    bound = minmax_error_bound_from_range(groups.amin(-1), groups.amax(-1), bits)
    assert (gerr <= minmax_error_bound(qk) * (1 + 1e-5) + 1e-6).all()  # |x - x_hat| <= scale / 2
    assert (gerr <= bound).all()  # a priori bound from the group's range
    # the bound is tight: the worst group uses most of it
    assert (gerr / bound).max() > 0.8
    # relative to the range, for groups with |min| << range
    rng = groups.amax(-1) - groups.amin(-1)
    small = groups.amin(-1).abs() < 0.05 * rng
    assert ((gerr / rng)[small] <= relative_error_bound(bits) + 1e-3).all()
    # values: groups of 32 channels per token
    qv = quantize_values(x, bits, 32, one_bit_mode="minmax")
    assert qv.packed.shape == (2, 3, 64, 2, 32 * bits // 8)
    yv = dequantize_values(qv, torch.float32)
    vg = x.reshape(2, 3, 64, 2, 32)
    verr = (x - yv).abs().reshape(2, 3, 64, 2, 32).amax(-1)
    assert (verr <= minmax_error_bound_from_range(vg.amin(-1), vg.amax(-1), bits)).all()
    # BF16 output adds at most half a BF16 ulp
    yb = dequantize_keys(qk, torch.bfloat16).float()
    assert ((x - yb).abs() <= minmax_error_bound(qk).repeat_interleave(32, 2).reshape(2, 3, 64, 64) * 1.0001
            + y.abs() * 2 ** -8 + 1e-6).all()


def test_relative_bounds_shrink_with_bits():
    vals = [relative_error_bound(b) for b in BITS]
    assert vals == sorted(vals, reverse=True)
    assert math.isclose(relative_error_bound(8), 0.5 / 255 * (1 + 2 ** -7))


def test_constant_and_extreme_groups():
    x = torch.full((1, 1, 32, 64), 3.0)
    for bits in BITS:
        assert torch.allclose(dequantize_keys(quantize_keys(x, bits, 32, "minmax"), torch.float32), x)
    x = torch.zeros(1, 1, 32, 64)
    x[..., 0, :] = 1e4
    y = dequantize_keys(quantize_keys(x, 8, 32), torch.float32)
    assert ((x - y).abs() <= 1e4 / 255 / 2 * 1.01).all()


def test_sign_mode_beats_minmax_at_one_bit_on_gaussian():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 128, 64, generator=g) * 2 + 0.5
    for quant, deq in ((quantize_keys, dequantize_keys), (quantize_values, dequantize_values)):
        mse = {}
        for mode in ("sign", "minmax"):
            q = quant(x, 1, 32, one_bit_mode=mode)
            assert q.mode == mode and q.packed.shape[-1] == 4  # 32 codes in 4 bytes
            mse[mode] = ((x - deq(q, torch.float32)) ** 2).mean().item()
        var = 4.0
        assert mse["sign"] < 0.4 * var  # theory: (1 - 2 / pi) var = 0.363 var
        assert mse["sign"] < 0.5 * mse["minmax"]


def test_sign_mode_mse_identity():
    """mean +/- MAD: the group's MSE is var - MAD^2 (up to the BF16 statistics)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 32, generator=g) * 3 + 1
    q = quantize_groups(x, 1, "sign")
    y = dequantize_groups(q)
    mse = ((x - y) ** 2).mean(-1)
    mu = x.mean(-1, keepdim=True)
    mad = (x - mu).abs().mean(-1)
    var = ((x - mu) ** 2).mean(-1)
    assert torch.allclose(mse, var - mad ** 2, rtol=0.03, atol=0.02)
    assert (mse <= var * 1.02).all()  # never worse than the group mean


def test_quantizer_argument_errors():
    x = torch.randn(1, 1, 32, 64)
    with pytest.raises(ValueError, match="bits"):
        quantize_keys(x, 3, 32)
    with pytest.raises(ValueError, match="whole groups"):
        quantize_keys(x[:, :, :20], 2, 32)
    with pytest.raises(ValueError, match="multiple"):
        quantize_values(torch.randn(1, 1, 4, 48), 2, 32)
    with pytest.raises(ValueError, match="1-bit"):
        quantize_groups(x, 2, "sign")


def test_precision_names():
    assert parse_precision("K2V2") == (2, 2)
    assert parse_precision("k2v4") == (2, 4)
    assert parse_precision(" K1V8 ") == (1, 8)
    assert normalize_precision("k4v4") == "K4V4"
    for bad in ("K3V3", "K2", "fp16", "K16V16", "V2K2", ""):
        with pytest.raises(UnknownPrecisionError):
            parse_precision(bad)


@pytest.mark.parametrize("bits,mode", [(b, m) for b in (1, 2, 4, 8) for m in ("minmax", "normal")] + [(1, "sign")])
def test_code_levels_by_byte_lookup_equal_per_code_levels(bits, mode):
    """The one-lookup-per-byte decode of packed codes gives exactly the per-code levels (2c - 1, the Lloyd-Max
    levels, or c) of every code of every byte, in pack order."""
    from dgap_hf.quantize import code_levels, normal_levels, pack_bits, unpack_bits

    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (3, 5, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert torch.equal(unpack_bits(packed, bits), codes)
    c = codes.float()
    want = {"sign": 2 * c - 1, "normal": torch.tensor(normal_levels(bits))[codes.long()], "minmax": c}[mode]
    got = code_levels(packed, bits, mode)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
