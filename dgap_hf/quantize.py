"""Packed low-bit group quantizers for KV caches (the low-bit side that DGAP repairs).

Grouping (KIVI-style):

* **keys per channel**: for every (row, kv-head, channel), groups of `G` consecutive *tokens* share one scale and
  zero-point. `quantize_keys` takes `[B, H, S, D]` with `S % G == 0` and stores codes `[B, H, S/G, D, G*bits/8]`
  and statistics `[B, H, S/G, D]`.
* **values per token**: for every (row, kv-head, token), groups of `G` consecutive *channels*. `quantize_values`
  takes `[B, H, S, D]` with `D % G == 0` and stores codes `[B, H, S, D/G, G*bits/8]` and statistics `[B, H, S, D/G]`.

Both append along dim 2, so a cache grows by concatenation and never requantizes what it stored.

Codes are packed little-end first into uint8 (8, 4, 2 or 1 codes per byte for 1, 2, 4 or 8 bits). The two per-group
statistics are stored in BF16. Modes:

* `"minmax"` (any bit width): asymmetric, `x ~ zero + q * scale`, `q` in `[0, 2^b - 1]`. The BF16 statistics are
  rounded *outward* (zero-point down, scale up), so the quantization grid always covers `[min, max]` of the group
  and the round trip is bounded by

      |x - x_hat| <= scale / 2,     scale <= (max - min + 2^-7 |min|) * (1 + 2^-7) / (2^b - 1)

  (plus the rounding of the output dtype: 2^-9 |x| relative for BF16, about 1e-7 relative for float32).
  `minmax_error_bound` returns `scale / 2` per stored group, `minmax_error_bound_from_range` the a priori bound
  from the group's min and max; as a fraction of the range, when `|min| << max - min`, that is
  `relative_error_bound(bits)` = 0.504, 0.168, 0.0336, 0.00198 for 1, 2, 4, 8 bits.
* `"sign"` (1 bit only): the bit is `x >= mean`, the statistics are the group mean `mu` and mean absolute deviation
  `a = mean|x - mu|`, and `x_hat = mu +/- a`. With exact statistics the group's mean squared error is exactly
  `var - a^2` (so never worse than replacing the group by its mean, and `(1 - 2/pi) var ~ 0.363 var` for Gaussian
  data), whereas 1-bit min/max puts the two levels at the extremes of the group.
* `"normal"` (2 or 4 bits): non-uniform levels, the Lloyd-Max quantizer of a standard normal
  (`normal_levels(bits)`: +/-0.453, +/-1.510 at 2 bits). A group is standardized by its mean and standard deviation,
  each element gets the nearest level, then `zero` and `scale` are refitted by least squares on the codes
  (`x_hat = zero + scale * level[q]`), which is the 1-bit sign mode's rule (mean +/- MAD) carried to more levels.

Outliers (dense-and-sparse, as in KVQuant): `outliers=n` keeps the `n` elements of each group farthest from the
group mean in BF16 with their uint8 position in the group; the dense part is quantized without them (they are
replaced by the mean of the others) and they are written back on dequantization. Cost: `n * 24` bits per group
(`n * 16` with `outlier_dtype="float8_e4m3fn"`).

Statistic formats (`scale_dtype`, `zero_dtype`, `outlier_dtype`): `"bfloat16"` (the default) or `"float8_e4m3fn"`
(FP8 E4M3: 3 mantissa bits, finite range +/-448, subnormals down to 2^-9; values beyond the range saturate, smaller
ones round to the nearest subnormal or zero). In `"minmax"` mode the statistics are rounded outward in either format
(so the error bound above holds with the format's spacing, as long as the group stays within +/-448). In
`"normal"` mode both are rounded to nearest. In
`"normal"` and `"sign"` modes `zero_dtype="none"` stores no zero-point (symmetric groups, `x ~ scale * level[q]`,
the scale fitted by least squares with the zero at 0): for channel groups of rotated vectors, whose mean is close
to 0.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

import math

BITS = (1, 2, 4, 8)
ONE_BIT_MODES = ("sign", "minmax")
MODES = ("minmax", "sign", "normal")
STAT_DTYPE = torch.bfloat16
STAT_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}
ZERO_DTYPES = (*STAT_DTYPES, "none")
_BF16_EPS = 2.0 ** -7  # spacing of BF16 values in [1, 2)


def check_stat_dtype(name: str, what: str = "stat dtype", allow_none: bool = False) -> str:
    allowed = ZERO_DTYPES if allow_none else tuple(STAT_DTYPES)
    if name not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, not {name!r}")
    return name


def stat_bits(name: str) -> int:
    """Bits of one stored statistic of format `name` (0 for `"none"`)."""
    return 0 if name == "none" else torch.finfo(STAT_DTYPES[check_stat_dtype(name, allow_none=True)]).bits


def check_bits(bits: int, what: str = "bits") -> int:
    if bits not in BITS:
        raise ValueError(f"{what} must be one of {BITS}, not {bits!r}")
    return int(bits)


def minmax_error_bound_from_range(lo: torch.Tensor, hi: torch.Tensor, bits: int) -> torch.Tensor:
    """A priori bound on `|x - x_hat|` of `"minmax"` mode for a group with minimum `lo` and maximum `hi`:
    `(hi - lo + 2^-7 |lo|) * (1 + 2^-7) / (2 (2^b - 1))` (before output-dtype rounding)."""
    levels = 2 ** check_bits(bits) - 1
    lo, hi = lo.float(), hi.float()
    return (hi - lo + _BF16_EPS * lo.abs()) * (1 + _BF16_EPS) / (2 * levels) * (1 + 1e-6) + 1e-30


def relative_error_bound(bits: int) -> float:
    """`minmax_error_bound_from_range / (hi - lo)` for groups with `|lo| << hi - lo`."""
    return 0.5 / (2 ** check_bits(bits) - 1) * (1 + _BF16_EPS)


@functools.lru_cache(maxsize=None)
def normal_levels(bits: int) -> tuple[float, ...]:
    """Lloyd-Max reconstruction levels of N(0, 1) with `2^bits` levels (ascending), by Lloyd's iteration on the
    closed-form centroids `(phi(a) - phi(b)) / (Phi(b) - Phi(a))` of each cell `[a, b]`."""
    n = 2 ** check_bits(bits)
    pdf = lambda t: math.exp(-t * t / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + math.erf(t / math.sqrt(2)))  # noqa: E731
    levels = [(-1 + (2 * i + 1) / n) * 2.5 for i in range(n)]
    for _ in range(500):
        edges = [-math.inf] + [(a + b) / 2 for a, b in zip(levels, levels[1:])] + [math.inf]
        levels = [(pdf(a) - pdf(b)) / max(cdf(b) - cdf(a), 1e-300) for a, b in zip(edges, edges[1:])]
    return tuple(levels)


# --- packing ---------------------------------------------------------------------------------------------------------
def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[..., n]` (each < 2^bits) -> packed uint8 `[..., n * bits / 8]`; code `i` of a byte sits at bit
    `i * bits`."""
    check_bits(bits)
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    per = 8 // bits
    n = codes.shape[-1]
    if n % per:
        raise ValueError(f"cannot pack {n} codes of {bits} bits into whole bytes")
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], n // per, per)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (c << shifts).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack_bits`: uint8 `[..., m]` -> uint8 codes `[..., m * 8 / bits]`."""
    check_bits(bits)
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2 ** bits - 1)
    return c.reshape(*packed.shape[:-1], -1).to(torch.uint8)


@functools.lru_cache(maxsize=None)
def _byte_levels(bits: int, mode: str, device: torch.device) -> torch.Tensor:
    """float32 `[256, 8 / bits]`: the level of every code of a packed byte (code `i` at bit `i * bits`), as
    `dequantize_groups` computes it from the code: `2c - 1` (sign), `normal_levels(bits)[c]` (normal), `c` (else)."""
    codes = unpack_bits(torch.arange(256, dtype=torch.uint8), bits).reshape(256, 8 // bits)
    if mode == "sign":
        out = 2 * codes.float() - 1
    elif mode == "normal":
        out = torch.tensor(normal_levels(bits))[codes.long()]
    else:
        out = codes.float()
    return out.to(device)


def code_levels(packed: torch.Tensor, bits: int, mode: str) -> torch.Tensor:
    """Packed codes uint8 `[..., m]` -> their float32 levels `[..., m * 8 / bits]` by one lookup per byte."""
    lut = _byte_levels(check_bits(bits), mode, packed.device)
    return torch.nn.functional.embedding(packed.long(), lut).reshape(*packed.shape[:-1], -1)


# --- statistics: rounding to their format ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _fp8_grid() -> torch.Tensor:
    """The finite FP8 E4M3 values, ascending (float32, one zero)."""
    t = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.unique(t[torch.isfinite(t)])


def _to_stat(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round to nearest in `dtype`; FP8 saturates at its largest finite value instead of overflowing to NaN."""
    if dtype == torch.float8_e4m3fn:
        big = torch.finfo(dtype).max
        return x.clamp(-big, big).to(dtype)
    return x.to(dtype)


def _round_down(x: torch.Tensor, dtype: torch.dtype = STAT_DTYPE) -> torch.Tensor:
    """The largest `dtype` value <= `x` (FP8: saturating at -448)."""
    if dtype == torch.float8_e4m3fn:
        grid = _fp8_grid().to(x.device)
        i = (torch.searchsorted(grid, x.contiguous(), right=True) - 1).clamp_(0, grid.numel() - 1)
        return grid[i].to(dtype)
    b = x.to(dtype)
    return torch.where(b.float() > x, torch.nextafter(b, torch.full_like(b, -float("inf"))), b)


def _round_up(x: torch.Tensor, dtype: torch.dtype = STAT_DTYPE) -> torch.Tensor:
    """The smallest `dtype` value >= `x` (FP8: saturating at 448)."""
    if dtype == torch.float8_e4m3fn:
        grid = _fp8_grid().to(x.device)
        i = torch.searchsorted(grid, x.contiguous(), right=False).clamp_(0, grid.numel() - 1)
        return grid[i].to(dtype)
    b = x.to(dtype)
    return torch.where(b.float() < x, torch.nextafter(b, torch.full_like(b, float("inf"))), b)


_bf16_down, _bf16_up = _round_down, _round_up


# --- groups ----------------------------------------------------------------------------------------------------------
@dataclass
class QuantizedGroups:
    """Packed codes plus statistics of groups of `group_size` elements.

    `packed` is uint8 `[*lead, group_size * bits / 8]`; `scale` and `zero` are `[*lead]` in their stat format
    (BF16 or FP8; `zero` is None for symmetric groups). In `"sign"` mode `scale` holds the mean absolute deviation
    and `zero` the mean. With outliers, `outlier_values` (BF16 or FP8) and `outlier_index` (uint8 position in the
    group) are `[*lead, n]`.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int
    mode: str
    group_size: int
    outlier_values: torch.Tensor | None = None
    outlier_index: torch.Tensor | None = None

    @property
    def _tensor_names(self) -> tuple[str, ...]:
        base = ("packed", "scale") if self.zero is None else ("packed", "scale", "zero")
        return base if self.outlier_values is None else base + ("outlier_values", "outlier_index")

    @property
    def _format(self) -> tuple:
        dt = lambda t: None if t is None else t.dtype  # noqa: E731
        return (self.bits, self.mode, self.group_size, dt(self.scale), dt(self.zero), dt(self.outlier_values),
                None if self.outlier_values is None else self.outlier_values.shape[-1])

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self._tensor_names)

    @property
    def outlier_bytes(self) -> int:
        if self.outlier_values is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.outlier_values, self.outlier_index))

    @property
    def packed_bytes(self) -> int:
        return self.packed.numel()

    @property
    def stat_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.scale, self.zero) if t is not None)

    def map(self, fn) -> "QuantizedGroups":
        """Apply `fn` to each tensor (they share their leading dims)."""
        return replace(self, **{n: fn(getattr(self, n)) for n in self._tensor_names})

    def cat(self, other: "QuantizedGroups", dim: int) -> "QuantizedGroups":
        if other._format != self._format:
            raise ValueError(f"cannot concatenate groups of different formats: {self._format} and {other._format}")
        return replace(self, **{n: torch.cat([getattr(self, n), getattr(other, n)], dim)
                                for n in self._tensor_names})

    def to(self, device) -> "QuantizedGroups":
        return self.map(lambda t: t.to(device, non_blocking=True))


def quantize_groups(x: torch.Tensor, bits: int, mode: str = "minmax", outliers: int = 0, *,
                    scale_dtype: str = "bfloat16", zero_dtype: str = "bfloat16",
                    outlier_dtype: str = "bfloat16") -> QuantizedGroups:
    """Quantize the last dim of `x` (one group) to `bits` bits. `mode="sign"` needs `bits == 1`, `mode="normal"`
    2 or 4 bits. `outliers`: elements per group kept in `outlier_dtype` (the farthest from the group mean).
    `scale_dtype` / `zero_dtype`: the statistics' formats (module docstring); `zero_dtype="none"` (symmetric) is for
    the `"normal"` and `"sign"` modes."""
    check_bits(bits)
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, not {mode!r}")
    if mode == "sign" and bits != 1:
        raise ValueError("sign mode is a 1-bit quantizer")
    if mode == "normal" and bits not in (2, 4):
        raise ValueError(f"normal (non-uniform) levels are for 2 or 4 bits, not {bits}")
    sdt = STAT_DTYPES[check_stat_dtype(scale_dtype, "scale_dtype")]
    odt = STAT_DTYPES[check_stat_dtype(outlier_dtype, "outlier_dtype")]
    check_stat_dtype(zero_dtype, "zero_dtype", allow_none=True)
    symmetric = zero_dtype == "none"
    if symmetric and mode == "minmax":
        raise ValueError("zero_dtype='none' (symmetric groups) needs the 'normal' or 'sign' mode; minmax groups "
                         "need their zero-point")
    zdt = None if symmetric else STAT_DTYPES[zero_dtype]
    g = x.shape[-1]
    if not 0 <= outliers < g or outliers > 255:
        raise ValueError(f"outliers per group must be in [0, min({g}, 256)), not {outliers}")
    xf = x.float()
    out_v = out_i = None
    if outliers:
        mu = xf.mean(-1, keepdim=True)
        out_i = (xf - mu).abs().topk(outliers, -1).indices
        out_v = _to_stat(xf.gather(-1, out_i), odt)
        keep = torch.ones_like(xf, dtype=torch.bool).scatter_(-1, out_i, False)
        rest_mean = (xf * keep).sum(-1, keepdim=True) / (g - outliers)
        xf = torch.where(keep, xf, rest_mean)  # the dense part, without the outliers
        out_i = out_i.to(torch.uint8)

    def done(codes, scale, zero):
        return QuantizedGroups(pack_bits(codes.to(torch.uint8), bits), scale.squeeze(-1),
                               None if zero is None else zero.squeeze(-1), bits, mode, g, out_v, out_i)

    if mode == "sign":
        mu = torch.zeros_like(xf[..., :1]) if symmetric else _to_stat(xf.mean(-1, keepdim=True), zdt).float()
        mad = _to_stat((xf - mu).abs().mean(-1, keepdim=True), sdt)
        codes = xf >= mu
        return done(codes, mad, None if symmetric else mu.to(zdt))
    if mode == "normal":
        levels = torch.tensor(normal_levels(bits), device=x.device)
        mu = torch.zeros_like(xf[..., :1]) if symmetric else xf.mean(-1, keepdim=True)
        sd = (xf * xf).mean(-1, keepdim=True).sqrt() if symmetric else xf.std(-1, keepdim=True, correction=0)
        edges = (levels[1:] + levels[:-1]) / 2
        z = ((xf - mu) / torch.where(sd > 0, sd, torch.ones_like(sd))).contiguous()
        codes = torch.bucketize(z, edges)
        c = levels[codes]
        if symmetric:  # least squares through the origin
            c2 = (c * c).mean(-1, keepdim=True)
            scale = _to_stat((c * xf).mean(-1, keepdim=True) / torch.where(c2 > 0, c2, torch.ones_like(c2)), sdt)
            return done(codes, scale, None)
        c_mean = c.mean(-1, keepdim=True)
        c_var = ((c - c_mean) ** 2).mean(-1, keepdim=True)
        cov = ((c - c_mean) * (xf - mu)).mean(-1, keepdim=True)
        scale = cov / torch.where(c_var > 0, c_var, torch.ones_like(c_var))
        return done(codes, _to_stat(scale, sdt), _to_stat(mu - scale * c_mean, zdt))
    levels = 2 ** bits - 1
    lo = xf.amin(-1, keepdim=True)
    hi = xf.amax(-1, keepdim=True)
    zero = _round_down(lo, zdt)
    scale = _round_up((hi - zero.float()) / levels, sdt)
    s = scale.float()
    codes = torch.round((xf - zero.float()) / torch.where(s > 0, s, torch.ones_like(s))).clamp_(0, levels)
    return done(codes, scale, zero)


def dequantize_groups(q: QuantizedGroups, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`QuantizedGroups` -> values `[*lead, group_size]` in `dtype` (computed in float32)."""
    s = q.scale.float().unsqueeze(-1)
    z = 0.0 if q.zero is None else q.zero.float().unsqueeze(-1)
    out = z + code_levels(q.packed, q.bits, q.mode) * s
    if q.outlier_values is not None:
        out = out.scatter(-1, q.outlier_index.long(), q.outlier_values.float())
    return out.to(dtype)


def minmax_error_bound(q: QuantizedGroups) -> torch.Tensor:
    """Per-group bound on `|x - x_hat|` for `"minmax"` groups (float32 `[*lead]`, before output-dtype rounding)."""
    if q.mode != "minmax":
        raise ValueError("the worst-case bound is for minmax groups; sign mode has the MSE identity var - MAD^2")
    return q.scale.float() / 2


# --- KV layouts ------------------------------------------------------------------------------------------------------
def group_mode(bits: int, one_bit_mode: str = "sign", levels: str = "uniform") -> str:
    """The `quantize_groups` mode of a `bits`-bit group: `one_bit_mode` at 1 bit, `"normal"` for 2/4 bits with
    `levels="normal"`, else `"minmax"`."""
    if levels not in ("uniform", "normal"):
        raise ValueError(f"levels must be 'uniform' or 'normal', not {levels!r}")
    if bits == 1:
        return one_bit_mode
    return "normal" if levels == "normal" and bits in (2, 4) else "minmax"


def quantize_keys(k: torch.Tensor, bits: int, group_size: int, one_bit_mode: str = "sign", levels: str = "uniform",
                  outliers: int = 0, **stat_formats) -> QuantizedGroups:
    """Keys `[B, H, S, D]` (`S % group_size == 0`), per channel over groups of `group_size` tokens.
    `stat_formats`: `scale_dtype`, `zero_dtype`, `outlier_dtype` of `quantize_groups`.

    Codes `[B, H, S/G, D, G*bits/8]`, statistics `[B, H, S/G, D]`."""
    b, h, s, d = k.shape
    if s % group_size:
        raise ValueError(f"keys are quantized in whole groups of {group_size} tokens, got {s} tokens")
    x = k.reshape(b, h, s // group_size, group_size, d).transpose(-1, -2)
    return quantize_groups(x, bits, group_mode(bits, one_bit_mode, levels), outliers, **stat_formats)


def _dequantize_by_head(q: "HeadGroups", dequantize, dtype: torch.dtype) -> torch.Tensor:
    parts = [dequantize(p, dtype) for p in q.parts]
    out = parts[0].new_empty(parts[0].shape[0], q.num_heads, *parts[0].shape[2:])
    for heads, part in zip(q.heads, parts):
        out[:, list(heads)] = part
    return out


def dequantize_keys(q: "QuantizedGroups | HeadGroups", dtype: torch.dtype) -> torch.Tensor:
    if isinstance(q, HeadGroups):
        return _dequantize_by_head(q, dequantize_keys, dtype)
    x = dequantize_groups(q, dtype)  # [B, H, n, D, G]
    b, h, n, d, g = x.shape
    return x.transpose(-1, -2).reshape(b, h, n * g, d)


@dataclass
class HeadGroups:
    """Keys (or values) of one layer whose KV heads use different bit widths: `parts[i]` (`QuantizedGroups` of
    `quantize_keys` / `quantize_values`) holds the heads `heads[i]` (indices along dim 1). Same interface as
    `QuantizedGroups` for the cache (`map`, `cat`, `to`, byte counts); `dequantize_keys` / `dequantize_values` put
    the heads back in order."""

    heads: tuple[tuple[int, ...], ...]
    parts: tuple[QuantizedGroups, ...]

    @property
    def num_heads(self) -> int:
        return sum(len(h) for h in self.heads)

    def map(self, fn) -> "HeadGroups":
        return HeadGroups(self.heads, tuple(p.map(fn) for p in self.parts))

    def cat(self, other: "HeadGroups", dim: int) -> "HeadGroups":
        if not isinstance(other, HeadGroups) or other.heads != self.heads:
            raise ValueError("cannot concatenate groups of different per-head formats")
        return HeadGroups(self.heads, tuple(a.cat(b, dim) for a, b in zip(self.parts, other.parts)))

    def to(self, device) -> "HeadGroups":
        return self.map(lambda t: t.to(device, non_blocking=True))

    nbytes = property(lambda self: sum(p.nbytes for p in self.parts))
    packed_bytes = property(lambda self: sum(p.packed_bytes for p in self.parts))
    stat_bytes = property(lambda self: sum(p.stat_bytes for p in self.parts))
    outlier_bytes = property(lambda self: sum(p.outlier_bytes for p in self.parts))


def _quantize_by_head(quantize, x: torch.Tensor, head_bits, *args, **kwargs) -> HeadGroups:
    head_bits = [check_bits(b, "head bits") for b in head_bits]
    if len(head_bits) != x.shape[1]:
        raise ValueError(f"head_bits has {len(head_bits)} entries for {x.shape[1]} KV heads")
    heads = tuple(tuple(h for h, b in enumerate(head_bits) if b == bits) for bits in sorted(set(head_bits)))
    return HeadGroups(heads, tuple(quantize(x[:, list(hs)], head_bits[hs[0]], *args, **kwargs) for hs in heads))


def quantize_keys_by_head(k: torch.Tensor, head_bits, group_size: int, one_bit_mode: str = "sign",
                          levels: str = "uniform", outliers: int = 0, **stat_formats) -> HeadGroups:
    """`quantize_keys` with `head_bits[h]` bits for KV head `h` of `k` `[B, H, S, D]` (heads of equal bits share
    one `QuantizedGroups`)."""
    return _quantize_by_head(quantize_keys, k, head_bits, group_size, one_bit_mode, levels, outliers, **stat_formats)


def quantize_values_by_head(v: torch.Tensor, head_bits, group_size: int, one_bit_mode: str = "sign",
                            levels: str = "uniform", outliers: int = 0, **stat_formats) -> HeadGroups:
    """`quantize_values` with `head_bits[h]` bits for KV head `h` of `v` `[B, H, S, D]`."""
    return _quantize_by_head(quantize_values, v, head_bits, group_size, one_bit_mode, levels, outliers,
                             **stat_formats)


def quantize_values(v: torch.Tensor, bits: int, group_size: int, one_bit_mode: str = "sign", levels: str = "uniform",
                    outliers: int = 0, **stat_formats) -> QuantizedGroups:
    """Values `[B, H, S, D]` (`D % group_size == 0`), per token over groups of `group_size` channels.
    `stat_formats`: `scale_dtype`, `zero_dtype`, `outlier_dtype` of `quantize_groups`.

    Codes `[B, H, S, D/G, G*bits/8]`, statistics `[B, H, S, D/G]`."""
    b, h, s, d = v.shape
    if d % group_size:
        raise ValueError(f"values are quantized in groups of {group_size} channels; head_dim {d} is not a multiple")
    x = v.reshape(b, h, s, d // group_size, group_size)
    return quantize_groups(x, bits, group_mode(bits, one_bit_mode, levels), outliers, **stat_formats)


def dequantize_values(q: "QuantizedGroups | HeadGroups", dtype: torch.dtype) -> torch.Tensor:
    if isinstance(q, HeadGroups):
        return _dequantize_by_head(q, dequantize_values, dtype)
    x = dequantize_groups(q, dtype)  # [B, H, S, D/G, G]
    b, h, s, n, g = x.shape
    return x.reshape(b, h, s, n * g)


def packed_bytes_per_group(bits: int, group_size: int) -> int:
    return group_size * check_bits(bits) // 8
