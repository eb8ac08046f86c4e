"""On CUDA: GAACCache with the fused Triton "gaac" attention gives exactly the tokens and logits of the same attention
over a DynamicCache (the kernel reads plain KV as raw tiles), and GAACCache under sdpa equals DynamicCache."""

import pytest
import torch
from conftest import tiny_llama_config
from transformers import AutoModelForCausalLM, DynamicCache

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import GAACCache
from gaac_hf.calibrate import calibrate
from gaac_hf.demo import cache_kwarg

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def model_and_calibration():
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                            hidden_size=256)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
    gen = torch.Generator().manual_seed(1)
    calibration = calibrate(model, [torch.randint(0, 512, (1024,), generator=gen)], "random ids")
    return model, calibration


@pytest.mark.parametrize("attn", ["gaac", "sdpa"])
@pytest.mark.parametrize("padded", [False, True])
def test_gpu_generation_is_lossless(model_and_calibration, attn, padded):
    model, calibration = model_and_calibration
    model.set_attn_implementation(attn)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (2, 301), generator=gen).cuda()
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :37] = 0
    kw = dict(attention_mask=mask, max_new_tokens=40, min_new_tokens=40, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    name = cache_kwarg(model)
    ref = model.generate(ids, **kw, **{name: DynamicCache(config=model.config)})
    cache = GAACCache(model.config, calibration)
    out = model.generate(ids, **kw, **{name: cache})
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert cache.stats()["slots"] > 0
