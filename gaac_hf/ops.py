"""The kernels behind the GAAC caches, one entry point per job, the backend chosen per device in `backend_of`.

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

import functools
import os
from dataclasses import dataclass

import torch

from . import format_v2
from .codec import encode_tiles
from .cpu_decode import expand_into
from .format import BLOCK_TOKENS, TileLayout, tile_split

try:  # the CUDA C++ kernels (a separate package); absent: Triton on CUDA
    import gaac_cuda
except ImportError:
    gaac_cuda = None

# Slot layouts, made once per shape (the eager step asks per layer): by escape capacity, by a pool's row size.
_tile_layout = functools.lru_cache(maxsize=None)(TileLayout)
_slot_layout = functools.lru_cache(maxsize=None)(TileLayout.of_slot_bytes)

# Tokens per step of the torch reference's online softmax (part of its math: compressed and plain KV both use it).
REFERENCE_CHUNK_TOKENS = 512


def backend_of(device: torch.device) -> str:
    """`"gaac_cuda"`, `"triton"` or `"torch"`: which kernels serve tensors on `device`. The one place that decides.

    `GAAC_HF_BACKEND=triton` runs the Triton kernels on CPU tensors too (under `TRITON_INTERPRET=1`: the tests
    check the CUDA path's ops end to end that way)."""
    device = torch.device(device)
    forced = os.environ.get("GAAC_HF_BACKEND")
    if forced:
        if forced not in ("torch", "triton", "gaac_cuda"):
            raise ValueError(f"GAAC_HF_BACKEND must be torch, triton or gaac_cuda, not {forced!r}")
        return forced
    if device.type != "cuda":
        return "torch"
    return _cuda_backend(str(device), os.environ.get("GAAC_HF_CUDA_KERNEL"))


@functools.lru_cache(maxsize=None)
def _cuda_backend(device: str, kernel_switch: str | None) -> str:
    """The CUDA device's backend, asked once per device and `GAAC_HF_CUDA_KERNEL` value (an eager step asks per
    layer; the capability and NVRTC lookups cost more than the rest of the decision)."""
    return "gaac_cuda" if gaac_cuda is not None and gaac_cuda.available(device) else "triton"


# --- plan --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodePlan:
    """Launch decisions for one shape, made once (at cache construction), not per step."""

    batch: int
    kv_heads: int
    max_blocks: int
    head_dim: int
    device: str
    splits: int


def splits(batch: int, kv_heads: int, max_blocks: int, device, head_dim: int = 128) -> int:
    """Split count of the decode attention over at most `max_blocks` blocks (1 for the torch reference); cached
    (an eager decode step asks once per layer)."""
    device = torch.device(device)
    return _splits(int(batch), int(kv_heads), int(max_blocks), str(device), int(head_dim), backend_of(device))


@functools.lru_cache(maxsize=4096)
def _splits(batch: int, kv_heads: int, max_blocks: int, device: str, head_dim: int, backend: str) -> int:
    device = torch.device(device)
    if not fused_serves(head_dim):
        return 1
    if backend == "gaac_cuda":  # the CUDA kernel's split count depends on the shape alone (host arithmetic)
        return gaac_cuda.plan(batch, kv_heads, 1, head_dim, max_blocks * BLOCK_TOKENS, device, plain=True).nsplit
    if backend == "triton":
        from triton_ops.gaac_attention import num_splits

        return num_splits(batch * kv_heads, max_blocks, device)
    return 1


_LENGTHS: dict = {}  # the last (batch, length, device) of `device_lengths` and its tensor


def device_lengths(batch: int, length: int, device) -> torch.Tensor:
    """int32 `[batch]` filled with `length` on `device`, for the kernels to read (never written): the layers of one
    eager decode step share one (one allocation and fill per step instead of per layer). Inside a CUDA graph capture
    a fresh one each time (a kept tensor would be freed under the graph, a captured one belongs to it)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # neither kept nor reused in a capture
        return torch.full((batch,), length, dtype=torch.int32, device=device)
    key = (batch, length, str(device))
    t = _LENGTHS.get(key)
    if t is None:
        _LENGTHS.clear()
        t = _LENGTHS[key] = torch.full((batch,), length, dtype=torch.int32, device=device)
    return t


@functools.lru_cache(maxsize=None)
def _plan(batch: int, kv_heads: int, max_blocks: int, head_dim: int, device: str) -> DecodePlan:
    return DecodePlan(batch, kv_heads, max_blocks, head_dim, device,
                      splits(batch, kv_heads, max_blocks, device, head_dim))


def plan(batch: int, kv_heads: int, max_blocks: int, head_dim: int, device) -> DecodePlan:
    """The `DecodePlan` of a shape (cached: the same shape always gets the same plan)."""
    return _plan(int(batch), int(kv_heads), int(max_blocks), int(head_dim), str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def _cuda_plan(batch, kv_heads, rep, head_dim, max_blocks, slot_bytes, plain, nsplit, device, format_version=1):
    # format version 2 as stored (fragment order) is what the kernel calls its format 3
    return gaac_cuda.plan(batch, kv_heads, rep, head_dim, max_blocks * BLOCK_TOKENS, torch.device(device),
                          slot_bytes=slot_bytes, plain=plain, nsplit=nsplit,
                          format_version=3 if format_version == 2 else 1)


FUSED_HEAD_DIMS = (64, 128, 256)  # what the fused kernels (CUDA, Triton) cover; other head dims use the reference


def fused_serves(head_dim: int) -> bool:
    """The fused decode kernels cover this head dim (one 64- or 128-channel tile per head, or two of 128). Other
    multiples of 16 (Phi-2's 80, Phi-3-mini's 96, ...) take the torch reference attention over tiles decoded by the
    expand kernel: bit-exact the same way (compressed and plain KV through the same code), but eager only on CUDA
    (it reads the lengths on the host, so a CUDA graph cannot capture it)."""
    return head_dim in FUSED_HEAD_DIMS


# Format version 2 (docs/format.md): the CUDA kernel reads it at these head dims (one 64- or 128-channel tile in
# fragment order); the Triton attention kernels read version 1 only, and the torch reference reads both.
CUDA_V2_HEAD_DIMS = (64, 128)


def _cuda_serves(query: torch.Tensor, kv_heads: int, format_version: int = 1) -> bool:
    """The CUDA kernel covers this shape (at most 8 query heads per kv-head, head_dim 64/128/256; format version 2:
    64/128); else Triton (format version 1) or the torch reference."""
    return query.shape[1] // kv_heads <= gaac_cuda.MAX_GROUP_HEADS and fused_serves(query.shape[-1]) and (
        format_version == 1 or query.shape[-1] in CUDA_V2_HEAD_DIMS)


def fused_reads(format_version: int, head_dim: int, group_heads: int, device) -> bool:
    """A fused kernel (capturable, no host synchronization) reads this storage on `device`: what a static cache
    needs, and what `GAACCache`'s choice of format version asks before it picks version 2."""
    if not fused_serves(head_dim):
        return False
    backend = backend_of(device)
    if format_version == 1:
        return backend != "torch"
    return (backend == "gaac_cuda" and head_dim in CUDA_V2_HEAD_DIMS and group_heads <= gaac_cuda.MAX_GROUP_HEADS)


# --- tiles -------------------------------------------------------------------------------------------------------
def encode(tiles: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, capacity: int, format_version: int = 1):
    """BF16 tiles `[..., P, 16, C]` (positions: K tiles, then V tiles), bases uint8 `[P, C]` -> `(slots [..., P,
    slot_bytes], fits [..., P], mode counts int32 [..., P, 3])`, in format version `format_version` (2: the bases
    are even windows, the caller's check)."""
    c = tiles.shape[-1]
    if tiles.is_cuda:
        from triton_ops.gaac_encode import gaac_encode

        frag = format_v2.fragment_map(c, tiles.device) if format_version == 2 else None
        slots, esc, counts = gaac_encode(tiles, base3, base4, _tile_layout(c, capacity), format_version, frag)
        return slots, esc <= capacity, counts
    if format_version == 2:
        slots, fits, modes = format_v2.encode_kv(tiles, base3, base4, capacity)
        counts = torch.stack([(modes == m).sum(-1, dtype=torch.int32) for m in range(3)], -1)
        return slots, fits, counts
    enc = encode_tiles(tiles, base3, base4, capacity)
    counts = torch.stack([(enc.modes == m).sum(-1, dtype=torch.int32) for m in range(3)], -1)
    return enc.slots, enc.fits, counts


def expand_tiles(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
                 base4: torch.Tensor, format_version: int = 1) -> torch.Tensor:
    """Entries `[..., P]` (slot >= 0, else -1 - raw; positions: K tiles, then V tiles) with bases uint8 `[P, C]` ->
    BF16 tiles `[..., P, 16, C]`."""
    channels = raw_pool.shape[-1]
    if format_version == 2:
        return _expand_tiles_v2(table, slot_pool, raw_pool, base3, base4)
    if table.is_cuda:
        from triton_ops.gaac_decode import expand_tiles as triton_expand_tiles

        return triton_expand_tiles(table, slot_pool, raw_pool, base3, base4,
                                   _slot_layout(channels, slot_pool.shape[-1]))
    lead, p = table.shape[:-1], table.shape[-1]
    n = table.numel() // max(p, 1)
    out = torch.empty(*lead, p, BLOCK_TOKENS, channels, dtype=raw_pool.dtype)
    expand_into(table.reshape(1, n, 1, 1, p), slot_pool, raw_pool, base3, base4,
                out.view(1, n, 1, 1, p, BLOCK_TOKENS, channels))
    return out


def _expand_tiles_v2(table, slot_pool, raw_pool, base3, base4) -> torch.Tensor:
    """`expand_tiles` of format version 2: the Triton kernel on CUDA, else the torch reference decoder
    (`format_v2.decode_slots`; the CPU path reads version 2 only where a user forces it)."""
    lead, p = table.shape[:-1], table.shape[-1]
    c = raw_pool.shape[-1]
    if table.is_cuda:
        from triton_ops.gaac_decode import expand_tiles_v2

        return expand_tiles_v2(table, slot_pool, raw_pool, base3, base4, _slot_layout(c, slot_pool.shape[-1]),
                               format_v2.fragment_map(c, table.device))
    flat = table.reshape(-1).long()
    pos = torch.arange(flat.numel(), device=flat.device) % max(p, 1)
    out = torch.empty(flat.numel(), BLOCK_TOKENS, c, dtype=raw_pool.dtype, device=raw_pool.device)
    fit = flat >= 0
    at, raw_at = fit.nonzero().reshape(-1), (~fit).nonzero().reshape(-1)
    if at.numel():
        where = pos[at]
        out[at] = format_v2.decode_slots(slot_pool[flat[at]], where >= p // 2, base3[where], base4[where], c)
    if raw_at.numel():
        out[raw_at] = raw_pool[-1 - flat[raw_at]]
    return out.reshape(*lead, p, BLOCK_TOKENS, c)


def expand_kv(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
              base4: torch.Tensor, tail_k: torch.Tensor | None = None,
              tail_v: torch.Tensor | None = None, format_version: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries `[B, n, 2, H, tiles]` with bases uint8 `[2 * H * tiles, C]` (then the BF16 tails `[B, H, s, D]`, if
    given) -> contiguous K, V `[B, H, n * 16 + s, D]`.

    On the CPU the decoder writes every tile straight to its place in one `[2, B, H, S, D]` buffer, whose halves are
    K and V (no `blocks_of` permute, no concatenation with the tail)."""
    b, n, _, h, t = table.shape
    c = raw_pool.shape[-1]
    if table.is_cuda or format_version == 2:
        kv = blocks_of(expand_tiles(table.reshape(b, n, 2 * h * t), slot_pool, raw_pool, base3, base4,
                                    format_version), h)
        if tail_k is None:
            return kv[:, 0], kv[:, 1]
        return torch.cat([kv[:, 0], tail_k], -2), torch.cat([kv[:, 1], tail_v], -2)
    s = 0 if tail_k is None else tail_k.shape[2]
    length, d = n * BLOCK_TOKENS + s, t * c
    buf = torch.empty(2, b, h, length, d, dtype=raw_pool.dtype)
    out = buf.as_strided((b, n, 2, h, t, BLOCK_TOKENS, c),
                         (h * length * d, BLOCK_TOKENS * d, b * h * length * d, length * d, c, d, 1))
    expand_into(table, slot_pool, raw_pool, base3, base4, out)
    if s:
        buf[0, :, :, n * BLOCK_TOKENS:] = tail_k
        buf[1, :, :, n * BLOCK_TOKENS:] = tail_v
    return buf[0], buf[1]


def tiles_of(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K, V `[B, H, n * 16, D]` -> tiles `[B, n, 2 * H * tiles, 16, C]` (position order of the block table)."""
    b, h, s, d = k.shape
    c = tile_split(d)[1]
    x = torch.stack([k, v], 1).reshape(b, 2, h, s // BLOCK_TOKENS, BLOCK_TOKENS, d // c, c)
    return x.permute(0, 3, 1, 2, 5, 4, 6).reshape(b, s // BLOCK_TOKENS, 2 * h * (d // c), BLOCK_TOKENS, c)


def blocks_of(tiles: torch.Tensor, heads: int) -> torch.Tensor:
    """Inverse of `tiles_of`: `[B, n, 2 * H * tiles, 16, C]` -> KV `[B, 2, H, n * 16, D]`."""
    b, n, p, _, c = tiles.shape
    t = p // (2 * heads)
    x = tiles.reshape(b, n, 2, heads, t, BLOCK_TOKENS, c).permute(0, 2, 3, 1, 5, 4, 6)
    return x.reshape(b, 2, heads, n * BLOCK_TOKENS, t * c)


# --- the torch reference of the decode-step attention -------------------------------------------------------------
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


def _compressed_chunks(slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len_list, format_version=1):
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


def _mask4(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None else mask[:, None, None, :]


# --- custom ops ----------------------------------------------------------------------------------------------------
# Each op's body is a plain function too: eager callers (GAACCache) skip the dispatcher's per-call cost.
def _decode_attention_impl(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len, mask, scale,
                           num_splits, format_version=1):
    backend = backend_of(query.device)
    if not fused_serves(query.shape[-1]):
        backend = "torch"
    if backend == "gaac_cuda" and _cuda_serves(query, table.shape[3], format_version):
        b, hq, d = query.shape
        h = table.shape[3]
        channels = raw_pool.shape[-1]
        layout = _slot_layout(channels, slot_pool.shape[-1])
        plan_ = _cuda_plan(b, h, hq // h, d, table.shape[1], layout.slot_bytes, False, num_splits, str(query.device),
                           format_version)
        return gaac_cuda.decode_attention(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, kv_len,
                                          mask, scale, layout, plan_)
    if backend in ("triton", "gaac_cuda") and format_version == 1:
        from triton_ops.gaac_attention import fused_compressed_attention

        layout = _slot_layout(raw_pool.shape[-1], slot_pool.shape[-1])
        return fused_compressed_attention(query, slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, scale,
                                          layout, mask, kv_len=kv_len, num_splits=num_splits)
    lens = kv_len.tolist()
    chunks = _compressed_chunks(slot_pool, raw_pool, table, tail_k, tail_v, base3, base4, lens, format_version)
    return reference_attention(query, chunks, max(lens), scale, _mask4(mask), kv_len)


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
    if backend == "gaac_cuda" and _cuda_serves(query, key.shape[1]):
        b, h, s, d = key.shape
        plan_ = _cuda_plan(b, h, query.shape[1] // h, d, s // BLOCK_TOKENS, 0, True, num_splits, str(query.device))
        return gaac_cuda.plain_decode_attention(query, key, value, kv_len, mask, scale, plan_)
    if backend in ("triton", "gaac_cuda"):
        from triton_ops.gaac_attention import fused_plain_attention

        layout = _tile_layout(tile_split(key.shape[-1])[1], 0)  # no slot is read; its offsets: the same binary
        return fused_plain_attention(query, key, value, scale, layout, mask, kv_len=kv_len, table=table,
                                     num_splits=num_splits)
    lens = kv_len.tolist()
    return reference_attention(query, lambda s, e: (key[:, :, s:e], value[:, :, s:e]), max(lens), scale,
                               _mask4(mask), kv_len)


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


# --- the static layer's decode-step update -------------------------------------------------------------------------
def store_blocks(tiles: torch.Tensor, rows: torch.Tensor, first_block: torch.Tensor, base3, base4, capacity: int,
                 slot_pool, raw_pool, table, slot_modes, raw_modes, counts, format_version: int = 1) -> None:
    """Encode complete blocks and store them (eager): `encode`, then `place_blocks`."""
    slots, fits, modes = encode(tiles, base3, base4, capacity, format_version)
    place_blocks(slots, fits, modes, tiles, rows, first_block, slot_pool, raw_pool, table, slot_modes, raw_modes,
                 counts)


def place_blocks(slots, fits, modes, tiles: torch.Tensor, rows: torch.Tensor, first_block: torch.Tensor, slot_pool,
                 raw_pool, table, slot_modes, raw_modes, counts) -> None:
    """Store encoded blocks (eager; one host synchronization sizes the allocation).

    `tiles` `[R, n, P, 16, C]` of rows `rows` (long `[R]`), blocks `first_block[r] ..+ n`, with their `encode`
    output; the pools' last rows are scratch; `counts` int32 `[2]` (slots, raw tiles taken) is advanced; a counter
    past its pool's capacity (the caller grows the pools first, so only a caller's bug gets there) sends tiles to
    the scratch row."""
    r, n, p, _, c = tiles.shape
    fits = fits.reshape(-1)
    used = counts.tolist()
    n_fit = int(fits.sum())
    slot_at = used[0] + torch.cumsum(fits, 0) - 1
    raw_at = used[1] + torch.cumsum(~fits, 0) - 1
    slot_at = torch.where(fits & (slot_at < slot_pool.shape[0] - 1), slot_at, slot_pool.shape[0] - 1)
    raw_at = torch.where(~fits & (raw_at < raw_pool.shape[0] - 1), raw_at, raw_pool.shape[0] - 1)
    modes = modes.reshape(-1, 3)
    slot_pool.index_copy_(0, slot_at, slots.reshape(-1, slots.shape[-1]))
    slot_modes.index_copy_(0, slot_at, modes)
    raw_pool.index_copy_(0, raw_at, tiles.reshape(-1, BLOCK_TOKENS, c))
    raw_modes.index_copy_(0, raw_at, modes)
    entries = torch.where(fits, slot_at, -1 - raw_at).to(torch.int32).reshape(r, n, *table.shape[2:])
    blocks = first_block.reshape(r, 1) + torch.arange(n, device=tiles.device)
    table[rows.reshape(r, 1), blocks] = entries
    counts += torch.tensor([n_fit, fits.numel() - n_fit], dtype=counts.dtype, device=counts.device)


@torch.library.custom_op("gaac::append_token",
                         mutates_args=("tail_k", "tail_v", "kv_len", "slot_pool", "raw_pool", "table", "slot_modes",
                                       "raw_modes", "counts"))
def _append_token_op(key: torch.Tensor, value: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
                     kv_len: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, slot_pool: torch.Tensor,
                     raw_pool: torch.Tensor, table: torch.Tensor, slot_modes: torch.Tensor, raw_modes: torch.Tensor,
                     counts: torch.Tensor, format_version: int) -> None:
    c = raw_pool.shape[-1]
    p = base3.numel() // c
    layout = _slot_layout(c, slot_pool.shape[-1])
    if backend_of(key.device) != "torch":
        from triton_ops.gaac_append import gaac_append

        frag = format_v2.fragment_map(c, key.device) if format_version == 2 else None
        gaac_append(key, value, tail_k, tail_v, kv_len, base3.reshape(p, c), base4.reshape(p, c), slot_pool,
                    raw_pool, table, slot_modes, raw_modes, counts, layout, format_version, frag)
        kv_len.add_(1)
        return
    rows = torch.arange(key.shape[0], device=key.device)
    pos = (kv_len % BLOCK_TOKENS).long()
    tail_k[rows, :, pos] = key[:, :, 0]
    tail_v[rows, :, pos] = value[:, :, 0]
    kv_len.add_(1)
    done = (kv_len % BLOCK_TOKENS == 0).nonzero().reshape(-1)
    if done.numel():  # on the CPU a branch costs nothing; the CUDA kernel runs every step instead
        tiles = tiles_of(tail_k[done], tail_v[done])  # [R, 1, P, 16, C]
        store_blocks(tiles, done, (kv_len[done] // BLOCK_TOKENS - 1).long(), base3.reshape(p, c),
                     base4.reshape(p, c), layout.escape_capacity, slot_pool, raw_pool, table, slot_modes, raw_modes,
                     counts, format_version)


@_append_token_op.register_fake
def _(key, value, tail_k, tail_v, kv_len, base3, base4, slot_pool, raw_pool, table, slot_modes, raw_modes, counts,
      format_version):
    return None


def append_token(key: torch.Tensor, value: torch.Tensor, record: DecodeRecord, slot_modes: torch.Tensor,
                 raw_modes: torch.Tensor, counts: torch.Tensor) -> None:
    """One token per row (`[B, H, 1, D]`) into a static compressed layer, finalizing completed blocks in place."""
    r = record
    torch.ops.gaac.append_token(key, value, r.tail_k, r.tail_v, r.kv_len, r.base3, r.base4, r.slot_pool, r.raw_pool,
                                r.table, slot_modes, raw_modes, counts, r.format_version)


@torch.library.custom_op("gaac::plain_append_token", mutates_args=("keys", "values", "kv_len"))
def _plain_append_token_op(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           kv_len: torch.Tensor) -> None:
    if backend_of(key.device) != "torch":
        from triton_ops.gaac_append import plain_append

        plain_append(key, value, keys, values, kv_len)
        kv_len.add_(1)
        return
    rows = torch.arange(key.shape[0], device=key.device)
    pos = kv_len.long().clamp(max=keys.shape[2] - 1)  # past the buffer: the last row (the cache's check raises)
    keys[rows, :, pos] = key[:, :, 0]
    values[rows, :, pos] = value[:, :, 0]
    kv_len.add_(1)


@_plain_append_token_op.register_fake
def _(key, value, keys, values, kv_len):
    return None


def plain_append_token(key: torch.Tensor, value: torch.Tensor, record: PlainRecord) -> None:
    """One token per row (`[B, H, 1, D]`) into a static plain layer: the twin of `append_token`, an opaque op with
    the same model-side inputs (the new key and value states, first) and the same in-place writes of the layer's
    buffers and lengths, so a compiler treats the code that produces them alike in both caches."""
    torch.ops.gaac.plain_append_token(key, value, record.key, record.value, record.kv_len)
