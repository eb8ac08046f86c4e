"""On CUDA: GAACStaticCache compiled with CUDA graphs (what generate does by itself) equals its plain twin bit for bit,
its decode step is one graph, and the Triton append kernel leaves the state the torch path leaves."""

import pytest
import torch
from gaac_hf.testing import gqa_model_and_calibration, same_generation

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import ops
from gaac_hf.model_layers import cache_kwarg
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def model_and_calibration():
    model, calibration = gqa_model_and_calibration("cuda")
    model.set_attn_implementation("gaac")
    return model, calibration


@pytest.fixture(scope="module")
def calibration_v2(model_and_calibration):
    """A format-version-2 calibration of the same model (even windows: stored as format version 2 on Hopper)."""
    return gqa_model_and_calibration("cuda", 2)[1]


def _both(model, calibration, ids, max_cache_len, **kw):
    kw = {"max_new_tokens": 40, "min_new_tokens": 40, "output_scores": True, "return_dict_in_generate": True,
          **kw}
    name = cache_kwarg(model)
    outs = []
    for make in (lambda: GAACStaticCache(model.config, max_cache_len, calibration),
                 lambda: PlainStaticCache(model.config, max_cache_len)):
        torch._dynamo.reset()
        torch.manual_seed(3)
        cache = make()
        outs.append((model.generate(ids, **kw, **{name: cache}), cache))
    return outs


@pytest.mark.parametrize("mode, calibration_version", [("greedy", 1), ("sampling", 1), ("beam", 1), ("padded", 1),
                                                       ("greedy", 2), ("padded", 2)])
def test_gpu_compiled_generate_equals_twin(model_and_calibration, calibration_v2, mode, calibration_version):
    """Compiled GAACStaticCache equals its compiled twin bit for bit, across block finalizations; with a version-2
    calibration the slots are format version 2 on Hopper (the append kernel writes the fragment order, the CUDA kernel
    reads it in place)."""
    model, calibration = model_and_calibration
    if calibration_version == 2:
        calibration = calibration_v2
    gen = torch.Generator().manual_seed(5)
    batch = 2 if mode == "padded" else 1
    ids = torch.randint(0, 512, (batch, 301), generator=gen).cuda()
    kw = {"greedy": dict(do_sample=False), "sampling": dict(do_sample=True, top_k=30),
          "beam": dict(do_sample=False, num_beams=3), "padded": dict(do_sample=False)}[mode]
    if mode == "padded":
        mask = torch.ones_like(ids)
        mask[1, :37] = 0
        kw["attention_mask"] = mask
    (out, cache), (ref, _) = _both(model, calibration, ids, 400, **kw)
    assert same_generation(out, ref)
    stats = cache.stats()
    assert stats["slots"] > 0
    v2_read = calibration_version == 2 and ops.fused_reads(2, 128, 4, torch.device("cuda"))
    assert stats["format_version"] == (2 if v2_read else 1)


def test_gpu_compile_config_without_module_guards_equals_twin(model_and_calibration):
    """generate(..., compile_config=gaac_hf.compile_config()): inductor with CUDA graphs and the model's module
    guards skipped, GAAC equal to its plain twin bit for bit."""
    model, calibration = model_and_calibration
    ids = torch.randint(0, 512, (1, 77), generator=torch.Generator().manual_seed(8)).cuda()
    (out, _), (ref, _) = _both(model, calibration, ids, 160, do_sample=False, compile_config=gaac_hf.compile_config())
    assert same_generation(out, ref)


@pytest.mark.parametrize("calibration_version", [1, 2])
def test_gpu_prompt_lookup_equals_twin(model_and_calibration, calibration_v2, calibration_version):
    """Prompt lookup under generate's own compile on CUDA (inductor, CUDA graphs): the verification forwards run
    eagerly inside the compiled call, rejected drafts are cropped (blocks cut into come back to the tail), and tokens
    and logit bits equal the twin's, formats 1 and 2."""
    model, calibration = model_and_calibration
    calibration = calibration_v2 if calibration_version == 2 else calibration
    ids = torch.randint(0, 512, (1, 11), generator=torch.Generator().manual_seed(9)).repeat(1, 9).cuda()
    (out, cache), (ref, _) = _both(model, calibration, ids, 256, do_sample=False, prompt_lookup_num_tokens=6)
    assert same_generation(out, ref)
    layer = cache.stats()["layers"][0]
    assert layer["tokens"] == ids.shape[1] + 39 and layer["slots_taken"] == layer["slots"]


def test_gpu_compiled_long_generation(model_and_calibration):
    """1,100 compiled decode steps (69 block finalizations inside the CUDA graph)."""
    model, calibration = model_and_calibration
    ids = torch.randint(0, 512, (1, 37), generator=torch.Generator().manual_seed(6)).cuda()
    (out, cache), (ref, _) = _both(model, calibration, ids, 1200, do_sample=False, max_new_tokens=1100,
                                   min_new_tokens=1100)
    assert same_generation(out, ref)
    assert cache.stats()["layers"][0]["tokens"] == 37 + 1099


def test_gpu_decode_step_is_one_graph(model_and_calibration):
    model, calibration = model_and_calibration
    name = cache_kwarg(model)
    cache = GAACStaticCache(model.config, 128, calibration)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 512, (1, 47)).cuda(), use_cache=True, **{name: cache})
        torch._dynamo.reset()
        ex = torch._dynamo.explain(model)(input_ids=torch.tensor([[5]]).cuda(), use_cache=True, **{name: cache})
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons


@pytest.mark.parametrize("format_version", [1, 2])
def test_gpu_append_kernel_equals_torch_path(model_and_calibration, calibration_v2, format_version):
    """The model's own KV through the Triton kernel (CUDA) and through the torch path (CPU), one token at a time
    after a 20-token eager append: same lengths, counters, slot bytes and decoded blocks, equal to the KV put in
    (format version 2: slots in fragment order on both paths)."""
    from transformers import DynamicCache

    model, calibration = model_and_calibration
    if format_version == 2:
        calibration = calibration_v2
    ids = torch.randint(0, 512, (2, 80), generator=torch.Generator().manual_seed(7)).cuda()
    dyn = DynamicCache(config=model.config)
    model.set_attn_implementation("sdpa")
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **{cache_kwarg(model): dyn})
    finally:
        model.set_attn_implementation("gaac")
    k, v = dyn.layers[0].keys, dyn.layers[0].values  # [2, H, 80, D]
    gpu = GAACStaticCache(model.config, 96, calibration, format_version=format_version).layers[0]
    cpu = GAACStaticCache(model.config, 96, calibration, format_version=format_version).layers[0]
    gpu.append(k[:, :, :20], v[:, :, :20])
    cpu.append(k[:, :, :20].cpu(), v[:, :, :20].cpu())
    for i in range(20, 80):
        for lay, dev in ((gpu, "cuda"), (cpu, "cpu")):
            ops.append_token(k[:, :, i:i + 1].to(dev), v[:, :, i:i + 1].to(dev), lay.record, lay.slot_modes,
                             lay.raw_modes, lay.counts)
    assert torch.equal(gpu.kv_len.cpu(), cpu.kv_len) and torch.equal(gpu.counts.cpu(), cpu.counts)
    slots = []
    for lay in (gpu, cpu):  # slot bytes in table order (the pools may fill in another order)
        entries = lay.record.table[:, :5].reshape(-1).long().cpu()
        slots.append(lay.record.slot_pool.cpu()[entries.clamp(min=0)][entries >= 0])
    assert slots[0].shape[0] > 0 and torch.equal(slots[0], slots[1])
    gk, gv = gpu.expand(5)
    ck, cv = cpu.expand(5)
    for a, b, ref in ((gk, ck, k), (gv, cv, v)):
        assert torch.equal(a[:, :, :80].cpu().view(torch.int16), b[:, :, :80].view(torch.int16))
        assert torch.equal(a[:, :, :80].view(torch.int16), ref.view(torch.int16))
