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
from torch.utils._pytree import tree_map
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_common.cache_layers import (DenseKVMixin, RowSelectionMixin, full_attention_layers, stock_layer_bytes,
                                   sum_layer_bytes, tokens_to_crop)

from . import ops
from .calibration import CalibrationMismatchError, GAACCalibration
from .format import BLOCK_TABLE_ENTRY_BYTES, BLOCK_TOKENS, MODE_NAMES, TileLayout, tile_split
from .model_layers import kv_geometry, text_config
from .tile_pool import TilePool, grow

GAAC_ATTENTION_NAME = "gaac"
# Most tiles given to one `encode_tiles` call (bounds the encoder's temporary memory on long prompts).
ENCODE_MAX_TILES = 8192
# Blocks the CPU decode attention decodes per codec call (256 blocks = 4K tokens; its chunks are smaller).
DECODE_WINDOW_BLOCKS = 256


def check_kv_dtype(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    for name, t in (("key", key_states), ("value", value_states)):
        if t.dtype != torch.bfloat16:
            raise TypeError(
                f"GAACCache stores BF16 KV losslessly; the model produced {name} states of dtype {t.dtype}. "
                "Load the model with dtype=torch.bfloat16, or use DynamicCache for other dtypes."
            )


def resolve_calibration(calibration, what: str, **hub_kwargs) -> GAACCalibration:
    """A `GAACCalibration`, or one loaded from a path / Hub id; a clear `TypeError` for anything else."""
    if isinstance(calibration, str) or hasattr(calibration, "__fspath__"):
        calibration = GAACCalibration.from_pretrained(str(calibration), **hub_kwargs)
    if isinstance(calibration, GAACCalibration):
        return calibration
    raise TypeError(f"{what} takes as calibration a GAACCalibration or the path / Hub id of one, not "
                    f"{type(calibration).__name__}")


STORAGE_VERSIONS = (1, 2)


def check_storage_format(calibration: GAACCalibration, format_version: int | None, what: str) -> None:
    """Check that a cache that stores `format_version` (None: chosen per device) can code with `calibration`.
    Version 2 codes against windows that start at even exponents, which only a version-2 calibration has (version-1
    windows moved down to even starts cost much of the saving: 27.9% -> 22.5% resident on SmolLM2's held-out KV,
    benchmarks/results/tied_windows_s14_converted.json, against 27.6% for windows calibrated even). Version 1 reads
    any windows."""
    if format_version not in (None, *STORAGE_VERSIONS):
        raise ValueError(f"{what} stores GAAC format version 1 or 2 (None: chosen per device), not {format_version!r}")
    if format_version == 2 and calibration.config.format_version != 2:
        raise ValueError(
            f"{what}(format_version=2) needs a format-version-2 calibration (windows that start at even exponents); "
            f"this one is version {calibration.config.format_version}: calibrate with `gaac-hf calibrate "
            "--format-version 2` (or `calibrate(..., format_version=2)`); `calibration.convert(2)` moves its windows "
            "down instead, at a cost in ratio")


def choose_format(requested: int | None, calibration: GAACCalibration, head_dim: int, group_heads: int,
                  device) -> int:
    """The format version a cache layer stores on `device`: `requested`, or (None) version 2 where a fused kernel
    reads it (the CUDA kernel on Hopper, head_dim 64/128) and the calibration's windows are even (a version-2
    calibration: `gaac-hf calibrate --format-version 2`), else version 1."""
    if requested is not None:
        return requested
    even = calibration.config.format_version == 2
    return 2 if even and ops.fused_reads(2, head_dim, group_heads, device) else 1


def _is_model_config(x) -> bool:
    from transformers import PretrainedConfig

    return isinstance(x, PretrainedConfig)


def config_and_calibration(what: str, args: tuple, config, calibration):
    """Sort `GAACCache(config, calibration)`, `GAACCache(calibration, config=...)`, keywords, by type."""
    for arg in args:
        if _is_model_config(arg) and config is None:
            config = arg
        elif isinstance(arg, (GAACCalibration, str)) or hasattr(arg, "__fspath__"):
            if calibration is not None:
                raise TypeError(f"{what} got two calibrations")
            calibration = arg
        else:
            raise TypeError(f"{what} takes a model config (transformers PretrainedConfig) and a GAACCalibration "
                            f"(or the path / Hub id of one); got a {type(arg).__name__} positional argument")
    if config is None or not _is_model_config(config):
        raise TypeError(f"{what} needs the model config (transformers PretrainedConfig) as config, got "
                        f"{type(config).__name__}")
    if calibration is None:
        raise TypeError(f"{what} needs a calibration: {what}(config, calibration)")
    return config, resolve_calibration(calibration, what)


class CompressedKV:
    """Read-only snapshot of one `GAACLayer` at one step: finalized blocks (block table) plus the BF16 tail.

    Valid until the next `crop`/`reorder_cache`/`batch_select_indices`/`reset` of its layer (those may recycle
    tiles the snapshot still points to); plain appends never invalidate it.
    """

    def __init__(self, layer: "GAACLayer", table: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor):
        self.layer = layer
        self.table = table  # int32 [B, n_blocks, 2, H, tiles]
        self.slot_pool = layer.pool.slot_pool
        self.raw_pool = layer.pool.raw_pool
        self.tail_k, self.tail_v = tail_k, tail_v
        self.n_blocks = table.shape[1]
        self.batch, self.heads, _, self.head_dim = tail_k.shape
        self.length = self.n_blocks * BLOCK_TOKENS + tail_k.shape[-2]
        self._dense = None
        self._window = None  # (first block, K, V) of the decoded blocks the last chunks came from

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.heads, self.length, self.head_dim)

    def blocks(self, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded finalized blocks `[b0, b1)`: K, V each `[B, H, (b1 - b0) * 16, D]`."""
        return self.layer._decode_table(self.table[:, b0:b1], self.slot_pool, self.raw_pool)

    def _windowed(self, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks `[b0, b1)`, served from one decode of up to `DECODE_WINDOW_BLOCKS` blocks (fewer codec calls
        than one per attention chunk; the transient BF16 stays bounded)."""
        w = self._window
        if w is None or not (w[0] <= b0 and b1 <= w[0] + w[1].shape[2] // BLOCK_TOKENS):
            top = min(self.n_blocks, max(b1, b0 + DECODE_WINDOW_BLOCKS))
            k, v = self.blocks(b0, top)
            w = self._window = (b0, k, v)
        at = (b0 - w[0]) * BLOCK_TOKENS
        n = (b1 - b0) * BLOCK_TOKENS
        return w[1][:, :, at:at + n], w[2][:, :, at:at + n]

    def chunk(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens `[start, end)` (start a multiple of 16) as contiguous BF16 K, V `[B, H, end - start, D]`."""
        if start % BLOCK_TOKENS:
            raise ValueError(f"chunks start on a block boundary, not at token {start}")
        end = min(end, self.length)
        fin = self.n_blocks * BLOCK_TOKENS
        ks, vs = [], []
        if start < fin:
            stop = min(end, fin)
            k, v = self._windowed(start // BLOCK_TOKENS, (stop + BLOCK_TOKENS - 1) // BLOCK_TOKENS)
            ks.append(k[:, :, :stop - start])
            vs.append(v[:, :, :stop - start])
        if end > fin:
            lo = max(start - fin, 0)
            ks.append(self.tail_k[:, :, lo:end - fin])
            vs.append(self.tail_v[:, :, lo:end - fin])
        k = ks[0] if len(ks) == 1 else torch.cat(ks, -2)
        v = vs[0] if len(vs) == 1 else torch.cat(vs, -2)
        return k.contiguous(), v.contiguous()

    def record(self) -> ops.DecodeRecord:
        """What the decode attention reads (pools, table, tail, windows `[2, H, D]`, device lengths, plan)."""
        layer = self.layer
        base3, base4 = layer.windows()
        kv_len = ops.device_lengths(self.batch, self.length, self.table.device)
        plan = ops.plan(self.batch, self.heads, self.n_blocks, self.head_dim, self.table.device)
        return ops.DecodeRecord(self.slot_pool, self.raw_pool, self.table, self.tail_k, self.tail_v, base3, base4,
                                kv_len, plan, layer.format_version)

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The full K, V `[B, H, length, D]`, BF16 (decoded once, then cached)."""
        if self._dense is None:
            self._dense = self.chunk(0, self.length)
        return self._dense


_METADATA_FUNCS = {
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.is_cuda.__get__,
    torch.Tensor.layout.__get__, torch.Tensor.size, torch.Tensor.dim, torch.Tensor.ndimension,
    torch.Tensor.numel, torch.Tensor.__len__,
}


class GAACLazyKV(torch.Tensor):
    """A storage-less `[B, H_kv, S, D]` BF16 tensor standing for one side (K or V) of a `CompressedKV`.

    The `"gaac"` attention reads `.compressed` in place. Shape/dtype/device queries are answered from metadata;
    every other torch op materializes the full tensor (lossless decode, cached) and runs on it.
    """

    @staticmethod
    def __new__(cls, compressed: CompressedKV, which: int):
        t = torch.Tensor._make_wrapper_subclass(
            cls, compressed.shape, dtype=compressed.tail_k.dtype, device=compressed.tail_k.device,
            requires_grad=False)
        t.compressed = compressed
        t.which = which
        return t

    def materialize(self) -> torch.Tensor:
        return self.compressed.materialize()[self.which]

    def __repr__(self, *, tensor_contents=None):
        c = self.compressed
        return f"GAACLazyKV(shape={tuple(c.shape)}, {'KV'[self.which]}, blocks={c.n_blocks})"

    @staticmethod
    def _unwrap(x):
        return x.materialize() if isinstance(x, GAACLazyKV) else x

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA_FUNCS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map(cls._unwrap, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = tree_map(cls._unwrap, (args, kwargs or {}))
        return func(*args, **kwargs)


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

    def _decode_table(self, table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor,
                      tails: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Table entries `[B, n, 2, H, tiles]` (then `tails` K, V `[B, H, s, D]`) -> BF16 K, V `[B, H, n * 16 + s,
        D]`, bit-exact."""
        b3, b4 = self._flat_bases()
        tail_k, tail_v = tails or (None, None)
        return ops.expand_kv(table, slot_pool, raw_pool, b3, b4, tail_k, tail_v, self.format_version)

    def _decode_blocks(self, b0: int, b1: int,
                       tails: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._decode_table(self._table[:, b0:b1], self.pool.slot_pool, self.pool.raw_pool, tails)

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
        if not tokens_to_crop(tokens_to_remove, self.is_initialized):
            return
        new_len = max(self.get_seq_length() + tokens_to_remove, 0)
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
