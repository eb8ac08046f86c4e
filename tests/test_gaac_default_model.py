"""GAACCache on the real SmolLM2-135M-Instruct at 4K context: resident KV as the compression report predicts."""

import pytest
import torch
from transformers import DynamicCache

from gaac_hf import GAACCache
from gaac_hf.cli import shipped_calibration
from gaac_hf.corpus import token_prompts
from gaac_hf.model_layers import cache_kwarg


@pytest.fixture(scope="module")
def prefilled_4k(smollm2, sample_corpus):
    model, tokenizer = smollm2
    prompt = token_prompts(tokenizer, sample_corpus.text, 4096, 1)[0][None]
    cache = GAACCache.from_pretrained(str(shipped_calibration()), config=model.config)
    name = cache_kwarg(model)
    with torch.no_grad():
        for s in range(0, 4096, 1024):  # chunked prefill: every chunk encodes its complete blocks
            model(input_ids=prompt[:, s:s + 1024], use_cache=True, logits_to_keep=1, **{name: cache})
    return model, cache


def test_resident_kv_at_4k_matches_the_report(prefilled_4k):
    model, cache = prefilled_4k
    stats = cache.stats()
    cfg = cache.calibration.config
    elements = 4096 * cfg.num_hidden_layers * 2 * cfg.num_kv_heads * cfg.head_dim
    assert stats["bf16_bytes"] == 2 * elements
    bits = 8 * stats["bytes"]["total"] / elements
    predicted = next(v for k, v in cfg.measured.items() if k.startswith("held-out"))["resident_bits"]
    print(f"\nSmolLM2 4K: resident {bits:.4f} bit/element, report predicts {predicted:.4f}; saving {stats['saving']:.4f}")
    assert abs(bits - predicted) / predicted < 0.01, (bits, predicted)
    assert stats["saving"] >= 0.26
    assert stats["bytes"]["tail"] == 0  # 4096 tokens are 256 complete blocks


def test_stored_kv_is_bit_identical_to_dynamic_cache(prefilled_4k, smollm2, sample_corpus):
    """Decompressing the cache gives back exactly the KV a DynamicCache holds (first 2 layers, first 1K tokens)."""
    model, cache = prefilled_4k
    tokenizer = smollm2[1]
    prompt = token_prompts(tokenizer, sample_corpus.text, 4096, 1)[0][None, :1024]
    ref = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, logits_to_keep=1, **{cache_kwarg(model): ref})
    for layer in (0, 1):
        got_k = cache.layers[layer].keys[:, :, :1024]
        got_v = cache.layers[layer].values[:, :, :1024]
        assert torch.equal(got_k.view(torch.int16), ref.layers[layer].keys.view(torch.int16))
        assert torch.equal(got_v.view(torch.int16), ref.layers[layer].values.view(torch.int16))


def test_stats_plot(prefilled_4k, tmp_path):
    from gaac_hf.plot import plot_stats

    _, cache = prefilled_4k
    fig = plot_stats(cache.stats(), tmp_path / "stats.png")
    assert (tmp_path / "stats.png").stat().st_size > 10_000
    bars = fig.axes[0].patches
    assert len(bars) == 4 * len(cache.gaac_layers)  # one bar per storage class and layer
    total = sum(b.get_height() for b in bars)
    assert abs(total - cache.stats()["bytes"]["total"] / 2**20) < 1e-6


def test_allocated_saving_stays_close_to_the_resident_one(smollm2, sample_corpus):
    """Pools grow by 1/128 of what they hold (not by doubling): at every length of a prefill-then-decode run from 600
    tokens on, what the cache has allocated saves at least 25.5% against BF16, within 2 points of what its live tiles
    save. The rest of the gap is the one scratch row each pool keeps per layer (the single-sync scatter target): at a
    few hundred tokens that row alone is worth a point, so 26% allocated is not reachable at every length."""
    model, tokenizer = smollm2
    prompt = token_prompts(tokenizer, sample_corpus.text, 700, 1)[0][None]
    cache = GAACCache.from_pretrained(str(shipped_calibration()), config=model.config)
    name = cache_kwarg(model)
    seen = []
    with torch.no_grad():
        model(input_ids=prompt[:, :600], use_cache=True, logits_to_keep=1, **{name: cache})
        for i in range(600, 700):  # decode steps, one block completing every 16
            model(input_ids=prompt[:, i:i + 1], use_cache=True, logits_to_keep=1, **{name: cache})
            if i % 16 == 15:
                s = cache.stats()
                allocated = 1 - s["allocated_bytes"]["total"] / s["bf16_bytes"]
                seen.append((i + 1, round(allocated, 4), round(s["saving"], 4)))
    print("\n(tokens, allocated saving, resident saving):", seen)
    assert all(a >= 0.255 and r - a <= 0.02 for _, a, r in seen), seen
