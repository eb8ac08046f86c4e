"""Decode-step overhead of `DGAPLogitsProcessor` (paper: p95 per-token latency), eager and inside a captured step.

SmolLM2-135M-Instruct (or its architecture with random weights: `--random-weights`, or `--config-json` to build it
from a config file alone, no GGUF needed; speed does not depend on weight values) after a `--context`-token prefill.
The processor is the shipped artifact (`--artifact`) or, when none is given, an untrained `DGAPModel` of the default
architecture and `--k-b` with tau 0, so that the corrected slice is written every step.

`--mode eager`: a greedy decode loop with `LowBitCache` and `DynamicCache`; every step times the model (CUDA
synchronized) and then, on the same logits, each processor variant: `reference` (the step computed feature by
feature from `features.py`, what the processor ran before the fused step), `fused` (the torch fused step, kernels
one by one) and, on CUDA, `fused_graph` (the torch fused step in the processor's own CUDA graph: the session-4
default), `triton` (the Triton step, `kernel_step.py`, kernels one by one) and `graph` (the default: the Triton step
in the processor's own graph). Overhead = p95 (and mean) of model + variant over p95 (mean) of the model alone.
Recorded per run: whether graph and eager outputs are bit-identical, and how far the Triton step's outputs are from
the torch step's (finite entries; the same rows corrected).

`--mode captured` (CUDA): a `StaticCache` filled with the prefill's KV and `torch.compile(mode="reduce-overhead",
fullgraph=True)` decode steps (CUDA graphs): `plain` (the compiled model step), `in_graph` (model step and
`DGAPLogitsProcessor.restore` compiled and captured together: the Triton step as one custom operator),
`plus_graph` (the compiled model step, then the processor's own graph), and the same two with the torch step
(`in_graph_torch`: Inductor fuses it into the model's graph; `plus_graph_torch`), in blocks plain / in_graph /
plus_graph / in_graph_torch / plus_graph_torch / plain; plus `processor_gpu_ms` and `processor_graph_kernels`, the
GPU time of one replay of the processor's graph (CUDA events over back-to-back replays) and its GPU kernels
(profiler), for the Triton and the torch step.

Both modes also record `aten_ops`: aten operators per processor call (torch.profiler on CPU, view operators not
counted), the reference step against the fused one, which is what sets the number of kernel launches on CUDA.

    python benchmarks/dgap_overhead.py --device cuda --context 8000 --out benchmarks/results/dgap_overhead_h200.json
    python benchmarks/dgap_overhead.py --mode captured --device cuda --context 8000 --out ..._captured.json
    python benchmarks/dgap_overhead.py --device cpu --context 4096 --steps 24 --out benchmarks/results/dgap_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import platform
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from dgap_hf import DGAPLogitsProcessor, LowBitCache  # noqa: E402
from dgap_hf.features import N_PHI, N_XI  # noqa: E402
from dgap_hf.models import DGAPModel  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402

VIEW_OPS = {"aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::expand", "aten::reshape",
            "aten::view", "aten::alias", "aten::unflatten", "aten::as_strided", "aten::t", "aten::transpose",
            "aten::permute", "aten::detach", "aten::_unsafe_view", "aten::flatten", "aten::lift_fresh"}


def aten_op_counts(fn, *args) -> dict:
    """aten operators of one call of `fn(*args)` (after one warm-up call), torch.profiler on the host: the top-level
    ones (not those an operator calls), without views and no-op `to`: `{"ops": n, "by_name": {...}}`."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args)
    top = [e for e in prof.events() if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    ops = [e.name for e in top if e.name not in VIEW_OPS and not (e.name == "aten::to" and not e.cpu_children)]
    return {"ops": len(ops), "by_name": dict(Counter(ops).most_common())}


def cuda_launch_counts(fn, *args) -> dict:
    """Host-side launches (kernels, graphs, copies) and GPU kernels of one call of `fn(*args)` on CUDA
    (torch.profiler with CUPTI, after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events()
                if e.name.startswith(("cudaLaunch", "cuLaunch", "cudaGraphLaunch", "cudaMemcpy", "cudaMemset"))]
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"launches": len(launches), "launches_by_name": dict(Counter(launches)), "gpu_kernels": len(kernels)}


def triton_step_launches(proc, scores, device) -> int | None:
    """Triton kernel launches of one call of the processor's Triton step (`kernel_step.py`) on `device` (on the CPU
    only under TRITON_INTERPRET=1); None where it cannot run."""
    from unittest import mock

    from dgap_hf.kernel_step import KernelStep, kernel_serves
    from dgap_hf.processor import NORMALIZED_ATOL
    from triton_ops.device import interpreted

    if not (device.type == "cuda" or interpreted()) or not kernel_serves(proc.detector, proc.corrector, proc.k_b):
        return None
    from triton_ops import dgap_merge, dgap_mlp, dgap_window

    kernels = [dgap_window._vocab_pass_kernel, dgap_window._window_kernel, dgap_mlp._dense_pair_kernel,
               dgap_merge._merge_kernel]
    proc.to(device)._prepare(device)
    step = KernelStep(proc.detector, proc.corrector, proc.k_b, proc._prepared[1])
    original, seen = type(kernels[0]).run, []

    def run(self, *a, **kw):
        seen.append(self)
        return original(self, *a, **kw)

    with mock.patch.object(type(kernels[0]), "run", run):
        step(scores.to(device), proc.tau, NORMALIZED_ATOL)
    proc.to("cpu")
    return sum(k in kernels for k in seen)


def untrained_artifact(config, precision: str, k_b: int) -> DGAPModel:
    spec = {"k_b": k_b, "tau": 0.0,  # tau 0: the detector fires, so the corrected slice is written every step
            "detector": {"n_features": N_PHI, "arch": "mlp", "hidden": 128, "layers": 2},
            "corrector": {"window": k_b, "n_candidate_features": N_XI, "n_features": N_PHI, "arch": "mlp",
                          "hidden": 256, "layers": 2, "max_delta": 8.0}}
    return DGAPModel({precision: spec}, {"name": config.name_or_path, "vocab_size": config.vocab_size})


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summary(times_s) -> dict:
    t = torch.tensor(times_s, dtype=torch.float64) * 1e3
    return {"mean_ms": round(float(t.mean()), 4), "p50_ms": round(float(t.median()), 4),
            "p95_ms": round(float(t.quantile(0.95)), 4)}


def overhead(plain: dict, total: dict) -> dict:
    return {"overhead_p95": round(total["p95_ms"] / plain["p95_ms"] - 1, 4),
            "overhead_mean": round(total["mean_ms"] / plain["mean_ms"] - 1, 4)}


def load_model(args, device):
    if args.config_json:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(args.config_json)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()
        model.config.name_or_path = "random weights of " + Path(args.config_json).name
        return model, None
    from gaac_hf.default_model import load_default_model

    model, tok = load_default_model(device=device)
    if args.random_weights:
        model = type(model)(model.config).to(device, torch.bfloat16).eval()
    return model, tok


def prompt_ids(args, tok, vocab: int, device) -> torch.Tensor:
    if tok is None or args.random_prompt:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, vocab, (1, args.context), generator=g)
    else:
        from gaac_hf.corpus import read_text_files

        text = read_text_files(args.text).text
        ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :args.context]
    return ids.repeat(args.batch, 1).to(device)


def make_processor(args, model, cuda_graph: bool, triton: bool = True) -> DGAPLogitsProcessor:
    if args.artifact:
        return DGAPLogitsProcessor.from_pretrained(args.artifact, args.precision, model_config=model.config,
                                                   cuda_graph=cuda_graph, triton=triton)
    torch.manual_seed(0)
    return DGAPLogitsProcessor(untrained_artifact(model.config, args.precision, args.k_b), args.precision,
                               cuda_graph=cuda_graph, triton=triton)


EAGER_VARIANTS = {  # name: (cuda_graph, triton); the CPU runs the first two
    "reference": (False, False), "fused": (False, False), "fused_graph": (True, False), "triton": (False, True),
    "graph": (True, True)}


def triton_active(procs) -> dict:
    """Per variant: whether its step ran as Triton kernels to the end (the processor falls back to the torch step,
    with a warning, where a kernel fails to build)."""
    return {name: p._kernel is not None for name, p in procs.items()}


def eager(args, model, ids, device, result):
    names = list(EAGER_VARIANTS) if device.type == "cuda" else ["reference", "fused"]
    procs = {n: make_processor(args, model, *EAGER_VARIANTS[n]).to(device) for n in names}
    calls = {n: (lambda s, p=p: p(None, s)) for n, p in procs.items()}
    calls["reference"] = lambda s: procs["reference"].reference_restore(s)[0]
    if device.type == "cuda":
        probe = torch.randn(args.batch, model.config.vocab_size, device=device)
        result["cuda_launches"] = {name: cuda_launch_counts(call, probe) for name, call in calls.items()}
        print("CUDA launches per processor call: " + ", ".join(
            f"{n} {c['launches']} ({c['gpu_kernels']} GPU kernels)" for n, c in result["cuda_launches"].items()),
            flush=True)
    kw = cache_kwarg(model)
    for cache_name in args.caches:
        try:
            eager_cache(args, model, ids, device, result, cache_name, calls, kw)
        except Exception as e:  # noqa: BLE001 - one failing cache must not lose the other's numbers
            traceback.print_exc()
            result["eager"][cache_name] = {"error": f"{type(e).__name__}: {e}"[:800]}
    result["triton_step_active"] = triton_active(procs)
    print(f"Triton step ran to the end: {result['triton_step_active']}", flush=True)


def eager_cache(args, model, ids, device, result, cache_name, calls, kw):
    from transformers import DynamicCache

    cache = (LowBitCache(model.config, args.precision) if cache_name == "LowBitCache"
             else DynamicCache(config=model.config))
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache}).logits[:, -1].float()
    times = {"plain": [], **{name: [] for name in calls}}
    identical, triton_diff, same_rows = True, 0.0, True
    for step in range(args.warmup + args.steps):
        nxt = logits.argmax(-1, keepdim=True)
        sync(device)
        t0 = time.perf_counter()
        logits = model(input_ids=nxt, use_cache=True, **{kw: cache}).logits[:, -1].float()
        sync(device)
        plain = time.perf_counter() - t0
        outs = {}
        for name, call in calls.items():
            t1 = time.perf_counter()
            outs[name] = call(logits)
            sync(device)
            if step >= args.warmup:
                times[name].append(plain + time.perf_counter() - t1)
        if step >= args.warmup:
            times["plain"].append(plain)
        # graph == eager bits; the torch steps equal each other (CPU: bit for bit; CUDA: other reduction kernels)
        identical &= torch.equal(outs["fused"], outs.get("fused_graph", outs["fused"]))
        if "graph" in outs:
            identical &= torch.equal(outs["graph"], outs["triton"])
            a, b = outs["graph"].float(), outs["fused"].float()
            finite = torch.isfinite(a) & torch.isfinite(b)
            triton_diff = max(triton_diff, float(torch.where(finite, (a - b).abs(), 0).max()))
            same_rows &= torch.equal((a != logits).any(-1), (b != logits).any(-1))
        logits = outs["graph" if "graph" in outs else "fused"]
    row = {"plain": summary(times["plain"]), "graph_equals_eager_bits": bool(identical)}
    if "graph" in calls:
        row["triton_vs_torch_step"] = {"max_abs_diff": triton_diff, "same_rows_changed": bool(same_rows)}
    for name in calls:
        row[name] = {**summary(times[name]), **overhead(row["plain"], summary(times[name]))}
    result["eager"][cache_name] = row
    cells = "  ".join(f"{n} +{100 * row[n]['overhead_p95']:.1f}%" for n in calls)
    diff = (f" | Triton vs torch step: max |diff| {triton_diff:.2g}, same rows {same_rows}" if "graph" in calls
            else "")
    print(f"eager {cache_name:12s} step p95 {row['plain']['p95_ms']:8.2f} ms | p95 overhead: {cells} | graph vs "
          f"eager {'bit-identical' if identical else 'DIFFER'}{diff}", flush=True)


def captured(args, model, ids, device, result):
    from generate import fill, graph_seconds
    from transformers import DynamicCache, StaticCache

    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    kw = cache_kwarg(model)
    prefill = DynamicCache(config=model.config)
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: prefill}).logits[:, -1].float()
    kv = [(layer.keys, layer.values) for layer in prefill.layers]
    blocks = ("plain", "in_graph", "plus_graph", "in_graph_torch", "plus_graph_torch", "plain")
    cache = StaticCache(config=model.config, max_cache_len=args.context + len(blocks) * (args.warmup + args.steps) + 16)
    fill(cache, kv, args.context, device)
    del prefill, kv
    procs = {"in_graph": make_processor(args, model, False), "plus_graph": make_processor(args, model, True),
             "in_graph_torch": make_processor(args, model, False, triton=False),
             "plus_graph_torch": make_processor(args, model, True, triton=False)}
    for name, p in procs.items():
        p.to(device)
        p.restore(logits) if name.startswith("in_") else p(None, logits)  # device constants; the own graph
    with_cache_position = "cache_position" in inspect.signature(model.forward).parameters
    compile_kw = {"fullgraph": True, "backend": args.backend}
    if args.backend == "inductor":
        compile_kw["mode"] = "reduce-overhead"
    plain_forward = torch.compile(model.forward, **compile_kw)

    def compiled_with(proc):
        def with_dgap(**kwargs):
            out = model.forward(**kwargs)
            return proc.restore(out.logits[:, -1].float())[0]

        return torch.compile(with_dgap, **compile_kw)

    dgap_forward = {name: compiled_with(procs[name]) for name in ("in_graph", "in_graph_torch")}
    pos = args.context
    times = {name: [] for name in blocks}
    for name in blocks:
        t_compile = time.perf_counter()
        for step in range(args.warmup + args.steps):
            nxt = logits.argmax(-1, keepdim=True)
            step_kw = {kw: cache, "use_cache": True,
                       "position_ids": torch.full((args.batch, 1), pos, device=device, dtype=torch.long)}
            if with_cache_position:  # transformers versions that still take it
                step_kw["cache_position"] = torch.tensor([pos], device=device)
            if hasattr(torch.compiler, "cudagraph_mark_step_begin"):
                torch.compiler.cudagraph_mark_step_begin()
            sync(device)
            t0 = time.perf_counter()
            if name.startswith("in_graph"):
                logits = dgap_forward[name](input_ids=nxt, **step_kw).clone()
            else:
                logits = plain_forward(input_ids=nxt, **step_kw).logits[:, -1].float().clone()
                if name.startswith("plus_graph"):
                    logits = procs[name](None, logits)
            sync(device)
            if step >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            elif step == 0:
                print(f"captured {name}: first step (compile + capture) {time.perf_counter() - t_compile:.1f} s",
                      flush=True)
            pos += 1
    row = {"plain": summary(times["plain"])}
    variants = ("in_graph", "plus_graph", "in_graph_torch", "plus_graph_torch")
    for name in variants:
        row[name] = {**summary(times[name]), **overhead(row["plain"], summary(times[name]))}
    row["steps_ms"] = {k: [round(1e3 * t, 3) for t in v] for k, v in times.items()}
    scores = logits.clone()
    for step, name in (("triton", "plus_graph"), ("torch", "plus_graph_torch")):
        proc = procs[name]
        gpu_ms = round(1e3 * graph_seconds(lambda: proc(None, scores), device, reps=50), 4)
        row[f"processor_gpu_ms_{step}"] = gpu_ms
        row[f"processor_gpu_share_of_step_{step}"] = round(gpu_ms / row["plain"]["p50_ms"], 4)
        row[f"processor_graph_kernels_{step}"] = (cuda_launch_counts(lambda s: proc(None, s), scores)["gpu_kernels"]
                                                  if device.type == "cuda" else None)
    row["triton_step_active"] = triton_active(procs)
    result["captured"]["StaticCache"] = row
    cells = "  ".join(f"{n} +{100 * row[n]['overhead_p95']:.1f}%" for n in variants)
    print(f"captured StaticCache step p95 {row['plain']['p95_ms']:.3f} ms | p95 overhead: {cells} | Triton step "
          f"ran to the end: {row['triton_step_active']}", flush=True)
    for step in ("triton", "torch"):
        print(f"  processor graph ({step} step): {row[f'processor_graph_kernels_{step}']} GPU kernels (incl. its "
              f"copy in/out), GPU time {row[f'processor_gpu_ms_{step}']:.4f} ms "
              f"({100 * row[f'processor_gpu_share_of_step_{step}']:.1f}% of the step)", flush=True)


@torch.no_grad()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["eager", "captured"], default="eager")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--precision", default="K2V2")
    ap.add_argument("--artifact")
    ap.add_argument("--k-b", type=int, default=32)
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument("--config-json", help="build the model from this config with random weights (no GGUF needed)")
    ap.add_argument("--random-prompt", action="store_true", help="random token ids instead of --text")
    ap.add_argument("--text", nargs="+", default=None, help="prompt text files (.gz allowed; default Debian Reference)")
    ap.add_argument("--caches", nargs="+", default=["DynamicCache", "LowBitCache"],
                    choices=["LowBitCache", "DynamicCache"])
    ap.add_argument("--backend", default="inductor", help="torch.compile backend of --mode captured")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if args.text is None:
        from gaac_hf.corpus import DEBIAN_REFERENCE

        args.text = list(DEBIAN_REFERENCE)
    device = torch.device(args.device)
    t_start = time.time()
    model, tok = load_model(args, device)
    ids = prompt_ids(args, tok, model.config.vocab_size, device)
    probe = make_processor(args, model, False)
    scores = torch.randn(args.batch, model.config.vocab_size)
    counts = {"reference": aten_op_counts(lambda s: probe.reference_restore(s)[0], scores),
              "fused": aten_op_counts(lambda s: probe(None, s), scores)}
    print(f"aten ops per processor call (CPU profiler): reference {counts['reference']['ops']}, "
          f"fused {counts['fused']['ops']}", flush=True)
    launches = triton_step_launches(probe, scores, device)
    if launches is not None:
        counts["triton_step_kernel_launches"] = launches
        print(f"Triton step: {launches} kernel launches per processor call", flush=True)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "mode": args.mode, "context": args.context, "batch": args.batch,
              "steps": args.steps, "warmup": args.warmup, "precision": args.precision, "k_b": probe.k_b,
              "tau": probe.tau, "artifact": args.artifact or "untrained (speed only)",
              "weights": ("random" if args.random_weights or args.config_json else "SmolLM2-135M-Instruct"),
              "prompt": "random ids" if tok is None or args.random_prompt else args.text,
              "aten_ops": counts, "eager": {}, "captured": {}, "command": " ".join(sys.argv)}
    if args.mode == "eager":
        eager(args, model, ids, device, result)
    else:
        try:
            captured(args, model, ids, device, result)
        except Exception as e:  # noqa: BLE001 - keep the op counts and the error in the JSON
            traceback.print_exc()
            result["captured"]["error"] = f"{type(e).__name__}: {e}"[:800]
    result["wall_s"] = round(time.time() - t_start, 1)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
