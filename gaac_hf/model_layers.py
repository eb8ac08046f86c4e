"""What GAAC needs to know about a model's layers: the helpers of `hf_common.model_config` (their one home, shared
with `dgap_hf`), under the names `gaac_hf` modules import."""

from hf_common.model_config import KVGeometry, cache_kwarg, kv_geometry, layer_types_and_kwargs, text_config

__all__ = ["KVGeometry", "cache_kwarg", "kv_geometry", "layer_types_and_kwargs", "text_config"]
