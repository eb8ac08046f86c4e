"""Quality of SmolLM2-135M-Instruct with low-bit KV caches (the baseline DGAP repairs), on held-out real text.

For BF16 (DynamicCache) and each `LowBitCache` precision: perplexity, top-1 agreement with BF16 and KL(BF16 || low-bit)
over the tokens of one long document, teacher-forced in chunks of `--chunk` tokens (<= the cache's 128-token
full-precision residual, so every query sees the older context quantized, as in decoding). DGAP rows are added when
trained artifacts exist (issue 5); this script measures the caches alone.

    python benchmarks/dgap_quality.py --tokens 4096 --out benchmarks/results/dgap_baseline.json
"""

import argparse
import json
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from dgap_hf import LowBitCache
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files, token_prompts
from gaac_hf.default_model import load_default_model
from gaac_hf.model_layers import cache_kwarg

CONFIGS = [("K8V8", {}), ("K4V4", {}), ("K2V2", {}), ("K2V2", {"sink_length": 4}),
           ("K1V1", {"one_bit_mode": "sign"}), ("K1V1", {"one_bit_mode": "sign", "sink_length": 4}),
           ("K1V1", {"one_bit_mode": "minmax"})]


@torch.no_grad()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/dgap_baseline.json")
    args = p.parse_args()
    model, tokenizer = load_default_model()
    text = read_text_files(DEBIAN_REFERENCE)
    ids = token_prompts(tokenizer, text.text, args.tokens, 1)[0][None]
    name = cache_kwarg(model)
    caches = {"BF16": DynamicCache(config=model.config)}
    for precision, kw in CONFIGS:
        label = precision + "".join(f" ({v})" if k == "one_bit_mode" else f" (sink {v})" for k, v in kw.items())
        caches[label] = LowBitCache(model.config, precision, group_size=32, residual_length=128, **kw)
    stats = {k: {"nll": 0.0, "agree": 0, "kl": 0.0, "n": 0} for k in caches}
    t0 = time.time()
    for s in tqdm(range(0, args.tokens - 1, args.chunk), desc="chunks"):
        chunk = ids[:, s:s + args.chunk]
        target = ids[0, s + 1:s + 1 + chunk.shape[1]]
        n = target.numel()
        logp = {}
        for k, cache in caches.items():
            logits = model(input_ids=chunk, use_cache=True, **{name: cache}).logits[0, :n].float()
            logp[k] = torch.log_softmax(logits, -1)
        ref = logp["BF16"]
        for k, lp in logp.items():
            st = stats[k]
            st["nll"] -= lp.gather(-1, target[:, None]).sum().item()
            st["agree"] += (lp.argmax(-1) == ref.argmax(-1)).sum().item()
            st["kl"] += (ref.exp() * (ref - lp)).sum().item()
            st["n"] += n
    rows = []
    for k, st in stats.items():
        rows.append({"cache": k, "ppl": float(torch.tensor(st["nll"] / st["n"]).exp()),
                     "top1_agreement_with_bf16": st["agree"] / st["n"], "kl_from_bf16": st["kl"] / st["n"],
                     "tokens": st["n"]})
    bytes_ = {k: c.stats()["bytes"]["total"] if hasattr(c, "stats") else None for k, c in caches.items()}
    out = {"model": str(model.config.name_or_path), "text": text.description, "tokens": args.tokens,
           "chunk": args.chunk, "group_size": 32, "residual_length": 128, "rows": rows,
           "cache_bytes": {k: v for k, v in bytes_.items() if v is not None},
           "seconds": time.time() - t0, "torch": torch.__version__}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print("| cache | PPL | top-1 agreement with BF16 | KL(BF16 || cache) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['cache']} | {r['ppl']:.2f} | {100 * r['top1_agreement_with_bf16']:.1f}% | {r['kl_from_bf16']:.4f} |")


if __name__ == "__main__":
    main()
