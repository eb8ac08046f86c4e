"""Head dims other than 64/128/256 (multiples of 16: Phi-2's 80, Phi-3-mini's 96): tiles of 16 or 32 channels, the
torch reference attention over decoded tiles, bit-identical generation with GAACCache and GAACStaticCache."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache
from transformers.generation import CompileConfig

from gaac_hf import GAACStaticCache, PlainStaticCache
from gaac_hf.cache import GAACCache
from gaac_hf.calibrate import calibrate
from gaac_hf.calibration import GAACCalibration
from gaac_hf.format import tile_split
from gaac_hf.model_layers import cache_kwarg
from hf_common.testing import tiny_llama_config

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB = 512


def _ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


def _model(head_dim: int):
    torch.manual_seed(0)
    config = tiny_llama_config(head_dim=head_dim, hidden_size=2 * head_dim, num_attention_heads=2,
                               num_key_value_heads=1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    calibration = calibrate(model, [_ids(128, 100)[0]], "random ids")
    calibration = GAACCalibration(dataclasses.replace(calibration.config, escape_capacity=16), calibration.base3,
                                  calibration.base4)
    return model, calibration


def _scores_bits(out):
    return [s.view(torch.int32) for s in out.scores]


@pytest.mark.parametrize("head_dim", [80, 96])
def test_gaac_cache_generate_is_bit_identical(head_dim):
    model, calibration = _model(head_dim)
    assert calibration.config.head_dim == head_dim and tile_split(head_dim) == {80: (5, 16), 96: (3, 32)}[head_dim]
    ids = _ids(40, 21, batch=2)
    kw = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True)
    for attn in ("gaac", "sdpa"):
        model.set_attn_implementation(attn)
        cache = GAACCache(model.config, calibration)
        got = model.generate(ids, **kw, **{cache_kwarg(model): cache})
        ref = model.generate(ids, **kw, **{cache_kwarg(model): DynamicCache(config=model.config)})
        assert torch.equal(got.sequences, ref.sequences), attn
        assert all(torch.equal(a, b) for a, b in zip(_scores_bits(got), _scores_bits(ref))), attn
        stats = cache.stats()
        assert stats["ratio"] > 1 and stats["slots"] > 0, attn


def test_compiled_static_cache_is_bit_identical_to_its_twin():
    """GAACStaticCache under torch.compile(fullgraph) at head_dim 80 equals the plain twin, crossing blocks."""
    model, calibration = _model(80)
    model.set_attn_implementation("gaac")
    cc = CompileConfig(fullgraph=True, backend="aot_eager")
    cc._compile_all_devices = True
    kw = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False, output_scores=True,
              return_dict_in_generate=True, compile_config=cc)
    outs = []
    for make in (lambda: GAACStaticCache(model.config, 80, calibration), lambda: PlainStaticCache(model.config, 80)):
        torch._dynamo.reset()
        outs.append(model.generate(_ids(29, 4), **kw, **{cache_kwarg(model): make()}))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(a, b) for a, b in zip(_scores_bits(outs[0]), _scores_bits(outs[1])))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("head_dim", [80, 96])
def test_gaac_cache_generate_on_cuda(head_dim):
    """On the GPU: Triton encode/expand kernels with 16/32-channel tiles, then the reference attention."""
    model, calibration = _model(head_dim)
    model = model.cuda()
    ids = _ids(40, 22, batch=2).cuda()
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, output_scores=True, return_dict_in_generate=True)
    model.set_attn_implementation("gaac")
    got = model.generate(ids, **kw, **{cache_kwarg(model): GAACCache(model.config, calibration)})
    ref = model.generate(ids, **kw, **{cache_kwarg(model): DynamicCache(config=model.config)})
    assert torch.equal(got.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(_scores_bits(got), _scores_bits(ref)))
