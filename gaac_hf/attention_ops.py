"""The decode-step attention as `torch.library` custom ops with fake implementations (`gaac::decode_attention`,
`gaac::plain_decode_attention`), over a compressed layer's `DecodeRecord` or plain KV's `PlainRecord`: the CUDA C++
kernel, the Triton kernel or the torch reference, chosen per device; the same math for compressed and plain KV, so
their outputs are bit-identical."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .backends import DecodePlan, backend_of, cuda_plan, cuda_serves, fused_serves, gaac_cuda, slot_layout, tile_layout
from .format import BLOCK_TOKENS, tile_split
from .reference_attention import compressed_chunks, mask4, reference_attention


# Each op's body is a plain function too: eager callers (GAACCache) skip the dispatcher's per-call cost.
def _decode_attention_impl(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len, mask, scale,
                           num_splits, format_version=1):
    backend = backend_of(query.device)
    if not fused_serves(query.shape[-1]):
        backend = "torch"
    if backend == "gaac_cuda" and cuda_serves(query, table.shape[3], format_version):
        b, hq, d = query.shape
        h = table.shape[3]
        channels = raw_pool.shape[-1]
        layout = slot_layout(channels, slot_pool.shape[-1])
        plan_ = cuda_plan(b, h, hq // h, d, table.shape[1], layout.slot_bytes, False, num_splits, str(query.device),
                           format_version)
        return gaac_cuda.decode_attention(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len,
                                          mask, scale, layout, plan_)
    if backend in ("triton", "gaac_cuda") and format_version == 1:
        from triton_ops.gaac_attention import fused_compressed_attention

        layout = slot_layout(raw_pool.shape[-1], slot_pool.shape[-1])
        return fused_compressed_attention(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, scale,
                                          layout, mask, kv_len=kv_len, num_splits=num_splits)
    lens = kv_len.tolist()
    chunks = compressed_chunks(slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, lens, format_version)
    return reference_attention(query, chunks, max(lens), scale, mask4(mask), kv_len)


@torch.library.custom_op("gaac::decode_attention", mutates_args=())
def _decode_attention_op(query: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, table: torch.Tensor,
                         tail_k: torch.Tensor, tail_v: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor,
                         kv_len: torch.Tensor, mask: torch.Tensor | None, scale: float,
                         num_splits: int, format_version: int) -> torch.Tensor:
    return _decode_attention_impl(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len, mask,
                                  scale, num_splits, format_version)


@_decode_attention_op.register_fake
def _(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len, mask, scale, num_splits,
      format_version):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def _plain_decode_attention_impl(query, key, value, table, kv_len, mask, scale, num_splits):
    backend = backend_of(query.device)
    if not fused_serves(query.shape[-1]):
        backend = "torch"
    if backend == "gaac_cuda" and cuda_serves(query, key.shape[1]):
        b, h, s, d = key.shape
        plan_ = cuda_plan(b, h, query.shape[1] // h, d, s // BLOCK_TOKENS, 0, True, num_splits, str(query.device))
        return gaac_cuda.plain_decode_attention(query, key, value, kv_len, mask, scale, plan_)
    if backend in ("triton", "gaac_cuda"):
        from triton_ops.gaac_attention import fused_plain_attention

        layout = tile_layout(tile_split(key.shape[-1])[1], 0)  # no slot is read; its offsets: the same binary
        return fused_plain_attention(query, key, value, scale, layout, mask, kv_len=kv_len, table=table,
                                     num_splits=num_splits)
    lens = kv_len.tolist()
    return reference_attention(query, lambda s, e: (key[:, :, s:e], value[:, :, s:e]), max(lens), scale,
                               mask4(mask), kv_len)


@torch.library.custom_op("gaac::plain_decode_attention", mutates_args=())
def _plain_decode_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                               table: torch.Tensor | None, kv_len: torch.Tensor, mask: torch.Tensor | None,
                               scale: float, num_splits: int) -> torch.Tensor:
    return _plain_decode_attention_impl(query, key, value, table, kv_len, mask, scale, num_splits)


@_plain_decode_attention_op.register_fake
def _(query, key, value, table, kv_len, mask, scale, num_splits):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@dataclass
class DecodeRecord:
    """What the decode attention reads of one compressed layer (no layer internals): pools, block table, BF16 tail,
    windows, device lengths, plan. `base3`/`base4` uint8 `[2, H_kv, D]`."""

    slot_pool: torch.Tensor
    raw_pool: torch.Tensor
    table: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    base3: torch.Tensor
    base4: torch.Tensor
    kv_len: torch.Tensor
    plan: DecodePlan
    format_version: int = 1  # of the slots (docs/format.md); the windows are the same either way (even for 2)


@dataclass
class PlainRecord:
    """The same for plain BF16 KV `[B, H_kv, S_cap, D]` (the bit-exact twin): buffers, table of their raw-tile
    addressing (or None), device lengths, plan."""

    key: torch.Tensor
    value: torch.Tensor
    table: torch.Tensor | None
    kv_len: torch.Tensor
    plan: DecodePlan


def decode_attention(query: torch.Tensor, record: DecodeRecord, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """`[B, H_q, D]` BF16 query over a compressed layer -> `[B, H_q, D]`; mask bool `[B, S_mask]` or None."""
    r = record
    op = torch.ops.gaac.decode_attention if torch.compiler.is_compiling() else _decode_attention_impl
    return op(query, r.slot_pool, r.raw_pool, r.table, r.tail_k, r.tail_v, r.base3, r.base4, r.kv_len, mask, scale,
              r.plan.splits, r.format_version)


def plain_decode_attention(query: torch.Tensor, record: PlainRecord, mask: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    r = record
    op = torch.ops.gaac.plain_decode_attention if torch.compiler.is_compiling() else _plain_decode_attention_impl
    return op(query, r.key, r.value, r.table, r.kv_len, mask, scale, r.plan.splits)
