"""transformers' `QuantizedCache` (quanto / HQQ backends) as a baseline for `LowBitCache`, with its bytes counted the
same way as `LowBitCache.stats()`.

`QuantizedCache` keeps up to `residual_length` recent tokens in the model dtype and, each time that residual fills,
dequantizes everything, appends the residual and quantizes it all again (groups of `q_group_size` along one axis,
one scale and one zero-point per group). `quantized_cache_stats` counts its packed codes at their bit width and each
statistic at 2 bytes (BF16, what a BF16 model stores; a float32 run stores them at 4), and reports the
full-precision residual (at most 128 tokens) apart, as `bytes["residual"]`.
"""

from __future__ import annotations

from .lowbit_config import RESIDUAL_WINDOW

BACKENDS = ("quanto", "hqq")
STAT_BYTES = 2  # BF16 scale / zero-point


def quantized_cache(config, backend: str = "quanto", nbits: int = 2, q_group_size: int = 64,
                    residual_length: int = 128, axis_key: int = 0, axis_value: int = 0):
    """A transformers `QuantizedCache` (the arguments are its own). Raises `ValueError` for a backend that is not
    installed or bits it does not support."""
    from transformers import QuantizedCache

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
    if residual_length > RESIDUAL_WINDOW:
        raise ValueError(f"residual_length {residual_length} exceeds the {RESIDUAL_WINDOW}-token window that bits "
                         f"per element leave out")
    try:
        return QuantizedCache(backend, config, nbits=nbits, axis_key=axis_key, axis_value=axis_value,
                              q_group_size=q_group_size, residual_length=residual_length)
    except ImportError as e:
        raise ValueError(f"QuantizedCache backend {backend!r} is not installed ({e})") from e


def _quantized_bytes(q) -> tuple[int, int]:
    """(code bytes, statistic bytes at BF16) of one quantized tensor of the quanto or HQQ backend."""
    if q is None:
        return 0, 0
    if isinstance(q, tuple):  # HQQ: (packed uint8, meta with scale and zero)
        packed, meta = q
        return packed.numel() * packed.element_size(), STAT_BYTES * (meta["scale"].numel() + meta["zero"].numel())
    data = q._data  # quanto WeightQBitsTensor: PackedTensor (uint8) codes, scale, shift
    raw = getattr(data, "_data", data)
    return raw.numel() * raw.element_size(), STAT_BYTES * (q._scale.numel() + q._shift.numel())


def quantized_cache_stats(cache) -> dict:
    """`LowBitCache.stats()`-style bytes of a `QuantizedCache`: `bytes` with `codes`, `stats`, `total` (all but the
    recent window) and `residual`; `elements` (all K/V elements), `counted_elements` (outside the window) and
    `bits_per_element = 8 * total / counted_elements`."""
    b = {"codes": 0, "stats": 0, "pending": 0, "residual": 0}
    elements = counted = 0
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        for q in (layer._quantized_keys, layer._quantized_values):
            codes, stats = _quantized_bytes(q)
            b["codes"] += codes
            b["stats"] += stats
        k = layer.keys
        res = k.shape[-2] if k is not None and k.dim() == 4 else 0
        q = layer._quantized_keys
        shape = tuple(k.shape) if res else tuple(q[1]["shape"] if isinstance(q, tuple) else q.shape)
        per_token = 2 * shape[0] * shape[1] * shape[3]
        window = min(res, RESIDUAL_WINDOW)
        elt = k.element_size()
        b["residual"] += window * per_token * elt
        b["pending"] += (res - window) * per_token * elt
        tokens = layer.get_seq_length()
        elements += tokens * per_token
        counted += (tokens - window) * per_token
    b["total"] = b["codes"] + b["stats"] + b["pending"]
    return {"bytes": b, "elements": elements, "counted_elements": counted,
            "bits_per_element": 8 * b["total"] / counted if counted else float("nan")}

