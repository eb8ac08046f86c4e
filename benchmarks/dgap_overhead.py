"""Decode-step overhead of `DGAPLogitsProcessor` (paper: p95 per-token latency), on CPU or CUDA.

A greedy decode loop over SmolLM2-135M-Instruct (or its architecture with random weights, `--random-weights`) with a
`LowBitCache` after a `--context`-token prefill of real text: each step is timed (CUDA-synchronized) once without and
once with the processor, interleaved in the same process, over the same steps. The processor is the shipped artifact
(`--artifact`) or, when none is given, an untrained `DGAPModel` of the default architecture and `--k-b` (speed does
not depend on weight values).

    python benchmarks/dgap_overhead.py --device cuda --context 8192 --out benchmarks/results/dgap_overhead_h200.json
"""

import argparse
import json
import platform
import time

import torch

from dgap_hf import DGAPLogitsProcessor, LowBitCache
from dgap_hf.features import FEATURE_SPEC
from dgap_hf.models import DGAPModel
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files
from gaac_hf.model_layers import cache_kwarg


def untrained_artifact(config, precision: str, k_b: int) -> DGAPModel:
    n_phi, n_xi = len(FEATURE_SPEC["phi"]), len(FEATURE_SPEC["xi"])
    spec = {"k_b": k_b, "tau": 0.0,  # tau 0: the detector fires, so the corrected slice is written every step
            "detector": {"n_features": n_phi, "arch": "mlp", "hidden": 128, "layers": 2},
            "corrector": {"window": k_b, "n_candidate_features": n_xi, "n_features": n_phi, "arch": "mlp",
                          "hidden": 256, "layers": 2, "max_delta": 8.0}}
    return DGAPModel({precision: spec}, {"name": config.name_or_path, "vocab_size": config.vocab_size})


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--precision", default="K2V2")
    ap.add_argument("--artifact")
    ap.add_argument("--k-b", type=int, default=32)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--text", nargs="+", default=list(DEBIAN_REFERENCE), help="prompt text files (.gz allowed)")
    ap.add_argument("--out")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    from gaac_hf.default_model import load_default_model

    model, tok = load_default_model(device=device)
    if args.random_weights:
        model = type(model)(model.config).to(device, torch.bfloat16).eval()
    if args.artifact:
        proc = DGAPLogitsProcessor.from_pretrained(args.artifact, args.precision, model_config=model.config)
    else:
        proc = DGAPLogitsProcessor(untrained_artifact(model.config, args.precision, args.k_b), args.precision)
    proc.to(device)
    text = read_text_files(args.text).text
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :args.context]
    ids = ids.repeat(args.batch, 1).to(device)
    kw = cache_kwarg(model)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "context": args.context, "batch": args.batch, "steps": args.steps,
              "precision": args.precision, "k_b": proc.k_b, "tau": proc.tau,
              "artifact": args.artifact or "untrained (speed only)", "weights": "random" if args.random_weights
              else "SmolLM2-135M-Instruct", "cache": {}}
    for cache_name in ("LowBitCache", "DynamicCache"):
        from transformers import DynamicCache

        cache = (LowBitCache(model.config, args.precision) if cache_name == "LowBitCache"
                 else DynamicCache(config=model.config))
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache})
        logits = out.logits[:, -1].float()
        seq = ids
        times = {"plain": [], "dgap": []}
        for step in range(args.warmup + args.steps):
            nxt = logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], -1)
            sync(device)
            t0 = time.perf_counter()
            logits = model(input_ids=nxt, use_cache=True, **{kw: cache}).logits[:, -1].float()
            sync(device)
            t1 = time.perf_counter()
            scores = proc(seq, logits)
            sync(device)
            t2 = time.perf_counter()
            if step >= args.warmup:
                times["plain"].append(t1 - t0)
                times["dgap"].append(t2 - t0)
            logits = scores
        row = {}
        for k, v in times.items():
            t = torch.tensor(v) * 1e3
            row[k] = {"mean_ms": float(t.mean()), "p50_ms": float(t.median()), "p95_ms": float(t.quantile(0.95))}
        row["processor_ms_mean"] = row["dgap"]["mean_ms"] - row["plain"]["mean_ms"]
        row["overhead_p95"] = row["dgap"]["p95_ms"] / row["plain"]["p95_ms"] - 1
        row["overhead_mean"] = row["dgap"]["mean_ms"] / row["plain"]["mean_ms"] - 1
        result["cache"][cache_name] = row
        print(f"{cache_name:12s} step p95 {row['plain']['p95_ms']:.2f} ms, with DGAP {row['dgap']['p95_ms']:.2f} ms "
              f"(+{100 * row['overhead_p95']:.1f}% p95, +{100 * row['overhead_mean']:.1f}% mean)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
