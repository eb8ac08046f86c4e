"""Calibration: per-channel exponent windows and the slot's escape capacity, from captured KV.

Captured KV is `[layers, 2 (K|V), kv_heads, tokens, head_dim]` BF16 (see `capture.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .codec import check_bf16, escape_bytes, group_modes, split_fields, split_head
from .format import ALIGN, BLOCK_TOKENS, BLOCK_TABLE_ENTRY_BYTES, TileLayout, tile_split

WINDOW_3BIT, WINDOW_4BIT = 8, 16


def exponents(kv: torch.Tensor) -> torch.Tensor:
    """BF16 KV -> its 8-bit exponents (int32), same shape."""
    check_bf16(kv)
    return split_fields(kv)[0]


def exponent_histogram(kv: torch.Tensor) -> torch.Tensor:
    """Count exponents per (layer, K|V, head, channel): `[L, 2, H, T, D]` -> `[L, 2, H, D, 256]` int64."""
    e = exponents(kv).transpose(-1, -2)  # [L, 2, H, D, T]
    lead = e.shape[:-1]
    rows = torch.arange(lead.numel(), device=e.device).reshape(*lead, 1) * 256
    flat = (rows + e).reshape(-1)
    return torch.bincount(flat, minlength=lead.numel() * 256).reshape(*lead, 256)


def window_sums(hist: torch.Tensor, width: int) -> torch.Tensor:
    """Counts covered by each contiguous exponent window `[b, b + width)`, b = 0 .. 256 - width."""
    cum = torch.nn.functional.pad(hist.cumsum(-1), (1, 0))
    return cum[..., width:] - cum[..., :-width]


def best_window(hist: torch.Tensor, width: int, align: int = 1) -> torch.Tensor:
    """Base of the contiguous window of `width` exponents that covers the most values (lowest base on ties), among
    the windows that start at multiples of `align`."""
    sums = window_sums(hist, width)
    first = torch.arange(sums.shape[-1], device=hist.device).expand_as(sums)
    sums = torch.where(first % align == 0, sums, -1)
    best = sums.max(-1, keepdim=True).values
    return torch.where(sums == best, first, sums.shape[-1]).min(-1).values.to(torch.uint8)


def windows_from_histogram(hist: torch.Tensor, format_version: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """`(base3, base4)`, each uint8 `[..., D]`: the best 8- and 16-wide windows per channel (format version 2:
    starting at even exponents)."""
    align = 2 if format_version == 2 else 1
    return best_window(hist, WINDOW_3BIT, align), best_window(hist, WINDOW_4BIT, align)


def complete_blocks(kv: torch.Tensor) -> torch.Tensor:
    """`[..., T, D]` -> `[..., blocks, tiles, 16, C]` for the complete 16-token blocks."""
    n = kv.shape[-2] // BLOCK_TOKENS
    blocks = kv[..., : n * BLOCK_TOKENS, :].reshape(*kv.shape[:-2], n, BLOCK_TOKENS, kv.shape[-1])
    return split_head(blocks)


def tile_bases(base: torch.Tensor) -> torch.Tensor:
    """Per-channel bases `[..., D]` -> `[..., 1 (blocks), tiles, C]`, matching `complete_blocks`."""
    n, c = tile_split(base.shape[-1])
    return base.reshape(*base.shape[:-1], 1, n, c)


def tile_modes(kv: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, grouping: str = "token") -> torch.Tensor:
    """Group modes of every complete tile: `[L, 2, H, T, D]` -> `[L, 2, H, blocks, tiles, G]`."""
    e = exponents(complete_blocks(kv))
    return group_modes(e, tile_bases(base3), tile_bases(base4), grouping)


def tile_escape_bytes(kv: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor) -> torch.Tensor:
    """Escape bytes of every complete tile: `[L, 2, H, blocks, tiles]` int32."""
    return escape_bytes(tile_modes(kv, base3, base4))


def resident_bytes_per_tile(escapes: torch.Tensor, channels: int, capacity: int) -> torch.Tensor:
    """Mean resident bytes per tile with slots of `capacity` escape bytes (raw fallback beyond it)."""
    layout = TileLayout(channels, capacity)
    fits = escapes <= capacity
    per_tile = torch.where(fits, layout.slot_bytes, layout.raw_bytes).to(torch.float64)
    return per_tile.mean() + BLOCK_TABLE_ENTRY_BYTES


def choose_escape_capacity(escapes: torch.Tensor, channels: int) -> int:
    """The slot escape capacity (a multiple of 16 bytes) that minimizes mean resident bytes per tile."""
    escapes = escapes.reshape(-1)
    top = int(escapes.max().item()) if escapes.numel() else 0
    candidates = range(0, top + ALIGN + 1, ALIGN)
    costs = [resident_bytes_per_tile(escapes, channels, c).item() for c in candidates]
    return candidates[min(range(len(costs)), key=costs.__getitem__)]


@dataclass
class SizeSummary:
    """Bits per element of the variable-length code and of the resident slot/raw storage."""

    codec_bits: float
    resident_bits: float
    raw_tile_share: float

    @property
    def codec_ratio(self) -> float:
        return 16.0 / self.codec_bits

    @property
    def resident_ratio(self) -> float:
        return 16.0 / self.resident_bits

    @property
    def resident_saving(self) -> float:
        return 1.0 - self.resident_bits / 16.0


def size_summary(escapes: torch.Tensor, channels: int, capacity: int) -> SizeSummary:
    layout = TileLayout(channels, capacity)
    esc = escapes.to(torch.float64)
    codec = (layout.fixed_bytes + esc.mean().item()) * 8 / layout.elements
    resident = resident_bytes_per_tile(escapes, channels, capacity).item() * 8 / layout.elements
    return SizeSummary(codec, resident, (escapes > capacity).double().mean().item())


def calibrate_from_captures(captures, format_version: int = 1) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """Windows and escape capacity from captured KV.

    `captures` is a callable returning a fresh iterator of `[L, 2, H, T, D]` captures (it is walked twice: once
    for the exponent histograms, once for the escape bytes under the chosen windows).
    Returns `(base3, base4, escape_capacity, escapes)`, `escapes` being every calibration tile's escape bytes.
    """
    hist = None
    for kv in captures():
        h = exponent_histogram(kv)
        hist = h if hist is None else hist + h
    if hist is None:
        raise ValueError("no KV was captured: the corpus gave no prompts")
    base3, base4 = windows_from_histogram(hist, format_version)
    escapes = torch.cat([tile_escape_bytes(kv, base3, base4).reshape(-1) for kv in captures()])
    channels = tile_split(base3.shape[-1])[1]
    return base3, base4, choose_escape_capacity(escapes, channels), escapes


def calibrate(model, prompts: list[torch.Tensor], corpus: str, store: str | None = None,
              chunk_tokens: int = 1024, format_version: int = 1):
    """Calibrate GAAC for `model` on token prompts; returns a `GAACCalibration`.

    Captured KV goes through `store` (a folder; a temporary one if None) so memory stays bounded. `format_version`
    2 (the byte-split draft of docs/format.md) chooses windows that start at even exponents.
    """
    import tempfile

    from .calibration import CalibrationConfig, GAACCalibration
    from .capture import capture_corpus
    from .model_layers import kv_geometry, text_config

    geometry = kv_geometry(model.config)
    with tempfile.TemporaryDirectory() as tmp:
        folder = store or tmp
        list(capture_corpus(model, prompts, chunk_tokens=chunk_tokens, store=folder, desc="capture KV"))

        def captures():
            return capture_corpus(model, prompts, chunk_tokens=chunk_tokens, store=folder, desc="read KV")

        base3, base4, capacity, escapes = calibrate_from_captures(captures, format_version)
    summary = size_summary(escapes, tile_split(geometry.head_dim)[1], capacity)
    cfg = text_config(model.config)
    config = CalibrationConfig(
        format_version=format_version,
        base_model=str(getattr(model.config, "name_or_path", "") or cfg.model_type),
        architecture=(cfg.architectures or [type(model).__name__])[0] if getattr(cfg, "architectures", None)
        else type(model).__name__,
        num_hidden_layers=len(geometry.layer_types),
        layers=list(geometry.full_attention_layers),
        num_kv_heads=geometry.num_kv_heads,
        head_dim=geometry.head_dim,
        escape_capacity=capacity,
        corpus=corpus,
        corpus_tokens=int(sum(p.numel() for p in prompts)),
        prompt_tokens=int(prompts[0].numel()),
        measured={"calibration corpus": summary_dict(summary)},
    )
    return GAACCalibration(config, base3, base4)


def summary_dict(s: SizeSummary) -> dict:
    return {"codec_bits": round(s.codec_bits, 4), "codec_ratio": round(s.codec_ratio, 4),
            "resident_bits": round(s.resident_bits, 4), "resident_saving": round(s.resident_saving, 4),
            "raw_tile_share": round(s.raw_tile_share, 5)}
