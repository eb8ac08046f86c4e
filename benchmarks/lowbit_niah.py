"""Needle-in-a-haystack with each precision's default `LowBitCache` and transformers' `QuantizedCache`.

The cases of `benchmarks/dgap_niah.py` (RULER-style needles in the Debian Reference, seeded); greedy answers, a case
scores the share of asked values in the answer. SmolLM2-135M-Instruct in float32 (CPU, or `--device cuda`); the
prompt is prefilled in one step (the prefill attends at full precision; the answer is decoded from the quantized
cache). The 8K cells run on the H200: `benchmarks/device/lowbit_niah_h200.sh`.

    python benchmarks/lowbit_niah.py --lengths 2048 --tasks multikey --samples 6 \\
        --out benchmarks/results/lowbit_niah.json
    python benchmarks/lowbit_niah.py --device cuda --lengths 8000 --tasks single,multikey,multivalue \\
        --text .bench/text/eval/debian-reference.en.txt.gz --out $OUT/lowbit_niah_8k.json
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
from dgap_niah import make_case, score_case, score_table  # noqa: E402
from lowbit_sensitivity import k2v2_session9, retrieval_configs  # noqa: E402

from dgap_hf import LowBitCache, LowBitConfig  # noqa: E402
from dgap_hf.baselines import quantized_cache  # noqa: E402
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files  # noqa: E402
from gaac_hf.default_model import load_default_model  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402

CACHES = {
    "DynamicCache": lambda cfg: DynamicCache(config=cfg),
    "K4V4 default": lambda cfg: LowBitCache(cfg, "K4V4"),
    "K2V2 default": lambda cfg: LowBitCache(cfg, "K2V2"),
    "K2V2 default of session 9 (27 key heads)": lambda cfg: LowBitCache(cfg, k2v2_session9(cfg)),
    "K1V1 default": lambda cfg: LowBitCache(cfg, "K1V1"),
    "K2V2 kivi32 (former default)": lambda cfg: LowBitCache(cfg, LowBitConfig("K2V2")),
    "QuantizedCache quanto 2 keys per channel": lambda cfg: quantized_cache(cfg, "quanto", 2, axis_key=-1),
    # diagnostics (over the 2.5-bit budget): the K2V2 default with every key head at 4 bits, or with 4-bit values
    "K2V2 default, 4-bit keys (diagnostic)": lambda cfg: LowBitCache(cfg, LowBitConfig.default(
        "K2V2", model_config=cfg, layer_key_bits=tuple((layer, 4) for layer in range(cfg.num_hidden_layers)))),
    "K2V2 default, 4-bit values (diagnostic)": lambda cfg: LowBitCache(cfg, LowBitConfig.default("K2V4",
                                                                                                 model_config=cfg)),
    # the K2V2 default's 4-bit budget spent on the retrieval heads (ranked on other cases than these)
    "K2V2 top-8 retrieval heads K4V4 + 11 key heads": lambda cfg: LowBitCache(cfg, _retrieval(cfg, 8)),
    "K2V2 top-8 retrieval heads K4V4 + 11 key heads + pre-RoPE keys": lambda cfg: LowBitCache(
        cfg, _retrieval(cfg, 8).replace(pre_rope_keys=True)),
    "K2V2 default + pre-RoPE keys": lambda cfg: LowBitCache(cfg, "K2V2", pre_rope_keys=True),
}
RANKING = Path(__file__).resolve().parent / "results" / "lowbit_retrieval_heads_2k.json"


def _retrieval(cfg, n):
    ranking = json.loads(RANKING.read_text())["ranking"]
    label = next(k for k in retrieval_configs(cfg, ranking, (n,)) if k.startswith(f"4-bit K and V in top {n} "))
    return retrieval_configs(cfg, ranking, (n,))[label][0]


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048])
    ap.add_argument("--samples", type=int, default=6)
    ap.add_argument("--first", type=int, default=0,
                    help="score cases first .. first + samples - 1 of each cell's seeded sequence (the earlier ones "
                         "are drawn and left out), so a run can extend an earlier one with new cases")
    ap.add_argument("--tasks", default="multikey")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--text", nargs="+", default=list(DEBIAN_REFERENCE), help="haystack text files (.gz allowed)")
    ap.add_argument("--caches", nargs="+", choices=list(CACHES), default=list(CACHES))
    ap.add_argument("--out", default="benchmarks/results/lowbit_niah.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model(device=args.device)
    model.float()
    kw = cache_kwarg(model)
    hay = tok(read_text_files(args.text).text, add_special_tokens=False).input_ids
    caches = {name: CACHES[name] for name in args.caches}
    scores = {name: {} for name in caches}
    errors, per_case = {}, {}
    t0 = time.time()
    for length in args.lengths:
        for task in args.tasks.split(","):
            rng = random.Random(f"{task}-{length}")
            cases = [make_case(task, hay, tok, length, rng) for _ in range(args.first + args.samples)][args.first:]
            for name, make in caches.items():
                got = []
                try:
                    for ids, want in cases:
                        got.append(score_case(model, tok, ids, want, **{kw: make(model.config)}))
                except (ImportError, RuntimeError, ValueError) as e:  # e.g. quanto absent: the others still run
                    errors[name] = f"{type(e).__name__}: {e}"[:300]
                    print(f"{name:40s} FAILED: {errors[name]}", flush=True)
                    continue
                scores[name][f"{task}@{length}"] = sum(got) / len(got)
                per_case.setdefault(name, {})[f"{task}@{length}"] = [round(float(x), 4) for x in got]
                print(f"{name:40s} {task:10s} {length:5d}: {scores[name][f'{task}@{length}']:.2f}", flush=True)
    scores = {name: s for name, s in scores.items() if s}
    table = score_table(scores)
    print(table)
    device = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "CPU"
    Path(args.out).write_text(json.dumps({"model": f"HuggingFaceTB/SmolLM2-135M-Instruct (float32, {device})",
                                          "haystack": args.text[0], "samples": args.samples, "first": args.first,
                                          "scores": scores, "per_case": per_case,
                                          "errors": errors, "seconds": time.time() - t0,
                                          "torch": torch.__version__, "command": " ".join(sys.argv)}, indent=1) + "\n")
    Path(args.out).with_suffix(".md").write_text(
        f"NIAH ({args.tasks}), {args.samples} seeded cases per cell (from case {args.first}), {device} "
        f"(`python {' '.join(sys.argv)}`).\n\n"
        + table + "\n")


if __name__ == "__main__":
    main()
