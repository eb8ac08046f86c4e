"""The recovery window of a decode step and its features, from the logits in two kernels (DGAP's per-step features,
defined in `dgap_hf/features.py`; this file only knows their order).

1. `_vocab_pass_kernel`, one program per (row, slice of `BLOCK` logits), one read of the logits: the slice's max
   `m`, `sum exp(z - m)`, `sum exp(z - m) (z - m)` (for the entropy), the sum of `exp(z - m)` over the slice minus
   its own top K, and the slice's top K as sortable int64 keys (the float's order-preserving integer in the high
   word, `2^31 - 1 - token` in the low word: one max per selection round, and among equal logits the lowest token
   index wins, a deterministic order where `torch.topk` leaves it open).
2. `_window_kernel`, one program per row: merges the slices (log-partition `lse`, entropy, the tail mass outside the
   window, for renormalizing log-probability rows later), selects the global top K among the slices' candidates
   (the window, sorted descending) and writes the feature row `[phi | xi_1 .. xi_K | phi]` of
   `dgap_hf.fused_features` (phi: 18 detector features, xi: 11 per candidate, in `features.py`'s order).

Agreement with the torch features: the same formulas, but the log-partition and entropy are sums in another order
(per slice, then merged; the entropy as `log S - T / S`), so values agree within float32 rounding, not bit for bit.
"""

import math

import torch
import triton
import triton.language as tl

from .device import on_device_of

NO_KEY = tl.constexpr(-9223372036854775808)  # below the key of every logit (negative NaNs aside)
NEG_MAX = tl.constexpr(-3.4028234663852886e38)  # float32 min: log 0 clamped here, so 0 * log 0 is 0
N_PHI = 18
N_XI = 11


@triton.jit
def _sortable_key(z, token):
    bits = z.to(tl.int32, bitcast=True)
    return ((tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)).to(tl.int64) << 32) | (2147483647 - token).to(tl.int64)


@triton.jit
def _key_value(key):
    hi = (key >> 32).to(tl.int32)
    return tl.where(hi >= 0, hi, hi ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _key_token(key):
    hi = (key >> 32).to(tl.int32)
    return 2147483647 - (key - (hi.to(tl.int64) << 32))


@triton.jit
def _vocab_pass_kernel(s_ptr, s_stride, V, part_ptr, key_ptr, P, K, BK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    p = tl.program_id(1)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    z = tl.load(s_ptr + row.to(tl.int64) * s_stride + offs, mask=inside, other=float("-inf")).to(tl.float32)
    m = tl.max(z, 0)
    d = z - tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp(d)
    key = tl.where(inside, _sortable_key(z, offs), NO_KEY)
    at = row * P + p
    e_rest = e
    for j in range(K):
        top = tl.max(key, 0)
        tl.store(key_ptr + at * BK + j, top)
        hit = key == top
        key = tl.where(hit, NO_KEY, key)
        e_rest = tl.where(hit, 0.0, e_rest)
    tl.store(part_ptr + at * 4, m)
    tl.store(part_ptr + at * 4 + 1, tl.sum(e, 0))
    tl.store(part_ptr + at * 4 + 2, tl.sum(tl.where(e > 0, e * d, 0.0), 0))
    tl.store(part_ptr + at * 4 + 3, tl.sum(e_rest, 0))


@triton.jit
def _finite(x, floor):
    """`torch.nan_to_num(x, nan=0, posinf=floor, neginf=-floor)`."""
    x = tl.where(x != x, 0.0, x)
    x = tl.where(x == float("inf"), floor, x)
    return tl.where(x == float("-inf"), -floor, x)


@triton.jit
def _window_kernel(part_ptr, key_ptr, row_ptr, win_ptr, tok_ptr, stat_ptr, P, K, F, log_vocab, log_k, floor,
                   near_top, tail_floor, BP: tl.constexpr, BK: tl.constexpr):
    row = tl.program_id(0)
    # --- the slices merged: lse, entropy, the mass outside the slices' candidates
    pp = tl.arange(0, BP)
    pm = pp < P
    pb = part_ptr + (row * P + pp) * 4
    m_p = tl.load(pb, mask=pm, other=float("-inf"))
    s_p = tl.load(pb + 1, mask=pm, other=0.0)
    t_p = tl.load(pb + 2, mask=pm, other=0.0)
    r_p = tl.load(pb + 3, mask=pm, other=0.0)
    top_m = tl.max(m_p, 0)
    dm = tl.where(m_p != float("-inf"), m_p - top_m, 0.0)
    scale = tl.where(m_p != float("-inf"), tl.exp(dm), 0.0)  # a slice far below the top (s_p dm = -inf) weighs 0
    total = tl.sum(s_p * scale, 0)
    log_total = tl.log(total)
    lse = top_m + log_total
    entropy = log_total - tl.sum(tl.where(scale > 0, scale * (t_p + s_p * dm), 0.0), 0) / total
    rest = tl.sum(r_p * scale, 0)
    # --- the window: K rounds of a max over the slices' candidates
    cc = tl.arange(0, BP * BK)
    cm = (cc // BK < P) & (cc % BK < K)
    key = tl.load(key_ptr + row * P * BK + cc, mask=cm, other=NO_KEY)
    kk = tl.arange(0, BK)
    km = kk < K
    raw = tl.zeros([BK], tl.float32)
    raw_next = tl.zeros([BK], tl.float32)
    raw_prev = tl.zeros([BK], tl.float32)
    first = top_m
    last = top_m
    for j in range(K):
        top = tl.max(key, 0)
        key = tl.where(key == top, NO_KEY, key)
        val = _key_value(top)
        tl.store(tok_ptr + row * BK + j, _key_token(top))
        raw = tl.where(kk == j, val, raw)
        raw_next = tl.where(kk == j - 1, val, raw_next)
        raw_prev = tl.where(kk == j + 1, val, raw_prev)
        first = tl.where(j == 0, val, first)
        last = val
    left = key != NO_KEY  # candidates outside the window
    rest += tl.sum(tl.where(left, tl.exp(_key_value(key) - top_m), 0.0), 0)
    tl.store(win_ptr + row * BK + kk, raw, mask=km)
    tl.store(stat_ptr + row * 4, lse)
    tl.store(stat_ptr + row * 4 + 1, top_m)
    tl.store(stat_ptr + row * 4 + 2, rest)
    # --- features (features.py's definitions)
    lt = raw - lse
    p = tl.where(km, tl.exp(lt), 0.0)
    lo = first - floor
    v = tl.maximum(raw, lo)
    v0 = tl.maximum(first, lo)
    span = v0 - tl.maximum(last, lo)
    rel = v - v0
    margin_next = tl.where(kk < K - 1, v - tl.maximum(raw_next, lo), 0.0)
    margin_prev = tl.where(kk > 0, tl.maximum(raw_prev, lo) - v, 0.0)
    mass = tl.sum(p, 0)
    q = p / tl.maximum(mass, 1e-30)
    local_entropy = -tl.sum(tl.where(km, q * tl.maximum(tl.log(q), NEG_MAX), 0.0), 0)
    log_p = tl.maximum(lt, -floor)
    mean_v = tl.sum(tl.where(km, v, 0.0), 0) / K
    centered = v - mean_v
    phi = tl.zeros([32], tl.float32)
    ii = tl.arange(0, 32)
    phi = tl.where(ii == 0, entropy, phi)
    phi = tl.where(ii == 1, entropy / log_vocab, phi)
    phi = tl.where(ii == 2, tl.maximum(first - lse, -floor), phi)
    phi = tl.where(ii == 3, tl.sum(tl.where(kk == 0, p, 0.0), 0), phi)
    phi = tl.where(ii == 4, tl.sum(tl.where(kk < 4, p, 0.0), 0), phi)
    phi = tl.where(ii == 5, mass, phi)
    phi = tl.where(ii == 6, tl.log(tl.maximum(1 - mass, tail_floor)), phi)
    phi = tl.where(ii == 7, tl.sum(tl.where(kk == 0, margin_next, 0.0), 0), phi)
    phi = tl.where(ii == 8, tl.sum(tl.where(kk == 1, margin_next, 0.0), 0), phi)  # K = 2: the last margin, 0
    phi = tl.where(ii == 9, span, phi)
    phi = tl.where(ii == 10, span / (K - 1), phi)
    phi = tl.where(ii == 11, tl.min(tl.where(kk < K - 1, margin_next, float("inf")), 0), phi)
    phi = tl.where(ii == 12, tl.sum(tl.where(km & (rel > -near_top), 1.0, 0.0), 0) / K, phi)
    phi = tl.where(ii == 13, local_entropy, phi)
    phi = tl.where(ii == 14, local_entropy / log_k, phi)
    phi = tl.where(ii == 15, tl.sqrt(tl.sum(tl.where(km, centered * centered, 0.0), 0) / K), phi)
    phi = tl.where(ii == 16, tl.exp(local_entropy) / K, phi)
    phi = tl.where(ii == 17, tl.sum(q * q, 0), phi)
    phi = _finite(phi, floor)
    out = row_ptr + row * F
    tl.store(out + ii, phi, mask=ii < 18)
    tl.store(out + F - 18 + ii, phi, mask=ii < 18)
    rank = kk.to(tl.float32)
    ff = tl.arange(0, 16)[None, :]
    xi = tl.zeros([BK, 16], tl.float32)
    xi = tl.where(ff == 0, rel[:, None], xi)
    xi = tl.where(ff == 1, centered[:, None], xi)
    xi = tl.where(ff == 2, (rel / tl.maximum(span, 1e-6))[:, None], xi)
    xi = tl.where(ff == 3, (rank / (K - 1))[:, None], xi)
    xi = tl.where(ff == 4, (1.0 / (rank + 1))[:, None], xi)
    xi = tl.where(ff == 5, margin_prev[:, None], xi)
    xi = tl.where(ff == 6, margin_next[:, None], xi)
    xi = tl.where(ff == 7, log_p[:, None], xi)
    xi = tl.where(ff == 8, p[:, None], xi)
    xi = tl.where(ff == 9, q[:, None], xi)
    xi = tl.where(ff == 10, tl.cumsum(p, 0)[:, None], xi)
    xi = _finite(xi, floor)
    tl.store(out + 18 + kk[:, None] * 11 + ff, xi, mask=km[:, None] & (ff < 11))


def window_features(scores: torch.Tensor, k: int, floor: float, near_top_nats: float, tail_mass_floor: float,
                    block: int = 2048):
    """The window and features of logits `scores` `[N, V]` (float32 / bfloat16 / float16, last dim contiguous):
    `(row [N, 2 * 18 + 11 k] float32, window logits [N, BK] float32, window tokens [N, BK] int64, stats [N, 4]
    float32 (lse, max logit, mass outside the window relative to exp(max), unset))` where `BK` is the next power
    of 2 of `k` (columns past `k` are unset). `block`: logits per program of the vocabulary pass (a power of 2
    >= BK). `floor`, `near_top_nats`, `tail_mass_floor`: `features.FEATURE_SPEC`'s constants."""
    n, vocab = scores.shape
    bk = triton.next_power_of_2(k)
    if not 2 <= k <= vocab:
        raise ValueError(f"the window needs 2 <= K_b <= vocabulary size, got K_b = {k} and {vocab} logits")
    if block < bk or block & (block - 1):
        raise ValueError(f"block must be a power of 2 >= {bk}, not {block}")
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    parts = triton.cdiv(vocab, block)
    dev = scores.device
    part = torch.empty(n, parts, 4, dtype=torch.float32, device=dev)
    keys = torch.empty(n, parts, bk, dtype=torch.int64, device=dev)
    width = 2 * N_PHI + k * N_XI
    row = torch.empty(n, width, dtype=torch.float32, device=dev)
    win = torch.empty(n, bk, dtype=torch.float32, device=dev)  # columns past k: never written nor read (no memset)
    tok = torch.empty(n, bk, dtype=torch.int64, device=dev)
    stats = torch.empty(n, 4, dtype=torch.float32, device=dev)
    with on_device_of(scores):
        _vocab_pass_kernel[(n, parts)](scores, scores.stride(0), vocab, part, keys, parts, k, BK=bk, BLOCK=block,
                                       num_warps=8)
        _window_kernel[(n,)](part, keys, row, win, tok, stats, parts, k, width, math.log(vocab),
                             math.log(k), floor, near_top_nats, tail_mass_floor,
                             BP=triton.next_power_of_2(parts), BK=bk, num_warps=4)
    return row, win, tok, stats
