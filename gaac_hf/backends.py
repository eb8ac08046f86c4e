"""Which kernels serve a device (`backend_of`: the CUDA C++ package `gaac_cuda`, Triton, or the torch reference) and
the launch plans the decode attention reads (`DecodePlan`, made once per shape: FlashInfer's plan/run split; the
CUDA kernel's own plans, `cuda_plan`); what the fused kernels cover (`fused_serves`, `fused_reads`); the lengths
tensor an eager step's layers share (`device_lengths`); the slot layouts by capacity or row size, made once."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from .format import BLOCK_TOKENS, TileLayout

try:  # the CUDA C++ kernels (a separate package); absent: Triton on CUDA
    import gaac_cuda
except ImportError:
    gaac_cuda = None

# Slot layouts, made once per shape (the eager step asks per layer): by escape capacity, by a pool's row size.
tile_layout = functools.lru_cache(maxsize=None)(TileLayout)
slot_layout = functools.lru_cache(maxsize=None)(TileLayout.of_slot_bytes)


def backend_of(device: torch.device) -> str:
    """`"gaac_cuda"`, `"triton"` or `"torch"`: which kernels serve tensors on `device`. The one place that decides.

    `GAAC_HF_BACKEND=triton` runs the Triton kernels on CPU tensors too (under `TRITON_INTERPRET=1`: the tests
    check the CUDA path's ops end to end that way)."""
    device = torch.device(device)
    forced = os.environ.get("GAAC_HF_BACKEND")
    if forced:
        if forced not in ("torch", "triton", "gaac_cuda"):
            raise ValueError(f"GAAC_HF_BACKEND must be torch, triton or gaac_cuda, not {forced!r}")
        return forced
    if device.type != "cuda":
        return "torch"
    return _cuda_backend(str(device), os.environ.get("GAAC_HF_CUDA_KERNEL"))


@functools.lru_cache(maxsize=None)
def _cuda_backend(device: str, kernel_switch: str | None) -> str:
    """The CUDA device's backend, asked once per device and `GAAC_HF_CUDA_KERNEL` value (an eager step asks per
    layer; the capability and NVRTC lookups cost more than the rest of the decision)."""
    return "gaac_cuda" if gaac_cuda is not None and gaac_cuda.available(device) else "triton"


# --- plan --------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodePlan:
    """Launch decisions for one shape, made once (at cache construction), not per step."""

    batch: int
    kv_heads: int
    max_blocks: int
    head_dim: int
    device: str
    splits: int


def splits(batch: int, kv_heads: int, max_blocks: int, device, head_dim: int = 128) -> int:
    """Split count of the decode attention over at most `max_blocks` blocks (1 for the torch reference); cached
    (an eager decode step asks once per layer)."""
    device = torch.device(device)
    return _splits(int(batch), int(kv_heads), int(max_blocks), str(device), int(head_dim), backend_of(device))


@functools.lru_cache(maxsize=4096)
def _splits(batch: int, kv_heads: int, max_blocks: int, device: str, head_dim: int, backend: str) -> int:
    device = torch.device(device)
    if not fused_serves(head_dim):
        return 1
    if backend == "gaac_cuda":  # the CUDA kernel's split count depends on the shape alone (host arithmetic)
        return gaac_cuda.plan(batch, kv_heads, 1, head_dim, max_blocks * BLOCK_TOKENS, device, plain=True).nsplit
    if backend == "triton":
        from triton_ops.gaac_attention import num_splits

        return num_splits(batch * kv_heads, max_blocks, device)
    return 1


_LENGTHS: dict = {}  # the last (batch, length, device) of `device_lengths` and its tensor


def device_lengths(batch: int, length: int, device) -> torch.Tensor:
    """int32 `[batch]` filled with `length` on `device`, for the kernels to read (never written): the layers of one
    eager decode step share one (one allocation and fill per step instead of per layer). Inside a CUDA graph capture
    a fresh one each time (a kept tensor would be freed under the graph, a captured one belongs to it)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # neither kept nor reused in a capture
        return torch.full((batch,), length, dtype=torch.int32, device=device)
    key = (batch, length, str(device))
    t = _LENGTHS.get(key)
    if t is None:
        _LENGTHS.clear()
        t = _LENGTHS[key] = torch.full((batch,), length, dtype=torch.int32, device=device)
    return t


@functools.lru_cache(maxsize=None)
def _plan(batch: int, kv_heads: int, max_blocks: int, head_dim: int, device: str) -> DecodePlan:
    return DecodePlan(batch, kv_heads, max_blocks, head_dim, device,
                      splits(batch, kv_heads, max_blocks, device, head_dim))


def plan(batch: int, kv_heads: int, max_blocks: int, head_dim: int, device) -> DecodePlan:
    """The `DecodePlan` of a shape (cached: the same shape always gets the same plan)."""
    return _plan(int(batch), int(kv_heads), int(max_blocks), int(head_dim), str(torch.device(device)))


@functools.lru_cache(maxsize=None)
def cuda_plan(batch, kv_heads, rep, head_dim, max_blocks, slot_bytes, plain, nsplit, device, format_version=1):
    # format version 2 as stored (fragment order) is what the kernel calls its format 3
    return gaac_cuda.plan(batch, kv_heads, rep, head_dim, max_blocks * BLOCK_TOKENS, torch.device(device),
                          slot_bytes=slot_bytes, plain=plain, nsplit=nsplit,
                          format_version=3 if format_version == 2 else 1)


FUSED_HEAD_DIMS = (64, 128, 256)  # what the fused kernels (CUDA, Triton) cover; other head dims use the reference


def fused_serves(head_dim: int) -> bool:
    """The fused decode kernels cover this head dim (one 64- or 128-channel tile per head, or two of 128). Other
    multiples of 16 (Phi-2's 80, Phi-3-mini's 96, ...) take the torch reference attention over tiles decoded by the
    expand kernel: bit-exact the same way (compressed and plain KV through the same code), but eager only on CUDA
    (it reads the lengths on the host, so a CUDA graph cannot capture it)."""
    return head_dim in FUSED_HEAD_DIMS


# Format version 2 (docs/format.md): the CUDA kernel reads it at these head dims (one 64- or 128-channel tile in
# fragment order); the Triton attention kernels read version 1 only, and the torch reference reads both.
CUDA_V2_HEAD_DIMS = (64, 128)


def cuda_serves(query: torch.Tensor, kv_heads: int, format_version: int = 1) -> bool:
    """The CUDA kernel covers this shape (at most 8 query heads per kv-head, head_dim 64/128/256; format version 2:
    64/128); else Triton (format version 1) or the torch reference."""
    return query.shape[1] // kv_heads <= gaac_cuda.MAX_GROUP_HEADS and fused_serves(query.shape[-1]) and (
        format_version == 1 or query.shape[-1] in CUDA_V2_HEAD_DIMS)


def fused_reads(format_version: int, head_dim: int, group_heads: int, device) -> bool:
    """A fused kernel (capturable, no host synchronization) reads this storage on `device`: what a static cache
    needs, and what `GAACCache`'s choice of format version asks before it picks version 2."""
    if not fused_serves(head_dim):
        return False
    backend = backend_of(device)
    if format_version == 1:
        return backend != "torch"
    return (backend == "gaac_cuda" and head_dim in CUDA_V2_HEAD_DIMS and group_heads <= gaac_cuda.MAX_GROUP_HEADS)
