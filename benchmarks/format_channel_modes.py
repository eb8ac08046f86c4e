"""Could a slot do without per-group mode tags? Per-channel concentration of the non-3-bit groups in real KV.

A tag-free ("fixed-layout") slot would fix each channel's code width at calibration time (3 bits, or 4 bits with a
dense fourth plane), so the decoder needs no tags, escape offsets or prepass; a tile with a group that does not fit its
channel's width would go to the raw-tile pool. This measures what that costs on real SmolLM2-135M KV (the
`[layers, 2, heads, tokens, 64]` pool of `benchmarks/attention.py --real-kv`): windows calibrated on the first half
of the tokens, groups of 8 tokens per channel (format 1's grouping) evaluated on the second half; for thresholds on a
channel's share of non-3-bit groups (4-bit above it), the share of tiles left raw and the bits per element, against
format 1's codec bits (tags and escapes counted, capacity effects not).

    python benchmarks/format_channel_modes.py --real-kv .bench/real_kv_2k.safetensors \\
        --out benchmarks/results/format_channel_modes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gaac_hf.calibrate import exponent_histogram, windows_from_histogram  # noqa: E402

THRESHOLDS = (0.0, 0.01, 0.03, 0.1, 1.0)


def study(kv: torch.Tensor) -> dict:
    layers, _, heads, tokens, dim = kv.shape
    half = tokens // 2
    base3, base4 = windows_from_histogram(exponent_histogram(kv[:, :, :, :half]))
    e = (kv[:, :, :, half:].view(torch.int16).int() >> 7) & 0xFF
    n = (e.shape[3] // 16) * 16
    e = e[:, :, :, :n].reshape(layers, 2, heads, n // 8, 8, dim)
    fit3 = ((e - base3.int()[:, :, :, None, None, :]) % 256 < 8).all(4)
    fit4 = ((e - base4.int()[:, :, :, None, None, :]) % 256 < 16).all(4)
    mode = torch.where(fit3, 3, torch.where(fit4, 4, 8))  # [L, 2, H, groups, D]
    shares = {m: (mode == m).float().mean().item() for m in (3, 4, 8)}
    format1_bits = 8 + 3 + 0.25 + shares[4] * 1 + shares[8] * 5  # sm, planes 0-2, tags, escape bytes per element
    wide = (mode >= 4).float().mean(3)  # [L, 2, H, D]: a channel's share of non-3-bit groups
    tiles = mode.reshape(layers, 2, heads, n // 16, 2, dim)
    rows = []
    for thr in THRESHOLDS:
        four = wide > thr
        width = torch.where(four[:, :, :, None, None, :], 4, 3)
        fits = (tiles <= width).all(4).all(-1)  # every group of the tile fits its channel's width (raw never)
        raw = 1 - fits.float().mean().item()
        bits = (1 - raw) * (11 + four.float().mean().item()) + raw * 16
        rows.append({"threshold": thr, "four_bit_channels": round(four.float().mean().item(), 4),
                     "raw_tiles": round(raw, 4), "bits_per_element": round(bits, 3), "ratio": round(16 / bits, 3)})
    return {"group_modes": {f"{m}-bit" if m < 8 else "raw": round(v, 4) for m, v in shares.items()},
            "format1_codec_bits": round(format1_bits, 3), "format1_ratio": round(16 / format1_bits, 3),
            "channels_by_wide_share": {f"<= {q}": round((wide <= q).float().mean().item(), 4)
                                       for q in (0.0, 0.01, 0.05, 0.2, 0.5)},
            "fixed_layout": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    ap.add_argument("--out", default="benchmarks/results/format_channel_modes.json")
    args = ap.parse_args(argv)
    from safetensors.torch import load_file

    res = study(load_file(args.real_kv)["kv"])
    res["command"] = "python benchmarks/format_channel_modes.py " + " ".join(sys.argv[1:] if argv is None else argv)
    print(f"group modes {res['group_modes']}; format 1 codec {res['format1_codec_bits']} bit/elt "
          f"({res['format1_ratio']}x)")
    print("| 4-bit above share | 4-bit channels | raw tiles | bit/elt | ratio |\n|---|---|---|---|---|")
    for r in res["fixed_layout"]:
        print(f"| {r['threshold']} | {100 * r['four_bit_channels']:.1f}% | {100 * r['raw_tiles']:.1f}% | "
              f"{r['bits_per_element']} | {r['ratio']}x |")
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
