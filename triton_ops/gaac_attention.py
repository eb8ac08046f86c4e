"""Fused split-K attention of one query token (the decode step) over GAAC-compressed KV (slots + raw tiles + BF16
tail): `fused_compressed_attention`, and `fused_plain_attention` over plain BF16 KV.

Grid: (batch x kv-head, split). A program reads each KV tile once for all query heads of its GQA group, reconstructs
BF16 in registers (`tile.chunk_words`, `tile.token_rows`) and keeps an fp32 online softmax (base 2); a second kernel
combines the splits. A chunk is NB blocks (16 NB tokens) of one (batch row, kv-head): its group-level words are read
once, then its 8 token slices (token I of each half block, 2 NB rows each) are reconstructed and multiplied one after
another: first all K slices (scores), one softmax update for the chunk, then all V slices. The next chunk's tiles are
prefetched into L2 meanwhile.

`fused_plain_attention` runs the very same compiled kernel over plain BF16 KV, presented as raw tiles: the lossless
reference. Reconstruction only changes where the BF16 bits come from, so both give identical output bits.
"""

import functools

import torch
import triton
import triton.language as tl

from .device import interpreted, on_device_of
from .layout import slot_constants
from .tile import chunk_words, prefetch_tiles, slot_row_words, token_rows

BLOCK = 16
LOG2E = 1.4426950408889634


# Triton's CPU interpreter multiplies BF16 operands of tl.dot as raw integers (seen with triton 3.9), so under
# TRITON_INTERPRET=1 the products run in fp32 (F32); on a GPU they are BF16 tensor-core products.
@triton.jit
def _dot(a, b, F32: tl.constexpr):
    if F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def _base_words(b3_ptr, b4_ptr, KV: tl.constexpr, TILE: tl.constexpr, hk, H_KV, C: tl.constexpr,
                TILES: tl.constexpr):
    """Bases of (K|V, head, tile) as `[1, C/2]` words: word w holds channels (4w) % C .. + 3 (see tile.chunk_words)."""
    w = tl.arange(0, C // 2)[None, :]
    kind = (KV * H_KV + hk) * TILES + TILE
    at = kind * (C // 4) + w % (C // 4)
    return tl.load(b3_ptr + at).to(tl.uint32, bitcast=True), tl.load(b4_ptr + at).to(tl.uint32, bitcast=True)


@triton.jit
def _chunk(slot_ptr, slot_w_ptr, entry, live, b3w, b4w, SLOT_BYTES, NB: tl.constexpr, C: tl.constexpr,
           PLANES: tl.constexpr, TAGS: tl.constexpr, ESC: tl.constexpr):
    """Classify the table entries of NB blocks (`entry` `[NB, 1]`) and, where any is a slot, load their
    group-level words: `(in_slot, in_raw, any_slot, any_raw, p0..p7, base, has_raw)`."""
    in_slot = live & (entry >= 0)
    in_raw = live & (entry < 0)
    any_slot = tl.max(tl.max(in_slot.to(tl.int32), axis=1), axis=0) > 0
    any_raw = tl.max(tl.max(in_raw.to(tl.int32), axis=1), axis=0) > 0
    z = tl.zeros([NB, C // 2], tl.uint32)
    p0, p1, p2, p3, p4, p5, p6, p7, base, has_raw = z, z, z, z, z, z, z, z, z, any_slot != any_slot
    if any_slot:
        p0, p1, p2, p3, p4, p5, p6, p7, base, has_raw = chunk_words(slot_ptr, slot_w_ptr, entry, in_slot, b3w, b4w,
                                                                    SLOT_BYTES, C, PLANES, TAGS, ESC)
    return in_slot, in_raw, any_slot, any_raw, p0, p1, p2, p3, p4, p5, p6, p7, base, has_raw


@triton.jit
def _attend(q0, q1, m_i, l_i, acc0, acc1, k0, k1, v0, v1, valid, qk_scale, TILES: tl.constexpr, F32: tl.constexpr,
            MATH: tl.constexpr):
    """One online-softmax step (base 2) over BF16 rows k*, v* `[R, C]`; `valid` `[R]`: rows that take part."""
    if MATH:
        s = _dot(q0, tl.trans(k0), F32)
        if TILES == 2:
            s += _dot(q1, tl.trans(k1), F32)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        pb = p.to(tl.bfloat16)
        acc0 = acc0 * alpha[:, None] + _dot(pb, v0, F32)
        if TILES == 2:
            acc1 = acc1 * alpha[:, None] + _dot(pb, v1, F32)
        m_i = m_new
    else:  # benchmark variant: the rows are read and reconstructed, no attention math
        acc0 += tl.sum(k0.to(tl.float32) + v0.to(tl.float32), axis=0)[None, :]
        if TILES == 2:
            acc1 += tl.sum(k1.to(tl.float32) + v1.to(tl.float32), axis=0)[None, :]
    return m_i, l_i, acc0, acc1


@triton.jit
def _slice_scores(q0, q1, slot_w_ptr, raw_w_ptr, live, ea, sa, ra, asa, ara, a0, a1, a2, a3, a4, a5, a6, a7, ab,
                  arw, eb, sb, rb, asb, arb, b0, b1, b2, b3, b4, b5, b6, b7, bb, brw, SLOT_BYTES, RAW_TILE, RAW_ROW,
                  j0, end, bq, s_mb, mask_ptr, qk_scale, I: tl.constexpr, NB: tl.constexpr, C: tl.constexpr,
                  TILES: tl.constexpr, HAS_MASK: tl.constexpr, F32: tl.constexpr, ASM: tl.constexpr,
                  RECON: tl.constexpr, MATH: tl.constexpr, wa=None, wb=None):
    """Scaled, masked scores `[NREP_PAD, 2NB]` of token slice I (row 2j + h: token 8h + I of block j0 + j)."""
    k0 = token_rows(slot_w_ptr, raw_w_ptr, ea, live, sa, ra, asa, ara, a0, a1, a2, a3, a4, a5, a6, a7, ab, arw,
                    SLOT_BYTES, RAW_TILE, RAW_ROW, I, NB, C, ASM, RECON, wa)
    if MATH:
        s = _dot(q0, tl.trans(k0), F32)
    else:  # benchmark variant: the rows are read and reconstructed, no tensor-core product
        s = tl.zeros([q0.shape[0], 2 * NB], tl.float32) + tl.sum(k0.to(tl.float32), axis=1)[None, :]
    if TILES == 2:
        k1 = token_rows(slot_w_ptr, raw_w_ptr, eb, live, sb, rb, asb, arb, b0, b1, b2, b3, b4, b5, b6, b7, bb, brw,
                        SLOT_BYTES, RAW_TILE, RAW_ROW, I, NB, C, ASM, RECON, wb)
        if MATH:
            s += _dot(q1, tl.trans(k1), F32)
        else:
            s += tl.sum(k1.to(tl.float32), axis=1)[None, :]
    rows = tl.arange(0, 2 * NB)
    blk = j0 + rows // 2
    valid = blk < end
    if HAS_MASK:
        pos = blk * 16 + (rows % 2) * 8 + I
        valid = valid & (tl.load(mask_ptr + bq.to(tl.int64) * s_mb + pos, mask=valid, other=0) != 0)
    return tl.where(valid[None, :], s * qk_scale, float("-inf"))


@triton.jit
def _slice_values(acc0, acc1, p, slot_w_ptr, raw_w_ptr, live, ea, sa, ra, asa, ara, a0, a1, a2, a3, a4, a5, a6, a7,
                  ab, arw, eb, sb, rb, asb, arb, b0, b1, b2, b3, b4, b5, b6, b7, bb, brw, SLOT_BYTES, RAW_TILE,
                  RAW_ROW, I: tl.constexpr, NB: tl.constexpr, C: tl.constexpr, TILES: tl.constexpr,
                  F32: tl.constexpr, ASM: tl.constexpr, RECON: tl.constexpr, MATH: tl.constexpr, wa=None,
                  wb=None):
    """acc += p @ V rows of token slice I."""
    v0 = token_rows(slot_w_ptr, raw_w_ptr, ea, live, sa, ra, asa, ara, a0, a1, a2, a3, a4, a5, a6, a7, ab, arw,
                    SLOT_BYTES, RAW_TILE, RAW_ROW, I, NB, C, ASM, RECON, wa)
    if MATH:
        acc0 += _dot(p.to(tl.bfloat16), v0, F32)
    else:
        acc0 += tl.sum(v0.to(tl.float32), axis=0)[None, :]
    if TILES == 2:
        v1 = token_rows(slot_w_ptr, raw_w_ptr, eb, live, sb, rb, asb, arb, b0, b1, b2, b3, b4, b5, b6, b7, bb, brw,
                        SLOT_BYTES, RAW_TILE, RAW_ROW, I, NB, C, ASM, RECON, wb)
        if MATH:
            acc1 += _dot(p.to(tl.bfloat16), v1, F32)
        else:
            acc1 += tl.sum(v1.to(tl.float32), axis=0)[None, :]
    return acc0, acc1


# The lengths are read from the device (`len_ptr`, int32 [B]: finalized blocks = len // 16, tail rows = len % 16), so
# one compiled kernel and one captured CUDA graph serve every step as the context grows: nothing length-dependent is
# a launch argument. Each row spreads its blocks over the SPLITS programs of its (row, kv-head).
# `tail_shift` 1: the tail is the rows after the finalized blocks of a plain [B, H, S_cap, D] buffer (plain KV);
# 0: its own buffer (compressed KV). Not specialized, so both run one binary.
@triton.jit(do_not_specialize=["tail_shift"])
def _split_kernel(q_ptr, slot_ptr, slot_w_ptr, raw_ptr, raw_w_ptr, rawv_ptr, rawv_w_ptr, table_ptr, tailk_ptr,
                  tailv_ptr, b3_ptr, b4_ptr, mask_ptr,
                  m_out, l_out, acc_out, qk_scale, len_ptr, tail_shift,
                  s_qb, s_qh, s_tb, s_tn, s_tkv, s_th, s_ab, s_ah, s_at, s_mb, H_KV, SPLITS,
                  SLOT_BYTES, RAW_TILE, RAW_ROW,
                  NREP: tl.constexpr, NREP_PAD: tl.constexpr, C: tl.constexpr, TILES: tl.constexpr,
                  NB: tl.constexpr, HAS_MASK: tl.constexpr, F32: tl.constexpr, RECON: tl.constexpr,
                  MATH: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr, SLOT_LINES: tl.constexpr,
                  HOIST: tl.constexpr, PLANES: tl.constexpr, TAGS: tl.constexpr, ESC: tl.constexpr):
    D: tl.constexpr = C * TILES
    pid = tl.program_id(0)
    split = tl.program_id(1)
    b = pid // H_KV
    hk = pid % H_KV
    r = tl.arange(0, NREP_PAD)
    c = tl.arange(0, C)
    heads = hk * NREP + r
    q_rows = q_ptr + b.to(tl.int64) * s_qb + heads[:, None] * s_qh + c[None, :]
    q0 = tl.load(q_rows, mask=(r < NREP)[:, None], other=0.0)
    q1 = q0
    if TILES == 2:
        q1 = tl.load(q_rows + C, mask=(r < NREP)[:, None], other=0.0)
    m_i = tl.full([NREP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([NREP_PAD], tl.float32)
    acc0 = tl.zeros([NREP_PAD, C], tl.float32)
    acc1 = tl.zeros([NREP_PAD, C], tl.float32)
    b3k0, b4k0 = _base_words(b3_ptr, b4_ptr, 0, 0, hk, H_KV, C, TILES)
    b3v0, b4v0 = _base_words(b3_ptr, b4_ptr, 1, 0, hk, H_KV, C, TILES)
    b3k1, b4k1, b3v1, b4v1 = b3k0, b4k0, b3v0, b4v0
    if TILES == 2:
        b3k1, b4k1 = _base_words(b3_ptr, b4_ptr, 0, 1, hk, H_KV, C, TILES)
        b3v1, b4v1 = _base_words(b3_ptr, b4_ptr, 1, 1, hk, H_KV, C, TILES)

    nb = tl.arange(0, NB)[:, None]
    rows = tl.arange(0, 2 * NB)  # row 2j + h of a token slice: token 8h + I of block j
    kv_len = tl.load(len_ptr + b)
    n_blocks = kv_len // 16
    tail_len = kv_len % 16
    blocks_per_split = tl.cdiv(tl.cdiv(tl.maximum(n_blocks, 1), SPLITS), NB) * NB
    tbase = b.to(tl.int64) * s_tb + hk * s_th
    start = split * blocks_per_split
    end = tl.minimum(start + blocks_per_split, n_blocks)
    # the next chunk's table entries are loaded one iteration ahead, and its tiles prefetched into L2
    nlive = start + nb < end
    noff = tbase + (start + nb).to(tl.int64) * s_tn
    nek = tl.load(table_ptr + noff, mask=nlive, other=0)
    nev = tl.load(table_ptr + noff + s_tkv, mask=nlive, other=0)
    nek1, nev1 = nek, nev
    if TILES == 2:
        nek1 = tl.load(table_ptr + noff + 1, mask=nlive, other=0)
        nev1 = tl.load(table_ptr + noff + s_tkv + 1, mask=nlive, other=0)
    for j0 in range(start, end, NB):
        live = nlive
        ek, ev, ek1, ev1 = nek, nev, nek1, nev1
        nlive = j0 + NB + nb < end
        noff = tbase + (j0 + NB + nb).to(tl.int64) * s_tn
        nek = tl.load(table_ptr + noff, mask=nlive, other=0)
        nev = tl.load(table_ptr + noff + s_tkv, mask=nlive, other=0)
        if TILES == 2:
            nek1 = tl.load(table_ptr + noff + 1, mask=nlive, other=0)
            nev1 = tl.load(table_ptr + noff + s_tkv + 1, mask=nlive, other=0)
        sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb, krw = _chunk(
            slot_ptr, slot_w_ptr, ek, live, b3k0, b4k0, SLOT_BYTES, NB, C, PLANES, TAGS, ESC)
        sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1 = \
            sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb, krw
        if TILES == 2:
            sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1 = _chunk(
                slot_ptr, slot_w_ptr, ek1, live, b3k1, b4k1, SLOT_BYTES, NB, C, PLANES, TAGS, ESC)
        if PREFETCH:
            prefetch_tiles(slot_ptr, raw_ptr, nek, nlive, SLOT_BYTES, RAW_TILE, RAW_ROW, C, SLOT_LINES)
            prefetch_tiles(slot_ptr, rawv_ptr, nev, nlive, SLOT_BYTES, RAW_TILE, RAW_ROW, C, SLOT_LINES)
            if TILES == 2:
                prefetch_tiles(slot_ptr, raw_ptr, nek1, nlive, SLOT_BYTES, RAW_TILE, RAW_ROW, C, SLOT_LINES)
                prefetch_tiles(slot_ptr, rawv_ptr, nev1, nlive, SLOT_BYTES, RAW_TILE, RAW_ROW, C, SLOT_LINES)
        ka0, ka1, ka2, ka3, ka4, ka5, ka6, ka7 = None, None, None, None, None, None, None, None
        if HOIST:  # every slice's sign+mantissa loads in flight before the first use
            ka0 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 0, NB, C)
            ka1 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 1, NB, C)
            ka2 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 2, NB, C)
            ka3 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 3, NB, C)
            ka4 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 4, NB, C)
            ka5 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 5, NB, C)
            ka6 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 6, NB, C)
            ka7 = slot_row_words(slot_w_ptr, ek, sk, SLOT_BYTES, 7, NB, C)
        # K phase: the scores of the chunk's 8 token slices; then one softmax update; then the V phase. The slices are
        # spelled out (s0..s7, p0..p7) because a Triton kernel cannot index a list of tensors by a loop variable.
        s0 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 0, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka0)
        s1 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 1, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka1)
        s2 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 2, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka2)
        s3 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 3, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka3)
        s4 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 4, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka4)
        s5 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 5, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka5)
        s6 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 6, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka6)
        s7 = _slice_scores(
            q0, q1, slot_w_ptr, raw_w_ptr, live, ek, sk, rk, ask, ark, k0_, k1_, k2_, k3_, k4_, k5_, k6_, k7_, kb,
            krw, ek1, sk1, rk1, ask1, ark1, k10, k11, k12, k13, k14, k15, k16, k17, kb1, krw1, SLOT_BYTES, RAW_TILE,
            RAW_ROW, j0, end, b, s_mb, mask_ptr, qk_scale, 7, NB, C, TILES, HAS_MASK, F32, ASM, RECON, MATH, ka7)
        top = tl.maximum(tl.maximum(tl.maximum(s0, s1), tl.maximum(s2, s3)),
                         tl.maximum(tl.maximum(s4, s5), tl.maximum(s6, s7)))
        m_new = tl.maximum(m_i, tl.max(top, axis=1))
        m_row = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_row)
        m_safe = m_row[:, None]
        p0 = tl.exp2(s0 - m_safe)
        p1 = tl.exp2(s1 - m_safe)
        p2 = tl.exp2(s2 - m_safe)
        p3 = tl.exp2(s3 - m_safe)
        p4 = tl.exp2(s4 - m_safe)
        p5 = tl.exp2(s5 - m_safe)
        p6 = tl.exp2(s6 - m_safe)
        p7 = tl.exp2(s7 - m_safe)
        l_i = l_i * alpha + tl.sum(((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)), axis=1)
        m_i = m_new
        sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_, vb, vrw = _chunk(
            slot_ptr, slot_w_ptr, ev, live, b3v0, b4v0, SLOT_BYTES, NB, C, PLANES, TAGS, ESC)
        sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1 = \
            sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_, vb, vrw
        if TILES == 2:
            sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1 = _chunk(
                slot_ptr, slot_w_ptr, ev1, live, b3v1, b4v1, SLOT_BYTES, NB, C, PLANES, TAGS, ESC)
        va0, va1, va2, va3, va4, va5, va6, va7 = None, None, None, None, None, None, None, None
        if HOIST:
            va0 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 0, NB, C)
            va1 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 1, NB, C)
            va2 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 2, NB, C)
            va3 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 3, NB, C)
            va4 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 4, NB, C)
            va5 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 5, NB, C)
            va6 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 6, NB, C)
            va7 = slot_row_words(slot_w_ptr, ev, sv, SLOT_BYTES, 7, NB, C)
        acc0 = acc0 * alpha[:, None]
        acc1 = acc1 * alpha[:, None]
        acc0, acc1 = _slice_values(
            acc0, acc1, p0, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 0, NB, C, TILES, F32, ASM, RECON, MATH, va0)
        acc0, acc1 = _slice_values(
            acc0, acc1, p1, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 1, NB, C, TILES, F32, ASM, RECON, MATH, va1)
        acc0, acc1 = _slice_values(
            acc0, acc1, p2, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 2, NB, C, TILES, F32, ASM, RECON, MATH, va2)
        acc0, acc1 = _slice_values(
            acc0, acc1, p3, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 3, NB, C, TILES, F32, ASM, RECON, MATH, va3)
        acc0, acc1 = _slice_values(
            acc0, acc1, p4, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 4, NB, C, TILES, F32, ASM, RECON, MATH, va4)
        acc0, acc1 = _slice_values(
            acc0, acc1, p5, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 5, NB, C, TILES, F32, ASM, RECON, MATH, va5)
        acc0, acc1 = _slice_values(
            acc0, acc1, p6, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 6, NB, C, TILES, F32, ASM, RECON, MATH, va6)
        acc0, acc1 = _slice_values(
            acc0, acc1, p7, slot_w_ptr, rawv_w_ptr, live, ev, sv, rv, asv, arv, v0_, v1_, v2_, v3_, v4_, v5_, v6_, v7_,
            vb, vrw, ev1, sv1, rv1, asv1, arv1, v10, v11, v12, v13, v14, v15, v16, v17, vb1, vrw1, SLOT_BYTES,
            RAW_TILE, RAW_ROW, 7, NB, C, TILES, F32, ASM, RECON, MATH, va7)
    if (split == SPLITS - 1) & (tail_len > 0):
        tt = tl.arange(0, 16)
        okt = tt < tail_len
        trow = tt.to(tl.int64) + tail_shift * n_blocks * 16
        toff2 = b.to(tl.int64) * s_ab + hk * s_ah + trow[:, None] * s_at + c[None, :]
        k0 = tl.load(tailk_ptr + toff2, mask=okt[:, None], other=0.0)
        v0 = tl.load(tailv_ptr + toff2, mask=okt[:, None], other=0.0)
        k1, v1 = k0, v0
        if TILES == 2:
            k1 = tl.load(tailk_ptr + toff2 + C, mask=okt[:, None], other=0.0)
            v1 = tl.load(tailv_ptr + toff2 + C, mask=okt[:, None], other=0.0)
        valid = okt
        if HAS_MASK:
            pos = n_blocks * 16 + tt
            valid = valid & (tl.load(mask_ptr + b.to(tl.int64) * s_mb + pos, mask=valid, other=0) != 0)
        m_i, l_i, acc0, acc1 = _attend(q0, q1, m_i, l_i, acc0, acc1, k0, k1, v0, v1, valid, qk_scale, TILES, F32,
                                       MATH)
    out = (b * H_KV * NREP + heads).to(tl.int64) * SPLITS + split
    ok = r < NREP
    tl.store(m_out + out, m_i, mask=ok)
    tl.store(l_out + out, l_i, mask=ok)
    tl.store(acc_out + out[:, None] * D + c[None, :], acc0, mask=ok[:, None])
    if TILES == 2:
        tl.store(acc_out + out[:, None] * D + C + c[None, :], acc1, mask=ok[:, None])


@triton.jit
def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, SPLITS, S_PAD: tl.constexpr, D: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    ok = s < SPLITS
    m = tl.load(m_ptr + pid * SPLITS + s, mask=ok, other=float("-inf"))
    l = tl.load(l_ptr + pid * SPLITS + s, mask=ok, other=0.0)
    big = tl.max(m, axis=0)
    big = tl.where(big == float("-inf"), 0.0, big)
    w = tl.exp2(m - big)
    total = tl.sum(l * w, axis=0)
    acc = tl.load(acc_ptr + (pid * SPLITS + s)[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
    o = tl.sum(acc * w[:, None], axis=0)
    o = tl.where(total > 0, o / total, 0.0)
    tl.store(out_ptr + pid * D + d, o.to(tl.bfloat16))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch_heads: int, n_blocks: int, device: torch.device, blocks_per_iter: int = 8,
               programs_per_sm: int = 4) -> int:
    """Split count for `batch_heads` (row, kv-head) pairs over `n_blocks` blocks: enough programs to fill the GPU,
    no split shorter than one chunk. The plan of a static cache calls it once with its largest `n_blocks`."""
    nb = blocks_per_iter
    if device.type != "cuda":
        return max(1, min(4, triton.cdiv(n_blocks, nb)))
    sms = _sm_count(device)
    want = triton.cdiv(programs_per_sm * sms, max(batch_heads, 1))
    return max(1, min(want, triton.cdiv(n_blocks, nb)))


def _launch(query, slot_pool, raw_pool, rawv_pool, raw_tile, raw_row, table, tail_k, tail_v, base3, base4, scale,
            mask, kv_len, offsets, tail_shift=0, num_splits=None, blocks_per_iter=8, num_warps=4, num_stages=1,
            programs_per_sm=4, stages=("recon", "math"), prefetch=True, hoist=True):
    if query.dtype != torch.bfloat16 or query.dim() != 3 or query.stride(-1) != 1:
        raise ValueError("query must be BF16 [B, H_q, D] with a contiguous last dim")
    b, hq, d = query.shape
    max_blocks, h_kv, tiles = table.shape[1], table.shape[3], table.shape[4]
    channels = d // tiles
    if hq % h_kv:
        raise ValueError(f"{hq} query heads do not group over {h_kv} KV heads")
    if kv_len.dtype != torch.int32 or tuple(kv_len.shape) != (b,):
        raise ValueError(f"kv_len must be int32 [{b}], got {kv_len.dtype} {tuple(kv_len.shape)}")
    table = table.contiguous()
    # strides from the shape, so compressed and plain KV of one shape specialize to the very same kernel
    t_strides = (table.shape[1] * 2 * h_kv * tiles, 2 * h_kv * tiles, h_kv * tiles, tiles)
    if tail_v.stride() != tail_k.stride() or tail_k.stride(-1) != 1:
        tail_k, tail_v = tail_k.contiguous(), tail_v.contiguous()
    nrep = hq // h_kv
    nb = blocks_per_iter
    if nb < 8 or nb & (nb - 1):
        raise ValueError(f"blocks_per_iter must be a power of two >= 8 (a token slice of 2 x {nb} rows is the "
                         f"K dimension of a tensor-core product), got {nb}")
    splits = num_splits or num_splits_for(b * h_kv, max_blocks, query.device, nb, programs_per_sm)
    f32 = dict(dtype=torch.float32, device=query.device)
    m_out = torch.empty(b * hq * splits, **f32)
    l_out = torch.empty(b * hq * splits, **f32)
    acc_out = torch.empty(b * hq * splits, d, **f32)
    if mask is not None:
        if mask.stride(-1) != 1:
            mask = mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=query.device)
    with on_device_of(query):
        _split_kernel[(b * h_kv, splits)](
            query, slot_pool, slot_pool.view(torch.int32), raw_pool, raw_pool.view(torch.int32), rawv_pool,
            rawv_pool.view(torch.int32), table, tail_k, tail_v,
            base3.view(torch.int32), base4.view(torch.int32), mask if mask is not None else query,
            m_out, l_out, acc_out, scale * LOG2E, kv_len, tail_shift,
            query.stride(0), query.stride(1), *t_strides,
            tail_k.stride(0), tail_k.stride(1), tail_k.stride(2), mask.stride(0) if mask is not None else 0,
            h_kv, splits, slot_pool.shape[-1], raw_tile, raw_row,
            NREP=nrep, NREP_PAD=max(16, triton.next_power_of_2(nrep)), C=channels, TILES=tiles, NB=nb,
            HAS_MASK=mask is not None, F32=interpreted(), RECON="recon" in stages, MATH="math" in stages,
            ASM=not interpreted(), PREFETCH=prefetch and not interpreted(),
            SLOT_LINES=triton.next_power_of_2(triton.cdiv(slot_pool.shape[-1], 128)), HOIST=hoist, **offsets,
            num_warps=num_warps, num_stages=num_stages,
        )
        _combine_kernel[(b * hq,)](m_out, l_out, acc_out, out, splits, S_PAD=triton.next_power_of_2(splits), D=d)
    return out


num_splits_for = num_splits


def lengths(batch: int, length: int, device) -> torch.Tensor:
    """`kv_len` for a batch whose rows all hold `length` tokens (the eager callers' case)."""
    return torch.full((batch,), length, dtype=torch.int32, device=device)


def fused_compressed_attention(query: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor,
                               table: torch.Tensor, tail_k: torch.Tensor, tail_v: torch.Tensor, base3: torch.Tensor,
                               base4: torch.Tensor, scale: float, layout, mask: torch.Tensor | None = None,
                               kv_len: torch.Tensor | None = None, **tuning) -> torch.Tensor:
    """Single-token attention over GAAC-compressed KV, the tiles reconstructed in registers (the fused kernel).

    query `[B, H_q, D]` BF16; slot_pool uint8 `[N, slot_bytes]`; raw_pool BF16 `[R, 16, C]`; table int32
    `[B, NB_cap, 2, H_kv, tiles]` (entry >= 0: slot index, else -1 - raw index); tail_k/v BF16
    `[B, H_kv, T_cap <= 16, D]` (any strides, last dim contiguous); base3/base4 uint8 `[2, H_kv, D]`; kv_len int32
    `[B]` on the device: row b has `kv_len[b] // 16` finalized blocks and `kv_len[b] % 16` tail tokens (rows 0..);
    None = all of the table plus all tail rows. mask `[B, S_mask]` bool (True = attend; column j = token j) or None.
    layout: the slots' layout (a `gaac_hf.format.TileLayout`, see `triton_ops.layout`). Returns `[B, H_q, D]` BF16.

    `tuning` (launch configuration, see `_launch`): num_splits, blocks_per_iter, num_warps, num_stages,
    programs_per_sm, and `stages`, which benchmarks use to leave out reconstruction or attention math.
    """
    c = raw_pool.shape[-1]
    if kv_len is None:
        kv_len = lengths(query.shape[0], table.shape[1] * BLOCK + tail_k.shape[2], query.device)
    offsets = slot_constants(layout, c, slot_pool.shape[-1])
    return _launch(query, slot_pool, raw_pool, raw_pool, 16 * c, c, table, tail_k, tail_v, base3.contiguous(),
                   base4.contiguous(), scale, mask, kv_len, offsets, **tuning)


def plain_table(batch: int, heads: int, tokens: int, head_dim: int, device, channels: int) -> torch.Tensor:
    """Table entries that present contiguous plain KV `[B, H, tokens, D]` as the kernel's raw storage class:
    the K entries index the key tensor, the V entries the value tensor, both with raw tile stride C = `channels`
    (the slot layout's tile width) and row stride D. Depends only on the shape: a static cache builds it once."""
    c = channels
    n = tokens // BLOCK
    t = head_dim // c
    bb = torch.arange(batch, device=device).view(batch, 1, 1, 1, 1)
    hh = torch.arange(heads, device=device).view(1, 1, 1, heads, 1)
    blk = torch.arange(n, device=device).view(1, n, 1, 1, 1)
    tile = torch.arange(t, device=device).view(1, 1, 1, 1, t)
    index = (bb * heads + hh) * (tokens * t) + blk * (BLOCK * t) + tile
    return (-1 - index).to(torch.int32).expand(batch, n, 2, heads, t).contiguous()


def plain_as_raw_tiles(key: torch.Tensor, value: torch.Tensor, channels: int):
    """Plain KV `[B, H, S, D]` as the kernel's raw storage class: `(key, value, table, tail_k, tail_v)` (contiguous
    K/V, the table of their complete blocks in tiles of `channels`, the tail rows past them)."""
    key, value = key.contiguous(), value.contiguous()
    b, h, s, d = key.shape
    n = s // BLOCK
    return (key, value, plain_table(b, h, s, d, key.device, channels), key[:, :, n * BLOCK:],
            value[:, :, n * BLOCK:])


@functools.lru_cache(maxsize=None)
def _dummies(device: torch.device, heads: int, head_dim: int):
    """The slot pool and bases the plain path passes (never read), made once per shape: allocating them inside a
    captured step would add two fills per layer. 16 slot bytes: the same specialization as a real slot pool."""
    return (torch.zeros(1, 16, dtype=torch.uint8, device=device),
            torch.zeros(2, heads, head_dim, dtype=torch.uint8, device=device))


def fused_plain_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float, layout,
                          mask: torch.Tensor | None = None, plain=None, kv_len: torch.Tensor | None = None,
                          table: torch.Tensor | None = None, **tuning) -> torch.Tensor:
    """The same kernel over plain BF16 KV `[B, H_kv, S_cap, D]`: bit-identical to `fused_compressed_attention` on
    the compressed form of the same KV (same kv_len, same split count).

    `layout`: a slot layout of the head dim's tiles (no slot is read: its offsets make this the very binary of
    `fused_compressed_attention`). `kv_len` int32 `[B]`: tokens held per row (None: all S_cap). `table`:
    `plain_table(...)` of the shape, if precomputed; `plain`: a precomputed `plain_as_raw_tiles(key, value)` (for
    kv_len None)."""
    d = key.shape[-1]
    c = layout.channels
    offsets = slot_constants(layout, c)
    if kv_len is None:
        key, value, table, tail_k, tail_v = plain if plain is not None else plain_as_raw_tiles(key, value, c)
        kv_len = lengths(query.shape[0], key.shape[2], query.device)
    else:
        if key.stride(-1) != 1 or key.stride(2) != d or key.stride(1) != key.shape[2] * d or \
                value.stride() != key.stride():
            key, value = key.contiguous(), value.contiguous()
        if table is None:
            table = plain_table(*key.shape[:3], d, query.device, c)
        tail_k, tail_v = key, value  # the tail of row b: the rows after its kv_len[b] // 16 blocks (tail_shift)
    dummy_slots, dummy_bases = _dummies(query.device, key.shape[1], d)
    return _launch(query, dummy_slots, key, value, c, d, table, tail_k, tail_v, dummy_bases, dummy_bases, scale,
                   mask, kv_len, offsets, int(tail_k is key), **tuning)
