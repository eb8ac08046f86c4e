"""The processor's features in few kernels: `features.py`'s detector and candidate features of one decode step,
computed together and laid out as one row per sample, `[phi | xi_1 .. xi_K | phi]`.

`features.py` stays the definition (offline traces and training use it); this is the same math arranged for the
decode step: one top-k, the full-vocabulary statistics once, the window's differences (relative logits, margins,
gaps, span) as one gather-and-subtract, the window statistics once each (shared by detector and candidate features),
`where(p > 0, log p, 0)` as a clamp, one stack per feature family and one `nan_to_num`. No host synchronization, no
branch on data: it can be captured in a CUDA graph or compiled with `fullgraph=True`.

Agreement with `features.py` (tested on CPU): bit-identical. Every value is computed by the same operations on the
same operands, only once instead of once per feature family. (Inductor, under `torch.compile`, fuses and reorders
reductions: there the features agree within float32 rounding, as any compiled code does with eager.)

The row is `[phi | xi_flat | phi]`: its first `N_PHI` columns are the detector's input, the rest is exactly the
flattened input `[xi_flat, phi]` of an MLP or linear corrector, normalized in one operation pair.

On CUDA the processor computes the same row in Triton kernels (`kernel_step.py`, `triton_ops/dgap_window.py`, tested
against this file); this is the step on the CPU and for transformer models.
"""

from __future__ import annotations

import math

import torch

from .features import FEATURE_SPEC, FLOOR, N_PHI, N_XI

NEG_MAX = torch.finfo(torch.float32).min


class WindowConstants:
    """Index and rank tensors of a recovery window of `k` candidates on one device (built once per processor)."""

    def __init__(self, k: int, device):
        if k < 2:
            raise ValueError(f"the recovery window K_b must be >= 2, not {k}")
        r = torch.arange(k)
        nxt = torch.clamp(r + 1, max=k - 1)
        prev = torch.clamp(r - 1, min=0)
        # pairs (a, b) for v_a - v_b: rel (k, 0), margin_prev (k-1, k), margin_next (k, k+1), span (0, k-1);
        # the edge pairs (0, 0) and (k-1, k-1) give the margins' exact zeros
        self.first = torch.cat([r, prev, r, torch.zeros(1, dtype=torch.long)]).to(device)
        self.second = torch.cat([torch.zeros(k, dtype=torch.long), r, nxt, torch.full((1,), k - 1)]).to(device)
        ranks = r.float()
        self.rank_frac = (ranks / (k - 1)).to(device)
        self.inv_rank = (1.0 / (ranks + 1)).to(device)
        self.k, self.device = k, torch.device(device)


def fused_runtime_features(scores: torch.Tensor, consts: WindowConstants):
    """`(row [N, 2 N_PHI + K N_XI], top values [N, K] in scores' dtype, top indices [N, K], lse [N])` for logits
    (or log-probabilities) `scores` `[N, V]`; `row` is `[phi | xi_flat | phi]` (see the module docstring)."""
    k = consts.k
    n, vocab = scores.shape
    vals, idx = scores.topk(k, -1)
    z = scores.float()
    lse = torch.logsumexp(z, -1)
    logp_all = z - lse.unsqueeze(-1)
    # -sum p log p over p > 0: where p == 0, log p is -inf or finite, and 0 * max(log p, MIN) is a zero either way
    entropy = -(logp_all.exp() * logp_all.clamp_min(NEG_MAX)).sum(-1)
    raw = vals.float()
    lt = raw - lse.unsqueeze(-1)  # log p_k
    p = lt.exp()
    v = torch.maximum(raw, raw[:, :1] - FLOOR)
    diff = v.index_select(-1, consts.first) - v.index_select(-1, consts.second)
    rel, margin_prev, margin_next, span = diff[:, :k], diff[:, k:2 * k], diff[:, 2 * k:3 * k], diff[:, 3 * k]
    mass = p.sum(-1)
    q = p / mass.clamp_min(1e-30).unsqueeze(-1)
    local_entropy = -(q * q.log().clamp_min(NEG_MAX)).sum(-1)
    log_p = lt.clamp(min=-FLOOR)
    phi = torch.stack([
        entropy,
        entropy / math.log(vocab),
        log_p[:, 0],
        p[:, 0],
        p[:, :min(4, k)].sum(-1),
        mass,
        torch.log((1 - mass).clamp_min(FEATURE_SPEC["tail_mass_floor"])),
        margin_next[:, 0],
        margin_next[:, 1] if k >= 3 else torch.zeros_like(span),
        span,
        span / (k - 1),
        margin_next[:, :k - 1].amin(-1),
        (rel > -FEATURE_SPEC["near_top_nats"]).sum(-1) / k,  # v_1 - v_k < 1 nat, written as v_k - v_1 > -1
        local_entropy,
        local_entropy / math.log(k),
        v.std(-1, unbiased=False),
        local_entropy.exp() / k,
        (q * q).sum(-1),
    ], -1)
    xi = torch.stack([
        rel,
        v - v.mean(-1, keepdim=True),
        rel / span.clamp_min(1e-6).unsqueeze(-1),
        consts.rank_frac.expand(n, k),
        consts.inv_rank.expand(n, k),
        margin_prev,
        margin_next,
        log_p,
        p,
        q,
        p.cumsum(-1),
    ], -1)
    row = torch.cat([phi, xi.reshape(n, k * N_XI), phi], -1)
    row = torch.nan_to_num(row, nan=0.0, posinf=FLOOR, neginf=-FLOOR)
    return row, vals, idx, lse


def split_row(row: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(phi [N, N_PHI], xi [N, K, N_XI])` views of a fused row."""
    return row[:, :N_PHI], row[:, N_PHI:N_PHI + k * N_XI].unflatten(-1, (k, N_XI))
