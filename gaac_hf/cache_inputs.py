"""What both GAAC caches (`GAACCache`, `GAACStaticCache`) check of their inputs and choose from them: the KV dtype,
the calibration (an object, a path or a Hub id) and the model config it must match, the format version of the
stored slots; and the name of the attention that reads them."""

from __future__ import annotations

import torch

from . import ops
from .calibration import GAACCalibration

GAAC_ATTENTION_NAME = "gaac"
# Most tiles given to one `encode_tiles` call (bounds the encoder's temporary memory on long prompts).
ENCODE_MAX_TILES = 8192


def check_kv_dtype(key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    for name, t in (("key", key_states), ("value", value_states)):
        if t.dtype != torch.bfloat16:
            raise TypeError(
                f"GAACCache stores BF16 KV losslessly; the model produced {name} states of dtype {t.dtype}. "
                "Load the model with dtype=torch.bfloat16, or use DynamicCache for other dtypes."
            )


def resolve_calibration(calibration, what: str, **hub_kwargs) -> GAACCalibration:
    """A `GAACCalibration`, or one loaded from a path / Hub id; a clear `TypeError` for anything else."""
    if isinstance(calibration, str) or hasattr(calibration, "__fspath__"):
        calibration = GAACCalibration.from_pretrained(str(calibration), **hub_kwargs)
    if isinstance(calibration, GAACCalibration):
        return calibration
    raise TypeError(f"{what} takes as calibration a GAACCalibration or the path / Hub id of one, not "
                    f"{type(calibration).__name__}")


STORAGE_VERSIONS = (1, 2)


def check_storage_format(calibration: GAACCalibration, format_version: int | None, what: str) -> None:
    """Check that a cache that stores `format_version` (None: chosen per device) can code with `calibration`.
    Version 2 codes against windows that start at even exponents, which only a version-2 calibration has (version-1
    windows moved down to even starts cost much of the saving: 27.9% -> 22.5% resident on SmolLM2's held-out KV,
    benchmarks/results/tied_windows_s14_converted.json, against 27.6% for windows calibrated even). Version 1 reads
    any windows."""
    if format_version not in (None, *STORAGE_VERSIONS):
        raise ValueError(f"{what} stores GAAC format version 1 or 2 (None: chosen per device), not {format_version!r}")
    if format_version == 2 and calibration.config.format_version != 2:
        raise ValueError(
            f"{what}(format_version=2) needs a format-version-2 calibration (windows that start at even exponents); "
            f"this one is version {calibration.config.format_version}: calibrate with `gaac-hf calibrate "
            "--format-version 2` (or `calibrate(..., format_version=2)`); `calibration.convert(2)` moves its windows "
            "down instead, at a cost in ratio")


def choose_format(requested: int | None, calibration: GAACCalibration, head_dim: int, group_heads: int,
                  device) -> int:
    """The format version a cache layer stores on `device`: `requested`, or (None) version 2 where a fused kernel
    reads it (the CUDA kernel on Hopper, head_dim 64/128) and the calibration's windows are even (a version-2
    calibration: `gaac-hf calibrate --format-version 2`), else version 1."""
    if requested is not None:
        return requested
    even = calibration.config.format_version == 2
    return 2 if even and ops.fused_reads(2, head_dim, group_heads, device) else 1


def _is_model_config(x) -> bool:
    from transformers import PretrainedConfig

    return isinstance(x, PretrainedConfig)


def config_and_calibration(what: str, args: tuple, config, calibration):
    """Sort `GAACCache(config, calibration)`, `GAACCache(calibration, config=...)`, keywords, by type."""
    for arg in args:
        if _is_model_config(arg) and config is None:
            config = arg
        elif isinstance(arg, (GAACCalibration, str)) or hasattr(arg, "__fspath__"):
            if calibration is not None:
                raise TypeError(f"{what} got two calibrations")
            calibration = arg
        else:
            raise TypeError(f"{what} takes a model config (transformers PretrainedConfig) and a GAACCalibration "
                            f"(or the path / Hub id of one); got a {type(arg).__name__} positional argument")
    if config is None or not _is_model_config(config):
        raise TypeError(f"{what} needs the model config (transformers PretrainedConfig) as config, got "
                        f"{type(config).__name__}")
    if calibration is None:
        raise TypeError(f"{what} needs a calibration: {what}(config, calibration)")
    return config, resolve_calibration(calibration, what)
