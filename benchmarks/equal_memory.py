"""Equal-memory throughput (the paper's Table 2): the largest batch each cache fits in one KV budget, and the
aggregate tokens/s of a compiled decode loop at that batch.

A Llama-3.1-8B-shaped model (random BF16 weights, or `--awq` W4A16 ones), calibrated on its own KV
(`gaac_hf.calibrate.calibrate`), a KV budget (`--budget-gb`, default 20 GB = 20e9 bytes) and a context
(`--context`, default 65,536 tokens per sequence: every cache is built with `max_cache_len = context`):

* BF16 `StaticCache`: `2 (K|V) x layers x kv_heads x head_dim x 2 bytes x batch x context`; the batch is the
  largest that fits, and the buffers transformers allocates are measured after the fill and must equal that.
* `GAACStaticCache`: what it **allocates** (`stats()["allocated_bytes"]["total"]`), measured on the device for each
  candidate batch (built and initialized, nothing filled), then once more after the fill and the decode steps (the
  raw pool may grow). The batch is the largest whose allocation stays within the budget. Its slot pool is sized at
  construction for every tile of `batch x max_cache_len` (a tile takes at most one slot), so its allocation is
  fixed by the layout, not by what the KV compresses to; its raw pool follows the calibration's raw-tile share.
  The *resident* bytes of the filled cache (`stats()["bytes"]["total"]`, what the live tiles take) are reported
  beside it with the batch they would allow; a cache would reach that batch only with a slot pool sized from the
  calibration instead of the worst case (`GAACStaticCache` has no such option today). When that batch is larger,
  it is timed too and labelled as such (its pools then exceed the budget).

Each cache is filled with the model's own KV of one random prompt (`generate.fill`, each row a different rotation of
it) to `context - warmup - steps` tokens, then `warmup + steps` greedy decode steps of the whole model run through
`torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` (CUDA; `--tiny`: backend aot_eager on the CPU):

* `StaticCache` + sdpa at the BF16 batch (what transformers offers for compiled decoding);
* `PlainStaticCache` + "gaac" at the BF16 batch (plain BF16 KV, the same compiled op code as GAAC, the same bytes
  as `StaticCache`);
* `GAACStaticCache` + "gaac" at its batch.

Aggregate tokens/s = batch / median step time. Targets (issue 15): >= 1 more sequence, >= +20% tokens/s.

    python benchmarks/equal_memory.py --out benchmarks/results/equal_memory_h200.json            # H200
    python benchmarks/equal_memory.py --awq --out benchmarks/results/equal_memory_awq_h200.json  # needs gptqmodel
    python benchmarks/equal_memory.py --tiny --out /tmp/equal_memory_tiny.json                   # CPU, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from generate import Stepper, fill, llama31_8b_config, ms, own_kv_calibration, sync  # noqa: E402

import gaac_hf  # noqa: E402,F401  (registers "gaac")
from gaac_hf.model_layers import kv_geometry  # noqa: E402
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache  # noqa: E402

GB = 1e9
TARGET_EXTRA_SEQUENCES, TARGET_SPEEDUP = 1, 1.20
# --tiny: context and a budget of 2.6 BF16 sequences (BF16 fits 2; GAAC fits 3 if it allocates < 0.87 of BF16)
TINY_CONTEXT, TINY_BUDGET_SEQUENCES = 1024, 2.6


def bf16_bytes_per_sequence(config, context: int) -> int:
    g = kv_geometry(config)
    return 2 * len(g.layer_types) * g.num_kv_heads * g.head_dim * 2 * context


def static_cache_bytes(cache) -> int:
    """Bytes of the K/V buffers a transformers `StaticCache` (or `PlainStaticCache`) holds."""
    return sum(layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
               for layer in cache.layers if getattr(layer, "keys", None) is not None)


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def gaac_allocated(config, context: int, calibration, batch: int, device) -> int:
    """Allocated bytes of a `GAACStaticCache` for `batch` rows of `context` tokens, initialized and empty."""
    cache = GAACStaticCache(config, context, calibration, max_batch_size=batch)
    g = kv_geometry(config)
    k = torch.zeros(batch, g.num_kv_heads, 1, g.head_dim, dtype=torch.bfloat16, device=device)
    for i in cache.own_layers:
        cache.layers[i].lazy_initialization(k, k)
    total = cache.stats()["allocated_bytes"]["total"]
    del cache, k
    free(device)
    return total


def largest_gaac_batch(config, context: int, calibration, budget: int, device) -> tuple[int, dict]:
    """The largest batch whose initialized `GAACStaticCache` allocates at most `budget` bytes (measured)."""
    measured = {1: gaac_allocated(config, context, calibration, 1, device)}

    def alloc(b):
        if b not in measured:
            measured[b] = gaac_allocated(config, context, calibration, b, device)
        return measured[b]

    b = max(1, budget // measured[1])
    while b > 1 and alloc(b) > budget:
        b -= 1
    while alloc(b + 1) <= budget:
        b += 1
    if alloc(b) > budget:
        b = 0
    return b, {str(k): v for k, v in sorted(measured.items())}


ROW_SHIFT = 331  # tokens each row's copy of the sample KV is rotated by: rows differ, row r is the same in any batch


def batch_kv(kv, batch: int):
    """`[1, H, T, D]` sample KV -> `[batch, H, T, D]`, row r rotated by r * ROW_SHIFT tokens."""
    return [tuple(torch.cat([x.roll(r * ROW_SHIFT, dims=2) for r in range(batch)]) for x in pair) for pair in kv]


def decode_loop(stepper: Stepper, batch: int, steps: int, warmup: int, device, check=None):
    """Greedy decode steps of `batch` rows (Stepper.step), timed; returns step seconds and the stacked logits."""
    tok = torch.full((batch, 1), 7, dtype=torch.long, device=device)
    times, logits = [], []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        out = stepper.step(tok)
        sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        logits.append(out)
        tok = out.argmax(-1, keepdim=True)
        if check is not None and i % 8 == 7:
            check()
    return times, torch.stack(logits)


def load_awq_model(args, cfg, device):
    """The AWQ W4A16 model (awq_checkpoint.py, written once to --awq-dir), BF16 activations; None if gptqmodel is
    missing (the reason is returned)."""
    try:
        import gptqmodel  # noqa: F401
    except ImportError as e:
        return None, f"skipped: --awq needs gptqmodel ({e}); pip install 'gaac-hf[awq]'"
    from awq_checkpoint import write_awq_checkpoint
    from awq_h200 import cast_to_bf16, quant_kernels
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.exists(os.path.join(args.awq_dir, "config.json")):
        write_awq_checkpoint(cfg, args.awq_dir, group_size=args.awq_group_size, device=device)
    config = AutoConfig.from_pretrained(args.awq_dir)
    config.quantization_config["backend"] = args.awq_backend
    model = AutoModelForCausalLM.from_pretrained(args.awq_dir, config=config, dtype=torch.bfloat16,
                                                 device_map=str(device)).eval()
    info = {"backend": args.awq_backend, "group_size": args.awq_group_size, "kernels": quant_kernels(model),
            "loaded_dtype": str(model.dtype)}
    if model.dtype != torch.bfloat16:
        info["bf16_cast"] = cast_to_bf16(model, str(device))
    return model, info


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget-gb", type=float, default=None, help="KV budget in GB (1e9 bytes); default 20 "
                   f"(--tiny: {TINY_BUDGET_SEQUENCES} BF16 sequences)")
    p.add_argument("--context", type=int, default=None, help="tokens per sequence (default 65536; --tiny 1024)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU, a budget of a few sequences")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; --tiny: aot_eager)")
    p.add_argument("--awq", action="store_true", help="AWQ W4A16 weights (benchmarks/awq_checkpoint.py; needs "
                   "gptqmodel, skipped with a note in the JSON when it is missing)")
    p.add_argument("--awq-dir", default="/tmp/equal_memory_awq")
    p.add_argument("--awq-backend", default="torch_awq")
    p.add_argument("--awq-group-size", type=int, default=128)
    p.add_argument("--skip", nargs="*", default=[], help="variants to leave out")
    p.add_argument("--out", default="benchmarks/results/equal_memory_h200.json")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, StaticCache

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        args.steps, args.warmup = min(args.steps, 4), min(args.warmup, 1)
    context = args.context or (TINY_CONTEXT if args.tiny else 65536)
    backend = args.backend or ("aot_eager" if args.tiny else "inductor")
    compile_kw = dict(fullgraph=True, backend=backend)
    if backend == "inductor":
        compile_kw["mode"] = "reduce-overhead"
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    t_start = time.time()
    torch.manual_seed(0)
    cfg = llama31_8b_config(args.tiny)
    per_seq_bf16 = bf16_bytes_per_sequence(cfg, context)
    budget = int((args.budget_gb * GB) if args.budget_gb is not None else
                 (TINY_BUDGET_SEQUENCES * per_seq_bf16 if args.tiny else 20 * GB))
    n_fill = context - args.warmup - args.steps
    if n_fill < 1:
        raise ValueError(f"--context {context} leaves no room to fill before {args.warmup + args.steps} steps")
    results = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]) if argv is None else
               "equal_memory.main(" + repr(argv) + ")",
               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "model": ("tiny Llama" if args.tiny else "Llama-3.1-8B architecture") +
               (", random AWQ W4A16 weights" if args.awq else ", random BF16 weights"),
               "budget_bytes": budget, "context": context, "filled_tokens": n_fill, "steps": args.steps,
               "warmup": args.warmup, "compile": compile_kw,
               "targets": {"extra_sequences": TARGET_EXTRA_SEQUENCES, "tokens_per_s_ratio": TARGET_SPEEDUP}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    if args.awq:
        model, info = load_awq_model(args, cfg, device)
        results["awq"] = info
        if model is None:
            print(info, flush=True)
            out_path.write_text(json.dumps(results, indent=1))
            return results
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    results["param_bytes"] = sum(t.numel() * t.element_size() for t in list(model.parameters()) +
                                 list(model.buffers()))
    _, calibration, seconds, kv = own_kv_calibration(model, args.tiny, device)
    results["calibration"] = {"escape_capacity": calibration.config.escape_capacity,
                              "slot_bytes": calibration.config.slot_bytes,
                              "measured": calibration.config.measured, "seconds": round(seconds, 1)}

    # --- the batches ------------------------------------------------------------------------------------------------
    b_bf16 = budget // per_seq_bf16
    b_gaac, measured = largest_gaac_batch(model.config, context, calibration, budget, device)
    batches = {"bf16_bytes_per_sequence": per_seq_bf16, "bf16_batch": int(b_bf16),
               "gaac_allocated_bytes_by_batch": measured, "gaac_batch": int(b_gaac),
               "gaac_batch_counts": "allocated bytes (stats()['allocated_bytes']['total']) of an initialized "
                                    "GAACStaticCache: its slot pool has a slot for every tile of batch x context"}
    results["batches"] = batches
    print(f"budget {budget / GB:.3f} GB, context {context}: BF16 {per_seq_bf16 / GB:.3f} GB/sequence -> batch "
          f"{b_bf16}; GAACStaticCache allocates {measured} -> batch {b_gaac}", flush=True)
    if b_bf16 < 1 or b_gaac < 1:
        raise ValueError(f"a budget of {budget} bytes holds no sequence of {context} tokens (BF16 {per_seq_bf16} "
                         f"bytes; GAAC {measured['1']} bytes)")

    compiled = {}

    def compiled_forward(key):
        if key not in compiled:
            compiled[key] = torch.compile(model.forward, **compile_kw)
        return compiled[key]

    variants = results["variants"] = {}
    logits = {}

    def attempt(label, fn):
        if label in args.skip:
            return
        try:
            fn(label)
        except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others' numbers)
            traceback.print_exc()
            variants[label] = {"error": f"{type(e).__name__}: {e}"[:800]}
            print(f"  {label:<44} FAILED: {variants[label]['error'][:200]}", flush=True)
        free(device)
        out_path.write_text(json.dumps(results, indent=1))

    def timed(label, cache, batch, attn, check=None):
        model.set_attn_implementation(attn)
        fill(cache, batch_kv(kv, batch), n_fill, device)
        step = Stepper(model, compiled_forward(label), cache, n_fill, device)
        times, lg = decode_loop(step, batch, args.steps, args.warmup, device, check)
        logits[label] = lg
        step_s = statistics.median(times)
        row = {"batch": batch, "step_ms": ms(step_s), "min_ms": ms(min(times)),
               "tokens_per_s": round(batch / step_s, 2)}
        print(f"  {label:<44} batch {batch}: {row['step_ms']:9.3f} ms/step, {row['tokens_per_s']:9.1f} tokens/s",
              flush=True)
        return row

    def static_sdpa(label):
        cache = StaticCache(config=model.config, max_cache_len=context)
        row = timed(label, cache, b_bf16, "sdpa")
        row["allocated_bytes"] = static_cache_bytes(cache)
        if row["allocated_bytes"] != b_bf16 * per_seq_bf16:
            raise AssertionError(f"StaticCache holds {row['allocated_bytes']} bytes, not the "
                                 f"{b_bf16 * per_seq_bf16} of {b_bf16} x {per_seq_bf16}")
        variants[label] = row

    def plain(label):
        cache = PlainStaticCache(model.config, context, max_batch_size=b_bf16)
        row = timed(label, cache, b_bf16, "gaac")
        row["allocated_bytes"] = static_cache_bytes(cache)
        variants[label] = row

    def gaac(label, batch=b_gaac):
        cache = GAACStaticCache(model.config, context, calibration, max_batch_size=batch)
        row = timed(label, cache, batch, "gaac", check=cache.check)
        s = cache.stats()
        row.update(allocated_bytes=s["allocated_bytes"]["total"], allocated=s["allocated_bytes"],
                   resident_bytes=s["bytes"]["total"], bf16_bytes=s["bf16_bytes"], saving=round(s["saving"], 4),
                   raw_tiles=s["raw_tiles"], slots=s["slots"], within_budget=s["allocated_bytes"]["total"] <= budget)
        variants[label] = row

    print(f"decode at {n_fill} + {args.warmup + args.steps} tokens", flush=True)
    attempt("compiled GAACStaticCache + gaac", gaac)
    attempt("compiled PlainStaticCache + gaac (twin)", plain)
    attempt("compiled StaticCache + sdpa", static_sdpa)

    g = variants.get("compiled GAACStaticCache + gaac", {})
    if "resident_bytes" in g:
        # resident bytes per sequence at the full context (the filled cache holds exactly `context` tokens now)
        per_seq_resident = g["resident_bytes"] / g["batch"]
        b_res = int(budget // per_seq_resident)
        batches.update(gaac_resident_bytes_per_sequence=round(per_seq_resident),
                       gaac_batch_if_pools_were_resident_sized=b_res,
                       gaac_allocated_over_resident=round(g["allocated_bytes"] / g["resident_bytes"], 4))
        if not g["within_budget"]:
            batches["note"] = "the raw pool grew past the budget during the run"
        if b_res > b_gaac:
            attempt(f"compiled GAACStaticCache + gaac, resident-sized batch {b_res} (pools over budget)",
                    lambda label: gaac(label, b_res))

    # --- summary ----------------------------------------------------------------------------------------------------
    summary = results["summary"] = {"extra_sequences": int(b_gaac - b_bf16)}
    tps = {k: v["tokens_per_s"] for k, v in variants.items() if "tokens_per_s" in v}
    gt = tps.get("compiled GAACStaticCache + gaac")
    for base in ("compiled StaticCache + sdpa", "compiled PlainStaticCache + gaac (twin)"):
        if gt and base in tps:
            summary[f"tokens_per_s_ratio_vs {base}"] = round(gt / tps[base], 3)
    ratio = summary.get("tokens_per_s_ratio_vs compiled StaticCache + sdpa")
    summary["targets_met"] = {"extra_sequences": summary["extra_sequences"] >= TARGET_EXTRA_SEQUENCES,
                              "tokens_per_s_vs_StaticCache": ratio is not None and ratio >= TARGET_SPEEDUP}
    a, b = logits.get("compiled GAACStaticCache + gaac"), logits.get("compiled PlainStaticCache + gaac (twin)")
    if a is not None and b is not None:
        n = min(a.shape[1], b.shape[1])  # the rows both batches hold (batch_kv gives row r the same KV in both)
        summary["tokens_equal_twin_on_shared_rows"] = bool(torch.equal(a[:, :n].argmax(-1), b[:, :n].argmax(-1)))
    results["wall_s"] = round(time.time() - t_start, 1)

    print("\n| cache (compiled) | batch | KV bytes counted | step ms | tokens/s |\n|---|---|---|---|---|")
    for label, v in variants.items():
        if "error" in v:
            print(f"| {label} | - | - | error | - |")
            continue
        print(f"| {label} | {v['batch']} | {v['allocated_bytes'] / GB:.3f} GB allocated | {v['step_ms']:.3f} | "
              f"{v['tokens_per_s']:.1f} |")
    print(f"budget {budget / GB:.3f} GB; {json.dumps(summary)}")
    print(f"batches: {json.dumps(batches)}")
    print(f"wall {results['wall_s']} s")
    out_path.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
