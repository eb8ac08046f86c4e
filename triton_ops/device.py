"""Launch helpers: run a kernel on the GPU that holds its tensors, not on the current device (with `device_map`, a
model's layers and their caches live on several GPUs; Triton launches on the current device), and tell whether
kernels run under Triton's CPU interpreter."""

import contextlib
import os

import torch


def interpreted() -> bool:
    """Triton kernels run under the CPU interpreter (`TRITON_INTERPRET=1`): no inline PTX, no BF16 tensor-core dots."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def on_device_of(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
