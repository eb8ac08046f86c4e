"""DGAP runtime features, computed from the (low-bit) logits only, batched over rows.

Detector features `phi = Phi(z_hat)` (paper Sec. 4.2: "entropy, top-K_b probability mass, local gap statistics,
probability-mass concentration, and dispersion among high-probability candidates") and candidate features
`xi` of the top-K_b window (Sec. 4.3: "local logits, ranks, margins, and probabilities"). The paper names these
families without formulas; the concrete statistics below are this package's definition (`FEATURE_SPEC`, recorded
in every artifact and checked on load).

Every feature is invariant to adding a constant to all logits (the paper's Sec. 3.2 control), so raw logits and
log-softmax scores (beam search) give the same features. Only two statistics need the whole vocabulary, the
log-partition `lse` and the entropy `H`; `full_vocab_stats` computes them, and everything else comes from the sorted
top-K logits. Offline traces therefore store `(lse, H)` plus the top-M logits and get exactly the runtime features
for any `K <= M` (`detector_features_from_top`).

Notation for one row: `v_1 >= ... >= v_K` the top-K logits, `p_k = exp(v_k - lse)`, `m = sum_k p_k`,
`q_k = p_k / m` the window distribution.

Detector features (`PHI_NAMES`):
  entropy            H = -sum_i p_i log p_i over the vocabulary (nats)
  entropy_norm       H / log V
  log_p1             log p_1
  p1                 p_1
  mass_top4          sum_{k <= min(4, K)} p_k                       (concentration)
  mass_topk          m, the top-K_b mass
  log_tail_mass      log(1 - m), floored at log(1e-12)
  gap_12             v_1 - v_2                                       (gap statistics)
  gap_23             v_2 - v_3 (0 if K < 3)
  gap_span           v_1 - v_K
  gap_mean           (v_1 - v_K) / (K - 1)
  gap_min            min_k (v_k - v_{k+1})
  near_top_frac      #{k : v_1 - v_k < 1} / K                         (candidates within one nat of the top)
  local_entropy      -sum_k q_k log q_k                                (dispersion of the window)
  local_entropy_norm local_entropy / log K
  local_std          standard deviation of v_1..v_K
  eff_candidates     exp(local_entropy) / K
  local_collision    sum_k q_k^2

Candidate features (`XI_NAMES`), for window position k = 1..K:
  rel_logit     v_k - v_1
  centered      v_k - mean(v)
  scaled        (v_k - v_1) / (v_1 - v_K)   (in [-1, 0])
  rank_frac     (k - 1) / (K - 1)
  inv_rank      1 / k
  margin_prev   v_{k-1} - v_k (0 for k = 1)
  margin_next   v_k - v_{k+1} (0 for k = K)
  log_p         v_k - lse (floored at -50)
  p             p_k
  q_local       q_k
  cum_mass      sum_{j <= k} p_j

Logits of -inf (tokens masked by other processors) are floored at `v_1 - 50` for the gap and dispersion statistics;
their probabilities are 0.
"""

from __future__ import annotations

import math

import torch

FEATURE_VERSION = 1
PHI_NAMES = (
    "entropy", "entropy_norm", "log_p1", "p1", "mass_top4", "mass_topk", "log_tail_mass",
    "gap_12", "gap_23", "gap_span", "gap_mean", "gap_min", "near_top_frac",
    "local_entropy", "local_entropy_norm", "local_std", "eff_candidates", "local_collision",
)
XI_NAMES = (
    "rel_logit", "centered", "scaled", "rank_frac", "inv_rank", "margin_prev", "margin_next",
    "log_p", "p", "q_local", "cum_mass",
)
N_PHI = len(PHI_NAMES)
N_XI = len(XI_NAMES)
FLOOR = 50.0  # logits further than this below the top are treated as this far
FEATURE_SPEC = {"version": FEATURE_VERSION, "phi": list(PHI_NAMES), "xi": list(XI_NAMES), "floor": FLOOR,
                "near_top_nats": 1.0, "tail_mass_floor": 1e-12}


def full_vocab_stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(lse, entropy)` of logits `z` `[N, V]` (float32, computed in float32)."""
    z = z.float()
    lse = torch.logsumexp(z, -1)
    logp = z - lse.unsqueeze(-1)
    p = logp.exp()
    entropy = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)
    return lse, entropy


def _floored(top: torch.Tensor) -> torch.Tensor:
    return torch.maximum(top, top[:, :1] - FLOOR)


def detector_features_from_top(top: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor, k: int,
                               vocab_size: int) -> torch.Tensor:
    """Detector features `[N, N_PHI]` from the sorted (descending) top logits `top` `[N, >= k]`, the full-vocabulary
    `lse` and `entropy` `[N]`, the window `k` and the vocabulary size."""
    if k < 2:
        raise ValueError(f"the recovery window K_b must be >= 2, not {k}")
    if top.shape[-1] < k:
        raise ValueError(f"need the top {k} logits, got {top.shape[-1]}")
    raw = top[:, :k].float()
    lse = lse.float().unsqueeze(-1)
    v = _floored(raw)
    logp = torch.clamp(raw - lse, min=-FLOOR)
    p = (raw - lse).exp()
    mass = p.sum(-1)
    q = p / mass.clamp_min(1e-30).unsqueeze(-1)
    gaps = v[:, :-1] - v[:, 1:]
    local_entropy = -(q * torch.where(q > 0, q.log(), torch.zeros_like(q))).sum(-1)
    span = v[:, 0] - v[:, -1]
    feats = [
        entropy.float(),
        entropy.float() / math.log(vocab_size),
        logp[:, 0],
        p[:, 0],
        p[:, :min(4, k)].sum(-1),
        mass,
        torch.log((1 - mass).clamp_min(FEATURE_SPEC["tail_mass_floor"])),
        gaps[:, 0],
        gaps[:, 1] if k >= 3 else torch.zeros_like(span),
        span,
        span / (k - 1),
        gaps.amin(-1),
        ((v[:, :1] - v) < FEATURE_SPEC["near_top_nats"]).float().mean(-1),
        local_entropy,
        local_entropy / math.log(k),
        v.std(-1, unbiased=False),
        local_entropy.exp() / k,
        (q * q).sum(-1),
    ]
    return torch.nan_to_num(torch.stack(feats, -1), nan=0.0, posinf=FLOOR, neginf=-FLOOR)


def candidate_features(top: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Candidate features `[N, K, N_XI]` of the window given by the sorted top-K logits `top` `[N, K]`."""
    raw = top.float()
    n, k = raw.shape
    if k < 2:
        raise ValueError(f"the recovery window K_b must be >= 2, not {k}")
    v = _floored(raw)
    lse = lse.float().unsqueeze(-1)
    p = (raw - lse).exp()
    q = p / p.sum(-1, keepdim=True).clamp_min(1e-30)
    rel = v - v[:, :1]
    span = (v[:, :1] - v[:, -1:]).clamp_min(1e-6)
    ranks = torch.arange(k, device=raw.device, dtype=torch.float32)
    zero = torch.zeros_like(v[:, :1])
    feats = [
        rel,
        v - v.mean(-1, keepdim=True),
        rel / span,
        (ranks / (k - 1)).expand(n, k),
        (1.0 / (ranks + 1)).expand(n, k),
        torch.cat([zero, v[:, :-1] - v[:, 1:]], -1),
        torch.cat([v[:, :-1] - v[:, 1:], zero], -1),
        torch.clamp(raw - lse, min=-FLOOR),
        p,
        q,
        p.cumsum(-1),
    ]
    return torch.nan_to_num(torch.stack(feats, -1), nan=0.0, posinf=FLOOR, neginf=-FLOOR)


def detector_features(z: torch.Tensor, k: int) -> torch.Tensor:
    """Runtime detector features `[N, N_PHI]` of logits (or log-probabilities) `z` `[N, V]`."""
    lse, entropy = full_vocab_stats(z)
    top = z.float().topk(k, -1).values
    return detector_features_from_top(top, lse, entropy, k, z.shape[-1])


def runtime_features(z: torch.Tensor, k: int):
    """Everything the processor needs in one pass: `(phi [N, N_PHI], xi [N, K, N_XI], top values [N, K] in z's
    dtype, top indices [N, K])`."""
    lse, entropy = full_vocab_stats(z)
    vals, idx = z.topk(k, -1)
    phi = detector_features_from_top(vals, lse, entropy, k, z.shape[-1])
    xi = candidate_features(vals, lse)
    return phi, xi, vals, idx
