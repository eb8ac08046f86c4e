"""The fast CPU decoder (gaac_hf/cpu_decode.py) against the reference decoder, bit for bit."""

import ctypes

import pytest
import torch
from gaac_triton_cases import realistic_kv

from gaac_hf.codec import decode_tiles, encode_tiles
from gaac_hf.cpu_decode import decode_slots


@pytest.mark.parametrize("d, kind, capacity", [(64, "mixed", 32), (64, "mixed", 16), (128, "mixed", 16),
                                               (128, "mixed", 64), (64, "raw", 1280), (64, "4bit", 256),
                                               (128, "raw", 2560)])
def test_decode_slots_equals_reference(d, kind, capacity):
    gen = torch.Generator().manual_seed(d + capacity)
    k, _, b3, b4 = realistic_kv(1, 3, 16 * 37, d, gen, kind)
    tiles = k.reshape(3, 37, 16, d)
    bases3 = b3[0][:, None, :].expand(3, 37, d).reshape(-1, d)
    bases4 = b4[0][:, None, :].expand(3, 37, d).reshape(-1, d)
    enc = encode_tiles(tiles.reshape(-1, 16, d), bases3, bases4, capacity)
    fits = enc.fits
    assert fits.any()
    got = decode_slots(enc.slots[fits], bases3[fits], bases4[fits], d)
    ref = decode_tiles(enc.slots[fits], bases3[fits], bases4[fits], d)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(got.view(torch.int16), tiles.reshape(-1, 16, d)[fits].view(torch.int16))


def test_decode_slots_of_nothing():
    out = decode_slots(torch.zeros(0, 1472, dtype=torch.uint8), torch.zeros(0, 64, dtype=torch.uint8),
                       torch.zeros(0, 64, dtype=torch.uint8), 64)
    assert out.shape == (0, 16, 64) and out.dtype == torch.bfloat16


# --- `expand_into` / `ops.expand_kv`: the C kernel and its torch fallback, against `decode_tiles` ------------------
from gaac_hf import cpu_decode, ops  # noqa: E402
from gaac_hf.format import tile_split  # noqa: E402


@pytest.fixture(params=["kernel", "torch"])
def decoder(request, monkeypatch):
    """Run a test through the C kernel, then through the torch fallback (the kernel reported unavailable)."""
    if request.param == "kernel":
        if cpu_decode.kernel() is None:
            pytest.skip("the C kernel cannot be built here (no working C compiler)")
    else:
        monkeypatch.setattr(cpu_decode, "kernel", lambda: None)
    return request.param


def compressed_layer(b, h, blocks, d, kind, capacity, seed):
    """A layer's worth of realistic K/V encoded like GAACLayer stores it: pools (slots in shuffled order, tiles whose
    escapes overflow `capacity` in the raw pool), table `[B, n, 2, H, T]`, flat bases, and the K/V themselves."""
    gen = torch.Generator().manual_seed(seed)
    k, v, b3, b4 = realistic_kv(b, h, 16 * blocks, d, gen, kind)
    t, c = tile_split(d)
    p = 2 * h * t
    b3, b4 = b3.reshape(p, c), b4.reshape(p, c)
    tiles = ops.tiles_of(k, v)  # [B, n, P, 16, C]
    slots, fits, _ = ops.encode(tiles, b3, b4, capacity)
    fits, slots, flat_tiles = fits.reshape(-1), slots.reshape(-1, slots.shape[-1]), tiles.reshape(-1, 16, c)
    n_fit = int(fits.sum())
    order = torch.randperm(n_fit, generator=gen)  # slot i of the fitting tiles lives at row order[i]
    slot_pool = torch.zeros(n_fit + 1, slots.shape[-1], dtype=torch.uint8)
    slot_pool[order] = slots[fits]
    raw_pool = flat_tiles[~fits].clone()
    entries = torch.empty(fits.numel(), dtype=torch.int32)
    entries[fits] = order.to(torch.int32)
    entries[~fits] = -1 - torch.arange(fits.numel() - n_fit, dtype=torch.int32)
    table = entries.reshape(b, blocks, 2, h, t)
    return table, slot_pool, raw_pool, b3, b4, k, v


def reference_kv(table, slot_pool, raw_pool, b3, b4):
    """`ops.expand_kv`'s K, V through the oracle `decode_tiles`, entry by entry."""
    b, n, _, h, t = table.shape
    c = raw_pool.shape[-1]
    flat = table.reshape(b * n, -1)
    bases3 = b3.expand(b * n, *b3.shape).reshape(-1, c)
    bases4 = b4.expand(b * n, *b4.shape).reshape(-1, c)
    e = flat.reshape(-1).long()
    out = decode_tiles(slot_pool[e.clamp(min=0)], bases3, bases4, c)
    out[e < 0] = raw_pool[-1 - e[e < 0]]
    kv = ops.blocks_of(out.reshape(b, n, -1, 16, c), h)
    return kv[:, 0], kv[:, 1]


CASES = [  # (head_dim, kind, capacity): 64/128 one tile, 256 two of 128, 80 five of 16, 96 three of 32
    (64, "mixed", 32), (64, "mixed", 0), (128, "mixed", 64), (256, "mixed", 32), (80, "mixed", 16),
    (96, "mixed", 16), (64, "raw", 640), (128, "raw", 1280), (64, "4bit", 256), (128, "4bit", 16)]


@pytest.mark.parametrize("d, kind, capacity", CASES)
def test_expand_kv_equals_reference(decoder, d, kind, capacity):
    table, slot_pool, raw_pool, b3, b4, k, v = compressed_layer(2, 2, 6, d, kind, capacity, d + capacity)
    if kind == "mixed":  # capacity 0: every tile raw; else raw tiles and slots mixed in one table
        assert raw_pool.shape[0] > 0 and (slot_pool.shape[0] > 1) == (capacity > 0)
    for b0, b1 in ((0, 6), (1, 4), (5, 6)):  # slices: the table's batch stride is not its row size
        got_k, got_v = ops.expand_kv(table[:, b0:b1], slot_pool, raw_pool, b3, b4)
        ref_k, ref_v = reference_kv(table[:, b0:b1], slot_pool, raw_pool, b3, b4)
        assert got_k.is_contiguous() and got_v.is_contiguous() and got_k.shape == (2, 2, 16 * (b1 - b0), d)
        assert torch.equal(got_k.view(torch.int16), ref_k.view(torch.int16))
        assert torch.equal(got_v.view(torch.int16), ref_v.view(torch.int16))
        assert torch.equal(got_k.view(torch.int16), k[:, :, 16 * b0:16 * b1].view(torch.int16))  # lossless
        assert torch.equal(got_v.view(torch.int16), v[:, :, 16 * b0:16 * b1].view(torch.int16))


@pytest.mark.parametrize("tail", [1, 15, 17])
@pytest.mark.parametrize("d", [64, 128])
def test_expand_kv_with_tails(decoder, d, tail):
    table, slot_pool, raw_pool, b3, b4, k, v = compressed_layer(2, 3, 4, d, "mixed", 16, tail)
    gen = torch.Generator().manual_seed(tail)
    tail_k, tail_v = (torch.randn(2, 3, tail, d, generator=gen).bfloat16() for _ in range(2))
    got_k, got_v = ops.expand_kv(table, slot_pool, raw_pool, b3, b4, tail_k, tail_v)
    assert torch.equal(got_k.view(torch.int16), torch.cat([k, tail_k], -2).view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), torch.cat([v, tail_v], -2).view(torch.int16))
    empty_k, empty_v = ops.expand_kv(table[:, :0], slot_pool, raw_pool, b3, b4, tail_k, tail_v)  # tail only
    assert torch.equal(empty_k.view(torch.int16), tail_k.view(torch.int16))
    assert torch.equal(empty_v.view(torch.int16), tail_v.view(torch.int16))


def test_expand_tiles_equals_reference(decoder):
    table, slot_pool, raw_pool, b3, b4, _, _ = compressed_layer(1, 2, 5, 128, "mixed", 16, 3)
    flat = table.reshape(1, 5, -1)
    got = ops.expand_tiles(flat, slot_pool, raw_pool, b3, b4)
    e = flat.reshape(-1).long()
    ref = decode_tiles(slot_pool[e.clamp(min=0)], b3.repeat(5, 1), b4.repeat(5, 1), 128)
    ref[e < 0] = raw_pool[-1 - e[e < 0]]
    assert got.shape == (1, 5, 4, 16, 128)
    assert torch.equal(got.reshape(-1, 16, 128).view(torch.int16), ref.view(torch.int16))


def test_kernel_refuses_corrupt_slots_and_bad_entries():
    if cpu_decode.kernel() is None:
        pytest.skip("the C kernel cannot be built here (no working C compiler)")
    table, slot_pool, raw_pool, b3, b4, _, _ = compressed_layer(1, 1, 2, 64, "mixed", 16, 5)
    layout = cpu_decode.TileLayout.of_slot_bytes(64, slot_pool.shape[-1])
    bad = slot_pool.clone()
    bad[:, layout.tags_offset + layout.tag_plane_bytes] |= 1  # raw tag of group 0 ...
    bad[:, layout.tags_offset] &= 0xFE  # ... without its wide tag
    with pytest.raises(ValueError, match="raw bit without the wide bit"):
        ops.expand_kv(table.clamp(min=0), bad, raw_pool, b3, b4)
    bad = slot_pool.clone()
    bad[:, layout.tags_offset:layout.tags_end] = 0xFF  # every group raw: 5 bytes each, far past 16
    with pytest.raises(ValueError, match="more escape bytes"):
        ops.expand_kv(table.clamp(min=0), bad, raw_pool, b3, b4)
    for entry in (slot_pool.shape[0], -1 - raw_pool.shape[0]):
        with pytest.raises(ValueError, match="outside its pool"):
            ops.expand_kv(torch.full_like(table, entry), slot_pool, raw_pool, b3, b4)


def test_kernel_falls_back_silently(monkeypatch):
    """No compiler (or GAAC_HF_CPU_KERNEL=0): `kernel()` is None, and the caches decode through the torch decoder."""
    table, slot_pool, raw_pool, b3, b4, k, v = compressed_layer(1, 2, 3, 64, "mixed", 16, 7)
    for env, value in (("CC", "/nonexistent/cc"), (cpu_decode.KERNEL_ENV, "0")):
        with monkeypatch.context() as m:
            m.setenv(env, value)
            cpu_decode.kernel.cache_clear()
            assert cpu_decode.kernel() is None
            got_k, got_v = ops.expand_kv(table, slot_pool, raw_pool, b3, b4)
            assert torch.equal(got_k.view(torch.int16), k.view(torch.int16))
            assert torch.equal(got_v.view(torch.int16), v.view(torch.int16))
        cpu_decode.kernel.cache_clear()
    with pytest.raises(FileNotFoundError, match="no C compiler"):
        cpu_decode.build_kernel("/nonexistent/cc")


def test_kernel_is_built_once_and_cached(tmp_path, monkeypatch):
    if cpu_decode.kernel() is None:
        pytest.skip("the C kernel cannot be built here (no working C compiler)")
    monkeypatch.setenv("GAAC_HF_CACHE", str(tmp_path))
    path = cpu_decode.build_kernel()
    assert path.is_file() and path.parent == tmp_path / "cpu_kernel"
    stamp = path.stat().st_mtime_ns
    assert cpu_decode.build_kernel() == path and path.stat().st_mtime_ns == stamp  # the cached build is reused


def test_an_unwritable_cache_builds_the_kernel_for_the_process(tmp_path, monkeypatch):
    if cpu_decode.kernel() is None:
        pytest.skip("the C kernel cannot be built here (no working C compiler)")
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GAAC_HF_CACHE", str(blocker / "cache"))  # mkdir fails here even for root
    path = cpu_decode.build_kernel()
    assert path.is_file() and not str(path).startswith(str(blocker))
    assert ctypes.CDLL(str(path)).gaac_expand is not None


def test_expand_into_rejects_bad_shapes():
    table, slot_pool, raw_pool, b3, b4, _, _ = compressed_layer(1, 1, 2, 64, "mixed", 16, 9)
    with pytest.raises(ValueError, match="out must be"):
        cpu_decode.expand_into(table, slot_pool, raw_pool, b3, b4, torch.empty(1, 2, 2, 1, 1, 16, 32).bfloat16())
    with pytest.raises(ValueError, match="bases must be"):
        cpu_decode.expand_into(table, slot_pool, raw_pool, b3[:1], b4[:1],
                               torch.empty(1, 2, 2, 1, 1, 16, 64).bfloat16())


def test_cpu_step_benchmark_runs(tmp_path):
    """`benchmarks/cpu_step.py` on a short context: both caches timed, bit-identical under both attentions."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import cpu_step

    out = tmp_path / "cpu_step.json"
    threads = torch.get_num_threads()
    try:
        cpu_step.main(["--contexts", "40", "--steps", "2", "--threads", "1", "--out", str(out)])
    finally:
        torch.set_num_threads(threads)
    res = json.loads(out.read_text())
    row = res["contexts"]["40"]
    assert res["cpu_decoder"] in ("C kernel", "torch") and len(res["load_average_after"]) == 3
    for attn in ("sdpa", "gaac"):
        assert row[f"bit_identical ({attn})"] is True
        assert row[f"DynamicCache + {attn}"] > 0 and row[f"GAACCache + {attn}"] > 0
