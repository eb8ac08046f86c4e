"""Pre-RoPE key quantization (KVQuant's observation) without patching models.

`cache.update` receives post-RoPE keys: token `p` of a key channel pair `(i, i + d/2)` (transformers' `rotate_half`
layout) is the pre-RoPE pair rotated by the angle `p * inv_freq[i]`, so a channel's values oscillate along the
sequence and a per-channel group of 128 tokens spans the pair's whole circle. `LowBitLayer` with
`LowBitConfig(pre_rope_keys=True)` rotates each key back by the angle of its own index in the cache before
quantizing, and forward again after dequantizing. This is a per-token orthogonal map, applied and undone with the
same angles, so the attention reads post-RoPE keys as before whatever the angles are; they only decide how well the
keys quantize. They are the model's own when the cache index is the position (no left padding); a left-padded row
is shifted by its padding, i.e. its stored keys are the pre-RoPE keys turned by one fixed angle per channel pair,
which quantize just as well. Sinks and the full-precision residual are stored as they arrive.

The frequencies come from the model config (`rope_parameters` / `rope_theta`, `partial_rotary_factor`, and
transformers' RoPE initializers for scaled types).
"""

from __future__ import annotations

import torch

from hf_common.model_config import kv_geometry, text_config


def _rope_parameters(tc) -> dict:
    params = getattr(tc, "rope_parameters", None)
    if isinstance(params, dict) and "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type parameters (Gemma 3 style): the full-attention ones
    if not isinstance(params, dict):
        params = dict(getattr(tc, "rope_scaling", None) or {})
        if getattr(tc, "rope_theta", None) is not None:
            params.setdefault("rope_theta", tc.rope_theta)
    return params


def rope_inv_freq(model_config, head_dim: int | None = None) -> torch.Tensor:
    """float32 `[rotary_dim / 2]` inverse frequencies of the model's RoPE (rotary_dim <= head_dim, by default the
    config's KV head dim).

    Raises `ValueError` when the config has no RoPE parameters (a model without rotary embeddings has no pre-RoPE
    keys to quantize)."""
    tc = text_config(model_config)
    params = _rope_parameters(tc)
    theta = params.get("rope_theta")
    if theta is None:
        raise ValueError(f"pre_rope_keys needs the model's RoPE parameters; the {type(tc).__name__} config has no "
                         f"rope_theta / rope_parameters")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type != "default":
        try:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq = ROPE_INIT_FUNCTIONS[rope_type](tc, "cpu")[0]
            return inv_freq.float().flatten()
        except Exception:  # noqa: BLE001 - an initializer we cannot call: the unscaled frequencies (quality only)
            pass
    factor = float(params.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", 1.0)) or 1.0)
    rot = int((head_dim or kv_geometry(model_config).head_dim) * factor) // 2 * 2
    return (1.0 / (float(theta) ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))).float()


def _angles(start: int, stop: int, inv_freq: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin `[stop - start, len(inv_freq)]` of the angles `p * inv_freq`, p = start .. stop - 1
    (products in float64, so every position's values are the same whatever range they are computed in)."""
    pos = torch.arange(start, stop, dtype=torch.float64, device=device)
    ang = pos[:, None] * inv_freq.to(device=device, dtype=torch.float64)[None]
    return ang.cos().float(), ang.sin().float()


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    half = cos.shape[-1]
    if inverse:
        sin = -sin
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], -1)


def rope_rotate(x: torch.Tensor, start: int, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`x` `[B, H, S, D]` (float32) with token `s` turned by `(start + s) * inv_freq` (`rotate_half` pairs
    `(i, i + r/2)` of the first `r = 2 * len(inv_freq)` channels), or back by it with `inverse`."""
    if inv_freq.numel() == 0 or x.shape[-2] == 0:
        return x
    return _turn(x, *_angles(start, start + x.shape[-2], inv_freq, x.device), inverse)


class RopeTable:
    """`rope_rotate` with the cos/sin of positions 0 .. n - 1 kept (grown by doubling) instead of recomputed: a
    `LowBitLayer` turns its whole quantized prefix forward on every read. Same values as `rope_rotate`."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq
        self._cos = self._sin = None

    def rotate(self, x: torch.Tensor, start: int, inverse: bool = False) -> torch.Tensor:
        stop = start + x.shape[-2]
        if self.inv_freq.numel() == 0 or stop == start:
            return x
        if self._cos is None or self._cos.device != x.device or self._cos.shape[0] < stop:
            n = max(stop, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            self._cos, self._sin = _angles(0, n, self.inv_freq, x.device)
        return _turn(x, self._cos[start:stop], self._sin[start:stop], inverse)
