"""On CUDA: GAACCache with the fused Triton "gaac" attention gives exactly the tokens and logits of the same attention
over a DynamicCache (the kernel reads plain KV as raw tiles), and GAACCache under sdpa equals DynamicCache."""

import contextlib

import pytest
import torch
from gaac_hf.testing import generate_both, gqa_model_and_calibration, same_generation
from torch.nn.attention import SDPBackend, sdpa_kernel

import gaac_hf  # noqa: F401  (registers "gaac")

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module", params=[1, 2], ids=["calibration_v1", "calibration_v2"])
def model_and_calibration(request):
    """Calibrations of format versions 1 and 2: with the second the cache stores format version 2 where the CUDA
    kernel reads it (Hopper), and the kernel reads it in place."""
    return gqa_model_and_calibration("cuda", request.param)


def _expected_format(calibration) -> int:
    from gaac_hf import ops

    even = calibration.config.format_version == 2
    return 2 if even and ops.fused_reads(2, 128, 4, torch.device("cuda")) else 1


@pytest.mark.parametrize("attn", ["gaac", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_generation_is_lossless(model_and_calibration, attn, padded):
    model, calibration = model_and_calibration
    model.set_attn_implementation(attn)
    # With a padding mask, DynamicCache + the default SDPA backend was seen to differ from itself between two
    # identical runs on an H200 (benchmarks/device/diag_gpu_generate.py): compare under the deterministic math backend.
    backend = sdpa_kernel(SDPBackend.MATH) if attn == "sdpa" else contextlib.nullcontext()
    with backend:
        out, ref, cache = generate_both(model, calibration, batch=2, prompt=301, pad=37 if padded else 0,
                                        new_tokens=40, device="cuda")
    assert same_generation(out, ref)
    stats = cache.stats()
    assert stats["slots"] > 0
    assert {s["format_version"] for s in stats["layers"].values()} == {_expected_format(calibration)}
