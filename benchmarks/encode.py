"""Cost of block finalization in GAACCache on a GPU: one decode step's update of a GAAC layer when its 16th tail
token completes a block (encode + slot bookkeeping) against a step that only appends to the tail.

Llama-3.1-8B shape (8 KV heads, head_dim 128, 32 layers), batch 1; KV with real exponent statistics (see
benchmarks/attention.py). Prints per-layer microseconds, the cost per step amortized over 16 steps for 32 layers,
and writes JSON.

    python benchmarks/encode.py --real-kv .bench/real_kv.safetensors --out benchmarks/results/encode.json
"""

import argparse
import json
import time

import torch
from safetensors.torch import load_file

from gaac_hf.cache import GAACLayer
from gaac_hf.calibrate import choose_escape_capacity, exponent_histogram, tile_escape_bytes, windows_from_histogram
from gaac_hf.calibration import CalibrationConfig, GAACCalibration


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--real-kv", default=".bench/real_kv.safetensors")
    p.add_argument("--out", default="benchmarks/results/encode.json")
    p.add_argument("--context", type=int, default=65536)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    import sys

    sys.path.insert(0, "benchmarks")
    from attention import real_kv

    dev = torch.device("cuda")
    heads, d = 8, 128
    pool = load_file(args.real_kv)["kv"]
    k, v = real_kv(pool, 1, heads, 4096 + 64, d, torch.Generator().manual_seed(0))
    kv = torch.stack([k[0], v[0]])[None]  # [1 layer, 2, H, T, D]
    hist = exponent_histogram(kv)
    b3, b4 = windows_from_histogram(hist)
    cap = choose_escape_capacity(tile_escape_bytes(kv, b3, b4).reshape(-1), 128)
    cfg = CalibrationConfig(base_model="random", num_hidden_layers=1, layers=[0], num_kv_heads=heads, head_dim=d,
                            escape_capacity=cap)
    calib = GAACCalibration(cfg, b3, b4)
    k, v = k.to(dev), v.to(dev)
    layer = GAACLayer(calib, 0)
    layer.lazy = True  # what the "gaac" attention gets: single-token steps return the compressed snapshot
    ctx = args.context
    # fill to `ctx` tokens with real-statistics blocks (tiled), then time single-token steps
    chunk = 4096
    for s in range(0, ctx, chunk):
        layer.update(k[:, :, :chunk], v[:, :, :chunk])
    torch.cuda.synchronize()
    finalize, append = [], []
    for step in range(16 * 20):
        t = 4096 + step % 64
        ks, vs = k[:, :, t:t + 1], v[:, :, t:t + 1]
        completes = (layer.tail_length == 15)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        layer.update(ks, vs)
        torch.cuda.synchronize()
        (finalize if completes else append).append((time.perf_counter() - t0) * 1e6)
    med = lambda x: sorted(x)[len(x) // 2]  # noqa: E731
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "context": ctx, "kv_heads": heads,
           "head_dim": d, "escape_capacity": cap, "finalize_step_us_per_layer": med(finalize),
           "append_step_us_per_layer": med(append),
           "extra_per_finalization_us_all_layers": (med(finalize) - med(append)) * args.layers}
    res["amortized_extra_us_per_step_all_layers"] = res["extra_per_finalization_us_all_layers"] / 16
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
