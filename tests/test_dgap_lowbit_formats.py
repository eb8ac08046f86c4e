"""Statistic formats (FP8 E4M3 scales / zero-points / outliers, symmetric groups) and mixed key precision across
layers and heads (`layer_key_bits`, `layer_value_bits`) of the low-bit cache: rounding, error bounds, validation, honest byte counts and the
spec's round trip."""

import json
import math

import pytest
import torch
from hf_common.testing import tiny_llama_config
from transformers import AutoModelForCausalLM

from dgap_hf import LowBitCache, LowBitConfig, LowBitLayer
from dgap_hf.quantize import (
    _fp8_grid, _round_down, _round_up, dequantize_groups, dequantize_keys, quantize_groups, quantize_keys, stat_bits)
from gaac_hf.model_layers import cache_kwarg

pytestmark = pytest.mark.usefixtures("one_thread")

F8 = "float8_e4m3fn"


def _x(*shape, seed=0, scale=1.0, shift=0.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + shift


# --- FP8 rounding ---------------------------------------------------------------------------------------------------
def test_fp8_outward_rounding_brackets_each_value_by_neighbours():
    grid = _fp8_grid()
    assert grid.numel() == 253 and grid.max() == 448 and grid.min() == -448  # 254 finite codes, +0 and -0 merged
    x = torch.cat([_x(4000, scale=3.0), _x(500, seed=1, scale=0.003), grid[::7], torch.tensor([0.0, 500.0, -900.0])])
    lo, hi = _round_down(x, torch.float8_e4m3fn), _round_up(x, torch.float8_e4m3fn)
    assert lo.dtype == hi.dtype == torch.float8_e4m3fn
    lo, hi = lo.float(), hi.float()
    inside = x.abs() <= 448
    assert bool((lo[inside] <= x[inside]).all() and (hi[inside] >= x[inside]).all())
    # neighbours on the grid: no FP8 value strictly between them, equal exactly on grid points
    i_lo, i_hi = torch.searchsorted(grid, lo), torch.searchsorted(grid, hi)
    same = (i_hi == i_lo) & inside
    assert bool(((i_hi - i_lo) <= 1).all()) and bool((lo[same] == x[same]).all()) and int(same.sum()) >= 36
    assert hi[-2] == 448 and lo[-1] == -448  # saturated, never NaN
    assert stat_bits(F8) == 8 and stat_bits("bfloat16") == 16 and stat_bits("none") == 0


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_minmax_with_fp8_statistics_still_covers_the_group(bits):
    x = _x(64, 3, 32, scale=2.0, shift=1.5)
    q = quantize_groups(x, bits, "minmax", scale_dtype=F8, zero_dtype=F8)
    assert q.scale.dtype == q.zero.dtype == torch.float8_e4m3fn
    assert q.stat_bytes == 2 * 64 * 3  # one byte per statistic
    z, s = q.zero.float(), q.scale.float()
    assert bool((z <= x.amin(-1)).all()) and bool((z + (2 ** bits - 1) * s >= x.amax(-1)).all())
    err = (dequantize_groups(q) - x).abs()
    assert bool((err <= s.unsqueeze(-1) / 2 * (1 + 1e-5) + 1e-6).all())


def test_fp8_statistics_cost_little_accuracy_in_normal_mode():
    x = _x(256, 128, scale=1.3, shift=0.4)
    mse = {f: ((dequantize_groups(quantize_groups(x, 2, "normal", scale_dtype=f, zero_dtype=f)) - x) ** 2).mean()
           for f in ("bfloat16", F8)}
    assert mse[F8] < 1.05 * mse["bfloat16"]  # 3 mantissa bits: a few % of the scale, far below 2-bit noise
    assert mse["bfloat16"] < 0.13 * x.var()


def test_fp8_statistics_saturate_instead_of_nan():
    x = _x(4, 64, scale=3000.0)
    q = quantize_groups(x, 2, "normal", scale_dtype=F8, zero_dtype=F8)
    y = dequantize_groups(q)
    assert bool(torch.isfinite(y).all()) and float(q.scale.float().max()) == 448.0


# --- symmetric groups -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,bits", [("normal", 2), ("normal", 4), ("sign", 1)])
def test_symmetric_groups_store_no_zero(mode, bits):
    x = _x(128, 64)  # zero-mean groups
    sym = quantize_groups(x, bits, mode, zero_dtype="none")
    full = quantize_groups(x, bits, mode)
    assert sym.zero is None and sym.stat_bytes == full.stat_bytes // 2 and sym.nbytes == full.nbytes - 128 * 2
    e_sym = ((dequantize_groups(sym) - x) ** 2).mean()
    e_full = ((dequantize_groups(full) - x) ** 2).mean()
    assert e_sym < 1.1 * e_full
    # on groups far from zero the zero-point is needed: symmetric groups are then much worse
    shifted = x + 3.0
    e_shift = ((dequantize_groups(quantize_groups(shifted, bits, mode, zero_dtype="none")) - shifted) ** 2).mean()
    assert e_shift > 2 * e_full
    with pytest.raises(ValueError, match="needs the 'normal' or 'sign' mode"):
        quantize_groups(x, 2, "minmax", zero_dtype="none")


def test_groups_of_different_formats_do_not_concatenate():
    x = _x(2, 2, 128, 64)
    a = quantize_keys(x, 2, 128, levels="normal")
    b = quantize_keys(x, 2, 128, levels="normal", scale_dtype=F8)
    with pytest.raises(ValueError, match="different formats"):
        a.cat(b, 2)
    assert a.cat(a, 2).packed.shape[2] == 2
    y = dequantize_keys(b.cat(b, 2), torch.float32)
    assert y.shape == (2, 2, 256, 64) and bool(torch.isfinite(y).all())


# --- config validation ----------------------------------------------------------------------------------------------
def test_format_and_layer_options_are_validated():
    with pytest.raises(ValueError, match="key_scale_dtype must be one of"):
        LowBitConfig(key_scale_dtype="float16")
    with pytest.raises(ValueError, match="outlier_dtype must be one of"):
        LowBitConfig(outlier_dtype="none")
    with pytest.raises(ValueError, match="value_zero_dtype='none' .* min/max groups"):
        LowBitConfig("K2V2", value_zero_dtype="none")  # uniform 2-bit groups need a zero-point
    with pytest.raises(ValueError, match="key_zero_dtype='none' .* 8-bit groups"):
        LowBitConfig("K2V2", levels="normal", key_zero_dtype="none", layer_key_bits=((1, 8),))
    LowBitConfig("K2V2", levels="normal", value_zero_dtype="none")
    LowBitConfig("K1V1", value_zero_dtype="none")  # 1-bit sign groups
    with pytest.raises(ValueError, match="bits of layer 3 must be one of"):
        LowBitConfig(layer_key_bits=((3, 3),))
    with pytest.raises(ValueError, match="lists a layer or head twice"):
        LowBitConfig(layer_key_bits=((3, 4), (3, 8)))
    with pytest.raises(ValueError, match="lists a layer or head twice"):
        LowBitConfig(layer_key_bits=((3, 1, 4), (3, 1, 8)))
    with pytest.raises(ValueError, match="both whole-layer and per-head bits"):
        LowBitConfig(layer_key_bits=((3, 4), (3, 1, 8)))
    with pytest.raises(ValueError, match="bits of layer 3 head 1 must be one of"):
        LowBitConfig(layer_key_bits=((3, 1, 5),))
    with pytest.raises(ValueError, match="integer tuples"):
        LowBitConfig(layer_key_bits=((-1, 4),))
    with pytest.raises(ValueError, match="integer tuples"):
        LowBitConfig(layer_key_bits=((1.5, 4),))
    with pytest.raises(ValueError, match="integer tuples"):
        LowBitConfig(layer_key_bits=((1, 2, 3, 4),))
    with pytest.raises(ValueError, match="layer_key_bits must be"):
        LowBitConfig(layer_key_bits=(4,))
    cfg = tiny_llama_config()  # 2 layers
    with pytest.raises(ValueError, match=r"names layers \[2\], but the model has 2 layers"):
        LowBitCache(cfg, "K2V2", layer_key_bits=((2, 4),))
    with pytest.raises(ValueError, match="names KV head 2, but the model has 2 KV heads"):
        LowBitCache(cfg, "K2V2", layer_key_bits=((1, 2, 4),))
    with pytest.raises(ValueError, match="needs the model's config"):
        LowBitCache(None, "K2V2", layer_key_bits=((0, 4),))
    with pytest.raises(ValueError, match="needs the layer index"):
        LowBitLayer(config=LowBitConfig(layer_key_bits=((0, 4),)))
    assert LowBitConfig(layer_key_bits={5: 4, 1: 8}).layer_key_bits == ((1, 8), (5, 4))  # sorted pairs


def test_spec_round_trips_formats_and_layer_bits():
    cfg = LowBitConfig("K2V2", levels="normal", key_scale_dtype=F8, key_zero_dtype=F8, value_scale_dtype=F8,
                       value_zero_dtype="none", outlier_dtype=F8, key_outliers=1,
                       layer_key_bits=((18, 8), (7, 4), (9, 2, 4)))
    back = LowBitConfig.from_spec(json.loads(json.dumps(cfg.to_spec())))
    assert back == cfg and back.layer_key_bits == ((7, 4), (9, 2, 4), (18, 8))
    assert back.head_key_bits(9) == {2: 4} and back.head_key_bits(7) == {} and back.for_layer(9).precision == "K2V2"
    assert back.for_layer(7).precision == "K4V2" and back.for_layer(18).precision == "K8V2"
    assert back.for_layer(0).precision == "K2V2" and back.for_layer(0).layer_key_bits == ()
    assert LowBitConfig().for_layer(3) == LowBitConfig()
    # a layer left without 2/4-bit groups drops levels='normal' (which only applies to them) instead of failing
    mix = LowBitConfig("K8V8", levels="normal", layer_key_bits=((1, 0, 2),))
    assert mix.for_layer(0) == LowBitConfig("K8V8") and mix.for_layer(1).levels == "normal"


# --- the cache: byte counts and per-layer bits ---------------------------------------------------------------------
def _run(model, cache, n=512, seed=0):
    ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(model): cache})
    return cache


def test_cache_counts_fp8_statistics_outliers_and_layer_bits():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=128, num_hidden_layers=3),
                                             dtype=torch.float32).eval()
    cfg = LowBitConfig("K2V2", key_group_size=128, value_group_size=64, residual_length=0, levels="normal",
                       key_scale_dtype=F8, key_zero_dtype=F8, value_scale_dtype=F8, value_zero_dtype="none",
                       key_outliers=2, outlier_dtype=F8, layer_key_bits=((1, 4),))
    cache = _run(model, LowBitCache(model.config, cfg))
    assert [cache.layers[i].key_bits for i in range(3)] == [2, 4, 2]
    h, d, nq = 2, 64, 512  # 2 KV heads, head_dim 64, 4 whole key groups of 128 tokens
    for i, kb in enumerate((2, 4, 2)):
        b = cache.layers[i].stats()["bytes"]
        assert b["key_codes"] == h * nq * d * kb // 8 and b["value_codes"] == h * nq * d * 2 // 8
        assert b["key_stats"] == h * (nq // 128) * d * 2  # FP8 scale + FP8 zero per (channel, 128 tokens)
        assert b["value_stats"] == h * nq * 1  # one FP8 scale per token, no zero
        assert b["key_outliers"] == h * (nq // 128) * d * 2 * 2  # 2 outliers, FP8 value + uint8 index
        assert b["residual"] == 0 and b["sink"] == 0
    st = cache.stats()
    per_elt_k = {2: 2 + 16 / 128 + 2 * 16 / 128, 4: 4 + 16 / 128 + 2 * 16 / 128}
    expect = (per_elt_k[2] * 2 + per_elt_k[4] + 3 * (2 + 8 / 64)) / 6  # K and V of 3 layers, bits per element
    rot_bits = 0.0  # no rotation in this config
    assert st["bytes"]["rotation"] == 0
    assert math.isclose(st["bits_per_element"], expect + rot_bits, rel_tol=1e-12)


def test_four_bit_layer_keys_are_more_accurate():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=128), dtype=torch.float32).eval()
    ref = _run(model, LowBitCache(model.config, LowBitConfig("K8V8", key_group_size=128, value_group_size=64,
                                                             residual_length=0)))
    cfg = LowBitConfig.default("K2V2", key_scale_dtype=F8, layer_key_bits=((0, 4),))
    cache = _run(model, LowBitCache(model.config, cfg))
    err = [float((cache.layers[i].keys - ref.layers[i].keys).pow(2).mean() / ref.layers[i].keys.var())
           for i in range(2)]
    assert err[0] < 0.25 * err[1]  # 4-bit keys in layer 0, 2-bit keys in layer 1


def test_per_head_key_bits_count_and_round_trip():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=128), dtype=torch.float32).eval()
    base = LowBitConfig.default("K2V2", key_scale_dtype=F8)
    ref = _run(model, LowBitCache(model.config, LowBitConfig("K8V8", key_group_size=128, value_group_size=64,
                                                             residual_length=0)), n=520)
    mixed = _run(model, LowBitCache(model.config, base.replace(layer_key_bits=((1, 0, 4),))), n=520)
    plain = _run(model, LowBitCache(model.config, base), n=520)
    a, p = mixed.layers[1], plain.layers[1]
    assert a.head_bits == {0: 4} and mixed.layers[0].head_bits == {}
    # head 0 of layer 1 at 4 bits: twice its key code bytes, same statistics; head 1 and layer 0 unchanged
    nq, d = a.quantized_length, 64
    assert a.stats()["bytes"]["key_codes"] == nq * d * (4 + 2) // 8 == p.stats()["bytes"]["key_codes"] * 3 // 2
    assert a.stats()["bytes"]["key_stats"] == p.stats()["bytes"]["key_stats"]
    assert torch.equal(mixed.layers[0].keys, plain.layers[0].keys)
    err = lambda c, h: float((c.layers[1].keys[:, h] - ref.layers[1].keys[:, h]).pow(2).mean())  # noqa: E731
    assert err(mixed, 0) < 0.25 * err(plain, 0)
    assert torch.equal(a.keys[:, 1], p.keys[:, 1])  # the 2-bit head is quantized exactly as without the mix
    # cropping into the quantized prefix and selecting rows keep the per-head layout
    before = a.keys[:, :, :300].clone()
    mixed.crop(-220)
    assert a.get_seq_length() == 300 and torch.equal(a.keys, before)
    mixed.batch_repeat_interleave(2)
    assert a.keys.shape[0] == 2 and torch.equal(a.keys[1], before[0])


def test_per_head_value_bits_count_validate_and_round_trip():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=128), dtype=torch.float32).eval()
    base = LowBitConfig.default("K2V2", key_scale_dtype=F8)
    ref = _run(model, LowBitCache(model.config, LowBitConfig("K8V8", key_group_size=128, value_group_size=64,
                                                             residual_length=0)), n=520)
    cfg = base.replace(layer_value_bits=((1, 1, 4),), layer_key_bits=((1, 1, 4),))
    mixed = _run(model, LowBitCache(model.config, cfg), n=520)
    plain = _run(model, LowBitCache(model.config, base), n=520)
    a, p = mixed.layers[1], plain.layers[1]
    assert a.head_value_bits == {1: 4} and a.head_bits == {1: 4} and mixed.layers[0].head_value_bits == {}
    # head 1 of layer 1: 4-bit values (twice the value code bytes of a 2-bit head), same statistics
    nq, d = a.quantized_length, 64
    assert a.stats()["bytes"]["value_codes"] == nq * d * (2 + 4) // 8 == p.stats()["bytes"]["value_codes"] * 3 // 2
    assert a.stats()["bytes"]["value_stats"] == p.stats()["bytes"]["value_stats"]
    assert torch.equal(mixed.layers[0].values, plain.layers[0].values)
    assert torch.equal(a.values[:, 0], p.values[:, 0])  # the 2-bit head is quantized exactly as without the mix
    err = lambda c, h: float((c.layers[1].values[:, h] - ref.layers[1].values[:, h]).pow(2).mean())  # noqa: E731
    assert err(mixed, 1) < 0.25 * err(plain, 1)
    # whole-layer value bits set the layer's precision; the tables travel through the spec
    whole = LowBitConfig("K2V2", layer_value_bits=((3, 4),), layer_key_bits=((3, 8),))
    assert whole.for_layer(3).precision == "K8V4" and whole.for_layer(2).precision == "K2V2"
    back = LowBitConfig.from_spec(json.loads(json.dumps(cfg.to_spec())))
    assert back == cfg and back.head_value_bits(1) == {1: 4}
    # crop and row selection keep the per-head layout
    before = a.values[:, :, :300].clone()
    mixed.crop(-220)
    assert torch.equal(a.values, before)
    mixed.batch_repeat_interleave(2)
    assert torch.equal(a.values[1], before[0])
    # validation names the value table
    with pytest.raises(ValueError, match="layer_value_bits lists a layer or head twice"):
        LowBitConfig(layer_value_bits=((3, 1, 4), (3, 1, 8)))
    with pytest.raises(ValueError, match="layer_value_bits bits of layer 3 head 1 must be one of"):
        LowBitConfig(layer_value_bits=((3, 1, 3),))
    with pytest.raises(ValueError, match="value_zero_dtype='none' .* 8-bit groups"):
        LowBitConfig("K2V2", levels="normal", value_zero_dtype="none", layer_value_bits=((1, 8),))
    with pytest.raises(ValueError, match="layer_value_bits names KV head 2, but the model has 2 KV heads"):
        LowBitCache(model.config, "K2V2", layer_value_bits=((1, 2, 4),))
    with pytest.raises(ValueError, match="needs the model's config"):
        LowBitCache(None, "K2V2", layer_value_bits=((0, 4),))
    with pytest.raises(ValueError, match="needs the layer index"):
        LowBitLayer(config=LowBitConfig(layer_value_bits=((0, 4),)))


def test_per_token_keys_are_grouped_like_values():
    from dgap_hf.quantize import dequantize_values, quantize_values
    from dgap_hf.rotation import rotation_matrix

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=128), dtype=torch.float32).eval()
    cfg = LowBitConfig.default("K2V2", key_axis="token", key_zero_dtype="none", layer_key_bits=((1, 0, 4),))
    cache = _run(model, LowBitCache(model.config, cfg), n=520)
    full = _run(model, LowBitCache(model.config, LowBitConfig("K8V8", residual_length=10_000)), n=520)
    a = cache.layers[0]
    nq, h, d = a.quantized_length, 2, 64
    b = a.stats()["bytes"]
    assert b["key_codes"] == h * nq * d * 2 // 8 and b["key_stats"] == h * nq * (d // 64)  # one FP8 scale per token
    # the stored keys are exactly the rotated keys quantized as values are, rotated back
    rot = rotation_matrix("hadamard", d, 0, torch.device("cpu"))
    k = full.layers[0].keys[:, :, 4:4 + nq].float()  # after the 4 sink tokens
    q = quantize_values(k @ rot, 2, 64, "sign", "normal", 0, scale_dtype=F8, zero_dtype="none", outlier_dtype="bfloat16")
    want = (dequantize_values(q, torch.float32) @ rot.T).to(a.keys.dtype)
    assert torch.equal(a.keys[:, :, 4:4 + nq].view(torch.int32), want.view(torch.int32))
    # per-head bits and crop work along the token axis too
    assert cache.layers[1].stats()["bytes"]["key_codes"] == nq * d * (4 + 2) // 8
    before = cache.layers[1].keys[:, :, :300].clone()
    cache.crop(-220)
    assert torch.equal(cache.layers[1].keys, before)
    assert LowBitConfig.from_spec(json.loads(json.dumps(cfg.to_spec()))) == cfg
    with pytest.raises(ValueError, match="key_axis must be one of"):
        LowBitConfig(key_axis="head")
    with pytest.raises(ValueError, match="key_outliers=64 must be below the group size 64"):
        LowBitConfig(key_axis="token", key_group_size=128, value_group_size=64, key_outliers=64)


def _smollm2_shaped_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64)


def test_k2v2_default_is_measured_heads_within_the_bit_budget():  # (session 11: retrieval heads, see pre-RoPE tests)
    from dgap_hf.lowbit_config import MEASURED_KEY_HEADS, model_signature

    cfg = _smollm2_shaped_config()
    assert model_signature(cfg) in MEASURED_KEY_HEADS
    q = LowBitCache(cfg, "K2V2").quant_config
    assert q == LowBitConfig.default("K2V2", model_config=cfg)
    assert len(q.layer_key_bits) == 19 and len(q.layer_value_bits) == 8  # 27 upgrades to 4 bits, keys or values
    assert {e[-1] for e in q.layer_key_bits + q.layer_value_bits} == {4}
    assert (18, 2, 4) in q.layer_key_bits and (18, 2, 4) in q.layer_value_bits
    # other models (and other precisions) get no head table; K4V4 / K8V8 / K1V1 defaults are not touched by it
    assert LowBitCache(tiny_llama_config(), "K2V2").quant_config.layer_key_bits == ()
    for p in ("K1V1", "K4V4", "K8V8", "K4V2"):
        assert LowBitCache(cfg, p).quant_config == LowBitConfig.default(p)
    # the 2K-token cache: bits per element as stats() counts them, at most 2.5 (float32 KV: sinks at 4 bytes)
    cache = LowBitCache(cfg, "K2V2")
    for i in range(30):
        k, v = _x(1, 3, 2048, 64, seed=i), _x(1, 3, 2048, 64, seed=100 + i)
        cache.update(k, v, i)
    st = cache.stats()
    assert st["bytes"]["residual"] == 124 * 2 * 3 * 64 * 4 * 30 and st["bytes"]["pending"] == 0
    four_bit_heads = sum(cache.layers[i].head_bits.get(h, 2) == 4 for i in range(30) for h in range(3))
    four_bit_values = sum(cache.layers[i].head_value_bits.get(h, 2) == 4 for i in range(30) for h in range(3))
    assert (four_bit_heads, four_bit_values) == (19, 8)
    nq = 2048 - 4 - 124
    expect_codes = 30 * 3 * nq * 64 * 2 * 2 / 8 + 27 * nq * 64 * 2 / 8  # K and V at 2 bits, +2 bits in 27 head K or V
    assert st["bytes"]["key_codes"] + st["bytes"]["value_codes"] == expect_codes
    assert st["bytes"]["key_stats"] == 30 * 3 * (nq // 128) * 64 * 2 and st["bytes"]["value_stats"] == 30 * 3 * nq
    assert 2.45 < st["bits_per_element"] <= 2.5
