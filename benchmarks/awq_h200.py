"""Eager decode steps of an AWQ W4A16 model with DynamicCache and GAACCache (run by benchmarks/device/awq_h200.sh).

Writes a random-weight AWQ-GEMM 4-bit checkpoint of the Llama-3.1-8B architecture (`awq_checkpoint.py`, packed on
the GPU, no download) unless `--model-dir` already holds one, loads it with `from_pretrained` through transformers'
AWQ integration (gptqmodel kernel chosen by `--backend`), calibrates GAAC on the model's own KV, prefills a
`--context`-token random prompt and times `--new-tokens` greedy decode steps (CUDA-synchronized) for:

- `DynamicCache+sdpa`: transformers' default attention, the latency baseline;
- `DynamicCache+gaac`: the "gaac" attention's fused kernel over plain BF16 KV;
- `GAACCache+gaac`: the same kernel reading the compressed KV in place; tokens and every logit bit must equal
  `DynamicCache+gaac` (`lossless`).

transformers loads AWQ models in FP16 on CUDA whatever `dtype` says. With `--activations bf16` (the default) the
model is cast to BF16 after loading (scales and norms; the packed int32 weights stay) and the JSON records how far its
logits moved from the FP16 ones; with `--activations fp16` only DynamicCache runs (GAACCache refuses FP16 KV with a
TypeError, tested in tests/test_gaac_awq.py).

    python benchmarks/awq_h200.py --model-dir /tmp/llama8b-awq --backend torch_awq --out $OUT/awq_h200_torch.json
    python benchmarks/awq_h200.py --model tiny --model-dir /tmp/tiny-awq --context 256 --backend auto   # CPU dry run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from importlib.metadata import version

import torch
from awq_checkpoint import write_awq_checkpoint
from multi_gpu import LLAMA_31_8B, TINY, decode, kv_bytes_per_device
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import GAACCache
from gaac_hf.calibrate import calibrate

RUNS = ("DynamicCache+sdpa", "DynamicCache+gaac", "GAACCache+gaac")


def load(args, device: str):
    built_s = None
    if not os.path.exists(os.path.join(args.model_dir, "config.json")):
        t0 = time.perf_counter()
        write_awq_checkpoint(LlamaConfig(**(LLAMA_31_8B if args.model == "llama8b" else TINY)), args.model_dir,
                             group_size=args.group_size, device=device)
        built_s = time.perf_counter() - t0
    config = AutoConfig.from_pretrained(args.model_dir)
    config.quantization_config["backend"] = args.backend
    t0 = time.perf_counter()
    # device_map matters: without it gptqmodel picks its kernel for the CPU
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, config=config, dtype=torch.bfloat16,
                                                 device_map=device, attn_implementation="gaac").eval()
    return model, {"checkpoint_build_s": built_s, "load_s": time.perf_counter() - t0}


def quant_kernels(model) -> list[str]:
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    return sorted({type(m).__name__ for m in model.modules() if isinstance(m, BaseQuantLinear)})


@torch.no_grad()
def cast_to_bf16(model, device: str) -> dict:
    """Cast an FP16-loaded AWQ model to BF16 activations; report the logit change on a short prompt."""
    ids = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(5)).to(device)
    fp16 = model(input_ids=ids).logits.float()
    model.to(torch.bfloat16)
    bf16 = model(input_ids=ids).logits.float()
    return {"max_abs_logit_diff_vs_fp16": float((bf16 - fp16).abs().max()),
            "max_abs_logit_fp16": float(fp16.abs().max()),
            "top1_agreement_vs_fp16": float((bf16.argmax(-1) == fp16.argmax(-1)).float().mean())}


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, out = load(args, device)
    out.update(model=args.model, context=args.context, new_tokens=args.new_tokens, backend=args.backend,
               group_size=args.group_size, loaded_dtype=str(model.dtype), kernels=quant_kernels(model),
               gpu=torch.cuda.get_device_name(0) if device == "cuda" else "cpu", torch=torch.__version__,
               transformers=__import__("transformers").__version__,
               gptqmodel=version("gptqmodel"))
    if args.activations == "bf16" and model.dtype != torch.bfloat16:
        out["bf16_cast"] = cast_to_bf16(model, device)
    out["activations"] = str(model.dtype)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, model.config.vocab_size, (1, args.context), generator=gen).to(device)
    runs = RUNS
    calibration = None
    if model.dtype == torch.bfloat16:
        t0 = time.perf_counter()
        prompt = torch.randint(0, model.config.vocab_size, (args.calibration_tokens,),
                               generator=torch.Generator().manual_seed(1))
        calibration = calibrate(model, [prompt], "random token ids (the model's own KV)")
        out["calibration_s"] = time.perf_counter() - t0
    else:  # GAACCache refuses FP16 KV with a TypeError naming the dtype (tests/test_gaac_awq.py)
        runs = RUNS[:2]
    results = {}
    for name in runs:
        cache = GAACCache(model.config, calibration) if name.startswith("GAAC") else DynamicCache(config=model.config)
        model.set_attn_implementation(name.split("+")[1])
        tokens, scores, times, prefill = decode(model, ids, cache, args.new_tokens)
        ms = [1e3 * t for t in times[args.warmup:]]
        results[name] = {"tokens": tokens, "scores": scores}
        out[name] = {"prefill_s": prefill, "step_ms_median": statistics.median(ms),
                     "step_ms_p95": sorted(ms)[max(0, int(round(0.95 * len(ms))) - 1)],
                     "kv_bytes": sum(kv_bytes_per_device(cache).values())}
        del cache
        if device == "cuda":
            torch.cuda.empty_cache()
    if "GAACCache+gaac" in results:
        a, b = results["GAACCache+gaac"], results["DynamicCache+gaac"]
        out["lossless"] = torch.equal(a["tokens"], b["tokens"]) and all(
            torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a["scores"], b["scores"]))
        g = out["GAACCache+gaac"]["step_ms_median"]
        out["step_ratio_vs_dynamic_same_kernel"] = out["DynamicCache+gaac"]["step_ms_median"] / g
        out["step_ratio_vs_dynamic_sdpa"] = out["DynamicCache+sdpa"]["step_ms_median"] / g
        out["kv_saving"] = 1 - out["GAACCache+gaac"]["kv_bytes"] / out["DynamicCache+gaac"]["kv_bytes"]
    return out


def table(out: dict) -> str:
    rows = [f"AWQ W4A16 {out['model']} ({', '.join(out['kernels'])}, {out['activations']}), context "
            f"{out['context']}, {out['gpu']}",
            "| cache + attention | decode step ms (p95) | KV MB | step time / GAACCache step |", "|---|---|---|---|"]
    g = out.get("GAACCache+gaac", {}).get("step_ms_median")
    for name in RUNS:
        if name in out:
            r = out[name]
            ratio = f"{r['step_ms_median'] / g:.2f}x" if g else "—"
            rows.append(f"| {name} | {r['step_ms_median']:.2f} ({r['step_ms_p95']:.2f}) | {r['kv_bytes'] / 1e6:.1f} "
                        f"| {ratio} |")
    if "lossless" in out:
        rows.append(f"lossless (GAACCache+gaac vs DynamicCache+gaac): {out['lossless']}; KV saved "
                    f"{100 * out['kv_saving']:.1f}%")
    return "\n".join(rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=["llama8b", "tiny"], default="llama8b")
    ap.add_argument("--model-dir", required=True, help="an AWQ checkpoint; written here first if absent")
    ap.add_argument("--backend", default="torch_awq", help="transformers AwqBackend: torch_awq, marlin, auto, ...")
    ap.add_argument("--activations", choices=["bf16", "fp16"], default="bf16")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--calibration-tokens", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    out = run(args)
    print(table(out), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
