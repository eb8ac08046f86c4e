"""Launch helper: run a kernel on the GPU that holds its tensors, not on the current device.

With `device_map`, a model's layers (and their caches) live on several GPUs; Triton launches on the current device.
"""

import contextlib

import torch


def on_device_of(t: torch.Tensor):
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
