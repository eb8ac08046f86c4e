"""LowBitCache / LowBitLayer: packed storage, append-only flushes, byte accounting, generate."""

import pytest
import torch
from hf_common.testing import tiny_llama_config
from transformers import AutoModelForCausalLM, DynamicCache

import dgap_hf.cache as cache_mod
from gaac_hf.model_layers import cache_kwarg
from dgap_hf import LowBitCache, LowBitLayer
from dgap_hf.precision import UnknownPrecisionError
from dgap_hf.traces import collect_traces


pytestmark = pytest.mark.usefixtures("one_thread")


VOCAB = 256


def small_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                num_key_value_heads=1, head_dim=64, initializer_range=0.2)
    base.update(kw)
    return tiny_llama_config(**base)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(small_config(), dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # random weights: do not stop early
    return m


def _kv(b, s, h=2, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, s, d, generator=g), torch.randn(b, h, s, d, generator=g)


def _expected_bytes(b, h, d, n_quant, residual, kb, vb, g, elt=4):
    """Analytic resident bytes: packed codes + 2 BF16 statistics per group + the full-precision residual."""
    return {
        "key_codes": b * h * n_quant * d * kb // 8,
        "key_stats": b * h * (n_quant // g) * d * 2 * 2,
        "value_codes": b * h * n_quant * d * vb // 8,
        "value_stats": b * h * n_quant * (d // g) * 2 * 2,
        "residual": 2 * b * h * residual * d * elt,
    }


def test_flush_rule_append_only_and_packed_bytes(monkeypatch):
    layer = LowBitLayer(key_bits=2, value_bits=4, group_size=32, residual_length=16)
    chunks = []
    real = cache_mod.quantize_keys
    monkeypatch.setattr(cache_mod, "quantize_keys", lambda k, *a, **kw: chunks.append(k.shape[-2]) or real(k, *a, **kw))
    k, v = _kv(2, 112)
    out_k, out_v = layer.update(k[:, :, :100], v[:, :, :100])
    # prefill: 100 tokens returned at full precision; the oldest 64 (2 groups) quantized, 36 stay in the residual
    assert torch.equal(out_k, k[:, :, :100]) and torch.equal(out_v, v[:, :, :100])
    assert (layer.quantized_length, layer.residual_tokens) == (64, 36)
    first_codes = layer._qk.packed.clone()
    for t in range(100, 112):  # residual reaches 48 = 16 + 32 at t = 111: one more group flushed
        out_k, _ = layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        assert out_k.shape == (2, 2, t + 1, 64)
    assert (layer.quantized_length, layer.residual_tokens) == (96, 16)
    assert chunks == [64, 32]  # whole groups, each token quantized once
    assert torch.equal(layer._qk.packed[:, :, :2], first_codes)  # earlier groups never requantized
    # storage really is packed uint8 with BF16 statistics
    assert layer._qk.packed.dtype == torch.uint8 and layer._qk.packed.shape == (2, 2, 3, 64, 8)
    assert layer._qv.packed.shape == (2, 2, 96, 2, 16) and layer._qv.scale.dtype == torch.bfloat16
    st = layer.stats()
    exp = _expected_bytes(2, 2, 64, 96, 16, 2, 4, 32)
    assert {k: st["bytes"][k] for k in exp} == exp
    assert st["bytes"]["total"] == sum(exp.values()) - exp["residual"]  # the recent window is reported apart
    assert st["tokens"] == 112 and st["elements"] == 2 * 2 * 2 * 112 * 64
    # quantized prefix comes back dequantized, residual exactly
    full_k, full_v = layer.keys, layer.values
    with pytest.raises(AttributeError, match=r"LowBitLayer.keys is read-only \(the layer stores packed low-bit KV\)"):
        layer.keys = full_k
    assert torch.equal(full_k[:, :, 96:], k[:, :, 96:112]) and not torch.equal(full_k[:, :, :96], k[:, :, :96])
    assert (full_v[:, :, :96] - v[:, :, :96]).abs().max() < 0.5


def test_residual_zero_and_sign_mode():
    layer = LowBitLayer(1, 1, group_size=16, residual_length=0)
    k, v = _kv(1, 40)
    layer.update(k, v)
    assert (layer.quantized_length, layer.residual_tokens) == (32, 8)
    assert layer._qk.mode == "sign" and layer._qv.mode == "sign"
    assert LowBitLayer(1, 1, one_bit_mode="minmax").one_bit_mode == "minmax"


def test_crop_reorder_reset_mask_sizes():
    layer = LowBitLayer(4, 4, group_size=32, residual_length=16)
    k, v = _kv(3, 112, seed=3)
    layer.update(k[:, :, :100], v[:, :, :100])
    for t in range(100, 112):
        layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
    assert layer.get_seq_length() == 112 and layer.get_mask_sizes(5) == (117, 0)
    full_k, full_v = layer.keys, layer.values
    # crop inside the residual
    layer.crop(-4)
    assert layer.get_seq_length() == 108 and (layer.quantized_length, layer.residual_tokens) == (96, 12)
    assert torch.equal(layer.keys, full_k[:, :, :108])
    # crop into the quantized prefix: the partial group comes back dequantized (the count as a 0-d tensor, as
    # transformers 5.17's assisted decoding passes it)
    layer.crop(torch.tensor(-16))
    assert (layer.quantized_length, layer.residual_tokens) == (64, 28)
    assert torch.equal(layer.keys, full_k[:, :, :92]) and torch.equal(layer.values, full_v[:, :, :92])
    layer.crop(0)
    with pytest.raises(ValueError):
        layer.crop(3)
    # beam reorder: rows permuted, nothing requantized
    before_k, before_v = layer.keys, layer.values
    idx = torch.tensor([2, 0, 0])
    layer.reorder_cache(idx)
    assert torch.equal(layer.keys, before_k[idx]) and torch.equal(layer.values, before_v[idx])
    layer.batch_select_indices(torch.tensor([1, 2]))
    assert layer.keys.shape[0] == 2
    layer.reset()
    assert layer.get_seq_length() == 0 and layer.stats()["bytes"]["total"] == 0 and layer.keys is None


def test_cache_options_and_layer_kinds():
    cfg = small_config()
    c = LowBitCache(cfg, "K2V4")
    assert c.precision == "K2V4" and len(c.layers) == 2 and all(isinstance(x, LowBitLayer) for x in c.layers)
    assert LowBitCache(cfg, "K2V2", key_bits=1).precision == "K1V2"
    with pytest.raises(UnknownPrecisionError):
        LowBitCache(cfg, "K3V3")
    with pytest.raises(ValueError, match="one_bit_mode"):
        LowBitCache(cfg, "K1V1", one_bit_mode="mean")
    with pytest.raises(ValueError, match="group_size"):
        LowBitCache(cfg, group_size=12)
    spec = c.quantizer_spec()
    assert spec["key_bits"] == 2 and spec["value_bits"] == 4 and spec["stat_dtype"] == "bfloat16"
    from transformers import Qwen3Config
    hybrid = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, use_sliding_window=True,
                         sliding_window=16, max_window_layers=1)
    kinds = [type(x).__name__ for x in LowBitCache(hybrid).layers]
    assert kinds == ["LowBitLayer", "DynamicSlidingWindowLayer", "DynamicSlidingWindowLayer"]
    lazy = LowBitCache(None, "K2V2")
    lazy.update(*_kv(1, 8), layer_idx=1)
    assert len(lazy.layers) == 2 and lazy.get_seq_length(1) == 8


def test_generate_k8v8_matches_dynamic_cache(model):
    cfg = model.config
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (1, 40))
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    ref = model.generate(ids, **{cache_kwarg(model): DynamicCache(config=cfg)}, **kw)
    cache = LowBitCache(cfg, "K8V8", group_size=16, residual_length=0)
    out = model.generate(ids, **{cache_kwarg(model): cache}, **kw)
    assert cache.stats()["layers"][0]["quantized_tokens"] >= 48  # the prompt and part of the answer were quantized
    # teacher-forced on the reference continuation: top-1 agreement of K8V8 with the FP cache
    tr = collect_traces(model, ref, ["K8V8"], prefix_len=40, steps=20, top_m=8,
                        cache_kwargs={"group_size": 16, "residual_length": 0})["K8V8"]
    agreement = (tr.fp_idx[:, 0] == tr.lb_idx[:, 0]).float().mean().item()
    assert torch.equal(out, ref) or agreement >= 0.9
    assert agreement >= 0.9


def test_generate_low_bit_runs_and_saves_memory(model):
    cfg = model.config
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(2))
    for precision in ("K2V2", "K1V1", "K2V4"):
        cache = LowBitCache(cfg, precision, group_size=32, residual_length=8)
        out = model.generate(ids, **{cache_kwarg(model): cache}, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.shape == (2, 60)
        st = cache.stats()
        assert st["precision"] == precision and st["layers"][0]["quantized_tokens"] == 32
        assert st["bytes"]["total"] < 0.75 * 4 * st["elements"]  # vs the float32 DynamicCache
    # beam search (reorder_cache) and prompt lookup (crop) run on the low-bit cache
    out = model.generate(ids[:1], **{cache_kwarg(model): LowBitCache(cfg, "K2V2", group_size=32, residual_length=8)}, num_beams=3,
                         max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 56)
    rep = torch.cat([ids[:1, :24], ids[:1, :24]], -1)
    out = model.generate(rep, **{cache_kwarg(model): LowBitCache(cfg, "K2V2", group_size=32, residual_length=8)},
                         prompt_lookup_num_tokens=4, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape[1] <= 56


@pytest.mark.parametrize("chunks", [[100], [3, 1, 1, 95], [1] * 40 + [60]])
def test_sink_tokens_stay_exact_whatever_the_update_sizes(chunks):
    """The first `sink_length` tokens are returned bit-exact forever; the rest is quantized as without a sink."""
    k, v = _kv(2, sum(chunks))
    layer = LowBitLayer(key_bits=1, value_bits=1, group_size=8, residual_length=8, sink_length=5)
    plain = LowBitLayer(key_bits=1, value_bits=1, group_size=8, residual_length=8)
    pos = 0
    for n in chunks:
        layer.update(k[:, :, pos:pos + n], v[:, :, pos:pos + n])
        pos += n
    keys, values = layer.update(k[:, :, :0], v[:, :, :0])  # what later steps see
    assert keys.shape[-2] == layer.get_seq_length() == 100
    assert torch.equal(keys[:, :, :5], k[:, :, :5]) and torch.equal(values[:, :, :5], v[:, :, :5])
    pk, pv = plain.update(k[:, :, 5:], v[:, :, 5:])  # the same tokens after the sink, in one update
    pk, pv = plain.update(k[:, :, :0], v[:, :, :0])
    assert torch.equal(keys[:, :, 5:], pk) and torch.equal(values[:, :, 5:], pv)
    assert not torch.equal(keys[:, :, 5:], k[:, :, 5:])  # the rest really is 1-bit
    st = layer.stats()
    assert st["sink_tokens"] == 5 and st["quantized_tokens"] + st["residual_tokens"] == 95


def test_sink_crop_and_reorder():
    k, v = _kv(3, 60)
    layer = LowBitLayer(key_bits=2, value_bits=2, group_size=8, residual_length=8, sink_length=6)
    layer.update(k, v)
    layer.crop(-56)  # into the sink
    assert layer.get_seq_length() == 4 and layer.sink_tokens == 4
    keys, _ = layer.update(k[:, :, 4:30], v[:, :, 4:30])  # refills the sink first
    assert layer.sink_tokens == 6 and torch.equal(keys[:, :, :6], k[:, :, :6])
    layer.reorder_cache(torch.tensor([2, 0, 1]))
    keys, _ = layer.update(k[:, :, :0], v[:, :, :0])
    assert torch.equal(keys[:, :, :6], k[[2, 0, 1], :, :6])
    with pytest.raises(ValueError, match="sink_length"):
        LowBitLayer(sink_length=-1)


def test_generate_with_sink(model):
    ids = torch.randint(0, VOCAB, (2, 50), generator=torch.Generator().manual_seed(3))
    cache = LowBitCache(model.config, "K2V2", group_size=8, residual_length=8, sink_length=4)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **{cache_kwarg(model): cache}, max_new_tokens=10,
                         do_sample=False)
    assert out.shape == (2, 60)
    assert cache.quantizer_spec()["sink_length"] == 4
    assert all(cache.layers[i].sink_tokens == 4 for i in cache.low_bit_layers)
