"""Pre-RoPE key quantization (`LowBitConfig(pre_rope_keys=True)`, `dgap_hf.rope_frame`): the map is undone exactly
at every cache index (prefix, crop, beam reorder), it quantizes RoPE'd keys as well as their pre-RoPE form, and bad
uses are clear errors."""

import pytest
import torch
from hf_common.testing import tiny_llama_config
from transformers import LlamaConfig

from dgap_hf import LowBitCache, LowBitConfig, LowBitLayer
from dgap_hf.rope_frame import rope_inv_freq, rope_rotate

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(**kw):
    return LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=1,
                       head_dim=64, intermediate_size=64, vocab_size=64, **kw)


def test_rope_rotate_inverts_and_matches_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    freq = rope_inv_freq(_cfg(), 64)
    x = torch.randn(2, 3, 40, 64)
    # the same angles as transformers' Llama RoPE at positions 7..46 (rotate_half layout)
    pos = torch.arange(7, 47, dtype=torch.float32)
    emb = torch.cat([pos[:, None] * freq[None]] * 2, -1)
    ref, _ = apply_rotary_pos_emb(x, x, emb.cos()[None], emb.sin()[None])
    assert torch.allclose(rope_rotate(x, 7, freq), ref, atol=1e-4)
    assert torch.allclose(rope_rotate(rope_rotate(x, 7, freq, inverse=True), 7, freq), x, atol=1e-5)


def test_partial_rotary_leaves_the_other_channels():
    freq = rope_inv_freq(_cfg(partial_rotary_factor=0.5), 64)
    assert freq.numel() == 16
    x = torch.randn(1, 1, 5, 64)
    y = rope_rotate(x, 3, freq)
    assert torch.equal(y[..., 32:], x[..., 32:]) and not torch.allclose(y[..., :32], x[..., :32])


@pytest.mark.parametrize("rotation", ["hadamard", "none"])
def test_pre_rope_keys_quantize_rope_keys_like_their_pre_rope_form(rotation):
    """Keys that are one pre-RoPE vector per head turned by RoPE: per-channel groups see the rotation's full circle
    post-RoPE, a constant pre-RoPE. The pre-RoPE cache returns them far more accurately, at every index."""
    cfg = _cfg()
    freq = rope_inv_freq(cfg, 64)
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(1, 2, 1, 64, generator=g).expand(1, 2, 600, 64) + 0.01 * torch.randn(1, 2, 600, 64,
                                                                                             generator=g)
    k = rope_rotate(pre.contiguous(), 0, freq)
    v = torch.randn(1, 2, 600, 64, generator=g)
    err = {}
    for flag in (False, True):
        cache = LowBitCache(cfg, "K2V2", pre_rope_keys=flag, rotation=rotation)
        cache.update(k, v, 0)
        keys, _ = cache.update(k[:, :, -1:], v[:, :, -1:], 0)
        n = cache.layers[0].quantized_length
        assert n >= 512
        err[flag] = (keys[:, :, 4:4 + n] - k[:, :, 4:4 + n]).pow(2).mean().item()
    assert err[True] < 0.05 * err[False], err


def test_crop_and_beam_reorder_keep_each_token_at_its_index():
    cfg = _cfg()
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(3, 2, 700, 64, generator=g), torch.randn(3, 2, 700, 64, generator=g)
    cache = LowBitCache(cfg, "K2V2", pre_rope_keys=True)
    full, _ = cache.update(k, v, 0)
    before, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    cache.crop(-101)  # back to 600 tokens: into the quantized prefix (groups of 128), a partial group dequantized
    after, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert cache.get_seq_length() == 601
    assert torch.equal(after[:, :, :600], before[:, :, :600])
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    again, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert torch.equal(again[:, :, :600], after[[2, 0, 1], :, :600])
    # the quantized keys come back near the keys that went in (RoPE undone at the same index)
    assert (before[:, :, 4:600] - k[:, :, 4:600]).pow(2).mean() < 0.3


def test_spec_round_trip_and_errors():
    cfg = LowBitConfig.default("K2V2", pre_rope_keys=True)
    back = LowBitConfig.from_spec(cfg.to_spec())
    assert back == cfg and back.pre_rope_keys
    assert LowBitConfig.from_spec({"precision": "K2V2", "spec_version": 2}).pre_rope_keys is False
    with pytest.raises(ValueError, match="pre_rope_keys must be True, False or a tuple of layer indices"):
        LowBitConfig(pre_rope_keys="yes")
    with pytest.raises(ValueError, match="lists a layer twice"):
        LowBitConfig(pre_rope_keys=(3, 3))
    with pytest.raises(ValueError, match="RoPE frequencies"):
        LowBitCache(None, LowBitConfig(pre_rope_keys=True))
    with pytest.raises(ValueError, match="RoPE frequencies"):
        LowBitLayer(config=LowBitConfig(pre_rope_keys=True), layer_idx=0)
    no_rope = tiny_llama_config()
    no_rope.rope_parameters = None
    if hasattr(no_rope, "rope_theta"):
        no_rope.rope_theta = None
    with pytest.raises(ValueError, match="rope_theta"):
        rope_inv_freq(no_rope, 64)


def test_pre_rope_keys_per_layer():
    """A tuple of layers: those layers store pre-RoPE keys, the others post-RoPE; the spec keeps the tuple (a JSON
    list); a layer the model lacks is an error; without the model config the table cannot be placed."""
    cfg = LlamaConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=3, head_dim=64,
        intermediate_size=64, vocab_size=64)
    q = LowBitConfig.default("K2V2", pre_rope_keys=[2, 0])
    assert q.pre_rope_keys == (0, 2) and LowBitConfig(pre_rope_keys=()).pre_rope_keys is False
    import json

    assert LowBitConfig.from_spec(json.loads(json.dumps(q.to_spec()))) == q
    cache = LowBitCache(cfg, q)
    assert [layer.rope_inv_freq is not None for layer in cache.layers] == [True, False, True]
    assert [layer.config.pre_rope_keys for layer in cache.layers] == [True, False, True]
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    for i in range(3):
        cache.update(k, v, i)  # (the tokens flushed by this update come back at full precision once)
    outs = [cache.update(k[:, :, :1], v[:, :, :1], i)[0] for i in range(3)]
    assert torch.equal(outs[0], outs[2]) and not torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="pre_rope_keys names layer 5, but the model has 3 layers"):
        LowBitCache(cfg, LowBitConfig(pre_rope_keys=(5,)))
    with pytest.raises(ValueError, match="pre_rope_keys"):
        LowBitLayer(config=q)


def test_smollm2_k2v2_default_spends_its_budget_on_retrieval_heads():
    """The measured K2V2 default of SmolLM2-135M (session 11): 4-bit keys and values in the 8 retrieval heads, 4-bit
    keys in 11 more of the measured key heads, pre-RoPE keys in layers 15-29; other models do not get it."""
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M's shape
    q = LowBitConfig.default("K2V2", model_config=cfg)
    retrieval = {(18, 2), (17, 1), (23, 0), (20, 2), (21, 2), (6, 0), (21, 0), (20, 1)}
    assert {e[:2] for e in q.layer_value_bits} == retrieval and {e[-1] for e in q.layer_value_bits} == {4}
    assert retrieval < {e[:2] for e in q.layer_key_bits} and len(q.layer_key_bits) == 19
    assert q.pre_rope_keys == tuple(range(15, 30))
    assert LowBitConfig.default("K2V2", model_config=tiny_llama_config()).pre_rope_keys is False
    assert LowBitConfig.default("K2V4", model_config=cfg).pre_rope_keys is False
