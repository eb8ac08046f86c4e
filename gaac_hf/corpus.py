"""Text corpora for calibration and evaluation: local files (plain or gzip) or a `datasets` data set."""

from __future__ import annotations

import gzip
from dataclasses import dataclass
from pathlib import Path

import torch

# Real English text that Debian packages install, usable offline.
GNU_STANDARDS = ("/usr/share/info/standards.info.gz", "/usr/share/info/maintain.info.gz")  # package gnu-standards
DEBIAN_REFERENCE = ("/usr/share/debian-reference/debian-reference.en.txt.gz",)  # package debian-reference-en


@dataclass
class Corpus:
    text: str
    description: str


def read_text_files(paths) -> Corpus:
    parts = []
    for p in paths:
        p = Path(p)
        if not p.is_file():
            raise FileNotFoundError(f"text file not found: {p}")
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt", encoding="utf-8", errors="replace") as f:
            parts.append(f.read())
    return Corpus("\n\n".join(parts), "files: " + ", ".join(str(p) for p in paths))


def load_dataset_text(name: str = "wikitext", config: str | None = "wikitext-2-raw-v1", split: str = "train",
                      column: str = "text") -> Corpus:
    """Concatenate one split of a Hugging Face data set (needs `datasets` and network or a local copy)."""
    try:
        import datasets
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("`--dataset` needs the `datasets` package: pip install datasets") from e
    ds = datasets.load_dataset(name, config, split=split)
    if column not in ds.column_names:
        raise ValueError(f"data set {name!r} has no column {column!r}; columns: {ds.column_names}")
    text = "\n".join(t for t in ds[column] if t)
    return Corpus(text, f"dataset: {name}" + (f"/{config}" if config else "") + f" [{split}]")


def token_prompts(tokenizer, text: str, prompt_tokens: int, max_prompts: int | None = None) -> list[torch.Tensor]:
    """Cut the tokenized text into consecutive prompts of exactly `prompt_tokens` tokens (the last partial one dropped)."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[0]
    n = ids.numel() // prompt_tokens
    if max_prompts is not None:
        n = min(n, max_prompts)
    if n == 0:
        raise ValueError(f"the text has {ids.numel()} tokens, fewer than one prompt of {prompt_tokens}")
    return [ids[i * prompt_tokens:(i + 1) * prompt_tokens] for i in range(n)]


LICENCE_TEXTS = ("/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0")


def sample_text() -> Corpus:
    """Real English text present on any machine: Debian's licence texts, else the licences of installed packages."""
    found = [p for p in LICENCE_TEXTS if Path(p).is_file()]
    if found:
        return read_text_files(found)
    from importlib import metadata

    parts, names = [], []
    for dist in ("torch", "transformers", "huggingface_hub", "safetensors"):
        try:
            files = metadata.distribution(dist).files or []
        except metadata.PackageNotFoundError:
            continue
        for f in files:
            if "LICENSE" in f.name.upper() and f.locate().is_file():
                parts.append(f.locate().read_text(errors="replace"))
                names.append(f"{dist}:{f.name}")
    if not parts:
        raise FileNotFoundError("no licence text found to use as sample text")
    return Corpus("\n\n".join(parts), "licence texts of " + ", ".join(names))
