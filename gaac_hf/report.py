"""Compression report: how well GAAC codes a model's real KV, on calibration text and on held-out text.

Everything here is computed from captured KV (`capture.py`) with the reference codec's rules.
"""

from __future__ import annotations

import torch

from .calibrate import (
    calibrate_from_captures,
    choose_escape_capacity,
    exponent_histogram,
    size_summary,
    summary_dict,
    tile_modes,
    window_sums,
)
from .codec import escape_bytes
from .format import BLOCK_TOKENS, MODE_NAMES, tile_split

KV_NAMES = ("K", "V")


def entropy_bits(hist: torch.Tensor) -> float:
    p = hist.double() / hist.sum()
    p = p[p > 0]
    return float(-(p * p.log2()).sum())


def histogram_stats(hist: torch.Tensor) -> dict:
    """Entropy and best-window coverage from per-channel exponent histograms `[..., D, 256]`."""
    total = hist.sum().item()
    per_channel = hist.reshape(-1, 256).double()
    n = per_channel.sum(-1, keepdim=True).clamp(min=1)
    p = per_channel / n
    h = -(torch.where(p > 0, p * p.clamp(min=1e-300).log2(), 0.0)).sum(-1)
    out = {
        "exponent_entropy_pooled_bits": entropy_bits(hist.sum(tuple(range(hist.dim() - 1)))),
        "exponent_entropy_per_channel_bits": float((h * n.squeeze(-1)).sum() / n.sum()),
    }
    for w in (6, 8, 16):
        out[f"best{w}_contiguous_coverage"] = window_sums(hist, w).max(-1).values.sum().item() / total
    out["best8_any_coverage"] = hist.topk(8, dim=-1).values.sum().item() / total
    return out


def covered_by(hist: torch.Tensor, base: torch.Tensor, width: int) -> float:
    """Share of values inside given windows `[base, base + width)`."""
    sums = window_sums(hist, width)
    return torch.gather(sums, -1, base.long().unsqueeze(-1)).sum().item() / hist.sum().item()


def evaluate(captures, base3, base4, capacity, channels) -> dict:
    """Size and mode statistics of `captures` coded with the given windows and slot capacity."""
    hist, esc, esc_channel, modes_by_layer, channel_counts = None, [], [], None, 0
    for kv in captures():
        h = exponent_histogram(kv)
        hist = h if hist is None else hist + h
        modes = tile_modes(kv, base3, base4, "token")  # [L, 2, H, blocks, tiles, G]
        esc.append(escape_bytes(modes).reshape(kv.shape[0], 2, -1))
        modes_channel = tile_modes(kv, base3, base4, "channel")
        esc_channel.append(escape_bytes(modes_channel).reshape(-1))
        channel_counts = channel_counts + torch.bincount(modes_channel.reshape(-1).long(), minlength=3)
        counts = torch.stack([(modes == m).sum((2, 3, 4, 5)) for m in range(3)], -1)  # [L, 2, 3]
        modes_by_layer = counts if modes_by_layer is None else modes_by_layer + counts
    esc = torch.cat(esc, -1)  # [L, 2, tiles]
    summary = size_summary(esc, channels, capacity)
    channel_summary = size_summary(torch.cat(esc_channel), channels, choose_escape_capacity(torch.cat(esc_channel),
                                                                                            channels))
    shares = modes_by_layer.sum((0, 1)).double()
    per_layer = []
    for layer in range(esc.shape[0]):
        row = {"layer": layer}
        for kv_i, name in enumerate(KV_NAMES):
            s = size_summary(esc[layer, kv_i], channels, capacity)
            c = modes_by_layer[layer, kv_i].double()
            row[name] = {"3-bit": (c[0] / c.sum()).item(), "4-bit": (c[1] / c.sum()).item(),
                         "raw": (c[2] / c.sum()).item(), "codec_bits": s.codec_bits, "resident_bits": s.resident_bits,
                         "raw_tiles": s.raw_tile_share}
        per_layer.append(row)
    return {
        "tokens": int(hist[0, 0, 0, 0].sum().item()),
        **histogram_stats(hist),
        "covered_by_calibrated_3bit_window": covered_by(hist, base3, 8),
        "covered_by_calibrated_4bit_window": covered_by(hist, base4, 16),
        "mode_shares": {name: (shares[i] / shares.sum()).item() for i, name in enumerate(MODE_NAMES)},
        "mean_escape_bytes_per_tile": esc.double().mean().item(),
        **summary_dict(summary),
        "grouping_8_channels_of_one_token": {
            "mode_shares": {n: (channel_counts[i] / channel_counts.sum()).item() for i, n in enumerate(MODE_NAMES)},
            **summary_dict(channel_summary),
        },
        "per_layer": per_layer,
    }


def drift_table(captures, windows: dict, segment_tokens: int, layer: int | None = None) -> list[dict]:
    """Escape bytes per tile along the prompt (RoPE positional drift), for several sets of windows.

    For each segment of `segment_tokens` positions, K and V: the maximum over (layer, head) of the mean escape
    bytes per tile in that segment (only `layer` if given).
    """
    sums, count = {}, 0
    for kv in captures():
        for name, (b3, b4) in windows.items():
            esc = escape_bytes(tile_modes(kv, b3, b4)).double().sum(-1)  # [L, 2, H, blocks] summed over halves
            blocks = esc.shape[-1] // (segment_tokens // BLOCK_TOKENS) * (segment_tokens // BLOCK_TOKENS)
            seg = esc[..., :blocks].reshape(*esc.shape[:-1], -1, segment_tokens // BLOCK_TOKENS).mean(-1)
            sums[name] = seg if name not in sums else sums[name] + seg
        count += 1
    rows = []
    for s in range(next(iter(sums.values())).shape[-1]):
        row = {"segment": f"{s * segment_tokens / 1024:g}K-{(s + 1) * segment_tokens / 1024:g}K"}
        for name, total in sums.items():
            mean = total / count  # [L, 2, H, segments]
            sel = mean if layer is None else mean[layer: layer + 1]
            for kv_i, kv_name in enumerate(KV_NAMES):
                row[f"{kv_name} ({name})"] = round(sel[:, kv_i, :, s].max().item(), 2)
        rows.append(row)
    return rows


def compression_report(long_captures, short_captures, heldout_captures, drift_layer: int = 5,
                       segment_tokens: int = 1024) -> dict:
    """The full report. Each argument is a callable returning a fresh iterator over captured KV."""
    first = next(iter(long_captures()))
    channels = tile_split(first.shape[-1])[1]
    b3, b4, cap, _ = calibrate_from_captures(long_captures)
    s3, s4, s_cap, _ = calibrate_from_captures(short_captures)
    o3, o4, o_cap, _ = calibrate_from_captures(heldout_captures)
    windows = {"long-prompt calibration": (b3, b4), "short-prompt calibration": (s3, s4)}
    report = {
        "escape_capacity": cap,
        "calibration_A_on_A": evaluate(long_captures, b3, b4, cap, channels),
        "calibration_A_on_B": evaluate(heldout_captures, b3, b4, cap, channels),
        "oracle_B_on_B": evaluate(heldout_captures, o3, o4, o_cap, channels),
        "short_calibration_A_on_B": evaluate(heldout_captures, s3, s4, s_cap, channels),
        "drift_layer": drift_layer,
        "drift": drift_table(heldout_captures, windows, segment_tokens, drift_layer),
        "drift_all_layers": drift_table(heldout_captures, windows, segment_tokens, None),
    }
    report["short_calibration_escape_capacity"] = s_cap
    return report


def markdown(report: dict, meta: dict) -> str:
    """The report as Markdown tables."""
    lines = [f"# GAAC compression report: {meta.get('model', '')}", ""]
    for k, v in meta.items():
        lines.append(f"- {k}: {v}")
    lines += ["", f"Slot escape capacity (calibrated on A): {report['escape_capacity']} bytes", "",
              "| metric | A→A | A→B (held out) | B→B (oracle) | short-prompt A→B |", "|---|---|---|---|---|"]
    cols = [report[k] for k in ("calibration_A_on_A", "calibration_A_on_B", "oracle_B_on_B",
                                "short_calibration_A_on_B")]

    def row(name, get, fmt):
        lines.append(f"| {name} | " + " | ".join(fmt(get(c)) for c in cols) + " |")

    pct = lambda x: f"{100 * x:.2f}%"  # noqa: E731
    f3 = lambda x: f"{x:.3f}"  # noqa: E731
    row("tokens", lambda c: c["tokens"], str)
    row("exponent entropy, pooled (bit)", lambda c: c["exponent_entropy_pooled_bits"], f3)
    row("exponent entropy, per channel (bit)", lambda c: c["exponent_entropy_per_channel_bits"], f3)
    for w in (6, 8, 16):
        row(f"best-{w} contiguous coverage", lambda c, w=w: c[f"best{w}_contiguous_coverage"], pct)
    row("best-8 any (non-contiguous) coverage", lambda c: c["best8_any_coverage"], pct)
    row("values in calibrated 8-window", lambda c: c["covered_by_calibrated_3bit_window"], pct)
    for m in MODE_NAMES:
        row(f"{m} groups", lambda c, m=m: c["mode_shares"][m], pct)
    row("mean escape bytes / tile", lambda c: c["mean_escape_bytes_per_tile"], lambda x: f"{x:.1f}")
    row("codec bit/element", lambda c: c["codec_bits"], f3)
    row("codec ratio", lambda c: c["codec_ratio"], lambda x: f"{x:.4f}x")
    row("resident bit/element (slots, table, raw)", lambda c: c["resident_bits"], f3)
    row("resident saving vs BF16", lambda c: c["resident_saving"], pct)
    row("raw fallback tiles", lambda c: c["raw_tile_share"], pct)
    g = "grouping_8_channels_of_one_token"
    row("other grouping (8 channels of 1 token): codec bit/elt", lambda c: c[g]["codec_bits"], f3)
    row("other grouping: resident bit/elt", lambda c: c[g]["resident_bits"], f3)

    lines += ["", "## Per layer (A→B)", "",
              "| layer | K 3-bit | K 4-bit | K raw | K codec bit | K resident bit | V 3-bit | V 4-bit | V raw | "
              "V codec bit | V resident bit |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["calibration_A_on_B"]["per_layer"]:
        cells = [str(r["layer"])]
        for name in KV_NAMES:
            d = r[name]
            cells += [pct(d["3-bit"]), pct(d["4-bit"]), pct(d["raw"]), f3(d["codec_bits"]), f3(d["resident_bits"])]
        lines.append("| " + " | ".join(cells) + " |")

    for title, key in ((f"layer {report['drift_layer']}", "drift"), ("max over all layers", "drift_all_layers")):
        rows = report[key]
        heads = [k for k in rows[0] if k != "segment"]
        lines += ["", f"## RoPE positional drift on held-out B, {title}",
                  "", "Mean escape bytes per 16-token block (K or V, summed over a head's tiles), max over heads.", "",
                  "| segment | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for r in rows:
            lines.append(f"| {r['segment']} | " + " | ".join(str(r[h]) for h in heads) + " |")
    return "\n".join(lines) + "\n"

