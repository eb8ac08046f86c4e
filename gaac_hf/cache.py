"""`GAACCache`: a lossless compressed KV cache for `transformers` `generate`.

Every full-attention layer gets a `GAACLayer`; every other layer (sliding window, linear attention, dummy, ...) gets
the stock transformers layer that `DynamicCache(config=...)` would build, so hybrid and sliding models work unchanged.

A `GAACLayer` is fill-then-finalize. New tokens go to a BF16 *tail*; every completed 16-token block is encoded once
(K and V, every kv-head and tile independently, all batch rows in one vectorized `encode_tiles` call) and is never
re-encoded afterwards (only `crop` pulls a block back into the tail). A tile goes to one of two storage classes:

* the *slot pool*, uint8 `[n_slots, slot_bytes]`: fixed-size GAAC slots (format.py);
* the *raw pool*, BF16 `[n_raw, 16, C]`: tiles whose escape bytes overflow the slot's escape capacity.

The *block table*, int32 `[batch, blocks, 2 (K|V), kv_heads, tiles]`, holds for every tile its slot index (>= 0)
or `-1 - raw_index`. Both pools grow by amortized doubling. Finalized tiles are immutable, so rows may share them
(beam search, `batch_repeat_interleave`); tiles no row references any more (after `crop`, `reorder_cache`,
`batch_select_indices`, `reset`) are found by a mark-and-sweep over the table and reused.

`update()` returns K/V `[B, H_kv, S, D]` BF16: the losslessly expanded full K/V (all finalized tiles decoded, plus
the tail), except when the model runs the `"gaac"` attention (gaac_hf/attention.py) on a single query token: then it
returns `GAACLazyKV` tensors, storage-less tensor subclasses that carry a `CompressedKV` snapshot of the layer, which
the `"gaac"` decode attention reads block by block. Any other torch op on a `GAACLazyKV` materializes it
(bit-identical to the expanded K/V).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_common.cache_layers import (DenseKVMixin, RowSelectionMixin, full_attention_layers, stock_layer_bytes,
                                   sum_layer_bytes, tokens_to_crop)

from . import ops
from .cache_inputs import (ENCODE_MAX_TILES, GAAC_ATTENTION_NAME, check_kv_dtype, check_storage_format,
                           choose_format, config_and_calibration)
from .calibration import CalibrationMismatchError, GAACCalibration
from .compressed_kv import CompressedKV, GAACLazyKV
from .format import BLOCK_TABLE_ENTRY_BYTES, BLOCK_TOKENS, MODE_NAMES, TileLayout, tile_split
from .model_layers import kv_geometry, text_config
from .tile_pool import TilePool, grow

# (CompressedKV, GAACLazyKV and GAAC_ATTENTION_NAME are importable from here too, as before they moved)
__all__ = ["GAACCache", "GAACLayer", "CompressedKV", "GAACLazyKV", "GAAC_ATTENTION_NAME"]


class GAACLayer(RowSelectionMixin, DenseKVMixin, CacheLayerMixin):
    """The GAAC-compressed cache of one full-attention layer (see the module docstring)."""

    is_sliding = False
    is_croppable = True
    is_compileable = False
    STORED_AS = "compressed KV"  # (`keys` / `values`: the decoded KV, read-only)

    def __init__(self, calibration: GAACCalibration, layer_idx: int, tp_rank: int | None = None,
                 tp_size: int | None = None, format_version: int | None = None, group_heads: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        cfg = calibration.config
        self.calibration = calibration
        self.requested_format, self.group_heads = format_version, group_heads
        self.format_version = None  # of the stored slots: chosen on the first update, per device (`choose_format`)
        self.layer_idx = layer_idx
        self.num_kv_heads, self.head_dim = cfg.num_kv_heads, cfg.head_dim
        self.tiles, self.channels = tile_split(cfg.head_dim)
        self.layout = TileLayout(self.channels, cfg.escape_capacity)
        base3, base4 = calibration.windows(layer_idx)  # [2, H, D] each
        shape = (2, self.num_kv_heads, self.tiles, self.channels)
        self._base3, self._base4 = base3.reshape(shape), base4.reshape(shape)
        self.lazy = False  # set per forward by GAACCache: return GAACLazyKV for single-token updates
        self.device = None
        self.pool = TilePool(self.layout.slot_bytes, self.channels)
        self._clear()

    # --- state ----------------------------------------------------------------------------------------------------
    def _clear(self) -> None:
        self.is_initialized = False
        self.batch = 0
        self.n_blocks = 0
        self._table = None
        self._tail_k = self._tail_v = None
        self.pool.clear()

    @property
    def tail_length(self) -> int:
        return 0 if self._tail_k is None else self._tail_k.shape[-2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_kv_dtype(key_states, value_states)
        b, h, _, d = key_states.shape
        vb, vh, _, vd = value_states.shape
        if h != self.num_kv_heads and d == self.head_dim and (vb, vh, vd) == (b, h, d):
            self._take_shard(h)
        if (h, d) != (self.num_kv_heads, self.head_dim) or (vb, vh, vd) != (b, h, d):
            raise CalibrationMismatchError(
                f"layer {self.layer_idx} gets KV of shape {tuple(key_states.shape)} / {tuple(value_states.shape)}; "
                f"the GAAC calibration has "
                f"{self.num_kv_heads} KV heads of dim {self.head_dim}")
        device = key_states.device
        self.format_version = choose_format(self.requested_format, self.calibration, self.head_dim, self.group_heads,
                                            device)
        self.pool.on(device)
        self.device = device
        self._base3, self._base4 = self._base3.to(device), self._base4.to(device)
        self.batch = b
        self.n_blocks = 0
        self._table = torch.zeros(b, 0, 2, h, self.tiles, dtype=torch.int32, device=device)
        self._tail_k = key_states.new_zeros(b, h, 0, d)
        self._tail_v = value_states.new_zeros(b, h, 0, d)
        self.is_initialized = True

    def _take_shard(self, heads: int) -> None:
        """Tensor parallelism: this rank holds `heads` of the calibrated KV heads (a contiguous slice, as
        transformers' colwise k/v projections split them); keep that slice of the windows."""
        if self.num_kv_heads % heads:
            return
        size = self.num_kv_heads // heads
        rank, tp_size = self.tp_rank, self.tp_size
        if rank is None:
            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() == size):
                return  # not a recognizable shard: the shape check below raises
            rank, tp_size = dist.get_rank(), size
        if tp_size != size:
            raise CalibrationMismatchError(
                f"layer {self.layer_idx} gets {heads} of {self.num_kv_heads} KV heads, i.e. a 1/{size} shard, "
                f"but the cache was built for tp_size={tp_size}")
        rows = slice(rank * heads, (rank + 1) * heads)
        self._base3, self._base4 = self._base3[:, rows].contiguous(), self._base4[:, rows].contiguous()
        self.num_kv_heads = heads

    # --- storage --------------------------------------------------------------------------------------------------
    def windows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bases as uint8 `[2, H, D]` (the attention's layout)."""
        shape = (2, self.num_kv_heads, self.head_dim)
        return self._base3.reshape(shape), self._base4.reshape(shape)

    def _flat_bases(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = 2 * self.num_kv_heads * self.tiles
        return self._base3.reshape(p, self.channels), self._base4.reshape(p, self.channels)

    def _live(self) -> torch.Tensor:
        return self._table[:, :self.n_blocks]

    def _append_blocks(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Encode the complete blocks `k`, `v` `[B, H, nb * 16, D]` and append them to the block table."""
        nb = k.shape[-2] // BLOCK_TOKENS
        p = 2 * self.num_kv_heads * self.tiles
        step = max(1, ENCODE_MAX_TILES // max(self.batch * p, 1))
        self._table = grow(self._table, self.n_blocks + nb, dim=1)
        b3, b4 = self._flat_bases()
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            t0, t1 = b0 * BLOCK_TOKENS, b1 * BLOCK_TOKENS
            tiles = ops.tiles_of(k[:, :, t0:t1], v[:, :, t0:t1])  # [B, n, P, 16, C]
            slots, fits, counts = ops.encode(tiles, b3, b4, self.layout.escape_capacity, self.format_version)
            entries = self.pool.store(slots.reshape(-1, slots.shape[-1]),
                                      tiles.reshape(-1, BLOCK_TOKENS, self.channels), fits.reshape(-1),
                                      counts.reshape(-1, 3), self._live)
            self._table[:, self.n_blocks + b0:self.n_blocks + b1] = entries.reshape(
                self.batch, b1 - b0, 2, self.num_kv_heads, self.tiles)
        self.n_blocks += nb

    def decode_table(self, table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor,
                     tails: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Table entries `[B, n, 2, H, tiles]` (then `tails` K, V `[B, H, s, D]`) -> BF16 K, V `[B, H, n * 16 + s,
        D]`, bit-exact."""
        b3, b4 = self._flat_bases()
        tail_k, tail_v = tails or (None, None)
        return ops.expand_kv(table, slot_pool, raw_pool, b3, b4, tail_k, tail_v, self.format_version)

    def _decode_blocks(self, b0: int, b1: int,
                       tails: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.decode_table(self._table[:, b0:b1], self.pool.slot_pool, self.pool.raw_pool, tails)

    def _dense_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full K, V `[B, H, S, D]` (finalized blocks decoded, then the tail)."""
        return self._decode_blocks(0, self.n_blocks, (self._tail_k, self._tail_v))

    def compressed(self) -> CompressedKV:
        """A `CompressedKV` snapshot of the current state."""
        # a view, not a copy: appends write rows past it and reorder replaces the table; crop invalidates it
        return CompressedKV(self, self._table[:, :self.n_blocks], self._tail_k, self._tail_v)

    # --- CacheLayerMixin ------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        check_kv_dtype(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch or key_states.shape[1:2] != self._tail_k.shape[1:2]:
            raise ValueError(
                f"layer {self.layer_idx} holds {self.batch} rows of {self.num_kv_heads} KV heads; got key states of "
                f"shape {tuple(key_states.shape)} (reset() the cache before reusing it for another batch)")
        q_len = key_states.shape[-2]
        old_blocks = self.n_blocks
        tail_k = torch.cat([self._tail_k, key_states], -2)
        tail_v = torch.cat([self._tail_v, value_states], -2)
        nb = tail_k.shape[-2] // BLOCK_TOKENS
        if nb:
            self._append_blocks(tail_k[:, :, :nb * BLOCK_TOKENS], tail_v[:, :, :nb * BLOCK_TOKENS])
            self._tail_k = tail_k[:, :, nb * BLOCK_TOKENS:].clone()
            self._tail_v = tail_v[:, :, nb * BLOCK_TOKENS:].clone()
        else:  # the concatenation is already a fresh tensor: no copy
            self._tail_k, self._tail_v = tail_k, tail_v
        if self.lazy and q_len == 1:
            view = self.compressed()
            return GAACLazyKV(view, 0), GAACLazyKV(view, 1)
        # Expanded K/V: earlier blocks decoded; this update's blocks are still at hand (encoding is lossless).
        return self._decode_blocks(0, old_blocks, (tail_k, tail_v))

    def get_seq_length(self) -> int:
        if not self.is_initialized:
            return 0
        return self.n_blocks * BLOCK_TOKENS + self.tail_length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens; finalized blocks cut into come back to the tail as BF16."""
        n = tokens_to_crop(tokens_to_remove, self.is_initialized)
        if not n:
            return
        new_len = max(self.get_seq_length() - n, 0)
        fin = self.n_blocks * BLOCK_TOKENS
        if new_len >= fin:
            self._tail_k = self._tail_k[:, :, :new_len - fin].clone()
            self._tail_v = self._tail_v[:, :, :new_len - fin].clone()
            return
        keep, rest = divmod(new_len, BLOCK_TOKENS)
        if rest:
            k, v = self._decode_blocks(keep, keep + 1)
            self._tail_k = k[:, :, :rest].clone()
            self._tail_v = v[:, :, :rest].clone()
        else:
            self._tail_k = self._tail_k[:, :, :0].clone()
            self._tail_v = self._tail_v[:, :, :0].clone()
        self.n_blocks = keep
        self.pool.dirty = True

    def _select_rows(self, index: torch.Tensor) -> None:
        """Keep rows `index` (beam search, `batch_repeat_interleave`, `batch_select_indices`): the rows' table
        entries and tails are selected; finalized tiles are shared, not re-encoded."""
        index = index.to(self.device)
        self._table = self._table[:, :self.n_blocks].index_select(0, index)
        self._tail_k = self._tail_k.index_select(0, index)
        self._tail_v = self._tail_v.index_select(0, index)
        self.batch = self._table.shape[0]
        self.pool.dirty = True

    def reset(self) -> None:
        """Forget every token; the pools keep their capacity for reuse."""
        self._clear()

    # --- devices --------------------------------------------------------------------------------------------------
    def _move(self, device) -> None:
        self.pool.to(device)
        for name in ("_table", "_tail_k", "_tail_v", "_base3", "_base4"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t.to(device, non_blocking=True))

    def offload(self) -> None:
        if self.is_initialized:
            self._move("cpu")

    def prefetch(self) -> None:
        if self.is_initialized and self.device is not None and self._table.device != torch.device(self.device):
            self._move(self.device)

    def to(self, device) -> "GAACLayer":
        self.device = torch.device(device)
        self._move(self.device)
        return self

    # --- accounting -----------------------------------------------------------------------------------------------
    def _allocated_bytes(self) -> dict:
        out = self.pool.allocated_bytes()
        out["tail"] = 0 if self._tail_k is None else 2 * self._tail_k.numel() * self._tail_k.element_size()
        out["block_table"] = 0 if self._table is None else self._table.numel() * BLOCK_TABLE_ENTRY_BYTES
        out["total"] = sum(out.values())
        return out

    def stats(self) -> dict:
        """Resident bytes per storage class, BF16-equivalent bytes, ratio and group-mode counts of this layer."""
        tokens = self.get_seq_length()
        out = {"layer": self.layer_idx, "rows": self.batch, "tokens": tokens, "blocks": self.n_blocks,
               "tail_tokens": self.tail_length, "format_version": self.format_version}
        if not self.is_initialized:
            out.update(slots=0, raw_tiles=0, bytes={"slots": 0, "raw": 0, "tail": 0, "block_table": 0, "total": 0},
                       bf16_bytes=0, ratio=float("nan"), modes={m: 0 for m in MODE_NAMES},
                       mode_shares={m: float("nan") for m in MODE_NAMES}, allocated_bytes=self._allocated_bytes())
            return out
        live = self._table[:, :self.n_blocks].reshape(-1).long()
        slots = torch.unique(live[live >= 0])
        raws = torch.unique(-1 - live[live < 0])
        pool = self.pool
        modes = pool.slot_modes[slots].sum(0, dtype=torch.int64) + pool.raw_modes[raws].sum(0, dtype=torch.int64)
        n_groups = int(modes.sum())
        bytes_ = {
            "slots": slots.numel() * self.layout.slot_bytes,
            "raw": raws.numel() * self.layout.raw_bytes,
            "tail": 2 * self._tail_k.numel() * self._tail_k.element_size(),
            "block_table": self.batch * self.n_blocks * 2 * self.num_kv_heads * self.tiles * BLOCK_TABLE_ENTRY_BYTES,
        }
        bytes_["total"] = sum(bytes_.values())
        bf16 = self.batch * tokens * 2 * self.num_kv_heads * self.head_dim * 2
        counts = modes.tolist()
        out.update(
            slots=slots.numel(), raw_tiles=raws.numel(), bytes=bytes_, bf16_bytes=bf16,
            ratio=bf16 / bytes_["total"] if bytes_["total"] else float("nan"),
            modes={m: int(c) for m, c in zip(MODE_NAMES, counts)},
            mode_shares={m: (int(c) / n_groups if n_groups else float("nan")) for m, c in zip(MODE_NAMES, counts)},
            allocated_bytes=self._allocated_bytes(),
        )
        return out


class GAACCache(Cache):
    """Lossless GAAC-compressed KV cache for `model.generate(..., cache=GAACCache(model.config, calibration))`.

    Full-attention layers are GAAC-compressed (`GAACLayer`); the other layers are the stock transformers layers
    `DynamicCache(config=config)` would build. `lazy` chooses what `update` returns for single-token steps:
    `"auto"` (default) returns `GAACLazyKV` when the model runs the `"gaac"` attention, else expanded K/V;
    `True`/`False` force it.

    The calibration is checked against `config` (`CalibrationMismatchError`) before anything runs; BF16 KV only
    (`TypeError` otherwise). Under sdpa/eager every step decodes all finalized tiles of every GAAC layer (the
    expanded K/V are transient, so memory is saved but decode costs O(context) codec work per step); the `"gaac"`
    attention decodes them chunk by chunk instead. Pass the cache empty to `generate` (like DynamicCache, it is not
    expanded for `num_beams`/`num_return_sequences`); `reset()` it before reusing it for an unrelated prompt.

    `format_version` of the stored slots (docs/format.md): None (default) picks version 2 where the CUDA kernel
    reads it (Hopper, head_dim 64/128) and the calibration is a version-2 one (even windows), else version 1; 1 or
    2 force it (2 needs a version-2 calibration, `gaac-hf calibrate --format-version 2`). Both are
    lossless; version 2 is what the CUDA kernel reads fastest, version 1 what the Triton kernels and the CPU
    decoder read (elsewhere version 2 is decoded by the torch reference: correct, slower). `stats()` says which.
    """

    def __init__(self, *args, config=None, calibration: GAACCalibration | str | None = None,
                 lazy: bool | str = "auto", offloading: bool = False, offload_only_non_sliding: bool = False,
                 tp_rank: int | None = None, tp_size: int | None = None, format_version: int | None = None):
        config, calibration = config_and_calibration("GAACCache", args, config, calibration)
        calibration.check_model(config)
        check_storage_format(calibration, format_version, "GAACCache")
        if lazy not in ("auto", True, False):
            raise ValueError(f"lazy must be 'auto', True or False, not {lazy!r}")
        self.config = config
        self.calibration = calibration
        self.lazy = lazy
        # Under tensor parallelism each rank's layers see a contiguous slice of the KV heads; the rank comes from
        # tp_rank/tp_size or, when they are not given, from torch.distributed (the whole world is one TP group).
        group_heads = kv_geometry(config).group_heads
        layers = full_attention_layers(
            config, lambda i: GAACLayer(calibration, i, tp_rank, tp_size, format_version, group_heads))
        super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)

    @classmethod
    def from_pretrained(cls, pretrained_calibration, config, *, lazy: bool | str = "auto", tp_rank: int | None = None,
                        tp_size: int | None = None, format_version: int | None = None,
                        **hub_kwargs) -> "GAACCache":
        """Load a `GAACCalibration` (Hub repo id or local folder) and build the cache for a model `config`."""
        calibration = GAACCalibration.from_pretrained(pretrained_calibration, **hub_kwargs)
        return cls(config=config, calibration=calibration, lazy=lazy, tp_rank=tp_rank, tp_size=tp_size,
                   format_version=format_version)

    @property
    def gaac_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, GAACLayer)]

    def _lazy_wanted(self) -> bool:
        if self.lazy != "auto":
            return bool(self.lazy)
        impl = getattr(text_config(self.config), "_attn_implementation", None)
        if impl is None:
            impl = getattr(self.config, "_attn_implementation", None)
        return impl == GAAC_ATTENTION_NAME

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, GAACLayer):
            # the model's attention implementation, read once per forward pass (at its first GAAC layer: a layer
            # index not above the last one read starts a new pass) rather than per layer, as the config lookups cost
            # more than the rest of an eager update
            at = getattr(self, "_lazy_layer", None)
            if at is None or layer_idx <= at:
                self._lazy_now, self._lazy_layer = self._lazy_wanted(), layer_idx
            layer.lazy = self._lazy_now
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def to(self, device) -> "GAACCache":
        """Move every layer's storage (GAAC pools, tables and tails; stock layers' keys/values) to `device`."""
        for layer in self.layers:
            if isinstance(layer, GAACLayer):
                layer.to(device)
            elif getattr(layer, "keys", None) is not None and isinstance(layer.keys, torch.Tensor):
                layer.keys, layer.values = layer.keys.to(device), layer.values.to(device)
                layer.device = torch.device(device)
        return self

    def stats(self) -> dict:
        """Resident bytes per storage class, totals vs BF16, ratio and mode shares, per GAAC layer and overall.

        `bytes` counts what the live tiles occupy; `allocated_bytes` what the pools, tails and tables hold as
        allocated (capacity kept for growth and reuse). `uncompressed_bytes` counts the stock (sliding-window)
        layers' BF16 keys/values, which GAAC leaves alone.
        """
        layers = {i: self.layers[i].stats() for i in self.gaac_layers}
        keys = ("slots", "raw", "tail", "block_table", "total")
        total = sum_layer_bytes(layers, "bytes", keys)
        alloc_keys = ("slot_pool", "raw_pool", "tail", "block_table", "total")
        allocated = sum_layer_bytes(layers, "allocated_bytes", alloc_keys)
        bf16 = sum(s["bf16_bytes"] for s in layers.values())
        modes = {m: sum(s["modes"][m] for s in layers.values()) for m in MODE_NAMES}
        n_groups = sum(modes.values())
        other = stock_layer_bytes(self.layers, layers)
        return {
            "bytes": total,
            "allocated_bytes": allocated,
            "bf16_bytes": bf16,
            "ratio": bf16 / total["total"] if total["total"] else float("nan"),
            "saving": 1 - total["total"] / bf16 if bf16 else float("nan"),
            "modes": modes,
            "mode_shares": {m: (c / n_groups if n_groups else float("nan")) for m, c in modes.items()},
            "slots": sum(s["slots"] for s in layers.values()),
            "raw_tiles": sum(s["raw_tiles"] for s in layers.values()),
            "uncompressed_bytes": other,
            "layers": layers,
        }
