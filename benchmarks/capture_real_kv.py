"""Capture real KV for the kernel benchmarks: SmolLM2-135M-Instruct's keys and values over real English text.

Writes a `.safetensors` with one tensor `kv`, BF16 `[layers, 2 (K|V), kv heads, tokens, 64]` (post-RoPE keys, as the
cache stores them), which `benchmarks/attention.py`, `format_v2_probe.py`, `ring_depth_probe.py` and the other
`--real-kv` benchmarks tile into their head shapes. Runs on the CPU in under a minute; the output (47 MB at 2,048
tokens) is local data (`.bench/` is not tracked) and travels to the GPU machine as a carried path:

    python benchmarks/capture_real_kv.py --tokens 2048 --out .bench/real_kv_2k.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gaac_hf.corpus import DEBIAN_REFERENCE, read_text_files, sample_text, token_prompts  # noqa: E402
from gaac_hf.default_model import load_default_model  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402


def capture(model, ids: torch.Tensor) -> torch.Tensor:
    """KV of one prompt `[1, T]` through a DynamicCache: `[layers, 2, H, T, D]` BF16."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
    return torch.stack([torch.stack([layer.keys[0], layer.values[0]]) for layer in cache.layers]).contiguous()


def load_real_kv(path: str) -> tuple[torch.Tensor, dict]:
    """The captured KV `[layers, 2, H, T, D]` BF16 and the file's metadata (model, text, tokens)."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.get_tensor("kv"), f.metadata()


def study_args(doc: str, out: str, argv=None) -> tuple[argparse.Namespace, torch.Tensor, dict]:
    """The command line of a study over the captured KV (`--real-kv`, `--out`), the KV, and the header of its JSON."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--real-kv", default=".bench/real_kv_2k.safetensors")
    p.add_argument("--out", default=out)
    args = p.parse_args(argv)
    kv, meta = load_real_kv(args.real_kv)
    return args, kv, {"real_kv": args.real_kv, "source": meta, "shape": list(kv.shape), "torch": torch.__version__}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--text", nargs="*", default=None,
                   help="text files (default: the Debian reference, else the machine's licence texts)")
    p.add_argument("--out", default=".bench/real_kv_2k.safetensors")
    args = p.parse_args(argv)
    model, tokenizer = load_default_model()
    if args.text:
        text = read_text_files(args.text)
    else:
        text = read_text_files(DEBIAN_REFERENCE) if all(Path(f).is_file() for f in DEBIAN_REFERENCE) \
            else sample_text()
    ids = token_prompts(tokenizer, text.text, args.tokens, 1)[0][None]
    kv = capture(model, ids)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file({"kv": kv}, args.out, metadata={"model": "SmolLM2-135M-Instruct", "text": text.description,
                                              "tokens": str(ids.shape[1])})
    print(f"{args.out}: kv {tuple(kv.shape)} {kv.dtype} from {text.description}")


if __name__ == "__main__":
    main()
