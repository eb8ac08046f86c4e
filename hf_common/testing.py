"""Tiny random model configs for the tests and benchmarks of both packages (transformers is imported only when called,
so importing this module needs no torch)."""


def tiny_llama_config(**overrides):
    """A 2-layer Llama config (4 query / 2 KV heads, head_dim 64, vocabulary 512); `overrides` replace any field."""
    from transformers import LlamaConfig

    kw = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    kw.update(overrides)
    return LlamaConfig(**kw)


def same_bits(a, b) -> bool:
    """Same dtype, shape and bit pattern (never a tolerance): floats compared through their integer views."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    view = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
