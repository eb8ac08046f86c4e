"""The `gaac-hf` command line: its arguments, parsed without importing torch (so `--help` and `--version` answer at
once). Each command is named by a `module:function` string, as a console-script entry point is, and imported only
once the arguments are parsed; this module imports nothing of `gaac_hf`. (`dgap-hf` keeps its parser in
`dgap_hf.cli`: its `train` help shows `TrainConfig`'s defaults, which needs torch.)"""

from __future__ import annotations

import argparse
import importlib

from . import __version__
from .artifacts import SHIPPED_CALIBRATION


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends `(default: ...)` to every option that has a default other than None or False."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "%(default)" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return text + (" " if text else "") + "(default: %(default)s)"


def gaac_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gaac-hf", formatter_class=DefaultsHelpFormatter,
                                description="Lossless GAAC KV-cache compression for Hugging Face transformers: "
                                            "calibrate a model, report its compression, run the demo.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, formatter_class=DefaultsHelpFormatter)

    c = command("calibrate", "calibrate GAAC windows and slot capacity for a model")
    c.add_argument("model", nargs="?", default="default", help="model id or folder ('default': the embedded SmolLM2)")
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", nargs="+", help="plain or .gz text files")
    src.add_argument("--dataset", help="a Hugging Face data set, e.g. wikitext")
    c.add_argument("--config", default=None, help="data set config, e.g. wikitext-2-raw-v1")
    c.add_argument("--split", default="train", help="data set split")
    c.add_argument("--out", required=True, help="output folder (Hub repo format)")
    c.add_argument("--push-to-hub", default=None, metavar="REPO", help="also push the artifact to this Hub repo")
    c.add_argument("--prompt-tokens", type=int, default=8192, help="calibrate on prompts as long as deployment")
    c.add_argument("--max-prompts", type=int, default=None, help="at most this many prompts (default: all)")
    c.add_argument("--chunk-tokens", type=int, default=1024, help="chunked-prefill size")
    c.add_argument("--store", default=None, help="folder to keep captured KV in (default: temporary)")
    c.add_argument("--format-version", type=int, choices=(1, 2), default=1,
                   help="GAAC format version (2: the byte-split draft, even windows; no cache writes it yet)")
    c.add_argument("--heldout-text", nargs="+", default=None, help="also measure the ratio on this text")
    c.add_argument("--heldout-store", default=None, help="folder to keep the held-out KV in (default: temporary)")
    c.set_defaults(func="gaac_hf.cli:cmd_calibrate")

    r = command("report", "compression report on real KV: calibration text A vs held-out text B")
    r.add_argument("model", nargs="?", default="default", help="model id or folder ('default': the embedded SmolLM2)")
    r.add_argument("--calib-text", nargs="+", required=True, help="text A: calibration files (plain or .gz)")
    r.add_argument("--heldout-text", nargs="+", required=True, help="text B: held-out files (plain or .gz)")
    r.add_argument("--prompt-tokens", type=int, default=8192, help="tokens per long prompt")
    r.add_argument("--short-prompt-tokens", type=int, default=1024, help="tokens per prompt of the short calibration")
    r.add_argument("--max-prompts", type=int, default=3, help="long prompts of text A")
    r.add_argument("--heldout-prompts", type=int, default=2, help="long prompts of text B")
    r.add_argument("--chunk-tokens", type=int, default=1024, help="chunked-prefill size")
    r.add_argument("--segment-tokens", type=int, default=1024, help="positions per segment of the drift table")
    r.add_argument("--drift-layer", type=int, default=5, help="layer of the drift table")
    r.add_argument("--store", default=".cache/kv", help="folder for the captured KV")
    r.add_argument("--out", default="benchmarks/results", help="folder for compression.json and compression.md")
    r.set_defaults(func="gaac_hf.cli:cmd_report")

    d = command("demo", "the main job on the embedded default model")
    d.add_argument("--calibration", default=None,
                   help=f"calibration folder or Hub id (default: the shipped {SHIPPED_CALIBRATION})")
    d.add_argument("--prompt-words", type=int, default=250, help="words of licence text in the prompt")
    d.add_argument("--new-tokens", type=int, default=32, help="tokens to generate")
    d.set_defaults(func="gaac_hf.cli:cmd_demo")
    return p


def gaac_main(argv=None) -> None:
    args = gaac_parser().parse_args(argv)
    module, function = args.func.split(":")
    getattr(importlib.import_module(module), function)(args)  # torch and transformers from here on
