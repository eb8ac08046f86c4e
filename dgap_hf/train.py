"""Offline DGAP training from paired traces: losses (Eq. 10, 14-18), training loops, tau calibration, evaluation.

`train_dgap({precision: TracePairs}, TrainConfig(...))` does, per precision:

1. split the traces into training and validation rows;
2. `K_b` by Eq. 4 on the training rows (`labels.fit_recovery_window`);
3. labels `y_t` (Eq. 9) and features `phi`, `xi` (exactly the runtime features, from the stored top-M slices);
4. the detector with binary cross-entropy (Eq. 10), the corrector on the window with
   `L_dist + lambda_rank L_rank + lambda_reg ||delta||^2` (Eq. 15-18), both weighted by `y_t`;
5. `tau` on the validation rows (`calibrate_tau`);
6. validation metrics: local drift d_loc (Eq. 8), window KL, FP top-1 agreement and the correction rate, before and
   after DGAP.

It returns a `DGAPModel` ready for `save_pretrained` / `push_to_hub`, with the results in its config.

Sums over steps in the paper's losses are means here (sum / number of rows, or / sum of y_t for the y-weighted
corrector terms); that only rescales the learning rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from .evaluation import corrected_top1
from .features import FEATURE_SPEC
from .labels import fit_recovery_window, local_drift, risk_labels, window_targets
from .models import DGAPCorrector, DGAPDetector, DGAPModel
from .precision import normalize_precision
from .predict import predict, trace_features
from .traces import TracePairs


@dataclass
class TrainConfig:
    # labels (Eq. 3-9); the paper gives no values, these are this package's defaults
    alpha: float = 0.95
    rho_k: float = 0.9
    rho_c: float = 0.8
    eps: float = 0.1
    k_min: int = 2
    k_max: int | None = None
    # corrector objective (Eq. 14-18)
    temperature: float = 1.0
    lambda_rank: float = 0.1
    lambda_reg: float = 1e-3
    # architectures
    detector_arch: str = "mlp"
    detector_hidden: int = 128
    detector_layers: int = 2
    corrector_arch: str = "mlp"
    corrector_hidden: int = 256
    corrector_layers: int = 2
    max_delta: float = 8.0
    # optimization
    epochs: int = 30
    batch_size: int = 1024
    lr: float = 1e-3
    weight_decay: float = 0.0
    detector_pos_weight: bool = False  # weight positives by n_neg / n_pos in the BCE
    val_fraction: float = 0.2
    seed: int = 0
    # tau calibration
    tau_grid: tuple = tuple(round(0.05 * i, 2) for i in range(1, 20))
    tau_tolerance: float = 0.05
    device: str = "cpu"
    extra: dict = field(default_factory=dict)


# --- losses --------------------------------------------------------------------------------------------------------
def detector_loss(logits: torch.Tensor, y: torch.Tensor, pos_weight: float | None = None) -> torch.Tensor:
    """Eq. 10 (mean over rows): binary cross-entropy of `r = sigmoid(logits)` against `y`."""
    pw = None if pos_weight is None else torch.tensor(pos_weight, device=logits.device)
    return F.binary_cross_entropy_with_logits(logits, y.float(), pos_weight=pw)


def corrector_loss(z_hat: torch.Tensor, delta: torch.Tensor, z_fp: torch.Tensor, p_fp: torch.Tensor,
                   y: torch.Tensor, temperature: float = 1.0, lambda_rank: float = 0.1,
                   lambda_reg: float = 1e-3) -> dict:
    """Eq. 14-18 on the window S (all `[N, K]`): `z_hat` low-bit logits, `delta` the update, `z_fp` FP logits,
    `p_fp` FP full-vocabulary probabilities, `y` `[N]` the risk labels.

    * `dist`: `sum_t y_t KL(softmax(z_fp / T) || softmax((z_hat + delta) / T))` (Eq. 15)
    * `rank`: `sum_t y_t sum_{z_fp,i > z_fp,j} (p_fp,i - p_fp,j) log(1 + exp(-(z~_i - z~_j)))` (Eq. 16-17)
    * `reg`: `sum_t y_t ||delta_t||^2` (Eq. 18)

    each divided by `max(sum_t y_t, 1)`; `total = dist + lambda_rank rank + lambda_reg reg`."""
    y = y.float()
    z_tilde = z_hat.float() + delta
    log_q_fp = F.log_softmax(z_fp.float() / temperature, -1)
    log_q = F.log_softmax(z_tilde / temperature, -1)
    kl = (log_q_fp.exp() * (log_q_fp - log_q)).sum(-1)
    zf = z_fp.float()
    pairs = (zf.unsqueeze(-1) > zf.unsqueeze(-2)).float()  # [N, i, j]: z_fp,i > z_fp,j
    w = (p_fp.float().unsqueeze(-1) - p_fp.float().unsqueeze(-2)) * pairs
    margin = z_tilde.unsqueeze(-1) - z_tilde.unsqueeze(-2)
    rank = (w * F.softplus(-margin)).sum((-1, -2))
    reg = (delta * delta).sum(-1)
    norm = y.sum().clamp_min(1.0)
    out = {"dist": (y * kl).sum() / norm, "rank": (y * rank).sum() / norm, "reg": (y * reg).sum() / norm}
    out["total"] = out["dist"] + lambda_rank * out["rank"] + lambda_reg * out["reg"]
    return out


# --- training loops ------------------------------------------------------------------------------------------------
def _batches(n: int, batch_size: int, generator: torch.Generator):
    perm = torch.randperm(n, generator=generator)
    for s in range(0, n, batch_size):
        yield perm[s:s + batch_size]


def train_detector(phi: torch.Tensor, y: torch.Tensor, cfg: TrainConfig) -> DGAPDetector:
    torch.manual_seed(cfg.seed)
    det = DGAPDetector(phi.shape[-1], arch=cfg.detector_arch, hidden=cfg.detector_hidden,
                       layers=cfg.detector_layers).fit_normalization(phi).to(cfg.device)
    pos = float(y.sum())
    pos_weight = (len(y) - pos) / max(pos, 1.0) if cfg.detector_pos_weight else None
    opt = torch.optim.AdamW(det.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(cfg.seed)
    det.train()
    for _ in range(cfg.epochs):
        for b in _batches(len(y), cfg.batch_size, g):
            loss = detector_loss(det(phi[b].to(cfg.device)), y[b].to(cfg.device), pos_weight)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return det.eval()


def train_corrector(xi: torch.Tensor, phi: torch.Tensor, targets: dict, y: torch.Tensor, cfg: TrainConfig,
                    window: int) -> DGAPCorrector:
    """Train g_psi on the rows with `y_t = 1` (the others have zero weight in Eq. 15-18)."""
    torch.manual_seed(cfg.seed + 1)
    corr = DGAPCorrector(window, xi.shape[-1], phi.shape[-1], arch=cfg.corrector_arch, hidden=cfg.corrector_hidden,
                         layers=cfg.corrector_layers, max_delta=cfg.max_delta)
    rows = y > 0
    if not bool(rows.any()):
        return corr.fit_normalization(xi, phi).eval()  # nothing to learn: the zero-initialized output stays 0
    xi, phi = xi[rows], phi[rows]
    t = {k: v[rows] for k, v in targets.items()}
    corr.fit_normalization(xi, phi).to(cfg.device)
    opt = torch.optim.AdamW(corr.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    corr.train()
    ones = torch.ones(len(xi), device=cfg.device)
    dev = cfg.device
    for _ in range(cfg.epochs):
        for b in _batches(len(xi), cfg.batch_size, g):
            delta = corr(xi[b].to(dev), phi[b].to(dev))
            loss = corrector_loss(t["z_hat"][b].to(dev), delta, t["z_fp"][b].to(dev), t["p_fp"][b].to(dev),
                                  ones[b], cfg.temperature, cfg.lambda_rank, cfg.lambda_reg)["total"]
            opt.zero_grad()
            loss.backward()
            opt.step()
    return corr.eval()


# --- evaluation and tau ----------------------------------------------------------------------------------------------
def window_kl(z_fp: torch.Tensor, z: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """`KL(softmax(z_fp / T) || softmax(z / T))` over the window, `[N]`."""
    lp = F.log_softmax(z_fp.float() / temperature, -1)
    lq = F.log_softmax(z.float() / temperature, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def auc(score: torch.Tensor, y: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties averaged); nan without both classes."""
    y = y.bool()
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if not n_pos or not n_neg:
        return float("nan")
    order = score.argsort()
    ranks = torch.empty_like(score, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.float64)
    s_sorted = score[order]  # average the ranks of ties
    uniq, inverse, counts = torch.unique_consecutive(s_sorted, return_inverse=True, return_counts=True)
    if len(uniq) < len(score):
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks[order])
        ranks[order] = (sums / counts)[inverse]
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def calibrate_tau(risk: torch.Tensor, gain: torch.Tensor, grid=TrainConfig.tau_grid,
                  tolerance: float = 0.05) -> tuple[float, list[dict]]:
    """Pick tau on validation rows: the highest tau (fewest corrections) whose total quality gain stays within
    `tolerance` of the best tau of the grid.

    `gain[t]` is what correcting row t would bring (drift before minus drift after; negative when the corrector
    hurts). `total(tau) = sum_{r_t > tau} gain_t`. The paper calibrates tau offline "to trade off restoration
    quality and correction frequency" (Sec. 4.2, 5.5; its chosen value is 0.60) without a formula; this rule keeps
    (1 - tolerance) of the best achievable gain with the lowest correction frequency. If no tau gains anything,
    tau = 1.0 (never correct)."""
    rows = []
    grid = sorted(set(float(t) for t in grid) | {1.0})
    for tau in grid:
        on = risk > tau
        rows.append({"tau": tau, "correction_rate": float(on.float().mean()) if len(risk) else 0.0,
                     "gain": float(gain[on].sum()) / max(len(gain), 1)})
    best = max(r["gain"] for r in rows)
    if best <= 0:
        return 1.0, rows
    ok = [r["tau"] for r in rows if r["gain"] >= (1 - tolerance) * best]
    return max(ok), rows


@torch.no_grad()
def evaluate(detector: DGAPDetector, corrector: DGAPCorrector, tr: TracePairs, k: int, tau: float,
             alpha: float = 0.95, eps: float = 0.1, rho_c: float = 0.8) -> dict:
    """Validation metrics before / after DGAP on trace rows: mean local drift d_loc (Eq. 8, over C u S), window KL
    at T = 1, FP top-1 agreement, correction rate, and the detector's AUC against y_t."""
    risk, delta = predict(detector, corrector, tr, k)
    on = (risk > tau).float().unsqueeze(-1)
    applied = delta * on
    labels = risk_labels(tr, k, alpha, eps, rho_c)
    t = window_targets(tr, k)
    fp_top = tr.fp_idx[:, 0].long()
    d_after = local_drift(tr, k, alpha, applied)
    return {
        "rows": len(tr),
        "k_b": k,
        "tau": tau,
        "positive_rate": float(labels["y"].mean()),
        "detector_auc": auc(risk, labels["y"]),
        "correction_rate": float(on.mean()),
        "drift_before": float(labels["d_loc"].mean()),
        "drift_after": float(d_after.mean()),
        "window_kl_before": float(window_kl(t["z_fp"], t["z_hat"]).mean()),
        "window_kl_after": float(window_kl(t["z_fp"], t["z_hat"] + applied).mean()),
        "top1_agreement_before": float((corrected_top1(tr, k, None) == fp_top).float().mean()),
        "top1_agreement_after": float((corrected_top1(tr, k, applied) == fp_top).float().mean()),
    }


# --- everything ------------------------------------------------------------------------------------------------------
def train_precision(train: TracePairs, val: TracePairs, cfg: TrainConfig) -> tuple[dict, DGAPDetector,
                                                                                     DGAPCorrector, dict]:
    """Train one precision: returns `(spec for DGAPModel, detector, corrector, results)`."""
    window = fit_recovery_window(train, cfg.alpha, cfg.rho_k, cfg.k_min, cfg.k_max)
    k = window["k_b"]
    lab = risk_labels(train, k, cfg.alpha, cfg.eps, cfg.rho_c)
    phi, xi = trace_features(train, k)
    detector = train_detector(phi, lab["y"], cfg)
    corrector = train_corrector(xi, phi, window_targets(train, k), lab["y"], cfg, k)
    risk, delta = predict(detector, corrector, val, k)
    gain = local_drift(val, k, cfg.alpha) - local_drift(val, k, cfg.alpha, delta)
    tau, tau_table = calibrate_tau(risk, gain, cfg.tau_grid, cfg.tau_tolerance)
    results = {
        "k_b": k, "k_b_reached": window["reached"], "mean_coverage": window["mean_coverage"][:k],
        "train_rows": len(train), "train_positive_rate": float(lab["y"].mean()),
        "tau": tau, "tau_table": tau_table,
        "validation": evaluate(detector, corrector, val, k, tau, cfg.alpha, cfg.eps, cfg.rho_c),
    }
    spec = {
        "k_b": k, "tau": tau,
        "detector": {"n_features": phi.shape[-1], "arch": cfg.detector_arch, "hidden": cfg.detector_hidden,
                     "layers": cfg.detector_layers},
        "corrector": {"window": k, "n_candidate_features": xi.shape[-1], "n_features": phi.shape[-1],
                      "arch": cfg.corrector_arch, "hidden": cfg.corrector_hidden, "layers": cfg.corrector_layers,
                      "max_delta": cfg.max_delta},
    }
    return spec, detector, corrector, results


def train_dgap(traces: dict, cfg: TrainConfig | None = None, *, base_model: dict | None = None,
               quantizer: dict | None = None, training_data: dict | None = None,
               val_traces: dict | None = None) -> DGAPModel:
    """Train a `DGAPModel` from `{precision: TracePairs}` (see the module docstring).

    `base_model` defaults to the traces' metadata (name) and vocabulary size; pass `{"name", "vocab_size",
    "architectures", "hidden_size", "num_hidden_layers"}` so that `check_model` can verify the target model."""
    cfg = cfg or TrainConfig()
    if not traces:
        raise ValueError("no traces")
    specs, modules, results = {}, {}, {}
    first = next(iter(traces.values()))
    for name, tr in traces.items():
        p = normalize_precision(name)
        if val_traces is not None:
            if p not in {normalize_precision(q) for q in val_traces}:
                raise ValueError(f"no validation traces for {p}")
            train, val = tr, next(v for q, v in val_traces.items() if normalize_precision(q) == p)
        else:
            train, val = tr.split(cfg.val_fraction, cfg.seed)
        specs[p], det, corr, results[p] = train_precision(train, val, cfg)
        modules[p] = (det, corr)
    base = {"name": first.meta.get("base_model", ""), "vocab_size": first.vocab_size}
    base.update(first.meta.get("base_model_info") or {})
    base.update(base_model or {})
    if int(base["vocab_size"]) != first.vocab_size:
        raise ValueError(f"base_model says vocab_size {base['vocab_size']}, the traces have {first.vocab_size}")
    if quantizer is None:
        quantizer = {p: tr.meta.get("quantizer") for p, tr in traces.items() if tr.meta.get("quantizer")}
    training = {"config": {k: v for k, v in asdict(cfg).items() if k != "device"},
                "rows": {normalize_precision(p): len(tr) for p, tr in traces.items()}}
    training.update(training_data or {})
    label_params = {"alpha": cfg.alpha, "rho_k": cfg.rho_k, "rho_c": cfg.rho_c, "eps": cfg.eps}
    model = DGAPModel(specs, base, dict(FEATURE_SPEC), quantizer, _jsonable(training), _jsonable(results),
                      label_params)
    for p, (det, corr) in modules.items():
        model.detectors[p].load_state_dict(det.state_dict())
        model.correctors[p].load_state_dict(corr.state_dict())
    return model.eval()


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x
