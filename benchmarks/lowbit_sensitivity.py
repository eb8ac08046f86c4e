"""Where 2-bit KV loses quality: short teacher-forced probes on the harder held-out 4K windows.

Per window, the first `--tokens - --score-tokens` tokens are run once through a full-precision `DynamicCache`; their
per-layer keys/values are then loaded into each probed cache (a `LowBitCache` quantizes them exactly as it would have
had they arrived chunk by chunk: same groups, same sinks), and only the last `--score-tokens` tokens are
teacher-forced in chunks of `--chunk` and scored against the full-precision continuation (PPL ratio, KL, top-1).
The prefix's own KV is the full-precision one (no error carried through the prefix's hidden states), so the gaps
are a little below those of the full protocol of `benchmarks/lowbit_quality.py`; they rank options and locate
damage (K vs V, layers, heads) at a small fraction of its cost.

A probe is a base `LowBitConfig` (the session-1 K2V2 default: groups of 128 tokens / 64 channels, 4 sinks,
Hadamard, Lloyd-Max levels, BF16 statistics) plus per-layer replacements: `"fp"` (the stock full-precision layer) or
another config. Probes:

* `kv`: K only at 2 bits (values 8-bit), V only at 2 bits, both.
* `layers`: for each layer alone, its keys at 2 bits (every other layer full precision); `--probe layers-v` values.
* `heads`: for each KV head of `--layers` alone, its keys at 2 bits (the other heads of that layer at 8 bits, every
  other layer full precision).
* `niah-layers` / `niah-heads` (with `--task niah`): K4V2 everywhere but one layer's (one head's) keys at 2 bits.
* `niah-retrieval` (with `--task niah --ranking`): the K2V2 default with 4-bit values (and keys) in the top
  retrieval heads of a `benchmarks/lowbit_retrieval_heads.py` ranking, within the default's budget (as many of
  the measured 4-bit key heads dropped, least sensitive first) and, as diagnostics, on top of it.
* `niah-upgrade-layers` (with `--task niah`): the K2V2 default with one more layer's keys all at 4 bits (what
  each layer's keys are worth to retrieval, over the default's budget).
* `niah-key-axis` (with `--task niah`): the K2V2 default with per-token keys (`key_axis="token"`) instead of
  per-channel ones, alone and with the retrieval-head tables of `niah-retrieval`.
* `niah-key-groups` (with `--task niah`): the K2V2 default with smaller key groups or FP8 key outliers, on top of
  its budget and within it (the least sensitive measured 4-bit key heads dropped).
* `niah-rotation` (with `--task niah`): the K2V2 default with its keys unrotated, or a seeded random rotation.
* `niah-pre-rope` (with `--task niah`): the K2V2 default with pre-RoPE keys (`pre_rope_keys=True`), with and
  without the Hadamard rotation of the keys (and with `--ranking`, the retrieval-head table of `niah-retrieval`).
* `niah-combined` (with `--task niah --ranking`): the top 8 retrieval heads at K4V4 with FP8 key outliers, in budget.
* `options`: named configs (`options()` below): the statistic formats, outliers, per-layer and per-head 4-bit
  keys, and the chosen default.

    python benchmarks/lowbit_sensitivity.py --probe kv layers --windows 1 --score-tokens 512 \\
        --out benchmarks/results/lowbit_sensitivity.json
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from dgap_hf import LowBitCache, LowBitConfig
from dgap_hf.cache import LowBitLayer
from dgap_hf.lowbit_config import MEASURED_KEY_HEADS, model_signature
from dgap_hf.rope_frame import rope_inv_freq
from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files, token_prompts
from gaac_hf.default_model import load_default_model
from gaac_hf.model_layers import cache_kwarg


def probe_cache(model, base: LowBitConfig, layers: dict | None = None):
    """`LowBitCache(base)` with layer `i` replaced per `layers[i]`: `"fp"` -> a full-precision `DynamicLayer`,
    a `LowBitConfig` -> a `LowBitLayer` of that config."""
    cache = LowBitCache(model.config, base)
    for i, what in (layers or {}).items():
        freq = rope_inv_freq(model.config) if what != "fp" and what.pre_rope_keys else None
        cache.layers[i] = DynamicLayer() if what == "fp" else LowBitLayer(config=what, layer_idx=i,
                                                                          rope_inv_freq=freq)
    return cache


@torch.no_grad()
def prefix_kv(model, ids):
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    return [(layer.keys, layer.values) for layer in cache.layers]


@torch.no_grad()
def continue_scored(model, cache, ids, start, chunk):
    """Log-probabilities of tokens `start+1 ..` of `ids` `[1, T]`, teacher-forced from `start` in chunks."""
    out = []
    for s in range(start, ids.shape[1] - 1, chunk):
        piece = ids[:, s:s + chunk]
        n = min(piece.shape[1], ids.shape[1] - 1 - s)
        logits = model(input_ids=piece, use_cache=True, **{cache_kwarg(model): cache}).logits[0, :n].float()
        out.append(torch.log_softmax(logits, -1))
    return torch.cat(out)


@torch.no_grad()
def answer_steps(model, cache, answer):
    """Teacher-force the answer tokens one decode step at a time (as greedy decoding would feed them): per token
    its log-probability and whether it is the argmax. `answer` `[1, n + 1]` starts with the prompt's last token."""
    lps, hits = [], []
    for t in range(answer.shape[1] - 1):
        logits = model(input_ids=answer[:, t:t + 1], use_cache=True, **{cache_kwarg(model): cache}).logits[0, -1]
        lp = torch.log_softmax(logits.float(), -1)
        lps.append(float(lp[answer[0, t + 1]]))
        hits.append(bool(lp.argmax() == answer[0, t + 1]))
    return lps, hits


def load_prefix(cache, kv):
    for i, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), i)
    return cache


def lowbit_bits(cache) -> float | None:
    st = cache.stats()
    if any(not isinstance(layer, LowBitLayer) for layer in cache.layers):
        return None  # full-precision layers in the probe: no honest bit count
    return st["bits_per_element"]


F8 = "float8_e4m3fn"
# SmolLM2's measured 4-bit key heads (the K2V2 default's table), most sensitive first (`--probe heads`)
KEY_HEAD_ORDER = ((18, 2), (7, 2), (8, 0), (4, 0), (7, 1), (3, 2), (3, 1), (8, 2), (17, 1), (23, 0), (6, 2), (9, 0),
                  (6, 1), (20, 2), (5, 2), (5, 1), (23, 2), (5, 0), (9, 2), (24, 0), (24, 1), (24, 2), (10, 0),
                  (10, 1), (10, 2), (28, 2), (28, 1))


def k2v2_session9(model_config) -> LowBitConfig:
    """The K2V2 default of sessions 4-10 (4-bit keys in the 27 measured key heads, post-RoPE keys), which the probes
    of those sessions start from; session 11's default spends the budget on the retrieval heads instead."""
    return LowBitConfig.default("K2V2", model_config=model_config, layer_value_bits=(), pre_rope_keys=False,
                                layer_key_bits=MEASURED_KEY_HEADS[model_signature(model_config)][2])


def options(base: LowBitConfig, model_config) -> dict:
    """The options compared on top of the session-1 K2V2 default (`base`): statistic formats, key outliers, 4-bit
    keys in the most sensitive layers / heads (the orders measured by the `layers` / `heads` probes)."""
    heads = k2v2_session9(model_config).layer_key_bits
    order = list(KEY_HEAD_ORDER)
    h = lambda n: tuple((layer, head, 4) for layer, head in order[:n])  # noqa: E731
    lay = lambda *ls: tuple((layer, 4) for layer in ls)  # noqa: E731
    s = base.replace(key_scale_dtype=F8, key_zero_dtype=F8, value_scale_dtype=F8, value_zero_dtype="none",
                     outlier_dtype=F8)
    return {
        "session-1 default": (base, {}),
        "V stats FP8": (base.replace(value_scale_dtype=F8, value_zero_dtype=F8), {}),
        "V symmetric (no zero)": (base.replace(value_zero_dtype="none"), {}),
        "K stats FP8": (base.replace(key_scale_dtype=F8, key_zero_dtype=F8), {}),
        "S = K stats FP8 + V scale FP8, symmetric": (s, {}),
        "1 key outlier/group (BF16)": (base.replace(key_outliers=1), {}),
        "S + 2 key outliers (FP8)": (s.replace(key_outliers=2), {}),
        "S + 4-bit keys in layers 7, 18": (s.replace(layer_key_bits=lay(7, 18)), {}),
        "S + 4-bit keys in 9 layers": (s.replace(layer_key_bits=lay(18, 7, 8, 3, 17, 19, 4, 5, 23)), {}),
        "S + 2 outliers + 4-bit keys in 16 heads": (s.replace(key_outliers=2, layer_key_bits=h(16)), {}),
        "S + 1 outlier + 4-bit keys in 22 heads": (s.replace(key_outliers=1, layer_key_bits=h(22)), {}),
        "S + 4-bit keys in 27 heads (new default)": (s.replace(layer_key_bits=heads), {}),
    }


def retrieval_configs(model_config, ranking: list, tops=(2, 4, 8)) -> dict:
    """K2V2 default variants that spend its 4-bit budget (one upgrade = 2 more bits on the keys or the values of one
    KV head) on the top retrieval heads of `ranking` ([{"layer", "kv_head"}, ...], best first)."""
    default = k2v2_session9(model_config)
    key_heads = [e[:2] for e in default.layer_key_bits]  # sorted; the measured order is in options()
    order = list(KEY_HEAD_ORDER)
    assert sorted(order) == key_heads, "the measured key-head order no longer matches the default's table"
    budget = len(order)
    out = {"K2V2 default": (default, {})}
    for n in tops:
        top = [(e["layer"], e["kv_head"]) for e in ranking[:n]]
        v4 = tuple((layer, head, 4) for layer, head in top)
        out[f"default + 4-bit values in top {n} retrieval heads (over budget)"] = (
            default.replace(layer_value_bits=v4), {})
        keys = list(top)
        for lh in order:
            if len(keys) + n >= budget:
                break
            if lh not in keys:
                keys.append(lh)
        out[f"4-bit K and V in top {n} retrieval heads + {len(keys) - n} measured key heads (budget)"] = (
            default.replace(layer_value_bits=v4, layer_key_bits=tuple((la, h, 4) for la, h in keys)), {})
    out["K2V4 default: 4-bit values everywhere (diagnostic, over budget)"] = (
        LowBitConfig.default("K2V4", model_config=model_config), {})
    return out


def probes(names, n_layers, base, model_config=None, layers_arg=(), n_heads=0, ranking=None):
    out = {}
    if "niah-upgrade-layers" in names:
        default = k2v2_session9(model_config)
        for j in range(n_layers):
            table = tuple(e for e in default.layer_key_bits if e[0] != j) + tuple((j, h, 4) for h in range(n_heads))
            out[f"default + layer {j} keys 4-bit"] = (default.replace(layer_key_bits=table), {})
    if "niah-key-axis" in names:
        default = k2v2_session9(model_config)
        tok = default.replace(key_axis="token", key_zero_dtype="none")
        out["K2V2 default"] = (default, {})
        out["per-token keys, symmetric (same bits)"] = (tok, {})
        out["per-token keys with FP8 zero (over budget)"] = (default.replace(key_axis="token"), {})
        if ranking is not None:
            for label, (cfg, layers) in retrieval_configs(model_config, ranking, tops=(2, 8)).items():
                if "(budget)" in label:
                    out[f"per-token keys, symmetric; {label}"] = (
                        cfg.replace(key_axis="token", key_zero_dtype="none"), layers)
    if "niah-key-groups" in names:
        default = k2v2_session9(model_config)
        order = list(KEY_HEAD_ORDER)
        heads = lambda n: tuple(sorted((la, h, 4) for la, h in order[:n]))  # noqa: E731
        for label, change, n in (("key groups of 64 tokens", dict(key_group_size=64), 21),
                                 ("1 FP8 key outlier per group", dict(key_outliers=1, outlier_dtype=F8), 21),
                                 ("2 FP8 key outliers per group", dict(key_outliers=2, outlier_dtype=F8), 16)):
            out[f"{label} (over budget)"] = (default.replace(**change), {})
            out[f"{label}, {n} key heads (budget)"] = (default.replace(layer_key_bits=heads(n), **change), {})
    if "niah-rotation" in names:
        default = k2v2_session9(model_config)
        out["keys not rotated (rotate='v')"] = (default.replace(rotate="v"), {})
        out["seeded random rotation"] = (default.replace(rotation="random"), {})
        out["no rotation"] = (default.replace(rotation="none"), {})
    if "niah-pre-rope" in names:
        default = k2v2_session9(model_config)
        out["K2V2 default"] = (default, {})
        out["pre-RoPE keys, Hadamard"] = (default.replace(pre_rope_keys=True), {})
        out["pre-RoPE keys, not rotated"] = (default.replace(pre_rope_keys=True, rotate="v"), {})
        out["pre-RoPE keys, seeded random rotation"] = (default.replace(pre_rope_keys=True, rotation="random"), {})
        if ranking is not None:
            for label, (cfg, layers) in retrieval_configs(model_config, ranking, tops=(8,)).items():
                if "(budget)" in label:
                    out[f"pre-RoPE keys; {label}"] = (cfg.replace(pre_rope_keys=True), layers)
    if "niah-combined" in names:
        if ranking is None:
            raise SystemExit("--probe niah-combined needs --ranking (a lowbit_retrieval_heads.py JSON)")
        top = [(e["layer"], e["kv_head"]) for e in ranking[:8]]
        default = k2v2_session9(model_config)
        order = list(KEY_HEAD_ORDER)
        v4 = tuple((la, h, 4) for la, h in top)
        for outliers, extra in ((2, 0), (1, 5)):
            keys = top + [lh for lh in order if lh not in top][:extra]
            out[f"4-bit K and V in top 8 retrieval heads + {extra} measured key heads + {outliers} FP8 key outliers "
                f"(budget)"] = (default.replace(layer_value_bits=v4, layer_key_bits=tuple((la, h, 4) for la, h in keys),
                                                key_outliers=outliers, outlier_dtype=F8), {})
    if "niah-retrieval" in names:
        if ranking is None:
            raise SystemExit("--probe niah-retrieval needs --ranking (a lowbit_retrieval_heads.py JSON)")
        out.update(retrieval_configs(model_config, ranking))
    k_only, v_only = base.replace(precision="K2V8"), base.replace(precision="K8V2")
    if "kv" in names:
        out["K2V2 (default)"] = (base, {})
        out["K2V8 (keys only at 2 bits)"] = (k_only, {})
        out["K8V2 (values only at 2 bits)"] = (v_only, {})
        out["all fp (DynamicLayer)"] = (base, {i: "fp" for i in range(n_layers)})
    if "layers" in names:
        for j in range(n_layers):
            out[f"layer {j} keys 2-bit only"] = (k_only, {i: "fp" for i in range(n_layers) if i != j})
    if "layers-v" in names:
        for j in range(n_layers):
            out[f"layer {j} values 2-bit only"] = (v_only, {i: "fp" for i in range(n_layers) if i != j})
    if "heads" in names:
        for j in layers_arg:
            for h in range(n_heads):
                one = base.replace(precision="K8V8", layer_key_bits=((j, h, 2),))
                out[f"layer {j} head {h} keys 2-bit only"] = (one, {i: "fp" for i in range(n_layers) if i != j})
    k4 = base.replace(precision="K4V2")
    if "niah-layers" in names:
        for j in range(n_layers):
            out[f"K4V2 but layer {j} keys 2-bit"] = (k4, {j: base})
    if "niah-heads" in names:
        for j in layers_arg:
            for h in range(n_heads):
                out[f"K4V2 but layer {j} head {h} keys 2-bit"] = (k4.replace(layer_key_bits=((j, h, 2),)), {})
    if "options" in names:
        out.update(options(base, model_config))
    return out


def niah_cases(model, tok, length, samples, seed=None):
    """Multi-key NIAH cases of `benchmarks/dgap_niah.py` (same seeds as `lowbit_niah.py`): per case the prompt's
    full-precision KV (the prefill attends at full precision, as in `generate`) and the answer's tokens; the first
    answer token comes from the full-precision prefill, so only the later ones are probed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dgap_niah import make_case

    hay = tok(read_text_files(DEBIAN_REFERENCE).text, add_special_tokens=False).input_ids
    rng = random.Random(seed or f"multikey-{length}")
    out = []
    for _ in range(samples):
        ids, want = make_case("multikey", hay, tok, length, rng)
        answer = torch.tensor([tok(" " + want[0], add_special_tokens=False).input_ids])
        out.append((prefix_kv(model, ids), answer))
    return out


def run_niah(model, cases, cfg, layers):
    """Per case: whether every probed answer token is the argmax (greedy decoding would answer right), and the
    answer's log-probability."""
    passed, logp, bits = 0, 0.0, []
    for kv, answer in cases:
        cache = load_prefix(probe_cache(model, cfg, layers), kv)
        lps, hits = answer_steps(model, cache, answer)
        passed += all(hits)
        logp += sum(lps)
        bits.append(lowbit_bits(cache))
    return {"pass_rate": passed / len(cases), "answer_logp": logp / len(cases),
            "bits_per_element": None if None in bits else sum(bits) / len(bits)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", choices=("ppl", "niah"), default="ppl",
                    help="ppl: the last tokens of the 4K windows; niah: multi-key NIAH answers at --tokens")
    ap.add_argument("--samples", type=int, default=6, help="NIAH cases")
    ap.add_argument("--probe", nargs="+", default=["kv"],
                    choices=("kv", "layers", "layers-v", "heads", "niah-layers", "niah-heads", "niah-retrieval",
                             "niah-upgrade-layers", "niah-key-axis", "niah-key-groups", "niah-rotation",
                             "niah-pre-rope", "niah-combined", "options"))
    ap.add_argument("--ranking", help="retrieval-head ranking JSON (benchmarks/lowbit_retrieval_heads.py)")
    ap.add_argument("--case-seed", help="NIAH case seed (default: multikey-<tokens>, the cases lowbit_niah.py "
                                        "scores; choose heads on other cases, e.g. multikey-<tokens>-heads)")
    ap.add_argument("--layers", type=int, nargs="*", default=[], help="layers of the heads / niah-heads probes")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--windows", type=int, default=1)
    ap.add_argument("--first-window", type=int, default=1)
    ap.add_argument("--score-tokens", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/lowbit_sensitivity.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tok = load_default_model()
    model = model.float()
    n_layers = model.config.num_hidden_layers
    base = LowBitConfig("K2V2", key_group_size=128, value_group_size=64, residual_length=0, sink_length=4,
                        rotation="hadamard", levels="normal")  # the session-1 K2V2 default
    ranking = json.loads(Path(args.ranking).read_text())["ranking"] if args.ranking else None
    suite = probes(args.probe, n_layers, base, model.config, args.layers, model.config.num_key_value_heads, ranking)
    if args.only:
        suite = {k: v for k, v in suite.items() if k in args.only}
    if args.task == "niah":
        return main_niah(args, model, tok, suite)
    text = read_text_files(DEBIAN_REFERENCE)
    windows = token_prompts(tok, text.text, args.tokens, args.first_window + args.windows)[args.first_window:]
    start = args.tokens - args.score_tokens
    if start % 128 or start <= 0:
        raise SystemExit("--tokens - --score-tokens must be a positive multiple of 128 (whole key groups)")
    protocol = {"tokens": args.tokens, "windows": len(windows), "first_window": args.first_window,
                "score_tokens": args.score_tokens, "chunk": args.chunk}
    out_path = Path(args.out)
    saved = json.loads(out_path.read_text()) if out_path.is_file() else {}
    rows = saved.get("rows", {}) if saved.get("protocol") == protocol else {}
    data = []
    for ids in windows:
        ids = ids[None]
        kv = prefix_kv(model, ids[:, :start])
        ref = continue_scored(model, load_prefix(DynamicCache(config=model.config), kv), ids, start, args.chunk)
        data.append((ids, kv, ref))
    ref_nll = sum(float(-r.gather(-1, ids[0, start + 1:, None]).sum()) for ids, _, r in data)
    n = sum(r.shape[0] for _, _, r in data)
    ref_ppl = float(torch.tensor(ref_nll / n).exp())
    print(f"reference PPL on the scored tokens: {ref_ppl:.3f}", flush=True)
    for label, (cfg, layers) in suite.items():
        if label in rows:
            continue
        t0 = time.time()
        nll = kl = 0.0
        agree = 0
        bits = []
        for ids, kv, ref in data:
            cache = load_prefix(probe_cache(model, cfg, layers), kv)
            lp = continue_scored(model, cache, ids, start, args.chunk)
            nll += float(-lp.gather(-1, ids[0, start + 1:, None]).sum())
            kl += float((ref.exp() * (ref - lp)).sum())
            agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            bits.append(lowbit_bits(cache))
        ppl = float(torch.tensor(nll / n).exp())
        rows[label] = {"ppl": ppl, "ppl_vs_ref": ppl / ref_ppl - 1, "kl": kl / n, "top1_agreement": agree / n,
                       "bits_per_element": None if None in bits else sum(bits) / len(bits),
                       "base": cfg.to_spec(), "layers": {str(i): (w if w == "fp" else w.to_spec())
                                                         for i, w in layers.items()},
                       "seconds": time.time() - t0}
        r = rows[label]
        print(f"{label:40s} PPL {ppl:.3f} ({100 * r['ppl_vs_ref']:+.2f}%) KL {r['kl']:.4f} top-1 "
              f"{100 * r['top1_agreement']:.1f}% bits {r['bits_per_element']} [{r['seconds']:.0f}s]", flush=True)
        out_path.write_text(json.dumps({"protocol": protocol, "reference_ppl": ref_ppl, "rows": rows,
                                        "command": " ".join(sys.argv)}, indent=1) + "\n")
    lines = [f"Scored: the last {args.score_tokens} tokens of {len(windows)} window(s) of {args.tokens} "
             f"(from window {args.first_window}), prefix KV from a full-precision pass; reference PPL {ref_ppl:.3f}. "
             f"`python {' '.join(sys.argv)}`", "", "| probe | bits/elt | PPL vs ref | KL | top-1 |", "|---|---|---|---|---|"]
    for label, r in rows.items():
        b = "-" if r["bits_per_element"] is None else f"{r['bits_per_element']:.3f}"
        lines.append(f"| {label} | {b} | {100 * r['ppl_vs_ref']:+.2f}% | {r['kl']:.4f} | "
                     f"{100 * r['top1_agreement']:.1f}% |")
    out_path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main_niah(args, model, tok, suite):
    protocol = {"task": "niah multikey", "tokens": args.tokens, "samples": args.samples,
                **({"case_seed": args.case_seed} if args.case_seed else {})}
    out_path = Path(args.out)
    saved = json.loads(out_path.read_text()) if out_path.is_file() else {}
    rows = saved.get("rows", {}) if saved.get("protocol") == protocol else {}
    cases = niah_cases(model, tok, args.tokens, args.samples, args.case_seed)
    for label, (cfg, layers) in suite.items():
        if label in rows:
            continue
        t0 = time.time()
        r = rows[label] = {**run_niah(model, cases, cfg, layers), "base": cfg.to_spec(),
                           "layers": {str(i): (w if w == "fp" else w.to_spec()) for i, w in layers.items()},
                           "seconds": time.time() - t0}
        print(f"{label:40s} pass {100 * r['pass_rate']:.0f}% answer log-p {r['answer_logp']:.2f} "
              f"bits {r['bits_per_element']} [{r['seconds']:.0f}s]", flush=True)
        out_path.write_text(json.dumps({"protocol": protocol, "rows": rows, "command": " ".join(sys.argv)},
                                       indent=1) + "\n")
    lines = [f"Multi-key NIAH at {args.tokens} tokens, {args.samples} cases (seed "
             f"`{args.case_seed or f'multikey-{args.tokens}'}`): answer tokens after the first, "
             f"teacher-forced one decode step at a time from the full-precision prefill's KV. "
             f"`python {' '.join(sys.argv)}`", "", "| probe | bits/elt | greedy-correct | answer log-p |",
             "|---|---|---|---|"]
    for label, r in rows.items():
        b = "-" if r["bits_per_element"] is None else f"{r['bits_per_element']:.3f}"
        lines.append(f"| {label} | {b} | {100 * r['pass_rate']:.0f}% | {r['answer_logp']:.2f} |")
    out_path.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
