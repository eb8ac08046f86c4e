"""The processor's step as six Triton kernels (`triton_ops/dgap_*.py`), for CUDA: the vocabulary pass and the window
features (2), the detector and corrector MLPs side by side (one kernel per layer: 3 for the shipped MLPs), the
decision and merge (1), instead of the ~120 kernels of the torch step. The semantics are `DGAPLogitsProcessor`'s:
rows with `risk <= tau` come back bit-identical, corrected rows change only in their top-K_b entries (all of them if
renormalized), no host synchronization, capturable in a CUDA graph; under `torch.compile` it is one custom operator
(`dgap::kernel_restore`), so `fullgraph=True` holds.

Against the torch step (`fused_features.py` + the modules): the log-partition, the entropy and the MLPs' dot products
are sums in another order, so features, risk and update agree within float32 rounding, not bit for bit (a risk within
rounding of tau can fall on the other side); the window is the same set of logits, and among equal logits at the
window's edge the lowest token index is taken (`torch.topk` leaves that order open). The corrector's update is bounded
with `tanh` written as exponentials (~1e-7 absolute off torch's). Linear and MLP detectors / correctors only (the
transformer ones keep the torch step).
"""

from __future__ import annotations

import torch
from torch import nn

from .features import FEATURE_SPEC, N_PHI
from .models import DGAPCorrector, DGAPDetector

BLOCK = 2048  # logits per program of the vocabulary pass and of the merge
MAX_K = 64  # the window's candidates per program of the vocabulary pass stay in registers


def kernel_serves(detector: DGAPDetector, corrector: DGAPCorrector, k: int) -> bool:
    """Whether the Triton step computes these models: linear or MLP (GELU) nets, a window of at most `MAX_K`."""
    if k > MAX_K or detector.arch == "transformer" or corrector.arch == "transformer":
        return False
    for net in (detector.net, corrector.net):
        mods = [net] if isinstance(net, nn.Linear) else list(net)
        if not all(isinstance(m, nn.GELU if i % 2 else nn.Linear) for i, m in enumerate(mods)) or len(mods) % 2 == 0:
            return False
        if any(isinstance(m, nn.GELU) and m.approximate != "none" for m in mods):
            return False
    return True


def _layers(net: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    mods = [net] if isinstance(net, nn.Linear) else [m for m in net if isinstance(m, nn.Linear)]
    return [(m.weight, m.bias) for m in mods]


class KernelStep:
    """The processor step for one (detector, corrector, K_b, corrector normalization) on one device.

    It holds references to the modules' own weights (no copies: later in-place updates are seen, as by a captured
    graph). `__call__(scores, tau, atol, counter=None) -> (new scores, risk, corrected)`: rows with `|lse| < atol`
    count as log-probabilities; with `counter` (int64 scalar) the corrected rows are added to it on the device."""

    def __init__(self, detector: DGAPDetector, corrector: DGAPCorrector, k: int,
                 corrector_norm: tuple[torch.Tensor, torch.Tensor]):
        if not kernel_serves(detector, corrector, k):
            raise ValueError(f"the Triton step computes linear / MLP models with K_b <= {MAX_K}; got a "
                             f"{detector.arch} detector, a {corrector.arch} corrector and K_b = {k}")
        self.k = k
        self.detector = _layers(detector.net)
        self.corrector = _layers(corrector.net)
        self.detector_norm = (detector.phi_mean, detector.phi_std)
        self.corrector_norm = tuple(corrector_norm)
        self.max_delta = float(corrector.max_delta or 0.0)

    def tensors(self) -> list[torch.Tensor]:
        """Weights and normalizations flat, in the order `kernel_restore` reads them."""
        flat = [t for pair in self.detector + self.corrector for t in pair]
        return flat + list(self.detector_norm) + list(self.corrector_norm)

    def __call__(self, scores: torch.Tensor, tau: float, atol: float, counter: torch.Tensor | None = None,
                 block: int = BLOCK):
        if torch.compiler.is_compiling():
            if counter is not None:
                raise ValueError("under torch.compile the step counts in tensor code (the operator mutates nothing)")
            return torch.ops.dgap.kernel_restore(scores, self.tensors(), len(self.detector), self.k, tau,
                                                 self.max_delta, atol, block)
        return kernel_restore(scores, self.tensors(), len(self.detector), self.k, tau, self.max_delta, atol, block,
                              counter)


def kernel_restore(scores: torch.Tensor, tensors: list[torch.Tensor], detector_layers: int, k: int, tau: float,
                   max_delta: float, atol: float, block: int, counter: torch.Tensor | None = None):
    """`(new scores, risk [N], corrected [N] bool)` of `scores` `[N, V]` (see the module docstring); `tensors`:
    `KernelStep.tensors()`."""
    from triton_ops.dgap_merge import merge_window
    from triton_ops.dgap_mlp import mlp_pair
    from triton_ops.dgap_window import window_features

    if scores.shape[0] == 0:  # no rows: nothing to launch
        return scores.clone(), scores.new_empty(0, dtype=torch.float32), scores.new_empty(0, dtype=torch.bool)
    pairs = [(tensors[2 * i], tensors[2 * i + 1]) for i in range((len(tensors) - 4) // 2)]
    det_norm, cor_norm = tuple(tensors[-4:-2]), tuple(tensors[-2:])
    row, window, tokens, stats = window_features(scores, k, FEATURE_SPEC["floor"], FEATURE_SPEC["near_top_nats"],
                                                 FEATURE_SPEC["tail_mass_floor"], block)
    logit, delta = mlp_pair(row[:, :N_PHI], pairs[:detector_layers], det_norm, row[:, N_PHI:],
                            pairs[detector_layers:], cor_norm)
    return merge_window(scores, window, tokens, stats, logit, delta, tau, max_delta, atol, counter, block)


@torch.library.custom_op("dgap::kernel_restore", mutates_args=())
def _kernel_restore_op(scores: torch.Tensor, tensors: list[torch.Tensor], detector_layers: int, k: int, tau: float,
                       max_delta: float, atol: float, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernel_restore(scores, tensors, detector_layers, k, tau, max_delta, atol, block)


@_kernel_restore_op.register_fake
def _(scores, tensors, detector_layers, k, tau, max_delta, atol, block):
    n = scores.shape[0]
    return (torch.empty_like(scores, memory_format=torch.contiguous_format),
            scores.new_empty(n, dtype=torch.float32), scores.new_empty(n, dtype=torch.bool))
