"""CapturedStep: a static cache's decode step recorded once as a CUDA graph and replayed with no Python per call.

On the CPU there is nothing to record: the step runs directly, and these tests check what the wrapper adds (its
input checks, the pool check before each step, the buffers whose addresses it watches). On CUDA (marked `gpu`) the
replayed steps are compared bit for bit with the same compiled step run without recording, for the compressed cache
and its twin, across block finalizations and a raw pool that grows (which records the graph again).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import CapturedStep, compile_config, compile_kwargs
from gaac_hf.calibration import GAACCalibration
from gaac_hf.captured_step import cache_buffers
from gaac_hf.model_layers import cache_kwarg
from gaac_hf.static_cache import GAACCacheFullError, GAACStaticCache, PlainStaticCache
from gaac_hf.testing import KeepingRecorder, gqa_model_and_calibration

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def cpu_model():
    model, calibration = gqa_model_and_calibration("cpu")
    model.set_attn_implementation("gaac")
    return model, calibration


def _prefill(model, cache, n, seed=3, batch=1):
    ids = torch.randint(3, 512, (batch, n), generator=torch.Generator().manual_seed(seed)).to(model.device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})


def _steps(model, forward, cache, start, steps, pass_cache=True, tokens=None):
    """`steps` decode steps from position `start`, greedy (first token 7) or fed `tokens` (`[steps, 1, 1]`):
    `(logits of each step, tokens fed)`."""
    name = cache_kwarg(model)
    tok = torch.full((1, 1), 7, device=model.device)
    out, fed = [], []
    with torch.no_grad():
        for i in range(steps):
            if tokens is not None:
                tok = tokens[i]
            fed.append(tok)
            kw = {name: cache} if pass_cache else {}
            o = forward(input_ids=tok, position_ids=torch.full((1, 1), start + i, device=model.device),
                        use_cache=True, **kw)
            out.append(o.logits[:, -1].clone())
            tok = o.logits[:, -1:].argmax(-1)
    return torch.stack(out), torch.stack(fed)


def test_cpu_step_runs_the_model_and_checks_the_pools(cpu_model):
    """On the CPU the wrapper's steps are the eager steps bit for bit (across a block finalization), with or without
    the cache passed, and each call runs the cache's amortized check (`between_steps`)."""
    model, calibration = cpu_model
    ref_cache = GAACStaticCache(model.config, 96, calibration)
    _prefill(model, ref_cache, 40)
    ref = torch.cat([_steps(model, model.forward, ref_cache, 40, 10)[0],
                     _steps(model, model.forward, ref_cache, 50, 10)[0]])
    cache = GAACStaticCache(model.config, 96, calibration)
    _prefill(model, cache, 40)
    step = CapturedStep(model, cache, compile=False)
    checked = []
    check = cache.between_steps
    cache.between_steps = lambda q: checked.append(q) or check(q)
    got = torch.cat([_steps(model, step, cache, 40, 10)[0], _steps(model, step, cache, 50, 10, pass_cache=False)[0]])
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert len(checked) >= 20 and set(checked) == {1}  # (the eager forward's mask sizes call it too)
    assert step.graphs == {}  # nothing recorded on the CPU


def test_cpu_step_compiled_equals_eager(cpu_model):
    """`compile=` a torch.compile configuration: the compiled step (Dynamo, full graph) gives the eager bits."""
    model, calibration = cpu_model
    got = []
    for compile in (False, {"fullgraph": True, "backend": "aot_eager"}):
        torch._dynamo.reset()
        cache = PlainStaticCache(model.config, 64)
        _prefill(model, cache, 30)
        got.append(_steps(model, CapturedStep(model, cache, compile=compile), cache, 30, 6)[0])
    assert torch.equal(got[0].view(torch.int32), got[1].view(torch.int32))


def test_recording_bookkeeping_with_a_fake_recorder(cpu_model):
    """What the wrapper does around the graphs, followed on the CPU with a recorder that keeps the step function:
    `warmup` direct steps, one recording, then replays that read the inputs copied into the recorded (static) ones,
    bit-identical to eager steps across block finalizations; a raw pool that grows (1 tile, escape capacity 16: about
    half the tiles raw) moves the buffers, so the step is recorded again after `warmup` more direct steps; a new input
    signature records another graph, up to `max_graphs`."""
    model, calibration = cpu_model
    calibration = GAACCalibration(dataclasses.replace(calibration.config, escape_capacity=16), calibration.base3,
                                  calibration.base4)
    ref_cache = GAACStaticCache(model.config, 128, calibration, raw_tiles=1)
    _prefill(model, ref_cache, 17)
    ref = _steps(model, model.forward, ref_cache, 17, 60)[0]
    cache = GAACStaticCache(model.config, 128, calibration, raw_tiles=1)
    _prefill(model, cache, 17)
    fake = KeepingRecorder()
    step = CapturedStep(model, cache, compile=False, capture=True, recorder=fake, warmup=2, max_graphs=1)
    before = tuple(t.data_ptr() for t in cache_buffers(cache))
    got = _steps(model, step, cache, 17, 60)[0]
    assert torch.equal(got.view(torch.int32), ref.view(torch.int32))
    assert tuple(t.data_ptr() for t in cache_buffers(cache)) != before and fake.recorded >= 2  # grew, recorded again
    assert fake.replays == 60 - 2 * fake.recorded and len(step.graphs) == 1
    with torch.no_grad(), pytest.raises(RuntimeError, match="max_graphs=1"):
        for i in range(3):  # another signature (an extra constant): direct steps, then a second graph is refused
            step(input_ids=torch.ones(1, 1, dtype=torch.long), position_ids=torch.full((1, 1), 77 + i),
                 return_dict=True)


def test_bad_input_is_refused(cpu_model):
    model, calibration = cpu_model
    cache = PlainStaticCache(model.config, 48)
    _prefill(model, cache, 40)
    step = CapturedStep(model, cache, compile=False)
    name = cache_kwarg(model)
    with pytest.raises(ValueError, match="cache it was built with"):
        step(input_ids=torch.ones(1, 1, dtype=torch.long), **{name: PlainStaticCache(model.config, 48)})
    with pytest.raises(ValueError, match=r"shape \[batch, 1\]"):
        step(input_ids=torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="use_cache=False"):
        step(input_ids=torch.ones(1, 1, dtype=torch.long), use_cache=False)
    with pytest.raises(ValueError, match="warmup"):
        CapturedStep(model, cache, warmup=0)
    with pytest.raises(ValueError, match="CUDA graphs need CUDA"):
        CapturedStep(model, cache, compile=False, capture=True, warmup=1)(input_ids=torch.ones(1, 1, dtype=torch.long))
    # a full cache is refused before the step runs (the pool check), not written past its end
    for i in range(8):
        step(input_ids=torch.ones(1, 1, dtype=torch.long), position_ids=torch.full((1, 1), 40 + i))
    with pytest.raises(GAACCacheFullError):
        step(input_ids=torch.ones(1, 1, dtype=torch.long), position_ids=torch.full((1, 1), 48))


def test_buffers_are_the_stacks_and_move_when_the_raw_pool_grows(cpu_model):
    """`cache.buffers()`: the stacked tensors a step reads (none before the first update); the raw pool's growth
    changes their addresses (what tells a CapturedStep to record again). transformers' StaticCache: its layers'."""
    from transformers import StaticCache

    model, calibration = cpu_model
    cache = GAACStaticCache(model.config, 160, calibration, raw_tiles=1)
    assert cache_buffers(cache) == ()
    _prefill(model, cache, 16)
    before = tuple(t.data_ptr() for t in cache_buffers(cache))
    assert len(before) >= 8 and all(t.shape[0] == len(cache.own_layers) for t in cache_buffers(cache))
    _prefill(model, cache, 120, seed=4)  # more raw tiles than the pool held: it grows
    assert tuple(t.data_ptr() for t in cache_buffers(cache)) != before
    static = StaticCache(config=model.config, max_cache_len=32)
    _prefill(model, static, 8)
    assert {t.data_ptr() for t in cache_buffers(static)} >= {layer.keys.data_ptr() for layer in static.layers}


# --- CUDA: recorded and replayed ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cuda_model():
    model, calibration = gqa_model_and_calibration("cuda")
    model.set_attn_implementation("gaac")
    return model, calibration


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_replayed_steps_equal_the_twins_and_the_compiled_steps(cuda_model):
    """40 replayed steps from position 301 (two block finalizations): the compressed cache's logits equal its twin's
    bit for bit (both replayed), one graph each; and they are the same compiled step's run without recording (fed
    the same tokens; compared within a few BF16 ulps, since cuBLAS may pick other kernels inside a capture)."""
    model, calibration = cuda_model
    runs = {}
    for kind, capture in (("gaac", True), ("twin", True), ("gaac", False)):
        torch._dynamo.reset()
        cache = GAACStaticCache(model.config, 400, calibration) if kind == "gaac" else \
            PlainStaticCache(model.config, 400)
        _prefill(model, cache, 301)
        step = CapturedStep(model, cache, compile=compile_kwargs(cudagraphs=False), capture=capture)
        tokens = runs[("gaac", True)][1] if not capture else None
        runs[(kind, capture)] = _steps(model, step, cache, 301, 40, tokens=tokens)
        assert len(step.graphs) == (1 if capture else 0)
    (got, toks), (twin, twin_toks), (direct, _) = runs[("gaac", True)], runs[("twin", True)], runs[("gaac", False)]
    assert torch.equal(got.view(torch.int32), twin.view(torch.int32)) and torch.equal(toks, twin_toks)
    assert torch.allclose(got.float(), direct.float(), rtol=3e-2, atol=3e-2)  # a few BF16 ulps at most


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_raw_pool_growth_records_again(cuda_model):
    """A 1-tile raw pool and an escape capacity of 16 (about half the tiles raw): the checks before the replays grow
    the pool while the step replays, the buffers move, the step is recorded again, and the replayed logits stay
    bit-identical to the twin's."""
    model, calibration = cuda_model
    calibration = GAACCalibration(dataclasses.replace(calibration.config, escape_capacity=16), calibration.base3,
                                  calibration.base4)
    torch._dynamo.reset()
    cache = GAACStaticCache(model.config, 400, calibration, raw_tiles=1)
    _prefill(model, cache, 17)
    step = CapturedStep(model, cache)
    got = _steps(model, step, cache, 17, 8)[0]
    recorded = tuple(t.data_ptr() for t in cache_buffers(cache))
    capacity = {i: s["raw_capacity"] for i, s in cache.stats()["layers"].items()}
    assert len(step.graphs) == 1
    more = _steps(model, step, cache, 25, 200)[0]
    assert tuple(t.data_ptr() for t in cache_buffers(cache)) != recorded  # it grew while replaying
    after = cache.stats()["layers"]  # (stats() checks the pools: nothing was lost)
    assert len(step.graphs) == 1 and any(s["raw_capacity"] > capacity[i] for i, s in after.items())
    assert all(s["raw_taken"] <= s["raw_capacity"] for s in after.values())
    twin = PlainStaticCache(model.config, 400)
    _prefill(model, twin, 17)
    twin_step = CapturedStep(model, twin)
    ref = torch.cat([_steps(model, twin_step, twin, 17, 8)[0], _steps(model, twin_step, twin, 25, 200)[0]])
    assert torch.equal(torch.cat([got, more]).view(torch.int32), ref.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_generate_with_replayed_graphs_equals_the_twin(cuda_model):
    """generate with compile_config(graphs="replay") (the replay backend records the compiled step as a CUDA graph):
    40 tokens across block finalizations, GAAC's tokens and logit bits equal the twin's under the same settings."""
    model, calibration = cuda_model
    ids = torch.randint(0, 512, (1, 301), generator=torch.Generator().manual_seed(5)).cuda()
    outs = []
    for make in (lambda: GAACStaticCache(model.config, 400, calibration), lambda: PlainStaticCache(model.config, 400)):
        torch._dynamo.reset()
        outs.append(model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True, compile_config=compile_config(graphs="replay"),
                                   **{cache_kwarg(model): make()}))
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(outs[0].scores, outs[1].scores))
