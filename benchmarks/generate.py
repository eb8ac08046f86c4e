"""Decode-step time of whole-model generation at long context: compiled GAACStaticCache against the baselines.

One process, batch 1, a Llama-3.1-8B-shaped model (all 32 layers, random BF16 weights) calibrated on its own KV
(`gaac_hf.calibrate.calibrate`). For each context it fills every cache to that many tokens, then times decode
steps (greedy, one token each) of:

* `GAACStaticCache` + "gaac", `torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)`;
* the twin: `PlainStaticCache` + "gaac" (plain BF16 KV, the same compiled op code), compiled the same way;
* `StaticCache` + sdpa, compiled the same way (what transformers offers for compiled decoding);
* `DynamicCache` + sdpa forced to flash (`sdpa_kernel(SDPBackend.FLASH_ATTENTION)`), eager;
* `GAACCache` + "gaac", eager;
* `GAACStaticCache` and its twin under `gaac_hf.CapturedStep` (`captured`, `captured-twin`): the same step compiled
  by inductor without CUDA-graph trees, recorded once as a CUDA graph and replayed with no Dynamo or Python per call
  (the host part is then copying the inputs and launching the graph). They continue on the caches where the
  compiled variants left them, and their logits are compared bit for bit too (`captured_lossless_vs_twin`).

Filling the caches: the model's own KV of one 2,048-token random prompt (one eager prefill, the same KV the
calibration saw) is repeated along the sequence to the context length and written into each cache through its
own append path (`update` / `GAACStaticLayer.append`), instead of a 128K-token prefill. Decode steps then run the
real model on top of it. Step times do not depend on what the KV says, only on its length and, for GAAC, on the
raw-tile share, which repeating the model's own KV keeps at its calibrated value.

Also reported: tokens and every logit bit of compiled GAAC vs its twin (lossless; if they differ, the first step
that does and the largest difference), the host share of each compiled step (time until the call returns, GPU
work still queued, over the step) and a host profile of it (`host_profile`: guards, kernel and CUDA-graph launches
issued by the CPU), resident and allocated KV bytes, and the step's split: the GPU time of the cache's work in one
step, all layers, each op timed from a CUDA graph replay as in the captured step (`time_update_and_attention`):
the attention (`gaac::decode_attention`, and the twin's), the update (`gaac::append_token` as the per-step
average of 15 calls that finalize nothing and one that completes a block of the model's KV; the twin's scatter)
and the rest (weights, norms, RoPE, sampling) = step - attention - update. The timing leaves every bit of the
caches as it found it.

`--diag` (lossless diagnosis, same run): whether both caches hold the same KV bits after the fill; one eager step
of each from that state with every layer's attention output hooked (the first layer whose bits differ, and whether
the eager logits agree); each cache's compiled first step against its eager step from the same state; the KV
bits the compiled steps wrote, GAAC vs twin. Eager GAAC = eager twin with compiled GAAC != compiled twin means
the two compiled graphs compute around the op differently (e.g. inductor fusing the K/V projection and RoPE into
the twin's scatter but not into the custom op's inputs), not a cache bug.

GAAC and the twin are built once with room for the longest context (they read only `kv_len` tokens, whatever the
capacity: one compile serves every context); `StaticCache` is built per context with max_cache_len = context +
steps (its SDPA reads the whole buffer; Dynamo recompiles once with a dynamic length, then reuses it). The eager
variants run `--eager-steps` steps. The JSON is written after every context; progress lines carry the elapsed
time.

    python benchmarks/generate.py --contexts 16384 32768 65536 131072 --steps 10 --warmup 3 --eager-steps 3 \
        --diag --out benchmarks/results/generate_h200.json
    python benchmarks/generate.py --tiny --diag --out /tmp/generate_tiny.json    # CPU, a tiny model, seconds
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
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
from gaac_hf import CapturedStep, GAACCache  # noqa: E402
from gaac_hf.calibrate import calibrate  # noqa: E402
from gaac_hf import ops  # noqa: E402
from gaac_hf.format import BLOCK_TOKENS  # noqa: E402
from gaac_hf.compile_settings import compile_kwargs, compile_options, describe  # noqa: E402
from gaac_hf.model_layers import cache_kwarg, text_config  # noqa: E402
from gaac_hf.static_cache import GAACStaticCache, GAACStaticLayer, PlainStaticCache  # noqa: E402
from hf_common.testing import same_bits  # noqa: E402

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


def own_kv_calibration(model, tiny: bool, device, format_version: int = 2):
    """A random-weight model calibrated on its own KV: (sample ids, calibration, seconds, the sample's KV per layer as
    (k, v) `[1, H, T, D]`, reused to fill every cache). Leaves the model on SDPA attention."""
    from transformers import DynamicCache

    gen = torch.Generator().manual_seed(1)
    sample = torch.randint(0, model.config.vocab_size, (SAMPLE_TOKENS if not tiny else 64,), generator=gen)
    t = time.time()
    calibration = calibrate(model, [sample], "random ids (the model's own KV)", format_version=format_version)
    seconds = time.time() - t
    model.set_attn_implementation("sdpa")
    dyn = DynamicCache(config=model.config)
    model(input_ids=sample[None].to(device), use_cache=True, **{cache_kwarg(model): dyn})
    kv = [(layer.keys.clone(), layer.values.clone()) for layer in dyn.layers]
    return sample, calibration, seconds, kv


def cuda_default(name: str):
    """A process-wide default of the CUDA kernel's plans (`gaac_cuda.decode_attention.BALANCE`, `PDL`, `SPLIT_WARPS`,
    ...), None without the kernel."""
    try:
        module = importlib.import_module("gaac_cuda.decode_attention")  # (the package's name is also a function's)
    except ImportError:
        return None
    return getattr(module, name)


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

    def kwargs(self, position_ids: torch.Tensor, cache_position: torch.Tensor) -> dict:
        """The forward's keyword arguments of one decode step besides the token."""
        kw = {self.name: self.cache, "use_cache": True, "position_ids": position_ids}
        if self.with_cache_position:
            kw["cache_position"] = cache_position
        return kw

    def step(self, token: torch.Tensor):
        kw = self.kwargs(torch.tensor([[self.pos]], device=self.device), torch.tensor([self.pos], device=self.device))
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

    def run_pipelined(self, steps: int, token: int = 7) -> float:
        """Seconds per step of `steps` back-to-back steps with no host synchronization between them: each step's
        token is the previous one's argmax and its positions the previous ones + 1, all on the device (`step`'s
        positions from a Python int are a pageable host-to-device copy, which synchronizes the stream), and only the
        cache's own amortized checks synchronize now and then. A step's host work then overlaps the GPU work of the
        one before, as in a serving loop: this is the step's GPU-bound time, where `run` adds each step's launch
        latency to it."""
        tok = torch.tensor([[token]], device=self.device)
        pos = torch.tensor([[self.pos]], device=self.device)
        sync(self.device)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = self.forward(input_ids=tok, **self.kwargs(pos, pos[0])).logits[:, -1].argmax(-1, keepdim=True)
            pos = pos + 1
        sync(self.device)
        self.pos += steps
        return (time.perf_counter() - t0) / steps

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


# --- GPU time of the ops of one step, from CUDA graph replays -------------------------------------------------------
def graph_seconds(fn, device, reps: int = 20, setup=None) -> float:
    """Seconds one call of `fn` takes, median of `reps`: on CUDA the GPU time of a CUDA graph of it (captured once,
    events around each replay; no launch or Python cost, as in the captured decode step); elsewhere wall time of
    eager calls. `setup` runs before each call (and before the capture and the warm-up), outside the timing."""
    setup = setup or (lambda: None)
    times = []
    if device.type == "cuda":
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the capture (kernel compilation, plans)
            setup()
            fn()
        torch.cuda.current_stream(device).wait_stream(side)
        setup()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(reps):
            setup()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        del graph
        return statistics.median(times)
    setup()
    fn()
    for _ in range(reps):
        setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def step_state(cache) -> list:
    """What a decode-step update of `cache` may write in the 16 positions from the start of its current block
    on, as `(tensor, index, clone)`: lengths, counters, tails, block table, the pool rows the counters point at and
    the scratch rows (GAAC); the rows of those positions (twin)."""
    saved = []
    for i in cache.own_layers:
        layer = cache.layers[i]
        parts = [(layer.kv_len, (slice(None),))]
        if isinstance(layer, GAACStaticLayer):
            r = layer.record
            parts += [(layer.counts, (slice(None),)), (r.tail_k, (slice(None),)), (r.tail_v, (slice(None),)),
                      (r.table, (slice(None),))]
            taken = layer.counts.tolist()
            for pool, modes, at in ((r.slot_pool, layer.slot_modes, taken[0]), (r.raw_pool, layer.raw_modes, taken[1])):
                last = pool.shape[0] - 1
                rows = (slice(min(at, last), min(at + layer.headroom, last)),)  # one finalization takes at most that
                parts += [(pool, rows), (modes, rows), (pool, (slice(last, None),)), (modes, (slice(last, None),))]
        else:
            b0 = BLOCK_TOKENS * (layer.host_length() // BLOCK_TOKENS)
            rows = (slice(None), slice(None), slice(b0, b0 + BLOCK_TOKENS))
            parts += [(layer.keys, rows), (layer.values, rows)]
        saved += [(t, idx, t[idx].clone()) for t, idx in parts]
    return saved


def restore_state(saved: list) -> None:
    for t, idx, value in saved:
        t[idx].copy_(value)


def time_update_and_attention(cache, kv, device, reps: int = 20) -> dict:
    """GPU time of one decode step's cache work, all layers of `cache` (each op timed from a CUDA graph replay):
    the attention over the current length, a decode-step update that finalizes nothing and (GAAC) one that
    completes a block (on the model's own KV `kv[layer] = (k, v)`, so the block encodes as real KV does). Leaves
    the cache as it found it (`step_state`). Seconds per step, all layers together."""
    from gaac_hf.attention import static_decode_attention

    layers = [(i, cache.layers[i]) for i in cache.own_layers]
    first = layers[0][1]
    length = first.host_length()
    b0 = BLOCK_TOKENS * (length // BLOCK_TOKENS)
    tokens = {i: (kv[i][0][:, :, :BLOCK_TOKENS].contiguous(), kv[i][1][:, :, :BLOCK_TOKENS].contiguous())
              for i, _ in layers}
    heads = text_config(cache.config).num_attention_heads
    q = torch.randn(first.batch, heads, 1, first.head_dim, generator=torch.Generator().manual_seed(2))
    q = q.to(device, torch.bfloat16)
    gaac = isinstance(first, GAACStaticLayer)
    saved = step_state(cache)
    counts = {i: layer.counts.clone() for i, layer in layers} if gaac else {}

    def at(n, fill_tail=False):
        def setup():
            for i, layer in layers:
                layer.kv_len.fill_(n)
                if gaac:
                    layer.counts.copy_(counts[i])
                    if fill_tail:  # the block's first 15 tokens in the tail: the 16th completes it
                        layer.record.tail_k[:, :, :BLOCK_TOKENS - 1].copy_(tokens[i][0][:, :, :BLOCK_TOKENS - 1])
                        layer.record.tail_v[:, :, :BLOCK_TOKENS - 1].copy_(tokens[i][1][:, :, :BLOCK_TOKENS - 1])
        return setup

    def append(pos):
        def fn():
            for i, layer in layers:
                layer.update(tokens[i][0][:, :, pos:pos + 1], tokens[i][1][:, :, pos:pos + 1])
        return fn

    def attend():
        for _, layer in layers:
            static_decode_attention(q, layer.record, None, None)

    jobs = [("attention", attend, None), ("update", append(0), at(b0))]
    if gaac:
        jobs.append(("update_finalizing", append(BLOCK_TOKENS - 1), at(b0 + BLOCK_TOKENS - 1, True)))
    out = {}
    try:
        for key, fn, setup in jobs:
            try:
                out[key] = graph_seconds(fn, device, reps, setup)
            except Exception as e:  # noqa: BLE001  (a timing that cannot be captured must not lose the others)
                out[key + "_error"] = f"{type(e).__name__}: {e}"[:300]
        if gaac:  # what one finalizing call takes: proof that it finalized (tiles = layers x block positions)
            at(b0 + BLOCK_TOKENS - 1, True)()
            append(BLOCK_TOKENS - 1)()
            out["finalized_tiles"] = int(sum(int((layer.counts - counts[i]).sum()) for i, layer in layers))
    finally:
        restore_state(saved)
    return out


# --- host side of a compiled step ----------------------------------------------------------------------------------
HOST_EVENTS = {"TorchDynamo Cache Lookup": "guards_us", "Torch-Compiled Region": "compiled_region_us",
               "AOTDispatcher Runtime Wrapper Prologue": "aot_prologue_us", "Pregraph bytecode": "pregraph_us"}


def host_profile(stepper: "Stepper", device, steps: int = 3) -> dict:
    """What the host does per compiled step (torch.profiler over `steps` steps), per step: CPU time of Dynamo's
    cache lookup (guards), the compiled region and AOT's prologue, and how many kernel launches and CUDA-graph
    launches the CPU issues (a step replayed as one CUDA graph launches no kernel itself: more means the graph was
    split or not captured). Also inductor's cudagraph counters (skips)."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        stepper.run(steps, 0)
        sync(device)
    out = {"steps": steps}
    for e in prof.key_averages():
        if e.key in HOST_EVENTS:
            out[HOST_EVENTS[e.key]] = round(e.cpu_time_total / steps, 1)
        elif "LaunchKernel" in e.key:
            out["kernel_launches"] = out.get("kernel_launches", 0) + e.count / steps
        elif "GraphLaunch" in e.key:
            out["graph_launches"] = out.get("graph_launches", 0) + e.count / steps
    skips = {k: v for k, v in counters["inductor"].items() if "cudagraph" in k}
    if skips:
        out["inductor_cudagraph_counters"] = dict(skips)
    # where the rest of the host time goes: the events with the most self CPU time per step
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
    out["top_self_cpu_us"] = {e.key[:80]: [round(e.self_cpu_time_total / steps, 1), round(e.count / steps, 2)]
                              for e in top}
    return out


def python_profile(stepper: "Stepper", device, steps: int = 3, top: int = 20) -> dict:
    """Where an eager step's host time goes, by Python function (cProfile over `steps` steps): per step, the
    functions with the most own time and, of the project's and transformers' cache / attention code, the most
    cumulative time (µs, calls)."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    stepper.run(steps, 0)
    sync(device)
    prof.disable()
    st = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own s, cumulative s, callers)

    def name(k):
        f, line, fn = k
        return f"{'/'.join(Path(f).parts[-2:])}:{line}:{fn}" if f != "~" else fn

    def rows(key, keep=lambda k: True):
        chosen = sorted((k for k in st if keep(k)), key=lambda k: st[k][key], reverse=True)[:top]
        return {name(k): [round(st[k][key] / steps * 1e6, 1), round(st[k][1] / steps, 2)] for k in chosen}

    ours = ("gaac_hf", "gaac_cuda", "cache_utils", "masking_utils", "modeling_llama")
    return {"steps": steps, "own_us": rows(2), "cumulative_us": rows(3, lambda k: any(o in k[0] for o in ours))}


# --- device side of a step: GPU time by kernel kind ---------------------------------------------------------------
KERNEL_KINDS = (  # (kind, substrings of kernel names, lower case); the first kind that matches takes the kernel
    ("attention", ("gaac_decode", "gaac_combine", "_split_kernel", "_combine_kernel", "fmha", "flash", "cudnn",
                   "attention")),
    ("cache_update", ("_append_kernel", "_encode_kernel", "index_put", "index_copy", "scatter")),
    ("matmul", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "cublas", "splitk", "mm_")),
    ("fused_pointwise", ("triton_",)),
    ("memcpy_memset", ("memcpy", "memset")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    for kind, keys in KERNEL_KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def gpu_profile(stepper: "Stepper", device, steps: int = 3) -> dict:
    """Where a step's GPU time goes (torch.profiler, CUDA activity, over `steps` steps): milliseconds per step by
    kernel kind (`KERNEL_KINDS`; the kernels replayed from a CUDA graph included), the kernels (graph nodes) per step
    (a graph's CPU launch cost grows with them: 0.9-2.6 ms per step in sessions 15-17) and the ten longest kernels
    with their launches per step. Empty without CUDA."""
    if device.type != "cuda":
        return {}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    try:  # a profiler that fails must not lose the variant's timings
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            stepper.run(steps, 0)
            sync(device)
        out = summarize_kernels([(e.key, e.self_device_time_total, e.count) for e in prof.key_averages()
                                 if e.device_type == DeviceType.CUDA], steps)
        out["spread_us"] = kernel_spread([(e.name, e.time_range.elapsed_us()) for e in prof.events()
                                          if e.device_type == DeviceType.CUDA])
        return out
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:300]}


SPREAD_KERNELS = ("gaac_decode_split", "gaac_combine", "_append_kernel")


def kernel_spread(durations: list, names: tuple = SPREAD_KERNELS) -> dict:
    """Per kernel of `names` (a name that starts with one), how its launches' durations (µs) spread over the profiled
    steps' layers: count, p10 / p50 / p90 / max. An average over a step hides whether every layer's launch is slower
    or a few are (in the captured step the attention kernel averaged ~5 µs more than alone, session 21)."""
    out = {}
    for want in names:
        xs = sorted(us for name, us in durations if name.startswith(want))
        if xs:
            pick = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)  # noqa: E731
            out[want] = {"n": len(xs), "p10": pick(0.1), "p50": pick(0.5), "p90": pick(0.9), "max": round(xs[-1], 2)}
    return out


def summarize_kernels(kernels: list, steps: int) -> dict:
    """`gpu_profile`'s summary of (name, total µs, count) triples over `steps` steps."""
    kinds, total = {}, 0.0
    for name, us, _ in kernels:
        kind = kernel_kind(name)
        kinds[kind] = kinds.get(kind, 0.0) + us
        total += us
    top = sorted(kernels, key=lambda k: k[1], reverse=True)[:10]
    return {"steps": steps, "total_ms": round(total / steps / 1e3, 4),
            "kernels_per_step": round(sum(n for _, _, n in kernels) / steps, 1),
            "by_kind_ms": {k: round(v / steps / 1e3, 4) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
            "top": [[name[:90], round(us / steps / 1e3, 4), round(n / steps, 2)] for name, us, n in top]}


# --- lossless diagnosis --------------------------------------------------------------------------------------------
def dense_kv(layer, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens `[start, end)` (end <= length) of a static layer as BF16 K, V `[B, H, end - start, D]` (GAAC: the
    finalized blocks decoded, then the tail)."""
    if not isinstance(layer, GAACStaticLayer):
        return layer.keys[:, :, start:end], layer.values[:, :, start:end]
    r = layer.record
    n_fin = layer.host_length() // BLOCK_TOKENS
    b0, b1 = start // BLOCK_TOKENS, -(-end // BLOCK_TOKENS)
    ks, vs = [], []
    if b0 < min(b1, n_fin):
        p, c = layer.tile_positions, layer.channels
        n = min(b1, n_fin) - b0
        tiles = ops.expand_tiles(r.table[:, b0:b0 + n].reshape(layer.batch, n, p), r.slot_pool, r.raw_pool,
                                 r.base3.reshape(p, c), r.base4.reshape(p, c), r.format_version)
        kv = ops.blocks_of(tiles, layer.num_kv_heads)
        ks.append(kv[:, 0])
        vs.append(kv[:, 1])
    if b1 > n_fin:
        ks.append(r.tail_k)
        vs.append(r.tail_v)
    at = start - b0 * BLOCK_TOKENS
    return torch.cat(ks, 2)[:, :, at:at + end - start], torch.cat(vs, 2)[:, :, at:at + end - start]


def compare_kv(cache_a, cache_b, start: int, end: int, chunk: int = 8192) -> dict:
    """Do two static caches hold the same K/V bits for tokens `[start, end)`? The first layer that does not."""
    for i in cache_a.own_layers:
        for s in range(start, end, chunk):
            e = min(end, s + chunk)
            (ka, va), (kb, vb) = dense_kv(cache_a.layers[i], s, e), dense_kv(cache_b.layers[i], s, e)
            if not (same_bits(ka, kb) and same_bits(va, vb)):
                return {"equal": False, "first_layer": i, "first_chunk": [s, e]}
    return {"equal": True}


def attention_modules(model) -> list:
    return [m for name, m in model.named_modules() if name.endswith("self_attn")]


def eager_step(model, cache, context: int, device, token: int = 7):
    """One eager (uncompiled) decode step: logits and every layer's attention output (forward hooks)."""
    outs = []

    def hook(module, args, out):
        outs.append((out[0] if isinstance(out, tuple) else out).detach().clone())

    hooks = [m.register_forward_hook(hook) for m in attention_modules(model)]
    try:
        logits = Stepper(model, model.forward, cache, context, device).step(torch.tensor([[token]], device=device))
    finally:
        for h in hooks:
            h.remove()
    return logits, outs


def logit_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Tokens and logit bits of two `[steps, B, V]` logit sequences; the first step whose bits differ."""
    differ = (a.view(torch.int16) != b.view(torch.int16)).flatten(1).any(1)
    out = {"tokens": bool(torch.equal(a.argmax(-1), b.argmax(-1))), "logit_bits": not bool(differ.any())}
    if differ.any():
        out["first_step"] = int(differ.nonzero()[0, 0])
        out["max_abs_diff"] = float((a.float() - b.float()).abs().max())
    return out


def diagnose(model, gaac, twin, context: int, device) -> dict:
    """From the same filled state: do both caches hold the same KV bits; does one eager step of each give the same
    attention output in every layer and the same logits. Leaves both caches as it found them."""
    out = {"fill": compare_kv(gaac, twin, 0, context)}
    got = {}
    for name, cache in (("gaac", gaac), ("twin", twin)):
        saved = step_state(cache)
        try:
            got[name] = eager_step(model, cache, context, device)
        finally:
            restore_state(saved)
    (lg, ag), (lt, at) = got["gaac"], got["twin"]
    differ = [i for i, (x, y) in enumerate(zip(ag, at)) if not same_bits(x, y)]
    out["eager_gaac_vs_eager_twin"] = {"layers": len(ag), "attention_bits": not differ,
                                       "first_layer": differ[0] if differ else None,
                                       "logit_bits": same_bits(lg, lt)}
    out["eager_logits"] = {"gaac": lg, "twin": lt}  # compared with the compiled first step by the caller
    return out


def ms(x):
    return round(1e3 * x, 4)


VARIANTS = {  # short name: label
    "gaac": "compiled GAACStaticCache",
    "twin": "compiled twin (plain BF16, same op)",
    "static": "compiled StaticCache + sdpa",
    "dynamic": "eager DynamicCache + flash sdpa",
    "eager-gaac": "eager GAACCache + gaac",
    "captured": "captured GAACStaticCache (CapturedStep)",
    "captured-twin": "captured twin (CapturedStep)",
}


@torch.no_grad()
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768, 65536, 131072])
    p.add_argument("--steps", type=int, default=20, help="timed decode steps of the compiled variants")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--eager-steps", type=int, default=5, help="timed decode steps of the eager variants (1 warm-up)")
    p.add_argument("--reps", type=int, default=20, help="CUDA graph replays per op timing of the split")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU, contexts 40 and 72")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; --tiny: aot_eager)")
    p.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=list(VARIANTS),
                   help="variants to run (short names)")
    p.add_argument("--skip", nargs="*", default=[], help="variants to leave out (short names or labels)")
    p.add_argument("--diag", action="store_true",
                   help="lossless diagnosis: compare the filled KV of GAAC and twin, one eager step of each "
                        "(per-layer attention outputs) and each cache's compiled first step against its eager one")
    p.add_argument("--skip-module-guards", action="store_true",
                   help="compile with gaac_hf.compile_kwargs(): the same CUDA-graph step without Dynamo's guards on "
                        "the model's modules and parameters (torch.compiler.skip_guard_on_all_nn_modules_unsafe)")
    p.add_argument("--graphs", default="trees", choices=("trees", "replay"),
                   help="with --skip-module-guards: the compiled variants' CUDA graphs from inductor's graph trees "
                        "(mode reduce-overhead) or recorded and replayed by gaac_hf.graph_replay.graph_replay_backend")
    p.add_argument("--format-version", type=int, default=2, choices=(1, 2),
                   help="calibration format (2: even windows; the GAAC caches then store format version 2 where the "
                        "CUDA kernel reads it, on Hopper)")
    p.add_argument("--inductor", default="", help="inductor options (JSON) for every compiled variant, e.g. "
                   "'{\"max_autotune\": true, \"coordinate_descent_tuning\": true}' for the step's matrix-vector products")
    p.add_argument("--python-profile", action="store_true",
                   help="cProfile the eager variants' steps (eager GAACCache over 16 steps: one finalizes blocks)")
    p.add_argument("--out", default="benchmarks/results/generate_h200.json")
    args = p.parse_args(argv)
    from transformers import AutoModelForCausalLM, DynamicCache, StaticCache

    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if args.tiny:
        args.contexts = [c for c in args.contexts if c <= 256] or [40, 72]
        args.steps, args.warmup = min(args.steps, 6), min(args.warmup, 2)
        args.eager_steps, args.reps = min(args.eager_steps, 3), min(args.reps, 3)
    skip = set(args.skip)
    run = {k for k, label in VARIANTS.items() if k in args.variants and k not in skip and label not in skip}
    backend = args.backend or ("aot_eager" if args.tiny else "inductor")

    def make_compile_kw():
        """torch.compile's keyword arguments, a new dict per compile: torch.compile pops `guard_filter_fn` from the
        `options` it is given, so a dict reused for a second compile would compile it with every module guard
        (sessions 4-15 did that: only the first compiled variant, GAAC, had its module guards skipped)."""
        if args.skip_module_guards:
            return with_inductor(compile_kwargs(backend=backend, graphs=args.graphs))
        kw = dict(fullgraph=True, backend=backend)
        if backend == "inductor" and args.inductor:  # torch.compile takes a mode or options, not both
            kw["options"] = compile_options(skip_module_guards=False)
        elif backend == "inductor":
            kw["mode"] = "reduce-overhead"
        return with_inductor(kw)

    def with_inductor(kw: dict) -> dict:
        """`--inductor`'s options added to a compile's (every compiled variant alike, baselines included)."""
        if args.inductor and backend == "inductor":
            kw["options"] = {**kw.get("options", {}), **json.loads(args.inductor)}
        return kw

    compile_kw = make_compile_kw()  # (for the record)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:7.1f} s] {msg}", flush=True)

    torch.manual_seed(0)
    cfg = llama31_8b_config(args.tiny)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    param_bytes = sum(t.numel() * t.element_size() for t in model.parameters())
    log(f"model built ({param_bytes / 1e9:.2f} GB)")
    sample, calibration, t_cal, kv = own_kv_calibration(model, args.tiny, device, args.format_version)
    log(f"calibrated ({t_cal:.1f} s), sample KV taken")
    steps, warmup = args.steps, args.warmup
    # + the diagnosis and profiled steps, the captured variants' steps after the compiled ones, and their 2 blocks
    # of pipelined steps
    cap = max(args.contexts) + 2 * (warmup + steps) + 3 * BLOCK_TOKENS + 16
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": __import__("transformers").__version__,
               "model": "Llama-3.1-8B architecture, random BF16 weights" if not args.tiny else "tiny Llama",
               "param_bytes": param_bytes, "compile": describe(compile_kw), "steps": steps, "warmup": warmup,
               "eager_steps": args.eager_steps, "cuda_pdl": cuda_default("PDL"), "cuda_split_warps": cuda_default("SPLIT_WARPS"),
               "cuda_twin_swizzle": cuda_default("TWIN_SWIZZLE"),
               "command": "python benchmarks/generate.py " + " ".join(
                   sys.argv[1:] if argv is None else argv),
               "calibration": {"escape_capacity": calibration.config.escape_capacity,
                               "format_version": calibration.config.format_version,
                               "measured": calibration.config.measured, "seconds": round(t_cal, 1)},
               "fill": f"the model's KV of one {sample.numel()}-token random prompt, repeated to the context",
               "split_method": "GPU time of each op over all layers from CUDA graph replays (median of "
                               f"{args.reps}): attention over the context; update = the per-step average "
                               "(15 x non-finalizing + 1 x finalizing) / 16, the finalizing one on the model's KV; "
                               "rest = step - attention - update (weights, norms, RoPE, ...)",
               "contexts": {}}
    compiled = {}
    captured = {}  # CapturedStep per cache (gaac, twin): one compile serves every context

    # one compiled forward per variant; they share model.forward's code, so Dynamo keeps one entry per variant
    # and context (StaticCache) in the same cache
    for knob in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)

    def compiled_forward(key):
        if key not in compiled:
            compiled[key] = torch.compile(model.forward, **make_compile_kw())
        return compiled[key]

    def free():
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    statics = {}  # GAAC and the twin: built once with room for the longest context, refilled per context
    for context in args.contexts:
        row = {}
        logits = {}
        log(f"context {context}")

        def record(label, times, hosts):
            row[label] = {"step_ms": ms(statistics.median(times)), "min_ms": ms(min(times)),
                          "host_ms": ms(statistics.median(hosts)), "steps": len(times)}
            log(f"  {label:<36} {row[label]['step_ms']:9.3f} ms/step (host {row[label]['host_ms']:.3f} ms)")

        def attempt(label, fn):
            """Run one part; an error is recorded in the JSON and the others still run."""
            try:
                fn()
            except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others' numbers)
                traceback.print_exc()
                row[label] = {"error": f"{type(e).__name__}: {e}"[:800]}
                log(f"  {label:<36} FAILED: {row[label]['error'][:200]}")

        fresh = set()  # the caches filled for this context

        def filled(key):
            if key not in statics:
                statics[key] = GAACStaticCache(model.config, cap, calibration) if key == "gaac" else \
                    PlainStaticCache(model.config, cap)
            cache = statics[key]
            cache.reset()
            fill(cache, kv, context, device)
            fresh.add(key)
            log(f"  {VARIANTS[key]}: filled")
            return cache

        model.set_attn_implementation("gaac")
        for key in ("gaac", "twin"):
            if key in run or (args.diag and {"gaac", "twin"} <= run):
                attempt(f"fill {key}", lambda: filled(key))
        diag = None
        if args.diag and {"gaac", "twin"} <= run and "gaac" in statics and "twin" in statics:
            def run_diag():
                nonlocal diag
                diag = diagnose(model, statics["gaac"], statics["twin"], context, device)
                log(f"  diag: fill {diag['fill']}; eager {diag['eager_gaac_vs_eager_twin']}")
            attempt("diag", run_diag)

        # compiled GAACStaticCache, and its plain twin
        def static_variant(key):
            label = VARIANTS[key]
            cache = statics[key]
            step = Stepper(model, compiled_forward(label), cache, context, device,
                           check=cache.check if key == "gaac" else None)
            times, hosts, lg = step.run(steps, warmup)
            record(label, times, hosts)
            logits[key] = lg
            if key == "gaac":
                s = cache.stats()
                row["resident_kv"] = {"gaac_bytes": s["bytes"]["total"], "bf16_bytes": s["bf16_bytes"],
                                      "saving": round(s["saving"], 4), "allocated_bytes": s["allocated_bytes"],
                                      "raw_tiles": s["raw_tiles"], "slots": s["slots"],
                                      "format_version": s["format_version"]}
            t = time_update_and_attention(cache, kv, device, args.reps)
            step_s = row[label]["step_ms"] / 1e3
            split = {"attention_ms": ms(t["attention"]) if "attention" in t else None,
                     "host_share": round(row[label]["host_ms"] / row[label]["step_ms"], 4)}
            if key == "gaac" and "update" in t and "update_finalizing" in t:
                per_step = ((BLOCK_TOKENS - 1) * t["update"] + t["update_finalizing"]) / BLOCK_TOKENS
                split.update(append_ms=ms(t["update"]), append_finalizing_ms=ms(t["update_finalizing"]),
                             finalize_ms=ms(per_step), finalize_share=round(per_step / step_s, 4),
                             finalized_tiles=t["finalized_tiles"])
            elif "update" in t:
                per_step = t["update"]
                split["update_ms"] = ms(per_step)
            else:
                per_step = None
            if "attention" in t and per_step is not None:
                rest = step_s - t["attention"] - per_step
                split.update(attention_share=round(t["attention"] / step_s, 4), rest_ms=ms(rest),
                             weights_gbps_if_rest_were_weights=round(param_bytes / max(rest, 1e-9) / 1e9, 1))
            split.update({k + "_error": v for k, v in t.items() if k.endswith("_error")})
            row["split" if key == "gaac" else "twin_split"] = split
            log(f"  {label} split: {split}")
            row["host_profile" if key == "gaac" else "twin_host_profile"] = host_profile(step, device)
            log(f"  {label} host: {row['host_profile' if key == 'gaac' else 'twin_host_profile']}")
            row[label]["gpu_kernels"] = gpu_profile(step, device)
            log(f"  {label} GPU: {row[label]['gpu_kernels']}")
            if key == "gaac":
                cache.check()

        for key in ("gaac", "twin"):
            if key in run and key in statics:
                attempt(VARIANTS[key], lambda: static_variant(key))
        if "gaac" in logits and "twin" in logits:
            row["lossless_vs_twin"] = logit_diff(logits["gaac"], logits["twin"])
            log(f"  lossless vs twin: {row['lossless_vs_twin']}")

        # the same caches under CapturedStep, from where they are (the compiled variants' steps, if they ran)
        def captured_variant(key):
            label = VARIANTS[key]
            source = "gaac" if key == "captured" else "twin"
            if source not in fresh:  # not filled for this context yet (its compiled variant did not run)
                filled(source)
            cache = statics[source]
            if source not in captured:
                captured[source] = CapturedStep(model, cache, compile=with_inductor(
                    compile_kwargs(cudagraphs=False, backend=backend)))
            step = captured[source]
            step.reset()  # the cache may have been refilled (new context): record again, after warm-up steps
            start = int(cache.get_seq_length())
            warm = max(warmup, step.replayer.warmup + 1)  # direct steps, the recording, then replays
            times, hosts, lg = Stepper(model, step, cache, start, device).run(steps, warm)
            record(label, times, hosts)
            row[label].update(start=start, graphs=len(step.graphs))
            logits[key] = lg
            row[label]["gpu_kernels"] = gpu_profile(Stepper(model, step, cache, start + warm + steps, device), device)
            log(f"  {label} GPU: {row[label]['gpu_kernels']}")
            # 2 blocks of steps back to back (the finalizing steps amortized as in generation), no host sync between
            at = start + warm + steps + 3
            before = step.replayer.recordings
            row[label]["pipelined_ms"] = round(1e3 * Stepper(model, step, cache, at, device).run_pipelined(
                2 * BLOCK_TOKENS), 4)
            row[label]["pipelined_recordings"] = step.replayer.recordings - before
            log(f"  {label} pipelined (no host sync between steps): {row[label]['pipelined_ms']:.3f} ms/step, "
                f"{row[label]['pipelined_recordings']} recordings")

        for key in ("captured", "captured-twin"):
            if key in run:
                attempt(VARIANTS[key], lambda: captured_variant(key))
        if "captured" in logits and "captured-twin" in logits:
            row["captured_lossless_vs_twin"] = logit_diff(logits["captured"], logits["captured-twin"])
            log(f"  captured lossless vs twin: {row['captured_lossless_vs_twin']}")
        if diag is not None:
            el = diag.pop("eager_logits")
            for key in ("gaac", "twin"):  # the compiled first step starts from the state the eager one did
                if key in logits:
                    diag[f"compiled_vs_eager_{key}"] = {"logit_bits": same_bits(logits[key][0], el[key]),
                                                        "max_abs_diff": float((logits[key][0].float() -
                                                                               el[key].float()).abs().max())}
            if "gaac" in logits and "twin" in logits:  # the KV the compiled steps wrote, GAAC vs twin
                diag["compiled_steps_kv"] = compare_kv(statics["gaac"], statics["twin"], context,
                                                       context + warmup + steps)
            row["diag"] = diag
            log(f"  diag: {diag}")

        # compiled StaticCache + sdpa (its own capacity per context: its attention reads the whole buffer)
        def static_sdpa(label=VARIANTS["static"]):
            model.set_attn_implementation("sdpa")
            cache = StaticCache(config=model.config, max_cache_len=context + warmup + steps + 16)
            fill(cache, kv, context, device)
            times, hosts, _ = Stepper(model, compiled_forward(label), cache, context, device).run(steps, warmup)
            record(label, times, hosts)

        # eager DynamicCache + flash sdpa
        def eager_steps(label, cache, profile_steps):
            """Time the eager steps of `cache` (and with --python-profile, cProfile `profile_steps` more)."""
            stepper = Stepper(model, model.forward, cache, context, device)
            times, hosts, _ = stepper.run(args.eager_steps, 1)
            record(label, times, hosts)
            if args.python_profile:
                row[label]["python_profile"] = python_profile(stepper, device, steps=profile_steps)
                log(f"  {label} python: {row[label]['python_profile']}")

        def dynamic_flash(label=VARIANTS["dynamic"]):
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
            fill(cache, kv, context, device)
            ctx = contextlib.nullcontext()
            if device.type == "cuda":
                from torch.nn.attention import SDPBackend, sdpa_kernel

                ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
            with ctx:
                eager_steps(label, cache, 3)

        # eager GAACCache + gaac
        def gaac_eager(label=VARIANTS["eager-gaac"]):
            model.set_attn_implementation("gaac")
            cache = GAACCache(model.config, calibration)
            fill(cache, kv, context, device)
            log(f"  {label}: filled")
            eager_steps(label, cache, BLOCK_TOKENS)  # profiled over a block: one step finalizes

        for key, fn in (("static", static_sdpa), ("dynamic", dynamic_flash), ("eager-gaac", gaac_eager)):
            if key in run:
                attempt(VARIANTS[key], fn)
                free()
        free()
        g = row.get(VARIANTS["gaac"], {}).get("step_ms")
        base = [row[VARIANTS[k]]["step_ms"] for k in ("static", "dynamic") if "step_ms" in row.get(VARIANTS[k], {})]
        if g and base:
            row["speedup_vs_best_baseline"] = round(min(base) / g, 3)
        if g and "step_ms" in row.get(VARIANTS["twin"], {}):
            row["speedup_vs_twin"] = round(row[VARIANTS["twin"]]["step_ms"] / g, 3)
        cg, ct = (row.get(VARIANTS[k], {}).get("step_ms") for k in ("captured", "captured-twin"))
        if cg and base:
            row["captured_speedup_vs_best_baseline"] = round(min(base) / cg, 3)
        if cg and ct:
            row["captured_speedup_vs_twin"] = round(ct / cg, 3)
        pg, pt = (row.get(VARIANTS[k], {}).get("pipelined_ms") for k in ("captured", "captured-twin"))
        if pg and pt:
            row["captured_pipelined_speedup_vs_twin"] = round(pt / pg, 3)
        for k in ("captured", "captured-twin"):
            if "step_ms" in row.get(VARIANTS[k], {}):
                row[VARIANTS[k]]["host_share"] = round(row[VARIANTS[k]]["host_ms"] / row[VARIANTS[k]]["step_ms"], 4)
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
    for key in ("speedup_vs_best_baseline", "speedup_vs_twin", "captured_speedup_vs_best_baseline",
                "captured_speedup_vs_twin", "captured_pipelined_speedup_vs_twin"):
        print(f"| {key} | " + " | ".join(str(r.get(key, "-")) for r in results["contexts"].values()) + " |")
    for c, r in results["contexts"].items():
        if "split" in r:
            print(f"{c}: split {r['split']}; twin {r.get('twin_split')}; resident saving "
                  f"{r.get('resident_kv', {}).get('saving')}; lossless {r.get('lossless_vs_twin')}")
    print(f"wall {results['wall_s']} s")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
