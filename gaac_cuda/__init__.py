"""CUDA C++ kernels of gaac-hf, compiled at first use with NVRTC (no CUDA toolkit needed).

Kernel sources live in `kernels/`, thin launchers beside them; nothing here knows transformers. Importing the package
touches no GPU: `available(device)` tells whether the kernels can run there (a Hopper GPU with NVRTC found).
"""

from .decode_attention import (ESCAPE_SLACK, MAX_GROUP_HEADS, DecodePlan, available, decode_attention,
                               plain_decode_attention, plan, trace_size)

__all__ = ["ESCAPE_SLACK", "MAX_GROUP_HEADS", "DecodePlan", "available", "decode_attention", "plain_decode_attention",
           "plan", "trace_size"]
