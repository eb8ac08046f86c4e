"""AWQ W4A16 checkpoints through transformers' own AWQ integration (backend gptqmodel), CPU.

A tiny random Llama is written as an AWQ-GEMM 4-bit checkpoint (`benchmarks/awq_checkpoint.py`: round-to-nearest
packing, a `quantization_config` in config.json), loaded with `from_pretrained`, calibrated on its own KV, and
generated with `GAACCache` and with `DynamicCache`: tokens and every logit bit must agree. An FP16 AWQ model must get
the cache's TypeError naming the dtype.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "1")  # gptqmodel's CPU thread pool; this machine has 2 cores
pytest.importorskip("gptqmodel", reason="AWQ checkpoints load through gptqmodel: pip install 'gaac-hf[awq]'")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from gaac_hf import GAACCache  # noqa: E402
from gaac_hf.calibrate import calibrate  # noqa: E402
from gaac_hf.model_layers import cache_kwarg  # noqa: E402
from gaac_hf.testing import generate_both, same_generation  # noqa: E402
from hf_common.testing import tiny_llama_config  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from awq_checkpoint import dequantize_awq, write_awq_checkpoint  # noqa: E402

GROUP_SIZE = 32
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_awq_checkpoint(tiny_llama_config(), str(tmp_path_factory.mktemp("awq")), group_size=GROUP_SIZE)


@pytest.fixture(scope="module")
def awq_model(checkpoint):
    """The BF16 AWQ model and a GAAC calibration made on its own KV."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, model.config.vocab_size, (256,), generator=torch.Generator().manual_seed(100))
    return model, calibrate(model, [ids], "random ids")


def test_checkpoint_loads_as_awq_kernels_with_bf16_activations(awq_model, checkpoint):
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from safetensors.torch import load_file

    model, _ = awq_model
    assert model.dtype == torch.bfloat16
    assert type(model.config.quantization_config).__name__ == "AwqConfig"
    layers = model.model.layers
    quantized = [layer.get_submodule(p) for layer in layers for p in PROJECTIONS]
    assert all(isinstance(m, BaseQuantLinear) for m in quantized), {type(m).__name__ for m in quantized}
    assert not any(isinstance(m, torch.nn.Linear) for m in layers.modules())

    # The packed layout really is AWQ GEMM: the kernel computes x @ W with W dequantized from the file (to BF16
    # output rounding; a wrong nibble order or zero-point convention is off by the size of the weights).
    tensors = load_file(os.path.join(checkpoint, "model.safetensors"))
    for name in ("model.layers.0.self_attn.k_proj", "model.layers.1.mlp.down_proj"):
        w = dequantize_awq(tensors[f"{name}.qweight"], tensors[f"{name}.qzeros"], tensors[f"{name}.scales"],
                           GROUP_SIZE)
        x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(3)).bfloat16()
        got = model.get_submodule(name)(x)
        assert got.dtype == torch.bfloat16
        ref = x.float() @ w.t()
        err = (got.float() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, f"{name}: relative error {err:.3g}"


@pytest.mark.parametrize("attention", ["sdpa", "gaac"])
@pytest.mark.parametrize("batch, pad", [(1, 0), (3, 9)], ids=["greedy", "left-padded-batch"])
def test_gaac_cache_is_bit_identical_to_dynamic_cache(awq_model, attention, batch, pad):
    model, calibration = awq_model
    before = model.config._attn_implementation
    model.set_attn_implementation(attention)
    try:
        out, ref, cache = generate_both(model, calibration, batch=batch, prompt=40, pad=pad, new_tokens=30,
                                        device="cpu")
    finally:
        model.set_attn_implementation(before)
    assert same_generation(out, ref)
    stats = cache.stats()
    assert all(s["blocks"] == 4 for s in stats["layers"].values())  # 69 tokens: 4 finalized blocks + a tail
    assert stats["slots"] + stats["raw_tiles"] > 0


def test_fp16_awq_model_gets_the_dtype_error(checkpoint, awq_model):
    """transformers casts AWQ models to FP16 on CUDA; GAAC stores BF16 bits only, so the cache must say so."""
    _, calibration = awq_model
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float16).eval()
    assert model.dtype == torch.float16
    ids = torch.randint(3, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    name = cache_kwarg(model)
    model.generate(ids, **kw, **{name: DynamicCache(config=model.config)})  # the model itself runs in FP16
    with pytest.raises(TypeError, match=r"BF16.*torch\.float16.*dtype=torch\.bfloat16"):
        model.generate(ids, **kw, **{name: GAACCache(model.config, calibration)})
