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
`gaac::decode_attention` custom op (gaac_hf/ops.py), handed over as the `gaac_record` of the tail tensor `update`
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
from transformers import StaticCache
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_common.cache_layers import full_attention_layers, tokens_to_crop

from . import ops
from .cache import GAAC_ATTENTION_NAME, _check_kv_dtype, check_storage_format, choose_format, resolve_calibration
from .calibration import CalibrationMismatchError, GAACCalibration
from .format import BLOCK_TABLE_ENTRY_BYTES, BLOCK_TOKENS, MODE_NAMES, TileLayout, tile_split
from .model_layers import kv_geometry, text_config

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
    """A cache buffer for compiled steps: a static address (CUDA graphs read it in place) and static sizes. A raw
    pool that grows is a new tensor of a new size: the step recompiles for it, specialized again, instead of with
    a symbolic size (inductor then loses the symbolic offset of a layer's view in a mutating op's arguments:
    torch 2.13, CPU, every layer's append would write layer 0's pool)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
        torch._dynamo.mark_static(t)
    return t


def _recording_cuda_graph() -> bool:
    """Whether the current CUDA stream is recording a graph (no host synchronization may happen then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _is_gaac_attention(config) -> bool:
    impl = getattr(text_config(config), "_attn_implementation", None)
    if impl is None:
        impl = getattr(config, "_attn_implementation", None)
    return impl == GAAC_ATTENTION_NAME


def _query_length(arg) -> int:
    """`get_mask_sizes` gets the query length (transformers >= 5.2x) or the cache positions (before)."""
    return int(arg.shape[0]) if isinstance(arg, torch.Tensor) else int(arg)


class _LayerStack:
    """The buffers of a static cache's own layers, stacked: one `[L, ...]` tensor per kind (L layers), allocated
    once on the first update (when batch and device are known), static addresses.

    Layer `j` of the stack reads views `t[j]` (contiguous, so the kernels get per-layer pointers). Made inside the
    traced step the views cost nothing at replay, and the compiled step carries one input per kind instead of one
    per layer: fewer tensors for Dynamo to guard and for CUDA-graph trees to check every step."""

    def __init__(self, max_cache_len: int, max_batch_size: int | None, num_kv_heads: int, head_dim: int):
        if not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"max_cache_len must be a positive int, not {max_cache_len!r}")
        self.layer_ids: list[int] = []
        self.max_cache_len = int(max_cache_len)
        self.max_batch_size = max_batch_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.tiles, self.channels = tile_split(head_dim)
        self.max_blocks = -(-self.max_cache_len // BLOCK_TOKENS)
        self.batch = 0
        self.device = None
        self.plan = None

    def add(self, layer_idx: int) -> int:
        """Register a model layer; returns its index in the stack."""
        self.layer_ids.append(layer_idx)
        return len(self.layer_ids) - 1

    @property
    def allocated(self) -> bool:
        return self.device is not None

    def allocate(self, batch: int, device: torch.device) -> None:
        self.batch, self.device = batch, device
        self.plan = ops.plan(batch, self.num_kv_heads, self.max_blocks, self.head_dim, device)
        self._allocate(len(self.layer_ids), batch, device)

    def _allocate(self, layers: int, batch: int, device: torch.device) -> None:
        raise NotImplementedError


class _StaticLayerBase(CacheLayerMixin):
    is_compileable = True
    is_croppable = True  # `crop` (eager) puts the layer back as it was: assisted decoding, prompt lookup
    is_sliding = False

    def __init__(self, stack: _LayerStack, layer_idx: int):
        super().__init__()
        self.stack = stack
        self.j = stack.add(layer_idx)
        self.layer_idx = layer_idx
        self.max_cache_len, self.max_batch_size = stack.max_cache_len, stack.max_batch_size
        self.num_kv_heads, self.head_dim = stack.num_kv_heads, stack.head_dim
        self.tiles, self.channels, self.max_blocks = stack.tiles, stack.channels, stack.max_blocks
        self.batch = 0
        self.device = None

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
        held = self.batch if self.is_initialized else self.stack.batch if self.stack.allocated else b
        if b != held:
            raise ValueError(f"layer {self.layer_idx} holds {held} rows; got a batch of {b} "
                             "(reset() the cache before reusing it for another batch)")

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._check_input(key_states, value_states)
        b, dev = key_states.shape[0], key_states.device
        if not self.stack.allocated:
            self.stack.allocate(b, dev)
        elif torch.device(dev) != torch.device(self.stack.device):
            raise ValueError(f"layer {self.layer_idx} gets KV on {dev}; the cache's buffers are on "
                             f"{self.stack.device} (one device per cache)")
        self.batch, self.device = b, dev
        self.batch_size = b  # what Cache.batch_size reads, set on initialization as StaticLayer does
        self._bind()
        self.is_initialized = True

    def _bind(self) -> None:
        pass

    def _room(self, length: int, q: int) -> None:
        if length + q > self.max_cache_len:
            raise GAACCacheFullError(
                f"{length} cached + {q} new tokens exceed max_cache_len={self.max_cache_len}; build the cache with "
                "a larger max_cache_len")

    @property
    def kv_len(self) -> torch.Tensor:
        """Tokens held per row, int32 `[B]` on the device (a view of the stack's lengths)."""
        return self.stack.kv_len[self.j]

    def host_length(self) -> int:
        """Tokens held (one host synchronization; eager callers only)."""
        if not self.is_initialized:
            return 0
        lens = self.kv_len.tolist()
        if len(set(lens)) != 1:
            raise ValueError(f"rows hold different lengths {lens}; the eager path needs equal rows")
        return lens[0]

    @staticmethod
    def _hand_over(record, key: torch.Tensor, value: torch.Tensor):
        """What a decode-step update returns: the layer's buffers, with the record the "gaac" attention reads."""
        key.gaac_record = record
        return key, value

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

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last `-tokens_to_remove` tokens of every row (assisted decoding and prompt lookup reject
        draft tokens this way), eagerly and in place: buffers keep their addresses, so compiled graphs stay valid."""
        if not tokens_to_crop(tokens_to_remove, self.is_initialized):
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{type(self).__name__}.crop runs eagerly, between steps")
        length = self.host_length()
        new_length = max(length + tokens_to_remove, 0)
        self._crop_storage(length, new_length)
        self.kv_len.fill_(new_length)

    def _crop_storage(self, length: int, new_length: int) -> None:
        pass  # (plain KV: rows past the length are never read, and the next update writes over them)

    def offload(self):
        raise NotImplementedError(f"{type(self).__name__} keeps its buffers on the device (no offloading)")

    prefetch = offload


class _GAACStack(_LayerStack):
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
        self.kv_len = _static(torch.zeros(layers, b, **i32))
        self.counts = _static(torch.zeros(layers, 2, **i32))  # per layer: slots, raw tiles taken
        self.tails = _static(torch.zeros(layers, 2, b, h, BLOCK_TOKENS, d, dtype=torch.bfloat16, device=dev))
        self.bases = _static(torch.stack([torch.stack(self.calibration.windows(i)) for i in self.layer_ids])
                             .to(dev).contiguous())  # [L, base3|base4, K|V, H, D]
        self.table = _static(torch.full((layers, b, self.max_blocks, 2, h, self.tiles), -1 - n_raw, **i32))
        self.slot_pool = _static(torch.zeros(layers, n_all + 1, self.layout.slot_bytes, dtype=torch.uint8,
                                             device=dev))
        self.slot_modes = _static(torch.zeros(layers, n_all + 1, 3, **i32))
        self.raw_pool = _static(torch.zeros(layers, n_raw + 1, BLOCK_TOKENS, c, dtype=torch.bfloat16, device=dev))
        self.raw_modes = _static(torch.zeros(layers, n_raw + 1, 3, **i32))

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
        self.raw_pool, self.raw_modes = _static(pool), _static(modes)

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


class GAACStaticLayer(_StaticLayerBase):
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


class _PlainStack(_LayerStack):
    """The stacked buffers of a `PlainStaticCache`: K and V `[L, 2, B, H, S_cap, D]`, lengths `[L, B]`, and (Triton
    kernel) the raw-tile table of one layer's plain KV, which every layer shares (it depends on the shape only)."""

    def _allocate(self, layers: int, b: int, dev: torch.device) -> None:
        s_cap = self.max_blocks * BLOCK_TOKENS
        self.kv = _static(torch.zeros(layers, 2, b, self.num_kv_heads, s_cap, self.head_dim, dtype=torch.bfloat16,
                                      device=dev))
        self.kv_len = _static(torch.zeros(layers, b, dtype=torch.int32, device=dev))
        self.table = None
        if ops.backend_of(dev) == "triton":
            from triton_ops.gaac_attention import plain_table

            self.table = _static(plain_table(b, self.num_kv_heads, s_cap, self.head_dim, dev, self.channels))

    def record(self, j: int) -> ops.PlainRecord:
        return ops.PlainRecord(self.kv[j, 0], self.kv[j, 1], self.table, self.kv_len[j], self.plan)


class PlainStaticLayer(_StaticLayerBase):
    """One full-attention layer of a `PlainStaticCache`: BF16 `[B, H, S_cap, D]` buffers (`keys`, `values`: views of
    the cache's stacked K/V), device lengths."""

    def __init__(self, layer_idx: int, max_cache_len: int, max_batch_size: int | None, num_kv_heads: int,
                 head_dim: int, stack: _PlainStack | None = None):
        super().__init__(stack or _PlainStack(max_cache_len, max_batch_size, num_kv_heads, head_dim), layer_idx)

    def _bind(self) -> None:
        self.keys, self.values = self.stack.kv[self.j, 0], self.stack.kv[self.j, 1]  # for eager readers

    @property
    def record(self) -> ops.PlainRecord:
        return self.stack.record(self.j) if self.is_initialized else None

    def _row_tensors(self):
        return (self.keys, self.values, self.kv_len)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_input(key_states, value_states)
        q = key_states.shape[-2]
        if q == 1:  # the decode step: one opaque op, as GAAC's (so inductor compiles the model side alike)
            record = self.stack.record(self.j)
            ops.plain_append_token(key_states, value_states, record)
            return self._hand_over(record, record.key, record.value)
        return self._prefill(key_states, value_states)

    @torch.compiler.disable  # (several tokens per row: eager, as GAAC's, a graph break inside a compiled forward)
    def _prefill(self, key_states: torch.Tensor, value_states: torch.Tensor):
        q = key_states.shape[-2]
        self._room(self.host_length(), q)
        pos = self.kv_len.long()[:, None] + torch.arange(q, device=self.device)  # [B, q]
        rows = torch.arange(self.batch, device=self.device)[:, None]
        self.keys[rows, :, pos] = key_states.transpose(1, 2)
        self.values[rows, :, pos] = value_states.transpose(1, 2)
        self.kv_len.add_(q)
        return self.keys[:, :, :self.max_cache_len], self.values[:, :, :self.max_cache_len]


class _StaticCacheBase(Cache):
    """Shared by `GAACStaticCache` and `PlainStaticCache`: stock static layers for the other layer types."""

    def _build(self, config, max_cache_len: int, stack: _LayerStack, make_layer, offloading: bool):
        if offloading:
            raise NotImplementedError(f"{type(self).__name__} keeps its buffers on the device: offloading=True is "
                                      "not supported")
        stock = StaticCache(config=config, max_cache_len=max_cache_len).layers
        self._stack = stack
        layers = full_attention_layers(config, make_layer, stock)
        self.config = config
        self._max_cache_len = max_cache_len  # behind a property: some transformers versions define one on Cache
        self._calls = 0
        self._next_check = 0
        super().__init__(layers=layers, offloading=offloading, offload_only_non_sliding=True)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The device buffers a decode step reads and writes (stacked over the layers; none before the first
        update). A recorded CUDA graph is valid while their addresses stay (a raw pool that grows moves)."""
        return tuple(v for v in vars(self._stack).values() if isinstance(v, torch.Tensor))

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
        if not torch.compiler.is_compiling() and not _recording_cuda_graph():
            self.between_steps(q)
        return super().get_mask_sizes(query_length, layer_idx)

    def between_steps(self, query_length: int) -> None:
        """Before a step of `query_length` tokens per row: every few calls (fewer as the cache fills), `check()`.
        `generate` asks for the mask sizes eagerly before every forward, which calls this; a `CapturedStep` calls it
        before each replay."""
        self._calls += 1
        if self._calls >= self._next_check:
            room = self.check(query_length)
            self._next_check = self._calls + max(1, min(CHECK_EVERY, room // max(query_length, 1)))

    def check(self, query_length: int = 0) -> int:
        """Read the device counters (one synchronization); raise on dropped tiles or a full cache; grow raw
        pools short of headroom. Returns the tokens still free. Call it between decode steps in a hand-written
        loop (generate does it)."""
        stack = self._stack
        layers = [self.layers[i] for i in self.own_layers if self.layers[i].is_initialized]
        if not layers:
            return self.max_cache_len
        lens = layers[0].kv_len
        counts = getattr(stack, "counts", None)
        parts = [lens] + ([counts.reshape(-1)] if counts is not None else [])
        values = torch.cat([p.to(torch.int64) for p in parts]).tolist()
        length = max(values[:lens.numel()])
        if length > self.max_cache_len:
            raise GAACCacheFullError(
                f"the cache holds {length} tokens, past max_cache_len={self.max_cache_len}: outputs past that "
                "point are invalid")
        if length + query_length > self.max_cache_len:
            raise GAACCacheFullError(
                f"{length} cached + {query_length} new tokens exceed max_cache_len={self.max_cache_len}")
        if counts is not None:
            at = lens.numel()
            stack.check_counts({layer.j: (values[at + 2 * layer.j], values[at + 2 * layer.j + 1]) for layer in layers})
        return self.max_cache_len - length


class GAACStaticCache(_StaticCacheBase):
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


class PlainStaticCache(_StaticCacheBase):
    """The bit-exact twin of `GAACStaticCache`: the same static layout and attention code over plain BF16 KV."""

    def __init__(self, config, max_cache_len: int, *, max_batch_size: int | None = None,
                 offloading: bool = False):
        g = kv_geometry(config)
        self._max_batch_size = max_batch_size
        stack = _PlainStack(max_cache_len, max_batch_size, g.num_kv_heads, g.head_dim)
        self._build(config, max_cache_len, stack,
                    lambda i: PlainStaticLayer(i, max_cache_len, max_batch_size, g.num_kv_heads, g.head_dim, stack),
                    offloading)
