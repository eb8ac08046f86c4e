"""KV precision names: `"K<key bits>V<value bits>"`, e.g. `"K1V1"`, `"K2V2"`, `"K2V4"`."""

from __future__ import annotations

import re

from .quantize import BITS

PAPER_PRECISIONS = ("K1V1", "K2V2", "K4V4", "K8V8")
_PATTERN = re.compile(r"^\s*K(\d+)\s*V(\d+)\s*$", re.IGNORECASE)


class UnknownPrecisionError(ValueError):
    """A precision string that is not `K<b>V<b>` with bits in 1, 2, 4, 8 (or not in an artifact)."""


def parse_precision(precision: str) -> tuple[int, int]:
    """`"K2V4"` -> `(2, 4)`. Raises `UnknownPrecisionError` for anything else."""
    m = _PATTERN.match(str(precision))
    if not m:
        raise UnknownPrecisionError(
            f"unknown KV precision {precision!r}: write it as K<key bits>V<value bits>, e.g. 'K2V2' or 'K2V4'")
    kb, vb = int(m.group(1)), int(m.group(2))
    for what, b in (("key", kb), ("value", vb)):
        if b not in BITS:
            raise UnknownPrecisionError(f"KV precision {precision!r}: {what} bits must be one of {BITS}, not {b}")
    return kb, vb


def format_precision(key_bits: int, value_bits: int) -> str:
    return f"K{int(key_bits)}V{int(value_bits)}"


def normalize_precision(precision: str) -> str:
    """Canonical spelling: `"k2v4"` -> `"K2V4"`."""
    return format_precision(*parse_precision(precision))
