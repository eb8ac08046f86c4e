"""Synthetic paired logits for tests and demos: the low-bit side is a perturbation of the FP side.

FP logits follow a Zipf law with a random exponent per row (`z = -a log(rank) + small noise`, token ids shuffled),
so the FP mass is concentrated on a few candidates as in real language models. The low-bit side is
`z_hat = (1 - gamma) z_fp + noise`: a per-row flattening (as low-bit keys blur attention scores) plus Gaussian logit
noise, which reorders near-tied candidates. A fraction of rows is left nearly clean.
"""

from __future__ import annotations

import torch

from .traces import TracePairs


def synthetic_logits(n_rows: int, vocab_size: int = 256, *, flatten: tuple[float, float] = (0.2, 0.5),
                     noise: float = 0.3, clean_fraction: float = 0.3, clean_noise: float = 0.02,
                     exponent: tuple[float, float] = (1.0, 3.0), fp_noise: float = 0.3,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """`(fp_logits, low_bit_logits)`, each float32 `[n_rows, vocab_size]`."""
    g = torch.Generator().manual_seed(seed)
    a = exponent[0] + (exponent[1] - exponent[0]) * torch.rand(n_rows, 1, generator=g)
    ranks = torch.argsort(torch.rand(n_rows, vocab_size, generator=g), -1).float()
    fp = -a * torch.log1p(ranks) + fp_noise * torch.randn(n_rows, vocab_size, generator=g)
    gamma = flatten[0] + (flatten[1] - flatten[0]) * torch.rand(n_rows, 1, generator=g)
    clean = torch.rand(n_rows, 1, generator=g) < clean_fraction
    gamma = torch.where(clean, torch.zeros_like(gamma), gamma)
    sigma = torch.where(clean, torch.full_like(gamma, clean_noise), torch.full_like(gamma, noise))
    lb = (1 - gamma) * fp + sigma * torch.randn(n_rows, vocab_size, generator=g)
    return fp, lb


def synthetic_traces(n_rows: int, vocab_size: int = 256, top_m: int = 32, **kwargs) -> TracePairs:
    fp, lb = synthetic_logits(n_rows, vocab_size, **kwargs)
    return TracePairs.from_logits(fp, lb, top_m, meta={"base_model": "synthetic", "source": "dgap_hf.synthetic",
                                                       **{k: str(v) for k, v in kwargs.items()}})
