"""The lossless check shared by the GPU, multi-GPU and tensor-parallel tests."""

import torch
from transformers import DynamicCache

from gaac_hf import GAACCache
from gaac_hf.model_layers import cache_kwarg


def generate_both(model, calibration, batch: int, prompt: int, pad: int, new_tokens: int, device, seed: int = 2):
    """Greedy-generate a left-padded random batch with DynamicCache and with GAACCache; return
    `(gaac_out, dynamic_out, cache)` (outputs with `.sequences` and `.scores`)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              output_scores=True, return_dict_in_generate=True)
    name = cache_kwarg(model)
    ref = model.generate(ids, **kw, **{name: DynamicCache(config=model.config)})
    cache = GAACCache(model.config, calibration)
    out = model.generate(ids, **kw, **{name: cache})
    return out, ref, cache


def same_generation(a, b) -> bool:
    """Identical tokens and identical bits of every step's scores."""
    return torch.equal(a.sequences, b.sequences) and len(a.scores) == len(b.scores) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.scores, b.scores))
