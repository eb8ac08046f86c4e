"""gaac-hf: lossless GAAC KV-cache compression for Hugging Face transformers."""

from .calibration import CalibrationConfig, CalibrationMismatchError, CorruptArtifactError, GAACCalibration
from .format import FORMAT_VERSION

__all__ = [
    "FORMAT_VERSION",
    "CalibrationConfig",
    "CalibrationMismatchError",
    "CorruptArtifactError",
    "GAACCalibration",
]
