"""The session-19 probes' host-side pieces (the kernels they time need an H200): the stream probe's layouts, the split
phases read from globaltimer stamps, and generate.py's per-context refill and eager Python profile."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _module(rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("layout", ["rows", "pool", "head_major", "kv_one", "two_units"])
def test_stream_probe_layouts_cover_their_bytes_once(layout):
    """Every layout's chunks tile its span exactly (no byte read twice, none left out), and a warp's run of units is
    a run of one head's blocks."""
    sp = _module("benchmarks/stream_probe.py", "stream_probe_bench")
    offs, chunk, span = sp.offsets(layout)
    starts = offs.flatten().sort().values
    assert starts[0] == 0 and int(starts[-1]) + chunk == span
    assert torch.equal(starts[1:] - starts[:-1], torch.full((starts.numel() - 1,), chunk, dtype=starts.dtype))
    units_per_head = sp.BLOCKS // (2 if layout == "two_units" else 1)
    assert offs.shape[0] == sp.HEADS * units_per_head


def test_stream_probe_variants_fit_shared_memory():
    sp = _module("benchmarks/stream_probe.py", "stream_probe_bench2")
    import torch

    table = torch.arange(sp.BLOCKS * 2 * sp.HEADS).view(sp.BLOCKS, 2, sp.HEADS)  # the real layout's order
    for label, (_, _, stages, warps, *_) in sp.VARIANTS.items():
        g = sp.geometry(label, table)
        assert g["smem"] <= 227 * 1024, label
        assert g["ring_off"] + stages * g["stage"] <= g["warp_bytes"] and g["offs"].shape[1] * g["gap"] <= g["stage"]
        assert g["chunk"] <= g["gap"] and int(g["offs"].max()) + g["chunk"] <= g["span"], label
        assert int(g["offs"].min()) >= 0 and g["chunk"] % 16 == 0, label


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("defines", [("CHUNKS=2", "STAGES=2", "CPASYNC=0"), ("CHUNKS=1", "STAGES=3", "CPASYNC=1",
                                                                             "DELAY=2000")])
def test_stream_probe_kernel_compiles_for_sm90a(defines, tmp_path):
    out = subprocess.run(["nvcc", "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                          *[f"-D{d}" for d in defines], "-o", str(tmp_path / "p.cubin"), "-x", "cu",
                          str(ROOT / "benchmarks/device/stream_probe.cu")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "0 bytes spill stores" in out.stderr


def test_split_phases_from_stamps():
    """`finish_by_rank`'s phases: first-unit latency, streaming time and per-unit pace, the combine's start, all
    after the first entry; splits that never started are left out."""
    import gaac_cuda
    from benchmarks.probe_runner import finish_by_rank

    pl = gaac_cuda.plan(1, 8, 4, 128, 65536, "cpu", slot_bytes=2944, format_version=3, nsplit=198)
    items = pl.items
    tr = torch.full((gaac_cuda.trace_size(pl),), -(2 ** 62), dtype=torch.int64)
    st = torch.zeros(items, 4, dtype=torch.int64)
    st[:, 0] = 1000 + (torch.arange(items) % 3) * 100  # entries at 1.0-1.2 µs
    st[:, 1] = st[:, 0] + 4000
    st[:, 2] = st[:, 1] + 50000 + (torch.arange(items) % 2) * 2000
    st[:, 3] = torch.arange(items) // pl.warps
    st[-1, 1:3] = -(2 ** 62)  # a split that did not run
    tr[:4 * items] = st.flatten()
    tr[4 * items:] = 60000
    fin = finish_by_rank(tr, pl, 8, 65536)
    ph = fin["phases"]
    # done: 54.0-56.2 µs after the first entry (entries 0-0.2 µs after it, odd items 2 µs longer): mean ~55.1; every
    # KV head's splits alike (each head's 198 items hold both parities)
    assert fin["done_max_us"] == 56.2 and abs(fin["done_mean_us"] - 55.1) < 0.02
    assert fin["balance_bound_us"] == round(56.2 - fin["done_mean_us"], 2) and fin["done_p10_us"] <= fin["done_p90_us"]
    assert sorted(fin["by_kv_head"]) == list(range(8)) and sum(c for _, _, c in fin["by_kv_head"].values()) == items - 1
    assert ph["entry_max_us"] == 0.2 and ph["first_ready_p50_us"] == 4.0
    assert ph["stream_p50_us"] in (50.0, 52.0) and ph["stream_max_us"] == 52.0
    assert ph["stream_us_per_unit_p50"] == round(ph["stream_p50_us"] / (4096 / 198 - 1), 3)
    assert ph["combine_start_min_us"] == 59.0


def test_generate_refills_captured_caches_per_context_and_profiles_eager_steps(tmp_path, monkeypatch):
    """generate.py --tiny over two contexts with the captured variant alone: its cache is filled at each context
    (the second context's step starts at that context, not where the first left off); --python-profile records the
    eager steps' functions."""
    bench = _module("benchmarks/generate.py", "generate_bench_refill")
    fills = []
    real_fill = bench.fill
    monkeypatch.setattr(bench, "fill", lambda cache, kv, context, device: (fills.append((type(cache).__name__, context)),
                                                                           real_fill(cache, kv, context, device)))
    out = tmp_path / "g.json"
    bench.main(["--tiny", "--contexts", "40", "72", "--steps", "2", "--warmup", "1", "--eager-steps", "2",
                "--variants", "captured", "eager-gaac", "--python-profile", "--out", str(out)])
    res = json.loads(out.read_text())
    assert ("GAACStaticCache", 40) in fills and ("GAACStaticCache", 72) in fills
    for ctx in ("40", "72"):
        row = res["contexts"][ctx]
        assert row["captured GAACStaticCache (CapturedStep)"]["start"] == int(ctx)
        prof = row["eager GAACCache + gaac"]["python_profile"]
        assert prof["steps"] == 16 and prof["own_us"] and any("gaac_hf" in k for k in prof["cumulative_us"])


def test_issue_probe_variants_differ_only_in_the_issue_path():
    """`warps_probe.py --set issue`: the general issue path is the default plan with GAAC_FAST_ISSUE=0 and nothing
    else (same splits, same buffers), so the probe's bit check against one twin covers both."""
    import gaac_cuda
    from benchmarks.warps_probe import ISSUE_GAAC

    plans = {label: gaac_cuda.plan(1, 8, 4, 128, 65536, "cpu", slot_bytes=2960, format_version=3, nsplit=198,
                                   **kw) for label, kw in ISSUE_GAAC.items()}
    base, general = plans["gaac"], plans["gaac_general_issue"]
    assert sorted(general.options) == sorted(base.options + ("-DGAAC_FAST_ISSUE=0",))
    assert (general.nsplit, general.buf_bytes, general.smem) == (base.nsplit, base.buf_bytes, base.smem)


def test_w16_probe_plans_the_twin_with_the_variants_warps():
    """`warps_probe.py --set w16`: the 16-warp compressed plan at 9/3/64 and the twin its bits are checked against
    split alike and group their splits alike (CTA merge by 16-warp CTAs), and both fit one CTA per SM."""
    import gaac_cuda
    from benchmarks.probe_runner import SPLIT_KEYS
    from benchmarks.warps_probe import W16_GAAC

    kw = dict(W16_GAAC["gaac_16_warps"])
    kw["nsplit"] = kw["nsplit"](528)  # the shape's 12-warp split count on 132 SMs
    gaac = gaac_cuda.plan(1, 3, 3, 64, 65536, "cpu", slot_bytes=1456, format_version=3, **kw)
    twin = gaac_cuda.plan(1, 3, 3, 64, 65536, "cpu", plain=True,
                          **{k: v for k, v in kw.items() if k in SPLIT_KEYS})
    assert (gaac.warps, gaac.nsplit, gaac.cta_merge) == (twin.warps, twin.nsplit, twin.cta_merge) == (16, 704, True)
    assert max(gaac.warps * gaac.warp_bytes, twin.warps * twin.warp_bytes) + 1024 <= 227 * 1024


def test_stream_probe_phases_from_stamps():
    """`stream_probe.phases`: per-warp stamps (entry, first unit landed, done; done 0 for a warp with no units) ->
    first-ready and done times after the first entry, and the per-unit pace; `phase_cells` prints them."""
    import torch

    sp = _module("benchmarks/stream_probe.py", "stream_probe_bench3")
    tr = torch.tensor([[1000, 3000, 21000], [2000, 5000, 43000], [1500, 4000, 31000], [1200, 0, 0]])  # ns
    ph = sp.phases(tr.flatten(), per_warp=11)  # the fourth warp had no units
    assert (ph["first_ready_p50_us"], ph["first_ready_max_us"]) == (3.0, 4.0)
    assert (ph["done_p50_us"], ph["done_max_us"]) == (30.0, 42.0)
    assert ph["stream_us_per_unit_p50"] == 2.7  # median of 18, 38, 27 us over 10 units
    assert sp.phase_cells(ph) == "3.0 / 4.0 | 2.7 | 30.0 / 42.0" and sp.phase_cells(None) == " | | "


@pytest.mark.parametrize("probe_set, shapes", [("bounds", (4, 1, 5, 2, 0, 3)), ("w16", (3,))])
def test_prepared_probe_sets_plan_at_their_shapes(probe_set, shapes):
    """Every variant of the device calls' probe sets (`next_h200.sh bounds128`, ...) plans on each of their
    shapes as `probe_runner.run_probe` plans it on the H200 (its split count, the twin planned alike with the
    SPLIT_KEYS options, so the two split and merge alike), within one SM's shared memory: a bad option or a plan
    that does not fit fails here, not in device time."""
    import gaac_cuda
    from benchmarks.probe_runner import SPLIT_KEYS
    from benchmarks.format_v2_probe import SHAPES
    from benchmarks.warps_probe import SETS

    gaac_variants, twin_variants, traced = SETS[probe_set]
    assert set(traced) <= set(gaac_variants)
    for si in shapes:
        _, hq, hkv, d, b, s = SHAPES[si]
        slot = 2944 if d == 128 else 1472
        nsplit = gaac_cuda.plan(b, hkv, hq // hkv, d, s, "cpu", plain=True).nsplit
        for variants, plain in ((gaac_variants, False), (twin_variants, True)):
            for label, kw in variants.items():
                n = kw.get("nsplit", nsplit)
                opts = {**{k: v for k, v in kw.items() if k not in ("mask", "combine")},
                        "nsplit": n(nsplit) if callable(n) else n}
                pl = gaac_cuda.plan(b, hkv, hq // hkv, d, s, "cpu", plain=plain,
                                    **({} if plain else {"slot_bytes": slot, "format_version": 3}), **opts)
                assert pl.smem <= 227 * 1024 and pl.grid >= 1, (probe_set, si, label)
                if not plain:
                    twin = gaac_cuda.plan(b, hkv, hq // hkv, d, s, "cpu", plain=True,
                                          **{k: v for k, v in opts.items() if k in SPLIT_KEYS})
                    # the same bits: the same splits, merged alike (by CTAs of the same size where merged)
                    assert (twin.nsplit, twin.cta_merge, twin.fused_combine) == (
                        pl.nsplit, pl.cta_merge, pl.fused_combine), label
                    assert twin.warps == pl.warps or not pl.cta_merge, label
