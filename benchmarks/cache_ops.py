"""Host-side work of `GAACCache.update` per layer and decode step: aten ops dispatched and wall time.

A decode step either appends one token to each layer's BF16 tail or, every 16th step, finalizes a block (encodes it
into a slot). On a GPU each aten op is roughly one kernel launch, so the op count is what the issue-6 decode loop pays
per layer beside attention. Uses a Llama-3.1-8B-shaped KV layer (8 KV heads, head_dim 128) on a small random model,
calibrated on its own KV, and `lazy=True` (the `"gaac"` attention path: update returns the compressed view).

    python benchmarks/cache_ops.py --context 1024 --out benchmarks/results/cache_ops_cpu.json
"""

import argparse
import collections
import copy
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gaac_hf import GAACCache  # noqa: E402
from gaac_hf.calibrate import calibrate  # noqa: E402


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="benchmarks/results/cache_ops_cpu.json")
    args = p.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=args.layers, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      hidden_size=256, intermediate_size=512, vocab_size=512)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(args.device).eval()
    calibration = calibrate(model, [torch.randint(0, 512, (512,))], "random ids")
    cache = GAACCache(model.config, calibration, lazy=True)
    gen = torch.Generator().manual_seed(0)

    def kv(tokens):
        return (torch.randn(1, 8, tokens, 128, generator=gen) * 2).bfloat16().to(args.device)

    for layer in range(args.layers):
        cache.update(kv(args.context), kv(args.context), layer)
    rows = {"append": [], "finalize": []}
    top = collections.Counter()
    for _ in range(args.steps):
        inputs = [(kv(1), kv(1)) for _ in range(args.layers)]
        finalizes = (cache.get_seq_length() + 1) % 16 == 0
        # the ops are counted on a copy of the cache and the step is timed on the cache itself, without the dispatch
        # hook (until session 19 the counted step was undone with crop(-1), which at a block boundary left the tile
        # pool to be swept by the timed step: the finalizing time included a mark-and-sweep a decode step never does)
        counter = CountOps()
        probe = copy.deepcopy(cache)
        with counter:
            for layer, (k, v) in enumerate(inputs):
                probe.update(k, v, layer)
        ops = sum(counter.ops.values()) / args.layers
        del probe
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for layer, (k, v) in enumerate(inputs):
            cache.update(k, v, layer)
        if args.device != "cpu":
            torch.cuda.synchronize()
        us = (time.perf_counter() - t0) / args.layers * 1e6
        rows["finalize" if finalizes else "append"].append({"ops": ops, "us": us})
        if finalizes:
            top.update(counter.ops)
    result = {"device": args.device, "torch": torch.__version__, "python": platform.python_version(),
              "context": args.context, "layers": args.layers,
              **{k: {"steps": len(v), "ops_per_layer": statistics.median(r["ops"] for r in v),
                     "us_per_layer": statistics.median(r["us"] for r in v)} for k, v in rows.items() if v},
              "finalize_top_ops": top.most_common(12)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("| step | steps | aten ops per layer | µs per layer |\n|---|---|---|---|")
    for k in ("append", "finalize"):
        if k in result:
            print(f"| {k} | {result[k]['steps']} | {result[k]['ops_per_layer']:.0f} | {result[k]['us_per_layer']:.0f} |")


if __name__ == "__main__":
    main()
