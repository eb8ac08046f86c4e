"""The processor's Triton step (`dgap_hf/kernel_step.py`, `triton_ops/dgap_*.py`) against the torch step, under
TRITON_INTERPRET=1 on small shapes (and on CUDA where there is one): the window and its features, the two MLPs, the
merge; the same rows corrected, rows below tau bit-identical, values within float32 rounding (one bfloat16 step for
bfloat16 scores); ties at the window's edge go to the lowest token; one custom operator under torch.compile."""

import os
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops is imported

from dgap_hf import DGAPLogitsProcessor  # noqa: E402
from dgap_hf.features import FEATURE_SPEC, N_PHI, PHI_NAMES, candidate_features, detector_features_from_top, \
    full_vocab_stats  # noqa: E402
from dgap_hf.fused_features import WindowConstants, fused_runtime_features  # noqa: E402
from dgap_hf.kernel_step import KernelStep, kernel_serves  # noqa: E402
from dgap_hf.processor import NORMALIZED_ATOL  # noqa: E402
from hf_common.testing import same_bits  # noqa: E402
from triton_ops import dgap_merge, dgap_mlp, dgap_window  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_dgap_fused_step import artifact, awkward_scores  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 128  # 8 slices of a 1,000-token vocabulary, the last one partial
TAIL = PHI_NAMES.index("log_tail_mass")
WELL_CONDITIONED = [0, 2, 3, 4, 5]  # awkward_scores' rows but the peaked one (its log tail mass is 1 - m at ulp scale)


def window(scores, k):
    return dgap_window.window_features(scores, k, FEATURE_SPEC["floor"], FEATURE_SPEC["near_top_nats"],
                                       FEATURE_SPEC["tail_mass_floor"], block=BLOCK)


def kernel_processor(detector="mlp", corrector="mlp", k_b=8, tau=0.5):
    proc = DGAPLogitsProcessor(artifact(k_b=k_b, detector=detector, corrector=corrector, tau=tau), "K2V2").to(DEVICE)
    proc._prepare(torch.device(DEVICE))
    proc._kernel = KernelStep(proc.detector, proc.corrector, proc.k_b, proc._prepared[1])
    return proc


def torch_step(proc, scores):
    """The processor's torch step on the same inputs (what the kernels replace)."""
    kernel, proc._kernel = proc._kernel, None
    try:
        return proc.restore(scores)
    finally:
        proc._kernel = kernel


def kernel_step(proc, scores, counter=None):
    return proc._kernel(scores, proc.tau, NORMALIZED_ATOL, counter, block=BLOCK)


def assert_close_scores(a, b, dtype):
    """Same infinities, finite entries within float32 rounding (a rounding flip for bfloat16 scores), compared
    row by row in sorted order: where logits tie in the window, `torch.topk` may hand the k-th update to another of
    the tied tokens (test_ties_at_the_window_edge_take_the_lowest_tokens checks the kernels' order)."""
    a, b = a.float().sort(-1).values, b.float().sort(-1).values
    assert torch.equal(torch.isfinite(a), torch.isfinite(b)) and torch.equal(a[~torch.isfinite(a)],
                                                                              b[~torch.isfinite(b)])
    fin = torch.isfinite(a)
    rtol, atol = (2 ** -6, 1e-5) if dtype == torch.bfloat16 else (1e-5, 2e-5)  # bf16: a rounding flip, 2^-8..2^-7
    torch.testing.assert_close(a[fin], b[fin], rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 7, 18])
def test_window_features_match_the_torch_features(k, dtype):
    scores = awkward_scores(device=DEVICE).to(dtype)
    row, win, tok, stats = window(scores, k)
    row0, vals0, _, lse0 = fused_runtime_features(scores.cpu(), WindowConstants(k, "cpu"))
    row, win, tok, stats = row.cpu(), win.cpu(), tok.cpu(), stats.cpu()
    assert same_bits(win[:, :k], vals0.float())  # the window: the same logits, sorted
    stable = scores.cpu().float().sort(dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(tok[:, :k], stable)  # ... and among equal logits the lowest tokens (row 4: 64 ties)
    torch.testing.assert_close(stats[:, 0], lse0, rtol=0, atol=2e-6)
    tail = [TAIL, row.shape[1] - N_PHI + TAIL]
    others = [c for c in range(row.shape[1]) if c not in tail]
    torch.testing.assert_close(row[:, others], row0[:, others], rtol=1e-5, atol=1e-5)
    # log(1 - m) is ill-conditioned where m -> 1 (the peaked row): the tail mass itself agrees
    torch.testing.assert_close(row[:, tail].exp(), row0[:, tail].exp(), rtol=1e-4, atol=2e-7)
    assert row0[1, TAIL] < -13  # the peaked row is in that regime
    # the mass outside the window, relative to exp(max): what renormalizing a corrected row needs
    z = scores.cpu().float()
    outside = torch.ones_like(z, dtype=torch.bool).scatter(-1, stable, False)
    top = z.amax(-1, keepdim=True)
    torch.testing.assert_close(stats[:, 2], torch.where(outside, (z - top).exp(), 0).sum(-1), rtol=1e-5, atol=0)


@pytest.mark.parametrize("layers", [(0, 0), (1, 2), (2, 1)])
def test_mlp_pair_matches_the_modules(layers):
    g = torch.Generator().manual_seed(0)
    nets = [dgap_mlp_net(24, 40, layers[0], 5, g), dgap_mlp_net(30, 48, layers[1], 7, g)]
    x = torch.randn(3, 54, generator=g)
    norms = [(torch.randn(24, generator=g), torch.rand(24, generator=g) + 0.5),
             (torch.randn(30, generator=g), torch.rand(30, generator=g) + 0.5)]
    cols = [slice(0, 24), slice(24, 54)]
    pairs = [[(m.weight.to(DEVICE), m.bias.to(DEVICE)) for m in net if isinstance(m, torch.nn.Linear)]
             for net in nets]
    xd = x.to(DEVICE)
    got = dgap_mlp.mlp_pair(xd[:, cols[0]], pairs[0], [t.to(DEVICE) for t in norms[0]], xd[:, cols[1]], pairs[1],
                            [t.to(DEVICE) for t in norms[1]])
    for net, col, (mean, std), out in zip(nets, cols, norms, got):
        with torch.no_grad():
            expected = net((x[:, col] - mean) / std)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


def dgap_mlp_net(n_in, hidden, layers, n_out, g):
    from dgap_hf.models import _mlp

    net = _mlp(n_in, hidden, layers, n_out)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return net


@pytest.mark.parametrize("detector,corrector", [("mlp", "mlp"), ("linear", "linear"), ("linear", "mlp")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_step_matches_the_torch_step(detector, corrector, dtype):
    proc = kernel_processor(detector, corrector)
    scores = awkward_scores(seed=1, device=DEVICE).to(dtype)[WELL_CONDITIONED]
    risk0 = torch_step(proc, scores)[1]
    ranked = risk0.sort().values
    proc.tau = float((ranked[1] + ranked[2]) / 2)  # three of five rows above tau, away from it
    out0, risk0, fixed0 = torch_step(proc, scores)
    out, risk, fixed = kernel_step(proc, scores)
    torch.testing.assert_close(risk, risk0, rtol=1e-5, atol=1e-6)
    assert torch.equal(fixed, fixed0) and int(fixed.sum()) == 3
    assert torch.equal(out[~fixed], scores[~fixed])  # below tau: the input's bits
    assert_close_scores(out, out0, dtype)
    window = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, scores.float().topk(8, -1).indices, True)
    normalized = torch.logsumexp(scores.float(), -1).abs() < 1e-3
    keep = ~window & ~normalized.unsqueeze(-1)
    assert torch.equal(out[keep], scores[keep])  # outside the window only a renormalization moves a logit
    assert not torch.equal(out[fixed], scores[fixed])


def test_corrected_log_probabilities_stay_normalized():
    proc = kernel_processor(tau=-1.0)  # every row corrected
    scores = awkward_scores(seed=3, device=DEVICE)[WELL_CONDITIONED]
    out, _, fixed = kernel_step(proc, scores)
    assert fixed.all()
    out0 = torch_step(proc, scores)[0]
    assert_close_scores(out, out0, torch.float32)
    lse = torch.logsumexp(out.float(), -1)
    assert abs(float(lse[2])) < 1e-5  # the log-softmax row (awkward row 3) is renormalized
    assert float(lse[0].abs()) > 1  # the raw logits are not


def test_ties_at_the_window_edge_take_the_lowest_tokens():
    proc = kernel_processor(tau=-1.0)
    scores = torch.randn(2, 1000, generator=torch.Generator().manual_seed(4))
    scores[:, 100:140] = 9.0  # 40 equal logits at the top, a window of 8
    out = kernel_step(proc, scores.to(DEVICE))[0].cpu()
    changed = (out != scores).nonzero()[:, 1].unique()
    assert torch.equal(changed, torch.arange(100, 108))
    # against the torch step given the same window (stable top-k): the same values
    vals, idx = scores.sort(dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :8], idx[:, :8]
    lse, entropy = full_vocab_stats(scores)
    with torch.no_grad():
        phi = detector_features_from_top(vals, lse, entropy, 8, 1000)
        delta = proc.corrector.cpu()(candidate_features(vals, lse), phi)
    expected = scores.scatter(-1, idx, vals + delta)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-5)


def test_kernel_step_counts_on_the_device_and_restore_does_not():
    proc = kernel_processor(tau=0.65)
    scores = awkward_scores(seed=2, device=DEVICE)
    fixed = proc.restore(scores)[2]
    assert int(proc._corrected) == 0 and 0 < int(fixed.sum()) < len(fixed)
    out = proc(None, scores)
    assert proc.stats()["corrected"] == int(fixed.sum()) and proc.stats()["rows"] == len(fixed)
    assert same_bits(out, proc.restore(scores)[0])
    empty = proc(None, scores[:0])
    assert empty.shape == (0, scores.shape[1]) and proc.stats()["corrected"] == int(fixed.sum())


def test_kernel_step_is_six_launches_for_the_shipped_mlps():
    """Vocabulary pass, window features, one launch per MLP layer for both MLPs (3 for 2 hidden layers), merge."""
    proc = DGAPLogitsProcessor(artifact(k_b=8), "K2V2")
    for c in (proc.detector, proc.corrector):
        c.net = __import__("dgap_hf.models", fromlist=["_mlp"])._mlp(c.net[0].in_features, 16, 2,
                                                                       c.net[-1].out_features)
    proc.to(DEVICE)
    proc._prepare(torch.device(DEVICE))
    proc._kernel = KernelStep(proc.detector, proc.corrector, proc.k_b, proc._prepared[1])
    kernels = [dgap_window._vocab_pass_kernel, dgap_window._window_kernel, dgap_mlp._dense_pair_kernel,
               dgap_merge._merge_kernel]
    launches = []
    originals = [k.run for k in kernels]
    with mock.patch.multiple(type(kernels[0]), run=lambda self, *a, **kw: (
            launches.append(self), originals[kernels.index(self)](*a, **kw))[1]):
        kernel_step(proc, awkward_scores(device=DEVICE))
    assert [kernels.index(k) for k in launches] == [0, 1, 2, 2, 2, 3]


def test_kernel_step_serves_linear_and_mlp_models_only():
    plain = DGAPLogitsProcessor(artifact(), "K2V2")
    assert kernel_serves(plain.detector, plain.corrector, plain.k_b)
    assert not kernel_serves(plain.detector, plain.corrector, 65)
    tr = DGAPLogitsProcessor(artifact(detector="transformer", corrector="transformer"), "K2V2")
    assert not kernel_serves(tr.detector, tr.corrector, tr.k_b)
    with pytest.raises(ValueError, match="linear / MLP"):
        KernelStep(tr.detector, tr.corrector, tr.k_b, (torch.zeros(1), torch.ones(1)))
    plain.restore(awkward_scores())
    assert plain._kernel is None  # the CPU runs the torch step
    with pytest.raises(ValueError, match="K_b <= vocabulary"):
        dgap_window.window_features(torch.zeros(1, 4), 8, 50.0, 1.0, 1e-12)


def test_a_failing_triton_step_falls_back_to_the_torch_step():
    proc = kernel_processor(tau=0.65)
    scores = awkward_scores(seed=2, device=DEVICE)
    expected = torch_step(proc, scores)[0]
    with mock.patch.object(dgap_window, "window_features", side_effect=RuntimeError("PTX for this GPU failed")):
        with pytest.warns(UserWarning, match="PTX for this GPU failed"):
            out = proc(None, scores)
    assert proc._kernel is None and same_bits(out, expected)
    assert proc.stats()["corrected"] == int(torch_step(proc, scores)[2].sum())  # counted once, by the torch step


def test_kernel_step_compiles_as_one_operator():
    proc = kernel_processor(tau=0.65)
    scores = awkward_scores(seed=2, device=DEVICE)
    expected = kernel_step(proc, scores)
    torch._dynamo.reset()
    step = torch.compile(lambda s: proc._kernel(s, proc.tau, NORMALIZED_ATOL, block=BLOCK), fullgraph=True,
                         backend="eager")
    got = step(scores)
    for a, b in zip(got, expected):
        assert same_bits(a, b)
    with pytest.raises(Exception, match="counts in tensor code"):
        torch.compile(lambda s: proc._kernel(s, proc.tau, NORMALIZED_ATOL, proc._corrected), fullgraph=True,
                      backend="eager")(scores)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_processor_runs_the_kernels_in_its_graph(dtype):
    graphed = DGAPLogitsProcessor(artifact(tau=0.65), "K2V2").to("cuda")
    plain = DGAPLogitsProcessor(artifact(tau=0.65), "K2V2", cuda_graph=False).to("cuda")
    torch_proc = DGAPLogitsProcessor(artifact(tau=0.65), "K2V2", cuda_graph=False, triton=False).to("cuda")
    for seed in range(3):
        scores = awkward_scores(seed=seed, device="cuda").to(dtype)[WELL_CONDITIONED]
        a, b = graphed(None, scores), plain(None, scores)
        assert same_bits(a, b), seed  # the graph replays the eager kernels' bits
        assert plain._kernel is not None and torch_proc._kernel is None
        out0, _, fixed0 = torch_proc.restore(scores)
        assert torch.equal(plain.restore(scores)[2], fixed0), seed
        assert_close_scores(a, out0, dtype)
    assert len(graphed._graphs) == 1
    assert graphed.stats() == plain.stats() and 0 < graphed.stats()["corrected"] < graphed.stats()["rows"]
