"""GAACStaticCache: compiled decode steps bit-exact against the plain twin, one graph, pool overflow, bad input.

The twin (`PlainStaticCache`) holds the same tokens as plain BF16 in the same static layout and is read by the same
attention code (`gaac::plain_decode_attention`), so every comparison here is `torch.equal` on bit patterns. Compiled
runs use Dynamo with `fullgraph=True` (a graph break is an error); most use the `aot_eager` backend to keep the CPU
suite fast, one uses inductor, as `generate` does by default.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hf_common.testing import tiny_llama_config
from transformers import AutoModelForCausalLM
from transformers.generation.configuration_utils import CompileConfig

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import ops
from gaac_hf.calibrate import calibrate
from gaac_hf.calibration import CalibrationMismatchError, GAACCalibration
from gaac_hf.format import TileLayout
from gaac_hf.model_layers import cache_kwarg
from gaac_hf.static_cache import (GAACCacheFullError, GAACPoolOverflowError, GAACStaticCache, GAACStaticLayer,
                                   PlainStaticCache)

VOCAB = 512
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton kernels' tests: interpreted on the CPU
pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def llama():
    """Tiny Llama on "gaac" attention, calibrated on its own KV with escape capacity 16 (about half the tiles raw,
    so both storage classes carry data)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.bfloat16).eval()
    calibration = calibrate(model, [_ids(128, 100)[0]], "random ids")
    calibration = GAACCalibration(dataclasses.replace(calibration.config, escape_capacity=16), calibration.base3,
                                  calibration.base4)
    model.set_attn_implementation("gaac")
    return model, calibration


def _compile_config(backend: str = "aot_eager") -> CompileConfig:
    cc = CompileConfig(fullgraph=True, backend=backend, mode=None if backend != "inductor" else "default")
    cc._compile_all_devices = True  # generate compiles on CUDA by itself; on the CPU it has to be asked
    return cc


def _same(a, b) -> bool:
    return torch.equal(a.sequences, b.sequences) and len(a.scores) == len(b.scores) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.scores, b.scores))


def _generate_both(model, calibration, ids, max_cache_len, compile_backend="aot_eager", format_version=None, **kw):
    kw = {"max_new_tokens": 24, "min_new_tokens": 24, "output_scores": True, "return_dict_in_generate": True, **kw}
    if compile_backend is not None:
        kw["compile_config"] = _compile_config(compile_backend)
    name = cache_kwarg(model)
    outs = []
    for make in (lambda: GAACStaticCache(model.config, max_cache_len, calibration, format_version=format_version),
                 lambda: PlainStaticCache(model.config, max_cache_len)):
        torch._dynamo.reset()
        cache = make()
        torch.manual_seed(5)
        outs.append((model.generate(ids, **kw, **{name: cache}), cache))
    return outs


MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=20, temperature=0.9),
    "beam": dict(do_sample=False, num_beams=3),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_generate_equals_plain_twin(llama, mode):
    model, calibration = llama
    (out, cache), (ref, _) = _generate_both(model, calibration, _ids(37, 1), 96, **MODES[mode])
    assert _same(out, ref)
    assert cache.stats()["slots"] > 0 and cache.stats()["raw_tiles"] > 0


@pytest.fixture(scope="module")
def calibration_v2(llama):
    """A format-version-2 calibration of the same model (even windows), with room in the slots for its escapes."""
    calibration = calibrate(llama[0], [_ids(128, 100)[0]], "random ids", format_version=2)
    return GAACCalibration(dataclasses.replace(calibration.config, escape_capacity=32), calibration.base3,
                           calibration.base4)


def test_compiled_generate_of_format_2_equals_plain_twin(llama, calibration_v2):
    """Slots of format version 2 (what the CUDA kernel reads on Hopper; here the torch reference encodes and
    decodes them): the compiled step is still bit-identical to the twin, through block finalizations."""
    model, _ = llama
    calibration = calibration_v2
    kw = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False)
    (out, cache), (ref, _) = _generate_both(model, calibration, _ids(37, 1), 96, format_version=2, **kw)
    assert _same(out, ref)
    stats = cache.stats()
    assert stats["format_version"] == 2 and stats["slots"] > 0 and stats["raw_tiles"] > 0


def test_compiled_left_padded_batch_equals_plain_twin(llama):
    model, calibration = llama
    ids = _ids(29, 2, batch=3)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0
    mask[2, :16] = 0
    (out, _), (ref, _) = _generate_both(model, calibration, ids, 80, attention_mask=mask, do_sample=False)
    assert _same(out, ref)


def test_compiled_long_generation_crosses_many_blocks(llama):
    """1,024 compiled decode steps: 64 block finalizations inside the traced step."""
    model, calibration = llama
    kw = dict(max_new_tokens=1024, min_new_tokens=1024, do_sample=False)
    (out, cache), (ref, _) = _generate_both(model, calibration, _ids(9, 3), 1040, **kw)
    assert _same(out, ref)
    assert cache.stats()["layers"][0]["blocks"] == (9 + 1023) // 16


def test_generate_compiles_with_inductor(llama):
    """What generate does on CUDA by itself: inductor, fullgraph. The step was compiled (Dynamo counted frames) and
    both caches still agree bit for bit."""
    from torch._dynamo.utils import counters

    model, calibration = llama
    counters.clear()
    (out, _), (ref, _) = _generate_both(model, calibration, _ids(20, 4), 48, compile_backend="inductor",
                                        do_sample=False, max_new_tokens=6, min_new_tokens=6)
    assert counters["stats"]["unique_graphs"] >= 2  # one decode graph per cache
    assert _same(out, ref)


def test_triton_kernels_in_the_compiled_step(llama, monkeypatch):
    """The CUDA path's ops (Triton append/finalize kernel, the attention kernel reading device lengths, the plain
    twin's raw-tile table) inside the compiled generate step, run on the CPU under Triton's interpreter: compressed
    equals twin, across a block boundary, for a left-padded batch."""
    from triton_ops.device import interpreted

    if not interpreted():
        pytest.skip("on a GPU tests/test_gaac_gpu_static_cache.py runs these kernels on CUDA tensors")
    monkeypatch.setenv("GAAC_HF_BACKEND", "triton")
    model, calibration = llama
    ids = _ids(27, 14, batch=2)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    (out, cache), (ref, _) = _generate_both(model, calibration, ids, 48, attention_mask=mask, do_sample=False,
                                            max_new_tokens=6, min_new_tokens=6)
    assert _same(out, ref)
    assert cache.stats()["layers"][0]["blocks"] == 2


def _decode_logits(model, cache, ids, steps, forward):
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})  # prefill, eager
        return _steps(model, cache, ids.shape[0], ids.shape[1], steps, forward)


def _steps(model, cache, rows, start, steps, forward=None):
    """`steps` greedy single-token decode steps from position `start` (token 7 first): their logits."""
    name, forward = cache_kwarg(model), forward or model
    tok, logits = torch.full((rows, 1), 7), []
    for i in range(steps):
        out = forward(input_ids=tok, position_ids=torch.full((rows, 1), start + i), use_cache=True, **{name: cache})
        logits.append(out.logits[:, -1].clone())
        tok = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits)


def test_hand_loop_compiled_forward(llama):
    """`torch.compile(model.forward, fullgraph=True)` in a hand-written loop (prefill eager, 20 decode steps that
    finalize a block), the compressed cache against the twin."""
    model, calibration = llama
    got = []
    for cache in (GAACStaticCache(model.config, 64, calibration), PlainStaticCache(model.config, 64)):
        torch._dynamo.reset()
        step = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
        got.append(_decode_logits(model, cache, _ids(13, 5), 20, step))
    assert torch.equal(got[0].view(torch.int32), got[1].view(torch.int32))


@pytest.mark.parametrize("cls", ["gaac", "plain"])
def test_decode_step_is_one_graph(llama, cls):
    model, calibration = llama
    name = cache_kwarg(model)
    cache = GAACStaticCache(model.config, 64, calibration) if cls == "gaac" else PlainStaticCache(model.config, 64)
    with torch.no_grad():
        model(input_ids=_ids(31, 6), use_cache=True, **{name: cache})
        torch._dynamo.reset()
        ex = torch._dynamo.explain(model)(input_ids=torch.tensor([[5]]), position_ids=torch.tensor([[31]]),
                                          use_cache=True, **{name: cache})  # token 32 completes block 2
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), ex.break_reasons
    if cls == "gaac":
        assert cache.stats()["layers"][0]["blocks"] == 2


# --- crop: assisted decoding, prompt lookup ---------------------------------------------------------------------
def _decode_after(model, cache, ids, cut, steps):
    """Prefill `ids`, crop the last `cut` tokens, then `steps` eager single-token decode steps: their logits."""
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache})
        cache.crop(torch.tensor(-cut) if cut % 2 else -cut)  # (odd cuts as a 0-d tensor, as transformers 5.17 passes)
        return _steps(model, cache, ids.shape[0], ids.shape[1] - cut, steps)


@pytest.mark.parametrize("cut, rows", [(3, 1), (16, 1), (21, 1), (37, 1), (53, 1), (21, 2)])
def test_crop_leaves_the_cache_as_if_the_tokens_never_came(llama, cut, rows):
    """`crop(-n)` within the tail, to a block boundary, into a finalized block, across several blocks and to
    nothing (53 of 53), one row and two: the next decode steps give the logit bits of a cache that only ever held the
    kept tokens, and of the twin cropped alike; a block cut into comes back to the tail, the blocks past it leave the
    table, and the pool counters go back to the kept tiles: nothing leaks, with two rows too (the prefill took tiles
    row by row, so the cut ones lay between kept ones: the pools are compacted), and the tiles the later steps take
    never overwrite a kept one (the logits say so)."""
    model, calibration = llama
    ids = _ids(53, 30, batch=rows)
    cache = GAACStaticCache(model.config, 96, calibration)
    got = _decode_after(model, cache, ids, cut, 20)
    twin = _decode_after(model, PlainStaticCache(model.config, 96), ids, cut, 20)
    assert torch.equal(got.view(torch.int32), twin.view(torch.int32))
    if cut < ids.shape[1]:  # (nothing kept: compared with the twin only)
        want = _decode_logits(model, GAACStaticCache(model.config, 96, calibration), ids[:, :ids.shape[1] - cut], 20,
                              model)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    for layer in cache.stats()["layers"].values():
        assert layer["tokens"] == ids.shape[1] - cut + 20
        taken, live = (layer["slots_taken"], layer["raw_taken"]), (layer["slots"], layer["raw_tiles"])
        assert taken == live, layer


def test_fill_holes_compacts_the_kept_tiles():
    """`_fill_holes`: the kept tiles end as tiles 0 .. n - 1 of every pool, each keeping its content (and its mode
    counts), the ones below n staying where they were; nothing kept, or nothing to move, changes nothing."""
    from gaac_hf.static_cache import _fill_holes

    pool = torch.arange(12 * 3, dtype=torch.int32).reshape(12, 3)
    modes = torch.arange(12)
    live = torch.tensor([9, 0, 4, 11, 2], dtype=torch.int32)  # n = 5: 9 and 11 move into 1 and 3
    before = pool[live.long()].clone()
    n, now = _fill_holes(live, (pool, modes))
    assert n == 5 and now.dtype == live.dtype and sorted(now.tolist()) == list(range(5))
    assert now.tolist() == [1, 0, 4, 3, 2]
    assert torch.equal(pool[now.long()], before) and torch.equal(modes[now.long()], live.long())
    same = pool.clone()
    assert _fill_holes(torch.tensor([1, 0, 2]), (pool,))[0] == 3 and torch.equal(pool, same)
    assert _fill_holes(torch.tensor([], dtype=torch.int64), (pool,))[0] == 0 and torch.equal(pool, same)


def test_crop_rejects_a_positive_count(llama):
    model, calibration = llama
    cache = GAACStaticCache(model.config, 64, calibration)
    with torch.no_grad():
        model(input_ids=_ids(20, 31), use_cache=True, **{cache_kwarg(model): cache})
    with pytest.raises(ValueError, match="negative integer"):
        cache.crop(2)
    assert cache.is_croppable and PlainStaticCache(model.config, 64).is_croppable


@pytest.fixture(scope="module")
def assistant():
    torch.manual_seed(1)
    return AutoModelForCausalLM.from_config(tiny_llama_config(num_hidden_layers=1), dtype=torch.bfloat16).eval()


@pytest.mark.parametrize("how", ["prompt_lookup", "assistant"])
def test_assisted_decoding_equals_the_twin(llama, assistant, how, monkeypatch):
    """Prompt lookup and an assistant model under `generate`'s compiled call (transformers sends the verification
    forwards, several tokens each, through it: they break the graph and run eagerly): tokens and every logit bit
    equal the twin's, and some crop cut into a finalized block."""
    model, calibration = llama
    cuts = []
    crop_storage = GAACStaticLayer._crop_storage

    def record(self, length, new_length):
        cuts.append((length, new_length))
        crop_storage(self, length, new_length)

    monkeypatch.setattr(GAACStaticLayer, "_crop_storage", record)
    ids = _ids(9, 32).repeat(1, 5) if how == "prompt_lookup" else _ids(40, 33)
    extra = {"prompt_lookup_num_tokens": 6} if how == "prompt_lookup" else {"assistant_model": assistant}
    cc = CompileConfig(fullgraph=False, backend="aot_eager", mode=None)
    cc._compile_all_devices = True
    (gaac, _), (plain, _) = _generate_both(model, calibration, ids, 160, compile_backend=None, do_sample=False,
                                           max_new_tokens=40, min_new_tokens=40, compile_config=cc, **extra)
    assert _same(gaac, plain)
    assert any(new // 16 < old // 16 for old, new in cuts), cuts


# --- pools -------------------------------------------------------------------------------------------------------
def test_raw_pool_overflow_is_raised_not_silent(llama):
    """A compiled hand-written loop that never checks (an eager forward checks when it builds its mask): the raw
    pool runs out inside the compiled step, tiles are dropped, and the next check says so instead of returning
    garbage quietly."""
    model, calibration = llama
    cache = GAACStaticCache(model.config, 160, calibration, raw_tiles=1)
    torch._dynamo.reset()
    step = torch.compile(model.forward, fullgraph=True, backend="aot_eager")
    _decode_logits(model, cache, _ids(5, 7), 90, step)
    assert cache.layers[0].counts[1] > cache.layers[0].n_raw
    with pytest.raises(GAACPoolOverflowError, match="dropped"):
        cache.check()
    with pytest.raises(GAACPoolOverflowError):
        cache.stats()


def test_raw_pool_grows_between_steps_in_generate(llama):
    """The same tiny raw pool under generate: the checks between steps grow it, nothing is dropped, and the
    output is still bit-identical to the twin."""
    model, calibration = llama
    kw = dict(max_new_tokens=120, min_new_tokens=120, output_scores=True, return_dict_in_generate=True,
              do_sample=False)
    name = cache_kwarg(model)
    cache = GAACStaticCache(model.config, 160, calibration, raw_tiles=1)
    out = model.generate(_ids(5, 8), **kw, **{name: cache})
    ref = model.generate(_ids(5, 8), **kw, **{name: PlainStaticCache(model.config, 160)})
    assert _same(out, ref)
    layer = cache.stats()["layers"][0]
    assert layer["raw_capacity"] > 1 and layer["raw_taken"] <= layer["raw_capacity"]


def test_stacked_raw_pool_grows_for_every_layer(llama):
    """A prefill that outgrows a 1-tile raw pool: the stacked pool is reallocated for all layers (one shape, so
    the layers stay views of one tensor), each layer's finalized blocks still decode to the KV put in, the blocks
    of other layers are untouched, and the unfinalized table entries point at the new scratch row."""
    model, calibration = llama
    cache = GAACStaticCache(model.config, 160, calibration, raw_tiles=1)
    gen = torch.Generator().manual_seed(21)
    kv = [(torch.randn(1, 2, 70, 64, generator=gen).to(torch.bfloat16),
           torch.randn(1, 2, 70, 64, generator=gen).to(torch.bfloat16)) for _ in cache.own_layers]
    for i, (k, v) in zip(cache.own_layers, kv):
        cache.layers[i].append(k, v)  # layer 0 grows the pool of layer 1 too, before layer 1 holds anything
    stack = cache._stack
    assert stack.n_raw > 1 and stack.raw_pool.shape[0] == len(cache.own_layers)
    assert all(cache.layers[i].record.raw_pool.data_ptr() == stack.raw_pool[j].data_ptr()
               for j, i in enumerate(cache.own_layers))
    for i, (k, v) in zip(cache.own_layers, kv):
        layer = cache.layers[i]
        assert layer.counts[1] > 0  # raw tiles taken, some before the last growth
        keys, values = layer.expand(4)
        assert torch.equal(keys[:, :, :64].view(torch.int16), k[:, :, :64].view(torch.int16))
        assert torch.equal(values[:, :, :64].view(torch.int16), v[:, :, :64].view(torch.int16))
        assert bool((layer.record.table[:, 4:] == -1 - stack.n_raw).all())
        assert layer.stats()["raw_capacity"] == stack.n_raw


def test_triton_plain_append_kernel_matches_torch_path():
    """The twin's CUDA append kernel (under Triton's interpreter here) writes what the torch path writes, rows at
    their own lengths, a length past the buffer clamped to its last row (the cache's check raises there)."""
    from triton_ops.gaac_append import plain_append

    gen = torch.Generator().manual_seed(8)
    b, h, s, d = 3, 2, 32, 96  # a head_dim that is not a power of two
    ref = torch.randn(2, b, h, s, d, generator=gen).to(torch.bfloat16)
    got = ref.clone().to(DEVICE)
    kv_len = torch.tensor([0, 17, 40], dtype=torch.int32)
    got_len = kv_len.clone().to(DEVICE)
    tokens = []
    for _ in range(3):
        k = torch.randn(b, h, 1, d, generator=gen).to(torch.bfloat16)
        v = torch.randn(b, h, 1, d, generator=gen).to(torch.bfloat16)
        tokens.append((k, v))
        torch.ops.gaac.plain_append_token(k, v, ref[0], ref[1], kv_len)
        plain_append(k.to(DEVICE), v.to(DEVICE), got[0], got[1], got_len)
        got_len.add_(1)
    assert torch.equal(kv_len, got_len.cpu()) and kv_len.tolist() == [3, 20, 43]
    assert torch.equal(got.cpu().view(torch.int16), ref.view(torch.int16))
    k_in = torch.cat([k for k, _ in tokens], 2)
    v_in = torch.cat([v for _, v in tokens], 2)
    assert torch.equal(ref[0, 0, :, :3], k_in[0]) and torch.equal(ref[1, 1, :, 17:20], v_in[1])
    assert torch.equal(ref[0, 2, :, 31], k_in[2, :, 2])  # 40, 41, 42 past the 32-row buffer: the last row


def test_stats_report_resident_and_allocated_bytes(llama):
    model, calibration = llama
    name = cache_kwarg(model)
    cache = GAACStaticCache(model.config, 256, calibration)
    with torch.no_grad():
        model(input_ids=_ids(70, 9), use_cache=True, **{name: cache})
    s = cache.stats()
    assert s["bf16_bytes"] == 2 * 70 * 2 * 2 * 64 * 2  # layers x tokens x K|V x heads x dim x bytes
    assert 0 < s["bytes"]["total"] < s["allocated_bytes"]["total"]
    assert s["layers"][0]["blocks"] == 4 and s["layers"][0]["tokens"] == 70


@pytest.mark.parametrize("format_version", [1, 2])
def test_triton_append_kernel_matches_torch_path(format_version):
    """The CUDA append kernel (under Triton's interpreter here) leaves the very same state as the torch path:
    tails, lengths, counters, the slots' bytes (format version 2: in fragment order) and the decoded finalized
    blocks, through several block completions."""
    from triton_ops.gaac_append import gaac_append

    from gaac_hf.format_v2 import fragment_map
    from gaac_triton_cases import realistic_kv

    gen = torch.Generator().manual_seed(3)
    b, h, d, blocks, cap = 2, 2, 128, 4, 48
    c = d
    p = 2 * h
    layout = TileLayout(c, cap)
    tokens, vals, base3, base4 = realistic_kv(b, h, 40, d, gen, even=format_version == 2)
    frag = fragment_map(c, DEVICE) if format_version == 2 else None

    def state(device):
        n_all = b * blocks * p
        kw = dict(device=device)
        return dict(tail_k=torch.zeros(b, h, 16, d, dtype=torch.bfloat16, **kw),
                    tail_v=torch.zeros(b, h, 16, d, dtype=torch.bfloat16, **kw),
                    kv_len=torch.zeros(b, dtype=torch.int32, **kw),
                    slot_pool=torch.zeros(n_all + 1, layout.slot_bytes, dtype=torch.uint8, **kw),
                    raw_pool=torch.zeros(n_all + 1, 16, c, dtype=torch.bfloat16, **kw),
                    table=torch.full((b, blocks, 2, h, 1), -1 - n_all, dtype=torch.int32, **kw),
                    slot_modes=torch.zeros(n_all + 1, 3, dtype=torch.int32, **kw),
                    raw_modes=torch.zeros(n_all + 1, 3, dtype=torch.int32, **kw),
                    counts=torch.zeros(2, dtype=torch.int32, **kw))

    ref, got = state("cpu"), state(DEVICE)
    for i in range(40):
        k, v = tokens[:, :, i:i + 1], vals[:, :, i:i + 1]
        torch.ops.gaac.append_token(k, v, ref["tail_k"], ref["tail_v"], ref["kv_len"], base3, base4,
                                    ref["slot_pool"], ref["raw_pool"], ref["table"], ref["slot_modes"],
                                    ref["raw_modes"], ref["counts"], format_version)
        gaac_append(k.to(DEVICE), v.to(DEVICE), got["tail_k"], got["tail_v"], got["kv_len"],
                    base3.reshape(p, c).to(DEVICE), base4.reshape(p, c).to(DEVICE), got["slot_pool"], got["raw_pool"],
                    got["table"], got["slot_modes"], got["raw_modes"], got["counts"], layout, format_version, frag)
        got["kv_len"].add_(1)
    got = {k: t.cpu() for k, t in got.items()}
    assert torch.equal(ref["kv_len"], got["kv_len"]) and torch.equal(ref["counts"], got["counts"])
    assert ref["counts"][0] > 0 and ref["counts"][1] > 0
    for s in (ref, got):  # the slots' bytes, in table order (the pools fill in another order on the two paths)
        entries = s["table"][:, :2].reshape(-1).long()
        s["slots"] = s["slot_pool"][entries.clamp(min=0)][entries >= 0]
    assert torch.equal(ref["slots"], got["slots"])
    for s in (ref, got):
        s["kv"] = ops.blocks_of(ops.expand_tiles(s["table"][:, :2].reshape(b, 2, p), s["slot_pool"], s["raw_pool"],
                                                 base3.reshape(p, c), base4.reshape(p, c), format_version), h)
    assert torch.equal(ref["kv"][:, 0].view(torch.int16), tokens[:, :, :32].view(torch.int16))
    assert torch.equal(ref["kv"][:, 1].view(torch.int16), vals[:, :, :32].view(torch.int16))
    assert torch.equal(got["kv"].view(torch.int16), ref["kv"].view(torch.int16))
    assert torch.equal(got["tail_k"][:, :, :8].view(torch.int16), tokens[:, :, 32:].view(torch.int16))


def test_triton_attention_reads_device_lengths():
    """The Triton kernel over a static layout (table of NB_cap blocks, 16-row tail, per-row kv_len on the device):
    compressed equals plain bit for bit, for rows of different lengths, at one fixed split count."""
    from triton_ops.gaac_attention import fused_compressed_attention, fused_plain_attention

    from gaac_triton_cases import realistic_kv

    gen = torch.Generator().manual_seed(4)
    b, h, nrep, d, cap_blocks = 2, 2, 2, 64, 5
    s_cap = cap_blocks * 16
    key, value, base3, base4 = realistic_kv(b, h, s_cap, d, gen)
    kv_len = torch.tensor([45, 70], dtype=torch.int32)
    # compress every complete block of each row with the torch path, build the 16-row tails
    p = 2 * h
    tiles = ops.tiles_of(key, value)  # [B, NB, P, 16, C]
    n_all = b * cap_blocks * p
    layout = TileLayout(d, 32)
    slot_pool = torch.zeros(n_all + 1, layout.slot_bytes, dtype=torch.uint8)
    raw_pool = torch.zeros(n_all + 1, 16, d, dtype=torch.bfloat16)
    table = torch.full((b, cap_blocks, 2, h, 1), -1 - n_all, dtype=torch.int32)
    counts = torch.zeros(2, dtype=torch.int32)
    modes = torch.zeros(n_all + 1, 3, dtype=torch.int32)
    ops.store_blocks(tiles, torch.arange(b), torch.zeros(b, dtype=torch.long), base3.reshape(p, d),
                     base4.reshape(p, d), 32, slot_pool, raw_pool, table, modes, modes.clone(), counts)
    assert counts[0] > 0 and counts[1] > 0  # both storage classes
    tail_k = torch.stack([key[i, :, (n // 16) * 16:(n // 16) * 16 + 16] for i, n in enumerate(kv_len.tolist())])
    tail_v = torch.stack([value[i, :, (n // 16) * 16:(n // 16) * 16 + 16] for i, n in enumerate(kv_len.tolist())])
    q = torch.randn(b, h * nrep, d, generator=gen).to(torch.bfloat16)
    mask = torch.ones(b, s_cap, dtype=torch.bool)
    mask[0, :3] = False
    to = lambda t: t.to(DEVICE)  # noqa: E731
    for splits in (1, 3):
        got = fused_compressed_attention(to(q), to(slot_pool), to(raw_pool), to(table), to(tail_k), to(tail_v),
                                         to(base3), to(base4), 0.125, layout, to(mask), kv_len=to(kv_len),
                                         num_splits=splits).cpu()
        ref = fused_plain_attention(to(q), to(key), to(value), 0.125, layout, to(mask), kv_len=to(kv_len),
                                    num_splits=splits).cpu()
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    # and it is attention over each row's own tokens
    for i, n in enumerate(kv_len.tolist()):
        k = key[i, :, :n].float().repeat_interleave(nrep, 0)
        v = value[i, :, :n].float().repeat_interleave(nrep, 0)
        s = torch.einsum("hd,hsd->hs", q[i].float(), k) * 0.125
        s = s.masked_fill(~mask[i, :n], float("-inf"))
        want = torch.einsum("hs,hsd->hd", s.softmax(-1), v)
        assert ((got[i].float() - want).norm() / want.norm()).item() < 1e-2


# --- bad input ----------------------------------------------------------------------------------------------------
def test_prompt_longer_than_max_cache_len_is_rejected_before_any_work(llama):
    model, calibration = llama
    cache = GAACStaticCache(model.config, 32, calibration)
    with pytest.raises(GAACCacheFullError, match="max_cache_len=32"):
        model.generate(_ids(40, 10), max_new_tokens=2, **{cache_kwarg(model): cache})
    assert not cache.layers[0].is_initialized


def test_generation_past_max_cache_len_is_an_error(llama):
    model, calibration = llama
    cache = GAACStaticCache(model.config, 40, calibration)
    with pytest.raises(GAACCacheFullError, match="max_cache_len=40"):
        model.generate(_ids(30, 11), max_new_tokens=30, min_new_tokens=30, do_sample=False,
                       **{cache_kwarg(model): cache})


def test_batch_larger_than_max_batch_size_is_rejected(llama):
    model, calibration = llama
    cache = GAACStaticCache(model.config, 64, calibration, max_batch_size=2)
    with pytest.raises(ValueError, match="larger than max_batch_size=2"):
        model.generate(_ids(10, 12, batch=3), max_new_tokens=2, **{cache_kwarg(model): cache})
    assert not cache.layers[0].is_initialized


def test_calibration_for_another_model_is_rejected(llama):
    model, calibration = llama
    with pytest.raises(CalibrationMismatchError):
        GAACStaticCache(tiny_llama_config(num_key_value_heads=4), 64, calibration)
    with pytest.raises(TypeError, match="GAACCalibration"):
        GAACStaticCache(model.config, 64, 3.5)


def test_format_2_without_a_fused_reader_is_refused(llama, calibration_v2, monkeypatch):
    """Forcing format version 2 where only the Triton kernels run (a GPU other than Hopper; here the Triton backend
    forced on the CPU): a clear error at the first update, before any work, instead of an uncapturable step."""
    model, _ = llama
    monkeypatch.setenv("GAAC_HF_BACKEND", "triton")
    cache = GAACStaticCache(model.config, 64, calibration_v2, format_version=2)
    kv = torch.zeros(1, 2, 5, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no fused kernel reads format version 2.*format_version=1"):
        cache.update(kv, kv, 0)
    auto = GAACStaticCache(model.config, 64, calibration_v2)  # the default picks version 1 there
    auto.update(kv, kv, 0)
    assert auto.stats()["format_version"] == 1


def test_stock_attention_is_refused(llama):
    """The static caches hand their layers to the "gaac" attention; any other attention would read a 16-row tail."""
    model, calibration = llama
    model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(ValueError, match="gaac"):
            model.generate(_ids(10, 13), max_new_tokens=2,
                           **{cache_kwarg(model): GAACStaticCache(model.config, 64, calibration)})
    finally:
        model.set_attn_implementation("gaac")


@pytest.fixture(scope="module")
def bench():
    """benchmarks/generate.py as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _all_tensors(cache) -> dict:
    """Every buffer of the cache (the stacked ones hold all its layers)."""
    out = {name: t.clone() for name, t in vars(cache._stack).items() if isinstance(t, torch.Tensor)}
    assert out
    return out


@pytest.mark.parametrize("cls", ["gaac", "plain"])
def test_split_timing_leaves_the_cache_as_it_found_it(llama, bench, cls):
    """The benchmark's op timing appends tokens (one of them completes a block) and restores every bit of the
    cache afterwards: pools, counters, tails, table, lengths (the later steps and the lossless check rely on it)."""
    model, calibration = llama
    cache = GAACStaticCache(model.config, 96, calibration) if cls == "gaac" else PlainStaticCache(model.config, 96)
    kv = [(torch.randn(1, 2, 20, 64).to(torch.bfloat16), torch.randn(1, 2, 20, 64).to(torch.bfloat16))
          for _ in range(2)]
    bench.fill(cache, kv, 37, torch.device("cpu"))  # 2 finalized blocks + 5 tokens in the tail
    before = _all_tensors(cache)
    t = bench.time_update_and_attention(cache, kv, torch.device("cpu"), reps=2)
    after = _all_tensors(cache)
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value.view(torch.uint8), after[key].view(torch.uint8)), key
    assert t["attention"] > 0 and t["update"] > 0
    if cls == "gaac":  # the finalizing call did finalize: every tile position of the block, in both layers
        assert t["update_finalizing"] > 0
        assert t["finalized_tiles"] == 2 * cache.layers[0].tile_positions


def test_benchmark_diagnosis_tells_where_bits_part(llama, bench):
    """`logit_diff` names the first differing step; `diagnose` finds the first layer whose attention output
    differs when one cache's KV is changed, and says the fill differs."""
    a = torch.randn(4, 1, 8).to(torch.bfloat16)
    b = a.clone()
    assert bench.logit_diff(a, b) == {"tokens": True, "logit_bits": True}
    b[2, 0, 3] += 1
    d = bench.logit_diff(a, b)
    assert d["first_step"] == 2 and d["max_abs_diff"] > 0 and not d["logit_bits"]
    model, calibration = llama
    kv = [(torch.randn(1, 2, 20, 64).to(torch.bfloat16), torch.randn(1, 2, 20, 64).to(torch.bfloat16))
          for _ in range(2)]
    gaac, twin = GAACStaticCache(model.config, 96, calibration), PlainStaticCache(model.config, 96)
    for cache in (gaac, twin):
        bench.fill(cache, kv, 40, torch.device("cpu"))
    same = bench.diagnose(model, gaac, twin, 40, torch.device("cpu"))
    assert same["fill"] == {"equal": True} and same["eager_gaac_vs_eager_twin"]["attention_bits"]
    assert same["eager_gaac_vs_eager_twin"]["logit_bits"]
    twin.layers[1].keys[0, 0, 3, 0] += 1  # layer 1 of the twin now holds other KV
    d = bench.diagnose(model, gaac, twin, 40, torch.device("cpu"))
    assert d["fill"] == {"equal": False, "first_layer": 1, "first_chunk": [0, 40]}
    assert d["eager_gaac_vs_eager_twin"]["first_layer"] == 1 and not d["eager_gaac_vs_eager_twin"]["logit_bits"]


def test_generate_benchmark_runs_tiny(tmp_path, bench):
    """benchmarks/generate.py end to end at tiny scale on the CPU (what the lead runs on the H200 at 16K-128K)."""
    out = tmp_path / "generate.json"
    res = bench.main(["--tiny", "--contexts", "40", "--steps", "3", "--warmup", "1", "--diag", "--out", str(out)])
    row = res["contexts"]["40"]
    assert row["lossless_vs_twin"] == {"tokens": True, "logit_bits": True}
    assert row["captured_lossless_vs_twin"] == {"tokens": True, "logit_bits": True}
    assert row[bench.VARIANTS["captured"]]["start"] > 40 and 0 < row[bench.VARIANTS["captured"]]["host_share"] <= 1
    assert row[bench.VARIANTS["captured"]]["pipelined_ms"] > 0 and row["captured_pipelined_speedup_vs_twin"] > 0
    for label in bench.VARIANTS.values():
        assert row[label]["step_ms"] > 0
    assert 0 < row["resident_kv"]["gaac_bytes"] < row["resident_kv"]["bf16_bytes"]
    assert row["split"]["finalize_ms"] > 0 and row["twin_split"]["attention_ms"] > 0
    assert row["host_profile"]["guards_us"] > 0 and row["twin_host_profile"]["aot_prologue_us"] > 0
    d = row["diag"]
    assert d["fill"] == {"equal": True} and d["eager_gaac_vs_eager_twin"]["logit_bits"]
    assert d["compiled_vs_eager_gaac"]["logit_bits"] and d["compiled_steps_kv"] == {"equal": True}
    assert out.exists()
    only = bench.main(["--tiny", "--contexts", "40", "--steps", "2", "--warmup", "1", "--variants", "gaac", "twin",
                       "--skip", "twin", "--out", str(out)])["contexts"]["40"]
    assert bench.VARIANTS["gaac"] in only and bench.VARIANTS["twin"] not in only
    assert bench.VARIANTS["static"] not in only
