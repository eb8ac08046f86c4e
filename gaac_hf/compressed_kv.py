"""A read-only snapshot of one `GAACLayer` (`CompressedKV`), and the storage-less tensors that carry it to the `"gaac"`
attention (`GAACLazyKV`): the attention reads the snapshot block by block; any other torch op materializes the full
K/V, bit-identical to the expanded cache."""

from __future__ import annotations

from typing import Protocol

import torch
from torch.utils._pytree import tree_map

from . import ops
from .format import BLOCK_TOKENS
from .tile_pool import TilePool

# Blocks the CPU decode attention decodes per codec call (256 blocks = 4K tokens; its chunks are smaller).
DECODE_WINDOW_BLOCKS = 256


class SnapshotLayer(Protocol):
    """What a `CompressedKV` reads of its layer (a `GAACLayer`)."""

    pool: TilePool
    format_version: int

    def windows(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def decode_table(self, table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...


class CompressedKV:
    """Read-only snapshot of one `GAACLayer` at one step: finalized blocks (block table) plus the BF16 tail.

    Valid until the next `crop`/`reorder_cache`/`batch_select_indices`/`reset` of its layer (those may recycle
    tiles the snapshot still points to); plain appends never invalidate it.
    """

    def __init__(self, layer: SnapshotLayer, table: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor):
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
        return self.layer.decode_table(self.table[:, b0:b1], self.slot_pool, self.raw_pool)

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
