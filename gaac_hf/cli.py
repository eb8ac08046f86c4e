"""`gaac-hf` command line: calibrate, report, demo."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HUB_CONFIGS = Path(__file__).resolve().parent.parent / "hub_configs"
DEFAULT_CALIBRATION = "gaac-SmolLM2-135M-Instruct"


def shipped_calibration(name: str = DEFAULT_CALIBRATION) -> Path:
    path = HUB_CONFIGS / name
    if not path.is_dir():
        raise FileNotFoundError(f"no shipped calibration {name!r} in {HUB_CONFIGS} (use a Hub repo id instead)")
    return path


def load_model(name: str | None):
    """The embedded default model when `name` is None or "default", else any causal LM id or folder."""
    import torch

    from .default_model import load_default_model

    if name in (None, "default"):
        return load_default_model()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.bfloat16).eval()
    return model, tokenizer


def read_corpus(args, texts_attr="text"):
    from .corpus import load_dataset_text, read_text_files

    texts = getattr(args, texts_attr, None)
    if texts:
        return read_text_files(texts)
    return load_dataset_text(args.dataset, args.config, args.split)


def cmd_calibrate(args) -> None:
    from .calibrate import calibrate, size_summary, summary_dict, tile_escape_bytes
    from .capture import capture_corpus
    from .corpus import read_text_files, token_prompts

    model, tokenizer = load_model(args.model)
    corpus = read_corpus(args)
    prompts = token_prompts(tokenizer, corpus.text, args.prompt_tokens, args.max_prompts)
    calibration = calibrate(model, prompts, corpus.description, store=args.store, chunk_tokens=args.chunk_tokens)
    if args.heldout_text:
        import torch

        held = read_text_files(args.heldout_text)
        held_prompts = token_prompts(tokenizer, held.text, args.prompt_tokens, args.max_prompts)
        cfg = calibration.config
        escapes = torch.cat([
            tile_escape_bytes(kv, calibration.base3, calibration.base4).reshape(-1)
            for kv in capture_corpus(model, held_prompts, args.chunk_tokens, args.heldout_store, "held-out KV")])
        cfg.measured["held-out: " + held.description] = summary_dict(
            size_summary(escapes, cfg.tile_channels, cfg.escape_capacity))
    calibration.save_pretrained(args.out)
    print(json.dumps(calibration.config.measured, indent=2))
    print(f"saved to {args.out}")
    if args.push_to_hub:
        calibration.push_to_hub(args.push_to_hub, model_card_kwargs={"repo_id": args.push_to_hub})
        print(f"pushed to {args.push_to_hub}")


def cmd_report(args) -> None:
    from .capture import capture_corpus
    from .corpus import read_text_files, token_prompts
    from .report import compression_report, markdown

    model, tokenizer = load_model(args.model)
    a = read_text_files(args.calib_text)
    b = read_text_files(args.heldout_text)
    long_a = token_prompts(tokenizer, a.text, args.prompt_tokens, args.max_prompts)
    short_n = args.prompt_tokens // args.short_prompt_tokens * len(long_a)
    short_a = token_prompts(tokenizer, a.text, args.short_prompt_tokens, short_n)
    long_b = token_prompts(tokenizer, b.text, args.prompt_tokens, args.heldout_prompts)
    store = Path(args.store)

    def source(prompts, name):
        folder = str(store / f"{name}-{prompts[0].numel()}")
        list(capture_corpus(model, prompts, args.chunk_tokens, folder, f"capture {name}"))
        return lambda: capture_corpus(model, prompts, args.chunk_tokens, folder, f"read {name}")

    report = compression_report(source(long_a, "A"), source(short_a, "A"), source(long_b, "B"),
                                drift_layer=args.drift_layer, segment_tokens=args.segment_tokens)
    meta = {
        "model": str(model.config.name_or_path),
        "calibration text A": a.description,
        "held-out text B": b.description,
        "prompts": f"A: {len(long_a)} x {args.prompt_tokens} tokens (short-prompt calibration: {len(short_a)} x "
                   f"{args.short_prompt_tokens}); B: {len(long_b)} x {args.prompt_tokens}",
        "command": " ".join(sys.argv),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compression.json").write_text(json.dumps({"meta": meta, **report}, indent=1) + "\n")
    md = markdown(report, meta)
    (out / "compression.md").write_text(md)
    print(md)


def cmd_demo(args) -> None:
    from .demo import run_demo

    run_demo(args)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="gaac-hf", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("calibrate", help="calibrate GAAC windows and slot capacity for a model")
    c.add_argument("model", nargs="?", default="default", help="model id or folder (default: embedded SmolLM2)")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", help="plain or .gz text files")
    src.add_argument("--dataset", help="a Hugging Face data set, e.g. wikitext")
    c.add_argument("--config", default=None, help="data set config, e.g. wikitext-2-raw-v1")
    c.add_argument("--split", default="train")
    c.add_argument("--out", required=True, help="output folder (Hub repo format)")
    c.add_argument("--push-to-hub", default=None, metavar="REPO")
    c.add_argument("--prompt-tokens", type=int, default=8192, help="calibrate on prompts as long as deployment")
    c.add_argument("--max-prompts", type=int, default=None)
    c.add_argument("--chunk-tokens", type=int, default=1024, help="chunked-prefill size")
    c.add_argument("--store", default=None, help="folder to keep captured KV in (default: temporary)")
    c.add_argument("--heldout-text", nargs="+", default=None, help="also measure the ratio on this text")
    c.add_argument("--heldout-store", default=None)
    c.set_defaults(func=cmd_calibrate)

    r = sub.add_parser("report", help="compression report on real KV: calibration text A vs held-out text B")
    r.add_argument("model", nargs="?", default="default")
    r.add_argument("--calib-text", nargs="+", required=True)
    r.add_argument("--heldout-text", nargs="+", required=True)
    r.add_argument("--prompt-tokens", type=int, default=8192)
    r.add_argument("--short-prompt-tokens", type=int, default=1024)
    r.add_argument("--max-prompts", type=int, default=3)
    r.add_argument("--heldout-prompts", type=int, default=2)
    r.add_argument("--chunk-tokens", type=int, default=1024)
    r.add_argument("--segment-tokens", type=int, default=1024)
    r.add_argument("--drift-layer", type=int, default=5)
    r.add_argument("--store", default=".cache/kv")
    r.add_argument("--out", default="benchmarks/results")
    r.set_defaults(func=cmd_report)

    d = sub.add_parser("demo", help="the main job on the embedded default model")
    d.add_argument("--calibration", default=None, help="calibration folder or Hub id (default: the shipped one)")
    d.add_argument("--prompt-words", type=int, default=250, help="words of licence text in the prompt")
    d.add_argument("--new-tokens", type=int, default=32)
    d.set_defaults(func=cmd_demo)

    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
