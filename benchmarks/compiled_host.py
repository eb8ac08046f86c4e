"""Host cost of a compiled decode step outside its graph: `GAACStaticCache`, its twin and `StaticCache`, on the CPU.

On the GPU the captured step replays as one CUDA graph, so its host time is what runs around the graph: Dynamo's
guards, the bytecode that gathers the graph's inputs, AOTAutograd's runtime wrappers (and, there, the CUDA-graph
tree's checks of its inputs and copies of inputs not marked static). This script measures that part on the CPU,
where `mode="reduce-overhead"` is not available: each cache's decode step is compiled with inductor (default mode)
on a Llama with the layer count of Llama-3.1-8B (`--widths tiny`: tiny widths, the host cost does not depend on
them; `--widths 8b`: Llama-3.1-8B's widths, fewer layers if the memory is short), the `gaac::` ops' CPU kernels are
replaced by stubs (so the graph's own work is small and equal for GAAC and the twin), and each step's wall time is
split into the time inside the compiled graph (`CompiledFxGraph.__call__`) and the rest. Each variant's step has its
own code object, so Dynamo looks up only its own cache entry, as in a process that runs one cache.

Per variant: graph inputs, how many are static (parameters, `mark_static_address`), guards executed, one guard
check's time, the profiler's Dynamo cache lookup per step (`guards_us`, as `benchmarks/generate.py` reports it on the
H200) and the AOT prologue, step / inside / outside the graph.

    python benchmarks/compiled_host.py --out benchmarks/results/compiled_host_cpu_s4.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from generate import Stepper, host_profile, llama31_8b_config  # noqa: E402

import gaac_hf  # noqa: E402,F401  (registers "gaac")
from gaac_hf.calibrate import calibrate  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache  # noqa: E402

PROMPT = 40
VARIANTS = {"gaac": "compiled GAACStaticCache", "twin": "compiled twin (plain BF16, same ops)",
            "static": "compiled StaticCache + sdpa"}


def stub_op_kernels() -> None:
    """CPU kernels of the `gaac::` ops that do next to nothing (a CUDA graph replays the real ones without host
    work; here they would only add their own Python time to the step)."""

    @torch.library.register_kernel("gaac::append_token", "cpu")
    def _append(key, value, tail_k, tail_v, kv_len, base3, base4, slot_pool, raw_pool, table, slot_modes,
                raw_modes, counts, format_version):
        kv_len.add_(1)

    def _plain_append(key, value, keys, values, kv_len):
        kv_len.add_(1)

    if hasattr(torch.ops.gaac, "plain_append_token"):  # (absent before the twin had its own op: --before runs)
        torch.library.register_kernel("gaac::plain_append_token", "cpu", _plain_append)

    for name in ("gaac::decode_attention", "gaac::plain_decode_attention"):
        torch.library.register_kernel(name, "cpu", lambda query, *args: torch.empty_like(query))


class GraphClock:
    """Seconds spent inside compiled graphs (`CompiledFxGraph.__call__`), summed over calls."""

    def __init__(self):
        from torch._inductor.output_code import CompiledFxGraph

        self.seconds = 0.0
        inner = CompiledFxGraph.__call__
        clock = self

        def timed(self, inputs):
            t = time.perf_counter()
            try:
                return inner(self, inputs)
            finally:
                clock.seconds += time.perf_counter() - t

        CompiledFxGraph.__call__ = timed


def own_frame(fn, name: str):
    """`fn(**kw)` behind a function with a code object of its own: Dynamo keeps its cache entries per code object,
    so a compiled variant's step looks up its own entry only."""
    def call(**kw):
        return fn(**kw)

    return types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name, None, call.__closure__)


def model_config(widths: str, layers: int):
    if widths == "8b":
        cfg = llama31_8b_config(tiny=False)
        cfg.num_hidden_layers = layers
        return cfg
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--widths", choices=("tiny", "8b"), default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="rounds of steps, the variants alternating")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--guard-filter", default=None,
                   help="a torch.compiler guard filter for every variant (torch.compile(options={'guard_filter_fn': "
                        "...})), e.g. skip_guard_on_all_nn_modules_unsafe: how much of the guarding is the model's")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, StaticCache

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = model_config(args.widths, args.layers)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    calibration = calibrate(model, [torch.randint(0, cfg.vocab_size, (64,))], "random ids")
    stub_op_kernels()
    clock = GraphClock()
    name = cache_kwarg(model)
    device = torch.device("cpu")
    inputs = {}

    def backend_of(key):
        def backend(gm, example_inputs):
            from torch._inductor.compile_fx import compile_fx

            phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
            examples = [n.meta["grapharg"].example for n in phs if n.meta.get("grapharg") is not None]
            inputs[key] = {"graph_inputs": len(phs), "static_inputs": sum(
                isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None
                for t in examples if isinstance(t, torch.Tensor))}
            return compile_fx(gm, example_inputs)
        return backend

    torch.set_grad_enabled(False)
    attn = {"gaac": "gaac", "twin": "gaac", "static": "sdpa"}
    makers = {"gaac": lambda: GAACStaticCache(model.config, 512, calibration),
              "twin": lambda: PlainStaticCache(model.config, 512),
              "static": lambda: StaticCache(config=model.config, max_cache_len=512)}
    state = {}
    for key in args.variants:
        model.set_attn_implementation(attn[key])
        cache = makers[key]()
        model(input_ids=torch.randint(0, cfg.vocab_size, (1, PROMPT)), use_cache=True, **{name: cache})
        frame = own_frame(model.forward, f"step_{key}")
        options = {"guard_filter_fn": getattr(torch.compiler, args.guard_filter)} if args.guard_filter else None
        fn = torch.compile(frame, fullgraph=True, backend=backend_of(key), options=options)
        state[key] = {"stepper": Stepper(model, fn, cache, PROMPT, device), "frame": frame, "wall": [],
                      "inside": [], "tok": torch.tensor([[5]])}

    def step(key):
        s = state[key]
        model.set_attn_implementation(attn[key])
        before = clock.seconds
        t = time.perf_counter()
        s["tok"] = s["stepper"].step(s["tok"]).argmax(-1, keepdim=True)
        s["wall"].append(time.perf_counter() - t)
        s["inside"].append(clock.seconds - before)

    for key in state:  # compile, warm up
        for _ in range(3):
            step(key)
        state[key]["wall"].clear()
        state[key]["inside"].clear()
    for _ in range(args.rounds):
        for key in state:
            for _ in range(args.steps // args.rounds):
                step(key)

    results = {"layers": args.layers, "widths": args.widths, "backend": "inductor", "torch": torch.__version__,
               "guard_filter": args.guard_filter,
               "threads": 1, "command": "python benchmarks/compiled_host.py " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "note": "CPU, gaac:: op kernels stubbed; outside = step wall time - time inside the compiled graph; "
                       "guards_us: the profiler's TorchDynamo Cache Lookup per step (least of 5 x 10 steps)",
               "variants": {}}
    for key, s in state.items():
        model.set_attn_implementation(attn[key])
        row = dict(inputs.get(key, {}))
        row.update(guard_counts(s["frame"], s["stepper"]))
        profs = [host_profile(s["stepper"], device, steps=10) for _ in range(5)]  # the least disturbed of 5
        for k in ("guards_us", "aot_prologue_us", "compiled_region_us"):
            if all(k in prof for prof in profs):
                row[k] = min(prof[k] for prof in profs)
        outside = [w - i for w, i in zip(s["wall"], s["inside"])]
        row.update(step_ms=round(1e3 * statistics.median(s["wall"]), 3),
                   inside_graph_ms=round(1e3 * statistics.median(s["inside"]), 3),
                   outside_graph_ms=round(1e3 * statistics.median(outside), 3),
                   outside_graph_min_ms=round(1e3 * min(outside), 3))
        results["variants"][VARIANTS[key]] = row
    print(f"| {args.layers} layers ({args.widths} widths), CPU, ops stubbed | graph inputs | static | guards | "
          "guard check us | cache lookup us/step | step ms | inside graph ms | outside ms (median / min) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for key, r in results["variants"].items():
        print(f"| {key} | {r.get('graph_inputs')} | {r.get('static_inputs')} | {r.get('guards_executed')} | "
              f"{r.get('guard_check_us')} | {r.get('guards_us')} | {r['step_ms']} | {r['inside_graph_ms']} | "
              f"{r['outside_graph_ms']} / {r['outside_graph_min_ms']} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


def guard_counts(frame, stepper) -> dict:
    """Guards executed by the variant's own cache entry (of its `own_frame`) on its next step's arguments, and one
    check's time."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(frame.__code__)
    kw = {stepper.name: stepper.cache, "use_cache": True, "position_ids": torch.tensor([[stepper.pos]]),
          "input_ids": torch.tensor([[5]])}
    free = zip(frame.__code__.co_freevars, [c.cell_contents for c in frame.__closure__ or ()])
    local = {"kw": kw, **dict(free)}
    guards = [e.guard_manager for e in entries if e.guard_manager.check(local)]
    if not guards:
        return {"cache_entries": len(entries)}
    gm = guards[0]
    times = []
    for _ in range(50):  # the least disturbed of 50 rounds (the machine may be shared)
        t = time.perf_counter()
        for _ in range(20):
            gm.check(local)
        times.append((time.perf_counter() - t) / 20)
    return {"cache_entries": len(entries), "guards_executed": gm.check_verbose(local).num_guards_executed,
            "guard_check_us": round(1e6 * min(times), 1)}


if __name__ == "__main__":
    main()
