"""`GAACStaticCache`: a preallocated GAAC cache whose decode step is one capturable graph (torch.compile, CUDA graphs).

Like transformers' `StaticCache(config, max_cache_len)`, every buffer is allocated once and updated in place:

* the slot pool, uint8 `[n_slots + 1, slot_bytes]` per layer, sized for every tile of `max_batch_size x
  max_cache_len` (a tile takes at most one slot), and the raw pool, BF16 `[n_raw + 1, 16, C]` per layer, sized from
  the calibration's raw-tile share (measured when it was made) plus headroom; their last rows are scratch;
* the block table, int32 `[B, ceil(max_cache_len / 16), 2, H, tiles]`;
* the BF16 tail, `[B, H, 16, D]`, a fixed buffer;
* per-row lengths `kv_len` int32 `[B]` and the pool counters (slots, raw tiles taken), on the device.

Each kind is one cache-wide tensor stacked over the layers (`[L, ...]`, `_LayerStack`); a layer reads views of it,
made inside the traced step, so the compiled step carries 9 cache tensors whatever the layer count (fewer inputs
for Dynamo's guards and the CUDA-graph tree's per-replay checks). The buffers have static addresses and sizes.

A decode step (`update` with one token per row) is one custom op, `gaac::append_token`: it writes the token into the
tail and, for rows whose block the token completes, encodes the block and takes slots / raw tiles by advancing the
device counters, with no host synchronization and no Python branch on data (on CUDA a Triton kernel that runs every
step and returns early for rows with nothing to finalize). The attention then reads the layer through the
`gaac::decode_attention` custom op (gaac_hf/attention_ops.py), handed over as the `gaac_record` of the tail tensor `update`
returns. Prefill and any other update of several tokens per row run eagerly (inside a compiled forward: a graph
break, as for the verification steps of assisted decoding). `crop(-n)` (assisted decoding, prompt lookup) runs
eagerly and in place: a block it cuts into is decoded back into the tail, the blocks past it leave the table, and
the pools are compacted so their counters go back to the kept tiles.

Raw pool overflow never passes silently: between steps (`get_mask_sizes`, which `generate` calls eagerly before
every step, and `check()`, `stats()`) the cache reads the counters, grows the raw pools (all layers' at once: one
new stacked tensor, the step recompiles for it) while there is headroom for the steps until the next check, and
raises `GAACPoolOverflowError` if tiles were ever dropped (a hand-written loop that never calls `check()`). The same
check raises `GAACCacheFullError` past `max_cache_len`.

`PlainStaticCache` is the bit-exact twin: the same static layout over plain BF16 KV, updated by an opaque op of the
same shape (`gaac::plain_append_token`: the same model-side inputs, in place, so inductor compiles the code around
both updates alike) and read by the same attention code (`gaac::plain_decode_attention`), for lossless checks and
benchmarks.
"""

from __future__ import annotations

import math

import torch

from . import ops
from .cache_inputs import ENCODE_MAX_TILES, check_storage_format, choose_format, resolve_calibration
from .calibration import GAACCalibration
from .format import BLOCK_TABLE_ENTRY_BYTES, BLOCK_TOKENS, MODE_NAMES, TileLayout
from .model_layers import kv_geometry
from .plain_static_cache import PlainStaticCache
from .static_base import (GAACCacheFullError, GAACPoolOverflowError, LayerStack, StaticCacheBase, StaticLayerBase,
                          static_buffer)

# (PlainStaticCache and the errors are importable from here too, as before the static caches' shared part moved)
__all__ = ["GAACStaticCache", "GAACStaticLayer", "PlainStaticCache", "GAACCacheFullError", "GAACPoolOverflowError",
           "calibrated_raw_share"]


def calibrated_raw_share(calibration: GAACCalibration) -> float:
    """The largest raw-tile share the calibration measured (calibration corpus, held-out text); 0.05 if none."""
    shares = [m.get("raw_tile_share") for m in calibration.config.measured.values() if isinstance(m, dict)]
    shares = [float(s) for s in shares if s is not None]
    return max(shares) if shares else 0.05


class _GAACStack(LayerStack):
    """The stacked buffers of a `GAACStaticCache` (see the module docstring); the raw pools of all layers grow
    together (one reallocation of the stacked pool)."""

    def __init__(self, calibration: GAACCalibration, max_cache_len: int, max_batch_size: int | None = None,
                 raw_tiles: int | None = None, format_version: int | None = None, group_heads: int = 1):
        cfg = calibration.config
        super().__init__(max_cache_len, max_batch_size, cfg.num_kv_heads, cfg.head_dim)
        self.calibration = calibration
        self.requested_format, self.group_heads = format_version, group_heads
        self.format_version = None  # of the stored slots: chosen at allocation, per device (`choose_format`)
        self.layout = TileLayout(self.channels, cfg.escape_capacity)
        self.raw_share = calibrated_raw_share(calibration)
        self.raw_tiles = raw_tiles
        self.headroom = 0

    @property
    def tile_positions(self) -> int:
        """Tiles of one block of one row (K and V, every kv-head, every tile of the head)."""
        return 2 * self.num_kv_heads * self.tiles

    def _allocate(self, layers: int, b: int, dev: torch.device) -> None:
        fmt = choose_format(self.requested_format, self.calibration, self.head_dim, self.group_heads, dev)
        if fmt == 2 and ops.backend_of(dev) != "torch" and not ops.fused_reads(2, self.head_dim, self.group_heads, dev):
            # (the torch reference reads every format, eagerly; a GPU's captured step needs a fused kernel)
            raise ValueError(f"GAACStaticCache: no fused kernel reads format version 2 on {dev} at head_dim "
                             f"{self.head_dim} with {self.group_heads} query heads per KV head (the CUDA kernel "
                             f"on Hopper reads it at head_dim 64/128, up to 8): use format_version=1")
        self.format_version = fmt
        self.headroom = b * self.tile_positions
        n_all = b * self.max_blocks * self.tile_positions
        n_raw = self.raw_tiles if self.raw_tiles is not None else \
            min(n_all, math.ceil(1.5 * self.raw_share * n_all) + 2 * self.headroom)
        h, d, c = self.num_kv_heads, self.head_dim, self.channels
        i32 = dict(dtype=torch.int32, device=dev)
        self.kv_len = static_buffer(torch.zeros(layers, b, **i32))
        self.counts = static_buffer(torch.zeros(layers, 2, **i32))  # per layer: slots, raw tiles taken
        self.tails = static_buffer(torch.zeros(layers, 2, b, h, BLOCK_TOKENS, d, dtype=torch.bfloat16, device=dev))
        self.bases = static_buffer(torch.stack([torch.stack(self.calibration.windows(i)) for i in self.layer_ids])
                             .to(dev).contiguous())  # [L, base3|base4, K|V, H, D]
        self.table = static_buffer(torch.full((layers, b, self.max_blocks, 2, h, self.tiles), -1 - n_raw, **i32))
        self.slot_pool = static_buffer(torch.zeros(layers, n_all + 1, self.layout.slot_bytes, dtype=torch.uint8,
                                             device=dev))
        self.slot_modes = static_buffer(torch.zeros(layers, n_all + 1, 3, **i32))
        self.raw_pool = static_buffer(torch.zeros(layers, n_raw + 1, BLOCK_TOKENS, c, dtype=torch.bfloat16, device=dev))
        self.raw_modes = static_buffer(torch.zeros(layers, n_raw + 1, 3, **i32))

    @property
    def n_slots(self) -> int:
        return self.slot_pool.shape[1] - 1

    @property
    def n_raw(self) -> int:
        return self.raw_pool.shape[1] - 1

    def record(self, j: int) -> ops.DecodeRecord:
        return ops.DecodeRecord(slot_pool=self.slot_pool[j], raw_pool=self.raw_pool[j], table=self.table[j],
                                tail_k=self.tails[j, 0], tail_v=self.tails[j, 1], base3=self.bases[j, 0],
                                base4=self.bases[j, 1], kv_len=self.kv_len[j], plan=self.plan,
                                format_version=self.format_version)

    def grow_raw(self, needed: int) -> None:
        """Make room for `needed` raw tiles in every layer (eager; the stacked pool moves, so compiled graphs are
        re-recorded)."""
        if needed <= self.n_raw:
            return
        old = self.n_raw
        cap = max(needed, int(1.5 * old))
        layers = len(self.layer_ids)
        pool = torch.zeros(layers, cap + 1, BLOCK_TOKENS, self.channels, dtype=torch.bfloat16, device=self.device)
        modes = torch.zeros(layers, cap + 1, 3, dtype=torch.int32, device=self.device)
        used = min(int(self.counts[:, 1].max()), old)
        pool[:, :used] = self.raw_pool[:, :used]
        modes[:, :used] = self.raw_modes[:, :used]
        # table entries pointing at the old scratch row (blocks not yet finalized) move to the new one
        self.table.masked_fill_(self.table == -1 - old, -1 - cap)
        self.raw_pool, self.raw_modes = static_buffer(pool), static_buffer(modes)

    def check_counts(self, counts: dict[int, tuple[int, int]]) -> None:
        """`counts[j] = (slots, raw tiles taken)` of stack layers `j`: raise if a layer dropped tiles; grow the raw
        pools if one of them has less than twice `headroom` free."""
        for j, (slots, raws) in counts.items():
            if slots > self.n_slots or raws > self.n_raw:
                raise GAACPoolOverflowError(
                    f"layer {self.layer_ids[j]} dropped "
                    f"{max(slots - self.n_slots, 0) + max(raws - self.n_raw, 0)} tiles: its raw pool ({self.n_raw} "
                    "tiles) filled up between two checks, so the cache contents and every output since are "
                    "invalid. Call cache.check() between decode steps (generate does it), or build the cache with "
                    "a larger raw_tiles")
        worst = max((raws for _, raws in counts.values()), default=0)
        if worst + 2 * self.headroom > self.n_raw:
            self.grow_raw(worst + 4 * self.headroom)


def _fill_holes(live: torch.Tensor, pools: tuple[torch.Tensor, ...]) -> tuple[int, torch.Tensor]:
    """Compact a pool whose tiles `live` (distinct indices) are the ones kept: those at or above n = len(live) move,
    in every tensor of `pools` (indexed by tile along dim 0), into the indices below n that no kept tile holds, so the
    kept tiles become tiles 0 .. n - 1. Returns n and `live` as it reads after the move."""
    n = live.numel()
    if n == 0:
        return 0, live
    present = torch.zeros(int(live.max()) + 1, dtype=torch.bool, device=live.device)
    present[live] = True
    holes = (~present[:n]).nonzero().squeeze(1)
    movers = live[live >= n].sort().values  # as many as holes: n kept tiles, fewer than n of them below n
    for pool in pools:
        pool[holes] = pool[movers]
    where = torch.arange(present.numel(), device=live.device)
    where[movers] = holes.to(where.dtype)
    return n, where[live].to(live.dtype)


class GAACStaticLayer(StaticLayerBase):
    """One full-attention layer of a `GAACStaticCache` (see the module docstring): its buffers are views of the
    cache's stacked ones (`layer.record`, `layer.counts`, ...)."""

    def __init__(self, calibration: GAACCalibration, layer_idx: int, max_cache_len: int,
                 max_batch_size: int | None = None, raw_tiles: int | None = None, stack: _GAACStack | None = None):
        stack = stack or _GAACStack(calibration, max_cache_len, max_batch_size, raw_tiles)
        super().__init__(stack, layer_idx)
        self.layout = stack.layout
        self.raw_share = stack.raw_share
        self.raw_tiles = raw_tiles

    @property
    def tile_positions(self) -> int:
        return self.stack.tile_positions

    @property
    def headroom(self) -> int:
        """Raw tiles one block completion of every row may take (what can happen between two checks)."""
        return self.batch * self.tile_positions

    @property
    def record(self) -> ops.DecodeRecord:
        """What the attention reads of this layer (views of the stack)."""
        return self.stack.record(self.j) if self.is_initialized else None

    @property
    def counts(self) -> torch.Tensor:
        return self.stack.counts[self.j]

    @property
    def slot_modes(self) -> torch.Tensor:
        return self.stack.slot_modes[self.j]

    @property
    def raw_modes(self) -> torch.Tensor:
        return self.stack.raw_modes[self.j]

    def _row_tensors(self):
        r = self.record
        return (r.table, r.tail_k, r.tail_v, self.kv_len)

    def _reset_storage(self) -> None:
        self.counts.zero_()
        self.stack.table[self.j].fill_(-1 - self.n_raw)

    def _crop_storage(self, length: int, new_length: int) -> None:
        """Finalized blocks the crop cuts into come back: a block cut in the middle is decoded (losslessly) into the
        tail, the blocks past it leave the table, and each pool is compacted so that its kept tiles are its lowest
        (`_fill_holes`: kept tiles above the kept count move into the places the cut ones leave below it, their table
        entries with them) and its counter goes back to the kept count: nothing leaks, whatever the rows (a prefill
        takes tiles row by row, so with several rows the cut tiles lie between kept ones)."""
        finalized = length // BLOCK_TOKENS
        keep, rest = divmod(new_length, BLOCK_TOKENS)
        if keep >= finalized:
            return  # only tail tokens go
        r = self.record
        if rest:
            k, v = self._decode(keep, keep + 1)
            r.tail_k[:, :, :rest].copy_(k[:, :, :rest])
            r.tail_v[:, :, :rest].copy_(v[:, :, :rest])
        scratch = -1 - self.n_raw
        r.table[:, keep:finalized].fill_(scratch)
        kept = r.table[:, :keep]
        is_slot, is_raw = kept >= 0, (kept < 0) & (kept != scratch)
        n_slots, moved = _fill_holes(kept[is_slot], (r.slot_pool, self.slot_modes))
        kept[is_slot] = moved
        n_raw, moved = _fill_holes(-1 - kept[is_raw], (r.raw_pool, self.raw_modes))
        kept[is_raw] = -1 - moved
        self.counts.copy_(torch.tensor([n_slots, n_raw], dtype=self.counts.dtype))

    # --- pools ----------------------------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.stack.n_slots

    @property
    def n_raw(self) -> int:
        return self.stack.n_raw

    def grow_raw(self, needed: int) -> None:
        """Make room for `needed` raw tiles in all (every layer's raw pool grows with this one)."""
        self.stack.grow_raw(needed)

    def check_counts(self, slots: int, raws: int) -> None:
        """Raise if tiles were dropped; grow the raw pool if less than `headroom` is free."""
        self.stack.check_counts({self.j: (slots, raws)})

    # --- update ---------------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states, value_states)
        if key_states.shape[-2] == 1:
            s, j = self.stack, self.j
            record = s.record(j)
            ops.append_token(key_states, value_states, record, s.slot_modes[j], s.raw_modes[j], s.counts[j])
            return self._hand_over(record, record.tail_k, record.tail_v)
        return self._prefill(key_states, value_states)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> int:
        """Eager append of any number of tokens per row (prefill); returns the length before it."""
        if torch.compiler.is_compiling():
            raise RuntimeError("GAACStaticCache compiles the decode step only: run the prefill eagerly")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states, value_states)
        length = self.host_length()
        q = key_states.shape[-2]
        self._room(length, q)
        r = self.record
        t = length % BLOCK_TOKENS
        k = torch.cat([r.tail_k[:, :, :t], key_states], -2)
        v = torch.cat([r.tail_v[:, :, :t], value_states], -2)
        nb = k.shape[-2] // BLOCK_TOKENS
        rows = torch.arange(self.batch, device=self.device)
        p, c = self.tile_positions, self.channels
        step = max(1, ENCODE_MAX_TILES // (self.batch * p))
        for b0 in range(0, nb, step):
            b1 = min(nb, b0 + step)
            t0, t1 = b0 * BLOCK_TOKENS, b1 * BLOCK_TOKENS
            tiles = ops.tiles_of(k[:, :, t0:t1], v[:, :, t0:t1])
            slots, fits, modes = ops.encode(tiles, r.base3.reshape(p, c), r.base4.reshape(p, c),
                                            self.layout.escape_capacity, r.format_version)
            slots_used, raws_used = self.counts.tolist()
            self.check_counts(slots_used, raws_used)
            self.grow_raw(raws_used + int((~fits).sum()) + 2 * self.headroom)  # exactly what this chunk needs
            r = self.record  # the raw pool may have moved
            first = torch.full((self.batch,), length // BLOCK_TOKENS + b0, dtype=torch.long, device=self.device)
            ops.place_blocks(slots, fits, modes, tiles, rows, first, r.slot_pool, r.raw_pool, r.table,
                             self.slot_modes, self.raw_modes, self.counts)
        rest = k.shape[-2] - nb * BLOCK_TOKENS
        r.tail_k[:, :, :rest].copy_(k[:, :, nb * BLOCK_TOKENS:])
        r.tail_v[:, :, :rest].copy_(v[:, :, nb * BLOCK_TOKENS:])
        self.kv_len.add_(q)
        return length

    @torch.compiler.disable  # (several tokens per row: eager, a graph break inside a compiled forward)
    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor):
        t = self.host_length() % BLOCK_TOKENS
        old_k, old_v = self.record.tail_k[:, :, :t].clone(), self.record.tail_v[:, :, :t].clone()
        length = self.append(key_states, value_states)
        # K/V for the stock attention of a prefill, padded to max_cache_len (the mask hides the rest): the earlier
        # finalized blocks decoded, then the old tail and this update's tokens (at hand: encoding is lossless)
        keys, values = self.expand(length // BLOCK_TOKENS)
        end = length + key_states.shape[-2]
        keys[:, :, length - t:length], values[:, :, length - t:length] = old_k, old_v
        keys[:, :, length:end], values[:, :, length:end] = key_states, value_states
        return keys, values

    def expand(self, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, H, max_cache_len, D]` K, V with the first `n_blocks` finalized blocks decoded, zeros elsewhere."""
        b, h, d = self.batch, self.num_kv_heads, self.head_dim
        keys = torch.zeros(b, h, self.max_cache_len, d, dtype=torch.bfloat16, device=self.device)
        values = torch.zeros_like(keys)
        step = max(1, ENCODE_MAX_TILES // (b * self.tile_positions))
        for b0 in range(0, n_blocks, step):
            b1 = min(n_blocks, b0 + step)
            keys[:, :, b0 * BLOCK_TOKENS:b1 * BLOCK_TOKENS], values[:, :, b0 * BLOCK_TOKENS:b1 * BLOCK_TOKENS] = \
                self._decode(b0, b1)
        return keys, values

    def _decode(self, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V `[B, H, 16 (b1 - b0), D]` of finalized blocks b0 .. b1 - 1, decoded from their tiles."""
        r = self.record
        p, c = self.tile_positions, self.channels
        tiles = ops.expand_tiles(r.table[:, b0:b1].reshape(self.batch, b1 - b0, p), r.slot_pool, r.raw_pool,
                                 r.base3.reshape(p, c), r.base4.reshape(p, c), r.format_version)
        kv = ops.blocks_of(tiles, self.num_kv_heads)
        return kv[:, 0], kv[:, 1]

    # --- accounting -----------------------------------------------------------------------------------------------
    def stats(self) -> dict:
        out = {"layer": self.layer_idx, "rows": self.batch}
        if not self.is_initialized:
            out.update(tokens=0, blocks=0, slots=0, raw_tiles=0, bf16_bytes=0,
                       bytes={k: 0 for k in ("slots", "raw", "tail", "block_table", "total")},
                       allocated_bytes={k: 0 for k in ("slot_pool", "raw_pool", "tail", "block_table", "total")},
                       modes={m: 0 for m in MODE_NAMES})
            return out
        r = self.record
        length = self.host_length()
        blocks = length // BLOCK_TOKENS
        slots_used, raws_used = self.counts.tolist()
        live = r.table[:, :blocks].reshape(-1).long()
        slots = torch.unique(live[live >= 0])
        raws = torch.unique(-1 - live[live < 0])
        modes = self.slot_modes[slots].sum(0, dtype=torch.int64) + self.raw_modes[raws].sum(0, dtype=torch.int64)
        tail = 2 * self.batch * self.num_kv_heads * (length % BLOCK_TOKENS) * self.head_dim * 2
        bytes_ = {"slots": slots.numel() * self.layout.slot_bytes, "raw": raws.numel() * self.layout.raw_bytes,
                  "tail": tail, "block_table": self.batch * blocks * self.tile_positions * BLOCK_TABLE_ENTRY_BYTES}
        bytes_["total"] = sum(bytes_.values())
        alloc = {"slot_pool": r.slot_pool.numel() + self.slot_modes.numel() * 4,
                 "raw_pool": r.raw_pool.numel() * 2 + self.raw_modes.numel() * 4,
                 "tail": 2 * r.tail_k.numel() * 2, "block_table": r.table.numel() * BLOCK_TABLE_ENTRY_BYTES}
        alloc["total"] = sum(alloc.values())
        out.update(tokens=length, blocks=blocks, slots=slots.numel(), raw_tiles=raws.numel(),
                   slots_taken=slots_used, raw_taken=raws_used, raw_capacity=self.n_raw,
                   bf16_bytes=self.batch * length * 2 * self.num_kv_heads * self.head_dim * 2, bytes=bytes_,
                   allocated_bytes=alloc, modes={m: int(x) for m, x in zip(MODE_NAMES, modes.tolist())})
        return out


class GAACStaticCache(StaticCacheBase):
    """GAAC-compressed static KV cache for compiled decoding: `GAACStaticCache(config, max_cache_len, calibration)`.

    Mirrors `StaticCache(config, max_cache_len)`; `calibration` is a `GAACCalibration` or a path / Hub id of one,
    checked against `config` before anything is allocated. `max_batch_size` bounds the batch (buffers are sized from
    the first batch); `raw_tiles` overrides the raw pool size per layer (default: from the calibration's raw-tile
    share). Needs `attn_implementation="gaac"`. `model.generate(..., past_key_values=cache)` compiles the decode
    step by itself on CUDA (as for `StaticCache`; `compile_config` is honoured). `format_version`: of the stored
    slots, as for `GAACCache` (None: version 2 where the CUDA kernel reads it and the calibration's windows are
    even; forcing 2 where no fused kernel reads it on a GPU raises at the first update).
    """

    def __init__(self, config, max_cache_len: int, calibration: GAACCalibration | str | None = None, *,
                 max_batch_size: int | None = None, raw_tiles: int | None = None, offloading: bool = False,
                 format_version: int | None = None, **hub_kwargs):
        if calibration is None:
            raise TypeError("GAACStaticCache needs a calibration: GAACStaticCache(config, max_cache_len, calibration)")
        calibration = resolve_calibration(calibration, "GAACStaticCache", **hub_kwargs)
        calibration.check_model(config)
        check_storage_format(calibration, format_version, "GAACStaticCache")
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be a positive int, not {max_batch_size!r}")
        self.calibration = calibration
        self._max_batch_size = max_batch_size
        stack = _GAACStack(calibration, max_cache_len, max_batch_size, raw_tiles, format_version,
                           kv_geometry(config).group_heads)
        self._build(config, max_cache_len, stack,
                    lambda i: GAACStaticLayer(calibration, i, max_cache_len, max_batch_size, raw_tiles, stack),
                    offloading)

    @classmethod
    def from_pretrained(cls, pretrained_calibration, config, max_cache_len: int, *,
                        max_batch_size: int | None = None, raw_tiles: int | None = None,
                        format_version: int | None = None, **hub_kwargs) -> "GAACStaticCache":
        """Load a `GAACCalibration` (Hub repo id or local folder) and build the cache for a model `config`."""
        calibration = GAACCalibration.from_pretrained(pretrained_calibration, **hub_kwargs)
        return cls(config, max_cache_len, calibration, max_batch_size=max_batch_size, raw_tiles=raw_tiles,
                   format_version=format_version)

    def stats(self) -> dict:
        """Resident and allocated bytes per storage class, per GAAC layer and overall (checks the pools first)."""
        self.check()
        layers = {i: self.layers[i].stats() for i in self.own_layers}
        keys = ("slots", "raw", "tail", "block_table", "total")
        total = {k: sum(s["bytes"][k] for s in layers.values()) for k in keys}
        alloc_keys = ("slot_pool", "raw_pool", "tail", "block_table", "total")
        alloc = {k: sum(s["allocated_bytes"][k] for s in layers.values()) for k in alloc_keys}
        bf16 = sum(s["bf16_bytes"] for s in layers.values())
        return {"bytes": total, "allocated_bytes": alloc, "bf16_bytes": bf16,
                "ratio": bf16 / total["total"] if total["total"] else float("nan"),
                "saving": 1 - total["total"] / bf16 if bf16 else float("nan"),
                "slots": sum(s["slots"] for s in layers.values()),
                "raw_tiles": sum(s["raw_tiles"] for s in layers.values()),
                "format_version": self.layers[self.own_layers[0]].stack.format_version if self.own_layers else None,
                "layers": layers}

