"""What a lossless FP16 mode of the GAAC codec would give, measured on SmolLM2-135M-Instruct's real KV.

AWQ models run in FP16 on CUDA (transformers casts them), and GAAC codes BF16. An FP16 value is `s eeeee mmmmmmmmmm`:
a 5-bit exponent instead of 8, and 10 mantissa bits kept verbatim, so an exponent code can save at most 5 of 16 bits
instead of 8. This script captures the model's BF16 KV on a text, casts it to FP16 (exact wherever representable;
overflow, underflow and inexact subnormals are counted), and reports for both formats:

- the ideal size: verbatim sign+mantissa plus the per-channel empirical exponent entropy (no code reaches it);
- the GAAC code: per-channel 8- and 16-wide exponent windows calibrated on the same KV, groups of 8 tokens of one
  channel in 3-bit, 4-bit or raw mode, 2 tag bits per group, escapes for the 4th (and, raw, every further) bit-plane.
  For BF16 this is the project's own calibration (`calibrate_from_captures`, slot capacity and raw tiles included
  in "resident"); for FP16 the same rule with raw = 5 bits (codec bits only, no slot layout exists for FP16).

    python benchmarks/awq_fp16_exponents.py --prompt-tokens 2048 --max-prompts 2 --out benchmarks/results/awq_fp16_exponents.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from gaac_hf.calibrate import (best_window, calibrate_from_captures, complete_blocks, exponent_histogram,
                               size_summary, tile_bases)
from gaac_hf.capture import capture_kv
from gaac_hf.codec import group_modes
from gaac_hf.corpus import GNU_STANDARDS, read_text_files, sample_text, token_prompts
from gaac_hf.format import MODE_3BIT, MODE_4BIT, MODE_RAW, tile_split

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0 ** -14
FP16_MIN_SUBNORMAL = 2.0 ** -24


def per_channel_entropy(hist: torch.Tensor) -> float:
    """Mean over channels of the empirical entropy (bits) of the exponent histogram `[..., D, bins]`."""
    p = hist.double() / hist.sum(-1, keepdim=True).double()
    h = -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(-1)
    weights = hist.sum(-1).double()
    return float((h * weights).sum() / weights.sum())


def fp16_cast_report(kv: torch.Tensor) -> dict:
    x = kv.float()
    h = x.half()
    finite = torch.isfinite(x)
    exact = (h.float() == x) | (torch.isnan(x) & torch.isnan(h.float()))
    mag = x.abs()
    return {"values": x.numel(), "exact": int(exact.sum()),
            "overflow_to_inf": int((finite & (mag > FP16_MAX)).sum()),
            "underflow_to_zero": int((mag > 0).logical_and(h == 0).sum()),
            "inexact_subnormal": int(((mag < FP16_MIN_NORMAL) & (mag >= FP16_MIN_SUBNORMAL) & ~exact).sum()),
            "max_abs": float(mag[finite].max()), "min_abs_nonzero": float(mag[mag > 0].min())}


def fp16_exponents(kv: torch.Tensor) -> torch.Tensor:
    return ((kv.half().view(torch.int16).to(torch.int32) & 0xFFFF) >> 10) & 0x1F


def fp16_histogram(e: torch.Tensor) -> torch.Tensor:
    """`[L, 2, H, T, D]` 5-bit exponents -> `[L, 2, H, D, 32]` counts."""
    e = e.transpose(-1, -2)
    lead = e.shape[:-1]
    rows = torch.arange(lead.numel()).reshape(*lead, 1) * 32
    return torch.bincount((rows + e).reshape(-1), minlength=lead.numel() * 32).reshape(*lead, 32)


def fp16_code(kvs: list[torch.Tensor]) -> dict:
    """The GAAC rule on FP16 exponents: windows per channel, modes per group, codec bits per element."""
    exps = [fp16_exponents(kv) for kv in kvs]
    hist = sum(fp16_histogram(e) for e in exps)
    base3, base4 = best_window(hist, 8), best_window(hist, 16)
    modes = torch.cat([group_modes(complete_blocks(e), tile_bases(base3), tile_bases(base4)).reshape(-1)
                       for e in exps])
    share = {name: float((modes == m).double().mean()) for name, m in
             (("3-bit", MODE_3BIT), ("4-bit", MODE_4BIT), ("raw", MODE_RAW))}
    # per element: 11 verbatim bits (sign, mantissa), 3 code bits in planes, 2 tag bits per 8; escapes per group of
    # 8: one plane byte (4-bit), two (raw: planes 3 and 4 of a 5-bit exponent)
    bits = 11 + 3 + 2 / 8 + (share["4-bit"] * 8 + share["raw"] * 16) / 8
    entropy = per_channel_entropy(hist)
    return {"group_modes": share, "codec_bits": bits, "codec_ratio": 16 / bits,
            "exponent_entropy_per_channel": entropy, "ideal_bits": 11 + entropy, "ideal_ratio": 16 / (11 + entropy),
            "best_case_bits": 11 + 3 + 2 / 8, "best_case_ratio": 16 / (11 + 3 + 2 / 8)}


def bf16_code(kvs: list[torch.Tensor]) -> dict:
    base3, base4, capacity, escapes = calibrate_from_captures(lambda: iter(kvs))
    s = size_summary(escapes, tile_split(kvs[0].shape[-1])[1], capacity)
    entropy = per_channel_entropy(sum(exponent_histogram(kv) for kv in kvs))
    return {"codec_bits": s.codec_bits, "codec_ratio": s.codec_ratio, "resident_bits": s.resident_bits,
            "resident_ratio": s.resident_ratio, "escape_capacity": capacity,
            "exponent_entropy_per_channel": entropy, "ideal_bits": 8 + entropy, "ideal_ratio": 16 / (8 + entropy)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--text", nargs="*", help="text files (default: GNU standards if installed, else licence texts)")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-prompts", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    from gaac_hf.default_model import load_default_model

    paths = args.text or [p for p in GNU_STANDARDS if Path(p).is_file()]
    corpus = read_text_files(paths) if paths else sample_text()
    model, tokenizer = load_default_model()
    prompts = token_prompts(tokenizer, corpus.text, args.prompt_tokens, args.max_prompts)
    kvs = [capture_kv(model, p) for p in prompts]
    cast = fp16_cast_report(torch.cat([kv.reshape(-1) for kv in kvs]))
    out = {"model": model.config.name_or_path, "corpus": corpus.description, "prompts": len(prompts),
           "prompt_tokens": args.prompt_tokens, "fp16_cast": cast, "bf16": bf16_code(kvs), "fp16": fp16_code(kvs)}
    b, f = out["bf16"], out["fp16"]
    rows = ["| KV format | exponent entropy / channel (bit) | ideal bit/elt (ratio) | GAAC codec bit/elt (ratio) |",
            "|---|---|---|---|",
            f"| BF16 (8-bit exponent) | {b['exponent_entropy_per_channel']:.3f} | {b['ideal_bits']:.3f} "
            f"({b['ideal_ratio']:.4f}x) | {b['codec_bits']:.3f} ({b['codec_ratio']:.4f}x); resident "
            f"{b['resident_bits']:.3f} ({b['resident_ratio']:.4f}x) |",
            f"| FP16 (5-bit exponent) | {f['exponent_entropy_per_channel']:.3f} | {f['ideal_bits']:.3f} "
            f"({f['ideal_ratio']:.4f}x) | {f['codec_bits']:.3f} ({f['codec_ratio']:.4f}x); all 3-bit "
            f"{f['best_case_bits']:.3f} ({f['best_case_ratio']:.4f}x) |"]
    print(f"{out['model']}, {len(prompts)} x {args.prompt_tokens} tokens of {corpus.description}")
    print("\n".join(rows))
    exact = cast["exact"] / cast["values"]
    print(f"BF16 -> FP16 cast: {100 * exact:.4f}% exact, {cast['overflow_to_inf']} overflow to inf, "
          f"{cast['underflow_to_zero']} underflow to 0, {cast['inexact_subnormal']} inexact subnormals "
          f"(max |x| {cast['max_abs']:.4g}, min nonzero |x| {cast['min_abs_nonzero']:.3g}); FP16 group modes "
          + ", ".join(f"{k} {100 * v:.2f}%" for k, v in f["group_modes"].items()))
    if args.out:
        out["table"] = rows
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
