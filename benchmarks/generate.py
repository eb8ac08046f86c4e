"""Decode-step time of whole-model generation at long context: compiled GAACStaticCache against the baselines.

One process, batch 1, a Llama-3.1-8B-shaped model (all 32 layers, random BF16 weights) calibrated on its own KV
(`gaac_hf.calibrate.calibrate`). For each context it fills every cache to that many tokens, then times decode
steps (greedy, one token each) of:

* `GAACStaticCache` + "gaac", `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`;
* the twin: `PlainStaticCache` + "gaac" (plain BF16 KV, the same compiled op code), compiled the same way;
* `StaticCache` + sdpa, compiled the same way (what transformers offers for compiled decoding);
* `DynamicCache` + sdpa forced to flash (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`), eager;
* `GAACCache` + "gaac", eager.

Filling the caches: the model's own KV of one 2,048-token random prompt (one eager prefill, the same KV the
calibration saw) is repeated along the sequence to the context length and written into each cache through its
own append path (`update` / `GAACStaticLayer.append`), instead of a 128K-token prefill. Decode steps then run the
real model on top of it. Step times do not depend on what the KV says, only on its length and, for GAAC, on the
raw-tile share, which repeating the model's own KV keeps at its calibrated value.

Also reported: tokens and every logit bit of compiled GAAC vs its twin (lossless), the host share of the compiled
GAAC step (time until the call returns, GPU work still queued, over the step), the finalization share (GPU time of
the per-layer `gaac::append_token` op x layers over the step), the attention time (GPU time of the per-layer
`gaac::decode_attention` op x layers) and the rest, resident and allocated KV bytes.

GAAC and the twin are built once with room for the longest context (they read only `kv_len` tokens, whatever the
capacity: one compile serves every context); `StaticCache` is built per context with max_cache_len = context +
steps (its SDPA reads the whole buffer), one compile each.

    python benchmarks/generate.py --contexts 16384 65536 131072 --out benchmarks/results/generate_h200.json
    python benchmarks/generate.py --tiny --out /tmp/generate_tiny.json    # CPU, a tiny model, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaac_hf  # noqa: E402,F401  (registers "gaac")
from gaac_hf import GAACCache  # noqa: E402
from gaac_hf.calibrate import calibrate  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache  # noqa: E402

SAMPLE_TOKENS = 2048


def llama31_8b_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096)
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Stepper:
    """Runs decode steps of `forward` over a filled cache, timing each (and the host part of it)."""

    def __init__(self, model, forward, cache, context: int, device, check=None):
        self.model, self.forward, self.cache, self.device = model, forward, cache, device
        self.pos = context
        self.name = cache_kwarg(model)
        self.check = check
        self.with_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def step(self, token: torch.Tensor):
        kw = {self.name: self.cache, "use_cache": True, "position_ids": torch.tensor([[self.pos]], device=self.device)}
        if self.with_cache_position:
            kw["cache_position"] = torch.tensor([self.pos], device=self.device)
        out = self.forward(input_ids=token, **kw)
        self.pos += 1
        return out.logits[:, -1].clone()

    def run(self, steps: int, warmup: int, token: int = 7):
        tok = torch.tensor([[token]], device=self.device)
        times, hosts, logits = [], [], []
        for i in range(warmup + steps):
            sync(self.device)
            t0 = time.perf_counter()
            out = self.forward_once(tok)
            t1 = time.perf_counter()
            sync(self.device)
            t2 = time.perf_counter()
            if i >= warmup:
                times.append(t2 - t0)
                hosts.append(t1 - t0)
            logits.append(out)
            tok = out.argmax(-1, keepdim=True)
            if self.check is not None and i % 8 == 7:
                self.check()
        return times, hosts, torch.stack(logits)

    def forward_once(self, tok):
        return self.step(tok)


def fill(cache, kv, context: int, device) -> None:
    """Write `context` tokens of repeated model KV (`kv[layer] = (k, v)`, `[1, H, T, D]`) into `cache`."""
    reps = -(-context // kv[0][0].shape[2])
    for i, (k, v) in enumerate(kv):
        k = k.repeat(1, 1, reps, 1)[:, :, :context].contiguous()
        v = v.repeat(1, 1, reps, 1)[:, :, :context].contiguous()
        layer = cache.layers[i]
        if hasattr(layer, "append"):  # GAACStaticLayer: the eager append path, no dense K/V returned
            layer.append(k, v)
        elif isinstance(cache, (GAACCache, PlainStaticCache)):
            cache.layers[i].update(k, v)
        else:  # DynamicCache, StaticCache (cache_position for transformers versions that still take it)
            cache.update(k, v, i, {"cache_position": torch.arange(context, device=device)})
        del k, v
    sync(device)


def op_gpu_time(fn, n: int, device) -> float:
    """Seconds per call of `fn` on the GPU (events around n calls); wall time on the CPU."""
    fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        sync(device)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        sync(device)
        return start.elapsed_time(end) / 1e3 / n
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n


def ms(x):
    return round(1e3 * x, 4)


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU, contexts 40 and 72")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; --tiny: aot_eager)")
    p.add_argument("--skip", nargs="*", default=[], help="variants to leave out")
    p.add_argument("--out", default="benchmarks/results/generate_h200.json")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        args.contexts = [c for c in args.contexts if c <= 256] or [40, 72]
        args.steps, args.warmup = min(args.steps, 6), min(args.warmup, 2)
    backend = args.backend or ("aot_eager" if args.tiny else "inductor")
    compile_kw = dict(fullgraph=True, backend=backend)
    if backend == "inductor":
        compile_kw["mode"] = "reduce-overhead"
    t_start = time.time()
    torch.manual_seed(0)
    cfg = llama31_8b_config(args.tiny)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    gen = torch.Generator().manual_seed(1)
    sample = torch.randint(0, cfg.vocab_size, (SAMPLE_TOKENS if not args.tiny else 64,), generator=gen)
    t = time.time()
    calibration = calibrate(model, [sample], "random ids (the model's own KV)")
    t_cal = time.time() - t
    # the model's own KV of the sample prompt, reused to fill every cache
    model.set_attn_implementation("sdpa")
    name = cache_kwarg(model)
    dyn = DynamicCache(config=model.config)
    model(input_ids=sample[None].to(device), use_cache=True, **{name: dyn})
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in dyn.layers]
    del dyn
    steps, warmup = args.steps, args.warmup
    cap = max(args.contexts) + warmup + steps + 48  # + the 17 tokens the finalization timing appends
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "model": "Llama-3.1-8B architecture, random BF16 weights" if not args.tiny else "tiny Llama",
               "param_bytes": param_bytes, "compile": compile_kw, "steps": steps, "warmup": warmup,
               "calibration": {"escape_capacity": calibration.config.escape_capacity,
                               "measured": calibration.config.measured, "seconds": round(t_cal, 1)},
               "fill": f"the model's KV of one {sample.numel()}-token random prompt, repeated to the context",
               "contexts": {}}
    compiled = {}

    # one compiled forward per variant; they share model.forward's code, so Dynamo keeps one entry per variant
    # and context (StaticCache) in the same cache
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)

    def compiled_forward(key):
        if key not in compiled:
            compiled[key] = torch.compile(model.forward, **compile_kw)
        return compiled[key]

    gaac_cache = plain_cache = None
    for context in args.contexts:
        row = {}
        logits = {}
        print(f"context {context}", flush=True)

        def record(label, times, hosts):
            row[label] = {"step_ms": ms(statistics.median(times)), "min_ms": ms(min(times)),
                          "host_ms": ms(statistics.median(hosts))}
            print(f"  {label:<34} {row[label]['step_ms']:9.3f} ms", flush=True)

        def attempt(label, fn):
            """Run one variant; an error is recorded in the JSON and the others still run."""
            if label in args.skip:
                return
            try:
                fn()
            except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others' numbers)
                traceback.print_exc()
                row[label] = {"error": f"{type(e).__name__}: {e}"[:800]}
                print(f"  {label:<34} FAILED: {row[label]['error'][:200]}", flush=True)

        # compiled GAACStaticCache, and its plain twin (one capacity for every context: built once, refilled)
        def static_variant(label, make):
            nonlocal gaac_cache, plain_cache
            model.set_attn_implementation("gaac")
            cache = gaac_cache if label.startswith("compiled GAAC") else plain_cache
            if cache is None:
                cache = make()
            cache.reset()
            fill(cache, kv, context, device)
            step = Stepper(model, compiled_forward(label), cache, context, device,
                           check=cache.check if isinstance(cache, GAACStaticCache) else None)
            times, hosts, lg = step.run(steps, warmup)
            record(label, times, hosts)
            logits[label] = lg
            if isinstance(cache, GAACStaticCache):
                gaac_cache = cache
                s = cache.stats()
                row["resident_kv"] = {"gaac_bytes": s["bytes"]["total"], "bf16_bytes": s["bf16_bytes"],
                                      "saving": round(s["saving"], 4), "allocated_bytes": s["allocated_bytes"],
                                      "raw_tiles": s["raw_tiles"], "slots": s["slots"]}
                layer = cache.layers[0]
                q = torch.randn(1, cfg.num_attention_heads, cfg.head_dim, device=device).to(torch.bfloat16)
                attn = op_gpu_time(lambda: gaac_hf.ops.decode_attention(q, layer.record, None, cfg.head_dim ** -0.5),
                                   20, device)
                k1 = torch.randn(1, cfg.num_key_value_heads, 1, cfg.head_dim, device=device).to(torch.bfloat16)
                fin = op_gpu_time(lambda: gaac_hf.ops.append_token(k1, k1, layer.record, layer.slot_modes,
                                                                   layer.raw_modes, layer.counts), 16, device)
                n_layers = len(cache.own_layers)
                step_s = row[label]["step_ms"] / 1e3
                row["split"] = {"attention_ms": ms(attn * n_layers), "finalize_ms": ms(fin * n_layers),
                                "rest_ms": ms(step_s - attn * n_layers - fin * n_layers),
                                "weights_gbps_if_rest_were_weights": round(
                                    param_bytes / max(step_s - attn * n_layers, 1e-9) / 1e9, 1),
                                "host_share": round(row[label]["host_ms"] / row[label]["step_ms"], 4),
                                "finalize_share": round(fin * n_layers / step_s, 4)}
                cache.check()
            else:
                plain_cache = cache

        for label, make in (("compiled GAACStaticCache", lambda: GAACStaticCache(model.config, cap, calibration)),
                            ("compiled twin (plain BF16, same op)", lambda: PlainStaticCache(model.config, cap))):
            attempt(label, lambda: static_variant(label, make))
        a, b = logits.get("compiled GAACStaticCache"), logits.get("compiled twin (plain BF16, same op)")
        if a is not None and b is not None:
            row["lossless_vs_twin"] = {"tokens": bool(torch.equal(a.argmax(-1), b.argmax(-1))),
                                       "logit_bits": bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))}
            print(f"  lossless vs twin: {row['lossless_vs_twin']}", flush=True)

        # compiled StaticCache + sdpa (its own capacity per context: its attention reads the whole buffer)
        def static_sdpa(label="compiled StaticCache + sdpa"):
            model.set_attn_implementation("sdpa")
            cache = StaticCache(config=model.config, max_cache_len=context + warmup + steps + 16)
            fill(cache, kv, context, device)
            times, hosts, _ = Stepper(model, compiled_forward(label), cache, context, device).run(steps, warmup)
            record(label, times, hosts)

        # eager DynamicCache + flash sdpa
        def dynamic_flash(label="eager DynamicCache + flash sdpa"):
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            fill(cache, kv, context, device)
            ctx = contextlib.nullcontext()
            if device.type == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
            with ctx:
                times, hosts, _ = Stepper(model, model.forward, cache, context, device).run(steps, warmup)
            record(label, times, hosts)

        # eager GAACCache + gaac
        def gaac_eager(label="eager GAACCache + gaac"):
            model.set_attn_implementation("gaac")
            cache = GAACCache(model.config, calibration)
            fill(cache, kv, context, device)
            times, hosts, _ = Stepper(model, model.forward, cache, context, device).run(steps, warmup)
            record(label, times, hosts)

        for label, fn in (("compiled StaticCache + sdpa", static_sdpa), ("eager DynamicCache + flash sdpa",
                                                                        dynamic_flash),
                          ("eager GAACCache + gaac", gaac_eager)):
            attempt(label, fn)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        g = row.get("compiled GAACStaticCache", {}).get("step_ms")
        base = [row[k]["step_ms"] for k in ("compiled StaticCache + sdpa", "eager DynamicCache + flash sdpa")
                if "step_ms" in row.get(k, {})]
        if g and base:
            row["speedup_vs_best_baseline"] = round(min(base) / g, 3)
        if g and "step_ms" in row.get("compiled twin (plain BF16, same op)", {}):
            row["speedup_vs_twin"] = round(row["compiled twin (plain BF16, same op)"]["step_ms"] / g, 3)
        results["contexts"][str(context)] = row
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))  # after every context: a crash keeps the rest
    results["wall_s"] = round(time.time() - t_start, 1)

    labels = [k for r in results["contexts"].values() for k, v in r.items()
              if isinstance(v, dict) and ("step_ms" in v or "error" in v)]
    labels = list(dict.fromkeys(labels))
    print("\n| decode step (ms) | " + " | ".join(str(c) for c in results["contexts"]) + " |")
    print("|---|" + "---|" * len(results["contexts"]))
    for label in labels:
        print(f"| {label} | " + " | ".join(f"{r[label]['step_ms']:.3f}" if "step_ms" in r.get(label, {}) else
                                          ("error" if label in r else "-") for r in results["contexts"].values())
              + " |")
    for key in ("speedup_vs_best_baseline", "speedup_vs_twin"):
        print(f"| {key} | " + " | ".join(str(r.get(key, "-")) for r in results["contexts"].values()) + " |")
    for c, r in results["contexts"].items():
        if "split" in r:
            print(f"{c}: split {r['split']}; resident saving {r['resident_kv']['saving']}; "
                  f"lossless {r.get('lossless_vs_twin')}")
    print(f"wall {results['wall_s']} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
