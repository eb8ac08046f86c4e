"""`GAACCalibration`: the calibrated exponent windows and slot capacity of one model, as a Hub artifact.

On disk (a local folder or a Hub repo): `config.json` (a `CalibrationConfig`), `windows.safetensors` (uint8
`base3` and `base4`, each `[calibrated layers, 2 (K|V), kv_heads, head_dim]`) and a generated `README.md`.
Loading reads JSON and safetensors only; nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from huggingface_hub import ModelCard, ModelCardData, ModelHubMixin, hf_hub_download
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hf_common.artifacts import SHIPPED_CALIBRATION, check_artifact_path, shipped_artifact
from hf_common.model_config import identity_mismatches, kv_geometry, model_name, warn_if_other_name

from .format import BLOCK_TOKENS, FORMAT_VERSION, GROUP_SIZE, TileLayout, tile_split

READABLE_VERSIONS = (1, 2)  # 2: the byte-split slots (docs/format.md): even windows

WINDOWS_FILE = "windows.safetensors"
CONFIG_FILE = "config.json"


def shipped_calibration(name: str = SHIPPED_CALIBRATION) -> Path:
    """Folder of the GAAC calibration shipped with the package (SmolLM2-135M-Instruct), for `from_pretrained`."""
    return shipped_artifact(name)


class CalibrationMismatchError(ValueError):
    """The calibration was made for a model of another shape."""


class CorruptArtifactError(ValueError):
    """A calibration artifact is truncated, corrupted or of an unknown format."""


@dataclass
class CalibrationConfig:
    """Everything `config.json` records about a calibration."""

    format_version: int = FORMAT_VERSION
    base_model: str | None = None
    architecture: str | None = None
    num_hidden_layers: int | None = None
    layers: list[int] = field(default_factory=list)  # the full-attention layers that were calibrated
    num_kv_heads: int | None = None
    head_dim: int | None = None
    block_tokens: int = BLOCK_TOKENS
    group_size: int = GROUP_SIZE
    grouping: str = "token"
    escape_capacity: int | None = None
    slot_bytes: int | None = None
    corpus: str = ""
    corpus_tokens: int = 0
    prompt_tokens: int = 0
    measured: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.format_version not in READABLE_VERSIONS:
            raise CorruptArtifactError(
                f"unknown GAAC format version {self.format_version!r}; this gaac-hf reads versions "
                f"{', '.join(map(str, READABLE_VERSIONS))}"
            )
        for name in ("base_model", "num_hidden_layers", "num_kv_heads", "head_dim", "escape_capacity"):
            if getattr(self, name) is None:
                raise CorruptArtifactError(f"calibration config lacks the field {name!r}")
        if (self.block_tokens, self.group_size, self.grouping) != (BLOCK_TOKENS, GROUP_SIZE, "token"):
            raise CorruptArtifactError(
                f"calibration uses blocks of {self.block_tokens}, groups of {self.group_size} ({self.grouping}); "
                f"format version {self.format_version} has {BLOCK_TOKENS}, {GROUP_SIZE} (token)"
            )
        _, channels = tile_split(self.head_dim)
        self.slot_bytes = TileLayout(channels, self.escape_capacity).slot_bytes

    @property
    def tile_channels(self) -> int:
        return tile_split(self.head_dim)[1]


CARD_TEMPLATE = """---
{{ card_data }}
---

# GAAC calibration for {{ base_model }}

Exponent windows and slot capacity for GAAC (Group-Adaptive Additive Codec) lossless KV-cache compression with
the `gaac-hf` Python package (format version {{ format_version }}). Use it with

```python
from gaac_hf import GAACCache
cache = GAACCache.from_pretrained({{ source }}, config=model.config)  # checks the model first
out = model.generate(**inputs, cache=cache)
```

| field | value |
|---|---|
| base model | `{{ base_model }}` ({{ architecture }}) |
| calibrated layers | {{ n_layers }} full-attention layers of {{ num_hidden_layers }}, {{ num_kv_heads }} KV heads, head_dim {{ head_dim }} |
| slot | {{ slot_bytes }} bytes per 16 x {{ tile_channels }} tile, escape capacity {{ escape_capacity }} bytes |
| corpus | {{ corpus }} |
| tokens | {{ corpus_tokens }} in prompts of {{ prompt_tokens }} |

Measured on the calibration corpus and on held-out text:

{{ measured_table }}

Compression is lossless whatever the data: windows calibrated on other text change the ratio, never the values.
"""


class GAACCalibration(
    ModelHubMixin,
    library_name="gaac-hf",
    tags=["gaac", "kv-cache", "lossless-compression"],
    model_card_template=CARD_TEMPLATE,
):
    """Per (layer, K|V, kv-head, channel) exponent windows plus the slot's escape capacity."""

    def __init__(self, config: CalibrationConfig, base3: torch.Tensor | None = None,
                 base4: torch.Tensor | None = None):
        self.config = config
        shape = (len(config.layers), 2, config.num_kv_heads, config.head_dim)
        for name, t in (("base3", base3), ("base4", base4)):
            if t is None:
                raise CorruptArtifactError(f"calibration has no {name} windows")
            if t.dtype != torch.uint8 or tuple(t.shape) != shape:
                raise CorruptArtifactError(
                    f"{name} windows have dtype {t.dtype} and shape {tuple(t.shape)}; expected uint8 {shape}"
                )
        if int(base3.max()) > 256 - 8 or int(base4.max()) > 256 - 16:
            raise CorruptArtifactError("calibration windows reach past exponent 255")
        if config.format_version == 2 and bool(((base3 | base4) & 1).any()):
            raise CorruptArtifactError("a format-version-2 calibration has windows that start at odd exponents")
        self.base3, self.base4 = base3.contiguous(), base4.contiguous()
        self._layer_rows = {layer: i for i, layer in enumerate(config.layers)}

    def convert(self, format_version: int) -> "GAACCalibration":
        """This calibration for another format version. Windows are format-independent, except that version 2
        starts them at even exponents: to 2, each window moves down to the even start at or below it (it then
        covers one exponent less at the top, so the sizes measured for version 1 no longer hold and are dropped;
        measured on SmolLM2's held-out KV, the resident saving falls from 27.9% to 22.5%, against 27.6% for windows
        calibrated even: recalibrate with `format_version=2` where the data is at hand); to 1, they are kept as
        they are."""
        if format_version not in READABLE_VERSIONS:
            raise ValueError(f"format version {format_version}: this gaac-hf knows versions "
                             f"{', '.join(map(str, READABLE_VERSIONS))}")
        cfg = CalibrationConfig(**{**asdict(self.config), "format_version": format_version})
        if format_version == self.config.format_version:
            return GAACCalibration(cfg, self.base3.clone(), self.base4.clone())
        if format_version == 2:
            cfg.measured = {"converted": f"from format version {self.config.format_version}: windows moved down to "
                                         "even starts, sizes not re-measured"}
            return GAACCalibration(cfg, self.base3 & 0xFE, self.base4 & 0xFE)
        return GAACCalibration(cfg, self.base3.clone(), self.base4.clone())

    # --- use ---------------------------------------------------------------------------------------------------
    def windows(self, layer_idx: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """`(base3, base4)` of one layer, each uint8 `[2 (K|V), kv_heads, head_dim]`."""
        if layer_idx not in self._layer_rows:
            raise KeyError(f"layer {layer_idx} was not calibrated (calibrated: {self.config.layers})")
        row = self._layer_rows[layer_idx]
        return self.base3[row].to(device), self.base4[row].to(device)

    def check_model(self, model_config) -> None:
        """Raise `CalibrationMismatchError` unless this calibration fits a model with `model_config`: the same
        architecture and shapes (`hf_common.model_config.identity_mismatches`, as the DGAP check) and the same
        full-attention layers. Another name (repo id) only warns."""
        cfg = self.config
        expected = {"architecture": cfg.architecture, "num_hidden_layers": cfg.num_hidden_layers,
                    "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
        problems = identity_mismatches(expected, model_config)
        full = list(kv_geometry(model_config).full_attention_layers)
        if full != list(cfg.layers):
            problems.append(f"full-attention layers {full} (the artifact expects {cfg.layers})")
        if problems:
            name = model_name(model_config) or "this model"
            raise CalibrationMismatchError(
                f"GAAC calibration for {cfg.base_model} does not fit {name}: the model has " + "; ".join(problems)
            )
        warn_if_other_name(cfg.base_model, model_config, "the GAAC calibration")

    def __repr__(self) -> str:
        cfg = self.config
        return (f"GAACCalibration(base_model={cfg.base_model!r}, layers={len(cfg.layers)} of "
                f"{cfg.num_hidden_layers}, kv_heads={cfg.num_kv_heads}, head_dim={cfg.head_dim}, "
                f"slot_bytes={cfg.slot_bytes}, escape_capacity={cfg.escape_capacity}, format_version="
                f"{cfg.format_version})")

    # --- Hub I/O -----------------------------------------------------------------------------------------------
    def _save_pretrained(self, save_directory: Path) -> None:
        cfg = asdict(self.config)
        (save_directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        meta = {"format_version": str(self.config.format_version), "base_model": str(self.config.base_model)}
        save_file({"base3": self.base3, "base4": self.base4}, str(save_directory / WINDOWS_FILE), metadata=meta)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, **kwargs) -> "GAACCalibration":
        """Load from a local folder or a Hub repo id (`shipped_calibration()` is the shipped SmolLM2 one)."""
        pretrained_model_name_or_path = check_artifact_path(pretrained_model_name_or_path, "GAAC calibration")
        try:
            return super().from_pretrained(pretrained_model_name_or_path, **kwargs)
        except json.JSONDecodeError as e:
            raise CorruptArtifactError(
                f"corrupt GAAC calibration {pretrained_model_name_or_path}: {CONFIG_FILE} is not valid JSON ({e})"
            ) from e
        except TypeError as e:  # config.json whose fields do not fit CalibrationConfig
            raise CorruptArtifactError(f"corrupt GAAC calibration {pretrained_model_name_or_path}: {e}") from e

    @classmethod
    def _from_pretrained(cls, *, model_id, revision, cache_dir, force_download, local_files_only, token,
                         config=None, **kwargs) -> "GAACCalibration":
        if config is None:
            raise CorruptArtifactError(f"GAAC calibration {model_id} has no {CONFIG_FILE}")
        if isinstance(config, dict):
            config = CalibrationConfig(**config)
        if os.path.isdir(model_id):
            path = os.path.join(model_id, WINDOWS_FILE)
            if not os.path.isfile(path):
                raise CorruptArtifactError(f"GAAC calibration {model_id} has no {WINDOWS_FILE}")
        else:
            path = hf_hub_download(model_id, WINDOWS_FILE, revision=revision, cache_dir=cache_dir,
                                   force_download=force_download, local_files_only=local_files_only, token=token)
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise CorruptArtifactError(f"corrupt GAAC calibration {model_id}: cannot read {WINDOWS_FILE} ({e})") from e
        return cls(config, tensors.get("base3"), tensors.get("base4"))

    def generate_model_card(self, *args, **kwargs) -> ModelCard:
        cfg = self.config
        rows = ["| data | codec ratio | codec bit/elt | resident bit/elt | resident saving |", "|---|---|---|---|---|"]
        for name, m in cfg.measured.items():
            if isinstance(m, dict) and "codec_ratio" in m:
                rows.append(f"| {name} | {m['codec_ratio']:.3f}x | {m['codec_bits']:.3f} | {m['resident_bits']:.3f} "
                            f"| {100 * m['resident_saving']:.1f}% |")
        data = ModelCardData(library_name="gaac-hf", tags=["gaac", "kv-cache", "lossless-compression"],
                             base_model=cfg.base_model if "/" in str(cfg.base_model) else None)
        values = {k: v for k, v in asdict(cfg).items() if k != "measured"}
        repo_id = kwargs.pop("repo_id", None)
        source = f'"{repo_id}"' if repo_id else "folder_or_repo_id"  # this folder, or the repo it is pushed to
        values.update(n_layers=len(cfg.layers), tile_channels=cfg.tile_channels, measured_table="\n".join(rows),
                      source=source)
        return ModelCard.from_template(card_data=data, template_str=CARD_TEMPLATE, **values)
