"""`LowBitCache`: a packed low-bit KV cache (KbVc, KIVI-style grouping) for `transformers` `generate`.

Every full-attention layer gets a `LowBitLayer`; every other layer (sliding window, linear attention, dummy, ...)
keeps the stock layer `DynamicCache(config=...)` builds.

A `LowBitLayer` stores

* the **quantized prefix**: keys per channel in groups of `group_size` tokens, values per token in groups of
  `group_size` channels (`dgap_hf.quantize`), packed into uint8 with BF16 statistics;
* the **residual**: the most recent tokens in the model's dtype. After an update, once the residual holds at least
  `residual_length + group_size` tokens, its oldest `n * group_size` tokens are quantized (so at least
  `residual_length` recent tokens stay in full precision) and appended to the quantized prefix. Quantized groups are
  never requantized (append-only); only `crop` into the quantized prefix brings a group back (dequantized) into the
  residual;
* optionally the **sink**: the first `sink_length` tokens of the sequence, kept in the model's dtype for good
  (attention sinks draw a large share of attention; quantizing their keys shifts every score). Default 0 (plain
  KIVI grouping).

`update()` returns K/V `[B, H_kv, S, D]` in the input dtype: the quantized prefix dequantized, then the residual and
the new tokens at full precision (tokens flushed in this very update are returned at full precision once, as
`transformers.QuantizedCache` does; later steps see them dequantized).
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from .precision import format_precision, parse_precision
from .quantize import (
    ONE_BIT_MODES, QuantizedGroups, check_bits, dequantize_keys, dequantize_values, quantize_keys, quantize_values,
)


def text_config(config):
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def layer_types(config) -> list[str]:
    """Per-layer cache types of a transformers config (`full_attention`, `sliding_attention`, ...)."""
    config = text_config(config)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs

        return list(get_layer_types_and_kwargs(config)[0])
    except (ImportError, AttributeError):
        pass
    types = getattr(config, "layer_types", None)
    if types is None:
        window = getattr(config, "sliding_window", None)
        use = getattr(config, "use_sliding_window", True)
        types = ["sliding_attention" if window is not None and use else "full_attention"] * config.num_hidden_layers
    return ["dummy" if t in ("moe", "mlp") else t for t in types]


class LowBitLayer(CacheLayerMixin):
    """Packed low-bit KV of one full-attention layer (see the module docstring)."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, key_bits: int = 2, value_bits: int = 2, group_size: int = 32, residual_length: int = 128,
                 one_bit_mode: str = "sign", layer_idx: int | None = None, sink_length: int = 0):
        self.key_bits = check_bits(key_bits, "key_bits")
        self.value_bits = check_bits(value_bits, "value_bits")
        if one_bit_mode not in ONE_BIT_MODES:
            raise ValueError(f"one_bit_mode must be one of {ONE_BIT_MODES}, not {one_bit_mode!r}")
        if group_size <= 0 or group_size % 8:
            raise ValueError(f"group_size must be a positive multiple of 8 (whole packed bytes), not {group_size}")
        if residual_length < 0:
            raise ValueError(f"residual_length must be >= 0, not {residual_length}")
        self.group_size = int(group_size)
        self.residual_length = int(residual_length)
        if sink_length < 0:
            raise ValueError(f"sink_length must be >= 0, not {sink_length}")
        self.sink_length = int(sink_length)
        self.one_bit_mode = one_bit_mode
        self.layer_idx = layer_idx
        super().__init__()
        self.device = None
        self._clear()

    def _clear(self) -> None:
        self.is_initialized = False
        self.batch = 0
        self.dtype = None
        self._qk: QuantizedGroups | None = None
        self._qv: QuantizedGroups | None = None
        self._n_quant = 0
        self._res_k = self._res_v = None
        self._sink_k = self._sink_v = None

    # `keys`/`values` are read by some third-party tools: give them the dequantized KV (read-only).
    @property
    def keys(self) -> torch.Tensor | None:
        return self._full()[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value):
        if value is not None:
            raise AttributeError("LowBitLayer.keys is read-only (the layer stores packed low-bit KV)")

    @property
    def values(self) -> torch.Tensor | None:
        return self._full()[1] if self.is_initialized else None

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("LowBitLayer.values is read-only (the layer stores packed low-bit KV)")

    @property
    def precision(self) -> str:
        return format_precision(self.key_bits, self.value_bits)

    @property
    def quantized_length(self) -> int:
        return self._n_quant

    @property
    def residual_tokens(self) -> int:
        return 0 if self._res_k is None else self._res_k.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        d = value_states.shape[-1]
        if d % self.group_size:
            raise ValueError(
                f"values are quantized in groups of group_size={self.group_size} channels, but head_dim is {d}; "
                f"pick a group_size that divides {d}")
        self.device = key_states.device
        self.dtype = key_states.dtype
        self.batch = key_states.shape[0]
        self._res_k = key_states[:, :, :0].clone()
        self._res_v = value_states[:, :, :0].clone()
        self._sink_k, self._sink_v = self._res_k.clone(), self._res_v.clone()
        self._qk = self._qv = None
        self._n_quant = 0
        self.is_initialized = True

    # --- storage --------------------------------------------------------------------------------------------------
    def _dequantized(self, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = dtype or self.dtype
        if self._n_quant == 0:
            return self._res_k[:, :, :0].to(dtype), self._res_v[:, :, :0].to(dtype)
        return dequantize_keys(self._qk, dtype), dequantize_values(self._qv, dtype)

    def _full(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._dequantized()
        return (torch.cat([self._sink_k, k, self._res_k], -2), torch.cat([self._sink_v, v, self._res_v], -2))

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole groups `k`, `v` `[B, H, n * G, D]` and append them to the quantized prefix."""
        qk = quantize_keys(k, self.key_bits, self.group_size, self.one_bit_mode)
        qv = quantize_values(v, self.value_bits, self.group_size, self.one_bit_mode)
        self._qk = qk if self._qk is None else self._qk.cat(qk, 2)
        self._qv = qv if self._qv is None else self._qv.cat(qv, 2)
        self._n_quant += k.shape[-2]

    # --- CacheLayerMixin ------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch or key_states.shape[1] != self._res_k.shape[1]:
            raise ValueError(
                f"layer {self.layer_idx} holds {self.batch} rows of {self._res_k.shape[1]} KV heads; got key states "
                f"of shape {tuple(key_states.shape)} (reset() the cache before reusing it for another batch)")
        room = self.sink_length - self._sink_k.shape[-2]
        if room > 0:  # the first tokens of the sequence go to the full-precision sink
            self._sink_k = torch.cat([self._sink_k, key_states[:, :, :room].to(self.dtype)], -2)
            self._sink_v = torch.cat([self._sink_v, value_states[:, :, :room].to(self.dtype)], -2)
            key_states, value_states = key_states[:, :, room:], value_states[:, :, room:]
        deq_k, deq_v = self._dequantized(key_states.dtype)
        res_k = torch.cat([self._res_k, key_states.to(self.dtype)], -2)
        res_v = torch.cat([self._res_v, value_states.to(self.dtype)], -2)
        g = self.group_size
        excess = res_k.shape[-2] - self.residual_length
        flush = (excess // g) * g if excess >= g else 0
        if flush:
            self._append(res_k[:, :, :flush], res_v[:, :, :flush])
            self._res_k = res_k[:, :, flush:].clone()  # clone: do not keep the flushed tokens' storage alive
            self._res_v = res_v[:, :, flush:].clone()
        else:
            self._res_k, self._res_v = res_k, res_v
        # one concatenation per step: sink, dequantized prefix, residual (with the new tokens)
        keys = torch.cat([self._sink_k.to(key_states.dtype), deq_k, res_k.to(key_states.dtype)], -2)
        values = torch.cat([self._sink_v.to(value_states.dtype), deq_v, res_v.to(value_states.dtype)], -2)
        return keys, values

    @property
    def sink_tokens(self) -> int:
        return 0 if self._sink_k is None else self._sink_k.shape[-2]

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.sink_tokens + self._n_quant + self.residual_tokens

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # the name on older transformers releases

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens. Cutting into the quantized prefix moves the partial group back
        into the residual, dequantized (it stays at low-bit accuracy)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead.")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        new_len = max(self.get_seq_length() + tokens_to_remove, 0)
        sink = self.sink_tokens
        if new_len <= sink:
            self._sink_k, self._sink_v = self._sink_k[:, :, :new_len].clone(), self._sink_v[:, :, :new_len].clone()
            self._res_k, self._res_v = self._res_k[:, :, :0].clone(), self._res_v[:, :, :0].clone()
            self._qk = self._qv = None
            self._n_quant = 0
            return
        new_len -= sink
        if new_len >= self._n_quant:
            keep = new_len - self._n_quant
            self._res_k = self._res_k[:, :, :keep].clone()
            self._res_v = self._res_v[:, :, :keep].clone()
            return
        g = self.group_size
        groups, rest = divmod(new_len, g)
        if rest:
            k = dequantize_keys(self._qk.map(lambda t: t[:, :, groups:groups + 1]), self.dtype)[:, :, :rest]
            v = dequantize_values(self._qv.map(lambda t: t[:, :, groups * g:new_len]), self.dtype)
        else:
            k, v = self._res_k[:, :, :0], self._res_v[:, :, :0]
        self._res_k, self._res_v = k.clone(), v.clone()
        if groups:
            self._qk = self._qk.map(lambda t: t[:, :, :groups].clone())
            self._qv = self._qv.map(lambda t: t[:, :, :groups * g].clone())
        else:
            self._qk = self._qv = None
        self._n_quant = groups * g

    def _select_rows(self, index: torch.Tensor) -> None:
        index = index.to(self.device)
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        self._res_k, self._res_v = pick(self._res_k), pick(self._res_v)
        self._sink_k, self._sink_v = pick(self._sink_k), pick(self._sink_v)
        if self._qk is not None:
            self._qk, self._qv = self._qk.map(pick), self._qv.map(pick)
        self.batch = self._res_k.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute the rows of the packed codes, statistics and residual (no requantization)."""
        if self.is_initialized:
            self._select_rows(beam_idx.long())

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch, device=self.device).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._select_rows(torch.arange(self.batch, device=self.device)[indices])

    def reset(self) -> None:
        self._clear()

    def _move(self, device) -> None:
        if self.is_initialized:
            self._res_k = self._res_k.to(device, non_blocking=True)
            self._res_v = self._res_v.to(device, non_blocking=True)
            self._sink_k = self._sink_k.to(device, non_blocking=True)
            self._sink_v = self._sink_v.to(device, non_blocking=True)
            if self._qk is not None:
                self._qk, self._qv = self._qk.to(device), self._qv.to(device)

    def offload(self) -> None:
        self._move("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self._res_k.device != torch.device(self.device):
            self._move(self.device)

    # --- accounting -----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """True resident bytes: packed codes, BF16 statistics and the full-precision residual, K and V."""
        tokens = self.get_seq_length()
        out = {"layer": self.layer_idx, "precision": self.precision, "rows": self.batch, "tokens": tokens,
               "quantized_tokens": self._n_quant, "residual_tokens": self.residual_tokens,
               "sink_tokens": self.sink_tokens}
        zero = {"key_codes": 0, "key_stats": 0, "value_codes": 0, "value_stats": 0, "residual": 0}
        if self.is_initialized:
            zero["residual"] = sum(t.numel() * t.element_size()
                                   for t in (self._res_k, self._res_v, self._sink_k, self._sink_v))
            if self._qk is not None:
                zero.update(key_codes=self._qk.packed_bytes, key_stats=self._qk.stat_bytes,
                            value_codes=self._qv.packed_bytes, value_stats=self._qv.stat_bytes)
        zero["total"] = sum(zero.values())
        elements = 2 * self.batch * tokens * (self._res_k.shape[1] * self._res_k.shape[3] if self.is_initialized else 0)
        out.update(bytes=zero, elements=elements, fp16_bytes=2 * elements,
                   ratio=(2 * elements / zero["total"]) if zero["total"] else float("nan"),
                   bits_per_element=(8 * zero["total"] / elements) if elements else float("nan"))
        return out


class LowBitCache(Cache):
    """Packed low-bit KV cache: `model.generate(..., cache=LowBitCache(model.config, "K2V2"))`.

    `precision` is a `"K<b>V<b>"` string (bits 1, 2, 4 or 8; mixed such as `"K2V4"` allowed); `key_bits` /
    `value_bits` override its halves. `group_size` tokens (keys, per channel) / channels (values, per token) share
    one BF16 scale and zero-point; `residual_length` recent tokens stay in full precision; 1-bit groups use
    `one_bit_mode` (`"sign"`: mean +/- mean absolute deviation, or `"minmax"`); the first `sink_length` tokens
    stay in full precision (attention sinks; default 0).

    With `config=None` every layer is a low-bit layer, created lazily (not for hybrid/sliding models). Pass the cache
    empty to `generate`, and `reset()` it before reusing it for an unrelated prompt.
    """

    def __init__(self, config=None, precision: str = "K2V2", *, key_bits: int | None = None,
                 value_bits: int | None = None, group_size: int = 32, residual_length: int = 128,
                 one_bit_mode: str = "sign", sink_length: int = 0, offloading: bool = False,
                 offload_only_non_sliding: bool = False):
        kb, vb = parse_precision(precision)
        kb = kb if key_bits is None else check_bits(key_bits, "key_bits")
        vb = vb if value_bits is None else check_bits(value_bits, "value_bits")
        self.config = config
        self.layer_kwargs = dict(key_bits=kb, value_bits=vb, group_size=group_size,
                                 residual_length=residual_length, one_bit_mode=one_bit_mode,
                                 sink_length=sink_length)
        LowBitLayer(**self.layer_kwargs)  # validate the options now, not at the first update
        if config is None:
            super().__init__(layer_class_to_replicate=functools.partial(LowBitLayer, **self.layer_kwargs),
                             offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
            return
        types = layer_types(config)
        stock = DynamicCache(config=config).layers
        if len(stock) != len(types):
            raise ValueError(f"DynamicCache built {len(stock)} layers for a config with {len(types)} layer types")
        layers = [LowBitLayer(**self.layer_kwargs, layer_idx=i) if t == "full_attention" else stock[i]
                  for i, t in enumerate(types)]
        super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    @property
    def precision(self) -> str:
        return format_precision(self.layer_kwargs["key_bits"], self.layer_kwargs["value_bits"])

    @property
    def low_bit_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, LowBitLayer)]

    def quantizer_spec(self) -> dict:
        """JSON description of the quantizer (recorded in DGAP artifacts)."""
        return {
            "precision": self.precision, **self.layer_kwargs,
            "key_grouping": "per channel, groups of group_size tokens",
            "value_grouping": "per token, groups of group_size channels",
            "stat_dtype": "bfloat16", "packing": "uint8, little-end first",
            "minmax": "asymmetric zero + q * scale, statistics rounded outward",
            "sign": "1 bit: mean +/- mean absolute deviation",
            "sink": "the first sink_length tokens stay in the model dtype",
        }

    def stats(self) -> dict:
        """Resident bytes per storage class (summed over low-bit layers), vs 16-bit KV, plus per-layer stats.

        `uncompressed_bytes` counts the stock (sliding-window, ...) layers' keys/values, left at full precision."""
        per_layer = {i: self.layers[i].stats() for i in self.low_bit_layers}
        keys = ("key_codes", "key_stats", "value_codes", "value_stats", "residual", "total")
        total = {k: sum(s["bytes"][k] for s in per_layer.values()) for k in keys}
        elements = sum(s["elements"] for s in per_layer.values())
        other = 0
        for i, layer in enumerate(self.layers):
            if i not in per_layer and isinstance(getattr(layer, "keys", None), torch.Tensor):
                other += sum(t.numel() * t.element_size() for t in (layer.keys, layer.values))
        return {
            "precision": self.precision,
            "bytes": total,
            "elements": elements,
            "fp16_bytes": 2 * elements,
            "ratio": 2 * elements / total["total"] if total["total"] else float("nan"),
            "bits_per_element": 8 * total["total"] / elements if elements else float("nan"),
            "uncompressed_bytes": other,
            "layers": per_layer,
        }
