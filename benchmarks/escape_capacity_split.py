"""Fewer bytes per token from the escape capacity? One capacity per calibration against finer ones, on the kernel
benchmark's real-statistics KV.

Issue 12's speed targets ask the kernel to stream its bytes at ~97% of cuDNN's rate at 1x128K
(`benchmarks/results/attention_cuda.md`, "Where it stands"), unless the slots get smaller: every 1% of bytes is about
1% of the kernel's time there. The slot's fixed sections (sign+mantissa or low bytes, three code planes, tags) are
incompressible at this code; its escape area `E` (a capacity per calibration, chosen to minimize resident bytes, a
tile with more escapes kept raw) is the one free size. This measures, per benchmark shape (SmolLM2's captured KV
channels tiled to the shape, as `benchmarks/attention.py` builds them; format version 2's even windows), the resident
bytes per tile (slot or raw tile, plus its table entry) with:

- `joint`: one capacity for every tile (what the caches do);
- `k_v`: one capacity for K tiles and one for V tiles;
- `k_v_head`: one per (K|V, kv-head);
- `exact`: every slot sized to its own escapes (rounded up to 16 bytes; no raw tiles), the bound of any capacity
  scheme (a kernel would then need per-slot offsets).

    python benchmarks/escape_capacity_split.py --real-kv .bench/real_kv_2k.safetensors \\
        --out benchmarks/results/escape_capacity_split.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gaac_hf.calibrate import (choose_escape_capacity, exponent_histogram, resident_bytes_per_tile,  # noqa: E402
                                tile_escape_bytes, windows_from_histogram)
from gaac_hf.format import ALIGN, BLOCK_TABLE_ENTRY_BYTES, TileLayout, tile_split  # noqa: E402

SHAPES = ((8, 128, 16384), (3, 64, 16384))  # (kv heads, head_dim, tokens): batch 1; the source repeats every 2K tokens


def tile_escapes(k: torch.Tensor, v: torch.Tensor, format_version: int = 2) -> torch.Tensor:
    """Escape bytes of every tile of K, V `[1, H, S, D]` under windows calibrated on them: `[2 (K|V), H, tiles]`."""
    kv = torch.stack([k, v]).transpose(0, 1)  # [1 (layer), 2, H, S, D]
    base3, base4 = windows_from_histogram(exponent_histogram(kv)[0], format_version)
    return tile_escape_bytes(kv, base3[None], base4[None])[0].flatten(2)  # [2, H, blocks * tiles]


def _best(escapes: torch.Tensor, channels: int) -> tuple[int, float]:
    cap = choose_escape_capacity(escapes, channels)
    return cap, resident_bytes_per_tile(escapes.reshape(-1), channels, cap).item()


def study(esc: torch.Tensor, channels: int) -> dict:
    """Resident bytes per tile of the escapes `[2, H, tiles]` under each capacity scheme, and each one's gain over
    `joint` (bytes saved, as a share of joint's)."""
    cap, joint = _best(esc, channels)
    kv = [_best(esc[i], channels) for i in range(2)]
    per_head = [_best(esc[i, j], channels) for i in range(2) for j in range(esc.shape[1])]
    fixed = TileLayout(channels, 0).slot_bytes
    exact = (fixed + (-(-esc.double() // ALIGN)) * ALIGN).mean().item() + BLOCK_TABLE_ENTRY_BYTES
    out = {"joint": {"capacity": cap, "bytes_per_tile": round(joint, 2)},
           "k_v": {"capacity": [c for c, _ in kv], "bytes_per_tile": round(sum(b for _, b in kv) / 2, 2)},
           "k_v_head": {"capacity": [c for c, _ in per_head],
                        "bytes_per_tile": round(sum(b for _, b in per_head) / len(per_head), 2)},
           "exact": {"bytes_per_tile": round(exact, 2)},
           "raw_tile_bytes": TileLayout(channels, cap).raw_bytes + BLOCK_TABLE_ENTRY_BYTES,
           "mean_escape_bytes": round(esc.double().mean().item(), 2)}
    for name in ("k_v", "k_v_head", "exact"):
        out[name]["saved_vs_joint"] = round(1 - out[name]["bytes_per_tile"] / joint, 5)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    p.add_argument("--out", default="benchmarks/results/escape_capacity_split.json")
    args = p.parse_args()
    from safetensors.torch import load_file

    from benchmarks.attention import real_kv

    pool = load_file(args.real_kv)["kv"]
    gen = torch.Generator().manual_seed(0)
    res = {"real_kv": args.real_kv, "torch": torch.__version__, "rows": []}
    print("| kv heads / head_dim, tokens | joint B/tile (E) | K,V | per (K|V, head) | exact slots | mean escapes |")
    print("|---|---|---|---|---|---|")
    for h, d, s in SHAPES:
        k, v = real_kv(pool, 1, h, s, d, gen)
        row = {"shape": f"{h}/{d} 1x{s}", **study(tile_escapes(k, v), tile_split(d)[1])}
        res["rows"].append(row)
        print(f"| {row['shape']} | {row['joint']['bytes_per_tile']} ({row['joint']['capacity']}) | "
              + " | ".join(f"{row[n]['bytes_per_tile']} ({100 * row[n]['saved_vs_joint']:+.2f}%)"
                           for n in ("k_v", "k_v_head", "exact")) + f" | {row['mean_escape_bytes']} |")
    res["command"] = " ".join(["python", "benchmarks/escape_capacity_split.py", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
