"""What a KV cache needs to know about a model, read from its transformers config."""

from __future__ import annotations

import inspect
import os
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGeometry:
    """Layer kinds and KV head shape of a decoder, as the cache sees them."""

    layer_types: tuple[str, ...]
    num_kv_heads: int
    head_dim: int
    num_attention_heads: int = 0  # query heads (0: not given)

    @property
    def group_heads(self) -> int:
        """Query heads per KV head (1 where the query heads are not known)."""
        return max(1, self.num_attention_heads // self.num_kv_heads) if self.num_attention_heads else 1

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")


def text_config(config):
    """The decoder's config (the text config of a multimodal model, the config itself otherwise)."""
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
    return KVGeometry(tuple(types), int(kv_heads), int(head_dim), int(heads))


def cache_kwarg(model) -> str:
    """The forward's cache keyword for a model (instance or class): `cache` on transformers >= 5.2x,
    `past_key_values` before (e.g. 5.17)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# --- model identity ------------------------------------------------------------------------------------------------
# An artifact made for one model fits another when these agree; the name (repo id or folder) never decides, since
# the same weights are loaded from a repo id, a local copy or a converted checkpoint alike.
IDENTITY_LABELS = {"architecture": "architecture", "num_hidden_layers": "layers",
                   "num_attention_heads": "attention heads", "num_kv_heads": "KV heads", "head_dim": "head_dim",
                   "vocab_size": "vocabulary size", "hidden_size": "hidden_size"}
IDENTITY_FIELDS = tuple(IDENTITY_LABELS)


def model_name(config) -> str:
    """The name a config was loaded under (repo id or folder), or ""."""
    return str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "") or "")


def model_identity(config) -> dict:
    """Architecture and shapes of the model with this config: the fields of `IDENTITY_FIELDS` that it defines."""
    cfg = text_config(config)
    archs = getattr(config, "architectures", None) or getattr(cfg, "architectures", None)
    heads = getattr(cfg, "num_attention_heads", None)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is None and heads and getattr(cfg, "hidden_size", None):
        head_dim = cfg.hidden_size // heads
    identity = {
        "architecture": str(archs[0]) if archs else None,
        "num_hidden_layers": getattr(cfg, "num_hidden_layers", None),
        "num_attention_heads": heads,
        "num_kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": head_dim,
        "vocab_size": getattr(cfg, "vocab_size", None),
        "hidden_size": getattr(cfg, "hidden_size", None),
    }
    return {k: (v if k == "architecture" else int(v)) for k, v in identity.items() if v is not None}


def identity_mismatches(expected: dict, config) -> list[str]:
    """How the model with `config` differs from the identity an artifact recorded (`expected`, a dict with any of
    the `IDENTITY_FIELDS`); fields either side does not know are not compared. Empty when they agree."""
    have = model_identity(config)
    # a multimodal model names its top-level class and, sometimes, its text model's: either is its architecture
    archs = {str(a) for c in (config, text_config(config)) for a in (getattr(c, "architectures", None) or [])}
    problems = []
    for key in IDENTITY_FIELDS:
        want, got = expected.get(key), have.get(key)
        if want is None or got is None or str(want) == str(got) or (key == "architecture" and str(want) in archs):
            continue
        problems.append(f"{IDENTITY_LABELS[key]} {got} (the artifact expects {want})")
    return problems


def _tail(name: str) -> str:
    return str(name).rstrip("/\\").replace("\\", "/").split("/")[-1].lower()


def warn_if_other_name(expected_name: str | None, config, what: str) -> None:
    """Warn (never fail) when a model whose shapes fit was loaded under another repo id than the artifact's.

    A local folder says nothing about which weights it holds (the embedded model is cached as
    `SmolLM2-135M-Instruct-bf16`), so a name that is an existing folder is not compared."""
    name = model_name(config)
    if not expected_name or not name or os.path.isdir(name) or _tail(name) == _tail(expected_name):
        return
    warnings.warn(f"{what} was made for {expected_name!r}; this model is {name!r} (same architecture and shapes, so "
                  f"it is used)", UserWarning, stacklevel=3)
