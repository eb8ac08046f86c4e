"""LowBitConfig options of the low-bit cache: validation, rotation, non-uniform levels, outliers, honest bit
accounting, the spec's round trip through a DGAP artifact, and transformers' QuantizedCache harness."""

import math
from pathlib import Path

import pytest
import torch
from hf_common.testing import tiny_llama_config
from transformers import AutoModelForCausalLM

from dgap_hf import DGAPModel, LowBitCache, LowBitConfig, LowBitLayer
from dgap_hf.baselines import quantized_cache, quantized_cache_stats
from dgap_hf.lowbit_config import DEFAULTS
from dgap_hf.precision import UnknownPrecisionError
from dgap_hf.quantize import dequantize_groups, normal_levels, quantize_groups
from dgap_hf.rotation import rotation_matrix
from gaac_hf.model_layers import cache_kwarg

pytestmark = pytest.mark.usefixtures("one_thread")

SHIPPED = Path(__file__).resolve().parents[1] / "hub_configs" / "dgap-SmolLM2-135M-Instruct"


def _kv(b, s, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)


# --- validation ------------------------------------------------------------------------------------------------
def test_config_errors_name_the_problem():
    cfg = tiny_llama_config()  # head_dim 64
    with pytest.raises(UnknownPrecisionError):
        LowBitConfig("K3V3")
    with pytest.raises(UnknownPrecisionError):
        LowBitCache(cfg, "fp16")
    with pytest.raises(ValueError, match="value_group_size=48 channels, but head_dim is 64"):
        LowBitCache(cfg, "K2V2", value_group_size=48)
    with pytest.raises(ValueError, match="multiple of 8"):
        LowBitConfig(key_group_size=12)
    with pytest.raises(ValueError, match="is for head_dim 32, the model has head_dim 64"):
        LowBitCache(cfg, LowBitConfig(rotation="random", head_dim=32))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        LowBitCache(tiny_llama_config(head_dim=48, hidden_size=96, num_attention_heads=2),
                    LowBitConfig(rotation="hadamard", value_group_size=16))
    with pytest.raises(ValueError, match="rotation must be one of"):
        LowBitConfig(rotation="givens")
    with pytest.raises(ValueError, match="levels='normal' applies to 2- and 4-bit"):
        LowBitConfig("K8V8", levels="normal")
    with pytest.raises(ValueError, match="key_outliers=32 must be below the group size 32"):
        LowBitConfig(key_outliers=32)
    with pytest.raises(TypeError, match="LowBitConfig's fields"):
        LowBitCache(cfg, "K2V2", rotaton="hadamard")
    with pytest.raises(ValueError, match="unknown low-bit quantizer options"):
        LowBitConfig.from_spec({"precision": "K2V2", "rotaton": "hadamard"})
    with pytest.raises(ValueError, match="contradicts its precision"):
        LowBitConfig.from_spec({"precision": "K2V2", "key_bits": 4})
    # a layer without a model config checks head_dim at the first update
    layer = LowBitLayer(config=LowBitConfig(value_group_size=64))
    with pytest.raises(ValueError, match="head_dim is 32"):
        layer.update(*_kv(1, 8, d=32))


def test_precision_defaults_and_overrides():
    cfg = tiny_llama_config()
    for p in DEFAULTS:
        assert LowBitCache(cfg, p).quant_config == LowBitConfig.default(p)
    mixed = LowBitCache(cfg, "K4V2").quant_config
    assert mixed.precision == "K4V2" and mixed == LowBitConfig.default("K4V4").replace(precision="K4V2")
    c = LowBitCache(cfg, "K2V2", key_bits=1, group_size=16, sink_length=2)
    q = c.quant_config
    assert (q.precision, q.key_group_size, q.value_group_size, q.sink_length) == ("K1V2", 16, 16, 2)


# --- rotation ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["hadamard", "random"])
def test_rotation_is_orthogonal(kind):
    r = rotation_matrix(kind, 64, seed=3).double()
    err = (r @ r.T - torch.eye(64, dtype=torch.float64)).abs().max().item()
    if kind == "hadamard":  # entries +-1/8: exactly orthogonal in float32
        assert err == 0.0 and set(r.abs().unique().tolist()) == {0.125}
    else:
        assert err < 1e-6
        assert not torch.equal(rotation_matrix("random", 64, seed=4), rotation_matrix("random", 64, seed=3))
        assert torch.equal(rotation_matrix("random", 64, seed=3), rotation_matrix("random", 64, seed=3))


@pytest.mark.parametrize("rotate", ["kv", "k", "v"])
def test_rotated_layer_returns_unrotated_kv(rotate):
    """K8V8 with a rotation: the quantized prefix is stored rotated and comes back un-rotated, close to the input."""
    k, v = _kv(2, 96)
    k[..., 5] *= 20  # an outlier channel
    cfg = LowBitConfig("K8V8", key_group_size=32, value_group_size=64, residual_length=0, rotation="hadamard",
                       rotate=rotate)
    layer, plain = LowBitLayer(config=cfg), LowBitLayer(config=cfg.replace(rotation="none"))
    for lay in (layer, plain):
        lay.update(k, v)
    keys, values = layer.keys, layer.values
    assert layer.quantized_length == 96
    for x, x_hat, which in ((k, keys, "k"), (v, values, "v")):
        scale = x.abs().amax().item()
        assert (x_hat - x).abs().max().item() < 0.02 * scale
        stored = layer._qk if which == "k" else layer._qv
        base = plain._qk if which == "k" else plain._qv
        assert torch.equal(stored.packed, base.packed) != (which in rotate)  # rotated exactly where asked


# --- levels and outliers ------------------------------------------------------------------------------------------
def test_normal_levels_are_lloyd_max():
    lv = normal_levels(2)
    assert lv == tuple(sorted(lv)) and all(abs(a + b) < 1e-9 for a, b in zip(lv, reversed(lv)))
    assert abs(lv[2] - 0.4528) < 1e-3 and abs(lv[3] - 1.5104) < 1e-3  # Max (1960), Table I
    x = torch.randn(4096, 128, generator=torch.Generator().manual_seed(0))
    mse = {m: ((dequantize_groups(quantize_groups(x, 2, m)) - x) ** 2).mean().item() for m in ("normal", "minmax")}
    assert abs(mse["normal"] - 0.1175) < 0.01  # the Lloyd-Max distortion of N(0, 1) at 2 bits
    assert mse["normal"] < 0.8 * mse["minmax"]
    with pytest.raises(ValueError, match="2 or 4 bits"):
        quantize_groups(x, 8, "normal")


@pytest.mark.parametrize("mode,bits", [("minmax", 2), ("normal", 2), ("sign", 1), ("minmax", 4)])
def test_outliers_budget_and_exact_outliers(mode, bits):
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    x[0, 0, 7] = 40.0
    n = 2
    q = quantize_groups(x, bits, mode, outliers=n)
    assert q.outlier_values.shape == (3, 5, n) and q.outlier_index.dtype == torch.uint8
    assert q.outlier_bytes == 3 * 5 * n * 3  # BF16 value + uint8 index per outlier, nothing else
    y = dequantize_groups(q)
    far = (x - x.mean(-1, keepdim=True)).abs().topk(n, -1).indices
    assert torch.equal(y.gather(-1, far), x.gather(-1, far).to(torch.bfloat16).float())  # outliers come back in BF16
    assert y[0, 0, 7] == 40.0
    plain = dequantize_groups(quantize_groups(x, bits, mode))
    assert ((y - x) ** 2).mean() < ((plain - x) ** 2).mean()


# --- bits per element ---------------------------------------------------------------------------------------------
def test_stats_count_everything_but_the_recent_window():
    b, h, d, gk, gv = 2, 2, 64, 16, 32
    cfg = LowBitConfig("K2V4", key_group_size=gk, value_group_size=gv, residual_length=120, sink_length=3,
                       key_outliers=1, value_outliers=2, rotation="hadamard")
    layer = LowBitLayer(config=cfg)
    k, v = _kv(b, 405, h, d)
    layer.update(k[:, :, :300], v[:, :, :300])
    for t in range(300, 405):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
    st = layer.stats()
    nq, res, sink = layer.quantized_length, layer.residual_tokens, layer.sink_tokens
    assert sink + nq + res == 405 and res > 128  # residual_length + group_size - 1 > 128: some residual is pending
    per_tok = 2 * b * h * d
    exp = {"key_codes": b * h * nq * d * 2 // 8, "key_stats": b * h * (nq // gk) * d * 4,
           "key_outliers": b * h * (nq // gk) * d * 1 * 3, "value_codes": b * h * nq * d * 4 // 8,
           "value_stats": b * h * nq * (d // gv) * 4, "value_outliers": b * h * nq * (d // gv) * 2 * 3,
           "sink": sink * per_tok * 4, "pending": (res - 128) * per_tok * 4}
    assert {key: st["bytes"][key] for key in exp} == exp
    assert st["bytes"]["total"] == sum(exp.values())
    assert st["bytes"]["residual"] == 128 * per_tok * 4
    assert st["counted_elements"] == (405 - 128) * per_tok and st["elements"] == 405 * per_tok
    assert st["bits_per_element"] == 8 * st["bytes"]["total"] / st["counted_elements"]
    assert st["bf16_bytes"] == 2 * st["elements"] and "fp16_bytes" not in st


def test_cache_stats_bits_per_element_on_a_model():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=128), dtype=torch.float32).eval()
    cfg = LowBitConfig("K2V2", key_group_size=128, value_group_size=64, residual_length=0, rotation="random")
    cache = LowBitCache(model.config, cfg)
    ids = torch.randint(0, 128, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids, **{cache_kwarg(model): cache})
    st = cache.stats()
    assert st["bytes"]["residual"] == 0 and st["bytes"]["rotation"] == 64 * 64 * 4
    codes_stats = 2 + 32 / 128 + 2 + 32 / 64  # K: codes + two BF16 stats per 128 tokens; V: per 64 channels
    rot_bits = 8 * st["bytes"]["rotation"] / st["counted_elements"]
    assert math.isclose(st["bits_per_element"], codes_stats / 2 + rot_bits, rel_tol=1e-12)
    assert st["bytes"]["total"] == sum(v for key, v in st["bytes"].items() if key not in ("total", "residual"))


# --- artifact round trip ------------------------------------------------------------------------------------------
CONFIGS = [
    LowBitConfig(),
    LowBitConfig("K1V1", key_group_size=128, value_group_size=64, residual_length=0, sink_length=4,
                 rotation="hadamard", rotate="v", one_bit_mode="minmax"),
    LowBitConfig("K2V4", levels="normal", rotation="random", rotation_seed=7, key_outliers=1, value_outliers=2,
                 head_dim=64),
    *(LowBitConfig.default(p) for p in DEFAULTS),
]


def test_spec_round_trips_through_the_artifact(tmp_path):
    specs = {p: {"k_b": 8, "tau": 0.5, "detector": {"arch": "linear"},
                 "corrector": {"window": 8, "arch": "mlp", "hidden": 16, "layers": 1}} for p in ("K2V2",)}
    quantizer = {f"config{i}": c.to_spec() for i, c in enumerate(CONFIGS)}
    DGAPModel(specs, {"name": "t", "vocab_size": 32}, quantizer=quantizer).save_pretrained(tmp_path)
    back = DGAPModel.from_pretrained(tmp_path)
    assert [LowBitConfig.from_spec(back.quantizer[f"config{i}"]) for i in range(len(CONFIGS))] == CONFIGS


def test_shipped_artifact_records_each_precisions_default_quantizer():
    """The shipped artifact was trained on the cache `LowBitCache(config, precision)` builds for SmolLM2 (the model
    card's snippet): its spec rebuilds each precision's default, the measured per-head key bits of K2V2 included."""
    from transformers import AutoConfig

    from dgap_hf.lowbit_config import SPEC_VERSION
    from gaac_hf.default_model import default_model_path

    config = AutoConfig.from_pretrained(default_model_path())
    art = DGAPModel.from_pretrained(SHIPPED)
    assert set(art.quantizer) == set(art.precisions) == {"K1V1", "K2V2", "K4V4", "K8V8"}
    for p in art.precisions:
        assert art.quantizer[p]["spec_version"] == SPEC_VERSION
        cfg = LowBitConfig.from_artifact(art, p)
        assert cfg == LowBitConfig.default(p, model_config=config), p
        assert LowBitCache(config, cfg).quant_config == LowBitCache(config, p).quant_config, p
    assert LowBitConfig.from_artifact(art, "K2V2").layer_key_bits  # the SmolLM2 head table, not the generic default
    with pytest.raises(UnknownPrecisionError, match="K2V4"):
        LowBitConfig.from_artifact(art, "K2V4")


# --- transformers' QuantizedCache harness ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_quantized_cache_harness_counts_bits(backend):
    pytest.importorskip({"quanto": "optimum.quanto", "hqq": "hqq"}[backend])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(vocab_size=128), dtype=torch.float32).eval()
    cache = quantized_cache(model.config, backend, nbits=2, q_group_size=64, residual_length=32)
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 104)
    st = quantized_cache_stats(cache)
    assert st["elements"] == 2 * 2 * 2 * 103 * 64  # 2 layers, K and V, 2 KV heads, 103 cached tokens
    assert 0 < st["bytes"]["residual"] and st["bytes"]["pending"] == 0
    assert math.isclose(st["bits_per_element"], 2 + 2 * 16 / 64, rel_tol=1e-12)  # codes + BF16 scale and zero
    with pytest.raises(ValueError, match="128-token window"):
        quantized_cache(model.config, backend, residual_length=256)


def test_defaults_fit_the_head_dim():
    assert LowBitConfig.default("K2V2", head_dim=32).value_group_size == 32
    assert LowBitConfig.default("K2V2", head_dim=96).rotation == "random"
    assert LowBitConfig.default("K2V2", head_dim=64) == LowBitConfig.default("K2V2")
    small = LowBitCache(tiny_llama_config(head_dim=32, hidden_size=64, num_attention_heads=2), "K2V2")
    assert small.quant_config.value_group_size == 32
