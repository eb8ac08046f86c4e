"""Quality of a low-bit cache, with and without DGAP, computed exactly from paired trace rows.

DGAP changes only the logits of the low-bit top-K_b window `S` (Eq. 13). A trace row keeps the low-bit top-M slice
with the FP logits of the same tokens, the full-vocabulary log-partitions and entropies, the target token's logits and
`cross = sum_v p_fp(v) z_lb(v)`. For a corrected row `z_q = z_lb + delta` on `S` (zero elsewhere):

* `lse_q = lse_lb + log(1 + sum_S p_lb (exp(delta) - 1))`
* `log q(target) = z_lb(target) + delta(target) - lse_q` (perplexity)
* `KL(p_fp || q) = -H_fp - (cross + sum_S p_fp delta) + lse_q` (full vocabulary, exact)
* `argmax q`: the best corrected window token unless the best token outside `S` (`lb_z[K_b]`) beats it.

So every number below equals what decoding with the `DGAPLogitsProcessor` in the loop would give under teacher
forcing (the corrected logits do not feed back into the cache). `quality(tr)` with `delta=None` is the plain
low-bit cache, `reference_quality(tr)` the FP (BF16) run.
"""

from __future__ import annotations

import math

import torch

from .labels import local_drift
from .precision import normalize_precision
from .predict import predict
from .traces import TracePairs


def _ppl(logp: torch.Tensor) -> float:
    return float(math.exp(-float(logp.double().mean()))) if logp.numel() else float("nan")


def reference_quality(tr: TracePairs) -> dict:
    """Perplexity of the FP (BF16) run on the rows' targets."""
    if not tr.has_targets:
        raise ValueError("these traces have no target tokens (collected without teacher-forcing targets)")
    return {"rows": len(tr), "ppl": _ppl(tr.fp_z_target - tr.fp_lse), "top1_agreement": 1.0, "kl": 0.0}


def corrected_top1(tr: TracePairs, k: int, delta: torch.Tensor | None) -> torch.Tensor:
    """Token chosen by greedy decoding from the (corrected) low-bit logits, `[N]`."""
    if delta is None:
        return tr.lb_idx[:, 0].long()
    z = tr.lb_z[:, :k] + delta
    best, pos = z.max(-1)
    top = tr.lb_idx[:, :k].long().gather(-1, pos.unsqueeze(-1)).squeeze(-1)
    if k < tr.top_m:
        top = torch.where(best >= tr.lb_z[:, k], top, tr.lb_idx[:, k].long())
    return top


def quality(tr: TracePairs, k: int | None = None, delta: torch.Tensor | None = None, alpha: float = 0.95) -> dict:
    """Perplexity, top-1 agreement with FP, full-vocabulary KL(p_fp || q), local drift (Eq. 8, window `k`) of the
    low-bit rows, corrected by `delta` `[N, k]` on the low-bit top-`k` window when given (rows not corrected carry
    zeros). Also: how often the FP top-1 token lies outside the window (no logits-only corrector can restore it)."""
    if not tr.has_targets:
        raise ValueError("these traces have no target tokens (collected without teacher-forcing targets)")
    k = k or (delta.shape[-1] if delta is not None else 1)
    d = torch.zeros(len(tr), k) if delta is None else delta.float()
    z_s = tr.lb_z[:, :k].double()
    p_lb = (z_s - tr.lb_lse.double().unsqueeze(-1)).exp()
    p_fp = (tr.lb_z_fp[:, :k].double() - tr.fp_lse.double().unsqueeze(-1)).exp()
    dd = d.double()
    lse_q = tr.lb_lse.double() + torch.log1p((p_lb * dd.expm1()).sum(-1))
    in_win = tr.lb_idx[:, :k].long() == tr.target.unsqueeze(-1)
    d_target = (in_win * dd).sum(-1)
    logq = tr.lb_z_target.double() + d_target - lse_q
    kl = -tr.fp_entropy.double() - (tr.cross.double() + (p_fp * dd).sum(-1)) + lse_q
    fp_top = tr.fp_idx[:, 0].long()
    out_of_window = ~(tr.lb_idx[:, :k].long() == fp_top.unsqueeze(-1)).any(-1)
    return {
        "rows": len(tr),
        "ppl": _ppl(logq),
        "top1_agreement": float((corrected_top1(tr, k, delta) == fp_top).float().mean()),
        "kl": float(kl.clamp_min(0).mean()),
        "drift": float(local_drift(tr, k, alpha, None if delta is None else d).mean()),
        "fp_top1_outside_window": float(out_of_window.float().mean()),
    }


def gap_closed(fp: float, before: float, after: float) -> float:
    """Share of the gap `before - fp` closed by `after` (1 = back to FP, 0 = no change, < 0 = worse)."""
    gap = before - fp
    return float("nan") if gap == 0 else (before - after) / gap


@torch.no_grad()
def predict_rows(model, precision: str, tr: TracePairs) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`(risk [N], delta [N, K_b], K_b)` of `model`'s (a `DGAPModel`) detector and corrector on trace rows; the
    corrector's update is computed for every row, before the detector's mask."""
    name = normalize_precision(precision)
    k = int(model.spec(precision)["k_b"])
    if k > tr.top_m:
        raise ValueError(f"K_b = {k} exceeds the traces' top-M = {tr.top_m}")
    risk, delta = predict(model.detectors[name], model.correctors[name], tr, k)
    return risk, delta, k


def applied_at(risk: torch.Tensor, delta: torch.Tensor, tau: float) -> torch.Tensor:
    """What the processor adds at threshold `tau`: `delta` on rows with `risk > tau`, zeros elsewhere."""
    return delta * (risk > tau).unsqueeze(-1).float()


def dgap_delta(model, precision: str, tr: TracePairs, tau: float | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          int]:
    """`(applied delta [N, K_b], risk [N], K_b)`: what a `DGAPLogitsProcessor` of `model` adds to the low-bit top-K_b
    logits of each trace row at threshold `tau` (default: the artifact's)."""
    risk, delta, k = predict_rows(model, precision, tr)
    tau = float(model.spec(precision)["tau"] if tau is None else tau)
    return applied_at(risk, delta, tau), risk, k


def evaluate_artifact(model, traces: dict, taus=None) -> dict:
    """`{precision: {"bf16", "lowbit", "dgap", "ppl_gap_closed", "drift_ratio", ["tau_sweep"]}}` on held-out traces
    (`{precision: TracePairs}`) for every precision the artifact has. `taus`: optional list of thresholds for a
    sweep."""
    out = {}
    for p, tr in traces.items():
        if p not in model.precisions:
            continue
        risk, delta, k = predict_rows(model, p, tr)
        tau = model.precisions[p]["tau"]
        fp, lb = reference_quality(tr), quality(tr, k)
        dg = {**quality(tr, k, applied_at(risk, delta, tau)), "correction_rate": float((risk > tau).float().mean())}
        row = {"k_b": k, "tau": tau, "bf16": fp, "lowbit": lb, "dgap": dg,
               "ppl_gap_closed": gap_closed(fp["ppl"], lb["ppl"], dg["ppl"]),
               "drift_ratio": dg["drift"] / lb["drift"] if lb["drift"] else float("nan")}
        if taus:
            sweep = []
            for t in taus:
                q = quality(tr, k, applied_at(risk, delta, t))
                sweep.append({"tau": float(t), "correction_rate": float((risk > t).float().mean()),
                              **{m: q[m] for m in ("ppl", "top1_agreement", "kl", "drift")}})
            row["tau_sweep"] = sweep
        out[p] = row
    return out
