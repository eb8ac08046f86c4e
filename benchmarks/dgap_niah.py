"""Needle-in-a-haystack retrieval in the style of RULER with low-bit KV caches, with and without DGAP.

Haystack: the Debian Reference (held-out text). Tasks: `single` (one key-value needle, asked back), `multikey` (four
needles with different keys, one asked), `multivalue` (one key with three values, all asked). Each answer is a
7-digit number; a case scores the share of asked values that appear in the greedy answer. Needles sit at seeded
depths of the context. SmolLM2-135M-Instruct in float32 on the CPU (the cache quantizes the same KV either way).

    python benchmarks/dgap_niah.py --lengths 1024 2048 --samples 6 --out benchmarks/results/dgap_niah.json
"""

import argparse
import json
import random
import time

import torch
from transformers import DynamicCache

from dgap_hf import DGAPLogitsProcessor, LowBitCache
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files
from gaac_hf.default_model import load_default_model
from gaac_hf.model_layers import cache_kwarg

KEYS = ["amber-falcon", "silver-otter", "quiet-harbor", "copper-lantern", "velvet-comet", "iron-meadow"]
CACHES = [("BF16", None, {}), ("K8V8", "K8V8", {}), ("K4V4", "K4V4", {}), ("K2V2", "K2V2", {}),
          ("K2V2 + DGAP", "K2V2", {"dgap": True}), ("K2V2 sink 4", "K2V2", {"sink_length": 4}),
          ("K1V1", "K1V1", {}), ("K1V1 sink 4", "K1V1", {"sink_length": 4})]


def make_case(task, haystack_ids, tok, length, rng):
    n_needles = {"single": 1, "multikey": 4, "multivalue": 3}[task]
    keys = rng.sample(KEYS, 1 if task == "multivalue" else n_needles)
    values = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(n_needles)]
    needles = [f" The special magic number for {keys[0] if task == 'multivalue' else keys[i]} is {values[i]}. "
               for i in range(n_needles)]
    asked = keys[0] if task != "multikey" else keys[rng.randrange(n_needles)]
    want = values if task == "multivalue" else [values[keys.index(asked)]]
    what = "all the special magic numbers" if task == "multivalue" else "the special magic number"
    question = f"\n\nQuestion: What is {what} for {asked}? Answer: The special magic number for {asked} is"
    q_ids = tok(question, add_special_tokens=False).input_ids
    n_ids = [tok(n, add_special_tokens=False).input_ids for n in needles]
    room = length - len(q_ids) - sum(len(x) for x in n_ids)
    start = rng.randrange(0, len(haystack_ids) - room)
    hay = list(haystack_ids[start:start + room])
    for x in sorted(n_ids, key=lambda _: rng.random()):
        at = rng.randrange(0, len(hay))
        hay[at:at] = x
    return torch.tensor([hay + q_ids]), want


@torch.no_grad()
def score_case(model, tok, ids, want, **generate_kwargs) -> float:
    """Greedy answer to one haystack: the share of the wanted values it contains."""
    ids = ids.to(model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12 * len(want), do_sample=False,
                         pad_token_id=tok.eos_token_id, **generate_kwargs)
    text = tok.decode(out[0, ids.shape[1]:])
    return sum(v in text for v in want) / len(want)


def score_table(scores: dict) -> str:
    """`{cache: {task@length: share}}` as a markdown table of percentages."""
    cols = list(next(iter(scores.values())))
    table = ["| cache | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    table += [f"| {name} | " + " | ".join(f"{100 * s[c]:.0f}%" for c in cols) + " |" for name, s in scores.items()]
    return "\n".join(table)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--tasks", default="single,multikey,multivalue")
    ap.add_argument("--artifact", default="hub_configs/dgap-SmolLM2-135M-Instruct")
    ap.add_argument("--out", default="benchmarks/results/dgap_niah.json")
    args = ap.parse_args()
    model, tok = load_default_model()
    model.float()
    kw = cache_kwarg(model)
    hay = tok(read_text_files(DEBIAN_REFERENCE).text, add_special_tokens=False).input_ids
    dgap = DGAPLogitsProcessor.from_pretrained(args.artifact, "K2V2", model_config=model.config)
    scores = {name: {} for name, _, _ in CACHES}
    t0 = time.time()
    for length in args.lengths:
        for task in args.tasks.split(","):
            rng = random.Random(f"{task}-{length}")
            cases = [make_case(task, hay, tok, length, rng) for _ in range(args.samples)]
            for name, precision, opts in CACHES:
                got = []
                for ids, want in cases:
                    cache = (DynamicCache(config=model.config) if precision is None else
                             LowBitCache(model.config, precision, sink_length=opts.get("sink_length", 0)))
                    procs = [dgap] if opts.get("dgap") else []
                    got.append(score_case(model, tok, ids, want, logits_processor=procs, **{kw: cache}))
                scores[name][f"{task}@{length}"] = sum(got) / len(got)
                print(f"{name:14s} {task:10s} {length:5d}: {scores[name][f'{task}@{length}']:.2f}", flush=True)
    table = score_table(scores)
    print(table)
    with open(args.out, "w") as f:
        json.dump({"model": "HuggingFaceTB/SmolLM2-135M-Instruct (float32, CPU)", "haystack": DEBIAN_REFERENCE[0],
                   "samples": args.samples, "scores": scores, "seconds": time.time() - t0,
                   "torch": torch.__version__}, f, indent=1)
    with open(args.out.replace(".json", ".md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
