"""`DGAPLogitsProcessor`: the DGAP runtime (paper Fig. 3, Eq. 2, 6, 11-13) as a `transformers.LogitsProcessor`.

Every call, for all rows at once and without host-device synchronization:

1. `S = TopK(scores, K_b)` and the features `phi` (detector) and `xi` (candidates) from the scores;
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

import torch
from transformers import LogitsProcessor

from hf_common.artifacts import SHIPPED_DGAP, shipped_artifact
from hf_common.model_config import identity_mismatches, warn_if_other_name

from .features import candidate_features, detector_features_from_top, full_vocab_stats
from .models import DGAPMismatchError, DGAPModel
from .precision import normalize_precision

NORMALIZED_ATOL = 1e-3


def shipped_dgap_artifact(name: str = SHIPPED_DGAP):
    """Folder of the DGAP artifact shipped with the package (SmolLM2-135M-Instruct, every precision)."""
    return shipped_artifact(name)


class DGAPLogitsProcessor(LogitsProcessor):
    """Detect risky steps and restore their top-K_b logits (see the module docstring).

    `model` is a `DGAPModel`; `precision` picks its detector, corrector, `K_b` and `tau` (override those with
    `tau=` / `k_b=`; a fixed-window corrector only accepts its own `K_b`). Pass `model_config` (the base model's
    config) to check the artifact against the model up front (`check_model`); the vocabulary size is checked on every
    call anyway. `stats()` reports how many rows were corrected (kept as device counters, read on demand).
    """

    def __init__(self, model: DGAPModel, precision: str = "K2V2", *, tau: float | None = None,
                 k_b: int | None = None, model_config=None):
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
        self._corrected = None
        self._rows = 0
        if model_config is not None:
            self.check_model(model_config)

    # --- construction / Hub ------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, repo_or_path, precision: str = "K2V2", *, model_config=None, tau: float | None = None,
                        k_b: int | None = None, **hub_kwargs) -> "DGAPLogitsProcessor":
        """Load a DGAP artifact (Hub repo id or local folder) and pick one precision's models."""
        model = DGAPModel.from_pretrained(repo_or_path, **hub_kwargs)
        return cls(model, precision, tau=tau, k_b=k_b, model_config=model_config)

    def save_pretrained(self, save_directory, **kwargs):
        """Save the whole artifact (all precisions): `config.json`, `model.safetensors`, `README.md`."""
        return self.model.save_pretrained(save_directory, **kwargs)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Push the whole artifact to the Hub (`huggingface_hub` `push_to_hub`; the card gets `repo_id`)."""
        kwargs.setdefault("model_card_kwargs", {"repo_id": repo_id})
        return self.model.push_to_hub(repo_id, **kwargs)

    def to(self, device) -> "DGAPLogitsProcessor":
        self.model.to(device)
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
    @torch.no_grad()
    def restore(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(new_scores, risk [N], corrected [N] bool)` for scores `[N, V]` (see the module docstring)."""
        self._check_scores(scores)
        if self.detector.phi_mean.device != scores.device:
            self.model.to(scores.device)
        lse_in, entropy = full_vocab_stats(scores)
        vals, idx = scores.topk(self.k_b, -1)
        phi = detector_features_from_top(vals, lse_in, entropy, self.k_b, scores.shape[-1])
        xi = candidate_features(vals, lse_in)
        risk = self.detector.risk(phi)
        corrected = risk > self.tau
        delta = self.corrector(xi, phi)
        new_vals = torch.where(corrected.unsqueeze(-1), (vals.float() + delta).to(scores.dtype), vals)
        out = scores.scatter(-1, idx, new_vals)
        renorm = corrected & (lse_in.abs() < NORMALIZED_ATOL)
        lse_out = torch.logsumexp(out.float(), -1, keepdim=True)
        out = torch.where(renorm.unsqueeze(-1), (out.float() - lse_out).to(scores.dtype), out)
        return out, risk, corrected

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        out, _, corrected = self.restore(scores)
        n = corrected.sum()  # stays on the device: no synchronization per step
        self._corrected = n if self._corrected is None else self._corrected + n
        self._rows += corrected.numel()
        return out

    def stats(self) -> dict:
        """Rows seen and corrected since construction / `reset_stats()` (reads the device counters)."""
        rows = self._rows
        corrected = 0 if self._corrected is None else int(self._corrected)
        return {"precision": self.precision, "k_b": self.k_b, "tau": self.tau, "rows": rows, "corrected": corrected,
                "correction_rate": corrected / rows if rows else float("nan")}

    def reset_stats(self) -> None:
        self._corrected, self._rows = None, 0
