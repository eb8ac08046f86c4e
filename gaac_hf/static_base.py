"""What the two static caches share: the stacked buffers, the static layer protocol and the checks between steps.

`GAACStaticCache` (static_cache.py) and its bit-exact twin `PlainStaticCache` (plain_static_cache.py) stand on these
pieces:

* `LayerStack`: the buffers of a cache's own layers, one `[L, ...]` tensor per kind, allocated once on the first
  update (batch and device known then), with static addresses (`static_buffer`) so CUDA graphs read them in place;
* `StaticLayerBase`: the `CacheLayerMixin` of one full-attention layer over a stack (input checks, device lengths,
  beam reordering, reset, eager crop); a subclass says how it updates, what its attention reads (`record`) and
  which row tensors beam search permutes;
* `StaticCacheBase`: the `Cache` (stock static layers for the other layer types) and its amortized `check()` of
  lengths and pool counters between decode steps.
"""

from __future__ import annotations

import torch
from transformers import StaticCache
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_common.cache_layers import full_attention_layers, tokens_to_crop

from . import ops
from .cache_inputs import GAAC_ATTENTION_NAME, check_kv_dtype
from .calibration import CalibrationMismatchError
from .format import BLOCK_TOKENS, tile_split
from .model_layers import text_config


# Decode steps between two pool checks by `generate` (each check reads the counters: one host synchronization).
CHECK_EVERY = 8


class GAACPoolOverflowError(RuntimeError):
    """A static GAAC layer dropped tiles: its raw pool ran out between two checks."""


class GAACCacheFullError(ValueError):
    """More tokens than `max_cache_len`."""


def static_buffer(t: torch.Tensor) -> torch.Tensor:
    """A cache buffer for compiled steps: a static address (CUDA graphs read it in place) and static sizes. A raw
    pool that grows is a new tensor of a new size: the step recompiles for it, specialized again, instead of with
    a symbolic size (inductor then loses the symbolic offset of a layer's view in a mutating op's arguments:
    torch 2.13, CPU, every layer's append would write layer 0's pool)."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
        torch._dynamo.mark_static(t)
    return t


def recording_cuda_graph() -> bool:
    """Whether the current CUDA stream is recording a graph (no host synchronization may happen then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def is_gaac_attention(config) -> bool:
    impl = getattr(text_config(config), "_attn_implementation", None)
    if impl is None:
        impl = getattr(config, "_attn_implementation", None)
    return impl == GAAC_ATTENTION_NAME


def query_length_of(arg) -> int:
    """`get_mask_sizes` gets the query length (transformers >= 5.2x) or the cache positions (before)."""
    return int(arg.shape[0]) if isinstance(arg, torch.Tensor) else int(arg)


class LayerStack:
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


class StaticLayerBase(CacheLayerMixin):
    is_compileable = True
    is_croppable = True  # `crop` (eager) puts the layer back as it was: assisted decoding, prompt lookup
    is_sliding = False

    def __init__(self, stack: LayerStack, layer_idx: int):
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
        check_kv_dtype(key_states, value_states)
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
        n = tokens_to_crop(tokens_to_remove, self.is_initialized)
        if not n:
            return
        if torch.compiler.is_compiling():
            raise RuntimeError(f"{type(self).__name__}.crop runs eagerly, between steps")
        length = self.host_length()
        new_length = max(length - n, 0)
        self._crop_storage(length, new_length)
        self.kv_len.fill_(new_length)

    def _crop_storage(self, length: int, new_length: int) -> None:
        pass  # (plain KV: rows past the length are never read, and the next update writes over them)

    def offload(self):
        raise NotImplementedError(f"{type(self).__name__} keeps its buffers on the device (no offloading)")

    prefetch = offload


class StaticCacheBase(Cache):
    """Shared by `GAACStaticCache` and `PlainStaticCache`: stock static layers for the other layer types."""

    def _build(self, config, max_cache_len: int, stack: LayerStack, make_layer, offloading: bool):
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
        return [i for i, layer in enumerate(self.layers) if isinstance(layer, StaticLayerBase)]

    @property
    def max_batch_size(self) -> int | None:
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        return self._max_cache_len

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if isinstance(layer, StaticLayerBase) and not is_gaac_attention(self.config):
            raise ValueError(
                f"{type(self).__name__} is read by the \"gaac\" attention only; load the model with "
                "attn_implementation=\"gaac\" (or model.set_attn_implementation(\"gaac\")) after importing gaac_hf")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length, layer_idx: int = 0) -> tuple[int, int]:
        q = query_length_of(query_length)
        if q > self.max_cache_len:
            raise GAACCacheFullError(f"{q} tokens exceed max_cache_len={self.max_cache_len}")
        if not torch.compiler.is_compiling() and not recording_cuda_graph():
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

