"""GAACCache under accelerate `device_map` across two GPUs: pools live on each layer's GPU, the fused kernel runs
there, and tokens and logits equal DynamicCache (sdpa) or the same kernel over plain KV (gaac)."""

import pytest
import torch
from hf_common.testing import tiny_llama_config
from gaac_hf.testing import generate_both, same_generation
from transformers import AutoModelForCausalLM

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf.calibrate import calibrate

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


@pytest.fixture(scope="module")
def split_model(tmp_path_factory):
    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                            hidden_size=256)
    path = tmp_path_factory.mktemp("model")
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(path)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
                  "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device_map).eval()
    gen = torch.Generator().manual_seed(1)
    calibration = calibrate(model, [torch.randint(0, 512, (512,), generator=gen)], "random ids")
    return model, calibration


@pytest.mark.parametrize("attn", ["gaac", "sdpa"])
def test_device_map_generation_is_lossless(split_model, attn):
    model, calibration = split_model
    model.set_attn_implementation(attn)
    out, ref, cache = generate_both(model, calibration, batch=2, prompt=203, pad=11, new_tokens=30, device="cuda:0")
    assert same_generation(out, ref)
    devices = {torch.device(cache.layers[i].device) for i in cache.gaac_layers}
    assert devices == {torch.device("cuda:0"), torch.device("cuda:1")}
