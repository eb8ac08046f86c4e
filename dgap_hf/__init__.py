"""dgap-hf: DGAP local distribution restoration for low-bit KV caches in Hugging Face transformers.

* `LowBitCache` / `LowBitLayer`: packed KbVc KV cache (keys per channel, values per token, BF16 statistics,
  1-bit sign mode), `dgap_hf.quantize` for the quantizers;
* `DGAPLogitsProcessor`: the runtime detector + top-K_b corrector, loaded from a `DGAPModel` artifact;
* `dgap_hf.features`, `dgap_hf.labels`, `dgap_hf.traces`, `dgap_hf.train`: features, labels, paired traces and the
  offline training that produce the artifact.
"""

from hf_common import __version__

from .cache import LowBitCache, LowBitLayer
from .lowbit_config import LowBitConfig
from .features import FEATURE_SPEC, PHI_NAMES, XI_NAMES, candidate_features, detector_features
from .models import DGAPArtifactError, DGAPCorrector, DGAPDetector, DGAPMismatchError, DGAPModel
from .precision import UnknownPrecisionError, format_precision, parse_precision
from .processor import DGAPLogitsProcessor, shipped_dgap_artifact
from .traces import TracePairs, collect_traces
from .train import TrainConfig, train_dgap

__all__ = [
    "FEATURE_SPEC",
    "PHI_NAMES",
    "XI_NAMES",
    "DGAPArtifactError",
    "DGAPCorrector",
    "DGAPDetector",
    "DGAPLogitsProcessor",
    "DGAPMismatchError",
    "DGAPModel",
    "LowBitCache",
    "LowBitConfig",
    "LowBitLayer",
    "TracePairs",
    "TrainConfig",
    "UnknownPrecisionError",
    "candidate_features",
    "collect_traces",
    "detector_features",
    "format_precision",
    "parse_precision",
    "shipped_dgap_artifact",
    "train_dgap",
]
