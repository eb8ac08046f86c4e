"""DGAP's decision and merge: the risk `sigmoid(logit)`, `corrected = risk > tau`, the bounded update
`max_delta * tanh(delta / max_delta)` added to the window's logits of corrected rows, written back over a copy of
the scores; corrected rows whose input was normalized (`|lse| < atol`, beam-search log-probabilities) are
renormalized. One kernel, one program per (row, slice of `BLOCK` logits), each writing its slice of the output;
program 0 of each row also writes the risk and the decision and adds the row to a device counter.

Rows left alone are copied bit for bit; the log-partition of a renormalized row is
`max + log(tail + sum_k exp(new_k - max))` from the window kernel's statistics (`dgap_window.py`), the same value as
a log-sum-exp over the new row within float32 rounding.
"""

import torch
import triton
import triton.language as tl

from .device import on_device_of


@triton.jit
def _tanh(x):
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _merge_kernel(s_ptr, s_stride, o_ptr, V, win_ptr, tok_ptr, stat_ptr, logit_ptr, delta_ptr, risk_ptr, fix_ptr,
                  count_ptr, K, tau, max_delta, atol, BK: tl.constexpr, BLOCK: tl.constexpr, BOUND: tl.constexpr,
                  COUNT: tl.constexpr):
    row = tl.program_id(0)
    p = tl.program_id(1)
    risk = 1.0 / (1.0 + tl.exp(-tl.load(logit_ptr + row)))
    fix = risk > tau
    kk = tl.arange(0, BK)
    km = kk < K
    delta = tl.load(delta_ptr + row * K + kk, mask=km, other=0.0)
    if BOUND:
        delta = max_delta * _tanh(delta / max_delta)
    new = (tl.load(win_ptr + row * BK + kk, mask=km, other=0.0) + delta).to(o_ptr.dtype.element_ty).to(tl.float32)
    lse = tl.load(stat_ptr + row * 4)
    top = tl.load(stat_ptr + row * 4 + 1)
    new_lse = top + tl.log(tl.load(stat_ptr + row * 4 + 2) + tl.sum(tl.where(km, tl.exp(new - top), 0.0), 0))
    renorm = fix & (tl.abs(lse) < atol)
    offs = p * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    z = tl.load(s_ptr + row.to(tl.int64) * s_stride + offs, mask=inside)
    z = tl.where(renorm, (z.to(tl.float32) - new_lse).to(z.dtype), z)
    out = o_ptr + row.to(tl.int64) * V
    tl.store(out + offs, z, mask=inside)
    tl.debug_barrier()  # the copy of this slice lands before its window entries overwrite it
    tok = tl.load(tok_ptr + row * BK + kk, mask=km, other=-1)
    mine = tl.where(fix, km & (tok >= p * BLOCK) & (tok < p * BLOCK + BLOCK), False)
    tl.store(out + tok, tl.where(renorm, new - new_lse, new).to(o_ptr.dtype.element_ty), mask=mine)
    if p == 0:
        tl.store(risk_ptr + row, risk)
        tl.store(fix_ptr + row, fix.to(tl.int8))
        if COUNT:
            tl.atomic_add(count_ptr, fix.to(tl.int64))


def merge_window(scores: torch.Tensor, window: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor,
                 logit: torch.Tensor, delta: torch.Tensor, tau: float, max_delta: float, atol: float,
                 counter: torch.Tensor | None = None, block: int = 2048):
    """`(new scores [N, V] in scores' dtype, risk [N] float32, corrected [N] bool)`.

    `window`/`tokens`/`stats`: `dgap_window.window_features`' outputs; `logit` float32 `[N, 1]` (the detector's),
    `delta` float32 `[N, K]` (the corrector's, bounded here when `max_delta` > 0); `atol`: rows with `|lse| < atol`
    count as normalized; `counter`: int64 scalar to add the corrected rows to (in place), or None."""
    n, vocab = scores.shape
    k = delta.shape[-1]
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    out = torch.empty(n, vocab, dtype=scores.dtype, device=scores.device)
    risk = torch.empty(n, dtype=torch.float32, device=scores.device)
    fix = torch.empty(n, dtype=torch.int8, device=scores.device)
    count = counter is not None
    if count and (counter.dtype != torch.int64 or counter.numel() != 1):
        raise ValueError(f"the counter must be one int64, not {counter.dtype} {tuple(counter.shape)}")
    with on_device_of(scores):
        _merge_kernel[(n, triton.cdiv(vocab, block))](
            scores, scores.stride(0), out, vocab, window, tokens, stats, logit, delta, risk, fix,
            counter if count else risk, k, float(tau), float(max_delta), float(atol), BK=window.shape[-1],
            BLOCK=block, BOUND=bool(max_delta), COUNT=count, num_warps=8)
    return out, risk, fix.view(torch.bool)
