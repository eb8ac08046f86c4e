"""`PlainStaticCache`: the bit-exact twin of `GAACStaticCache` over plain BF16 KV.

The same static layout (stacked buffers, device lengths) and the same attention code as `GAACStaticCache`, with the
KV kept as BF16 `[B, H, S_cap, D]` buffers: updated by an opaque op of the same shape (`gaac::plain_append_token`,
in place, so inductor compiles the code around both caches' updates alike) and read by
`gaac::plain_decode_attention`. Lossless checks and benchmarks compare GAAC against it.
"""

from __future__ import annotations

import torch

from . import ops
from .format import BLOCK_TOKENS
from .model_layers import kv_geometry
from .static_base import LayerStack, StaticCacheBase, StaticLayerBase, static_buffer


class _PlainStack(LayerStack):
    """The stacked buffers of a `PlainStaticCache`: K and V `[L, 2, B, H, S_cap, D]`, lengths `[L, B]`, and (Triton
    kernel) the raw-tile table of one layer's plain KV, which every layer shares (it depends on the shape only)."""

    def _allocate(self, layers: int, b: int, dev: torch.device) -> None:
        s_cap = self.max_blocks * BLOCK_TOKENS
        self.kv = static_buffer(torch.zeros(layers, 2, b, self.num_kv_heads, s_cap, self.head_dim, dtype=torch.bfloat16,
                                      device=dev))
        self.kv_len = static_buffer(torch.zeros(layers, b, dtype=torch.int32, device=dev))
        self.table = None
        if ops.backend_of(dev) == "triton":
            from triton_ops.gaac_attention import plain_table

            self.table = static_buffer(plain_table(b, self.num_kv_heads, s_cap, self.head_dim, dev, self.channels))

    def record(self, j: int) -> ops.PlainRecord:
        return ops.PlainRecord(self.kv[j, 0], self.kv[j, 1], self.table, self.kv_len[j], self.plan)


class PlainStaticLayer(StaticLayerBase):
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


class PlainStaticCache(StaticCacheBase):
    """The bit-exact twin of `GAACStaticCache`: the same static layout and attention code over plain BF16 KV."""

    def __init__(self, config, max_cache_len: int, *, max_batch_size: int | None = None,
                 offloading: bool = False):
        g = kv_geometry(config)
        self._max_batch_size = max_batch_size
        stack = _PlainStack(max_cache_len, max_batch_size, g.num_kv_heads, g.head_dim)
        self._build(config, max_cache_len, stack,
                    lambda i: PlainStaticLayer(i, max_cache_len, max_batch_size, g.num_kv_heads, g.head_dim, stack),
                    offloading)
