"""Decode-step time on the CPU (the path `make demo` shows): GAACCache against DynamicCache on the default model.

SmolLM2-135M-Instruct (BF16), batch 1. For each context the prompt's KV comes from one eager prefill with
DynamicCache; GAACCache gets the same KV through its own `update` (encoded once), then both run the same decode
steps, interleaved step by step (median per step). The GAAC steps' outputs are checked bit for bit against the same
attention on the DynamicCache. The JSON records the CPU decoder that ran (`gaac_hf.cpu_decode`: the C kernel, or the torch fallback
under `GAAC_HF_CPU_KERNEL=0`) and the load average before and after (the numbers are only comparable within a run).

    python benchmarks/cpu_step.py --contexts 360 4096 --steps 8 --threads 1 --out benchmarks/results/cpu_step_s5.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gaac_hf import GAACCache  # noqa: E402
from gaac_hf.cli import shipped_calibration  # noqa: E402
from gaac_hf.cpu_decode import kernel  # noqa: E402
from gaac_hf.default_model import load_default_model  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402


def steps(model, caches: dict, context: int, n: int):
    """`n` decode steps of each cache, interleaved (step i of every cache, then step i + 1), so that a change of the
    machine's load hits them alike. Returns `{label: (times, logits [n, V])}`."""
    name = cache_kwarg(model)
    toks = {label: torch.tensor([[42]]) for label in caches}
    out = {label: ([], []) for label in caches}
    for i in range(n):
        for label, cache in caches.items():
            t = time.perf_counter()
            o = model(input_ids=toks[label], position_ids=torch.tensor([[context + i]]), use_cache=True,
                      **{name: cache})
            out[label][0].append(time.perf_counter() - t)
            out[label][1].append(o.logits[:, -1])
            toks[label] = o.logits[:, -1:].argmax(-1)
    return {label: (times, torch.stack(logits)) for label, (times, logits) in out.items()}


@torch.no_grad()
def main(argv=None):
    from transformers import DynamicCache

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[360, 4096])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default="benchmarks/results/cpu_step.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_default_model()
    name = cache_kwarg(model)
    calibration = str(shipped_calibration())
    res = {"torch": torch.__version__, "threads": torch.get_num_threads(), "steps": args.steps,
           "cpu_decoder": "C kernel" if kernel() is not None else "torch", "cpus": os.cpu_count(),
           "load_average_before": [round(x, 2) for x in os.getloadavg()], "contexts": {}}
    for context in args.contexts:
        ids = torch.randint(10, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(0))
        model.set_attn_implementation("sdpa")
        prefill = DynamicCache(config=model.config)
        model(input_ids=ids, use_cache=True, **{name: prefill})
        kv = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.layers]
        row = {}
        for attn in ("sdpa", "gaac"):
            model.set_attn_implementation(attn)
            caches = {"DynamicCache": DynamicCache(config=model.config),
                      "GAACCache": GAACCache.from_pretrained(calibration, config=model.config)}
            for cache in caches.values():
                for i, (k, v) in enumerate(kv):
                    cache.update(k, v, i)
            steps(model, caches, context, 1)  # warm up
            outs = {}
            for label, (times, logits) in steps(model, caches, context + 1, args.steps).items():
                outs[label] = logits
                row[f"{label} + {attn}"] = round(1e3 * statistics.median(times), 2)
                print(f"context {context}: {label} + {attn}: {row[f'{label} + {attn}']:.1f} ms/step", flush=True)
            row[f"bit_identical ({attn})"] = bool(torch.equal(outs["GAACCache"].view(torch.int16),
                                                              outs["DynamicCache"].view(torch.int16)))
            row[f"ratio ({attn})"] = round(row[f"GAACCache + {attn}"] / row[f"DynamicCache + {attn}"], 3)
        res["contexts"][str(context)] = row
    res["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\ndecoder: {res['cpu_decoder']}; threads {res['threads']}; load average {res['load_average_before']} "
          f"-> {res['load_average_after']} on {res['cpus']} CPUs")
    print("| context | " + " | ".join(k for k in next(iter(res["contexts"].values()))) + " |")
    for c, row in res["contexts"].items():
        print(f"| {c} | " + " | ".join(str(v) for v in row.values()) + " |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
