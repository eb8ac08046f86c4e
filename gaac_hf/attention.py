"""The `"gaac"` attention implementation: decode attention that reads GAAC-compressed KV in place.

Importing this module registers `"gaac"` with `transformers.AttentionInterface` (the attention function) and with
`transformers.masking_utils.AttentionMaskInterface` (`sdpa_mask`, so padded batches get their bool masks). Use it as
`AutoModelForCausalLM.from_pretrained(..., attn_implementation="gaac")` or `model.set_attn_implementation("gaac")`
after importing `gaac_hf`.

* Decode (one query token, no unusual kwargs): `gaac_decode_attention` (the user-facing attention of one query
  token). On CUDA it runs the fused kernel (`gaac_cuda`, or Triton's `fused_compressed_attention`), reading slots,
  raw tiles and the tail in place, or the same kernel over plain KV (`fused_plain_attention`). On the CPU it runs
  the torch reference (`ops.reference_attention`), which walks the KV block by block, `DECODE_CHUNK_BLOCKS`
  16-token blocks at a time, with an fp32 online softmax, GQA without `repeat_kv`, and the bool mask (left padding)
  honoured. Fed `GAACLazyKV` from a `GAACCache`, it expands one chunk of compressed blocks at a time and never
  materializes the whole decompressed cache; fed plain BF16 K/V (e.g. from a `DynamicCache`), it slices the same
  chunks. The chunks it computes on are bit-identical either way, so the output is bit-identical: that is the
  lossless contract of `"gaac"`.
* Anything else (prefill and verify steps with several query tokens, softcap, sinks, position bias, sliding window,
  output_attentions, dropout in training): `transformers.integrations.sdpa_attention.sdpa_attention_forward` over
  the expanded context.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache_inputs import GAAC_ATTENTION_NAME
from .compressed_kv import CompressedKV, GAACLazyKV
from .format import BLOCK_TOKENS
from .ops import (PlainRecord, decode_attention, device_lengths, fused_serves, plain_decode_attention, plan,
                  reference_attention)

# Blocks of 16 tokens per decode step of the online softmax (the chunking is part of the math: both the compressed
# and the plain path use it, so they stay bit-identical whatever its value).
DECODE_CHUNK_BLOCKS = 32

# Keyword arguments the decode path understands or may ignore; other kwargs with a value other than None/False
# send the call to sdpa.
_IGNORED_KWARGS = {"position_ids", "use_cache", "is_causal", "cache_position", "layer_idx"}


class PlainKV:
    """The chunk interface of `CompressedKV` over plain K/V tensors `[B, H_kv, S, D]`."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor):
        self.key, self.value = key, value
        self.batch, self.heads, self.length, self.head_dim = key.shape

    def chunk(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.key[:, :, start:end].contiguous(), self.value[:, :, start:end].contiguous())


def kv_source(key: torch.Tensor, value: torch.Tensor) -> CompressedKV | PlainKV:
    """A chunk source for the decode attention: the compressed snapshot when given `GAACLazyKV`, else plain KV."""
    if isinstance(key, GAACLazyKV) and isinstance(value, GAACLazyKV) and key.compressed is value.compressed \
            and (key.which, value.which) == (0, 1):
        return key.compressed
    if isinstance(key, GAACLazyKV):
        key = key.materialize()
    if isinstance(value, GAACLazyKV):
        value = value.materialize()
    return PlainKV(key, value)


def _mask_rows(mask: torch.Tensor | None, batch: int) -> tuple[bool, torch.Tensor | None]:
    """A `[B|1, 1, 1, S]` bool mask as `[B, S]` for the fused kernel; `(False, None)` if it has another form."""
    if mask is None:
        return True, None
    if mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != 1:
        return False, None
    return True, mask[:, 0, 0, :].expand(batch, -1)


def _fused_attention(query, source, attention_mask, scale):
    """The fused kernel on CUDA (through the `gaac::` ops): compressed blocks read in place, or plain KV."""
    b, hq, _, d = query.shape
    ok, mask = _mask_rows(attention_mask, b)
    if not ok or not fused_serves(d):  # other head dims: the reference below, for compressed and plain KV alike
        return None
    q = query.reshape(b, hq, d)
    if isinstance(source, CompressedKV):
        return decode_attention(q, source.record(), mask, scale).unsqueeze(1)
    key, value = source.key, source.value
    record = PlainRecord(key, value, None, device_lengths(b, key.shape[2], key.device),
                         plan(b, source.heads, key.shape[2] // BLOCK_TOKENS, d, key.device))
    return plain_decode_attention(q, record, mask, scale).unsqueeze(1)


def gaac_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None = None, scaling: float | None = None,
                          chunk_blocks: int | None = None) -> torch.Tensor:
    """Single-query attention over K/V, block-chunked with an fp32 online softmax.

    `query` `[B, H_q, 1, D]`; `key`/`value` `[B, H_kv, S, D]`, plain tensors or `GAACLazyKV` (read compressed, chunk
    by chunk); `attention_mask` None, bool (True = attend) or additive float, `[B|1, 1|H_q, 1, S]`.
    Returns `[B, 1, H_q, D]` in the query dtype. Query head `h` reads KV head `h // (H_q / H_kv)` (no repeat_kv).
    """
    source = kv_source(key, value)
    b, hq, q_len, d = query.shape
    if q_len != 1:
        raise ValueError(f"gaac_decode_attention takes one query token, got {q_len}")
    hkv = source.heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads do not group over {hkv} KV heads")
    scale = d ** -0.5 if scaling is None else scaling
    if query.is_cuda and query.dtype == torch.bfloat16:
        fused = _fused_attention(query, source, attention_mask, scale)
        if fused is not None:
            return fused
    out = reference_attention(query.reshape(b, hq, d), source.chunk, source.length, scale, attention_mask,
                              chunk_tokens=BLOCK_TOKENS * (chunk_blocks or DECODE_CHUNK_BLOCKS))
    return out.unsqueeze(1)


def static_decode_attention(query: torch.Tensor, record, attention_mask: torch.Tensor | None,
                            scaling: float | None) -> torch.Tensor:
    """The decode attention of the static caches: the `gaac::` custom ops over a `DecodeRecord` (compressed) or a
    `PlainRecord` (the plain twin); traceable, so a compiled decode step is one graph."""
    b, hq, _, d = query.shape
    ok, mask = _mask_rows(attention_mask, b)
    if not ok:
        raise ValueError("the static GAAC caches take a bool attention mask [B, 1, 1, S] (the \"gaac\" mask "
                         f"function gives one); got {attention_mask.dtype} {tuple(attention_mask.shape)}")
    scale = d ** -0.5 if scaling is None else scaling
    q = query.reshape(b, hq, d)
    if isinstance(record, PlainRecord):
        out = plain_decode_attention(q, record, mask, scale)
    else:
        out = decode_attention(q, record, mask, scale)
    return out.unsqueeze(1)


def _decode_supported(query: torch.Tensor, dropout: float, module, kwargs: dict) -> bool:
    if query.shape[2] != 1:
        return False
    if dropout and getattr(module, "training", False):
        return False
    for name, value in kwargs.items():
        if name in _IGNORED_KWARGS:
            continue
        if value is None or value is False:
            continue
        return False
    return True


def gaac_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs) -> tuple[torch.Tensor, None]:
    """The `"gaac"` attention function (signature of transformers' attention interface)."""
    record = getattr(key, "gaac_record", None)
    if record is not None:  # K/V of a static GAAC cache: only the decode step reads them (prefill gets dense K/V)
        if not _decode_supported(query, dropout, module, kwargs):
            raise ValueError(f"the static GAAC caches serve single-token decode steps; got query "
                             f"{tuple(query.shape)} with {sorted(k for k, v in kwargs.items() if v)}")
        return static_decode_attention(query, record, attention_mask, scaling), None
    if _decode_supported(query, dropout, module, kwargs):
        return gaac_decode_attention(query, key, value, attention_mask, scaling), None
    if isinstance(key, GAACLazyKV):
        key = key.materialize()
    if isinstance(value, GAACLazyKV):
        value = value.materialize()
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


def register() -> None:
    """Register `"gaac"` (attention function and `sdpa_mask`) process-wide; done at import."""
    AttentionInterface.register(GAAC_ATTENTION_NAME, gaac_attention_forward)
    AttentionMaskInterface.register(GAAC_ATTENTION_NAME, sdpa_mask)


register()
