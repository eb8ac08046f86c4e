"""Append one decode token to a static GAAC layer and finalize the blocks it completes, with no host involvement;
and the plain twin's append (`plain_append`: the token written into plain BF16 buffers, one launch too).

One program per tile position (row, K|V, kv-head, tile). Each writes its slice of the new token into the BF16 tail
`[B, H, 16, D]` at row `kv_len[b] % 16`; where that token completes the block (`(kv_len[b] + 1) % 16 == 0`) it
encodes the tile (same code as `gaac_encode`, bit-exact to the torch reference), takes a slot or a raw tile from the
pool counters with an atomic add, stores it there and writes the block-table entry. Programs of rows whose block did
not complete return after the tail write, so the kernel runs every step and its cost is one launch.

Counters `counts` int32 `[2]`: slots and raw tiles taken. A counter that passes its pool's capacity means tiles were
dropped (written to the pool's scratch row): the cache checks for that outside the captured graph and raises.
"""

import torch
import triton
import triton.language as tl

from .device import on_device_of
from .gaac_encode import check_fragment, mode_counts, store_slot, tile_modes
from .layout import slot_constants


@triton.jit
def _append_kernel(k_ptr, v_ptr, tk_ptr, tv_ptr, len_ptr, b3_ptr, b4_ptr, slot_ptr, raw_ptr, table_ptr,
                   slot_modes_ptr, raw_modes_ptr, count_ptr, frag_ptr,
                   s_kb, s_kh, s_vb, s_vh, s_tb, s_th, s_tt, H, NB_CAP, N_SLOTS, N_RAW, SLOT_BYTES, CAPACITY,
                   C: tl.constexpr, TILES: tl.constexpr, E_PAD: tl.constexpr, PLANES: tl.constexpr,
                   TAGS: tl.constexpr, ESC: tl.constexpr, VERSION: tl.constexpr, FRAGMENT: tl.constexpr):
    pid = tl.program_id(0)
    tile = pid % TILES
    h = (pid // TILES) % H
    kv = (pid // (TILES * H)) % 2
    b = pid // (TILES * H * 2)
    c = tl.arange(0, C)
    length = tl.load(len_ptr + b)
    pos = length % 16
    col = tile * C + c
    if kv == 0:
        new = tl.load(k_ptr + b.to(tl.int64) * s_kb + h * s_kh + col)
        tail = tk_ptr + b.to(tl.int64) * s_tb + h * s_th
    else:
        new = tl.load(v_ptr + b.to(tl.int64) * s_vb + h * s_vh + col)
        tail = tv_ptr + b.to(tl.int64) * s_tb + h * s_th
    tl.store(tail + pos * s_tt + col, new)
    block = (length + 1) // 16 - 1
    if ((length + 1) % 16 == 0) & (block < NB_CAP):
        tl.debug_barrier()  # the new row lands before the tile is read back
        t = tl.arange(0, 16)
        x = tl.load(tail + t[:, None] * s_tt + col[None, :])
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        kind = (kv * H + h) * TILES + tile
        b3 = tl.load(b3_ptr + kind * C + c).to(tl.int32)
        b4 = tl.load(b4_ptr + kind * C + c).to(tl.int32)
        sm, code, mode, total = tile_modes(bits, b3, b4, C, VERSION)
        m = tl.arange(0, 4)
        counts = mode_counts(mode)
        if total <= CAPACITY:
            idx = tl.atomic_add(count_ptr, 1)
            idx = tl.where(idx < N_SLOTS, idx, N_SLOTS)  # past the pool: the scratch row (the counter tells)
            store_slot(slot_ptr + idx.to(tl.int64) * SLOT_BYTES, sm, code, mode, CAPACITY, C, E_PAD, PLANES, TAGS,
                       ESC, frag_ptr + kv * 96 * C, FRAGMENT, VERSION)
            tl.store(slot_modes_ptr + idx * 3 + m, counts, mask=m < 3)
            entry = idx
        else:
            idx = tl.atomic_add(count_ptr + 1, 1)
            idx = tl.where(idx < N_RAW, idx, N_RAW)
            tl.store(raw_ptr + idx.to(tl.int64) * 16 * C + t[:, None] * C + c[None, :], x)
            tl.store(raw_modes_ptr + idx * 3 + m, counts, mask=m < 3)
            entry = -1 - idx
        at = ((b.to(tl.int64) * NB_CAP + block) * 2 + kv) * H * TILES + h * TILES + tile
        tl.store(table_ptr + at, entry)


def gaac_append(key: torch.Tensor, value: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor,
                kv_len: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, slot_pool: torch.Tensor,
                raw_pool: torch.Tensor, table: torch.Tensor, slot_modes: torch.Tensor, raw_modes: torch.Tensor,
                counts: torch.Tensor, layout, format_version: int = 1, fragment: torch.Tensor | None = None,
                num_warps: int = 4) -> None:
    """Append `key`/`value` `[B, H, 1, D]` (BF16, last dim contiguous) at `kv_len` and finalize completed blocks.
    `format_version` and `fragment`: the slots `gaac_encode` writes with them. `num_warps`: per program (one tile).

    tail_k/v BF16 `[B, H, 16, D]`; kv_len int32 `[B]` (not advanced here); base3/base4 uint8 `[2 * H * tiles, C]`;
    slot_pool uint8 `[N_slots + 1, slot_bytes]` and raw_pool BF16 `[N_raw + 1, 16, C]` (last rows: scratch);
    table int32 `[B, NB_cap, 2, H, tiles]`, contiguous; slot_modes/raw_modes int32 `[N + 1, 3]`; counts int32 `[2]`;
    layout: the slot layout (a `gaac_hf.format.TileLayout`, see `triton_ops.layout`).
    """
    b, h, q, d = key.shape
    if q != 1 or key.stride(-1) != 1 or value.stride(-1) != 1 or tail_k.stride() != tail_v.stride():
        raise ValueError("gaac_append takes one token per row, last dim contiguous, and equal tail strides")
    channels = raw_pool.shape[-1]
    tiles = d // channels
    offsets = slot_constants(layout, channels, slot_pool.shape[-1])
    capacity = layout.escape_capacity
    frag = check_fragment(fragment, channels, key.device, format_version)
    with on_device_of(key):
        _append_kernel[(b * 2 * h * tiles,)](
            key, value, tail_k, tail_v, kv_len, base3, base4, slot_pool, raw_pool, table, slot_modes, raw_modes,
            counts, frag, key.stride(0), key.stride(1), value.stride(0), value.stride(1), tail_k.stride(0),
            tail_k.stride(1), tail_k.stride(2), h, table.shape[1], slot_pool.shape[0] - 1, raw_pool.shape[0] - 1,
            slot_pool.shape[-1], capacity, C=channels, TILES=tiles,
            E_PAD=max(16, triton.next_power_of_2(max(capacity, 1))), VERSION=format_version,
            FRAGMENT=fragment is not None, num_warps=num_warps, **offsets)


@triton.jit
def _plain_append_kernel(k_ptr, v_ptr, keys_ptr, values_ptr, len_ptr, s_kb, s_kh, s_vb, s_vh, s_cb, s_ch, s_ct, H,
                         S_CAP, D, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    h = pid % H
    kv = (pid // H) % 2
    b = pid // (H * 2)
    d = tl.arange(0, BLOCK_D)
    pos = tl.minimum(tl.load(len_ptr + b), S_CAP - 1)  # past the buffer: the last row (the cache's check raises)
    at = b.to(tl.int64) * s_cb + h * s_ch + pos.to(tl.int64) * s_ct + d
    if kv == 0:
        new = tl.load(k_ptr + b.to(tl.int64) * s_kb + h * s_kh + d, mask=d < D)
        tl.store(keys_ptr + at, new, mask=d < D)
    else:
        new = tl.load(v_ptr + b.to(tl.int64) * s_vb + h * s_vh + d, mask=d < D)
        tl.store(values_ptr + at, new, mask=d < D)


def plain_append(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 kv_len: torch.Tensor) -> None:
    """Write `key`/`value` `[B, H, 1, D]` (last dim contiguous) into plain KV buffers `keys`/`values` `[B, H, S, D]`
    (equal strides, last dim contiguous) at row `kv_len[b]` of each row b (int32 `[B]`, not advanced here): the
    plain twin's decode-step update, one launch like `gaac_append`'s."""
    b, h, q, d = key.shape
    if q != 1 or key.stride(-1) != 1 or value.stride(-1) != 1 or keys.stride() != values.stride() or \
            keys.stride(-1) != 1:
        raise ValueError("plain_append takes one token per row, last dims contiguous, and equal buffer strides")
    with on_device_of(key):
        _plain_append_kernel[(b * 2 * h,)](
            key, value, keys, values, kv_len, key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            keys.stride(0), keys.stride(1), keys.stride(2), h, keys.shape[2], d,
            BLOCK_D=triton.next_power_of_2(d))
