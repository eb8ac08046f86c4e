"""The torch reference of the decode-step attention: block-chunked, fp32 online softmax, GQA without repeat_kv; the
chunks of a compressed layer decoded from its block table."""

from __future__ import annotations

import torch

from .format import BLOCK_TOKENS
from .tile_ops import blocks_of, expand_tiles

# Tokens per step of the torch reference's online softmax (part of its math: compressed and plain KV both use it).
REFERENCE_CHUNK_TOKENS = 512


def reference_attention(query: torch.Tensor, chunks, length: int, scale: float, mask: torch.Tensor | None = None,
                        kv_len: torch.Tensor | None = None,
                        chunk_tokens: int = REFERENCE_CHUNK_TOKENS) -> torch.Tensor:
    """Single-query attention, block-chunked with an fp32 online softmax; GQA without repeat_kv.

    `query` `[B, H_q, D]`; `chunks(start, end)` returns BF16 K, V `[B, H_kv, end - start, D]` of tokens
    `[start, end)`; `mask` None, bool (True = attend) or additive float, `[B|1, 1|H_q, 1, S >= length]`;
    `kv_len` int32 `[B]`: row b attends to its first `kv_len[b]` tokens only (None: all `length`).
    Returns `[B, H_q, D]` in the query dtype.
    """
    b, hq, d = query.shape
    m = denom = acc = None
    ragged = kv_len is not None and bool((kv_len != length).any())
    for start in range(0, length, chunk_tokens):
        end = min(start + chunk_tokens, length)
        k, v = chunks(start, end)
        hkv = k.shape[1]
        n_rep = hq // hkv
        if m is None:
            q = query.float().reshape(b, hkv, n_rep, d)
            m = torch.full((b, hkv, n_rep, 1), float("-inf"), dtype=torch.float32, device=query.device)
            denom = torch.zeros((b, hkv, n_rep, 1), dtype=torch.float32, device=query.device)
            acc = torch.zeros((b, hkv, n_rep, d), dtype=torch.float32, device=query.device)
        keep = None
        if ragged:
            keep = torch.arange(start, end, device=query.device)[None, :] < kv_len[:, None].to(query.device)
            k = torch.where(keep[:, None, :, None], k, 0)
            v = torch.where(keep[:, None, :, None], v, 0)
        s = torch.matmul(q, k.float().transpose(-1, -2)) * scale  # [B, H_kv, n_rep, n]
        if mask is not None:
            mc = mask[:, :, -1, start:end]  # [B|1, 1|H_q, n]
            mc = mc.unsqueeze(2) if mc.shape[1] == 1 else mc.reshape(mc.shape[0], hkv, n_rep, -1)
            s = s.masked_fill(~mc, float("-inf")) if mc.dtype == torch.bool else s + mc.float()
        if keep is not None:
            s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        denom = denom * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + torch.matmul(p, v.float())
        m = m_new
    if m is None:
        return torch.zeros_like(query)
    out = torch.where(denom > 0, acc / denom, torch.zeros_like(acc))
    return out.reshape(b, hq, d).to(query.dtype)


def compressed_chunks(slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len_list, format_version=1):
    """`chunks(start, end)` over a compressed layer: finalized blocks decoded from the table, each row's tail placed
    after its own finalized blocks."""
    b, _, _, h, t = table.shape
    c = raw_pool.shape[-1]
    p = 2 * h * t
    b3, b4 = base3.reshape(p, c), base4.reshape(p, c)
    n_fin = [n // BLOCK_TOKENS for n in kv_len_list]

    def chunks(start: int, end: int):
        b0, b1 = start // BLOCK_TOKENS, -(-end // BLOCK_TOKENS)
        tiles = expand_tiles(table[:, b0:b1].reshape(b, b1 - b0, p), slot_pool, raw_pool, b3, b4, format_version)
        kv = blocks_of(tiles, h)  # [B, 2, H, (b1 - b0) * 16, D]
        for row, nf in enumerate(n_fin):
            if b0 <= nf < b1:
                at = (nf - b0) * BLOCK_TOKENS
                n = min(tail_k.shape[2], BLOCK_TOKENS)
                kv[row, 0, :, at:at + n] = tail_k[row, :, :n]
                kv[row, 1, :, at:at + n] = tail_v[row, :, :n]
        kv = kv[:, :, :, :end - start]
        return kv[:, 0], kv[:, 1]

    return chunks


def mask4(mask: torch.Tensor | None) -> torch.Tensor | None:
    """A decode op's bool mask `[B, S]` as `reference_attention` takes it, `[B, 1, 1, S]` (None stays None)."""
    return None if mask is None else mask[:, None, None, :]
