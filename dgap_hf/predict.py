"""What the DGAP runtime computes, evaluated offline on paired trace rows: the features of the low-bit side and the
detector's risk and the corrector's update (used by training, validation and `dgap_hf.evaluation`)."""

from __future__ import annotations

import torch

from .features import candidate_features, detector_features_from_top
from .models import DGAPCorrector, DGAPDetector
from .traces import TracePairs


def trace_features(tr: TracePairs, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(phi [N, N_PHI], xi [N, k, N_XI])` of the low-bit side: the runtime features, from the stored slices."""
    phi = detector_features_from_top(tr.lb_z, tr.lb_lse, tr.lb_entropy, k, tr.vocab_size)
    xi = candidate_features(tr.lb_z[:, :k], tr.lb_lse)
    return phi, xi


@torch.no_grad()
def predict(detector: DGAPDetector, corrector: DGAPCorrector, tr: TracePairs, k: int,
            batch_size: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """`(risk [N], delta [N, k])` of the models on trace rows (delta computed for every row)."""
    phi, xi = trace_features(tr, k)
    dev = detector.phi_mean.device
    risks, deltas = [], []
    for s in range(0, len(tr), batch_size):
        p, x = phi[s:s + batch_size].to(dev), xi[s:s + batch_size].to(dev)
        risks.append(detector.risk(p).cpu())
        deltas.append(corrector(x, p).cpu())
    return torch.cat(risks), torch.cat(deltas)
