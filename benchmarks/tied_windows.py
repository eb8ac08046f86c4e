"""What tying the 4-bit window to the 3-bit one would cost (a format-v2 question of issue 12), on real KV.

Format 1 calibrates the two windows of a channel independently. A fused kernel would like them tied, so that one
code path serves both modes (a 3-bit code is then a 4-bit code with a fixed high bit), and even aligned, so that the
exponent field is `base | code` with no addition (3-bit windows starting at multiples of 8). Each variant is
calibrated on text A (windows, then the escape capacity that minimizes resident bytes on A) and applied to held-out
text B, with the reference codec's rules (`gaac_hf.report.evaluate`). SmolLM2-135M-Instruct, real English prose
(Debian packages gnu-standards, debian-reference-en).

    python benchmarks/tied_windows.py --prompt-tokens 4096 --calib-prompts 2 --heldout-prompts 1
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gaac_hf.calibrate import (WINDOW_3BIT, best_window, choose_escape_capacity, exponent_histogram,  # noqa: E402
                               tile_escape_bytes, window_sums)
from gaac_hf.capture import capture_corpus  # noqa: E402
from gaac_hf.corpus import DEBIAN_REFERENCE, GNU_STANDARDS, read_text_files, token_prompts  # noqa: E402
from gaac_hf.default_model import load_default_model  # noqa: E402
from gaac_hf.format import tile_split  # noqa: E402
from gaac_hf.report import evaluate  # noqa: E402


def aligned_window(hist: torch.Tensor, width: int, align: int) -> torch.Tensor:
    """Base of the best window of `width` exponents among those starting at multiples of `align`."""
    sums = window_sums(hist, width)
    starts = torch.arange(sums.shape[-1], device=hist.device)
    sums = torch.where(starts % align == 0, sums, -1)
    return sums.argmax(-1).to(torch.uint8)


def variants(hist: torch.Tensor) -> dict:
    """(base3, base4) per variant, each uint8 `[L, 2, H, D]`."""
    b3 = best_window(hist, WINDOW_3BIT)
    free4 = best_window(hist, 2 * WINDOW_3BIT)
    lo = lambda b, k: (b.int() - k).clamp(0, 240).to(torch.uint8)  # noqa: E731
    a3 = aligned_window(hist, WINDOW_3BIT, WINDOW_3BIT)
    e3, e4 = aligned_window(hist, WINDOW_3BIT, 2), aligned_window(hist, 2 * WINDOW_3BIT, 2)
    return {
        "format_1_free_windows": (b3, free4),
        "tied_4bit_window_b3-4": (b3, lo(b3, 4)),  # [b3 - 4, b3 + 12): centred on the 3-bit window
        "tied_4bit_window_b3-8": (b3, lo(b3, 8)),  # [b3 - 8, b3 + 8): the 3-bit window is its upper half
        "tied_4bit_window_b3": (b3, b3),  # [b3, b3 + 16): its lower half
        "aligned_3bit_tied_b3-8": (a3, lo(a3, 8)),  # exponent field = base | code, no add, one path
        # both windows start at even exponents: the top 7 exponent bits are coded and the lowest is stored
        # verbatim with the mantissa (the BF16 low byte), a byte-split layout
        "even_windows": (e3, e4),
        "even_3bit_tied_b3-4": (e3, lo(e3, 4)),
        # the byte-split layout with the 4-bit window as [b3 - 8, b3 + 8): in units of the high byte (e >> 1) the
        # 3-bit window's upper-half code is then `w - 4 | code`, one OR for both modes (attention_cuda.md's sketch)
        "even_3bit_tied_b3-8": (e3, lo(e3, 8)),
        # format 1's windows moved down to even starts (`GAACCalibration.convert(2)`): what a cache that stores format
        # version 2 with a version-1 calibration codes against
        "format_1_windows_converted": (b3 & 0xFE, free4 & 0xFE),
    }


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--calib-prompts", type=int, default=2)
    p.add_argument("--heldout-prompts", type=int, default=1)
    p.add_argument("--chunk-tokens", type=int, default=1024)
    p.add_argument("--out", default="benchmarks/results/tied_windows.json")
    p.add_argument("--text-a", nargs="*", default=list(GNU_STANDARDS), help="calibration text files")
    p.add_argument("--text-b", nargs="*", default=list(DEBIAN_REFERENCE), help="held-out text files")
    p.add_argument("--variants", nargs="*", help="variants to evaluate (default: all)")
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    t0 = time.time()
    model, tokenizer = load_default_model()
    a = read_text_files(args.text_a)
    b = read_text_files(args.text_b)
    pa = token_prompts(tokenizer, a.text, args.prompt_tokens, args.calib_prompts)
    pb = token_prompts(tokenizer, b.text, args.prompt_tokens, args.heldout_prompts)
    store = tempfile.mkdtemp(prefix="tied-windows-")

    def source(prompts, name):
        folder = f"{store}/{name}"
        list(capture_corpus(model, prompts, args.chunk_tokens, folder, f"capture {name}"))
        return lambda: capture_corpus(model, prompts, args.chunk_tokens, folder, f"read {name}")

    cal, held = source(pa, "A"), source(pb, "B")
    hist = None
    for kv in cal():
        h = exponent_histogram(kv)
        hist = h if hist is None else hist + h
    channels = tile_split(hist.shape[-2])[1]
    rows = {}
    for name, (b3, b4) in variants(hist).items():
        if args.variants and name not in args.variants:
            continue
        escapes = torch.cat([tile_escape_bytes(kv, b3, b4).reshape(-1) for kv in cal()])
        cap = choose_escape_capacity(escapes, channels)
        ev = evaluate(held, b3, b4, cap, channels)
        rows[name] = {"escape_capacity": cap, "mode_shares": ev["mode_shares"],
                      **{k: ev[k] for k in ("codec_bits", "codec_ratio", "resident_bits", "resident_saving",
                                            "raw_tile_share")},
                      # the same windows with groups of 8 channels of one token (the grouping a kernel whose lanes
                      # own their groups would read; its escape capacity chosen on the held-out text itself)
                      "channel_grouping": ev["grouping_8_channels_of_one_token"]}
        print(name, json.dumps(rows[name]), flush=True)
    res = {"model": "SmolLM2-135M-Instruct", "calibration": f"A = {a.description}: {len(pa)} x {args.prompt_tokens}",
           "heldout": f"B = {b.description}: {len(pb)} x {args.prompt_tokens}", "variants": rows,
           "command": " ".join(["python", "benchmarks/tied_windows.py", *(argv or sys.argv[1:])]),
           "wall_s": round(time.time() - t0, 1)}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
