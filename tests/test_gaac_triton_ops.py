"""Triton kernels against the torch reference codec, on the CPU under TRITON_INTERPRET=1 (small shapes) and on
CUDA (large shapes, marked gpu)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops is imported
triton = pytest.importorskip("triton")

from gaac_triton_cases import compress_kv, realistic_kv  # noqa: E402

from gaac_hf.codec import decode_tiles  # noqa: E402
from gaac_hf.format import TileLayout, tile_split  # noqa: E402
from triton_ops.gaac_attention import fused_compressed_attention, fused_plain_attention  # noqa: E402
from triton_ops.gaac_decode import expand_tiles  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def bits(x):
    return x.view(torch.int16)


@pytest.mark.parametrize("d, kind, capacity", [(64, "mixed", 32), (128, "mixed", 16), (256, "mixed", 48),
                                               (64, "raw", 1280), (64, "4bit", 256), (128, "mixed", 0),
                                               (80, "mixed", 16), (96, "raw", 320)])
def test_expand_kernel_is_bit_exact(d, kind, capacity):
    gen = torch.Generator().manual_seed(d + capacity)
    k, v, b3, b4 = realistic_kv(2, 2, 48, d, gen, kind)
    slot_pool, raw_pool, table, _, _, fits = compress_kv(k, v, b3, b4, capacity)
    c = tile_split(d)[1]
    period = table.shape[2] * table.shape[3] * table.shape[4]
    out = expand_tiles(table.reshape(*table.shape[:2], period).to(DEVICE), slot_pool.to(DEVICE), raw_pool.to(DEVICE),
                       b3.reshape(period, c).to(DEVICE), b4.reshape(period, c).to(DEVICE),
                       TileLayout(c, capacity)).cpu()
    # the reference: decode every slot tile with the torch codec, raw tiles as they are
    ref = torch.empty_like(out.reshape(-1, 16, c))
    flat = table.reshape(-1)
    bb3 = b3.reshape(1, period, c).expand(flat.numel() // period, period, c).reshape(-1, c)
    bb4 = b4.reshape(1, period, c).expand(flat.numel() // period, period, c).reshape(-1, c)
    s = flat >= 0
    if s.any():
        ref[s] = decode_tiles(slot_pool[flat[s].long()], bb3[s], bb4[s], c)
    ref[~s] = raw_pool[(-1 - flat[~s]).long()]
    assert torch.equal(bits(out.reshape(-1, 16, c)), bits(ref))
    if kind == "raw":
        assert fits.all()  # raw groups, but the slot holds their escapes


def attention_case(b, h, nrep, s, d, kind, capacity, seed, pad=0):
    gen = torch.Generator().manual_seed(seed)
    k, v, b3, b4 = realistic_kv(b, h, s, d, gen, kind)
    slot_pool, raw_pool, table, tk, tv, fits = compress_kv(k, v, b3, b4, capacity)
    q = torch.randn(b, h * nrep, d, generator=gen).to(torch.bfloat16)
    mask = None
    if pad:
        mask = torch.ones(b, s, dtype=torch.bool)
        mask[0, :pad] = False
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    return [to(x) for x in (q, k, v, slot_pool, raw_pool, table, tk, tv, b3, b4, mask)], fits


def reference_attention(q, k, v, mask, scale):
    nrep = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(nrep, 1)
    vv = v.double().repeat_interleave(nrep, 1)
    sc = torch.einsum("bhd,bhsd->bhs", q.double(), kk) * scale
    if mask is not None:
        sc = sc.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", sc.softmax(-1), vv)


CPU_CASES = [  # (batch, kv heads, query heads per kv head, tokens, head_dim, mode mix, capacity, left pad)
    (1, 1, 1, 1, 64, "mixed", 32, 0),
    (2, 2, 3, 15, 64, "mixed", 32, 3),
    (1, 2, 4, 17, 128, "mixed", 16, 0),
    (2, 1, 2, 67, 64, "raw", 1280, 5),
    (1, 1, 9, 50, 64, "4bit", 256, 0),
    (1, 1, 2, 40, 256, "mixed", 48, 0),
    (2, 3, 3, 100, 64, "mixed", 0, 7),
]


@pytest.mark.parametrize("case", CPU_CASES)
def test_fused_attention_compressed_equals_plain(case):
    b, h, nrep, s, d, kind, cap, pad = case
    (q, k, v, sp, rp, tab, tk, tv, b3, b4, mask), _ = attention_case(b, h, nrep, s, d, kind, cap, sum(case[:5]), pad)
    scale = d ** -0.5
    for splits in (1, 3):
        layout = TileLayout(tile_split(d)[1], cap)
        got = fused_compressed_attention(q, sp, rp, tab, tk, tv, b3, b4, scale, layout, mask, num_splits=splits,
                                         blocks_per_iter=8)
        plain = fused_plain_attention(q, k, v, scale, layout, mask, num_splits=splits, blocks_per_iter=8)
        assert torch.equal(bits(got), bits(plain)), "reconstruction changed the attention output"
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(), scale)
    err = ((got.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < 1e-2, err


@gpu
@pytest.mark.parametrize("s", [1, 15, 17, 1000, 65537])
def test_fused_attention_large_on_gpu(s):
    (q, k, v, sp, rp, tab, tk, tv, b3, b4, mask), _ = attention_case(2, 2, 4, s, 128, "mixed", 32, s,
                                                                     pad=1 if s > 1 else 0)
    layout = TileLayout(128, 32)
    got = fused_compressed_attention(q, sp, rp, tab, tk, tv, b3, b4, 128 ** -0.5, layout, mask)
    plain = fused_plain_attention(q, k, v, 128 ** -0.5, layout, mask)
    assert torch.equal(bits(got), bits(plain))
    ref = reference_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(), 128 ** -0.5)
    assert ((got.cpu().double() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("d, kind, capacity", [(64, "mixed", 32), (128, "mixed", 16), (256, "mixed", 48),
                                               (64, "raw", 1280), (64, "raw", 48), (128, "4bit", 64),
                                               (80, "mixed", 16), (96, "raw", 320), (48, "4bit", 32)])
def test_encode_kernel_is_bit_exact(d, kind, capacity):
    from gaac_hf.codec import encode_tiles, split_head
    from triton_ops.gaac_encode import gaac_encode

    gen = torch.Generator().manual_seed(7 * d + capacity)
    k, v, b3, b4 = realistic_kv(2, 2, 48, d, gen, kind)
    c = tile_split(d)[1]
    tiles = split_head(torch.stack([k, v], 2).reshape(2, 2, 2, 3, 16, d).permute(0, 3, 2, 1, 4, 5))
    shape = (2, 2, d // c, c)
    ref = encode_tiles(tiles, b3.reshape(shape), b4.reshape(shape), capacity)
    period = 2 * 2 * (d // c)
    flat = tiles.reshape(2, 3, period, 16, c)
    slots, esc, modes = gaac_encode(flat.to(DEVICE), b3.reshape(period, c).to(DEVICE),
                                    b4.reshape(period, c).to(DEVICE), TileLayout(c, capacity))
    assert torch.equal(slots.cpu(), ref.slots.reshape(2, 3, period, -1))
    assert torch.equal(esc.cpu(), ref.escape_bytes.reshape(2, 3, period))
    counts = torch.stack([(ref.modes == m).sum(-1) for m in range(3)], -1).reshape(2, 3, period, 3)
    assert torch.equal(modes.cpu(), counts.to(torch.int32))


@pytest.mark.parametrize("d, kind, capacity", [(64, "mixed", 32), (128, "mixed", 16), (64, "raw", 48),
                                               (128, "4bit", 64), (80, "mixed", 16), (96, "raw", 320)])
def test_encode_kernel_writes_format_2_bit_exactly(d, kind, capacity):
    """format_version=2: the byte-split slots of gaac_hf.format_v2, in plane order and, for 64- and 128-channel
    tiles given the fragment map, in the stored (fragment) order of K and V tiles; escapes truncated alike."""
    from gaac_hf.codec import split_head
    from gaac_hf.format_v2 import encode_kv, encode_tiles, fragment_map
    from triton_ops.gaac_encode import gaac_encode

    gen = torch.Generator().manual_seed(11 * d + capacity)
    k, v, b3, b4 = realistic_kv(2, 2, 48, d, gen, kind)
    b3, b4 = b3 & 0xFE, b4 & 0xFE  # even windows
    c = tile_split(d)[1]
    tiles = split_head(torch.stack([k, v], 2).reshape(2, 2, 2, 3, 16, d).permute(0, 3, 2, 1, 4, 5))
    shape = (2, 2, d // c, c)
    ref, fits, mode = encode_tiles(tiles, b3.reshape(shape), b4.reshape(shape), capacity)
    period = 2 * 2 * (d // c)
    slots, esc, modes = gaac_encode(tiles.reshape(2, 3, period, 16, c).to(DEVICE), b3.reshape(period, c).to(DEVICE),
                                    b4.reshape(period, c).to(DEVICE), TileLayout(c, capacity), format_version=2)
    assert torch.equal(slots.cpu(), ref.reshape(2, 3, period, -1))
    assert torch.equal((esc.cpu() <= capacity), fits.reshape(2, 3, period))
    counts = torch.stack([(mode == m).sum(-1) for m in range(3)], -1).reshape(2, 3, period, 3)
    assert torch.equal(modes.cpu(), counts.to(torch.int32))
    frag = fragment_map(c, DEVICE)
    if frag is None:
        return
    stored, _, _ = encode_kv(tiles.reshape(2, 3, period, 16, c), b3.reshape(period, c), b4.reshape(period, c),
                             capacity)
    slots, _, _ = gaac_encode(tiles.reshape(2, 3, period, 16, c).to(DEVICE), b3.reshape(period, c).to(DEVICE),
                              b4.reshape(period, c).to(DEVICE), TileLayout(c, capacity), format_version=2,
                              fragment=frag)
    assert torch.equal(slots.cpu(), stored)
    assert not torch.equal(stored, ref.reshape(2, 3, period, -1))  # the order differs from the plane order
    with pytest.raises(ValueError, match="fragment must be"):
        gaac_encode(tiles.reshape(2, 3, period, 16, c)[:1].to(DEVICE), b3.reshape(period, c).to(DEVICE),
                    b4.reshape(period, c).to(DEVICE), TileLayout(c, capacity), format_version=2, fragment=frag[0])


@pytest.mark.parametrize("d, kind, capacity", [(64, "mixed", 32), (128, "mixed", 80), (128, "4bit", 256),
                                               (64, "raw", 1280), (80, "mixed", 16), (96, "mixed", 16)])
def test_expand_kernel_reads_format_2_bit_exactly(d, kind, capacity):
    """The version-2 expand kernel over a block table of slots (fragment order at 64/128 channels, plane order
    below) and raw tiles gives back the very KV that was encoded."""
    from gaac_hf import ops
    from gaac_hf.format_v2 import fragment_map
    from triton_ops.gaac_decode import expand_tiles_v2

    gen = torch.Generator().manual_seed(5 * d + capacity)
    k, v, b3, b4 = realistic_kv(2, 2, 48, d, gen, kind, even=True)
    c = tile_split(d)[1]
    tiles = ops.tiles_of(k, v)  # [2, 3, P, 16, C]: K positions, then V
    period = tiles.shape[2]
    b3, b4 = b3.reshape(period, c), b4.reshape(period, c)
    slots, fits, _ = ops.encode(tiles, b3, b4, capacity, format_version=2)  # the torch reference on the CPU
    n = fits.numel()
    at = torch.randperm(n, generator=gen)  # pool rows in another order than the table
    table = torch.where(fits.reshape(-1), at, -1 - at).to(torch.int32).reshape(fits.shape)
    slot_pool = torch.empty(n, slots.shape[-1], dtype=torch.uint8)
    slot_pool[at] = slots.reshape(n, -1)
    raw_pool = torch.empty(n, 16, c, dtype=torch.bfloat16)
    raw_pool[at] = tiles.reshape(n, 16, c)
    assert kind == "raw" or (bool(fits.any()) and (kind == "4bit" or not bool(fits.all())))
    out = expand_tiles_v2(table.to(DEVICE), slot_pool.to(DEVICE), raw_pool.to(DEVICE), b3.to(DEVICE), b4.to(DEVICE),
                          TileLayout(c, capacity), fragment_map(c, DEVICE)).cpu()
    assert torch.equal(bits(out), bits(tiles))
    ref = ops.expand_tiles(table, slot_pool, raw_pool, b3, b4, format_version=2)  # the torch reference
    assert torch.equal(bits(ref), bits(tiles))


class _PaddedLayout:
    """A slot layout with 16 spare bytes before the code planes, the mode tags and the escape area: a stand-in for a
    format change, to show that the kernels take every section offset from the layout they are given."""

    def __init__(self, channels, escape_capacity):
        base = TileLayout(channels, escape_capacity)
        self.channels, self.escape_capacity = channels, escape_capacity
        self.planes_offset = base.planes_offset + 16
        self.tags_offset = base.tags_offset + 32
        self.escape_offset = base.escape_offset + 48
        self.slot_bytes = base.slot_bytes + 48
        self.base = base


def test_kernels_take_the_slot_offsets_from_the_layout():
    from gaac_hf.codec import encode_tiles
    from triton_ops.gaac_encode import gaac_encode

    gen = torch.Generator().manual_seed(5)
    c, cap, period = 64, 640, 4  # capacity 640: every tile fits, so every tile round-trips
    k, v, b3, b4 = realistic_kv(1, 2, 16, c, gen, "mixed")
    tiles = torch.stack([k, v], 1).reshape(1, period, 16, c)
    b3, b4 = b3.reshape(period, c), b4.reshape(period, c)
    ref = encode_tiles(tiles, b3, b4, cap).slots.reshape(period, -1)
    padded = _PaddedLayout(c, cap)
    slots, _, _ = gaac_encode(tiles.to(DEVICE), b3.to(DEVICE), b4.to(DEVICE), padded)
    slots = slots.cpu().reshape(period, -1)
    base = padded.base
    sections = [(0, 0, base.planes_offset), (base.planes_offset, padded.planes_offset, base.tags_offset),
                (base.tags_offset, padded.tags_offset, base.escape_offset),
                (base.escape_offset, padded.escape_offset, base.slot_bytes)]
    for start, moved, end in sections:  # each section sits where the padded layout puts it, bit for bit
        assert torch.equal(slots[:, moved:moved + end - start], ref[:, start:end])
    table = torch.arange(period, dtype=torch.int32).reshape(1, period)
    raw_pool = torch.zeros(1, 16, c, dtype=torch.bfloat16)
    out = expand_tiles(table.to(DEVICE), slots.to(DEVICE), raw_pool.to(DEVICE), b3.to(DEVICE), b4.to(DEVICE),
                       padded).cpu()
    assert torch.equal(bits(out.reshape(period, 16, c)), bits(tiles.reshape(period, 16, c)))


def test_a_layout_that_does_not_match_the_pool_is_refused():
    gen = torch.Generator().manual_seed(3)
    k, v, b3, b4 = realistic_kv(1, 1, 16, 64, gen, "mixed")
    slot_pool, raw_pool, table, _, _, _ = compress_kv(k, v, b3, b4, 32)
    period = table.shape[2] * table.shape[3] * table.shape[4]
    args = (table.reshape(1, -1, period), slot_pool, raw_pool, b3.reshape(period, 64), b4.reshape(period, 64))
    with pytest.raises(ValueError, match="slot pool rows are"):
        expand_tiles(*args, TileLayout(64, 48))
    with pytest.raises(ValueError, match="128-channel tiles"):
        expand_tiles(*args, TileLayout(128, 32))


def test_triton_ops_restates_no_slot_offset():
    """The slot layout lives in `gaac_hf/format.py` alone: no kernel file derives a section offset or a slot size."""
    import re
    from pathlib import Path

    offset = re.compile(r"^\s*(?:PLANES|TAGS|ESC)\s*:\s*tl\.constexpr\s*=|16 \* (?:C|c|channels) \+ \d+ \*", re.M)
    root = Path(__file__).resolve().parents[1] / "triton_ops"
    found = {p.name: offset.findall(p.read_text()) for p in root.glob("*.py")}
    assert not {name: hits for name, hits in found.items() if hits}
