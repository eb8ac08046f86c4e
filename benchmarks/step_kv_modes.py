"""Is the captured step's KV harder for the kernel than the probes' KV? Group modes of both (issue 13, session 21).

`benchmarks/generate.py` fills its caches with a random-weight Llama-3.1-8B's own KV (calibrated on it, format
version 2); the kernel probes (`warps_probe.py`, `format_v2_probe.py`) use real SmolLM2 KV channels
(`.bench/real_kv_2k.safetensors`, 64 channels, two of them side by side per 128-channel head). In the captured step
the GAAC split kernel took ~5 µs more per layer than alone (the twin ~2): the share of 4-bit and raw groups, of tiles
with a raw group (their overlay path) and of tiles past the escape capacity (raw BF16 tiles) says whether the model's
KV explains it. CPU only: the model is cut to `--layers` layers (RMSNorm before every projection keeps the KV
statistics of a random init alike across depth), the same seeds and calibration as generate.py.

    python benchmarks/step_kv_modes.py --out benchmarks/results/step_kv_modes.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.generate import llama31_8b_config, own_kv_calibration  # noqa: E402
from benchmarks.tied_windows import aligned_window  # noqa: E402
from gaac_hf.calibrate import (WINDOW_3BIT, choose_escape_capacity, exponent_histogram,  # noqa: E402
                               tile_escape_bytes, tile_modes)


def mode_stats(kv: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, capacity: int) -> dict:
    """Modes of `kv` `[L, 2, H, T, D]` under the windows: group shares, tiles with a raw group, 4-bit or raw groups
    per tile, tiles whose escapes exceed `capacity`."""
    m = tile_modes(kv, base3, base4)  # [L, 2, H, blocks, tiles, G]
    return {"groups_per_tile": m.shape[-1],
            "mode_shares": {name: round((m == i).double().mean().item(), 5)
                            for i, name in enumerate(("3-bit", "4-bit", "raw"))},
            "tiles_with_a_raw_group": round((m == 2).any(-1).double().mean().item(), 4),
            "wide_groups_per_tile": round((m >= 1).sum(-1).double().mean().item(), 2),
            "tiles_over_capacity": round((tile_escape_bytes(kv, base3, base4) > capacity).double().mean().item(), 5),
            "escape_capacity": capacity}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    p.add_argument("--out", default="benchmarks/results/step_kv_modes.json")
    args = p.parse_args(argv)
    t0 = time.time()
    torch.manual_seed(0)
    cfg = llama31_8b_config(False)
    cfg.num_hidden_layers = args.layers
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    _, cal, _, kv = own_kv_calibration(model, False, torch.device("cpu"), 2)
    own = torch.stack([torch.stack([k[0], v[0]]) for k, v in kv])  # [L, 2, H, T, D]
    res = {"random_llama31_8b_own_kv": mode_stats(own, cal.base3, cal.base4, cal.config.escape_capacity)}
    pool = load_file(args.real_kv)["kv"]  # [L, 2, H, T, 64]
    hist = exponent_histogram(pool)
    b3, b4 = aligned_window(hist, WINDOW_3BIT, 2), aligned_window(hist, 2 * WINDOW_3BIT, 2)  # even windows
    cap = choose_escape_capacity(tile_escape_bytes(pool, b3, b4).reshape(-1), pool.shape[-1])
    res["real_smollm2_kv_64_channels"] = mode_stats(pool, b3, b4, cap)
    res["command"] = " ".join(["python", "benchmarks/step_kv_modes.py", *(argv or sys.argv[1:])])
    res["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
