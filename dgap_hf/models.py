"""DGAP modules: the risk detector f_theta (Eq. 6) and the top-K_b corrector g_psi (Eq. 12), plus `DGAPModel`, the
artifact that bundles one (detector, corrector, K_b, tau) per KV precision for the Hub.

Architectures (paper Sec. 5.5, "Detector-corrector architecture"): `"linear"`, `"mlp"` (default) and
`"transformer"` (small).

* Detector: `phi [N, N_PHI] -> logit [N]`, `r = sigmoid(logit)`. The transformer variant embeds every feature as a
  token (per-feature linear embedding) plus a CLS token.
* Corrector: `(xi [N, K, N_XI], phi [N, N_PHI]) -> delta [N, K]`. Linear and MLP see the flattened window
  (`window = K` is fixed), the transformer sees one token per candidate (`[xi_k, phi]` plus a rank embedding) and
  works for any `K <= window`. The output layer starts at zero (no correction before training) and the update is
  bounded by `max_delta * tanh(. / max_delta)`.

Both normalize their inputs with stored mean/std buffers (`fit_normalization`), saved with the weights.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData, PyTorchModelHubMixin, hf_hub_download
from torch import nn

from hf_common.artifacts import check_artifact_path
from hf_common.model_config import model_identity, model_name

from .features import FEATURE_SPEC, N_PHI, N_XI
from .precision import UnknownPrecisionError, normalize_precision

ARCHS = ("linear", "mlp", "transformer")
FORMAT_VERSION = 1
LIBRARY = "gaac-hf"
TAGS = ["dgap", "kv-cache", "low-bit-quantization", "logits-processor"]


class DGAPArtifactError(ValueError):
    """A DGAP artifact is missing files, corrupt, or of another format or feature version."""


class DGAPMismatchError(ValueError):
    """A DGAP artifact was trained for another base model or vocabulary."""


def base_model_info(config) -> dict:
    """What a DGAP artifact records about its base model: name, model type, architectures and the shapes of
    `hf_common.model_config.model_identity` (checked by `DGAPLogitsProcessor.check_model`)."""
    identity = model_identity(config)
    identity.pop("architecture", None)  # recorded as the config's `architectures` list
    info = {"name": model_name(config), "model_type": getattr(config, "model_type", None),
            "architectures": list(getattr(config, "architectures", None) or []) or None, **identity}
    return {k: v for k, v in info.items() if v not in (None, "")}


def _check_arch(arch: str) -> str:
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {ARCHS}, not {arch!r}")
    return arch


def _mlp(n_in: int, hidden: int, layers: int, n_out: int) -> nn.Sequential:
    mods, width = [], n_in
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), nn.GELU()]
        width = hidden
    mods.append(nn.Linear(width, n_out))
    return nn.Sequential(*mods)


def _zero_last(module: nn.Module) -> None:
    last = [m for m in module.modules() if isinstance(m, nn.Linear)][-1]
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)


class _Normalized(nn.Module):
    def _norm_buffers(self, name: str, n: int) -> None:
        self.register_buffer(f"{name}_mean", torch.zeros(n))
        self.register_buffer(f"{name}_std", torch.ones(n))

    def _normalize(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return (x - getattr(self, f"{name}_mean")) / getattr(self, f"{name}_std")

    @staticmethod
    def _stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.reshape(-1, x.shape[-1]).float()
        return x.mean(0), x.std(0, unbiased=False).clamp_min(1e-4)


class DGAPDetector(_Normalized, PyTorchModelHubMixin, library_name=LIBRARY, tags=TAGS):
    """Risk detector f_theta: detector features `phi` -> risk logit (`risk()` applies the sigmoid)."""

    def __init__(self, n_features: int = N_PHI, arch: str = "mlp", hidden: int = 128, layers: int = 2,
                 heads: int = 4):
        super().__init__()
        self.n_features, self.arch = n_features, _check_arch(arch)
        self._norm_buffers("phi", n_features)
        if arch == "linear":
            self.net = nn.Linear(n_features, 1)
        elif arch == "mlp":
            self.net = _mlp(n_features, hidden, layers, 1)
        else:
            self.feature_weight = nn.Parameter(torch.randn(n_features, hidden) / math.sqrt(hidden))
            self.feature_bias = nn.Parameter(torch.zeros(n_features, hidden))
            self.cls = nn.Parameter(torch.zeros(1, 1, hidden))
            layer = nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.net = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 1))

    def fit_normalization(self, phi: torch.Tensor) -> "DGAPDetector":
        self.phi_mean, self.phi_std = (t.to(self.phi_mean.device) for t in self._stats(phi))
        return self

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Risk logit `[N]` of already normalized features `x` `[N, N_PHI]` (linear and MLP detectors)."""
        return self.net(x).squeeze(-1)

    def forward(self, phi: torch.Tensor) -> torch.Tensor:
        x = self._normalize("phi", phi.float())
        if self.arch != "transformer":
            return self.head(x)
        tokens = x.unsqueeze(-1) * self.feature_weight + self.feature_bias  # [N, F, h]
        tokens = torch.cat([self.cls.expand(x.shape[0], -1, -1), tokens], 1)
        return self.net(self.encoder(tokens)[:, 0]).squeeze(-1)

    def risk(self, phi: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self(phi))


class DGAPCorrector(_Normalized, PyTorchModelHubMixin, library_name=LIBRARY, tags=TAGS):
    """Top-K_b corrector g_psi: `(xi [N, K, N_XI], phi [N, N_PHI])` -> logit update `delta [N, K]`."""

    def __init__(self, window: int, n_candidate_features: int = N_XI, n_features: int = N_PHI, arch: str = "mlp",
                 hidden: int = 256, layers: int = 2, heads: int = 4, max_delta: float = 8.0):
        super().__init__()
        if window < 2:
            raise ValueError(f"window must be >= 2, not {window}")
        self.window, self.arch, self.max_delta = window, _check_arch(arch), max_delta
        self.n_candidate_features, self.n_features = n_candidate_features, n_features
        self._norm_buffers("phi", n_features)
        self._norm_buffers("xi", n_candidate_features)
        flat = window * n_candidate_features + n_features
        if arch == "linear":
            self.net = nn.Linear(flat, window)
        elif arch == "mlp":
            self.net = _mlp(flat, hidden, layers, window)
        else:
            self.embed = nn.Linear(n_candidate_features + n_features, hidden)
            self.rank = nn.Embedding(window, hidden)
            layer = nn.TransformerEncoderLayer(hidden, heads, 2 * hidden, dropout=0.0, batch_first=True,
                                               norm_first=True)
            self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.net = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 1))
        _zero_last(self.net)

    def fit_normalization(self, xi: torch.Tensor, phi: torch.Tensor) -> "DGAPCorrector":
        self.xi_mean, self.xi_std = (t.to(self.xi_mean.device) for t in self._stats(xi))
        self.phi_mean, self.phi_std = (t.to(self.phi_mean.device) for t in self._stats(phi))
        return self

    def forward(self, xi: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
        n, k, _ = xi.shape
        if k > self.window or (self.arch != "transformer" and k != self.window):
            raise ValueError(f"this {self.arch} corrector was built for a window of {self.window} candidates, "
                             f"got {k}")
        x = self._normalize("xi", xi.float())
        f = self._normalize("phi", phi.float())
        if self.arch == "transformer":
            tokens = self.embed(torch.cat([x, f.unsqueeze(1).expand(n, k, -1)], -1))
            tokens = tokens + self.rank.weight[:k]
            out = self.net(self.encoder(tokens)).squeeze(-1)
            return self._bound(out)
        return self.head(torch.cat([x.reshape(n, -1), f], -1))

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Update `[N, window]` of the already normalized flat input `x = [xi_flat, phi]` (linear and MLP)."""
        return self._bound(self.net(x))

    def _bound(self, out: torch.Tensor) -> torch.Tensor:
        return self.max_delta * torch.tanh(out / self.max_delta) if self.max_delta else out


CARD_TEMPLATE = """---
{{ card_data }}
---

# DGAP restoration layer for {{ base_model }}

DGAP (Disagreement-Guided Adaptive Precision) detects decoding steps whose local top-K candidate distribution was
distorted by low-bit KV-cache quantization and restores only the top-K_b logits before token selection. Use it with
the `gaac-hf` package:

```python
from dgap_hf import DGAPLogitsProcessor, LowBitCache
dgap = DGAPLogitsProcessor.from_pretrained({{ source }}, precision="K2V2", model_config=model.config)
out = model.generate(**inputs, cache=LowBitCache(model.config, "K2V2"), logits_processor=[dgap])
```

| precision | K_b | tau | detector | corrector |
|---|---|---|---|---|
{{ precision_rows }}

Base model: `{{ base_model }}` (vocabulary {{ vocab_size }}). Features: version {{ feature_version }}
({{ n_phi }} detector features, {{ n_xi }} candidate features). Quantizer: {{ quantizer }}.

## Training data

{{ training }}

## Results (validation traces)

{{ results }}
"""


class DGAPModel(nn.Module, PyTorchModelHubMixin, library_name=LIBRARY, tags=TAGS, model_card_template=CARD_TEMPLATE):
    """The DGAP artifact: per precision a detector, a corrector, `k_b` and `tau`, and everything `config.json`
    records about the base model, the features, the quantizer, the training data and the results.

    `precisions` maps `"K2V2"`-style names to `{"k_b": int, "tau": float, "detector": {DGAPDetector kwargs},
    "corrector": {DGAPCorrector kwargs}}`; `base_model` is `{"name", "vocab_size", "architectures", ...}`.
    On disk: `config.json`, `model.safetensors` (all weights) and a generated `README.md`.
    """

    def __init__(self, precisions: dict, base_model: dict, feature_spec: dict | None = None,
                 quantizer: dict | None = None, training: dict | None = None, results: dict | None = None,
                 label_params: dict | None = None, format_version: int = FORMAT_VERSION):
        super().__init__()
        if format_version != FORMAT_VERSION:
            raise DGAPArtifactError(f"unknown DGAP format version {format_version!r}; this package reads "
                                    f"version {FORMAT_VERSION}")
        feature_spec = dict(FEATURE_SPEC) if feature_spec is None else feature_spec
        if feature_spec != FEATURE_SPEC:
            raise DGAPArtifactError(
                f"the artifact's features (version {feature_spec.get('version')!r}) differ from this package's "
                f"(version {FEATURE_SPEC['version']}); update gaac-hf or use a matching artifact")
        if not precisions:
            raise DGAPArtifactError("a DGAP artifact needs at least one precision")
        if "vocab_size" not in (base_model or {}):
            raise DGAPArtifactError("base_model must record the vocab_size")
        self.precisions = {normalize_precision(p): dict(v) for p, v in precisions.items()}
        self.base_model = dict(base_model)
        self.feature_spec = feature_spec
        self.quantizer = dict(quantizer or {})
        self.training_info = dict(training or {})  # not `self.training`: that is nn.Module's train/eval flag
        self.results = dict(results or {})
        self.label_params = dict(label_params or {})
        self.detectors = nn.ModuleDict()
        self.correctors = nn.ModuleDict()
        for p, spec in self.precisions.items():
            for key in ("k_b", "tau", "detector", "corrector"):
                if key not in spec:
                    raise DGAPArtifactError(f"precision {p} lacks {key!r}")
            spec["k_b"], spec["tau"] = int(spec["k_b"]), float(spec["tau"])
            self.detectors[p] = DGAPDetector(**spec["detector"])
            corr = dict(spec["corrector"])
            corr.setdefault("window", spec["k_b"])
            if corr["window"] < spec["k_b"] or (corr.get("arch", "mlp") != "transformer"
                                                and corr["window"] != spec["k_b"]):
                raise DGAPArtifactError(f"precision {p}: corrector window {corr['window']} does not fit "
                                        f"K_b = {spec['k_b']}")
            spec["corrector"] = corr
            self.correctors[p] = DGAPCorrector(**corr)
        self.eval()

    @property
    def vocab_size(self) -> int:
        return int(self.base_model["vocab_size"])

    def spec(self, precision: str) -> dict:
        try:
            name = normalize_precision(precision)
        except UnknownPrecisionError as e:
            raise UnknownPrecisionError(f"{e}; this artifact has {sorted(self.precisions)}") from None
        if name not in self.precisions:
            raise UnknownPrecisionError(
                f"this DGAP artifact has no {name} models; it was trained for {sorted(self.precisions)}")
        return self.precisions[name]

    def config_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, "precisions": self.precisions, "base_model": self.base_model,
                "feature_spec": self.feature_spec, "quantizer": self.quantizer, "training": self.training_info,
                "results": self.results, "label_params": self.label_params}

    # --- Hub I/O -----------------------------------------------------------------------------------------------
    def _save_pretrained(self, save_directory: Path) -> None:
        super()._save_pretrained(save_directory)
        (save_directory / "config.json").write_text(json.dumps(self.config_dict(), indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> "DGAPModel":
        kwargs.setdefault("strict", True)
        pretrained_model_name_or_path = check_artifact_path(pretrained_model_name_or_path, "DGAP artifact")
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except json.JSONDecodeError as e:
            raise DGAPArtifactError(f"corrupt DGAP artifact {pretrained_model_name_or_path}: config.json is not "
                                    f"valid JSON ({e})") from e
        except TypeError as e:
            raise DGAPArtifactError(f"{pretrained_model_name_or_path} is not a DGAP artifact ({e})") from e

    @classmethod
    def _from_pretrained(cls, *, model_id, revision, cache_dir, force_download, local_files_only, token,
                         map_location="cpu", strict=True, **model_kwargs):
        model = cls(**model_kwargs)
        if os.path.isdir(model_id):
            path = os.path.join(model_id, "model.safetensors")
            if not os.path.isfile(path):
                raise DGAPArtifactError(f"DGAP artifact {model_id} has no model.safetensors")
        else:
            path = hf_hub_download(model_id, "model.safetensors", revision=revision, cache_dir=cache_dir,
                                   force_download=force_download, local_files_only=local_files_only, token=token)
        from safetensors.torch import load_model

        try:
            load_model(model, path, strict=strict, device=str(map_location))
        except RuntimeError as e:
            raise DGAPArtifactError(f"DGAP artifact {model_id}: weights do not match config.json ({e})") from e
        return model.eval()

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        rows = []
        for p, s in self.precisions.items():
            d, c = s["detector"], s["corrector"]
            rows.append(f"| {p} | {s['k_b']} | {s['tau']:.3f} | {d.get('arch', 'mlp')} | {c.get('arch', 'mlp')} |")
        name = self.base_model.get("name") or "unknown"

        def block(d: dict) -> str:
            return "```json\n" + json.dumps(d, indent=2, sort_keys=True) + "\n```" if d else "(not recorded)"

        data = ModelCardData(library_name=LIBRARY, tags=TAGS, base_model=name if "/" in str(name) else None)
        return ModelCard.from_template(
            card_data=data, template_str=CARD_TEMPLATE, base_model=name, vocab_size=self.vocab_size,
            precision_rows="\n".join(rows), feature_version=self.feature_spec["version"],
            n_phi=len(self.feature_spec["phi"]), n_xi=len(self.feature_spec["xi"]),
            quantizer=json.dumps(self.quantizer, sort_keys=True) if self.quantizer else "(not recorded)",
            training=block(self.training_info), results=block(self.results),
            source=f'"{kwargs["repo_id"]}"' if kwargs.get("repo_id") else "folder_or_repo_id")
