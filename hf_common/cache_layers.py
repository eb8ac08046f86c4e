"""Cache pieces `GAACCache` and `LowBitCache` share: the layer list (full-attention layers get the package's layer,
every other layer the stock one `DynamicCache(config=...)` builds), the row-selection methods, and the byte tallies.

Imports torch and transformers (only those): import it from cache modules, not from `hf_common/__init__.py`, which
stays free of torch.
"""

from __future__ import annotations

from typing import Callable

import torch
from transformers import DynamicCache

from .model_config import layer_types_and_kwargs


def full_attention_layers(config, make_layer: Callable[[int], object], stock: list | None = None) -> list:
    """One cache layer per model layer: `make_layer(i)` for the full-attention layers, the stock transformers layer
    for every other one: `stock[i]`, by default the layers `DynamicCache(config=config)` builds (same classes, same
    sliding windows), so sliding and hybrid models return the same K/V lengths as with the stock cache."""
    types, _ = layer_types_and_kwargs(config)
    stock = DynamicCache(config=config).layers if stock is None else stock
    if len(stock) != len(types):
        raise ValueError(f"the stock cache built {len(stock)} layers for a config with {len(types)} layer types")
    return [make_layer(i) if t == "full_attention" else stock[i] for i, t in enumerate(types)]


def tokens_to_crop(tokens_to_remove, is_initialized: bool) -> int:
    """The tokens a layer's `crop(tokens_to_remove)` removes, a Python int (0: nothing to do). transformers' convention:
    a negative count removes that many tokens; a positive one is refused, as `DynamicLayer.crop` refuses it. The count
    may come as a 0-d tensor (assisted decoding in transformers 5.17 passes one)."""
    tokens_to_remove = int(tokens_to_remove)
    if tokens_to_remove > 0:
        raise ValueError(
            f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
            "Please use a negative integer to remove that number of tokens from the cache instead.")
    return -tokens_to_remove if is_initialized else 0


def _read_only_kv(index: int, name: str) -> property:
    def get(self):
        return self._dense_kv()[index] if self.is_initialized else None

    def set(self, value):
        if value is not None:  # (transformers' layer constructor sets None)
            raise AttributeError(f"{type(self).__name__}.{name} is read-only (the layer stores {self.STORED_AS})")
    return property(get, set)


class DenseKVMixin:
    """`keys` / `values` of a layer that stores KV in another form, for third-party tools that read them: the layer's
    `_dense_kv()` (K, V) in BF16, read-only (`STORED_AS` names the storage in the error). Put it before
    `CacheLayerMixin` among the bases."""

    STORED_AS = "KV in another form"
    keys = _read_only_kv(0, "keys")
    values = _read_only_kv(1, "values")

    def _dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class RowSelectionMixin:
    """`reorder_cache` / `batch_repeat_interleave` / `batch_select_indices` of a cache layer, all through the layer's
    `_select_rows(index)` (a LongTensor of the rows to keep, in order); `is_initialized`, `batch` and `device` come
    from the layer."""

    def _select_rows(self, index: torch.Tensor) -> None:
        raise NotImplementedError

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:
            self._select_rows(beam_idx.long())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch, device=self.device)[indices])


def sum_layer_bytes(per_layer: dict, field: str, keys) -> dict:
    """`{key: sum over the layers' stats()[field][key]}` (a missing key counts 0)."""
    return {k: sum(s[field].get(k, 0) for s in per_layer.values()) for k in keys}


def stock_layer_bytes(layers, skip) -> int:
    """Bytes of the keys/values the stock (not compressed) layers hold; `skip` the indices of the compressed ones."""
    total = 0
    for i, layer in enumerate(layers):
        if i not in skip and isinstance(getattr(layer, "keys", None), torch.Tensor):
            total += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
    return total
