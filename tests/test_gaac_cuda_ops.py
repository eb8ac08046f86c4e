"""The CUDA C++ decode-attention kernel (`gaac_cuda`): bit-exact twin checks on the GPU, compile checks anywhere
`nvcc` is installed, plan validation on the CPU."""

import os
import re
import shutil
import subprocess

import pytest
import torch

from gaac_cuda import available, decode_attention, plain_decode_attention, plan
from gaac_cuda.decode_attention import _SOURCE_FILE, CONST_LAYOUT, PDL, SPLIT_WARPS, STATIC_SMEM
from gaac_hf.format import TileLayout
from gaac_triton_cases import compress_kv, realistic_kv

gpu = pytest.mark.skipif(not available(), reason="needs a Hopper GPU with NVRTC")
CUOBJDUMP = None
try:
    import triton

    CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
except ImportError:
    pass


def bits(x):
    return x.view(torch.int16)


def test_the_caches_choose_format_2_where_the_cuda_kernel_reads_it(monkeypatch, tiny_llama):
    """The storage choice (`gaac_hf.cache_inputs.choose_format`) and the plan the ops hand the kernel for it, on the CPU
    with the backend forced: version 2 only where the CUDA kernel reads it and the windows are even; the CUDA
    plan of version-2 storage is the kernel's fragment-order format 3, staged as stored."""
    from gaac_hf import ops
    from gaac_hf.cache_inputs import choose_format
    from gaac_hf.calibrate import calibrate

    tiny_calibration = calibrate(tiny_llama, [torch.arange(3, 67)], "ids")
    v2 = tiny_calibration.convert(2)
    assert not ops.fused_reads(2, 128, 4, "cpu") and ops.fused_reads(1, 128, 4, "cpu") is False
    assert choose_format(None, v2, 128, 4, "cpu") == 1 and choose_format(2, tiny_calibration, 128, 4, "cpu") == 2
    monkeypatch.setenv("GAAC_HF_BACKEND", "gaac_cuda")
    assert ops.fused_reads(2, 128, 4, "cpu") and ops.fused_reads(2, 64, 8, "cpu")
    for d, rep in ((256, 4), (80, 1), (128, 9)):  # head dims and group sizes the kernel's format 3 does not cover
        assert not ops.fused_reads(2, d, rep, "cpu") and choose_format(None, v2, d, rep, "cpu") == 1
    assert choose_format(None, v2, 128, 4, "cpu") == 2 and choose_format(None, tiny_calibration, 128, 4, "cpu") == 1
    f3 = ops.cuda_plan(1, 8, 4, 128, 256, 2944, False, 6, "cpu", 2)
    assert "-DGAAC_FORMAT=3" in f3.options and "-DGAAC_DENSE_SLOT=1" in f3.options
    assert "-DGAAC_FORMAT=1" in ops.cuda_plan(1, 8, 4, 128, 256, 2944, False, 6, "cpu", 1).options


def test_plan_rejects_shapes_the_kernel_does_not_cover():
    with pytest.raises(ValueError, match="head_dim"):
        plan(1, 8, 4, 80, 1024, "cpu", nsplit=4)
    with pytest.raises(ValueError, match="query heads per kv-head"):
        plan(1, 2, 9, 128, 1024, "cpu", nsplit=4)
    with pytest.raises(ValueError, match="slot format 4"):
        plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, format_version=4)
    with pytest.raises(ValueError, match="format 3"):
        plan(1, 8, 4, 256, 1024, "cpu", nsplit=4, format_version=3)
    f3 = plan(1, 8, 4, 128, 1024, "cpu", nsplit=6, format_version=3, slot_bytes=2928)
    assert "-DGAAC_FORMAT=3" in f3.options and "-DGAAC_DENSE_SLOT=1" in f3.options  # staged as stored
    assert f3.warp_bytes == 128 + 2 * 2 * 4096 + 8 * 256  # 8 scratch bytes per group (overlay)
    with pytest.raises(ValueError, match="slot format 2"):  # the plane-order prototype was removed
        plan(1, 8, 4, 128, 1024, "cpu", nsplit=6, format_version=2, slot_bytes=2928)
    p = plan(2, 8, 4, 128, 65536, "cpu", nsplit=33, slot_bytes=2928)
    assert (p.items, p.grid, p.buf_bytes) == (2 * 8 * 33, -(-2 * 8 * 33 // p.warps), 4096)
    assert p.smem <= 227 * 1024
    # the slot format is a compile-time option: it keys the kernel cache
    assert plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, format_version=3, slot_bytes=2928).options != plan(
        1, 8, 4, 128, 1024, "cpu", nsplit=4, slot_bytes=2928, dense_slots=True).options
    # the swizzled staging is a plain-KV option: it keys the twin's kernel, not the compressed one
    assert plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, plain=True, swizzle=True).options != \
        plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, plain=True, swizzle=False).options
    assert plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, swizzle=True).options == plan(
        1, 8, 4, 128, 1024, "cpu", nsplit=4).options
    # a 128-byte header before each warp's ring (barriers, slot bits), for plain and compressed KV alike
    assert plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, plain=True).warp_bytes == 128 + 2 * 2 * 4096
    assert plan(1, 8, 4, 128, 1024, "cpu", nsplit=4).warp_bytes == 128 + 2 * 2 * 4096 + 14 * 128
    dense = plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, slot_bytes=3200, dense_slots=True)
    assert "-DGAAC_DENSE_SLOT=1" in dense.options and dense.buf_bytes == 4096  # no row padding: the raw tile's size
    assert plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, slot_bytes=4000).buf_bytes == 4352  # 4,272 in 128-B lines
    # a slot larger than a raw tile keeps 16 bytes past it: the prepass reads 12-byte escape windows clamped to the
    # buffer, and a full escape area (all-raw tiles, 1,280 escape bytes at 128 channels) must not be clamped
    assert plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, slot_bytes=4160, dense_slots=True,
                format_version=3).buf_bytes == 4224  # 4,176 in whole 128-byte lines
    with pytest.raises(ValueError, match="16 bytes past it"):
        plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, slot_bytes=4160, dense_slots=True, buf_bytes=4160)
    with pytest.raises(ValueError, match="v_words"):
        plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, v_words=3)


def test_ring_buffers_are_128_byte_aligned():
    """Every bulk copy lands on a 128-byte aligned shared-memory destination: the header before a warp's ring, each
    tile buffer and each warp's share are whole 128-byte lines (a 64-byte header cost a quarter of the copies' rate
    on the H200, session 25), at every head_dim, slot size and format."""
    from gaac_cuda.decode_attention import RING_HEADER

    assert RING_HEADER % 128 == 0
    for d in (64, 128, 256):
        for kw in ({"plain": True}, {"slot_bytes": 1488 * d // 64, "format_version": 3},
                   {"slot_bytes": 1504 * d // 64 + 16, "format_version": 1}, {"slot_bytes": 4000, "format_version": 1},
                   {"slot_bytes": 4160, "format_version": 3, "dense_slots": True}):
            if d == 256 and kw.get("format_version") == 3:
                continue  # format 3 covers head_dim 64 / 128
            p = plan(1, 8, 4, d, 4096, "cpu", nsplit=4, **kw)
            assert p.buf_bytes % 128 == 0 and p.warp_bytes % 128 == 0, (d, kw)
    with pytest.raises(ValueError, match="multiple of 128"):
        plan(1, 8, 4, 128, 1024, "cpu", nsplit=4, slot_bytes=2944, dense_slots=True, format_version=3,
             buf_bytes=2960)


def test_combine_warps_option():
    """plan(combine_warps=n): the combine kernel's block size, a kernel option only off the default (16), for both
    kernels; out-of-range counts refused."""
    base = plan(1, 8, 4, 128, 65536, "cpu", plain=True, nsplit=48)
    assert base.combine_warps == 16 and not any("COMBINE" in o for o in base.options)
    assert plan(1, 8, 4, 128, 65536, "cpu", plain=True, nsplit=48, combine_warps=16).options == base.options
    for kw in ({"plain": True}, {"slot_bytes": 3000, "format_version": 3}):
        p4 = plan(1, 8, 4, 128, 65536, "cpu", nsplit=48, combine_warps=4, **kw)
        assert p4.combine_warps == 4 and "-DGAAC_COMBINE_WARPS=4" in p4.options
    with pytest.raises(ValueError, match="combine_warps"):
        plan(1, 8, 4, 128, 65536, "cpu", plain=True, nsplit=48, combine_warps=17)


def test_pdl_option():
    """plan(pdl=True): the griddepcontrol build (a kernel option only when on) for both kernels and both storages,
    the launch flag on the plan; the split count and bits-relevant options unchanged."""
    from gaac_cuda.nvrtc import CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, programmatic_launch_config

    for kw in ({"plain": True, "nsplit": 48}, {"plain": True, "nsplit": 48, "warps": 4},
               {"slot_bytes": 3000, "format_version": 3, "nsplit": 48}):
        base = plan(1, 8, 4, 128, 65536, "cpu", pdl=False, **kw)
        assert plan(1, 8, 4, 128, 65536, "cpu", **kw).pdl == PDL
        on = plan(1, 8, 4, 128, 65536, "cpu", pdl=True, **kw)
        assert not base.pdl and not any("PDL" in o for o in base.options)
        assert on.pdl and on.options == base.options + ("-DGAAC_PDL=1",) and on.nsplit == base.nsplit
        assert on.grid == base.grid and on.smem == base.smem
    cfg = programmatic_launch_config(396, 128, 74240, 0)
    assert (cfg.gridDimX, cfg.blockDimX, cfg.sharedMemBytes, cfg.numAttrs) == (396, 128, 74240, 1)
    assert cfg.attrs[0].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION and cfg.attrs[0].value[0] == 1


def test_process_defines_reach_every_plan(monkeypatch):
    """GAAC_HF_CUDA_DEFINES (read at import into PROCESS_DEFINES): kernel defines for every plan of the process —
    compressed KV and its twin, in CTAs of any size — before the plan's own `defines`; a define that is not
    NAME=VALUE with a GAAC_ name is refused with a clear error."""
    import importlib

    da = importlib.import_module(plan.__module__)  # (the package's `decode_attention` is the function)
    monkeypatch.setattr(da, "PROCESS_DEFINES", ("GAAC_STAGED_O=0", "GAAC_FAST_ISSUE=0"))
    for kw in ({"plain": True}, {"plain": True, "warps": 4}, {"slot_bytes": 2944, "format_version": 3},
               {"slot_bytes": 2944, "format_version": 3, "defines": ("GAAC_LANE_ENTRIES=1",)}):
        opts = plan(1, 8, 4, 128, 65536, "cpu", **kw).options
        assert "-DGAAC_STAGED_O=0" in opts and "-DGAAC_FAST_ISSUE=0" in opts, kw
    assert "-DGAAC_LANE_ENTRIES=1" in opts
    for bad in (("STAGED_O=0",), ("GAAC_STAGED_O",), ("GAAC_X=1 -DFOO",)):
        monkeypatch.setattr(da, "PROCESS_DEFINES", bad)
        with pytest.raises(ValueError, match="NAME=VALUE"):
            plan(1, 8, 4, 128, 65536, "cpu", plain=True)
    monkeypatch.setattr(da, "PROCESS_DEFINES", ())
    with pytest.raises(ValueError, match="NAME=VALUE"):
        plan(1, 8, 4, 128, 65536, "cpu", plain=True, defines=("GAAC_A=1;",))


def test_plan_refuses_warps_beyond_shared_memory():
    """16 warps of BF16-tile ring buffers (18.5 KB each at head_dim 128) do not fit in one CTA: a clear error, not a
    failed launch. (Session 19's slot-sized ring fitted them, and was slower: benchmarks/results/attention_cuda.md.)"""
    with pytest.raises(ValueError, match="do not fit in one CTA"):
        plan(1, 8, 4, 128, 65536, "cpu", nsplit=264, slot_bytes=2960, format_version=3, warps=16, min_ctas=1)


def test_plan_of_the_kernel_shapes():
    """The twin and compressed KV in one 12-warp CTA per SM (the default since session 17), the twin's rows swizzled
    (head_dim 256: 4 warps, no swizzle); a CTA that shared memory cannot hold falls back to 4-warp CTAs."""
    t = plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, plain=True)
    assert t.warps == SPLIT_WARPS and "-DGAAC_SWIZZLE=1" in t.options and "-DGAAC_MIN_CTAS=1" in t.options
    assert t.grid == -(-8 * 198 // SPLIT_WARPS) and t.smem == SPLIT_WARPS * t.warp_bytes <= 227 * 1024
    c = plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, slot_bytes=2928, format_version=3)
    assert c.warps == SPLIT_WARPS and "-DGAAC_SWIZZLE=0" in c.options and c.grid == t.grid
    wide = plan(1, 8, 4, 256, 65536, "cpu", nsplit=3, plain=True)
    assert wide.warps == 4 and "-DGAAC_SWIZZLE=0" in wide.options
    big = plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, slot_bytes=8000, format_version=1)
    assert big.warps == 4 and "-DGAAC_MIN_CTAS=3" in big.options
    assert c.smem + STATIC_SMEM <= 232448
    # slots staged as stored (one bulk copy each) for format 3, padded rows for format 1 unless asked
    assert "-DGAAC_DENSE_SLOT=1" in c.options and c.buf_bytes == 4096
    assert "-DGAAC_DENSE_SLOT=0" in plan(1, 8, 4, 128, 1024, "cpu", nsplit=8, slot_bytes=4000).options
    with pytest.raises(TypeError):  # the warp-specialized kernel was removed in session 28
        plan(1, 8, 4, 128, 1024, "cpu", nsplit=8, ws=8)


@pytest.mark.skipif(shutil.which("nvcc") is None or CUOBJDUMP is None or not os.path.isfile(CUOBJDUMP or ""),
                    reason="needs nvcc (CUDA 12.8+) and triton's cuobjdump")
@pytest.mark.parametrize("config", [(128, 1, 0), (128, 1, 1), (64, 1, 0), (64, 1, 1), (128, 1, 2), (64, 1, 2),
                                    (128, 1, 3), (64, 1, 3), (128, 1, 6), (64, 1, 6),
                                    (128, 1, 6, "GAAC_COMBINE_WARPS=4"),
                                    (128, 1, 6, "GAAC_PDL=1"), (64, 1, 6, "GAAC_PDL=1"), (128, 1, 1, "GAAC_PDL=1"),
                                    (128, 1, 0, "GAAC_PDL=1"), (128, 1, 6, "GAAC_WARPS=12"), (64, 1, 6, "GAAC_WARPS=12"),
                                    (128, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1"), (128, 1, 0, "GAAC_WARPS=12"),
                                    (128, 1, 1, "GAAC_WARPS=12"), (128, 1, 2, "GAAC_WARPS=12"),
                                    (64, 1, 2, "GAAC_WARPS=12", "GAAC_PDL=1"),
                                    (128, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_FAST_ISSUE=0"),
                                    (64, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_FAST_ISSUE=0"),
                                    (128, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_STAGED_O=0"),
                                    (128, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_CTA_MERGE=1"),
                                    (64, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_CTA_MERGE=1"),
                                    (128, 1, 2, "GAAC_WARPS=12", "GAAC_CTA_MERGE=1"), (64, 1, 0, "GAAC_CTA_MERGE=1"),
                                    (128, 1, 6, "GAAC_WARPS=12", "GAAC_CTA_MERGE=1", "GAAC_FUSED_COMBINE=1"),
                                    (64, 1, 2, "GAAC_WARPS=12", "GAAC_CTA_MERGE=1", "GAAC_FUSED_COMBINE=1"),
                                    (64, 1, 0, "GAAC_CTA_MERGE=1", "GAAC_FUSED_COMBINE=1"),
                                    (128, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_LANE_ENTRIES=1"),
                                    (64, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_LANE_ENTRIES=1"),
                                    (128, 1, 6, "GAAC_WARPS=12", "GAAC_PDL=1", "GAAC_EVICT_FIRST=0")])
def test_kernel_compiles_for_sm90a_without_spills(config, tmp_path):
    """The sm_90a build of every head_dim-64/128 variant, at the plan's register cap (12 warps per SM: 3 CTAs of 4
    warps, or one of 12), keeps its state in registers: no stack, no local memory."""
    # kind 0 compressed, 1 plain (K and V of a stage on their own barriers), 2 plain with swizzled rows, 3 compressed
    # with slots staged as stored, 6 format 3 (version 2 in fragment order, staged as stored; raw groups from the
    # scratch overlay); kinds 4, 5 and 7 were the warp-specialized kernel's (removed in session 28)
    c, tiles, kind, *extra = config  # extra: a benchmark or plan option
    out = tmp_path / "k.cubin"
    defs = [f"-DGAAC_C={c}", f"-DGAAC_TILES={tiles}", f"-DGAAC_PLAIN={int(kind in (1, 2))}",
            f"-DGAAC_SWIZZLE={int(kind == 2)}", f"-DVT_WORDS={c // 32}", f"-DGAAC_DENSE_SLOT={int(kind in (3, 6))}",
            "-DGAAC_STAGES=2"]
    defs += (["-DGAAC_FORMAT=3"] if kind == 6 else []) + [f"-D{e}" for e in extra if not e.startswith("GAAC_WARPS")]
    # the CTA: 4 warps, 3 per SM, or the plan's default SPLIT_WARPS warps in one CTA per SM (the same register cap)
    warps = 12 if "GAAC_WARPS=12" in extra else 4
    defs += [f"-DGAAC_WARPS={warps}", f"-DGAAC_MIN_CTAS={1 if warps == 12 else 3}"]
    subprocess.run(["nvcc", "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", *defs, "-x", "cu",
                    _SOURCE_FILE, "-o", str(out)], check=True, capture_output=True)
    usage = subprocess.run([CUOBJDUMP, "-res-usage", str(out)], check=True, capture_output=True, text=True).stdout
    split = [line for line in usage.splitlines() if "REG" in line]
    fn = usage.split("gaac_decode_split")[1]
    regs = int(re.search(r"REG:(\d+)", fn).group(1))
    assert int(re.search(r"STACK:(\d+)", fn).group(1)) == 0 and int(re.search(r"LOCAL:(\d+)", fn).group(1)) == 0, split
    assert regs <= 168, split  # 12 warps per SM


def _ptx_of(function: str, defines: list[str], tmp_path) -> str:
    out = tmp_path / "k.ptx"
    subprocess.run(["nvcc", "-ptx", "-std=c++17", "-arch=compute_90a", *defines, "-x", "cu", _SOURCE_FILE, "-o",
                    str(out)], check=True, capture_output=True)
    text = out.read_text()
    body = text[text.index(f".entry {function}("):]
    nxt = body.find(".entry ", 1)
    return body if nxt < 0 else body[:nxt]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA 12.8+)")
def test_issue_paths_are_compiled_in(tmp_path):
    """Compressed KV staged as stored (the caches' Hopper default) carries the common unit's two bulk copies beside the
    general issue path (GAAC_FAST_ISSUE)."""
    split = ["-DGAAC_C=128", "-DGAAC_TILES=1", "-DGAAC_PLAIN=0", "-DGAAC_STAGES=2", "-DGAAC_WARPS=12",
             "-DGAAC_MIN_CTAS=1", "-DGAAC_FORMAT=3", "-DVT_WORDS=4", "-DGAAC_DENSE_SLOT=1"]
    fast = _ptx_of("gaac_decode_split", split, tmp_path).count("cp.async.bulk.shared")
    general = _ptx_of("gaac_decode_split", split + ["-DGAAC_FAST_ISSUE=0"], tmp_path).count("cp.async.bulk.shared")
    assert fast == general + 2, (fast, general)


def test_partials_leave_as_vector_stores(tmp_path):
    """The one-warp kernel writes its partial output rows as 16-byte stores from shared memory (GAAC_STAGED_O), not
    as 4-byte stores from the fragments: 32 scalar stores per thread (2 heads x 8 m-tiles x 2 channels at head_dim
    128) give way to a loop of vector stores."""
    split = ["-DGAAC_C=128", "-DGAAC_TILES=1", "-DGAAC_PLAIN=0", "-DGAAC_STAGES=2", "-DGAAC_WARPS=12",
             "-DGAAC_MIN_CTAS=1", "-DGAAC_FORMAT=3", "-DVT_WORDS=4", "-DGAAC_DENSE_SLOT=1"]
    staged = _ptx_of("gaac_decode_split", split, tmp_path)
    direct = _ptx_of("gaac_decode_split", split + ["-DGAAC_STAGED_O=0"], tmp_path)
    assert staged.count("st.global.v4.") >= 1 and direct.count("st.global.v4.") == 0  # (ptx: st.global.v4.u32)
    assert direct.count("st.global.f32") == staged.count("st.global.f32") + 32


def reference_attention(q, k, v, kv_len, mask, scale):
    b, hq, d = q.shape
    nrep = hq // k.shape[1]
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        n = int(kv_len[i])
        kk = k[i, :, :n].double().repeat_interleave(nrep, 0)
        vv = v[i, :, :n].double().repeat_interleave(nrep, 0)
        sc = torch.einsum("hd,hsd->hs", q[i].double(), kk) * scale
        if mask is not None:
            sc = sc.masked_fill(~mask[i, None, :n], float("-inf"))
        out[i] = torch.einsum("hs,hsd->hd", sc.softmax(-1), vv)
    return out


def compressed_case(b, h, nrep, lengths, d, kind, capacity, seed, pad=0, format_version=1):
    """Compressed KV of rows of different lengths (per-row tails, as a static cache keeps them) and its plain twin;
    `format_version` 2: even windows and the caches' version-2 slots (the kernel's format 3)."""
    gen = torch.Generator().manual_seed(seed)
    s = max(lengths)
    s16 = -(-s // 16) * 16
    k, v, b3, b4 = realistic_kv(b, h, s16, d, gen, kind, even=format_version == 2)
    slot_pool, raw_pool, table, _, _, _ = compress_kv(k.cuda(), v.cuda(), b3.cuda(), b4.cuda(), capacity,
                                                      format_version)
    tail_k = torch.zeros(b, h, 16, d, dtype=torch.bfloat16)
    tail_v = torch.zeros_like(tail_k)
    for i, n in enumerate(lengths):
        f = n // 16 * 16
        tail_k[i, :, :n - f] = k[i, :, f:n]
        tail_v[i, :, :n - f] = v[i, :, f:n]
    q = torch.randn(b, h * nrep, d, generator=gen).to(torch.bfloat16)
    kv_len = torch.tensor(lengths, dtype=torch.int32)
    mask = None
    if pad:
        mask = torch.ones(b, s16, dtype=torch.bool)
        mask[0, :pad] = False
    layout = TileLayout(min(d, 128), capacity)
    dev = "cuda"
    t = [x.to(dev) for x in (q, slot_pool, raw_pool, table, tail_k, tail_v, b3, b4, kv_len)]
    return t, (k.to(dev), v.to(dev)), None if mask is None else mask.to(dev), layout


def case_with_reference(case, format_version=1):
    """A GPU case's tensors (see compressed_case), its softmax scale and the fp64 reference attention."""
    b, h, nrep, lengths, d, kind, cap, pad = case
    tensors, (k, v), mask, layout = compressed_case(b, h, nrep, lengths, d, kind, cap, seed=sum(lengths) + d, pad=pad,
                                                    format_version=format_version)
    q, kv_len, scale = tensors[0], tensors[-1], d ** -0.5
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), kv_len.cpu(), None if mask is None else mask.cpu(), scale)
    return tensors, (k, v), mask, layout, scale, ref


GPU_CASES = [  # (batch, kv heads, q heads per kv head, lengths, head_dim, mode mix, capacity, left pad)
    (1, 1, 1, [1], 64, "mixed", 32, 0),
    (2, 2, 3, [15, 9], 64, "mixed", 32, 3),
    (1, 2, 4, [17], 128, "mixed", 16, 0),
    (2, 1, 2, [67, 40], 64, "raw", 1280, 5),
    (1, 1, 8, [50], 64, "4bit", 256, 0),
    (1, 2, 7, [77], 128, "mixed", 48, 0),
    (1, 1, 2, [40], 256, "mixed", 48, 0),
    (2, 3, 3, [100, 1000], 64, "mixed", 0, 7),
    (2, 2, 4, [1000, 999], 128, "mixed", 32, 1),
    (2, 8, 4, [65537, 4099], 128, "mixed", 32, 11),
    (1, 4, 4, [3000], 128, "raw", 1280, 0),
    (1, 4, 4, [3001], 128, "4bit", 256, 0),
]


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_cuda_compressed_equals_plain_twin(case):
    b, h, nrep, _, d, _, _, _ = case
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, ref = case_with_reference(case)
    for nsplit in (1, 3, None):
        pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, nsplit=nsplit)
        pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit)
        got = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
        twin = plain_decode_attention(q, k, v, kv_len, mask, scale, pp)
        assert torch.equal(bits(got), bits(twin)), f"compressed != twin (nsplit {pc.nsplit})"
        # the twin with its BF16 rows staged swizzled (bank-conflict-free loads): the same bits
        pps = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit, swizzle=True)
        twin_s = plain_decode_attention(q, k, v, kv_len, mask, scale, pps)
        assert torch.equal(bits(twin_s), bits(twin)), f"swizzled twin differs (nsplit {pc.nsplit})"
        # slots staged as stored (one bulk copy each): the same bits
        pcd = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, nsplit=pc.nsplit,
                   dense_slots=True)
        got_d = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pcd)
        assert torch.equal(bits(got_d), bits(got)), f"dense_slots changed the bits (nsplit {pc.nsplit})"
        err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (err, pc.nsplit)
    # rows further apart than head_dim (a view into wider rows): the same bits as contiguous rows
    kw, vw = (torch.zeros(*x.shape[:3], d + 64, dtype=x.dtype, device=x.device) for x in (k, v))
    kw[..., :d], vw[..., :d] = k, v
    pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True)
    strided = plain_decode_attention(q, kw[..., :d], vw[..., :d], kv_len, mask, scale, pp)
    assert torch.equal(bits(strided), bits(plain_decode_attention(q, k, v, kv_len, mask, scale, pp)))



@gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[4] in (64, 128)],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_compressed_equals_plain_twin_in_every_cta_shape(case):
    """Compressed KV and its twin planned alike give the same bits whatever the CTA: the default plans, each split's
    partial written on its own (no CTA merge), and 4-warp CTAs of 2 or 3 ring stages, at one, five and the default
    split count, launched twice (a second launch reuses nothing of the first)."""
    b, h, nrep, _, d, _, _, _ = case
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, ref = case_with_reference(case)
    for nsplit in (1, 5, None):
        pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, nsplit=nsplit)
        got = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
        twin = plain_decode_attention(q, k, v, kv_len, mask, scale)  # the default twin plan
        if nsplit is None:
            assert torch.equal(bits(got), bits(twin)), "default plans: compressed != twin"
        for kw in ({"cta_merge": False}, {"warps": 4, "min_ctas": 3}, {"warps": 4, "stages": 3, "min_ctas": 2}):
            pw = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, nsplit=pc.nsplit, **kw)
            pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit, **kw)
            for _ in range(2):
                got_w = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pw)
                twin_w = plain_decode_attention(q, k, v, kv_len, mask, scale, pp)
                assert torch.equal(bits(got_w), bits(twin_w)), f"{kw}, nsplit {pc.nsplit}: compressed != twin"
        err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (err, pc.nsplit)


@gpu
@pytest.mark.parametrize("case", [c for c in GPU_CASES if c[4] in (64, 128)],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_format_2_slots_equal_plain_twin(case):
    """Slots of format version 2 as the caches store them (even windows, written by the caches' encoder in fragment
    order, escapes ordered by plane): the kernel's format 3 gives the twin's bits at every case of the format-1 test
    (lengths 1 / 15 / 17 / 1000 / 65,537, mixed lengths with padding, all-raw and all-4-bit tiles), at several split
    counts, in 12- and 4-warp CTAs, with and without the CTA merge, and is attention."""
    if case[5] == "mixed":  # even windows leave more escapes: 32 more bytes keep slots and raw tiles both in use
        case = (*case[:6], case[6] + 32, case[7])
    b, h, nrep, _, d, _, _, _ = case
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, ref = case_with_reference(case, 2)
    for nsplit, kw in ((1, {}), (3, {}), (None, {}), (6, {"warps": 4, "min_ctas": 3}), (5, {"cta_merge": False})):
        pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, nsplit=nsplit, format_version=3,
                  **kw)
        pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit, **kw)
        got = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
        twin = plain_decode_attention(q, k, v, kv_len, mask, scale, pp)
        assert torch.equal(bits(got), bits(twin)), f"format 2 != twin (nsplit {pc.nsplit}, {kw})"
        err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (err, pc.nsplit)


@gpu
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[8], GPU_CASES[9]],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_combine_warps_equal_the_twin_planned_alike(case):
    """plan(combine_warps=n) changes how the combine groups the splits, for compressed KV and its twin alike: the same
    bits, and attention."""
    b, h, nrep, _, d, _, _, _ = case
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, ref = case_with_reference(case, 2)
    for cw in (4, 3, 1, 8):
        pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, format_version=3, combine_warps=cw)
        got = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
        pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit, combine_warps=cw)
        assert torch.equal(bits(got), bits(plain_decode_attention(q, k, v, kv_len, mask, scale, pp))), cw
        err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (err, cw)


@gpu
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[8], GPU_CASES[9]],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_pdl_launch_keeps_the_bits(case):
    """plan(pdl=True) (programmatic dependent launch of the split and combine kernels): the bits of the plain launch,
    for compressed KV (format 3, in 12- and 4-warp CTAs) and the twin, called directly and
    as three back-to-back calls in one CUDA graph (each split kernel then starts under the previous combine, which
    reads partials in the memory the next call reuses)."""
    b, h, nrep, _, d, _, _, _ = case
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, ref = case_with_reference(case, 2)
    for cta in ({}, {"warps": 4, "min_ctas": 3}):
        outs = {}
        for pdl in (False, True):
            pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, format_version=3, pdl=pdl,
                      **cta)
            outs[("gaac", pdl)] = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
            pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit, pdl=pdl, **cta)
            outs[("twin", pdl)] = plain_decode_attention(q, k, v, kv_len, mask, scale, pp)
            if pdl:
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    got = [decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
                           for _ in range(3)]
                graph.replay()
                torch.cuda.synchronize()
                assert all(torch.equal(bits(g), bits(outs[("gaac", False)])) for g in got), cta
        want = bits(outs[("gaac", False)])
        assert all(torch.equal(bits(o), want) for o in outs.values()), (cta, [k2 for k2, o in outs.items()
                                                                             if not torch.equal(bits(o), want)])
        err = ((outs[("gaac", True)].cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, err


@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_fragment_order_prototype_equals_plain_twin(d):
    """Format 3 (the fragment-order byte-split prototype of benchmarks/format_v2_probe.py, CPU-checked in
    tests/test_gaac_format_v3_prototype.py): the kernel in 12- and 4-warp CTAs gives the twin's bits on real-
    statistics-like KV with 3-bit, 4-bit and raw groups, raw tiles and a tail, at several split counts."""
    from benchmarks.format_v2_probe import compress_v2

    gen = torch.Generator().manual_seed(d)
    b, h, nrep, s = 2, 4, 4, 4100
    k, v, _, _ = realistic_kv(b, h, -(-s // 16) * 16, d, gen, "mixed")
    k, v = k[:, :, :s].cuda(), v[:, :, :s].cuda()
    q = torch.randn(b, h * nrep, d, generator=gen).to(torch.bfloat16).cuda()
    kv_len = torch.full((b,), s, dtype=torch.int32, device="cuda")
    packed, layout, info = compress_v2(k, v)
    assert info["raw_tiles"] > 0 and min(info["mode_shares"]) > 0, info
    cases = [(n, w, ()) for n, w in ((1, None), (7, None), (12, 4), (10, 4), (11, 4), (8, 4))]
    cases += [(7, None, ("GAAC_FAST_ISSUE=0",)), (1, None, ("GAAC_FAST_ISSUE=0",))]  # every unit by the general path
    for nsplit, warps, defines in cases:  # defines: the issue path
        pc = plan(b, h, nrep, d, s, "cuda", slot_bytes=layout.slot_bytes, nsplit=nsplit, warps=warps, format_version=3,
                  defines=defines)
        pp = plan(b, h, nrep, d, s, "cuda", plain=True, nsplit=nsplit, warps=pc.warps, cta_merge=pc.cta_merge)
        got = decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, d ** -0.5, layout, pc)
        twin = plain_decode_attention(q, k, v, kv_len, None, d ** -0.5, pp)
        assert torch.equal(bits(got), bits(twin)), (nsplit, warps, defines)


@gpu
def test_combine_over_many_splits_and_empty_ones():
    """The one-round combine: more splits than one round of loads covers (a short context over many splits leaves
    most of them empty, m = -inf), the same bits for compressed KV and its twin, and close to the fp64 reference."""
    b, h, nrep, d = 1, 1, 4, 64
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout = compressed_case(
        b, h, nrep, [4000], d, "mixed", 32, seed=3)
    scale = d ** -0.5
    for nsplit in (300, 997):  # > 256 splits: two or more rounds per warp; 997 over 250 units: most are empty
        pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, nsplit=nsplit)
        pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=nsplit)
        got = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, None, scale, layout, pc)
        twin = plain_decode_attention(q, k, v, kv_len, None, scale, pp)
        assert torch.equal(bits(got), bits(twin)), nsplit
        ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), kv_len.cpu(), None, scale)
        assert ((got.cpu().double() - ref).norm() / ref.norm()).item() < 1e-2, nsplit


def _option_equals_twin(case, option: dict, baseline: dict, splits):
    """Plans of `case` with `option` (the one-warp kernel, each (nsplit, warps) of `splits`): compressed KV and its
    twin planned alike give the same bits, close to the plan with `baseline` instead and to the fp64 reference; three
    calls in one CUDA graph, replayed twice, give the same bits each time. Yields each compressed plan."""
    b, h, nrep, _, d, _, _, _ = case
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, ref = case_with_reference(case)
    for nsplit, warps in splits:
        kw = {"nsplit": nsplit} | ({} if warps is None else {"warps": warps})
        pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, **kw, **option)
        kw["nsplit"] = pc.nsplit
        pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, **kw, **option)
        got = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
        twin = plain_decode_attention(q, k, v, kv_len, mask, scale, pp)
        assert torch.equal(bits(got), bits(twin)), (pc.nsplit, pc.warps)
        other = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout,
                                 plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, **kw, **baseline))
        assert (got.float() - other.float()).abs().max().item() <= 2 ** -6 * other.float().abs().max().item()
        err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (err, pc.nsplit, pc.warps)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            again = [decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
                     for _ in range(3)]
        for _ in range(2):
            graph.replay()
            torch.cuda.synchronize()
            assert all(torch.equal(bits(x), bits(got)) for x in again), (pc.nsplit, pc.warps)
        yield pc


def _format2_equals_twin(case, option: dict):
    """At head_dim 64 / 128, format version 2 (the kernel's format 3) as the caches store it on Hopper: compressed KV
    planned with `option` equals its twin planned alike, at 3 splits and at the shape's default."""
    b, h, nrep, _, d, _, _, _ = case
    if d not in (64, 128):
        return
    (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, ref = case_with_reference(case, 2)
    for nsplit in (3, None):
        pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, format_version=3,
                  nsplit=nsplit, **option)
        pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit, **option)
        got = decode_attention(q, sp, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
        assert torch.equal(bits(got), bits(plain_decode_attention(q, k, v, kv_len, mask, scale, pp))), nsplit


@gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1], GPU_CASES[6], GPU_CASES[8], GPU_CASES[9]],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_cta_merge_equals_the_twin_planned_alike(case):
    """plan(cta_merge=True): each CTA merges its splits per (row, kv-head) before they leave, so CTAs that span two
    or more groups (split counts that are not multiples of the warps per CTA, 4- and 12-warp CTAs, a CTA of fewer
    live warps at the end, empty splits) write one partial per group. Compressed KV (formats 1 and 3) and its twin
    planned alike give the same bits, close to the fp64 reference and to the unmerged kernel, and the same bits again
    as three back-to-back calls in one CUDA graph."""
    b, h = case[:2]
    for pc in _option_equals_twin(case, {"cta_merge": True}, {"cta_merge": False},
                                  ((1, None), (5, None), (13, None), (3, 4), (7, 4), (None, None), (40, None))):
        assert pc.cta_merge and "-DGAAC_CTA_MERGE=1" in pc.options and pc.parts <= max(pc.items, 3 * b * h)
    _format2_equals_twin(case, {"cta_merge": True})


def test_cta_merge_option():
    """plan(cta_merge=...): the kernel option and the partials' count."""
    p = plan(2, 8, 4, 128, 65536, "cpu", nsplit=33, warps=12, cta_merge=True)
    assert p.cta_merge and "-DGAAC_CTA_MERGE=1" in p.options and p.parts == 2 * 8 * (33 // 12 + 2)
    off = plan(2, 8, 4, 128, 65536, "cpu", nsplit=33, warps=12, cta_merge=False)
    assert not off.cta_merge and off.parts == off.items and not any("CTA_MERGE" in o for o in off.options)
    # the default where it pays (an H200's 132 SMs, the one-wave split counts): more than one round of the combine's
    # loads (9/3/64 1x64K: 528 splits per group) or more combine blocks than SMs (64/8 1x64K, 4x64K), not at 1x64K
    for (b, h, r, d, n), want in (((1, 8, 4, 128, 198), False), ((1, 8, 8, 128, 198), True),
                                  ((4, 8, 4, 128, 49), True), ((1, 3, 3, 64, 528), True), ((1, 3, 3, 64, 256), False)):
        for plain in (False, True):
            assert plan(b, h, r, d, 65536, "cpu", nsplit=n, plain=plain).cta_merge is want, (b, h, r, d, n)
    # the combine in the split kernel: only with the merge; by default where the combine kernel's blocks (row x query
    # head x 32 channels) outnumber the SMs (64/8 1x64K: 256, 4x64K: 512), not at 9/3/64 (18: merged, not fused)
    fused = plan(2, 8, 4, 128, 65536, "cpu", nsplit=33, cta_merge=True, fused_combine=True)
    assert fused.fused_combine and "-DGAAC_FUSED_COMBINE=1" in fused.options
    assert not plan(2, 8, 4, 128, 65536, "cpu", nsplit=33, cta_merge=True, fused_combine=False).fused_combine
    small = plan(1, 2, 4, 128, 65536, "cpu", nsplit=33, warps=12, cta_merge=True)  # 32 blocks
    assert small.cta_merge and not small.fused_combine and not any("FUSED" in o for o in small.options)
    for (b, h, r, d, n), want in (((1, 8, 8, 128, 198), True), ((4, 8, 4, 128, 49), True), ((1, 3, 3, 64, 528), False),
                                  ((1, 8, 4, 128, 198), False)):
        for plain in (False, True):
            pl = plan(b, h, r, d, 65536, "cpu", nsplit=n, plain=plain)
            assert pl.fused_combine is want and ("-DGAAC_FUSED_COMBINE=1" in pl.options) is want, (b, h, r, d, n)
    with pytest.raises(ValueError, match="needs cta_merge"):
        plan(2, 8, 4, 128, 65536, "cpu", nsplit=33, cta_merge=False, fused_combine=True)


@gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1], GPU_CASES[6], GPU_CASES[8], GPU_CASES[9]],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_fused_combine_equals_the_twin_planned_alike(case):
    """plan(fused_combine=True): the last CTA of each (row, kv-head) group merges the group's partials into the output
    (no combine kernel). CTAs holding several groups (1-split groups in 4-warp CTAs: up to four last-CTA merges in
    one CTA), groups over many CTAs, empty splits: compressed KV and its twin planned alike give the same bits, close
    to the fp64 reference and to the combine kernel's output; three calls in one CUDA graph, replayed twice, give the
    same bits each time (the counters reset themselves)."""
    for pc in _option_equals_twin(case, {"cta_merge": True, "fused_combine": True},
                                  {"cta_merge": True, "fused_combine": False},
                                  ((1, 4), (1, None), (5, None), (13, None), (3, 4), (None, None), (40, None))):
        assert pc.fused_combine and "-DGAAC_FUSED_COMBINE=1" in pc.options


def test_const_layout_option():
    """plan(const_layout=True): the ring layout (and for compressed KV the slot size) as kernel defines, recorded on
    the plan; compressed KV needs its slot size; the launcher refuses a pool
    whose slots are not the plan's size before touching any tensor."""
    pc = plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, slot_bytes=2944, format_version=3, const_layout=True)
    assert pc.slot_bytes == 2944 and "-DGAAC_SLOT_BYTES=2944" in pc.options
    assert f"-DGAAC_BUF_BYTES={pc.buf_bytes}" in pc.options and f"-DGAAC_WARP_BYTES={pc.warp_bytes}" in pc.options
    pp = plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, plain=True, const_layout=True)
    assert pp.slot_bytes == 0 and f"-DGAAC_BUF_BYTES={pp.buf_bytes}" in pp.options
    assert not any("SLOT_BYTES" in o for o in pp.options)
    # the default: compiled in wherever the plan knows the slot size (GAAC_HF_CUDA_CONST_LAYOUT=0: nowhere)
    dflt = plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, slot_bytes=2944, format_version=3)
    assert dflt.slot_bytes == (2944 if CONST_LAYOUT else 0)
    assert plan(1, 8, 4, 128, 65536, "cpu", nsplit=198).slot_bytes == 0  # no slot size given: read at launch
    off = plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, slot_bytes=2944, format_version=3, const_layout=False)
    assert off.slot_bytes == 0 and not any("_BYTES=" in o for o in off.options)
    with pytest.raises(ValueError, match="slot_bytes"):
        plan(1, 8, 4, 128, 65536, "cpu", nsplit=198, const_layout=True)
    other = TileLayout.of_slot_bytes(128, 2944 + 16)
    q = torch.zeros(1, 32, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="2944-byte slots compiled in"):
        decode_attention(q, torch.zeros(1, other.slot_bytes, dtype=torch.uint8), torch.zeros(0, 16, 128),
                         torch.zeros(1, 1, 2, 8, 1, dtype=torch.int32), torch.zeros(1, 8, 16, 128),
                         torch.zeros(1, 8, 16, 128), None, None, torch.ones(1, dtype=torch.int32), None, 1.0, other, pc)


def test_const_layout_offsets_match_the_format():
    """The kernel's compiled-in section offsets (GAAC_SLOT_BYTES: planes at 16 C, tags at 22 C, escapes at 22 C + C / 2)
    are the format's (`TileLayout`) at the CUDA kernel's tile widths, for every escape capacity."""
    src = open(_SOURCE_FILE).read()
    for name, want in (("PLANES_OFF", "(16 * C)"), ("TAGS_OFF", "(22 * C)"), ("ESC_OFF", "(22 * C + C / 2)")):
        assert f"#define {name} {want}" in src, name
    for c in (64, 128):
        for capacity in (0, 16, 64, 256):
            lay = TileLayout(c, capacity)
            assert (lay.planes_offset, lay.tags_offset, lay.escape_offset) == (16 * c, 22 * c, 22 * c + c // 2)


@gpu
@pytest.mark.parametrize("case", [GPU_CASES[0], GPU_CASES[1], GPU_CASES[6], GPU_CASES[8], GPU_CASES[9]],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_const_layout_equals_the_twin(case):
    """plan(const_layout=True): the layout compiled in changes no bit — compressed KV equals its twin (both compiled
    with their layouts), close to the fp64 reference and to the plan that reads the layout at launch, and CUDA-graph
    replays repeat the bits; also on format version 2 (the kernel's format 3) as the caches store it on Hopper."""
    for pc in _option_equals_twin(case, {"const_layout": True}, {"const_layout": False},
                                  ((1, None), (5, None), (3, 4), (None, None))):
        assert pc.slot_bytes > 0 and any(o.startswith("-DGAAC_SLOT_BYTES=") for o in pc.options)
    _format2_equals_twin(case, {"const_layout": True})


def _defines_equal_twin(case, *defines):
    """Kernel `defines` (benchmark options that must not change a bit): compressed KV equals its twin planned alike at
    1 split, 5, 3 x 4 warps and the default, and on format version 2."""
    opt = {"defines": defines}
    for pc in _option_equals_twin(case, opt, {}, ((1, None), (5, None), (3, 4), (None, None))):
        assert all(f"-D{d}" in pc.options for d in defines)
    _format2_equals_twin(case, opt)


@gpu
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[3], GPU_CASES[8], GPU_CASES[9]],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_lane_entries_equals_the_twin(case):
    """Kernel option GAAC_LANE_ENTRIES (session 24, benchmark option): the split's table entries held by the lanes in
    chunks of 32 units and read by shuffles change no bit — compressed KV equals its twin at 1 split (past 32 units:
    the chunks roll over), 5, 3 x 4 warps and the default, with raw tiles and padded rows; and on format version 2."""
    _defines_equal_twin(case, "GAAC_LANE_ENTRIES=1")


@gpu
@pytest.mark.parametrize("case", [GPU_CASES[1], GPU_CASES[3], GPU_CASES[5], GPU_CASES[8]],
                         ids=lambda c: f"b{c[0]}h{c[1]}r{c[2]}L{c[3][0]}d{c[4]}{c[5]}")
def test_slots_off_a_line_equal_the_twin(case):
    """Slots need not lie on 128-byte lines (head_dim 64's 1,472-byte slots, a pool that is a view at an offset):
    with the whole pool moved 16 .. 112 bytes off a line, formats 1 (staged as stored) and version 2 (the kernel's
    3) at 1, 3 and the default split count give the twin's bits. (Session 25 measured copies from the line start
    with the slot's lead carried to the consumer, `GAAC_SRC_LINES`: they took back a sixth of the bare copies' rate
    but were slower in the kernel at five of six shapes, benchmarks/results/warps_probe_lines_s25.json; removed.)"""
    b, h, nrep, _, d, _, _, _ = case
    for fmt in (1, 2):
        if fmt == 2 and d not in (64, 128):
            continue
        (q, sp, rp, tab, tk, tv, b3, b4, kv_len), (k, v), mask, layout, scale, _ = case_with_reference(case, fmt)
        kernel_fmt = {"format_version": 3} if fmt == 2 else {"dense_slots": True}
        for nsplit in (1, 3, None):
            pc = plan(b, h, nrep, d, k.shape[2], "cuda", slot_bytes=layout.slot_bytes, nsplit=nsplit,
                      **kernel_fmt)
            pp = plan(b, h, nrep, d, k.shape[2], "cuda", plain=True, nsplit=pc.nsplit)
            want = bits(plain_decode_attention(q, k, v, kv_len, mask, scale, pp))
            for shift in (0, 16, 48, 64, 112):
                store = torch.zeros(sp.numel() + 256, dtype=torch.uint8, device=sp.device)
                at = (-store.data_ptr() % 128) + shift
                moved = store[at:at + sp.numel()].view(sp.shape)
                moved.copy_(sp)
                got = decode_attention(q, moved, rp, tab, tk, tv, b3, b4, kv_len, mask, scale, layout, pc)
                assert torch.equal(bits(got), want), (fmt, nsplit, shift, layout.slot_bytes)
    with pytest.raises(ValueError, match="16-byte aligned"):
        store = torch.zeros(sp.numel() + 64, dtype=torch.uint8, device=sp.device)
        decode_attention(q, store[8:8 + sp.numel()].view(sp.shape), rp, tab, tk, tv, b3, b4, kv_len, mask, scale,
                         layout, pc)


def test_cta_merge_partials_fit_the_plans_allocation():
    """The kernel's CTA-merge indexing (kernel: first_cta / last_cta / cta_parts_cap): split s of group grp is item
    grp * nsplit + s, held by CTA item // warps; the group's partials are rows grp * cap + (cta - first CTA). Every
    group's CTAs fit in `cap` rows (so `DecodePlan.parts` rows suffice), every (CTA, group) pair gets its own row, and
    every CTA holds at most `warps` groups (the fused combine's one flag bit per group of a CTA)."""
    for warps in (4, 12):
        for nsplit in list(range(1, 60)) + [197, 198, 264, 528, 997]:
            groups = 7
            p = plan(1, groups, 4, 128, 65536, "cpu", nsplit=nsplit, warps=warps, cta_merge=True)
            cap = p.parts // groups
            rows, per_cta = set(), {}
            for item in range(groups * nsplit):
                grp, cta = item // nsplit, item // warps
                first, last = grp * nsplit // warps, ((grp + 1) * nsplit - 1) // warps
                assert first <= cta <= last < first + cap, (warps, nsplit, grp, cta)
                rows.add(grp * cap + cta - first)
                per_cta.setdefault(cta, set()).add(grp)
            assert len(rows) == sum(len(g) for g in per_cta.values()) and max(rows) < p.parts
            assert max(len(g) for g in per_cta.values()) <= warps
