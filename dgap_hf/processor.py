"""`DGAPLogitsProcessor`: the DGAP runtime (paper Fig. 3, Eq. 2, 6, 11-13) as a `transformers.LogitsProcessor`.

Every call, for all rows at once and without host-device synchronization:

1. `S = TopK(scores, K_b)` and the features `phi` (detector) and `xi` (candidates) from the scores, in one fused
   pass (`fused_features.py`; `features.py` is the definition, `reference_restore` the step computed from it; on
   CUDA all four steps are six Triton kernels, `kernel_step.py`);
2. `r = sigmoid(f_theta(phi))`;
3. `delta = g_psi(xi, phi)` on the `[N, K_b]` window of every row, kept only where `r > tau` (a mask, not a
   Python branch: the corrector is evaluated on the K_b slice of all rows and discarded for the others, which
   keeps the step free of data-dependent control flow);
4. the window is merged back with a scatter. Rows with `r <= tau` get their own values back, so they are
   bit-identical to the input, and tokens outside `S` are never touched.

Beam search hands processors log-softmax scores. Rows whose input is normalized (`|logsumexp| < 1e-3`, detected
per row) are renormalized after a correction, so they stay log-probabilities (which shifts every entry of a corrected
row by the same constant); the features are shift-invariant, so raw logits and log-probabilities give the same
risk and update. Assisted decoding calls processors once per candidate position; the processor is stateless, so
that is fine.
"""

from __future__ import annotations

import warnings

import torch
from transformers import LogitsProcessor

from hf_common.artifacts import SHIPPED_DGAP, shipped_artifact
from hf_common.model_config import identity_mismatches, warn_if_other_name

from .features import N_PHI, candidate_features, detector_features_from_top, full_vocab_stats
from .fused_features import WindowConstants, fused_runtime_features, split_row
from .kernel_step import KernelStep, kernel_serves
from .models import DGAPMismatchError, DGAPModel
from .precision import normalize_precision

NORMALIZED_ATOL = 1e-3
MAX_GRAPHS = 8  # captured CUDA graphs per processor (one per scores shape / dtype / device), then eager


def shipped_dgap_artifact(name: str = SHIPPED_DGAP):
    """Folder of the DGAP artifact shipped with the package (SmolLM2-135M-Instruct, every precision)."""
    return shipped_artifact(name)


class DGAPLogitsProcessor(LogitsProcessor):
    """Detect risky steps and restore their top-K_b logits (see the module docstring).

    `model` is a `DGAPModel`; `precision` picks its detector, corrector, `K_b` and `tau` (override those with
    `tau=` / `k_b=`; a fixed-window corrector only accepts its own `K_b`). Pass `model_config` (the base model's
    config) to check the artifact against the model up front (`check_model`); the vocabulary size is checked on every
    call anyway. `stats()` reports how many rows were corrected (kept as device counters, read on demand).

    On CUDA the step is six Triton kernels (`kernel_step.py`; linear / MLP models; `triton=False`, or a kernel that
    fails to build, with a warning, gives the torch step), and each call replays a CUDA graph of the whole step,
    captured on the first call of each scores shape (`cuda_graph=False` runs the kernels one by one); inside a step
    that is itself being captured or compiled the step runs without its own graph (the Triton step as one custom
    operator), which is capturable and compiles with `fullgraph=True`. The Triton step agrees with the torch step
    within float32 rounding (the torch step on the CPU is bit-identical to `reference_restore`); graph and eager
    calls of either give the same bits.
    """

    def __init__(self, model: DGAPModel, precision: str = "K2V2", *, tau: float | None = None,
                 k_b: int | None = None, model_config=None, cuda_graph: bool = True, triton: bool = True):
        spec = model.spec(precision)
        self.model = model.eval()
        self.precision = normalize_precision(precision)
        self.detector = model.detectors[self.precision]
        self.corrector = model.correctors[self.precision]
        self.tau = float(spec["tau"] if tau is None else tau)
        self.k_b = int(spec["k_b"] if k_b is None else k_b)
        if self.k_b < 2:
            raise ValueError(f"K_b must be >= 2, not {self.k_b}")
        if self.k_b > self.corrector.window or (self.corrector.arch != "transformer"
                                                and self.k_b != self.corrector.window):
            raise ValueError(f"the {self.precision} corrector works on a window of {self.corrector.window} "
                             f"candidates; K_b = {self.k_b} does not fit")
        self.cuda_graph = bool(cuda_graph)
        self.triton = bool(triton)
        self._graphs = {}  # (shape, dtype, device) -> (CUDAGraph, static input, static output)
        self._prepared = None  # (WindowConstants, the corrector's flat normalization or None), on the device
        self._kernel = None  # the Triton step (`kernel_step.KernelStep`) on CUDA, where it serves these models
        self._corrected = None  # device counter of corrected rows
        self._rows = 0
        if model_config is not None:
            self.check_model(model_config)

    # --- construction / Hub ------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, repo_or_path, precision: str = "K2V2", *, model_config=None, tau: float | None = None,
                        k_b: int | None = None, cuda_graph: bool = True, triton: bool = True,
                        **hub_kwargs) -> "DGAPLogitsProcessor":
        """Load a DGAP artifact (Hub repo id or local folder) and pick one precision's models."""
        model = DGAPModel.from_pretrained(repo_or_path, **hub_kwargs)
        return cls(model, precision, tau=tau, k_b=k_b, model_config=model_config, cuda_graph=cuda_graph,
                   triton=triton)

    def save_pretrained(self, save_directory, **kwargs):
        """Save the whole artifact (all precisions): `config.json`, `model.safetensors`, `README.md`."""
        return self.model.save_pretrained(save_directory, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Push the whole artifact to the Hub (`huggingface_hub` `push_to_hub`; the card gets `repo_id`)."""
        kwargs.setdefault("model_card_kwargs", {"repo_id": repo_id})
        return self.model.push_to_hub(repo_id, **kwargs)

    def to(self, device) -> "DGAPLogitsProcessor":
        self.model.to(device)
        self._graphs.clear()
        self._prepared = None
        return self

    # --- checks ------------------------------------------------------------------------------------------------
    def check_model(self, config) -> None:
        """Raise `DGAPMismatchError` unless the artifact was trained for a model with this config: the same
        architecture and shapes (`hf_common.model_config.identity_mismatches`, as `GAACCalibration.check_model`).
        Another name (repo id) only warns: a local copy or a converted checkpoint of the same model is fine."""
        base = self.model.base_model
        expected = {**base, "vocab_size": self.model.vocab_size}
        if base.get("architectures"):
            expected["architecture"] = base["architectures"][0]
        problems = identity_mismatches(expected, config)
        if problems:
            raise DGAPMismatchError(
                f"DGAP artifact for {base.get('name') or 'an unnamed model'} does not fit this model: it has "
                + "; ".join(problems))
        warn_if_other_name(base.get("name"), config, "the DGAP artifact")

    def _check_scores(self, scores: torch.Tensor) -> None:
        if scores.dim() != 2:
            raise ValueError(f"scores must be [batch, vocab], got shape {tuple(scores.shape)}")
        if scores.shape[-1] != self.model.vocab_size:
            raise DGAPMismatchError(
                f"scores have {scores.shape[-1]} vocabulary entries; the DGAP artifact was trained for "
                f"{self.model.base_model.get('name') or 'a model'} with {self.model.vocab_size}")

    # --- runtime -----------------------------------------------------------------------------------------------
    def _prepare(self, device: torch.device) -> None:
        """Move the models to `device` and build the window constants, the shared normalization, the device
        counter and, on CUDA, the Triton step there (host side, once per device)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device: prepare once
            device = torch.device("cuda", torch.cuda.current_device())
        if self.detector.phi_mean.device != device:
            self.model.to(device)
            self._graphs.clear()
        if self._prepared is not None and self._prepared[0].device == device:
            return
        norm = None
        if self.corrector.arch != "transformer":
            c = self.corrector  # the normalization of its flat input [xi_flat, phi], the tail of the fused row
            norm = (torch.cat([c.xi_mean.repeat(self.k_b), c.phi_mean]),
                    torch.cat([c.xi_std.repeat(self.k_b), c.phi_std]))
        self._prepared = (WindowConstants(self.k_b, device), norm)
        self._kernel = self._kernel_step(norm) if device.type == "cuda" and self.triton else None
        old = self._corrected
        self._corrected = torch.zeros((), dtype=torch.long, device=device) if old is None else old.to(device)

    def _kernel_step(self, norm) -> KernelStep | None:
        """The Triton step for these models, or None (transformer models, a window past `MAX_K`, no Triton)."""
        if not kernel_serves(self.detector, self.corrector, self.k_b):
            return None
        try:
            import triton_ops.dgap_merge  # noqa: F401 - Triton present and importable
        except ImportError:
            return None
        return KernelStep(self.detector, self.corrector, self.k_b, norm)

    @torch.no_grad()
    def restore(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(new_scores, risk [N], corrected [N] bool)` for scores `[N, V]` (see the module docstring); the
        features come from `fused_features` (bit-identical to `features.py`) or, on CUDA, the Triton step."""
        self._check_scores(scores)
        self._prepare(scores.device)
        return self._restore(scores)

    def _restore(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`restore` for scores already checked, on the prepared device (the per-step path: no host checks)."""
        if self._kernel is not None:
            if torch.compiler.is_compiling():
                return self._kernel(scores, self.tau, NORMALIZED_ATOL)  # one custom operator
            result = self._kernel_or_none(scores)
            if result is not None:
                return result
        consts, norm = self._prepared
        row, vals, idx, lse_in = fused_runtime_features(scores, consts)
        phi, xi = split_row(row, self.k_b)
        risk = self.detector.risk(phi)
        if norm is not None:
            delta = self.corrector.head((row[:, N_PHI:] - norm[0]) / norm[1])
        else:
            delta = self.corrector(xi, phi)
        return self._merge(scores, vals, idx, lse_in, risk, delta)

    @torch.no_grad()
    def reference_restore(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`restore` computed feature by feature with `features.py` and the modules' `forward` (many more kernels):
        the reference that tests and `benchmarks/dgap_overhead.py` compare the fused step with."""
        self._check_scores(scores)
        self._prepare(scores.device)
        lse_in, entropy = full_vocab_stats(scores)
        vals, idx = scores.topk(self.k_b, -1)
        phi = detector_features_from_top(vals, lse_in, entropy, self.k_b, scores.shape[-1])
        xi = candidate_features(vals, lse_in)
        return self._merge(scores, vals, idx, lse_in, self.detector.risk(phi), self.corrector(xi, phi))

    def _merge(self, scores, vals, idx, lse_in, risk, delta):
        corrected = risk > self.tau
        new_vals = torch.where(corrected.unsqueeze(-1), (vals.float() + delta).to(scores.dtype), vals)
        out = scores.scatter(-1, idx, new_vals)
        renorm = (corrected & (lse_in.abs() < NORMALIZED_ATOL)).unsqueeze(-1)
        out_f = out.float()
        out = torch.where(renorm, (out_f - torch.logsumexp(out_f, -1, keepdim=True)).to(scores.dtype), out)
        return out, risk, corrected

    def _kernel_or_none(self, scores: torch.Tensor, counter: torch.Tensor | None = None):
        """The Triton step's result, or None when it failed to build or launch here (a Triton version that cannot
        compile a kernel, say): warned once, and the torch step serves from then on."""
        try:
            return self._kernel(scores, self.tau, NORMALIZED_ATOL, counter)
        except Exception as e:  # noqa: BLE001 - the torch step computes the same thing
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise
            warnings.warn(f"DGAPLogitsProcessor: the Triton step failed ({type(e).__name__}: {e}); running the "
                          "torch step instead")
            self._kernel = None
            return None

    def _step(self, scores: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None and not torch.compiler.is_compiling():
            result = self._kernel_or_none(scores, self._corrected)  # counted by the merge kernel
            if result is not None:
                return result[0]
        out, _, corrected = self._restore(scores)
        self._corrected.add_(corrected.sum())  # stays on the device: no synchronization per step
        return out

    def _use_graph(self, scores: torch.Tensor) -> bool:
        return (self.cuda_graph and scores.is_cuda and not torch.compiler.is_compiling()
                and not torch.cuda.is_current_stream_capturing())

    def _graphed_step(self, scores: torch.Tensor) -> torch.Tensor:
        """`_step` replayed from a CUDA graph captured on the first call of each scores shape / dtype / device
        (the same kernels, so the same results; one launch instead of one per kernel)."""
        key = (tuple(scores.shape), scores.dtype, scores.device)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._graphs) >= MAX_GRAPHS:
                return self._step(scores)
            with torch.cuda.device(scores.device):
                entry = self._capture(key, scores)
            if entry is None:
                return self._step(scores)
        graph, static_in, static_out = entry
        static_in.copy_(scores)
        graph.replay()
        return static_out.clone()

    def _capture(self, key, scores: torch.Tensor):
        """Capture `_step` for `scores`' shape / dtype on its (current) device; None if the capture fails."""
        static_in = scores.clone()
        saved = self._corrected.clone()
        current = torch.cuda.current_stream(scores.device)
        side = torch.cuda.Stream(scores.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm-up outside the capture (cuBLAS workspaces, allocator)
            for _ in range(2):
                self._step(static_in)
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                static_out = self._step(static_in)
        except RuntimeError as e:  # capture refused (e.g. an op of this build is not capturable): stay eager
            warnings.warn(f"DGAPLogitsProcessor: CUDA graph capture failed ({e}); running eagerly")
            self.cuda_graph = False
            self._corrected.copy_(saved)
            return None
        self._corrected.copy_(saved)  # the warm-up calls were not decode steps
        self._graphs[key] = (graph, static_in, static_out)
        return self._graphs[key]

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self._check_scores(scores)
        self._prepare(scores.device)
        out = self._graphed_step(scores) if self._use_graph(scores) else self._step(scores)
        self._rows += scores.shape[0]
        return out

    def stats(self) -> dict:
        """Rows seen and corrected since construction / `reset_stats()` (reads the device counter)."""
        rows = self._rows
        corrected = 0 if self._corrected is None else int(self._corrected)
        return {"precision": self.precision, "k_b": self.k_b, "tau": self.tau, "rows": rows, "corrected": corrected,
                "correction_rate": corrected / rows if rows else float("nan")}

    def reset_stats(self) -> None:
        self._rows = 0
        if self._corrected is not None:
            self._corrected.zero_()  # in place: captured graphs keep counting into it
