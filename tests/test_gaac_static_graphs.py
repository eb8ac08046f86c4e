"""The compiled decode steps of `GAACStaticCache` and its plain twin as inductor builds them.

* The model-side kernels are the same in both steps: each cache's update is one opaque op with the same model-side
  inputs (`gaac::append_token`, `gaac::plain_append_token`), so inductor cannot fuse the K/V projection or RoPE into
  one cache's update and not the other's. That is what makes the compiled GAAC step bit-exact to the compiled twin
  (on the CPU the suite's compiled tests pass either way; on the H200 the old twin's fused scatter wrote other KV
  bits than the GAAC step from layer 27 of 32 on).
* The cache ops work in place on views of the cache-wide stacked buffers (no pool is copied), and the step carries
  one input per kind of buffer, not one per layer (fewer tensors to guard and check per step).
* GPU (`@pytest.mark.gpu`): CUDA-graph compiled steps (`mode="reduce-overhead"`) of both caches, 48 steps across
  block boundaries on Llama-3.1-8B-wide layers: the same kernels and the same logit bits.
"""

from __future__ import annotations

import ast
import dataclasses
import re

import pytest
import torch
from hf_common.testing import tiny_llama_config
from transformers import AutoModelForCausalLM

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf.calibrate import calibrate
from gaac_hf.calibration import GAACCalibration
from gaac_hf.model_layers import cache_kwarg
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache

pytestmark = pytest.mark.usefixtures("one_thread")

_KERNEL = re.compile(r"^(\w+) = async_compile\.(\w+)\((.*?)'''(.*?)'''", re.S | re.M)


def kernel_sources(code: str) -> list[str]:
    """The kernels of inductor's output code in definition order, each as its launcher kind, argument types and
    source with its own name replaced (names carry the fused ops' names, e.g. `append_token`, not the math)."""
    return [f"{kind}{head}{body}".replace(name, "KERNEL") for name, kind, head, body in _KERNEL.findall(code)]


def compiled_steps(model, cache, prompt: torch.Tensor, steps: int, check_every: int = 8, backend: str = "inductor",
                   **compile_kw):
    """Eager prefill, then `steps` compiled decode steps feeding back their argmax: `(logits [steps, B, V], output
    code of the decode graph)`. Runs `cache.check()` every `check_every` steps (as generate does)."""
    from torch._inductor.utils import run_and_get_code

    name = cache_kwarg(model)
    torch._dynamo.reset()
    step = torch.compile(model.forward, fullgraph=True, backend=backend, **compile_kw)
    b, n = prompt.shape
    logits, code = [], None
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{name: cache})
        tok = torch.full((b, 1), 7, device=prompt.device)
        for i in range(steps):
            kw = dict(input_ids=tok, position_ids=torch.full((b, 1), n + i, device=prompt.device), use_cache=True,
                      **{name: cache})
            if code is None:
                out, codes = run_and_get_code(step, **kw)
                code = "\n".join(codes)
            else:
                out = step(**kw)
            logits.append(out.logits[:, -1].clone())
            tok = out.logits[:, -1:].argmax(-1)
            if i % check_every == check_every - 1:
                cache.check()
    return torch.stack(logits), code


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.bfloat16).eval()
    calibration = calibrate(model, [torch.randint(3, 512, (128,), generator=torch.Generator().manual_seed(1))],
                            "random ids")
    calibration = GAACCalibration(dataclasses.replace(calibration.config, escape_capacity=16), calibration.base3,
                                  calibration.base4)  # about half the tiles raw: both storage classes carry data
    model.set_attn_implementation("gaac")
    return model, calibration


@pytest.fixture(scope="module")
def both_compiled(llama):
    """20 inductor-compiled steps of each cache from a 13-token prompt (a block completes at token 16 and 32; the
    4-tile raw pools grow at a check between steps, and the step recompiles for them)."""
    model, calibration = llama
    prompt = torch.randint(3, 512, (1, 13), generator=torch.Generator().manual_seed(2))
    out = {}
    for key, cache in (("gaac", GAACStaticCache(model.config, 256, calibration, raw_tiles=4)),
                       ("plain", PlainStaticCache(model.config, 256))):
        out[key] = (cache, *compiled_steps(model, cache, prompt, 20))
    return out


def test_compiled_steps_build_the_same_model_side_kernels(llama, both_compiled):
    """Every kernel inductor generates for the GAAC step is the twin's, in the same order: only the opaque cache
    ops differ (one update and one attention call per layer in each)."""
    model, _ = llama
    (_, _, gaac_code), (_, _, plain_code) = both_compiled["gaac"], both_compiled["plain"]
    gaac, plain = kernel_sources(gaac_code), kernel_sources(plain_code)
    assert gaac, "no kernel found in inductor's output code"
    differ = [i for i, (a, b) in enumerate(zip(gaac, plain)) if a != b]
    assert len(gaac) == len(plain) and not differ, f"kernels {differ} of {len(gaac)} / {len(plain)} differ"
    layers = model.config.num_hidden_layers
    assert gaac_code.count("torch.ops.gaac.append_token.default(") == layers
    assert plain_code.count("torch.ops.gaac.plain_append_token.default(") == layers
    assert gaac_code.count("torch.ops.gaac.decode_attention.default(") == layers
    assert plain_code.count("torch.ops.gaac.plain_decode_attention.default(") == layers


def test_compiled_steps_equal_bit_for_bit(both_compiled):
    """Inductor on the CPU: the 20 steps' logits and the KV both caches hold after them, bit for bit, across a
    raw-pool growth (the recompiled step must write each layer's own pool: with a symbolic pool size inductor
    lost the layers' view offsets in the append op's arguments)."""
    (gaac, gaac_logits, _), (plain, plain_logits, _) = both_compiled["gaac"], both_compiled["plain"]
    assert gaac.layers[0].n_raw > 4
    assert torch.equal(gaac_logits.view(torch.int16), plain_logits.view(torch.int16))
    for i in gaac.own_layers:
        g, p = gaac.layers[i], plain.layers[i]
        n = g.host_length()
        assert n == p.host_length() == 13 + 20
        keys, values = g.expand(n // 16)
        r = g.record
        keys[:, :, n // 16 * 16:n], values[:, :, n // 16 * 16:n] = r.tail_k[:, :, :n % 16], r.tail_v[:, :, :n % 16]
        assert torch.equal(keys[:, :, :n].view(torch.int16), p.keys[:, :, :n].view(torch.int16))
        assert torch.equal(values[:, :, :n].view(torch.int16), p.values[:, :, :n].view(torch.int16))


def test_cache_ops_run_in_place_on_the_stacked_buffers(both_compiled):
    """The compiled GAAC step allocates nothing near the size of a layer's slot pool (the ops write the graph's
    input buffers through views, no pool is copied in and back)."""
    cache, _, code = both_compiled["gaac"]
    call = code[code.index("def call("):]
    sizes = [ast.literal_eval(s) for s in re.findall(r"empty_strided_\w+\((\([^)]*\))", call)]
    largest = max(int(torch.Size(s).numel()) for s in sizes)
    assert largest < cache.layers[0].record.slot_pool.numel() // 4


def _graph_inputs(model, cache, prompt) -> list[torch.Tensor]:
    """The tensors Dynamo hands to the compiled decode graph (its placeholders' examples)."""
    name = cache_kwarg(model)
    seen = []

    def backend(gm, example_inputs):
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.meta.get("grapharg") is not None:
                seen.append(node.meta["grapharg"].example)
        return gm.forward

    torch._dynamo.reset()
    step = torch.compile(model.forward, fullgraph=True, backend=backend)
    with torch.no_grad():
        model(input_ids=prompt, use_cache=True, **{name: cache})
        step(input_ids=torch.tensor([[7]]), position_ids=torch.tensor([[prompt.shape[1]]]), use_cache=True,
             **{name: cache})
    return [t for t in seen if isinstance(t, torch.Tensor)]


@pytest.mark.parametrize("cls", ["gaac", "plain"])
def test_compiled_step_carries_one_input_per_buffer_kind(llama, cls):
    """The step's cache inputs are the cache-wide stacked buffers (9 kinds for GAAC, K/V and lengths for the
    twin), whatever the layer count: not one set per layer."""
    model, calibration = llama
    cache = GAACStaticCache(model.config, 64, calibration) if cls == "gaac" else PlainStaticCache(model.config, 64)
    inputs = _graph_inputs(model, cache, torch.randint(3, 512, (1, 9), generator=torch.Generator().manual_seed(3)))
    model_tensors = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    cache_inputs = [t for t in inputs if id(t) not in model_tensors and t.dtype != torch.long]  # ids, positions
    assert len(cache_inputs) == (9 if cls == "gaac" else 2)
    stacked = {id(t) for t in vars(cache._stack).values() if isinstance(t, torch.Tensor)}
    assert {id(t) for t in cache_inputs} == stacked
    assert all(getattr(t, "_dynamo_static_input_type", None) is not None for t in cache_inputs)  # static addresses


# --- GPU: CUDA graphs ---------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_cuda_graph_steps_equal_twin_bit_for_bit():
    """`torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)` (inductor + CUDA graphs, what generate
    uses on CUDA) over both caches: 4 layers of Llama-3.1-8B's widths (32 query / 8 KV heads, head_dim 128, hidden
    4096, MLP 14336), random weights calibrated on their own KV, a 40-token prompt, 48 steps (blocks complete at
    tokens 48, 64, 80): the same model-side kernels, and every logit bit equal."""
    from transformers import LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    calibration = calibrate(model, [torch.randint(0, cfg.vocab_size, (512,), generator=gen)], "random ids")
    model.set_attn_implementation("gaac")
    prompt = torch.randint(0, cfg.vocab_size, (1, 40), generator=gen).cuda()
    got = {}
    config = model.config  # the model's own (from_config copies cfg), which says "gaac"
    for key, cache in (("gaac", GAACStaticCache(config, 128, calibration)), ("plain", PlainStaticCache(config, 128))):
        got[key] = compiled_steps(model, cache, prompt, 48, mode="reduce-overhead")
    (gaac_logits, gaac_code), (plain_logits, plain_code) = got["gaac"], got["plain"]
    gaac, plain = kernel_sources(gaac_code), kernel_sources(plain_code)
    differ = [i for i, (a, b) in enumerate(zip(gaac, plain)) if a != b]
    assert gaac and len(gaac) == len(plain) and not differ, f"kernels {differ} of {len(gaac)} / {len(plain)} differ"
    steps_differ = (gaac_logits.view(torch.int16) != plain_logits.view(torch.int16)).flatten(1).any(1)
    assert not steps_differ.any(), f"logit bits differ from step {int(steps_differ.nonzero()[0, 0])} on"
    assert torch.equal(gaac_logits.argmax(-1), plain_logits.argmax(-1))
