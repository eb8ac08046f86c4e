"""Quality of low-bit KV caches against the full-precision cache on held-out text, at honest bits per element.

SmolLM2-135M-Instruct, teacher-forced over `--windows` windows of `--tokens` tokens of the Debian Reference, in
chunks of `--chunk` tokens (the protocol of `benchmarks/dgap_quality.py`: each chunk's queries see the older context
as the cache stores it). For each cache: perplexity, its ratio to the reference perplexity, top-1 agreement with the
reference and KL(reference || cache), and bits per K/V element from the cache's own byte count at the end of each
window (`LowBitCache.stats()`, `dgap_hf.baselines.quantized_cache_stats` for transformers' `QuantizedCache`):
everything but the recent full-precision window of at most 128 tokens.

The model runs in float32 on the CPU (its BF16 weights upcast; 2.5x faster than BF16 matmuls there). The reference
is `DynamicCache`; its log-probabilities are computed once per window and kept under `--ref-cache`. Full-precision
tokens a low-bit cache keeps (sinks, residual beyond 128 tokens) are counted at the run's 4 bytes, so bits per
element are slightly pessimistic next to a BF16 run; `QuantizedCache` statistics are counted at BF16 (2 bytes).
Results are appended per cache to `--out` (a rerun skips caches already measured under the same protocol).

    python benchmarks/lowbit_quality.py --suite sweep --tokens 1024 --windows 1 --threads 1 \\
        --out benchmarks/results/lowbit_sweep.json
    python benchmarks/lowbit_quality.py --suite baselines --tokens 2048 --windows 1 --first-window 1 --threads 1 \\
        --out benchmarks/results/lowbit_baselines.json
    python benchmarks/lowbit_quality.py --suite final --tokens 2048 --windows 1 --first-window 1 --threads 1 \\
        --out benchmarks/results/lowbit_quality.json --merge benchmarks/results/lowbit_baselines.json \\
        --plot benchmarks/results/lowbit_quality.png

One intra-op thread (`--threads 1`) is much faster than two on a busy machine.
"""

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from dgap_hf import LowBitCache, LowBitConfig
from dgap_hf.baselines import quantized_cache, quantized_cache_stats
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files, token_prompts
from gaac_hf.default_model import load_default_model
from gaac_hf.model_layers import cache_kwarg

KIVI = dict(key_group_size=32, value_group_size=32, residual_length=128)  # the former default (3 bits at 2-bit)
G = dict(key_group_size=128, value_group_size=64, residual_length=0)  # the group sizes that fit the bit budgets
G64 = dict(key_group_size=64, value_group_size=64, residual_length=64)


def lowbit(precision, **kw):
    return ("lowbit", {"precision": precision, **kw})


def qc(backend, nbits, **kw):
    return ("quantized", {"backend": backend, "nbits": nbits, "q_group_size": 64, "residual_length": 128, **kw})


SWEEP = {  # selection runs on window 0; `final` reports the chosen defaults on other windows
    "K8V8 g128/64": lowbit("K8V8", **G),
    "K4V4 g128/64 sink4": lowbit("K4V4", **G, sink_length=4),
    "K4V4 g128/64 sink4 hadamard": lowbit("K4V4", **G, sink_length=4, rotation="hadamard"),
    "K4V4 g128/64 sink4 hadamard normal": lowbit("K4V4", **G, sink_length=4, rotation="hadamard", levels="normal"),
    "K2V2 g128/64": lowbit("K2V2", **G),
    "K2V2 g128/64 sink4": lowbit("K2V2", **G, sink_length=4),
    "K2V2 g128/64 sink4 normal": lowbit("K2V2", **G, sink_length=4, levels="normal"),
    "K2V2 g128/64 sink4 hadamard": lowbit("K2V2", **G, sink_length=4, rotation="hadamard"),
    "K2V2 g128/64 sink4 hadamard normal": lowbit("K2V2", **G, sink_length=4, rotation="hadamard", levels="normal"),
    "K2V2 g128/64 sink4 random normal": lowbit("K2V2", **G, sink_length=4, rotation="random", levels="normal"),
    "K2V2 g128/64 sink4 hadamard-v normal": lowbit("K2V2", **G, sink_length=4, rotation="hadamard", rotate="v",
                                                   levels="normal"),
    "K2V2 g128/64 sink4 hadamard normal k-outlier1": lowbit("K2V2", **G, sink_length=4, rotation="hadamard",
                                                            levels="normal", key_outliers=1),
    "K1V1 g128/64": lowbit("K1V1", **G),
    "K2V2 g128/64 sink16 hadamard normal": lowbit("K2V2", **G, sink_length=16, rotation="hadamard", levels="normal"),
    "K1V1 g128/64 hadamard": lowbit("K1V1", **G, rotation="hadamard"),
    "K2V2 g128/64 hadamard normal": lowbit("K2V2", **G, rotation="hadamard", levels="normal"),
    "K4V4 g128/64 hadamard": lowbit("K4V4", **G, rotation="hadamard"),
    "K4V4 g128/64 sink4 random": lowbit("K4V4", **G, sink_length=4, rotation="random"),
    "K1V1 g128/64 sink4 random": lowbit("K1V1", **G, sink_length=4, rotation="random"),
    "K1V1 g128/64 sink4": lowbit("K1V1", **G, sink_length=4),
    "K1V1 g128/64 sink4 hadamard": lowbit("K1V1", **G, sink_length=4, rotation="hadamard"),
    "K1V1 g128/64 sink4 hadamard-v": lowbit("K1V1", **G, sink_length=4, rotation="hadamard", rotate="v"),
}

BASELINES = {
    "QuantizedCache quanto 2": qc("quanto", 2),
    "QuantizedCache quanto 2 keys per channel": qc("quanto", 2, axis_key=-1),
    "QuantizedCache quanto 4": qc("quanto", 4),
    "QuantizedCache hqq 1": qc("hqq", 1),
    "QuantizedCache hqq 2": qc("hqq", 2),
    "QuantizedCache hqq 4": qc("hqq", 4),
    "QuantizedCache hqq 8": qc("hqq", 8),
}


def final_suite(model_config=None):
    """Each precision's documented default (`LowBitConfig.default` for the model, as `LowBitCache(config, p)`
    builds it), mixed precisions and the former KIVI-32 default (`--suite baselines`: transformers'
    `QuantizedCache`)."""
    suite = {}
    for p in ("K2V2", "K1V1", "K4V4", "K8V8", "K2V4", "K4V2"):
        suite[f"{p} default"] = ("lowbit", {"config": LowBitConfig.default(p, model_config=model_config).to_spec()})
    if model_config is not None:  # session 11's candidates for the K2V2 default (pre-RoPE keys; retrieval heads), from session 9's
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from lowbit_niah import _retrieval
        from lowbit_sensitivity import k2v2_session9

        k2 = k2v2_session9(model_config)
        suite["K2V2 default of session 9 (27 key heads)"] = ("lowbit", {"config": k2.to_spec()})
        suite["K2V2 default + pre-RoPE keys"] = ("lowbit", {"config": k2.replace(pre_rope_keys=True).to_spec()})
        ret = _retrieval(model_config, 8)
        suite["K2V2 top-8 retrieval heads K4V4 + 11 key heads"] = ("lowbit", {"config": ret.to_spec()})
        suite["K2V2 top-8 retrieval heads K4V4 + 11 key heads + pre-RoPE keys"] = (
            "lowbit", {"config": ret.replace(pre_rope_keys=True).to_spec()})
        suite["K2V2 top-8 retrieval heads K4V4 + 11 key heads + pre-RoPE keys, BF16 key zero"] = (
            "lowbit", {"config": ret.replace(pre_rope_keys=True, key_zero_dtype="bfloat16").to_spec()})
        suite["K2V2 top-8 retrieval heads K4V4 + 11 key heads + pre-RoPE keys, random rotation"] = (
            "lowbit", {"config": ret.replace(pre_rope_keys=True, rotation="random").to_spec()})
        suite["K2V2 top-8 retrieval heads K4V4 + 11 key heads + pre-RoPE keys, keys not rotated"] = (
            "lowbit", {"config": ret.replace(pre_rope_keys=True, rotate="v").to_spec()})
    suite["K2V2 default of session 1"] = lowbit("K2V2", **G, sink_length=4, rotation="hadamard", levels="normal")
    for p in ("K2V2", "K1V1"):
        suite[f"{p} kivi32"] = lowbit(p, **KIVI)
    return suite


def make_cache(model, kind, kw):
    if kind == "quantized":
        return quantized_cache(model.config, **kw)
    cfg = LowBitConfig.from_spec(kw["config"]) if "config" in kw else LowBitConfig(**kw)
    return LowBitCache(model.config, cfg)


def cache_bits(cache) -> dict:
    st = cache.stats() if isinstance(cache, LowBitCache) else quantized_cache_stats(cache)
    return {"bits_per_element": st["bits_per_element"], "bytes": st["bytes"]}


@torch.no_grad()
def run_window(model, ids, cache, chunk):
    """Log-probabilities `[n, V]` of the next tokens of `ids` `[1, T]`, teacher-forced in chunks."""
    name = cache_kwarg(model)
    out = []
    for s in range(0, ids.shape[1] - 1, chunk):
        piece = ids[:, s:s + chunk]
        n = min(piece.shape[1], ids.shape[1] - 1 - s)
        logits = model(input_ids=piece, use_cache=True, **{name: cache}).logits[0, :n].float()
        out.append(torch.log_softmax(logits, -1))
    return torch.cat(out)


def reference(model, ids, chunk, ref_dir, key):
    path = Path(ref_dir) / f"{key}-f32.pt"
    if path.is_file():
        return torch.load(path)
    lp = run_window(model, ids, DynamicCache(config=model.config), chunk)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(lp, path)
    return lp


def score(lp, ref, target):
    return {"nll": float(-lp.gather(-1, target[:, None]).sum()), "agree": int((lp.argmax(-1) == ref.argmax(-1)).sum()),
            "kl": float((ref.exp() * (ref - lp)).sum()), "n": int(target.numel())}


def table(rows, ref_ppl) -> str:
    lines = [f"Reference (DynamicCache) PPL {ref_ppl:.3f}.", "",
             "| cache | bits/elt | PPL | PPL vs ref | top-1 agreement | KL(ref ‖ cache) |",
             "|---|---|---|---|---|---|"]
    for label, r in sorted(rows.items(), key=lambda kv: -kv[1]["bits_per_element"]):
        lines.append(f"| {label} | {r['bits_per_element']:.3f} | {r['ppl']:.3f} "
                     f"| {100 * (r['ppl'] / ref_ppl - 1):+.2f}% "
                     f"| {100 * r['top1_agreement']:.2f}% | {r['kl']:.4f} |")
    return "\n".join(lines)


def plot(rows, ref_ppl, path):
    """KL(reference || cache) (log) and top-1 agreement against bits per element, LowBitCache vs QuantizedCache."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    metrics = (("kl", "KL(DynamicCache || cache) per token (nats)", True),
               ("top1_agreement", "top-1 agreement with DynamicCache", False))
    for ax, (key, ylabel, log) in zip(axes, metrics):
        for kind, marker, color in (("LowBitCache", "o", "tab:blue"), ("QuantizedCache", "s", "tab:red")):
            pts = [(r["bits_per_element"], max(r[key], 1e-5), lab) for lab, r in rows.items()
                   if lab.startswith("QuantizedCache") == (kind == "QuantizedCache")]
            if not pts:
                continue
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=color, label=kind)
            for x, y, lab in pts:
                ax.annotate(lab.replace("QuantizedCache ", ""), (x, y), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        if log:
            ax.set_yscale("log")
        ax.set_xlabel("bits per K/V element (all but the recent 128-token window)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"SmolLM2-135M, Debian Reference, teacher-forced (DynamicCache PPL {ref_ppl:.3f})")
    fig.tight_layout()
    fig.savefig(path, dpi=130)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--suite", choices=("sweep", "final", "baselines"), default="final")
    p.add_argument("--only", nargs="*", help="labels of the suite to run (default: all)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--windows", type=int, default=2)
    p.add_argument("--first-window", type=int, default=0, help="index of the first text window")
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ref-cache", default=os.path.expanduser("~/.cache/gaac_hf/lowbit_ref"))
    p.add_argument("--out", default="benchmarks/results/lowbit_quality.json")
    p.add_argument("--markdown", help="write the table here (default: --out with .md)")
    p.add_argument("--plot", help="write a quality vs bits/element plot here")
    p.add_argument("--merge", nargs="*", default=[], help="result files of the same protocol whose rows join the "
                   "table and plot (run separately, e.g. the QuantizedCache baselines)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    model = model.float()
    suite = {"sweep": SWEEP, "final": final_suite(model.config), "baselines": BASELINES}[args.suite]
    if args.only:
        suite = {k: suite[k] for k in args.only}
    text = read_text_files(DEBIAN_REFERENCE)
    windows = token_prompts(tok, text.text, args.tokens, args.first_window + args.windows)[args.first_window:]
    protocol = {"model": str(model.config.name_or_path), "text": text.description, "tokens": args.tokens,
                "windows": len(windows), "first_window": args.first_window, "chunk": args.chunk,
                "dtype": "float32 compute (BF16 weights)"}
    out_path = Path(args.out)
    saved = json.loads(out_path.read_text()) if out_path.is_file() else {}
    rows = saved.get("rows", {}) if saved.get("protocol") == protocol else {}
    refs = []
    for w, ids in enumerate(windows):
        key = hashlib.sha1(ids.numpy().tobytes() + str(args.chunk).encode()).hexdigest()[:16]
        refs.append(reference(model, ids[None], args.chunk, args.ref_cache, key))
    ref_nll = sum(float(-r.gather(-1, ids[1:, None]).sum()) for r, ids in zip(refs, windows))
    ref_n = sum(ids.numel() - 1 for ids in windows)
    ref_ppl = float(torch.tensor(ref_nll / ref_n).exp())
    for label, (kind, kw) in suite.items():
        if label in rows:
            continue
        t0 = time.time()
        tot = {"nll": 0.0, "agree": 0, "kl": 0.0, "n": 0}
        bits = []
        try:
            for ids, ref in zip(windows, refs):
                cache = make_cache(model, kind, kw)
                lp = run_window(model, ids[None], cache, args.chunk)
                for k, v in score(lp, ref, ids[1:]).items():
                    tot[k] += v
                bits.append(cache_bits(cache))
        except ValueError as e:  # e.g. a QuantizedCache backend that is not installed
            print(f"{label}: skipped ({e})")
            continue
        rows[label] = {"kind": kind, "options": kw, "ppl": float(torch.tensor(tot["nll"] / tot["n"]).exp()),
                       "top1_agreement": tot["agree"] / tot["n"], "kl": tot["kl"] / tot["n"], "tokens": tot["n"],
                       "bits_per_element": sum(b["bits_per_element"] for b in bits) / len(bits),
                       "bytes_last_window": bits[-1]["bytes"], "seconds": time.time() - t0}
        r = rows[label]
        print(f"{label}: bits {r['bits_per_element']:.3f} PPL {r['ppl']:.3f} ({100 * (r['ppl'] / ref_ppl - 1):+.2f}%) "
              f"top-1 {100 * r['top1_agreement']:.2f}% KL {r['kl']:.4f} [{r['seconds']:.0f}s]", flush=True)
        out_path.write_text(json.dumps({"protocol": protocol, "reference_ppl": ref_ppl, "rows": rows,
                                        "torch": torch.__version__}, indent=1) + "\n")
    for other in args.merge:
        extra = json.loads(Path(other).read_text())
        if extra.get("protocol") != protocol:
            raise SystemExit(f"{other} was measured under another protocol: {extra.get('protocol')}")
        rows = {**extra["rows"], **rows}
    md = table(rows, ref_ppl)
    print(md)
    md_path = Path(args.markdown or out_path.with_suffix(".md"))
    cmd = "python benchmarks/lowbit_quality.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in (("suite", args.suite), ("tokens", args.tokens),
                                                     ("windows", args.windows), ("first_window", args.first_window)))
    md_path.write_text(f"{protocol['model']}, {protocol['text']}, {len(windows)} window(s) of {args.tokens} tokens "
                       f"from window {args.first_window}, teacher-forced in chunks of {args.chunk}, "
                       f"{protocol['dtype']}. `{cmd}`\n\n{md}\n")
    if args.plot:
        plot(rows, ref_ppl, args.plot)


if __name__ == "__main__":
    main()
