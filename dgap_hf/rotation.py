"""Fixed orthogonal rotations of the head dimension for low-bit KV (QuaRot-style Hadamard, or seeded random).

A rotation `R` (`[D, D]`, `R @ R.T = I`) mixes the channels of every key/value vector before quantization, which
spreads outlier channels over all channels; `LowBitLayer` quantizes `x @ R` and returns `x_hat @ R.T`, so any
attention reads un-rotated K/V (`q . k` and `p @ V` need no change). The rotation is rebuilt from its name, seed and
`head_dim` (recorded in the quantizer spec), never stored in an artifact.
"""

from __future__ import annotations

import functools
import math

import torch

ROTATIONS = ("none", "hadamard", "random")


def check_rotation(kind: str, head_dim: int | None) -> None:
    """Raise `ValueError` when rotation `kind` cannot be built for `head_dim`."""
    if kind not in ROTATIONS:
        raise ValueError(f"rotation must be one of {ROTATIONS}, not {kind!r}")
    if kind == "hadamard" and head_dim is not None and (head_dim <= 0 or head_dim & (head_dim - 1)):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, not {head_dim}; use rotation='random'")


@functools.lru_cache(maxsize=16)
def _rotation_cpu(kind: str, head_dim: int, seed: int) -> torch.Tensor:
    check_rotation(kind, head_dim)
    if kind == "hadamard":  # Sylvester construction, normalized
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        return (h / math.sqrt(head_dim)).float()
    if kind == "random":  # Haar-random orthogonal: QR of a seeded Gaussian, signs fixed by diag(R)
        g = torch.randn(head_dim, head_dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        q, r = torch.linalg.qr(g)
        return (q * torch.sign(torch.diagonal(r))).float()
    raise ValueError("rotation 'none' has no matrix")


def rotation_matrix(kind: str, head_dim: int, seed: int = 0, device=None) -> torch.Tensor:
    """The float32 `[head_dim, head_dim]` orthogonal matrix of rotation `kind` (`"hadamard"` or `"random"`)."""
    return _rotation_cpu(kind, int(head_dim), int(seed)).to(device)
