"""Host cost of a compiled decode step outside its graph: `GAACStaticCache` against its twin, on the CPU.

On the GPU the captured step replays as one CUDA graph, so its host time is what runs around the graph: Dynamo's
guards, the bytecode that gathers the graph's inputs, AOTAutograd's runtime wrappers (and, there, the CUDA-graph
tree's input checks and copies of inputs not marked static). This script measures that part on the CPU, where
`mode="reduce-overhead"` is not available: both caches' decode steps are compiled with inductor (default mode) on a
model with the layer count of Llama-3.1-8B but tiny widths, the `gaac::` ops' CPU kernels are replaced by stubs
(so the graph's own work is small and equal for both), and each step's wall time is split into the time inside
the compiled graph (`CompiledFxGraph.__call__`) and the rest. Also reported per variant: graph inputs, how many of
them are static (parameters, `mark_static_address`), guards executed and one guard check's time.

    python benchmarks/compiled_host.py --out benchmarks/results/compiled_host_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaac_hf  # noqa: E402,F401  (registers "gaac")
from gaac_hf.calibrate import calibrate  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache  # noqa: E402


def stub_op_kernels() -> None:
    """CPU kernels of the `gaac::` ops that do next to nothing (a CUDA graph replays the real ones without host
    work; here they would only add their own Python time to the step)."""

    @torch.library.register_kernel("gaac::append_token", "cpu")
    def _append(key, value, tail_k, tail_v, kv_len, base3, base4, slot_pool, raw_pool, table, slot_modes,
                raw_modes, counts):
        kv_len.add_(1)

    @torch.library.register_kernel("gaac::plain_append_token", "cpu")
    def _plain_append(key, value, keys, values, kv_len):
        kv_len.add_(1)

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


def cache_entries(fn):
    """Dynamo's cache entries of the outermost compiled frame of the bound method `fn`, with that function."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    f = fn.__func__
    while f is not None:
        entries = _debug_get_cache_entry_list(f.__code__)
        if entries:
            return f, entries
        f = getattr(f, "__wrapped__", None)
    return None, []


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="rounds of steps, the variants alternating")
    p.add_argument("--backend", default="inductor")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    calibration = calibrate(model, [torch.randint(0, cfg.vocab_size, (64,))], "random ids")
    model.set_attn_implementation("gaac")
    stub_op_kernels()
    clock = GraphClock()
    name = cache_kwarg(model)
    inputs = {}

    def backend_of(key):
        def backend(gm, example_inputs):
            phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
            examples = [n.meta["grapharg"].example for n in phs if n.meta.get("grapharg") is not None]
            inputs[key] = {"graph_inputs": len(phs), "static_inputs": sum(
                isinstance(t, torch.nn.Parameter) or getattr(t, "_dynamo_static_input_type", None) is not None
                for t in examples if isinstance(t, torch.Tensor))}
            if args.backend == "inductor":
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs)
            return torch._dynamo.backends.registry.lookup_backend(args.backend)(gm, example_inputs)
        return backend

    torch.set_grad_enabled(False)
    variants = {"compiled GAACStaticCache": GAACStaticCache(model.config, 512, calibration),
                "compiled twin (plain BF16, same op)": PlainStaticCache(model.config, 512)}
    state = {}
    for key, cache in variants.items():
        model(input_ids=torch.randint(0, cfg.vocab_size, (1, 40)), use_cache=True, **{name: cache})
        fwd = torch.compile(model.forward, fullgraph=True, backend=backend_of(key))
        state[key] = {"fwd": fwd, "pos": 40, "wall": [], "inside": []}

    def step(key):
        s = state[key]
        kw = {"input_ids": torch.tensor([[5]]), "position_ids": torch.tensor([[s["pos"]]]), "use_cache": True,
              name: variants[key]}
        before = clock.seconds
        t = time.perf_counter()
        s["fwd"](**kw)
        s["wall"].append(time.perf_counter() - t)
        s["inside"].append(clock.seconds - before)
        s["pos"] += 1
        s["kw"] = kw

    for key in variants:  # compile, warm up
        for _ in range(3):
            step(key)
        state[key]["wall"].clear()
        state[key]["inside"].clear()
    for _ in range(args.rounds):
        for key in variants:
            for _ in range(args.steps // args.rounds):
                step(key)

    f, entries = cache_entries(model.forward)
    free = dict(zip(f.__code__.co_freevars, [c.cell_contents for c in (f.__closure__ or ())]))
    results = {"layers": args.layers, "backend": args.backend, "torch": torch.__version__,
               "note": "CPU, gaac:: op kernels stubbed; outside = step wall time - time inside the compiled graph",
               "variants": {}}
    for key, s in state.items():
        local = {"args": (model,), "kwargs": s["kw"], **free}
        guards = [e.guard_manager for e in entries if e.guard_manager.check(local)]
        row = dict(inputs.get(key, {}))
        if guards:
            gm = guards[0]
            row["guards_executed"] = gm.check_verbose(local).num_guards_executed
            times = []
            for _ in range(10):
                t = time.perf_counter()
                for _ in range(20):
                    gm.check(local)
                times.append((time.perf_counter() - t) / 20)
            row["guard_check_us"] = round(1e6 * min(times), 1)
        outside = [w - i for w, i in zip(s["wall"], s["inside"])]
        row.update(step_ms=round(1e3 * statistics.median(s["wall"]), 3),
                   inside_graph_ms=round(1e3 * statistics.median(s["inside"]), 3),
                   outside_graph_ms=round(1e3 * statistics.median(outside), 3),
                   outside_graph_min_ms=round(1e3 * min(outside), 3))
        results["variants"][key] = row
    print(f"| {args.layers} layers, CPU, ops stubbed | graph inputs | static | guards | guard check us | "
          "step ms | inside graph ms | outside ms (median / min) |")
    print("|---|---|---|---|---|---|---|---|")
    for key, r in results["variants"].items():
        print(f"| {key} | {r.get('graph_inputs')} | {r.get('static_inputs')} | {r.get('guards_executed')} | "
              f"{r.get('guard_check_us')} | {r['step_ms']} | {r['inside_graph_ms']} | "
              f"{r['outside_graph_ms']} / {r['outside_graph_min_ms']} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
