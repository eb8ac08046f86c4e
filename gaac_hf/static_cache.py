"""`GAACStaticCache`: a preallocated GAAC cache whose decode step is one capturable graph (torch.compile, CUDA graphs).

Like transformers' `StaticCache(config, max_cache_len)`, every buffer is allocated once and updated in place:

* the slot pool, uint8 `[n_slots + 1, slot_bytes]`, sized for every tile of `max_batch_size x max_cache_len` (a
  tile takes at most one slot), and the raw pool, BF16 `[n_raw + 1, 16, C]`, sized from the calibration's raw-tile
  share (measured when it was made) plus headroom; their last rows are scratch;
* the block table, int32 `[B, ceil(max_cache_len / 16), 2, H, tiles]`;
* the BF16 tail, `[B, H, 16, D]`, a fixed buffer;
* per-row lengths `kv_len` int32 `[B]` and the pool counters (slots, raw tiles taken), on the device.

A decode step (`update` with one token per row) is one custom op, `gaac::append_token`: it writes the token into the
tail and, for rows whose block the token completes, encodes the block and takes slots / raw tiles by advancing the
device counters, with no host synchronization and no Python branch on data (on CUDA a Triton kernel that runs every
step and returns early for rows with nothing to finalize). The attention then reads the layer through the
`gaac::decode_attention` custom op (gaac_hf/ops.py), handed over as the `gaac_record` of the tail tensor `update`
returns. Prefill (several tokens per row) runs eagerly.

Raw pool overflow never passes silently: between steps (`get_mask_sizes`, which `generate` calls eagerly before
every step, and `check()`, `stats()`) the cache reads the counters, grows the raw pool while there is headroom for
the steps until the next check, and raises `GAACPoolOverflowError` if tiles were ever dropped (a hand-written loop
that never calls `check()`). The same check raises `GAACCacheFullError` past `max_cache_len`.

`PlainStaticCache` is the bit-exact twin: the same static layout over plain BF16 KV, read by the same attention
code (`gaac::plain_decode_attention`), for lossless checks and benchmarks.
"""

from __future__ import annotations

import math

import torch
from transformers import StaticCache
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_common.cache_layers import full_attention_layers

from . import ops
from .cache import GAAC_ATTENTION_NAME, _check_kv_dtype, resolve_calibration
from .calibration import CalibrationMismatchError, GAACCalibration
from .format import BLOCK_TABLE_ENTRY_BYTES, BLOCK_TOKENS, MODE_NAMES, TileLayout, tile_split
from .model_layers import text_config

# Tiles per encode call of the eager prefill (bounds the encoder's temporary memory).
ENCODE_MAX_TILES = 8192
# Decode steps between two pool checks by `generate` (each check reads the counters: one host synchronization).
CHECK_EVERY = 8


class GAACPoolOverflowError(RuntimeError):
    """A static GAAC layer dropped tiles: its raw pool ran out between two checks."""


class GAACCacheFullError(ValueError):
    """More tokens than `max_cache_len`."""


def calibrated_raw_share(calibration: GAACCalibration) -> float:
    """The largest raw-tile share the calibration measured (calibration corpus, held-out text); 0.05 if none."""
    shares = [m.get("raw_tile_share") for m in calibration.config.measured.values() if isinstance(m, dict)]
    shares = [float(s) for s in shares if s is not None]
    return max(shares) if shares else 0.05


def _static(t: torch.Tensor) -> torch.Tensor:
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


def _is_gaac_attention(config) -> bool:
    impl = getattr(text_config(config), "_attn_implementation", None)
    if impl is None:
        impl = getattr(config, "_attn_implementation", None)
    return impl == GAAC_ATTENTION_NAME


def _query_length(arg) -> int:
    """`get_mask_sizes` gets the query length (transformers >= 5.2x) or the cache positions (before)."""
    return int(arg.shape[0]) if isinstance(arg, torch.Tensor) else int(arg)


class _StaticLayerBase(CacheLayerMixin):
    is_compileable = True
    is_croppable = False
    is_sliding = False

    def __init__(self, layer_idx: int, max_cache_len: int, max_batch_size: int | None, num_kv_heads: int,
                 head_dim: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.max_cache_len = int(max_cache_len)
        self.max_batch_size = max_batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.tiles, self.channels = tile_split(head_dim)
        self.max_blocks = -(-self.max_cache_len // BLOCK_TOKENS)
        self.batch = 0
        self.device = None
        self.record = None

    def _check_input(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        _check_kv_dtype(key_states, value_states)
        b, h, _, d = key_states.shape
        if (h, d) != (self.num_kv_heads, self.head_dim) or value_states.shape[:2] != key_states.shape[:2] or \
                value_states.shape[-1] != d:
            raise CalibrationMismatchError(
                f"layer {self.layer_idx} gets KV of shape {tuple(key_states.shape)} / {tuple(value_states.shape)}; "
                f"the cache was built for {self.num_kv_heads} KV heads of dim {self.head_dim}")
        if self.max_batch_size is not None and b > self.max_batch_size:
            raise ValueError(f"batch of {b} rows is larger than max_batch_size={self.max_batch_size}")
        if self.is_initialized and b != self.batch:
            raise ValueError(f"layer {self.layer_idx} holds {self.batch} rows; got a batch of {b} "
                             "(reset() the cache before reusing it for another batch)")

    def _room(self, length: int, q: int) -> None:
        if length + q > self.max_cache_len:
            raise GAACCacheFullError(
                f"{length} cached + {q} new tokens exceed max_cache_len={self.max_cache_len}; build the cache with "
                "a larger max_cache_len")

    def host_length(self) -> int:
        """Tokens held (one host synchronization; eager callers only)."""
        if not self.is_initialized:
            return 0
        lens = self.kv_len.tolist()
        if len(set(lens)) != 1:
            raise ValueError(f"rows hold different lengths {lens}; the eager path needs equal rows")
        return lens[0]

    # --- CacheLayerMixin ----------------------------------------------------------------------------------------
    def get_seq_length(self):
        return self.kv_len[0].long() if self.is_initialized else 0  # a device tensor, as StaticLayer's

    def get_mask_sizes(self, query_length) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    get_max_cache_shape = get_max_length  # the name transformers versions before 5.2x call

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: permute rows in place (static addresses; finalized tiles are shared, never copied)."""
        if self.is_initialized:
            for t in self._row_tensors():
                t.copy_(t.index_select(0, beam_idx.to(t.device).long()))

    def reset(self) -> None:
        """Forget every token (in place: buffers keep their addresses, so compiled graphs stay valid)."""
        if self.is_initialized:
            self.kv_len.zero_()
            self._reset_storage()

    def _reset_storage(self) -> None:
        pass


class GAACStaticLayer(_StaticLayerBase):
    """One full-attention layer of a `GAACStaticCache` (see the module docstring)."""

    def __init__(self, calibration: GAACCalibration, layer_idx: int, max_cache_len: int,
                 max_batch_size: int | None = None, raw_tiles: int | None = None):
        cfg = calibration.config
        super().__init__(layer_idx, max_cache_len, max_batch_size, cfg.num_kv_heads, cfg.head_dim)
        self.layout = TileLayout(self.channels, cfg.escape_capacity)
        self._base3, self._base4 = calibration.windows(layer_idx)  # [2, H, D]
        self.raw_share = calibrated_raw_share(calibration)
        self.raw_tiles = raw_tiles

    @property
    def tile_positions(self) -> int:
        """Tiles of one block of one row (K and V, every kv-head, every tile of the head)."""
        return 2 * self.num_kv_heads * self.tiles

    @property
    def headroom(self) -> int:
        """Raw tiles one block completion of every row may take (what can happen between two checks)."""
        return self.batch * self.tile_positions

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_input(key_states, value_states)
        b = key_states.shape[0]
        dev = key_states.device
        self.batch, self.device = b, dev
        self.batch_size = b  # what Cache.batch_size reads, set on initialization as StaticLayer does
        n_all = b * self.max_blocks * self.tile_positions
        n_raw = self.raw_tiles if self.raw_tiles is not None else \
            min(n_all, math.ceil(1.5 * self.raw_share * n_all) + 2 * self.headroom)
        h, d, c = self.num_kv_heads, self.head_dim, self.channels
        self.slot_modes = _static(torch.zeros(n_all + 1, 3, dtype=torch.int32, device=dev))
        self.raw_modes = _static(torch.zeros(n_raw + 1, 3, dtype=torch.int32, device=dev))
        self.counts = _static(torch.zeros(2, dtype=torch.int32, device=dev))
        self.kv_len = _static(torch.zeros(b, dtype=torch.int32, device=dev))
        tail_k = _static(torch.zeros(b, h, BLOCK_TOKENS, d, dtype=torch.bfloat16, device=dev))
        tail_v = _static(torch.zeros(b, h, BLOCK_TOKENS, d, dtype=torch.bfloat16, device=dev))
        table = _static(torch.full((b, self.max_blocks, 2, h, self.tiles), -1 - n_raw, dtype=torch.int32,
                                   device=dev))
        self.record = ops.DecodeRecord(
            slot_pool=_static(torch.zeros(n_all + 1, self.layout.slot_bytes, dtype=torch.uint8, device=dev)),
            raw_pool=_static(torch.zeros(n_raw + 1, BLOCK_TOKENS, c, dtype=torch.bfloat16, device=dev)),
            table=table, tail_k=tail_k, tail_v=tail_v,
            base3=_static(self._base3.to(dev).clone(memory_format=torch.contiguous_format)),
            base4=_static(self._base4.to(dev).clone(memory_format=torch.contiguous_format)), kv_len=self.kv_len,
            plan=ops.plan(b, h, self.max_blocks, d, dev))
        tail_k.gaac_record = self.record  # what the "gaac" attention reads (gaac_hf/attention.py)
        self.is_initialized = True

    def _row_tensors(self):
        r = self.record
        return (r.table, r.tail_k, r.tail_v, self.kv_len)

    def _reset_storage(self) -> None:
        self.counts.zero_()
        self.record.table.fill_(-1 - (self.record.raw_pool.shape[0] - 1))

    # --- pools ----------------------------------------------------------------------------------------------------
    @property
    def n_slots(self) -> int:
        return self.record.slot_pool.shape[0] - 1

    @property
    def n_raw(self) -> int:
        return self.record.raw_pool.shape[0] - 1

    def grow_raw(self, needed: int) -> None:
        """Make room for `needed` raw tiles in all (eager; the pool moves, so compiled graphs are re-recorded)."""
        if needed <= self.n_raw:
            return
        r = self.record
        cap = max(needed, int(1.5 * self.n_raw))
        pool = torch.zeros(cap + 1, BLOCK_TOKENS, self.channels, dtype=torch.bfloat16, device=self.device)
        modes = torch.zeros(cap + 1, 3, dtype=torch.int32, device=self.device)
        used = min(int(self.counts[1]), self.n_raw)
        pool[:used] = r.raw_pool[:used]
        modes[:used] = self.raw_modes[:used]
        # table entries pointing at the old scratch row (blocks not yet finalized) move to the new one
        r.table.masked_fill_(r.table == -1 - self.n_raw, -1 - cap)
        r.raw_pool, self.raw_modes = _static(pool), _static(modes)

    def check_counts(self, slots: int, raws: int) -> None:
        """Raise if tiles were dropped; grow the raw pool if less than `headroom` is free."""
        if slots > self.n_slots or raws > self.n_raw:
            raise GAACPoolOverflowError(
                f"layer {self.layer_idx} dropped {max(slots - self.n_slots, 0) + max(raws - self.n_raw, 0)} tiles: "
                f"its raw pool ({self.n_raw} tiles) filled up between two checks, so the cache contents and every "
                "output since are invalid. Call cache.check() between decode steps (generate does it), or build "
                "the cache with a larger raw_tiles")
        if raws + 2 * self.headroom > self.n_raw:
            self.grow_raw(raws + 4 * self.headroom)

    # --- update ---------------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states, value_states)
        if key_states.shape[-2] == 1:
            ops.append_token(key_states, value_states, self.record, self.slot_modes, self.raw_modes, self.counts)
            return self.record.tail_k, self.record.tail_v
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
                                            self.layout.escape_capacity)
            slots_used, raws_used = self.counts.tolist()
            self.check_counts(slots_used, raws_used)
            self.grow_raw(raws_used + int((~fits).sum()) + 2 * self.headroom)  # exactly what this chunk needs
            first = torch.full((self.batch,), length // BLOCK_TOKENS + b0, dtype=torch.long, device=self.device)
            ops.place_blocks(slots, fits, modes, tiles, rows, first, r.slot_pool, r.raw_pool, r.table,
                             self.slot_modes, self.raw_modes, self.counts)
        rest = k.shape[-2] - nb * BLOCK_TOKENS
        r.tail_k[:, :, :rest].copy_(k[:, :, nb * BLOCK_TOKENS:])
        r.tail_v[:, :, :rest].copy_(v[:, :, nb * BLOCK_TOKENS:])
        self.kv_len.add_(q)
        return length

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
        r = self.record
        b, h, d = self.batch, self.num_kv_heads, self.head_dim
        keys = torch.zeros(b, h, self.max_cache_len, d, dtype=torch.bfloat16, device=self.device)
        values = torch.zeros_like(keys)
        p, c = self.tile_positions, self.channels
        step = max(1, ENCODE_MAX_TILES // (b * p))
        for b0 in range(0, n_blocks, step):
            b1 = min(n_blocks, b0 + step)
            tiles = ops.expand_tiles(r.table[:, b0:b1].reshape(b, b1 - b0, p), r.slot_pool, r.raw_pool,
                               r.base3.reshape(p, c), r.base4.reshape(p, c))
            kv = ops.blocks_of(tiles, h)
            keys[:, :, b0 * BLOCK_TOKENS:b1 * BLOCK_TOKENS] = kv[:, 0]
            values[:, :, b0 * BLOCK_TOKENS:b1 * BLOCK_TOKENS] = kv[:, 1]
        return keys, values

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


class PlainStaticLayer(_StaticLayerBase):
    """One full-attention layer of a `PlainStaticCache`: BF16 `[B, H, S_cap, D]` buffers, device lengths."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_input(key_states, value_states)
        b, dev = key_states.shape[0], key_states.device
        self.batch, self.device = b, dev
        self.batch_size = b
        s_cap = self.max_blocks * BLOCK_TOKENS
        shape = (b, self.num_kv_heads, s_cap, self.head_dim)
        self.keys = _static(torch.zeros(shape, dtype=torch.bfloat16, device=dev))
        self.values = _static(torch.zeros(shape, dtype=torch.bfloat16, device=dev))
        self.kv_len = _static(torch.zeros(b, dtype=torch.int32, device=dev))
        table = None
        if ops._backend(dev) == "triton":
            from triton_ops.gaac_attention import plain_table

            table = _static(plain_table(b, self.num_kv_heads, s_cap, self.head_dim, dev, self.channels))
        self.record = ops.PlainRecord(self.keys, self.values, table, self.kv_len,
                                      ops.plan(b, self.num_kv_heads, self.max_blocks, self.head_dim, dev))
        self.keys.gaac_record = self.record
        self.is_initialized = True

    def _row_tensors(self):
        return (self.keys, self.values, self.kv_len)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states, value_states)
        q = key_states.shape[-2]
        if q > 1:
            self._room(self.host_length(), q)
        pos = self.kv_len.long()[:, None] + torch.arange(q, device=self.device)  # [B, q]
        rows = torch.arange(self.batch, device=self.device)[:, None]
        self.keys[rows, :, pos] = key_states.transpose(1, 2)
        self.values[rows, :, pos] = value_states.transpose(1, 2)
        self.kv_len.add_(q)
        if q > 1:
            return self.keys[:, :, :self.max_cache_len], self.values[:, :, :self.max_cache_len]
        return self.keys, self.values


class _StaticCacheBase(Cache):
    """Shared by `GAACStaticCache` and `PlainStaticCache`: stock static layers for the other layer types."""

    def _build(self, config, max_cache_len: int, make_layer, offloading: bool):
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, not {max_cache_len!r}")
        stock = StaticCache(config=config, max_cache_len=max_cache_len).layers
        layers = full_attention_layers(config, make_layer, stock)
        self.config = config
        self._max_cache_len = max_cache_len  # behind a property: some transformers versions define one on Cache
        self._calls = 0
        self._next_check = 0
        super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=True)

    @property
    def own_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, _StaticLayerBase)]

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, _StaticLayerBase) and not _is_gaac_attention(self.config):
            raise ValueError(
                f"{type(self).__name__} is read by the \"gaac\" attention only; load the model with "
                "attn_implementation=\"gaac\" (or model.set_attn_implementation(\"gaac\")) after importing gaac_hf")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        q = _query_length(query_length)
        if q > self.max_cache_len:
            raise GAACCacheFullError(f"{q} tokens exceed max_cache_len={self.max_cache_len}")
        if not torch.compiler.is_compiling():
            self._between_steps(q)
        return super().get_mask_sizes(query_length, layer_idx)

    def _between_steps(self, query_length: int) -> None:
        """`generate` asks for the mask sizes eagerly before every forward: check the pools there, amortized."""
        self._calls += 1
        if self._calls >= self._next_check:
            room = self.check(query_length)
            self._next_check = self._calls + max(1, min(CHECK_EVERY, room // max(query_length, 1)))

    def check(self, query_length: int = 0) -> int:
        """Read the device counters (one synchronization); raise on dropped tiles or a full cache; grow raw
        pools short of headroom. Returns the tokens still free. Call it between decode steps in a hand-written
        loop (generate does it)."""
        layers = [self.layers[i] for i in self.own_layers if self.layers[i].is_initialized]
        if not layers:
            return self.max_cache_len
        lens = layers[0].kv_len
        counts = [getattr(layer, "counts", None) for layer in layers]
        parts = [lens.reshape(-1)] + [c for c in counts if c is not None]
        values = torch.cat([p.to(torch.int64) for p in parts]).tolist()
        length = max(values[:lens.numel()])
        if length > self.max_cache_len:
            raise GAACCacheFullError(
                f"the cache holds {length} tokens, past max_cache_len={self.max_cache_len}: outputs past that "
                "point are invalid")
        if length + query_length > self.max_cache_len:
            raise GAACCacheFullError(
                f"{length} cached + {query_length} new tokens exceed max_cache_len={self.max_cache_len}")
        at = lens.numel()
        for layer in layers:
            if getattr(layer, "counts", None) is not None:
                layer.check_counts(values[at], values[at + 1])
                at += 2
        return self.max_cache_len - length


class GAACStaticCache(_StaticCacheBase):
    """GAAC-compressed static KV cache for compiled decoding: `GAACStaticCache(config, max_cache_len, calibration)`.

    Mirrors `StaticCache(config, max_cache_len)`; `calibration` is a `GAACCalibration` or a path / Hub id of one,
    checked against `config` before anything is allocated. `max_batch_size` bounds the batch (buffers are sized from
    the first batch); `raw_tiles` overrides the raw pool size per layer (default: from the calibration's raw-tile
    share). Needs `attn_implementation="gaac"`. `model.generate(..., past_key_values=cache)` compiles the decode
    step by itself on CUDA (as for `StaticCache`; `compile_config` is honoured).
    """

    def __init__(self, config, max_cache_len: int, calibration: GAACCalibration | str | None = None, *,
                 max_batch_size: int | None = None, raw_tiles: int | None = None, offloading: bool = False,
                 **hub_kwargs):
        if calibration is None:
            raise TypeError("GAACStaticCache needs a calibration: GAACStaticCache(config, max_cache_len, calibration)")
        calibration = resolve_calibration(calibration, "GAACStaticCache", **hub_kwargs)
        calibration.check_model(config)
        if max_batch_size is not None and (not isinstance(max_batch_size, int) or max_batch_size < 1):
            raise ValueError(f"max_batch_size must be a positive int, not {max_batch_size!r}")
        self.calibration = calibration
        self._max_batch_size = max_batch_size
        self._build(config, max_cache_len,
                    lambda i: GAACStaticLayer(calibration, i, max_cache_len, max_batch_size, raw_tiles), offloading)

    @classmethod
    def from_pretrained(cls, pretrained_calibration, config, max_cache_len: int, *,
                        max_batch_size: int | None = None, raw_tiles: int | None = None,
                        **hub_kwargs) -> "GAACStaticCache":
        """Load a `GAACCalibration` (Hub repo id or local folder) and build the cache for a model `config`."""
        calibration = GAACCalibration.from_pretrained(pretrained_calibration, **hub_kwargs)
        return cls(config, max_cache_len, calibration, max_batch_size=max_batch_size, raw_tiles=raw_tiles)

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
                "raw_tiles": sum(s["raw_tiles"] for s in layers.values()), "layers": layers}


class PlainStaticCache(_StaticCacheBase):
    """The bit-exact twin of `GAACStaticCache`: the same static layout and attention code over plain BF16 KV."""

    def __init__(self, config, max_cache_len: int, *, max_batch_size: int | None = None,
                 offloading: bool = False):
        from .model_layers import kv_geometry

        g = kv_geometry(config)
        self._max_batch_size = max_batch_size
        self._build(config, max_cache_len,
                    lambda i: PlainStaticLayer(i, max_cache_len, max_batch_size, g.num_kv_heads, g.head_dim),
                    offloading)
