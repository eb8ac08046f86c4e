"""Detector / candidate features (dgap_hf.features) and labels from paired traces (dgap_hf.labels)."""

import math

import pytest
import torch

from dgap_hf.features import (
    N_PHI, N_XI, PHI_NAMES, XI_NAMES, candidate_features, detector_features, detector_features_from_top,
    full_vocab_stats, runtime_features,
)
from dgap_hf.labels import (
    core_set, coverage, coverage_curve, fit_recovery_window, local_drift, risk_labels, window_targets,
)
from dgap_hf.synthetic import synthetic_traces
from dgap_hf.traces import TracePairs


pytestmark = pytest.mark.usefixtures("one_thread")


def _phi(z, k):
    return dict(zip(PHI_NAMES, detector_features(z, k)[0].tolist()))


def test_feature_values_by_hand():
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]])
    z = p.log() + 3.0  # any shift
    f = _phi(z, 3)
    h = -(p * p.log()).sum().item()
    assert f["entropy"] == pytest.approx(h, abs=1e-5)
    assert f["entropy_norm"] == pytest.approx(h / math.log(5), abs=1e-5)
    assert f["p1"] == pytest.approx(0.5, abs=1e-6) and f["log_p1"] == pytest.approx(math.log(0.5), abs=1e-5)
    assert f["mass_topk"] == pytest.approx(0.85, abs=1e-6) and f["mass_top4"] == pytest.approx(0.85, abs=1e-6)
    assert f["log_tail_mass"] == pytest.approx(math.log(0.15), abs=1e-4)
    assert f["gap_12"] == pytest.approx(math.log(0.5 / 0.2), abs=1e-5)
    assert f["gap_23"] == pytest.approx(math.log(0.2 / 0.15), abs=1e-5)
    assert f["gap_span"] == pytest.approx(math.log(0.5 / 0.15), abs=1e-5)
    assert f["gap_mean"] == pytest.approx(math.log(0.5 / 0.15) / 2, abs=1e-5)
    assert f["gap_min"] == pytest.approx(math.log(0.2 / 0.15), abs=1e-5)
    assert f["near_top_frac"] == pytest.approx(2 / 3)  # 0.2 is within one nat of 0.5, 0.15 is not
    q = torch.tensor([0.5, 0.2, 0.15]) / 0.85
    lh = -(q * q.log()).sum().item()
    assert f["local_entropy"] == pytest.approx(lh, abs=1e-5)
    assert f["local_entropy_norm"] == pytest.approx(lh / math.log(3), abs=1e-5)
    assert f["eff_candidates"] == pytest.approx(math.exp(lh) / 3, abs=1e-5)
    assert f["local_collision"] == pytest.approx((q * q).sum().item(), abs=1e-5)
    assert f["local_std"] == pytest.approx(torch.tensor([0.5, 0.2, 0.15]).log().std(unbiased=False).item(), abs=1e-5)
    xi = candidate_features(z.topk(3).values, torch.logsumexp(z, -1))[0]
    x = {n: xi[:, i].tolist() for i, n in enumerate(XI_NAMES)}
    assert x["rank_frac"] == [0.0, 0.5, 1.0] and x["inv_rank"] == pytest.approx([1, 0.5, 1 / 3])
    assert x["margin_prev"][0] == 0 and x["margin_prev"][1] == pytest.approx(math.log(2.5), abs=1e-5)
    assert x["margin_next"][2] == 0 and x["margin_next"][1] == pytest.approx(math.log(0.2 / 0.15), abs=1e-5)
    assert x["p"] == pytest.approx([0.5, 0.2, 0.15], abs=1e-6)
    assert x["cum_mass"] == pytest.approx([0.5, 0.7, 0.85], abs=1e-6)
    assert x["q_local"] == pytest.approx((q).tolist(), abs=1e-6)
    assert x["scaled"] == pytest.approx([0, math.log(0.2 / 0.5) / math.log(0.15 / 0.5) * -1, -1], abs=1e-5)


def test_features_are_shift_invariant_batched_and_finite():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(6, 300, generator=g) * 3
    phi, xi, vals, idx = runtime_features(z, 16)
    assert phi.shape == (6, N_PHI) and xi.shape == (6, 16, N_XI) and vals.shape == idx.shape == (6, 16)
    for other in (z + 7.5, torch.log_softmax(z, -1)):  # a constant offset, and the beam-search log-probs
        p2, x2, _, i2 = runtime_features(other, 16)
        assert torch.equal(i2, idx)
        assert torch.allclose(p2, phi, atol=2e-4) and torch.allclose(x2, xi, atol=2e-4)
    for r in range(6):  # batched = row by row
        assert torch.allclose(detector_features(z[r:r + 1], 16), phi[r:r + 1], atol=1e-6)
    masked = z.clone()
    masked[:, 5:] = -float("inf")  # e.g. after top-k filtering by another processor
    p3, x3, _, _ = runtime_features(masked, 16)
    assert torch.isfinite(p3).all() and torch.isfinite(x3).all()
    with pytest.raises(ValueError):
        detector_features(z, 1)


def test_trace_features_equal_runtime_features():
    g = torch.Generator().manual_seed(1)
    fp = torch.randn(20, 500, generator=g) * 2
    lb = fp + 0.5 * torch.randn(20, 500, generator=g)
    tr = TracePairs.from_logits(fp, lb, top_m=32)
    for k in (4, 16, 32):
        from_top = detector_features_from_top(tr.lb_z, tr.lb_lse, tr.lb_entropy, k, tr.vocab_size)
        assert torch.equal(from_top, detector_features(lb, k))
        assert torch.equal(candidate_features(tr.lb_z[:, :k], tr.lb_lse), runtime_features(lb, k)[1])
    lse, h = full_vocab_stats(lb)
    assert torch.equal(lse, tr.lb_lse) and torch.equal(h, tr.lb_entropy)


def _hand_traces():
    # FP order 0 > 1 > 2 > 3 > 4 > 5; low-bit order 1 > 0 > 3 > 4 > 5 > 2
    p_fp = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02]])
    p_lb = torch.tensor([[0.3, 0.42, 0.04, 0.12, 0.07, 0.05]])
    return TracePairs.from_logits(p_fp.log() + 1.0, p_lb.log() - 2.0, top_m=6), p_fp[0], p_lb[0]


def test_labels_by_hand():
    tr, p_fp, p_lb = _hand_traces()
    in_c, truncated = core_set(tr, 0.85)  # 0.5, 0.8 < 0.85 <= 0.9: C = {0, 1, 2}
    assert in_c[0].tolist() == [True, True, True, False, False, False] and not truncated.any()
    assert tr.lb_idx[0].tolist() == [1, 0, 3, 4, 5, 2]
    curve = coverage_curve(tr, 0.85)[0]
    assert curve.tolist() == pytest.approx([0.3, 0.8, 0.8, 0.8, 0.8, 0.9], abs=1e-6)
    assert coverage(tr, 2, 0.85).item() == pytest.approx(0.8, abs=1e-6)
    # Eq. 4
    assert fit_recovery_window(tr, 0.85, 0.75)["k_b"] == 2
    assert fit_recovery_window(tr, 0.85, 0.85)["k_b"] == 6
    w = fit_recovery_window(tr, 0.85, 0.95)
    assert w["k_b"] == 6 and not w["reached"]
    # Eq. 8 over U = C u S = {0, 1, 2, 3} for K = 3
    u = [0, 1, 2, 3]
    a, b = p_fp[u] / p_fp[u].sum(), p_lb[u] / p_lb[u].sum()
    assert local_drift(tr, 3, 0.85).item() == pytest.approx((a - b).norm().item(), abs=1e-6)
    # Eq. 9
    d = (a - b).norm().item()
    lab = risk_labels(tr, 3, alpha=0.85, eps=d - 0.01, rho_c=0.75)
    assert lab["y"].item() == 1.0
    assert risk_labels(tr, 3, alpha=0.85, eps=d + 0.01, rho_c=0.75)["y"].item() == 0.0  # not distorted enough
    assert risk_labels(tr, 3, alpha=0.85, eps=d - 0.01, rho_c=0.85)["y"].item() == 0.0  # not recoverable
    # restoring the FP logits on S (which contains C when K = 6) gives zero drift
    t = window_targets(tr, 6)
    delta = (t["z_fp"] - t["z_hat"]) + 3.0  # any common offset
    assert local_drift(tr, 6, 0.85, delta).item() == pytest.approx(0.0, abs=1e-6)
    assert t["p_fp"][0].tolist() == pytest.approx(p_fp[[1, 0, 3, 4, 5, 2]].tolist(), abs=1e-6)


def test_recovery_window_grows_with_distortion():
    k = {}
    for noise in (0.1, 1.0):
        tr = synthetic_traces(600, 256, top_m=64, noise=noise, clean_fraction=0.0, seed=3)
        k[noise] = fit_recovery_window(tr, 0.9, 0.85)["k_b"]
    assert k[0.1] < k[1.0]


def test_trace_file_round_trip(tmp_path):
    tr = synthetic_traces(50, 128, top_m=16, seed=4)
    tr.save(tmp_path / "t.safetensors")
    back = TracePairs.load(tmp_path / "t.safetensors")
    assert back.vocab_size == 128 and back.meta == tr.meta and len(back) == 50
    assert torch.equal(back.lb_z, tr.lb_z) and torch.equal(back.fp_idx, tr.fp_idx)
    a, b = tr.split(0.2, seed=0)
    assert len(a) == 40 and len(b) == 10
    assert len(TracePairs.cat([a, b])) == 50
