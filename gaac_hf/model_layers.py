"""What GAAC needs to know about a model's layers, read from its transformers config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVGeometry:
    """Layer kinds and KV head shape of a decoder, as the cache sees them."""

    layer_types: tuple[str, ...]
    num_kv_heads: int
    head_dim: int

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")


def text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """Per-layer cache types (`full_attention`, `sliding_attention`, ...) and their constructor kwargs."""
    config = text_config(config)
    try:  # transformers >= 5.2x
        from transformers.cache_utils import get_layer_types_and_kwargs

        types, kwargs = get_layer_types_and_kwargs(config)
        return list(types), list(kwargs)
    except (ImportError, AttributeError):
        pass
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types is None:
        window = getattr(config, "sliding_window", None)
        use = getattr(config, "use_sliding_window", True)
        types = ["sliding_attention" if window is not None and use else "full_attention"] * n
    types = ["dummy" if t in ("moe", "mlp") else t for t in types]
    kwargs = [
        {"sliding_window": config.sliding_window} if t == "sliding_attention" else {} for t in types
    ]
    return list(types), kwargs


def kv_geometry(config) -> KVGeometry:
    cfg = text_config(config)
    types, _ = layer_types_and_kwargs(cfg)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return KVGeometry(tuple(types), int(kv_heads), int(head_dim))


def cache_kwarg(model) -> str:
    """The forward's cache keyword for a model (instance or class): `cache` on transformers >= 5.2x,
    `past_key_values` before (e.g. 5.17)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
