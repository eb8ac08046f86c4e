"""gaac-hf: lossless GAAC KV-cache compression for Hugging Face transformers.

Importing the package registers the `"gaac"` attention (and its mask function) with transformers.
"""

from hf_common import __version__

from .attention import gaac_attention_forward, gaac_decode_attention
from .cache import GAACCache, GAACLayer
from .captured_step import CapturedStep
from .calibration import (
    CalibrationConfig, CalibrationMismatchError, CorruptArtifactError, GAACCalibration, shipped_calibration,
)
from .compile_settings import compile_config, compile_kwargs
from .default_model import load_default_model
from .format import FORMAT_VERSION
from .static_cache import GAACCacheFullError, GAACPoolOverflowError, GAACStaticCache, PlainStaticCache


__all__ = [
    "FORMAT_VERSION",
    "CalibrationConfig",
    "CapturedStep",
    "CalibrationMismatchError",
    "CorruptArtifactError",
    "compile_config",
    "compile_kwargs",
    "GAACCache",
    "GAACCalibration",
    "GAACCacheFullError",
    "GAACPoolOverflowError",
    "GAACStaticCache",
    "GAACLayer",
    "gaac_attention_forward",
    "gaac_decode_attention",
    "load_default_model",
    "PlainStaticCache",
    "shipped_calibration",
]
