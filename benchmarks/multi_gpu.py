"""GAACCache across GPUs: accelerate `device_map` (layers split over GPUs) and transformers tensor parallelism
(`tp_plan="auto"` under torchrun, kv-heads split over ranks), against DynamicCache in the same setup.

For each setup: prefill a `--context`-token prompt, then `--new-tokens` greedy decode steps, once with DynamicCache and
once with GAACCache, both with the "gaac" attention (DynamicCache runs the same fused kernel over plain KV), and
checks that tokens and every step's logits are bit-identical; then DynamicCache with "sdpa" (cuDNN / flash), the
latency baseline. Reports decode-step latency (CUDA-synchronized on every GPU, median and p95) and resident KV per
GPU.

Models: `llama8b` (Llama-3.1-8B architecture, random weights, calibrated on its own KV) or `smollm2` (the embedded
SmolLM2-135M-Instruct with its shipped calibration; 9 query / 3 KV heads cannot be split over 2 ranks, so it runs
under device_map only). `tiny` is a small Llama for a CPU dry run.

    python benchmarks/multi_gpu.py device-map --model llama8b --context 65536 --out results/x.json
    torchrun --nproc-per-node 2 benchmarks/multi_gpu.py tp --model llama8b --model-dir /dev/shm/llama8b ...
    python benchmarks/multi_gpu.py report benchmarks/results/multi_gpu_*.json --out benchmarks/results/multi_gpu.md
"""

import argparse
import json
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import GAACCache, GAACCalibration
from gaac_hf.calibrate import calibrate
from gaac_hf.model_layers import cache_kwarg

LLAMA_31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                   rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)


def devices_of(model) -> list[torch.device]:
    return sorted({p.device for p in model.parameters()}, key=str)


def sync(model):
    for d in devices_of(model):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def kv_bytes_per_device(cache) -> dict:
    out = {}
    if isinstance(cache, GAACCache):
        for i in cache.gaac_layers:
            layer = cache.layers[i]
            d = str(layer.device)
            out[d] = out.get(d, 0) + layer.stats()["bytes"]["total"]
    else:
        for layer in cache.layers:
            if getattr(layer, "keys", None) is not None:
                d = str(layer.keys.device)
                out[d] = out.get(d, 0) + 2 * layer.keys.numel() * layer.keys.element_size()
    return out


@torch.no_grad()
def decode(model, ids, cache, steps):
    """Prefill, then greedy steps; returns tokens, per-step logits and per-step seconds."""
    kw = cache_kwarg(model)
    sync(model)
    t0 = time.perf_counter()
    logits = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{kw: cache}).logits[:, -1]
    sync(model)
    prefill = time.perf_counter() - t0
    tokens, scores, times = [], [logits.float().cpu()], []
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        tokens.append(nxt.cpu())
        sync(model)
        t0 = time.perf_counter()
        logits = model(input_ids=nxt, use_cache=True, **{kw: cache}).logits[:, -1]
        sync(model)
        times.append(time.perf_counter() - t0)
        scores.append(logits.float().cpu())
    return torch.cat(tokens, -1), scores, times, prefill


def build(args, device_map=None):
    if args.model == "smollm2":
        from gaac_hf.cli import shipped_calibration
        from gaac_hf.default_model import default_model_path

        model = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.bfloat16,
                                                     attn_implementation="gaac",
                                                     device_map="balanced" if device_map else None,
                                                     **({"tp_plan": "auto"} if args.mode == "tp" else {})).eval()
        model.config.name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
        return model, GAACCalibration.from_pretrained(shipped_calibration())
    if args.mode == "tp":
        model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.bfloat16, tp_plan="auto",
                                                     attn_implementation="gaac").eval()
    else:
        cfg = LlamaConfig(**(LLAMA_31_8B if args.model == "llama8b" else TINY))
        torch.manual_seed(0)
        first = "cuda:0" if torch.cuda.is_available() else "cpu"
        with torch.device(first):
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="gaac").eval()
        if args.model_dir and not os.path.isdir(args.model_dir):
            model.save_pretrained(args.model_dir)  # for the tensor-parallel run
        if device_map is not None and torch.cuda.device_count() > 1:
            from accelerate import dispatch_model, infer_auto_device_map

            dm = infer_auto_device_map(model, no_split_module_classes=["LlamaDecoderLayer"],
                                       max_memory=balanced_memory(model))
            # skip_keys: never let accelerate's hooks move the cache between devices (as from_pretrained does)
            model = dispatch_model(model, dm, skip_keys=model._skip_keys_device_placement)
    if args.calibration:
        return model, GAACCalibration.from_pretrained(args.calibration)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.config.vocab_size, (args.calibration_tokens,), generator=gen)]
    calibration = calibrate(model, prompts, "random token ids (the model's own KV)")
    if args.model_dir:  # the tensor-parallel run slices this full-model calibration per rank
        calibration.save_pretrained(os.path.join(args.model_dir, "gaac-calibration"))
    return model, calibration


def backends(name):
    """`sdpa-cudnn`: cuDNN attention first (the fastest decode kernel on Hopper), then flash / efficient."""
    import contextlib

    if not name.endswith("cudnn") or not torch.cuda.is_available():
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return sdpa_kernel(order, set_priority=True)


def balanced_memory(model) -> dict:
    """Half of the weights per GPU (accelerate would otherwise fill GPU 0 first)."""
    n = torch.cuda.device_count()
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    return {i: int(size / n * 1.15) for i in range(n)} | {"cpu": 0}


def run(args):
    distributed = args.mode == "tp"
    rank = int(os.environ.get("RANK", 0))
    if distributed and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    model, calibration = build(args, device_map=None if distributed else "auto")
    device = model.device
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=gen).to(device)
    results = {}
    for name in ("DynamicCache", "GAACCache", "DynamicCache+sdpa", "DynamicCache+sdpa-cudnn"):
        cache = (GAACCache(model.config, calibration) if name == "GAACCache"
                 else DynamicCache(config=model.config))
        model.set_attn_implementation("sdpa" if "sdpa" in name else "gaac")
        with backends(name):
            tokens, scores, times, prefill = decode(model, ids, cache, args.new_tokens)
        ms = [1e3 * t for t in times[args.warmup:]]
        results[name] = {"tokens": tokens, "scores": scores, "prefill_s": prefill,
                         "step_ms_median": statistics.median(ms),
                         "step_ms_p95": sorted(ms)[max(0, int(round(0.95 * len(ms))) - 1)],
                         "kv_bytes_per_device": kv_bytes_per_device(cache)}
        if name == "GAACCache":
            st = cache.stats()
            results[name]["kv_saving"] = st["saving"]
            results[name]["mode_shares"] = st["mode_shares"]
        del cache
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    a, b = results["GAACCache"], results["DynamicCache"]
    lossless = torch.equal(a["tokens"], b["tokens"]) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a["scores"], b["scores"]))
    out = {"mode": args.mode, "model": args.model, "context": args.context, "new_tokens": args.new_tokens,
           "rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", 1)),
           "devices": [str(d) for d in devices_of(model)],
           "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "lossless": lossless}
    for name, r in results.items():
        out[name] = {k: v for k, v in r.items() if k not in ("tokens", "scores")}
    out["decode_speedup_vs_same_kernel"] = b["step_ms_median"] / a["step_ms_median"]
    out["decode_speedup_vs_sdpa"] = results["DynamicCache+sdpa"]["step_ms_median"] / a["step_ms_median"]
    out["decode_speedup_vs_sdpa_cudnn"] = (results["DynamicCache+sdpa-cudnn"]["step_ms_median"]
                                           / a["step_ms_median"])
    out["sdpa_tokens_equal"] = torch.equal(results["DynamicCache+sdpa"]["tokens"], b["tokens"])
    print(json.dumps({k: v for k, v in out.items()}, indent=1), flush=True)
    if args.out:
        path = args.out if not distributed else args.out.replace(".json", f".rank{rank}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out


def report(paths, out=None) -> str:
    """Markdown table of result JSONs (one row per run and rank)."""
    rows = ["| setup | model | context | rank | lossless | GAAC step ms (p95) | DynamicCache same kernel | "
            "DynamicCache sdpa default | DynamicCache sdpa cuDNN | KV per GPU GAAC / BF16 (GB) | saved |",
            "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in paths:
        with open(path) as f:
            d = json.load(f)
        g, dyn = d["GAACCache"], d["DynamicCache"]
        kv = ", ".join(f"{dev}: {g['kv_bytes_per_device'][dev] / 1e9:.2f} / {b / 1e9:.2f}"
                       for dev, b in dyn["kv_bytes_per_device"].items() if dev in g["kv_bytes_per_device"])

        def ms(name):
            r = d.get(name)
            return f"{r['step_ms_median']:.1f}" if r else "—"
        setup = f"tp ({d['world_size']} ranks)" if d['mode'] == 'tp' else f"device_map ({len(d['devices'])} GPUs)"
        rows.append(f"| {setup} | {d['model']} | "
                    f"{d['context']} | {d['rank']}/{d['world_size']} | {d['lossless']} | {g['step_ms_median']:.1f} "
                    f"({g['step_ms_p95']:.1f}) | {ms('DynamicCache')} | {ms('DynamicCache+sdpa')} | "
                    f"{ms('DynamicCache+sdpa-cudnn')} | {kv} | {100 * g['kv_saving']:.1f}% |")
    table = "\n".join(rows)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")
    return table


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["device-map", "tp", "report"])
    ap.add_argument("results", nargs="*", help="report: result JSON files")
    ap.add_argument("--model", choices=["llama8b", "smollm2", "tiny"], default="llama8b")
    ap.add_argument("--model-dir", help="tp: a saved checkpoint; device-map: save the random model here")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--calibration", help="a saved GAAC calibration (default: calibrate on the model's own KV)")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.mode == "report":
        print(report(args.results, args.out))
        return
    run(args)


if __name__ == "__main__":
    main()
