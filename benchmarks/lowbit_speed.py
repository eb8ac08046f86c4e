"""Decode time per step of the low-bit KV caches (issue 14's results table): each precision's default `LowBitCache`,
transformers' `QuantizedCache` (quanto, HQQ where installed) and `DynamicCache`, on SmolLM2-135M-Instruct.

Each cache is filled by a prefill of `--context` tokens of held-out text, then `--steps` greedy decode steps are timed
one by one (median; the device is synchronized around each step). Eager Hugging Face steps: on a GPU they are
host-bound (launches and Python), so these times say what a user pays per token in eager `generate`, not what the
kernels could do.

    python benchmarks/lowbit_speed.py --context 2048 --steps 16 --threads 1 --out benchmarks/results/lowbit_speed_cpu.json
    python benchmarks/lowbit_speed.py --device cuda --context 8000 --out $OUT/lowbit_speed_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dgap_hf import LowBitCache, LowBitConfig  # noqa: E402
from dgap_hf.baselines import quantized_cache  # noqa: E402
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files, token_prompts  # noqa: E402
from gaac_hf.default_model import load_default_model  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402

PRECISIONS = ("K8V8", "K4V4", "K2V2", "K1V1")
QUANTIZED = (("quanto", 4), ("quanto", 2), ("hqq", 4), ("hqq", 2))


def caches(config):
    """label -> factory of a fresh cache."""
    out = {"DynamicCache": lambda: DynamicCache(config=config)}
    for p in PRECISIONS:
        out[f"{p} default"] = lambda p=p: LowBitCache(config, LowBitConfig.default(p, model_config=config))
    for backend, nbits in QUANTIZED:
        out[f"QuantizedCache {backend} {nbits}"] = lambda b=backend, n=nbits: quantized_cache(config, b, n)
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_cache(model, ids, make, steps: int, device) -> dict:
    name = cache_kwarg(model)
    cache = make()
    out = model(input_ids=ids, use_cache=True, **{name: cache})
    tok = out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(steps + 2):  # the first two steps warm up
        sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=tok, use_cache=True, **{name: cache})
        tok = out.logits[:, -1:].argmax(-1)
        sync(device)
        times.append(time.perf_counter() - t0)
    times = times[2:]
    return {"ms_per_step": round(1e3 * statistics.median(times), 3), "min_ms": round(1e3 * min(times), 3),
            "steps": steps}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads on the CPU (0: torch's default)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--caches", nargs="*", help="labels to time (default: all; DynamicCache always runs)")
    p.add_argument("--out", default="benchmarks/results/lowbit_speed_cpu.json")
    p.add_argument("--text", nargs="*", default=list(DEBIAN_REFERENCE),
                   help="text files of the prompt (default: the Debian reference, Debian package debian-reference-en)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, tok = load_default_model()
    model = model.to(device=device, dtype=getattr(torch, args.dtype))
    text = read_text_files(args.text)
    ids = token_prompts(tok, text.text, args.context, 1)[0][None].to(device)
    rows = {}
    todo = caches(model.config)
    if args.caches:
        unknown = set(args.caches) - set(todo)
        if unknown:
            raise SystemExit(f"unknown caches {sorted(unknown)}; known: {sorted(todo)}")
        todo = {k: f for k, f in todo.items() if k == "DynamicCache" or k in args.caches}
    for label, make in todo.items():
        try:
            rows[label] = time_cache(model, ids, make, args.steps, device)
        except (ValueError, ImportError) as e:  # a QuantizedCache backend that is not installed
            rows[label] = {"error": str(e)[:200]}
        print(label, rows[label], flush=True)
    base = rows["DynamicCache"]["ms_per_step"]
    print(f"\n| cache | ms per decode step at {args.context} tokens | vs DynamicCache |\n|---|---|---|")
    for label, r in rows.items():
        if "ms_per_step" in r:
            print(f"| {label} | {r['ms_per_step']:.1f} | {r['ms_per_step'] / base:.2f}x |")
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "torch": torch.__version__, "threads": torch.get_num_threads(), "dtype": args.dtype,
           "context": args.context, "rows": rows,
           "command": " ".join(["python", "benchmarks/lowbit_speed.py", *(sys.argv[1:] if argv is None else argv)])}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
