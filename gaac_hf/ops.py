"""The kernels behind the GAAC caches, one entry point per job, the backend chosen per device in `backend_of`: this
module gathers them from `backends` (backend and plans), `tile_ops` (tiles <-> slots, tables <-> K/V),
`reference_attention` (the torch reference), `attention_ops` (the attention custom ops and the records they read)
and `append_ops` (the static layers' decode-step update).

* `encode` / `expand_tiles` / `expand_kv`: tiles -> slots, block-table entries -> tiles or K/V (the Triton kernels
  on CUDA, the torch codec / `cpu_decode` elsewhere; bit-identical), in format version 1 or 2 (`format_version`: the
  caches choose it, `cache.choose_format`). The slot layout (`format.TileLayout`) is passed down to every kernel.
* `decode_attention` / `plain_decode_attention`: single-query attention over a compressed `DecodeRecord` or over
  plain BF16 KV, the same math either way (so their outputs are bit-identical), registered as `torch.library` custom
  ops (`gaac::decode_attention`, `gaac::plain_decode_attention`) with fake implementations, so Dynamo traces through
  them and a captured CUDA graph replays them. Lengths come from a device tensor `kv_len` int32 `[B]`; the split
  count comes from a `DecodePlan`, made once per shape (FlashInfer's plan/run split).
* `append_token` (`gaac::append_token`): one decode token into a static layer, finalizing the blocks it completes,
  with no host synchronization (a static cache's whole decode-step update); `plain_append_token`
  (`gaac::plain_append_token`): the plain twin's, the same op shape (so both compiled steps compile alike).

Backends: `gaac_cuda` (the CUDA C++ package, when installed and available for the device), else Triton on CUDA,
else the torch reference. The torch reference of the attention is block-chunked with an fp32 online softmax; the
Triton kernel and the CUDA kernel each agree with themselves across compressed and plain KV, bit for bit.
"""

from __future__ import annotations

from .append_ops import append_token, place_blocks, plain_append_token, store_blocks
from .attention_ops import DecodeRecord, PlainRecord, decode_attention, plain_decode_attention
from .backends import (CUDA_V2_HEAD_DIMS, FUSED_HEAD_DIMS, DecodePlan, backend_of, cuda_plan, device_lengths,
                       fused_reads, fused_serves, gaac_cuda, plan, slot_layout, splits, tile_layout)
from .reference_attention import REFERENCE_CHUNK_TOKENS, reference_attention
from .tile_ops import blocks_of, encode, expand_kv, expand_tiles, tiles_of

__all__ = ["append_token", "place_blocks", "plain_append_token", "store_blocks", "DecodeRecord", "PlainRecord",
           "decode_attention", "plain_decode_attention", "CUDA_V2_HEAD_DIMS", "FUSED_HEAD_DIMS", "DecodePlan",
           "backend_of", "cuda_plan", "device_lengths", "fused_reads", "fused_serves", "gaac_cuda", "plan",
           "slot_layout", "splits", "tile_layout", "REFERENCE_CHUNK_TOKENS", "reference_attention", "blocks_of",
           "encode", "expand_kv", "expand_tiles", "tiles_of"]
