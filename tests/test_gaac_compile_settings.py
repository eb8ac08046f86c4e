"""gaac_hf.compile_settings: the compiled decode step without Dynamo's guards on the model's modules."""

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, CompileConfig

import gaac_hf
from gaac_hf import compile_settings
from gaac_hf.calibrate import calibrate
from gaac_hf.calibration import GAACCalibration
from gaac_hf.model_layers import cache_kwarg
from gaac_hf.static_cache import GAACStaticCache, PlainStaticCache
from hf_common.testing import tiny_llama_config


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 200, (1, 96), generator=torch.Generator().manual_seed(1))
    calibration = calibrate(model, [ids[0]], "random ids")
    calibration = GAACCalibration(dataclasses.replace(calibration.config, escape_capacity=16), calibration.base3,
                                  calibration.base4)
    model.set_attn_implementation("gaac")
    return model, calibration


def test_kwargs_spell_reduce_overhead_as_an_option():
    kw = gaac_hf.compile_kwargs()
    assert kw["fullgraph"] and kw["backend"] == "inductor" and "mode" not in kw  # torch refuses mode + options
    assert kw["options"]["triton.cudagraphs"] is True
    assert torch._inductor.list_mode_options("reduce-overhead") == {"triton.cudagraphs": True}
    assert kw["options"]["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
    assert "options" not in gaac_hf.compile_kwargs(backend="aot_eager", skip_module_guards=False)
    assert compile_settings.describe(kw)["options"]["guard_filter_fn"] == "skip_guard_on_all_nn_modules_unsafe"
    cc = gaac_hf.compile_config()
    assert isinstance(cc, CompileConfig) and cc.mode is None and cc.options == kw["options"]


def _counting_filter(monkeypatch):
    seen = {"kept": 0, "dropped": 0}
    inner = torch.compiler.skip_guard_on_all_nn_modules_unsafe

    def count(entries):
        keep = inner(entries)
        seen["kept"] += sum(keep)
        seen["dropped"] += len(keep) - sum(keep)
        return keep

    monkeypatch.setattr(compile_settings, "_guard_filter", lambda: count)
    return seen


def test_generate_with_the_config_drops_module_guards_and_stays_lossless(llama, monkeypatch):
    """generate(..., compile_config=gaac_hf.compile_config(...)): the step compiles with the model's module guards
    dropped (the filter saw and dropped some, kept the rest) and GAAC still equals its plain twin bit for bit."""
    model, calibration = llama
    seen = _counting_filter(monkeypatch)
    ids = torch.randint(3, 200, (1, 21), generator=torch.Generator().manual_seed(2))
    outs = []
    for make in (lambda: GAACStaticCache(model.config, 64, calibration), lambda: PlainStaticCache(model.config, 64)):
        torch._dynamo.reset()
        cc = gaac_hf.compile_config(backend="aot_eager")
        cc._compile_all_devices = True  # generate compiles on CUDA by itself; on the CPU it has to be asked
        outs.append(model.generate(ids, max_new_tokens=14, min_new_tokens=14, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True, compile_config=cc, **{cache_kwarg(model): make()}))
    assert seen["dropped"] > seen["kept"] > 0  # most guards are the model's; the cache's and the inputs' stay
    a, b = outs
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.scores, b.scores))


def test_a_new_input_shape_still_recompiles(llama):
    """Skipping module guards keeps the input guards: a batch of another size is not run through the old graph."""
    model, _ = llama
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    step = torch.compile(model.forward, **gaac_hf.compile_kwargs(backend="aot_eager"))
    with torch.no_grad():
        for batch in (1, 1, 2):
            step(input_ids=torch.ones(batch, 5, dtype=torch.long))
    assert counters["stats"]["unique_graphs"] == 2


def test_replay_graphs_settings():
    """graphs="replay": the CUDA graph recorded by gaac_hf's backend instead of inductor's graph trees (so no
    `triton.cudagraphs` option); the module-guard filter stays; an unknown value is refused."""
    from gaac_hf.graph_replay import graph_replay_backend

    kw = gaac_hf.compile_kwargs(graphs="replay")
    assert kw["backend"] is graph_replay_backend and kw["options"] == {
        "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    assert compile_settings.describe(kw)["backend"] == "graph_replay_backend"
    assert gaac_hf.compile_kwargs(graphs="replay", cudagraphs=False)["backend"] == "inductor"
    assert gaac_hf.compile_config(graphs="replay").backend is graph_replay_backend
    with pytest.raises(ValueError, match="graphs"):
        gaac_hf.compile_kwargs(graphs="forest")


def test_generate_through_the_replay_backend(llama):
    """generate with the replay backend (aot_eager inside, a recorder that keeps the graph's function on the CPU):
    the step runs directly twice, is recorded once and replayed for every later token, with parameters and the
    cache's buffers read in place and the token and positions copied in; tokens and logit bits equal the same
    compiled step without replay, and GAAC equals its twin."""
    import functools

    from torch._dynamo.backends.registry import lookup_backend

    from gaac_hf.graph_replay import graph_replay_backend
    from gaac_hf.testing import KeepingRecorder

    model, calibration = llama
    ids = torch.randint(3, 200, (1, 21), generator=torch.Generator().manual_seed(2))
    outs, recorders = [], []
    for make, replay in ((lambda: GAACStaticCache(model.config, 64, calibration), True),
                         (lambda: PlainStaticCache(model.config, 64), True),
                         (lambda: GAACStaticCache(model.config, 64, calibration), False)):
        torch._dynamo.reset()
        recorder = KeepingRecorder(outputs="list")
        backend = functools.partial(graph_replay_backend, recorder=recorder, compiler=lookup_backend("aot_eager")) \
            if replay else "aot_eager"
        cc = gaac_hf.compile_config(backend=backend)
        cc._compile_all_devices = True  # generate compiles on CUDA by itself; on the CPU it has to be asked
        outs.append(model.generate(ids, max_new_tokens=14, min_new_tokens=14, do_sample=False, output_scores=True,
                                   return_dict_in_generate=True, compile_config=cc, **{cache_kwarg(model): make()}))
        recorders.append(recorder)
    for r in recorders[:2]:  # 13 compiled decode steps (the first token comes from the eager prefill)
        assert r.recorded == 1 and r.replays == 13 - 2
    for other in outs[1:]:
        assert torch.equal(outs[0].sequences, other.sequences)
        assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(outs[0].scores, other.scores))


def test_each_compile_needs_its_own_kwargs(monkeypatch, tmp_path):
    """torch.compile pops guard_filter_fn from the options it is given (so a reused dict loses it): compile_kwargs()
    gives a new dict per call, CapturedStep leaves a caller's dict intact, and every compiled variant of
    benchmarks/generate.py gets the filter (sessions 4-15 reused one dict: only the first variant had it)."""
    import importlib.util
    import pathlib

    kw = gaac_hf.compile_kwargs(backend="aot_eager")
    torch.compile(lambda x: x + 1, **kw)
    assert "guard_filter_fn" not in kw["options"]  # torch's behaviour, the reason for the rest
    assert "guard_filter_fn" in gaac_hf.compile_kwargs(backend="aot_eager")["options"]
    model = AutoModelForCausalLM.from_config(tiny_llama_config(), dtype=torch.bfloat16).eval()
    mine = gaac_hf.compile_kwargs(backend="aot_eager")
    gaac_hf.CapturedStep(model, PlainStaticCache(model.config, 32), compile=mine)
    assert "guard_filter_fn" in mine["options"]
    seen = []
    real = torch.compile

    def spy(fn=None, **kwargs):
        seen.append(dict(kwargs.get("options") or {}))
        return real(fn, **kwargs)

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "generate.py"
    spec = importlib.util.spec_from_file_location("generate_bench_spy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench.torch, "compile", spy)
    bench.main(["--tiny", "--contexts", "40", "--steps", "2", "--warmup", "1", "--variants", "gaac", "twin", "static",
                "--skip-module-guards", "--out", str(tmp_path / "g.json")])
    assert len(seen) >= 3 and all("guard_filter_fn" in o for o in seen), seen


def test_a_left_padded_batch_through_the_replay_backend(llama):
    """A left-padded batch of 2 under the replay backend: one recording (the step's inputs keep their shapes), and
    the tokens and logit bits of the same compiled step without replay."""
    import functools

    from torch._dynamo.backends.registry import lookup_backend

    from gaac_hf.graph_replay import graph_replay_backend
    from gaac_hf.testing import KeepingRecorder

    model, calibration = llama
    ids = torch.randint(3, 200, (2, 21), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    outs, recorder = [], KeepingRecorder(outputs="list")
    for backend in (functools.partial(graph_replay_backend, recorder=recorder, compiler=lookup_backend("aot_eager")),
                    "aot_eager"):
        torch._dynamo.reset()
        cc = gaac_hf.compile_config(backend=backend)
        cc._compile_all_devices = True
        outs.append(model.generate(ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                   output_scores=True, return_dict_in_generate=True, compile_config=cc,
                                   **{cache_kwarg(model): GAACStaticCache(model.config, 64, calibration)}))
    assert recorder.recorded == 1 and recorder.replays == 11 - 2
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    assert all(torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(outs[0].scores, outs[1].scores))


def _generate_bench(name: str):
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "generate.py"
    spec = importlib.util.spec_from_file_location(name, path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_generate_benchmark_passes_inductor_options_to_every_compile(monkeypatch, tmp_path):
    """`generate.py --inductor JSON`: the options reach every compiled variant (GAAC, its twin, compiled
    StaticCache and the CapturedStep ones) beside the guard filter, and without --skip-module-guards they replace
    `mode="reduce-overhead"` by the CUDA-graph option (torch.compile takes a mode or options, not both). The spy
    records what inductor would get and compiles with aot_eager (inductor's C++ build is too slow for the CPU)."""
    bench = _generate_bench("generate_bench_inductor")
    seen, real = [], torch.compile

    def spy(fn=None, **kwargs):
        seen.append(kwargs)
        return real(fn, backend="aot_eager", fullgraph=kwargs.get("fullgraph", False))

    monkeypatch.setattr(bench.torch, "compile", spy)
    monkeypatch.setattr(gaac_hf.captured_step.torch, "compile", spy)
    extra = '{"coordinate_descent_tuning": true}'
    common = ["--tiny", "--contexts", "40", "--steps", "2", "--warmup", "1", "--backend", "inductor",
              "--inductor", extra]
    bench.main(common + ["--variants", "gaac", "twin", "static", "captured", "--skip-module-guards",
                         "--out", str(tmp_path / "a.json")])
    assert len(seen) >= 4 and all(kw["options"]["coordinate_descent_tuning"] is True for kw in seen), seen
    assert all("guard_filter_fn" in kw["options"] for kw in seen)
    seen.clear()
    bench.main(common + ["--variants", "static", "--out", str(tmp_path / "b.json")])
    assert seen and all("mode" not in kw and kw["options"] == {"triton.cudagraphs": True,
                                                                "coordinate_descent_tuning": True} for kw in seen)


def test_kernel_kinds_of_the_generate_benchmark_profile():
    """generate.py's GPU profile: kernels sorted into kinds by name (our attention and append kernels, cuBLAS /
    cuTLASS matrix products, inductor's Triton kernels, copies), per-step milliseconds, the longest first."""
    bench = _generate_bench("generate_bench_kinds")
    kinds = {n: bench.kernel_kind(n) for n in (
        "gaac_decode_split", "gaac_combine", "_split_kernel", "_append_kernel", "_encode_kernel",
        "sm90_xmma_gemm_bf16bf16_bf16f32", "nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT", "gemv2T_kernel_val",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "Memcpy DtoD (Device -> Device)", "void at::native::x")}
    assert kinds == {"gaac_decode_split": "attention", "gaac_combine": "attention", "_split_kernel": "attention",
                     "_append_kernel": "cache_update", "_encode_kernel": "cache_update",
                     "sm90_xmma_gemm_bf16bf16_bf16f32": "matmul", "nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT": "matmul",
                     "gemv2T_kernel_val": "matmul", "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0":
                     "fused_pointwise", "Memcpy DtoD (Device -> Device)": "memcpy_memset",
                     "void at::native::x": "other"}
    out = bench.summarize_kernels([("gaac_decode_split", 600.0, 96), ("gemv2T_kernel_val", 3000.0, 672),
                                   ("triton_poi_fused_1", 300.0, 96)], steps=3)
    assert out["total_ms"] == 1.3 and out["kernels_per_step"] == 288.0 and out["by_kind_ms"] == {"matmul": 1.0, "attention": 0.2, "fused_pointwise": 0.1}
    assert out["top"][0] == ["gemv2T_kernel_val", 1.0, 224.0]
    spread = bench.kernel_spread([("gaac_decode_split", float(us)) for us in range(60, 70)] +
                                 [("gaac_combine", 3.0), ("gemv2T_kernel_val", 9.0)])
    assert spread == {"gaac_decode_split": {"n": 10, "p10": 61.0, "p50": 65.0, "p90": 69.0, "max": 69.0},
                      "gaac_combine": {"n": 1, "p10": 3.0, "p50": 3.0, "p90": 3.0, "max": 3.0}}
