"""The `gaac-hf` commands: calibrate, report, demo (their arguments are defined in `hf_common.console`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .calibration import shipped_calibration  # noqa: F401  (imported from here by tests and benchmarks)


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
    calibration = calibrate(model, prompts, corpus.description, store=args.store, chunk_tokens=args.chunk_tokens,
                            format_version=args.format_version)
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
    """`gaac-hf` (the parser lives in `hf_common.console`, so that `--help` and `--version` need no torch)."""
    from hf_common.console import gaac_main

    gaac_main(argv)


if __name__ == "__main__":
    main()
