"""Format version 2 in fragment order (the CUDA kernel's format 3, read by `k_tile_f3` / `v_tile_f3`): on the CPU,
every element of a tile rebuilt by the kernel's bit operations (emulated here word by word: the prepass reading the
tags and the plane-ordered escape area, the raw groups' overlay, the tile's words) equals the BF16 it encodes, bit
for bit."""

import pytest
import torch

from gaac_hf.format_v2 import encode_tiles, fragment_maps, to_fragment_order
from gaac_hf.format import MODE_3BIT, MODE_4BIT, MODE_RAW, TileLayout

M32 = 0xFFFFFFFF


def rotr(x, r):
    r %= 32
    return ((x >> r) | (x << (32 - r))) & M32 if r else x


def prmt(a, b, sel):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def word(buf, at):
    return int.from_bytes(bytes(buf[at:at + 4]), "little")


def high(y, r, mw, pw, b2):  # f3_high
    if y == 0:
        return (mw & 0x83838383) | b2
    if y == 1:
        return (rotr(mw, 3) & 0x83838383) | b2
    sb = (((mw << (2 if y == 2 else 1)) & M32) & 0x80808080) | b2
    return (rotr(pw, 2 * r) & 0x03030303) | sb


def tile_groups(x, mode, base3, base4):
    """What the prepass leaves in scratch for one tile: per group its base (halved), code bit 2 per token
    (plane 3), code bits 3..6 of raw groups (planes 4..7)."""
    c = x.shape[-1]
    bits = x.view(torch.int16).to(torch.int32) & 0xFFFF
    half = ((bits >> 7) & 0xFF) >> 1  # [16, C]
    groups = half.reshape(2, 8, c).transpose(1, 2).reshape(2 * c, 8)  # group h*C + ch, token bit i
    chan = torch.arange(2 * c) % c
    base = torch.where(mode == MODE_3BIT, base3[chan] >> 1, torch.where(mode == MODE_4BIT, base4[chan] >> 1, 0))
    code = (groups - base[:, None]) & 0x7F
    planes = [(((code >> p) & 1) << torch.arange(8)).sum(-1) for p in range(2, 7)]
    return base.tolist(), [pl.tolist() for pl in planes], (mode == MODE_RAW).tolist()


def prepass_from_slot(slot, c, layout, base3, base4):
    """What the kernel's prepass reads out of a slot (its tags and escape area), lane by lane as it does: lane L owns
    groups L*GPL .. L*GPL + GPL - 1; its plane-3 bytes are consecutive from the exclusive prefix of the wide-tag
    counts (one scan; `plane3_window` takes them by rank); the raw groups' planes 4..7 are 4 bytes each after all
    plane-3 bytes, in the order the overlay's warp loop takes them (lane, then group). Same shape as `tile_groups`."""
    g_all = 2 * c
    gpl = g_all // 32
    tags = slot[layout.tags_offset:layout.tags_offset + 2 * (g_all // 8)]
    wide = [(tags[g // 8] >> (g % 8)) & 1 for g in range(g_all)]
    raw = [(tags[g_all // 8 + g // 8] >> (g % 8)) & 1 for g in range(g_all)]
    esc = slot[layout.escape_offset:]
    n_wide = sum(wide)
    p3, base, hi = [0] * g_all, [0] * g_all, [[0] * g_all for _ in range(4)]
    off, rank_raw = 0, 0
    for lane in range(32):
        groups = range(lane * gpl, (lane + 1) * gpl)
        rank = 0
        for g in groups:
            ch = g % c
            base[g] = 0 if raw[g] else (int(base4[ch]) >> 1 if wide[g] else int(base3[ch]) >> 1)
            if wide[g]:
                p3[g] = esc[off + rank]
                rank += 1
            if raw[g]:
                for j in range(4):
                    hi[j][g] = esc[n_wide + 4 * rank_raw + j]
                rank_raw += 1
        off += rank
    return base, [p3] + hi, [bool(r) for r in raw]


def overlay(c, is_v, planes, raw):
    """GAAC_F3RAW=3: the scratch overlay `f3_overlay` scatters (its byte addresses and rotations), as words."""
    nks, nvw = c // 16, c // 32
    ov = [0] * (2 * c)  # 4G bytes
    for gi in (i for i, r in enumerate(raw) if r):
        h, ch = divmod(gi, c)
        w = ch >> 2
        for b in range(8):
            nib = sum(((planes[1 + j][gi] >> b) & 1) << j for j in range(4))
            if is_v:
                j = w % nvw
                at = ((j // 2) * 32 + 4 * (w // nvw) + b // 2) * 16 + 4 * (2 * (j % 2) + ((ch >> 1) & 1))
                e = 2 * (ch & 1) + (b & 1)
            else:
                at = (((w % nks) // 4) * 32 + 4 * b + w // nks) * 16 + 4 * (w % 4)
                e = ch & 3
            v = nib << (8 * e + 3)
            ov[at // 4] |= rotr(v, 28) if h else v  # (rotate left by 4)
    return ov


def emulate(slot, c, is_v, layout, base, planes, raw):
    """Elements rebuilt by the kernel's format-3 path -> {(token, channel): bf16 bits}; raw groups get code bits
    3..6 from the overlay, in the same add as the bases."""
    out = {}
    n, nks, nvw = c // 8, c // 16, c // 32
    ov = overlay(c, is_v, planes, raw)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        mw = [word(slot, layout.planes_offset + (x * 32 + lane) * 4) for x in range(n // 4)]
        pw = [word(slot, layout.planes_offset + ((n // 4 + x) * 32 + lane) * 4) for x in range(n // 8)]
        for q in range(n):
            low = word(slot, ((q // 4) * 32 + lane) * 16 + (q % 4) * 4)
            mk, y = q // 4, q % 4
            if is_v:
                j, h, k = q // 4, (q % 4) // 2, q % 2
                gi = [h * c + 4 * (g * nvw + j) + 2 * k + (e >> 1) for e in range(4)]
                tb = [2 * t + (e & 1) for e in range(4)]
                # prepass: doubled bases, plane-3 bits of even / odd tokens at even bits
                o = sum(base[gi[e]] << (8 * e) for e in range(4))
                xw = sum(((planes[0][gi[e]] >> (e & 1)) & 0x55) << (8 * e) for e in range(4))
                b2 = rotr(xw, (2 * t - 2) % 32) & 0x04040404
                r = 2 * (j % 2) + y - 2
            else:
                s4, h, i = q // 8, (q // 4) % 2, q % 4
                gi = [h * c + 4 * (t * nks + 4 * s4 + i) + e for e in range(4)]
                tb = [g] * 4
                o = sum(base[gi[e]] << (8 * e) for e in range(4))
                p3 = sum(planes[0][gi[e]] << (8 * e) for e in range(4))
                b2 = rotr(p3, (g - 2) % 32) & 0x04040404
                r = 2 * h + i - 2
            # the overlay: A words (h = 0) as stored, B words rotated right by 4
            x = ov[(((j // 2) * 32 + lane) * 16 + 4 * (2 * (j % 2) + k)) // 4] if is_v else \
                ov[((s4 * 32 + lane) * 16 + 4 * i) // 4]
            o += rotr(x, 4 * h) & 0x78787878
            hw = (high(y, r, mw[mk], pw[q // 8], b2) + o) & M32
            if is_v:
                regs = [prmt(low, hw, 0x5140), prmt(low, hw, 0x7362)]
                for e in range(4):
                    ch, tok = gi[e] % c, 8 * (gi[e] // c) + tb[e]
                    out[(tok, ch)] = (regs[e >> 1] >> (16 * (e & 1))) & 0xFFFF
            else:
                lo, hi = prmt(low, hw, 0x6240), prmt(low, hw, 0x7351)
                tok = 8 * h + g
                for e, (reg, half) in enumerate([(lo, 0), (hi, 0), (lo, 1), (hi, 1)]):
                    out[(tok, gi[e] % c)] = (reg >> (16 * half)) & 0xFFFF
    return out


@pytest.mark.parametrize("c", [64, 128])
@pytest.mark.parametrize("is_v", [False, True])
def test_fragment_maps_place_every_bit_once(c, is_v):
    low_src, plane, group, tbit = fragment_maps(c, is_v)
    assert sorted(low_src.tolist()) == list(range(16 * c))
    assert sorted(zip(plane.tolist(), group.tolist(), tbit.tolist())) == sorted(
        (p, gi, b) for p in range(3) for gi in range(2 * c) for b in range(8))


@pytest.mark.parametrize("c", [64, 128])
@pytest.mark.parametrize("is_v", [False, True])
def test_emulated_kernel_decode_of_format_3_is_lossless(c, is_v):
    gen = torch.Generator().manual_seed(c + is_v)
    scale = torch.exp2(torch.randint(-6, 4, (c,), generator=gen).float())
    x = (torch.randn(3, 16, c, generator=gen) * scale)
    x[0, 3, 5] = 1e-30  # raw groups: far out of every window
    x[1, 9, 7] = 3e4
    x[2, 0, :8] = 0.0
    x = x.to(torch.bfloat16)
    e = (x.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    base3 = (e.reshape(-1, c).median(0).values.to(torch.int32) - 4) & ~1  # even windows
    base4 = (base3 - 4) & ~1
    layout = TileLayout(c, 512)
    slots, fits, mode = encode_tiles(x, base3.to(torch.uint8), base4.to(torch.uint8), 512)
    assert fits.all() and (mode == MODE_4BIT).any() and (mode == MODE_RAW).any() and (mode == MODE_3BIT).any()
    f3 = to_fragment_order(slots, c, is_v)
    assert f3.shape == slots.shape
    for n in range(x.shape[0]):
        base, planes, raw = prepass_from_slot(f3[n].tolist(), c, layout, base3, base4)
        # what the prepass reads from the tags and the escape area is each group's base and escaped code bits
        assert (base, planes, raw) == tile_groups(x[n], mode[n], base3, base4)
        want = x[n].view(torch.int16).to(torch.int32) & 0xFFFF
        got = emulate(f3[n].tolist(), c, is_v, layout, base, planes, raw)
        assert len(got) == 16 * c
        bad = [(k, v, int(want[k])) for k, v in got.items() if v != int(want[k])]
        assert not bad, bad[:5]


@pytest.mark.parametrize("c", [64, 128])
@pytest.mark.parametrize("is_v", [False, True])
def test_overlay_words_hold_each_raw_element_once(c, is_v):
    """The overlay's two words per 32 bits never overlap: with every group raw and every bit set, each element's
    4 bits land in distinct places and fill the 4 bits x C x 16 elements exactly."""
    ov = overlay(c, is_v, [[0xFF] * (2 * c)] * 5, [True] * (2 * c))
    assert sum(bin(w).count("1") for w in ov) == 4 * 16 * c
