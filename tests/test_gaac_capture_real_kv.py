"""benchmarks/capture_real_kv.py: the KV pool the kernel benchmarks tile is the model's own post-RoPE K/V."""

import importlib.util
from pathlib import Path

import torch
from transformers import DynamicCache

from gaac_hf.model_layers import cache_kwarg

ROOT = Path(__file__).resolve().parents[1]


def test_capture_stacks_every_layers_keys_and_values(tiny_llama):
    spec = importlib.util.spec_from_file_location("capture_real_kv", ROOT / "benchmarks" / "capture_real_kv.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    ids = torch.randint(3, 500, (1, 40), generator=torch.Generator().manual_seed(0))
    kv = mod.capture(tiny_llama, ids)
    cfg = tiny_llama.config
    assert kv.shape == (cfg.num_hidden_layers, 2, cfg.num_key_value_heads, 40, cfg.head_dim)
    ref = DynamicCache(config=cfg)
    with torch.no_grad():
        tiny_llama(input_ids=ids, use_cache=True, **{cache_kwarg(tiny_llama): ref})
    last = ref.layers[-1]
    assert torch.equal(kv[-1, 0].view(torch.int16), last.keys[0].view(torch.int16))
    assert torch.equal(kv[-1, 1].view(torch.int16), last.values[0].view(torch.int16))
