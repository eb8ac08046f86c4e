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
  (attention sinks draw a large share of attention; quantizing their keys shifts every score).

The options (group sizes, sinks, rotation, non-uniform levels, outliers) are a `LowBitConfig`
(`dgap_hf.lowbit_config`). With a rotation the layer quantizes `x @ R` and returns `x_hat @ R.T` (post-RoPE keys;
the attention needs no change).

Pre-RoPE keys (`pre_rope_keys=True`): `cache.update` receives post-RoPE keys and no positions, so the layer turns
each quantized key back by the RoPE angle of its own cache index (the model's frequencies) and forward again after
dequantizing (`dgap_hf.rope_frame`: exact as a map whatever the padding; the angles only decide how well the keys
quantize).

`update()` returns K/V `[B, H_kv, S, D]` in the input dtype: the quantized prefix dequantized, then the residual and
the new tokens at full precision (tokens flushed in this very update are returned at full precision once, as
`transformers.QuantizedCache` does; later steps see them dequantized).
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_common.cache_layers import (DenseKVMixin, RowSelectionMixin, full_attention_layers, stock_layer_bytes,
                                   sum_layer_bytes, tokens_to_crop)
from hf_common.model_config import text_config

from .lowbit_config import RESIDUAL_WINDOW, LowBitConfig
from .precision import format_precision
from .quantize import (
    QuantizedGroups, check_bits, dequantize_keys, dequantize_values, quantize_keys, quantize_keys_by_head,
    quantize_values, quantize_values_by_head)
from .rope_frame import RopeTable, rope_inv_freq
from .rotation import rotation_matrix


class LowBitLayer(RowSelectionMixin, DenseKVMixin, CacheLayerMixin):
    """Packed low-bit KV of one full-attention layer (see the module docstring)."""

    is_sliding = False
    is_croppable = True
    is_compileable = False
    STORED_AS = "packed low-bit KV"  # (`keys` / `values`: the dequantized KV, read-only)

    def __init__(self, key_bits: int = 2, value_bits: int = 2, group_size: int = 32, residual_length: int = 128,
                 one_bit_mode: str = "sign", layer_idx: int | None = None, sink_length: int = 0, *,
                 config: LowBitConfig | None = None, rope_inv_freq: torch.Tensor | None = None):
        if config is None:
            if residual_length < 0:
                raise ValueError(f"residual_length must be >= 0, not {residual_length}")
            if sink_length < 0:
                raise ValueError(f"sink_length must be >= 0, not {sink_length}")
            config = LowBitConfig(format_precision(check_bits(key_bits, "key_bits"), check_bits(value_bits,
                                  "value_bits")), key_group_size=group_size, value_group_size=group_size,
                                  residual_length=residual_length, sink_length=sink_length, one_bit_mode=one_bit_mode)
        if (config.layer_key_bits or config.layer_value_bits or not isinstance(config.pre_rope_keys, bool)) \
                and layer_idx is None:
            raise ValueError("a config with layer_key_bits / layer_value_bits / pre_rope_keys layers needs the layer "
                             "index of each layer "
                             "(build the cache with the model's config: LowBitCache(model.config, ...))")
        if config.pre_rope_in(layer_idx) and rope_inv_freq is None:
            raise ValueError("pre_rope_keys needs the model's RoPE frequencies (build the cache with the model's "
                             "config: LowBitCache(model.config, ...))")
        self.rope_inv_freq = rope_inv_freq if config.pre_rope_in(layer_idx) else None
        self._rope_table = None if self.rope_inv_freq is None else RopeTable(self.rope_inv_freq)
        self.head_bits = config.head_key_bits(layer_idx)  # {kv_head: key bits} where they differ from the layer's
        self.head_value_bits = config.head_value_bits(layer_idx)  # the same for the values
        self.config = config = config.for_layer(layer_idx)
        self.key_bits, self.value_bits = config.key_bits, config.value_bits
        self.group_size = config.key_group_size  # flush granularity (tokens)
        self.residual_length = config.residual_length
        self.sink_length = config.sink_length
        self.one_bit_mode = config.one_bit_mode
        self.layer_idx = layer_idx
        super().__init__()
        self.device = None
        self._rot = None
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
        self.config.check_head_dim(d)
        for name, table in (("layer_key_bits", self.head_bits), ("layer_value_bits", self.head_value_bits)):
            if table and max(table) >= key_states.shape[1]:
                raise ValueError(f"layer {self.layer_idx}: {name} names KV head {max(table)}, but the layer has "
                                 f"{key_states.shape[1]} KV heads")
        self._rot = (rotation_matrix(self.config.rotation, d, self.config.rotation_seed, key_states.device)
                     if self.config.rotation != "none" else None)
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
    def _rotate(self, x: torch.Tensor, which: str, inverse: bool = False) -> torch.Tensor:
        if self._rot is None or not self.config.rotates(which):
            return x
        r = self._rot.T if inverse else self._rot
        return (x.float() @ r).to(x.dtype)

    def _rope(self, k: torch.Tensor, start: int, inverse: bool) -> torch.Tensor:
        """Keys `[B, H, S, D]` (float32) whose first token is quantized token `start`: turned back by their RoPE
        angle (`inverse`, before quantization) or forward again (after dequantization); as they are without
        `pre_rope_keys`. The sink precedes the quantized tokens, so quantized token i sits at cache index
        `sink_length + i`."""
        if self._rope_table is None:
            return k
        return self._rope_table.rotate(k, self.sink_length + start, inverse=inverse)

    def _dequantize(self, qk: QuantizedGroups, qv: QuantizedGroups, dtype,
                    start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        per_token = self.config.key_axis == "token"
        k = self._rotate((dequantize_values if per_token else dequantize_keys)(qk, torch.float32), "k",
                         inverse=True)
        k = self._rope(k, start, inverse=False).to(dtype)
        v = self._rotate(dequantize_values(qv, torch.float32), "v", inverse=True).to(dtype)
        return k, v

    def _dequantized(self, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = dtype or self.dtype
        if self._n_quant == 0:
            return self._res_k[:, :, :0].to(dtype), self._res_v[:, :, :0].to(dtype)
        return self._dequantize(self._qk, self._qv, dtype)

    def _dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._dequantized()
        return (torch.cat([self._sink_k, k, self._res_k], -2), torch.cat([self._sink_v, v, self._res_v], -2))

    def _groups(self, x: torch.Tensor, head_bits: dict, bits: int, per_token: bool, group: int, outliers: int,
                fmt: dict):
        """`x` `[B, H, S, D]` quantized per token (values' layout) or per channel (keys'), by head where `head_bits`
        gives some heads other bits."""
        c = self.config
        if head_bits:
            bits = [head_bits.get(h, bits) for h in range(x.shape[1])]
            quantize = quantize_values_by_head if per_token else quantize_keys_by_head
        else:
            quantize = quantize_values if per_token else quantize_keys
        return quantize(x, bits, group, c.one_bit_mode, c.levels, outliers, **fmt)

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize whole groups `k`, `v` `[B, H, n * G, D]` and append them to the quantized prefix."""
        c = self.config
        fmt = dict(scale_dtype=c.key_scale_dtype, zero_dtype=c.key_zero_dtype, outlier_dtype=c.outlier_dtype)
        per_token = c.key_axis == "token"  # keys grouped like the values (per token over value_group_size channels)
        k = self._rope(k.float(), self._n_quant, inverse=True)
        qk = self._groups(self._rotate(k, "k"), self.head_bits, c.key_bits, per_token,
                          c.value_group_size if per_token else c.key_group_size, c.key_outliers, fmt)
        vfmt = dict(scale_dtype=c.value_scale_dtype, zero_dtype=c.value_zero_dtype, outlier_dtype=c.outlier_dtype)
        qv = self._groups(self._rotate(v.float(), "v"), self.head_value_bits, c.value_bits, True, c.value_group_size,
                          c.value_outliers, vfmt)
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
        n = tokens_to_crop(tokens_to_remove, self.is_initialized)
        if not n:
            return
        new_len = max(self.get_seq_length() - n, 0)
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
        kg = 1 if self.config.key_axis == "channel" else g  # key entries along dim 2 per flushed group of g tokens
        groups, rest = divmod(new_len, g)
        if rest:
            k, v = self._dequantize(self._qk.map(lambda t: t[:, :, groups * kg:(groups + 1) * kg]),
                                    self._qv.map(lambda t: t[:, :, groups * g:(groups + 1) * g]), self.dtype,
                                    start=groups * g)
            k, v = k[:, :, :rest], v[:, :, :rest]
        else:
            k, v = self._res_k[:, :, :0], self._res_v[:, :, :0]
        self._res_k, self._res_v = k.clone(), v.clone()
        if groups:
            self._qk = self._qk.map(lambda t: t[:, :, :groups * kg].clone())
            self._qv = self._qv.map(lambda t: t[:, :, :groups * g].clone())
        else:
            self._qk = self._qv = None
        self._n_quant = groups * g

    def _select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (beam search, ...): the rows of the packed codes, statistics, sink and residual are
        selected (no requantization)."""
        index = index.to(self.device)
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        self._res_k, self._res_v = pick(self._res_k), pick(self._res_v)
        self._sink_k, self._sink_v = pick(self._sink_k), pick(self._sink_v)
        if self._qk is not None:
            self._qk, self._qv = self._qk.map(pick), self._qv.map(pick)
        self.batch = self._res_k.shape[0]

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
        """Resident bytes, K and V. `bytes["residual"]` is the newest `min(residual_tokens, 128)` tokens in full
        precision (the recent window); every other byte (packed codes, BF16 statistics, outliers, sinks, older
        full-precision residual tokens as `"pending"`) is in the other entries and in `bytes["total"]`.
        `bits_per_element` = `8 * total / elements outside the recent window`."""
        tokens = self.get_seq_length()
        out = {"layer": self.layer_idx, "precision": self.precision, "rows": self.batch, "tokens": tokens,
               "quantized_tokens": self._n_quant, "residual_tokens": self.residual_tokens,
               "sink_tokens": self.sink_tokens}
        b = {"key_codes": 0, "key_stats": 0, "key_outliers": 0, "value_codes": 0, "value_stats": 0,
             "value_outliers": 0, "sink": 0, "pending": 0}
        window = min(self.residual_tokens, RESIDUAL_WINDOW)
        per_token = 0
        if self.is_initialized:
            per_token = 2 * self.batch * self._res_k.shape[1] * self._res_k.shape[3]  # K and V elements per token
            elt = self._res_k.element_size()
            b["sink"] = self.sink_tokens * per_token * elt
            b["pending"] = (self.residual_tokens - window) * per_token * elt
            if self._qk is not None:
                b.update(key_codes=self._qk.packed_bytes, key_stats=self._qk.stat_bytes,
                         key_outliers=self._qk.outlier_bytes, value_codes=self._qv.packed_bytes,
                         value_stats=self._qv.stat_bytes, value_outliers=self._qv.outlier_bytes)
        b["total"] = sum(b.values())
        b["residual"] = window * per_token * (self._res_k.element_size() if self.is_initialized else 0)
        elements = per_token * tokens
        counted = per_token * (tokens - window)
        out.update(bytes=b, elements=elements, counted_elements=counted, bf16_bytes=2 * elements,
                   ratio=(2 * elements / (b["total"] + b["residual"])) if b["total"] + b["residual"] else float("nan"),
                   bits_per_element=(8 * b["total"] / counted) if counted else float("nan"))
        return out


class LowBitCache(Cache):
    """Packed low-bit KV cache: `model.generate(..., cache=LowBitCache(model.config, "K2V2"))`.

    `precision` is a `"K<b>V<b>"` string (bits 1, 2, 4 or 8; mixed such as `"K2V4"` allowed), which selects that
    precision's measured best options (`LowBitConfig.default`), or a `LowBitConfig`. Keyword options override it:
    `key_bits` / `value_bits`, `group_size` (both group sizes) and any `LowBitConfig` field (`sink_length`,
    `rotation`, `levels`, `key_outliers`, ...). To reproduce the quantizer a DGAP artifact was trained on, pass
    `LowBitConfig.from_spec(artifact.quantizer[precision])`.

    With `config=None` every layer is a low-bit layer, created lazily (not for hybrid/sliding models). Pass the cache
    empty to `generate`, and `reset()` it before reusing it for an unrelated prompt.
    """

    def __init__(self, config=None, precision: str | LowBitConfig = "K2V2", *, key_bits: int | None = None,
                 value_bits: int | None = None, group_size: int | None = None, offloading: bool = False,
                 offload_only_non_sliding: bool = False, **options):
        head_dim = None
        if config is not None:
            tc = text_config(config)
            head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        quant = (precision if isinstance(precision, LowBitConfig)
                 else LowBitConfig.default(precision, head_dim, model_config=config))
        if key_bits is not None or value_bits is not None:
            kb = quant.key_bits if key_bits is None else check_bits(key_bits, "key_bits")
            vb = quant.value_bits if value_bits is None else check_bits(value_bits, "value_bits")
            options["precision"] = format_precision(kb, vb)
        if group_size is not None:
            options.setdefault("key_group_size", group_size)
            options.setdefault("value_group_size", group_size)
        try:
            quant = quant.replace(**options)
        except TypeError as e:
            raise TypeError(f"LowBitCache: {e} (the options are LowBitConfig's fields)") from None
        if head_dim is not None:
            quant.check_head_dim(head_dim)
            quant.check_layers(tc.num_hidden_layers, getattr(tc, "num_key_value_heads", None)
                               or tc.num_attention_heads)
        self.config = config
        self.quant_config = quant
        if config is None:
            if quant.layer_key_bits or quant.layer_value_bits:
                raise ValueError("a per-layer bits table (layer_key_bits / layer_value_bits) needs the model's "
                                 "config: LowBitCache(model.config, ...)")
            if quant.pre_rope_keys:
                raise ValueError("pre_rope_keys needs the model's RoPE frequencies: LowBitCache(model.config, ...)")
            super().__init__(layer_class_to_replicate=functools.partial(LowBitLayer, config=quant),
                             offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)
            return
        inv_freq = rope_inv_freq(config, head_dim) if quant.pre_rope_keys else None
        layers = full_attention_layers(config, lambda i: LowBitLayer(config=quant, layer_idx=i,
                                                                      rope_inv_freq=inv_freq))
        super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    @property
    def precision(self) -> str:
        return self.quant_config.precision

    @property
    def low_bit_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, LowBitLayer)]

    def quantizer_spec(self) -> dict:
        """JSON description of the quantizer (recorded in DGAP artifacts; `LowBitConfig.from_spec` reads it)."""
        return self.quant_config.to_spec()

    def stats(self) -> dict:
        """Resident bytes per storage class (summed over low-bit layers), vs BF16 KV, plus per-layer stats.

        `bytes["residual"]` is the recent full-precision window (at most 128 tokens per layer); `bytes["total"]`
        everything else, including `bytes["rotation"]` (the resident rotation matrix, float32, once per cache).
        `bits_per_element` = `8 * total / elements outside the window`; `ratio` = BF16 bytes / all resident bytes.
        `uncompressed_bytes` counts the stock (sliding-window, ...) layers' keys/values, left at full precision."""
        per_layer = {i: self.layers[i].stats() for i in self.low_bit_layers}
        keys = ("key_codes", "key_stats", "key_outliers", "value_codes", "value_stats", "value_outliers", "sink",
                "pending", "total", "residual")
        total = sum_layer_bytes(per_layer, "bytes", keys)
        rot = next((self.layers[i]._rot for i in per_layer if self.layers[i]._rot is not None), None)
        total["rotation"] = 0 if rot is None else rot.numel() * rot.element_size()
        total["total"] += total["rotation"]
        elements = sum(s["elements"] for s in per_layer.values())
        counted = sum(s["counted_elements"] for s in per_layer.values())
        other = stock_layer_bytes(self.layers, per_layer)
        resident = total["total"] + total["residual"]
        return {
            "precision": self.precision,
            "bytes": total,
            "elements": elements,
            "counted_elements": counted,
            "bf16_bytes": 2 * elements,
            "ratio": 2 * elements / resident if resident else float("nan"),
            "bits_per_element": 8 * total["total"] / counted if counted else float("nan"),
            "uncompressed_bytes": other,
            "layers": per_layer,
        }
