"""The static layers' decode-step update: `append_token` (`gaac::append_token`: one token into a compressed layer,
finalizing the blocks it completes, with no host synchronization) and its plain twin `plain_append_token`; and the
eager block store (`store_blocks` / `place_blocks`)."""

from __future__ import annotations

import torch

from . import format_v2
from .attention_ops import DecodeRecord, PlainRecord
from .backends import backend_of, slot_layout
from .format import BLOCK_TOKENS
from .tile_ops import encode, tiles_of


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
    layout = slot_layout(c, slot_pool.shape[-1])
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
