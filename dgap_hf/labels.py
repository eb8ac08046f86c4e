"""DGAP supervision from paired traces (paper Sec. 4.1-4.3, Eq. 3-9).

All functions take a `TracePairs` (top-M slices of paired FP / low-bit logits, see `traces.py`) and work batched over
its rows. Probabilities are exact full-vocabulary probabilities (`exp(z - lse)`); only membership tests are limited
to the stored top-M, so `C_fp(alpha)` is truncated to the FP top-M when those M tokens hold less than `alpha` of the
FP mass (`core_set` reports it) and `K_b` is searched in `[k_min, M]`.

* `core_set`          C_fp(alpha), Eq. 3: the shortest FP-ordered prefix whose FP mass reaches alpha.
* `coverage_curve`    sum of FP mass of C_fp(alpha) inside TopK(z_hat, K), for every K = 1..M (Eq. 4 and 7).
* `fit_recovery_window`  K_b by Eq. 4: the smallest K whose mean coverage reaches rho_K.
* `local_drift`       d_loc, Eq. 8: L2 distance of the FP and low-bit distributions renormalized over
                      U = C_fp(alpha) u S, S = TopK(z_hat, K_b) (optionally after adding a correction to S).
* `risk_labels`       y_t, Eq. 9: d_loc > eps and c_t >= rho_c.

The paper gives no values for alpha, rho_K, rho_c and eps; `DEFAULT_LABEL_PARAMS` are this package's defaults.
"""

from __future__ import annotations

import torch

from .traces import TracePairs

DEFAULT_LABEL_PARAMS = {"alpha": 0.95, "rho_k": 0.9, "rho_c": 0.8, "eps": 0.1}
_CHUNK = 16384


def _fp_probs(tr: TracePairs) -> torch.Tensor:
    return (tr.fp_z - tr.fp_lse.unsqueeze(-1)).exp()


def core_set(tr: TracePairs, alpha: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`(in_C [N, M] bool over the FP top-M order, truncated [N] bool)` for C_fp(alpha) (Eq. 3)."""
    p = _fp_probs(tr)
    before = p.cumsum(-1) - p
    return before < alpha, p.sum(-1) < alpha


def _window_match(tr: TracePairs, k: int) -> torch.Tensor:
    """`[N, k, M]` bool: low-bit window position j holds the same token as FP position m."""
    out = torch.empty(len(tr), k, tr.top_m, dtype=torch.bool, device=tr.fp_idx.device)
    for s in range(0, len(tr), _CHUNK):
        e = s + _CHUNK
        out[s:e] = tr.lb_idx[s:e, :k, None] == tr.fp_idx[s:e, None, :]
    return out


def window_membership(tr: TracePairs, alpha: float, k: int | None = None) -> torch.Tensor:
    """`[N, k]` bool: low-bit top-k position j is a member of C_fp(alpha)."""
    k = tr.top_m if k is None else k
    in_c, _ = core_set(tr, alpha)
    member = torch.empty(len(tr), k, dtype=torch.bool, device=in_c.device)
    for s in range(0, len(tr), _CHUNK):
        e = s + _CHUNK
        match = tr.lb_idx[s:e, :k, None] == tr.fp_idx[s:e, None, :]
        member[s:e] = (match & in_c[s:e, None, :]).any(-1)
    return member


def coverage_curve(tr: TracePairs, alpha: float) -> torch.Tensor:
    """`[N, M]`: column K-1 is c_t for the window TopK(z_hat, K) (Eq. 7), i.e. the Eq. 4 summand."""
    p_fp = (tr.lb_z_fp - tr.fp_lse.unsqueeze(-1)).exp()
    return (window_membership(tr, alpha) * p_fp).cumsum(-1)


def coverage(tr: TracePairs, k: int, alpha: float) -> torch.Tensor:
    """c_t (Eq. 7) for the window of size `k`, `[N]`."""
    return coverage_curve(tr, alpha)[:, k - 1]


def fit_recovery_window(tr: TracePairs, alpha: float = DEFAULT_LABEL_PARAMS["alpha"],
                        rho_k: float = DEFAULT_LABEL_PARAMS["rho_k"], k_min: int = 2,
                        k_max: int | None = None) -> dict:
    """K_b by Eq. 4: the smallest `K` in `[k_min, k_max]` (default `M`) with `mean_t c_t(K) >= rho_K`.

    Returns `{"k_b", "reached" (False: no K reached rho_K, k_b = k_max), "mean_coverage" (list, K = 1..k_max),
    "alpha", "rho_k"}`."""
    k_max = tr.top_m if k_max is None else min(k_max, tr.top_m)
    curve = coverage_curve(tr, alpha)[:, :k_max].mean(0)
    ok = (curve >= rho_k).nonzero().flatten()
    ok = ok[ok + 1 >= k_min]
    reached = ok.numel() > 0
    k_b = int(ok[0]) + 1 if reached else k_max
    return {"k_b": k_b, "reached": bool(reached), "mean_coverage": [round(float(c), 6) for c in curve],
            "alpha": alpha, "rho_k": rho_k}


def local_drift(tr: TracePairs, k: int, alpha: float, delta: torch.Tensor | None = None) -> torch.Tensor:
    """d_loc (Eq. 8), `[N]`. With `delta` `[N, k]`, the low-bit logits of the window S are `lb_z[:, :k] + delta`
    (the corrected distribution of Eq. 13); everything else is unchanged."""
    in_c, _ = core_set(tr, alpha)
    match = _window_match(tr, k)  # [N, k, M]
    member = (match & in_c[:, None, :]).any(-1)  # window position is in C
    zl_c = tr.fp_z_lb
    zl_s = tr.lb_z[:, :k]
    if delta is not None:
        delta = delta.float()
        zl_c = zl_c + (match.float() * delta.unsqueeze(-1)).sum(1)
        zl_s = zl_s + delta
    keep = torch.cat([in_c, ~member], -1)  # U = C u (S \ C)
    zf = torch.cat([tr.fp_z, tr.lb_z_fp[:, :k]], -1)
    zl = torch.cat([zl_c, zl_s], -1)
    neg = torch.tensor(-float("inf"), device=zf.device)
    pf = torch.softmax(torch.where(keep, zf, neg), -1)
    pl = torch.softmax(torch.where(keep, zl, neg), -1)
    return (pf - pl).norm(dim=-1)


def risk_labels(tr: TracePairs, k: int, alpha: float = DEFAULT_LABEL_PARAMS["alpha"],
                eps: float = DEFAULT_LABEL_PARAMS["eps"], rho_c: float = DEFAULT_LABEL_PARAMS["rho_c"]) -> dict:
    """y_t (Eq. 9) with its ingredients: `{"y" (float 0/1), "d_loc", "coverage", "distorted", "recoverable"}`."""
    d = local_drift(tr, k, alpha)
    c = coverage(tr, k, alpha)
    distorted, recoverable = d > eps, c >= rho_c
    return {"y": (distorted & recoverable).float(), "d_loc": d, "coverage": c, "distorted": distorted,
            "recoverable": recoverable}


def window_targets(tr: TracePairs, k: int) -> dict:
    """Corrector inputs/targets on the window S = TopK(z_hat, k): low-bit logits `z_hat`, FP logits `z_fp` and FP
    full-vocabulary probabilities `p_fp`, each `[N, k]`."""
    return {"z_hat": tr.lb_z[:, :k], "z_fp": tr.lb_z_fp[:, :k],
            "p_fp": (tr.lb_z_fp[:, :k] - tr.fp_lse.unsqueeze(-1)).exp()}
