"""Fixtures only (builders live in `hf_common.testing`, `gaac_hf.testing` and `tests/gaac_triton_cases.py`)."""

import os

# Without a GPU, Triton kernels run in Triton's interpreter; this must be set before anything imports triton.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module: much faster for tiny models on a busy 2-core machine (then restored)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def smollm2():
    """The embedded default model, loaded once for the whole session: `(model, tokenizer)`."""
    from gaac_hf.default_model import load_default_model

    return load_default_model()


@pytest.fixture(scope="session")
def tiny_llama():
    from transformers import AutoModelForCausalLM

    from hf_common.testing import tiny_llama_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.bfloat16).eval()


@pytest.fixture(scope="session")
def sample_corpus():
    from gaac_hf.corpus import sample_text

    return sample_text()
