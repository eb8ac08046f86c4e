"""Capture the KV cache of a causal LM exactly as the cache stores it (post-RoPE keys, values), in BF16."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .model_layers import cache_kwarg, kv_geometry


@torch.no_grad()
def capture_kv(model, prompt_ids: torch.Tensor, chunk_tokens: int = 1024, progress: bool = True) -> torch.Tensor:
    """Run one long prompt through `model` in chunks (chunked prefill) and return its stored KV.

    Returns a tensor `[n_full_layers, 2 (K|V), kv_heads, tokens, head_dim]` on the CPU, in the model's KV dtype,
    for the model's full-attention layers (sliding-window and linear-attention layers are not GAAC's).
    """
    from transformers import DynamicCache

    geometry = kv_geometry(model.config)
    layers = geometry.full_attention_layers
    if not layers:
        raise ValueError("the model has no full-attention layers: there is no KV cache for GAAC to compress")
    ids = prompt_ids.reshape(1, -1).to(model.device)
    cache = DynamicCache(config=model.config)
    name = cache_kwarg(model)
    starts = range(0, ids.shape[1], chunk_tokens)
    for s in tqdm(starts, desc="prefill", unit="chunk", disable=not progress, leave=False):
        model(input_ids=ids[:, s:s + chunk_tokens], use_cache=True, logits_to_keep=1, **{name: cache})
    # layers may sit on different devices (device_map): gather on the CPU
    return torch.stack(
        [torch.stack([cache.layers[i].keys[0].cpu(), cache.layers[i].values[0].cpu()]) for i in layers]
    )


def capture_corpus(model, prompts: list[torch.Tensor], chunk_tokens: int = 1024, store: str | None = None,
                   desc: str = "capture KV"):
    """Yield the captured KV of each prompt; with `store`, keep each capture as safetensors and reuse it."""
    import hashlib
    import os

    from safetensors.torch import load_file, save_file

    for i, ids in enumerate(tqdm(prompts, desc=desc, unit="prompt")):
        path = None
        if store is not None:
            key = hashlib.sha256(ids.numpy().tobytes() + str(model.config.name_or_path).encode()).hexdigest()[:16]
            path = os.path.join(store, f"{i:04d}-{key}.safetensors")
            if os.path.isfile(path):
                yield load_file(path)["kv"]
                continue
        kv = capture_kv(model, ids, chunk_tokens=chunk_tokens)
        if path is not None:
            os.makedirs(store, exist_ok=True)
            save_file({"kv": kv.contiguous()}, path + ".tmp")
            os.replace(path + ".tmp", path)
        yield kv
