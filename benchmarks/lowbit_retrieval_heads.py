"""Which KV heads retrieve: a retrieval score per head from full-precision multi-key NIAH answers (Wu et al. 2024,
"Retrieval Head Mechanistically Explains Long-Context Factuality": a head retrieves when, while the model copies
the needle, its most-attended position is the needle token being copied).

Cases are multi-key NIAH haystacks of `benchmarks/dgap_niah.py` drawn from their own seed (`multikey-<length>-heads`),
so heads chosen here are not chosen on the cases `benchmarks/lowbit_niah.py` scores. Per case: the prompt is
prefilled once (full precision), then the answer (" " + 7 digits) is teacher-forced one token at a time with eager
attention; at each step whose next token is a digit of the asked needle, every query head scores a hit if its
argmax key position is that digit in the needle, and its attention mass there. A KV head's score is the mean over
its query heads (GQA group). Prints the ranking and writes JSON (used to choose `LowBitConfig` head tables).

    python benchmarks/lowbit_retrieval_heads.py --length 2048 --samples 32 \\
        --out benchmarks/results/lowbit_retrieval_heads_2k.json
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dgap_niah import make_case  # noqa: E402

from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files  # noqa: E402
from gaac_hf.default_model import load_default_model  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402


def find(seq: list, sub: list) -> int:
    """Last start of `sub` in `seq` (the needle sits in the haystack, before the question), or -1."""
    for i in range(len(seq) - len(sub), -1, -1):
        if seq[i:i + len(sub)] == sub:
            return i
    return -1


@torch.no_grad()
def case_scores(model, tok, ids, want):
    """Per (layer, query head): hits and attention mass on the copied needle digit, summed over the answer steps."""
    kw = cache_kwarg(model)
    answer = tok(" " + want[0], add_special_tokens=False).input_ids
    needle = find(ids[0].tolist(), answer)
    if needle < 0:  # another needle was inserted inside this one (dgap_niah.make_case allows it): no copy to score
        return None
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, **{kw: cache})
    n_layers, n_heads = model.config.num_hidden_layers, model.config.num_attention_heads
    hits = torch.zeros(n_layers, n_heads)
    mass = torch.zeros(n_layers, n_heads)
    for j in range(len(answer) - 1):  # input answer[j], next token answer[j + 1] = the needle's token needle + j + 1
        out = model(input_ids=torch.tensor([[answer[j]]]), use_cache=True, output_attentions=True, **{kw: cache})
        target = needle + j + 1
        for layer, att in enumerate(out.attentions):  # [1, heads, 1, kv]
            a = att[0, :, -1].float()
            hits[layer] += (a.argmax(-1) == target).float()
            mass[layer] += a[:, target]
    return hits, mass, len(answer) - 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--text", nargs="+", default=list(DEBIAN_REFERENCE), help="haystack text files (.gz allowed)")
    ap.add_argument("--out", default="benchmarks/results/lowbit_retrieval_heads.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model(attn_implementation="eager")
    model.float()
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    hay = tok(read_text_files(args.text).text, add_special_tokens=False).input_ids
    rng = random.Random(f"multikey-{args.length}-heads")
    t0 = time.time()
    hits = torch.zeros(cfg.num_hidden_layers, cfg.num_attention_heads)
    mass = torch.zeros_like(hits)
    steps, skipped = 0, []
    for i in range(args.samples):
        ids, want = make_case("multikey", hay, tok, args.length, rng)
        scored = case_scores(model, tok, ids, want)
        if scored is None:
            skipped.append(i)
            print(f"case {i}: the asked needle is split by another one, left out", flush=True)
            continue
        hits, mass, steps = hits + scored[0], mass + scored[1], steps + scored[2]
        print(f"case {i}: {time.time() - t0:.0f}s", flush=True)
    q_hit, q_mass = hits / steps, mass / steps
    kv_hit = q_hit.view(cfg.num_hidden_layers, cfg.num_key_value_heads, group).mean(-1)
    kv_mass = q_mass.view(cfg.num_hidden_layers, cfg.num_key_value_heads, group).mean(-1)
    order = sorted(((layer, head) for layer in range(cfg.num_hidden_layers) for head in range(cfg.num_key_value_heads)),
                   key=lambda lh: -float(kv_mass[lh]))
    ranking = [{"layer": layer, "kv_head": head, "retrieval_score": round(float(kv_hit[layer, head]), 4),
                "needle_attention": round(float(kv_mass[layer, head]), 4)} for layer, head in order]
    lines = [f"Retrieval heads of SmolLM2-135M-Instruct: multi-key NIAH at {args.length} tokens, {args.samples} cases "
             f"(seed `multikey-{args.length}-heads`; {len(skipped)} left out, their needle split by another), {steps} answer steps (`python {' '.join(sys.argv)}`).", "",
             "| rank | layer | KV head | retrieval score (argmax on the copied digit) | attention on it |",
             "|---|---|---|---|---|"]
    lines += [f"| {r + 1} | {e['layer']} | {e['kv_head']} | {e['retrieval_score']:.3f} | {e['needle_attention']:.3f} |"
              for r, e in enumerate(ranking[:30])]
    print("\n".join(lines))
    out = Path(args.out)
    out.write_text(json.dumps({"length": args.length, "samples": args.samples, "answer_steps": steps, "skipped_cases": skipped,
                               "ranking": ranking, "query_head_hits": q_hit.tolist(),
                               "query_head_attention": q_mass.tolist(), "seconds": time.time() - t0,
                               "torch": torch.__version__, "command": " ".join(sys.argv)}, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
