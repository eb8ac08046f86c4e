"""Where `torch.compile` (Dynamo) breaks the graph of one decode step, per cache and attention.

`GAACStaticCache` (and its plain twin, `PlainStaticCache`) are the caches built to be one graph; `GAACCache` is the
eager cache, listed for what breaks it.

For a small Llama (8 query / 2 KV heads, head_dim 128), prefill 40 tokens, then run `torch._dynamo.explain` on one
decode step that only appends to the tail and on one that completes a 16-token block (finalization). Reports the
number of graphs, graph breaks and the distinct break reasons with the line that caused them; writes JSON.

    python benchmarks/compile_breaks.py --out benchmarks/results/compile_breaks_cpu.json
"""

import argparse
import collections
import json
import sys
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaac_hf  # noqa: E402,F401  (registers "gaac")
from gaac_hf import GAACCache  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache  # noqa: E402
from gaac_hf.testing import gqa_model_and_calibration  # noqa: E402


def explain_step(model, cache, token):
    kw = cache_kwarg(model)
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(input_ids=torch.tensor([[token]], device=model.device), use_cache=True,
                                      **{kw: cache})
    reasons = collections.Counter()
    for r in ex.break_reasons:
        where = r.user_stack[-1] if r.user_stack else None
        at = f"{Path(where.filename).name}:{where.lineno} ({where.name})" if where else "?"
        reasons[(str(r.reason).split("Explanation:")[0].strip()[:90], at)] += 1
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count,
            "reasons": [{"reason": k[0], "at": k[1], "count": n} for k, n in reasons.most_common()]}


@torch.no_grad()
def main():
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="benchmarks/results/compile_breaks_cpu.json")
    args = p.parse_args()
    model, calibration = gqa_model_and_calibration(args.device)
    kw = cache_kwarg(model)
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(0)).to(args.device)
    setups = {"DynamicCache + sdpa": ("sdpa", lambda: DynamicCache(config=model.config)),
              "GAACCache + sdpa": ("sdpa", lambda: GAACCache(model.config, calibration)),
              "GAACCache + gaac": ("gaac", lambda: GAACCache(model.config, calibration)),
              "StaticCache + sdpa": ("sdpa", lambda: StaticCache(config=model.config, max_cache_len=64)),
              "GAACStaticCache + gaac": ("gaac", lambda: GAACStaticCache(model.config, 64, calibration)),
              "PlainStaticCache + gaac (twin)": ("gaac", lambda: PlainStaticCache(model.config, 64))}
    out = {"device": args.device, "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "setups": {}}
    for name, (attn, make) in setups.items():
        model.set_attn_implementation(attn)
        cache = make()
        model(input_ids=ids, use_cache=True, **{kw: cache})  # 40 tokens: 2 blocks + 8 in the tail
        res = {"append_step": explain_step(model, cache, 5)}
        for t in range(6):  # tokens 42..47: the tail fills to 15
            model(input_ids=torch.tensor([[t + 6]], device=args.device), use_cache=True, **{kw: cache})
        res["finalizing_step"] = explain_step(model, cache, 12)  # token 48 completes block 3
        out["setups"][name] = res
        print(f"{name}: append step {res['append_step']['graphs']} graphs / {res['append_step']['breaks']} breaks; "
              f"finalizing step {res['finalizing_step']['graphs']} / {res['finalizing_step']['breaks']}", flush=True)
        for r in res["finalizing_step"]["reasons"]:
            print(f"    {r['count']:>3} x {r['reason']}  at {r['at']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
