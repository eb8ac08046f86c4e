"""`dgap-hf`: collect paired traces, train a DGAP artifact, inspect one.

    dgap-hf collect --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset <PG-19 repo id> --split train \\
        --precisions K1V1,K2V2,K4V4,K8V8 --prefix-len 1024 4096 --steps 256 --sequences 64 --out traces/
    dgap-hf train --traces traces/ --out dgap-smollm2 [--push-to-hub org/dgap-smollm2]
    dgap-hf eval --traces traces-heldout/ --artifact dgap-smollm2 --out eval.json
    dgap-hf info dgap-smollm2

`collect` writes one `<precision>-p<prefix>.safetensors` trace file per precision and prefix length (the FP run
is shared by all precisions); `train` trains every precision found in the folder (one validation split per
precision, `TrainConfig` defaults unless overridden) and saves the artifact with `save_pretrained`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import torch


def _read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        return f.read()


def _documents(args):
    if args.text:
        for path in args.text:
            yield _read_text(path)
        return
    from datasets import load_dataset  # the `datasets` extra

    ds = load_dataset(args.dataset, args.dataset_config, split=args.split, streaming=True)
    for row in ds:
        yield row[args.text_column]


def _token_stream(args, tokenizer, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids, doc)`: the documents' tokens back to back (EOS between them) and each token's document index."""
    if args.random_tokens:
        g = torch.Generator().manual_seed(args.seed)
        n = max(args.random_tokens, needed)
        return torch.randint(0, tokenizer, (n,), generator=g), torch.zeros(n, dtype=torch.int32)
    ids: list[int] = []
    docs: list[int] = []
    sep = tokenizer.eos_token_id
    for d, doc in enumerate(_documents(args)):
        toks = tokenizer(doc, add_special_tokens=False)["input_ids"] + ([sep] if sep is not None else [])
        ids.extend(toks)
        docs.extend([d] * len(toks))
        if len(ids) >= needed:
            break
    if len(ids) < needed:
        raise SystemExit(f"the text has {len(ids)} tokens; {needed} are needed (lower --sequences or --prefix-len)")
    return torch.tensor(ids), torch.tensor(docs, dtype=torch.int32)


def quantizer_overrides(args) -> dict:
    """The `LowBitCache` options given on the command line; every other option keeps the precision's default
    (`LowBitConfig.default`, the measured best quantizer)."""
    given = {"group_size": args.group_size, "residual_length": args.residual_length,
             "one_bit_mode": args.one_bit_mode, "sink_length": args.sink_length}
    return {k: v for k, v in given.items() if v is not None}


def cmd_collect(args) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .traces import TracePairs, collect_traces

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    if args.model_name:  # a local copy: record the Hub name the artifact is for
        model.config.name_or_path = args.model_name
    tokenizer = model.config.vocab_size if args.random_tokens else AutoTokenizer.from_pretrained(args.model)
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    windows = {p: p + args.steps for p in args.prefix_len}
    stream, doc_of = _token_stream(args, tokenizer, sum(w * args.sequences for w in windows.values()))
    if args.random_tokens:
        source = "random tokens"
    elif args.text:
        source = f"files: {', '.join(args.text)}"
    else:
        source = f"dataset {args.dataset}" + (f"/{args.dataset_config}" if args.dataset_config else "")
        source += f" [{args.split}]"
    cache_kwargs = quantizer_overrides(args)
    pos = 0
    for prefix, width in windows.items():
        seqs = stream[pos:pos + width * args.sequences].reshape(args.sequences, width)
        docs = doc_of[pos:pos + width * args.sequences].reshape(args.sequences, width)[:, prefix]  # first target's
        pos += width * args.sequences
        parts: dict[str, list] = {p: [] for p in precisions}
        for b in range(0, args.sequences, args.batch_size):
            tr = collect_traces(model, seqs[b:b + args.batch_size], precisions, prefix_len=prefix, steps=args.steps,
                                top_m=args.top_m, cache_kwargs=cache_kwargs, doc_ids=docs[b:b + args.batch_size],
                                meta={"source": source, "base_model": model.config.name_or_path})
            for p, t in tr.items():
                parts[p].append(t.to("cpu"))
        for p, ts in parts.items():
            tr = TracePairs.cat(ts)
            tr.meta = {**ts[0].meta, "sequences": args.sequences}
            tr.save(out / f"{tr.meta['precision']}-p{prefix}.safetensors")
            print(f"{tr.meta['precision']} prefix {prefix}: {len(tr)} rows -> {out}")


def load_trace_folder(folder) -> tuple[dict, dict, list]:
    """`({precision: TracePairs}, {precision: [parts]}, files)` of every `*.safetensors` trace file in `folder`."""
    from .precision import normalize_precision
    from .traces import TracePairs

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise SystemExit(f"no trace files in {folder}")
    by_precision: dict[str, list] = {}
    for f in files:
        tr = TracePairs.load(f)
        p = normalize_precision(tr.meta.get("precision") or f.stem.split("-")[0])
        by_precision.setdefault(p, []).append(tr)
    return {p: TracePairs.cat(ts) for p, ts in by_precision.items()}, by_precision, files


def cmd_train(args) -> None:
    from .train import TrainConfig, train_dgap

    traces, by_precision, files = load_trace_folder(args.traces)
    val = load_trace_folder(args.val_traces)[0] if args.val_traces else None
    overrides = {k: v for k, v in vars(args).items() if k in TrainConfig.__dataclass_fields__ and v is not None}
    cfg = TrainConfig(**overrides)
    sources = sorted({str(t.meta.get("source", "")) for ts in by_precision.values() for t in ts})
    prefixes = sorted({int(t.meta.get("prefix_len", 0)) for ts in by_precision.values() for t in ts})
    model = train_dgap(traces, cfg, val_traces=val,
                       training_data={"sources": sources, "prefix_lens": prefixes,
                                      "trace_files": [f.name for f in files],
                                      "validation": args.val_traces or f"{cfg.val_fraction:.0%} of the documents"})
    model.save_pretrained(args.out)
    for p, r in model.results.items():
        v = r["validation"]
        print(f"{p}: K_b {r['k_b']}, tau {r['tau']:.2f}, correction rate {v['correction_rate']:.3f}, drift "
              f"{v['drift_before']:.4f} -> {v['drift_after']:.4f}, window KL {v['window_kl_before']:.4f} -> "
              f"{v['window_kl_after']:.4f}")
    if args.push_to_hub:
        model.push_to_hub(args.push_to_hub, model_card_kwargs={"repo_id": args.push_to_hub})


def cmd_eval(args) -> None:
    from .evaluation import evaluate_artifact
    from .models import DGAPModel

    model = DGAPModel.from_pretrained(args.artifact)
    traces = load_trace_folder(args.traces)[0]
    taus = [round(0.05 * i, 2) for i in range(0, 20)] + [0.99] if args.tau_sweep else None
    res = evaluate_artifact(model, traces, taus)
    if not res:
        raise SystemExit(f"the artifact has {sorted(model.precisions)}, the traces {sorted(traces)}: nothing to do")
    print("| cache | K_b | tau | PPL | top-1 vs BF16 | KL | drift | corrected | FP top-1 outside window |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p, r in res.items():
        for label, q in (("BF16", r["bf16"]), (p, r["lowbit"]), (p + " + DGAP", r["dgap"])):
            print(f"| {label} | {r['k_b']} | {r['tau']:.2f} | {q['ppl']:.3f} | {100 * q['top1_agreement']:.2f}% | "
                  f"{q['kl']:.4f} | {q.get('drift', 0):.4f} | {100 * q.get('correction_rate', 0):.1f}% | "
                  f"{100 * q.get('fp_top1_outside_window', 0):.2f}% |")
    if args.out:
        Path(args.out).write_text(json.dumps({"artifact": args.artifact, "traces": args.traces, "results": res},
                                             indent=1) + "\n")


def cmd_info(args) -> None:
    from .models import DGAPModel

    model = DGAPModel.from_pretrained(args.artifact)
    info = {"base_model": model.base_model,
            "precisions": {p: {"k_b": s["k_b"], "tau": s["tau"], "detector": s["detector"].get("arch", "mlp"),
                               "corrector": s["corrector"].get("arch", "mlp")} for p, s in model.precisions.items()},
            "parameters": sum(p.numel() for p in model.parameters())}
    print(json.dumps(info, indent=2))


def build_parser() -> argparse.ArgumentParser:
    from hf_common import __version__
    from hf_common.console import DefaultsHelpFormatter

    from .train import TrainConfig

    parser = argparse.ArgumentParser(prog="dgap-hf", description=__doc__.split("\n\n")[0],
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    c = command("collect", "paired FP / low-bit teacher-forced traces")
    c.add_argument("--model", required=True, help="model id or folder")
    c.add_argument("--model-name", help="the model's Hub name when --model is a local copy (recorded in the traces)")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", help="text files (.gz allowed)")
    src.add_argument("--dataset", help="a Hub dataset with a text column, e.g. a PG-19 copy (needs gaac-hf[datasets])")
    src.add_argument("--random-tokens", type=int, help="random token ids (smoke tests)")
    c.add_argument("--dataset-config", help="data set config")
    c.add_argument("--split", default="train", help="data set split")
    c.add_argument("--text-column", default="text", help="data set column with the text")
    c.add_argument("--precisions", default="K1V1,K2V2,K4V4,K8V8", help="comma-separated KbVc precisions")
    c.add_argument("--prefix-len", type=int, nargs="+", default=[1024], help="prompt lengths before the traced steps")
    c.add_argument("--steps", type=int, default=128, help="teacher-forced decoding steps per sequence")
    c.add_argument("--sequences", type=int, default=8, help="sequences per prefix length")
    c.add_argument("--batch-size", type=int, default=1, help="sequences per forward")
    c.add_argument("--top-m", type=int, default=64, help="top logits stored per row")
    same = "; default: the precision's LowBitConfig.default, the measured best quantizer"
    c.add_argument("--group-size", type=int, help="LowBitCache quantization group, keys and values" + same)
    c.add_argument("--residual-length", type=int, help="recent tokens kept in full precision" + same)
    c.add_argument("--one-bit-mode", choices=["sign", "minmax"], help="1-bit quantizer" + same)
    c.add_argument("--sink-length", type=int, help="first tokens kept in full precision" + same)
    c.add_argument("--dtype", default="bfloat16", help="model dtype")
    c.add_argument("--device", help="default: cuda if available, else cpu")
    c.add_argument("--seed", type=int, default=0, help="seed of --random-tokens")
    c.add_argument("--out", required=True, help="output folder for the trace files")
    c.set_defaults(func=cmd_collect)
    t = command("train", "train a DGAP artifact from a folder of trace files")
    t.add_argument("--traces", required=True, help="folder of trace files")
    t.add_argument("--out", required=True, help="output folder (Hub repo format)")
    for name, typ in (("epochs", int), ("batch_size", int), ("lr", float), ("alpha", float), ("rho_k", float),
                      ("rho_c", float), ("eps", float), ("k_max", int), ("temperature", float),
                      ("lambda_rank", float), ("lambda_reg", float), ("detector_arch", str),
                      ("corrector_arch", str), ("detector_hidden", int), ("corrector_hidden", int),
                      ("val_fraction", float), ("seed", int), ("device", str)):
        t.add_argument("--" + name.replace("_", "-"), dest=name, type=typ,
                       help=f"TrainConfig.{name} (default: {getattr(TrainConfig, name)})")
    t.add_argument("--val-traces", help="a folder of validation traces from other documents (default: split the "
                   "training traces by document)")
    t.add_argument("--push-to-hub", metavar="REPO_ID", help="also push the artifact to this Hub repo")
    t.set_defaults(func=cmd_train)
    e = command("eval", "quality with and without DGAP on held-out traces")
    e.add_argument("--traces", required=True, help="folder of held-out trace files")
    e.add_argument("--artifact", required=True, help="DGAP artifact folder or Hub repo id")
    e.add_argument("--tau-sweep", action="store_true", help="also evaluate a grid of thresholds")
    e.add_argument("--out", help="write the results as JSON here")
    e.set_defaults(func=cmd_eval)
    i = command("info", "show a DGAP artifact (local folder or Hub repo)")
    i.add_argument("artifact", help="DGAP artifact folder or Hub repo id")
    i.set_defaults(func=cmd_info)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
