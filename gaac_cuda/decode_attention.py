"""Thin launcher of the CUDA fused split-K decode attention (`kernels/decode_attention.cu`), plan/run split.

`plan(...)` decides, once per shape, the kernel variant, the split count and the shared-memory ring (host-side
only: no GPU work, graph-safe to reuse); `decode_attention` / `plain_decode_attention` run it on torch's current
stream. Lengths are read on the device (`kv_len`, int32 `[B]`), so one plan and one captured graph serve every
step as the context grows. The slot layout comes from the caller (`gaac_hf.format.TileLayout`): this package knows
the bitstream only through the offsets it is handed.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import math
import os
import re
from dataclasses import dataclass

import torch

from . import nvrtc

_SOURCE_FILE = os.path.join(os.path.dirname(__file__), "kernels", "decode_attention.cu")
LOG2E = 1.4426950408889634
BLOCK = 16
MAX_GROUP_HEADS = 8  # query heads per kv-head: the n dimension of the mma tile
MIN_UNITS_PER_SPLIT = 4
SPLITS_PER_SM = 12  # warps (= splits) resident per SM at head_dim 64/128 (one CTA of SPLIT_WARPS, or 3 of 4); 256: 4
COMBINE_WARPS = 16  # warps per combine block (the kernel's GAAC_COMBINE_WARPS default; see `plan(combine_warps=)`)
SWIZZLE = False  # plain KV: BF16 rows staged with an XOR swizzle against bank conflicts (see `plan`)
DENSE_SLOTS = False  # compressed KV: slots staged as stored by one bulk copy (see `plan`)
# The twin is the one-warp kernel in SPLIT_WARPS-warp CTAs with its BF16 rows swizzled (TWIN_SWIZZLE), measured
# faster on the H200 than the warp-specialized kernel of sessions 10-16 (a producer warp feeding consumer warps,
# removed in session 28; benchmarks/results/warps_probe_s17.json: 1x64K 73.3 -> 71.3 us, 4x64K 264.4 -> 257.2,
# 9/3/64 1x64K 21.9 -> 20.6; 1x16K 28.4 -> 28.6).
TWIN_SWIZZLE = True
# `_default_nsplit` rounds a row's split count down to a multiple of this where it is at least this (the whole
# 6-consumer CTAs of that warp-specialized twin; every default measured since keeps the rule: the split count sets the
# bits and the timings)
SPLIT_MULTIPLE = 6
# (Splits weighted by their CTA's launch rank, `plan(balance=...)` of sessions 15-27, were no faster once one 12-warp
# CTA per SM removed the ranks: benchmarks/results/balance_probe_s17.json, 1x64K 69.4 against 68.7 us; removed in
# session 28.)
# Programmatic dependent launch (`plan(pdl=True)`): the split and combine kernels are launched with
# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, and the split kernel lets its dependents launch as soon as its
# CTAs start, so the combine's CTAs take SMs as the split kernel's CTAs leave and wait there (griddepcontrol.wait) for
# its partials instead of starting after it; every kernel waits for the one before it before reading memory. The bits
# do not change. On by default since session 17 (H200, benchmarks/results/balance_probe_s17.json: 1.0-1.3 us less per
# call at every probed shape, compressed KV and twin alike); GAAC_HF_CUDA_PDL=0 turns it off for the process.
PDL = os.environ.get("GAAC_HF_CUDA_PDL", "1") != "0"
# The one-warp kernel's splits merged per CTA and (row, kv-head) before they leave the SM (`plan(cta_merge=True)`,
# kernel option GAAC_CTA_MERGE): one partial per CTA and group instead of one per split, so the partial bytes written
# and the combine's loads shrink about GAAC_WARPS-fold, at the price of the merge on the last CTA's critical path.
# The merge order changes the bits: compressed KV and its twin planned alike still match. Measured on the H200 in
# session 22 (benchmarks/results/warps_probe_cta_merge_s22.json, GAAC / twin us without -> with): faster where the
# combine ran in more than one round of loads (9/3/64 1x64K, 528 splits per group: 22.6 -> 21.6 / 20.0 -> 18.2) or
# in more than one wave of blocks (64/8 1x64K, 256 blocks: 66.7 -> 66.4 / 75.2 -> 73.4; 4x64K, 512: 245.2 -> 244.0 /
# 259.3 -> 256.8), slower where it did neither (1x64K 61.1 -> 62.2, 1x128K 112.5 -> 114.0, 1x16K 25.0 -> 25.3). So
# the default (CTA_MERGE = None) merges exactly there, a function of the shape and the SM count alone (compressed KV
# and its twin decide alike); GAAC_HF_CUDA_CTA_MERGE=1 / 0 forces it on / off for the process.
CTA_MERGE = {"1": True, "0": False}.get(os.environ.get("GAAC_HF_CUDA_CTA_MERGE", ""))
COMBINE_UNROLL = 16  # partials per combine warp and round of loads (the kernel's COMBINE_UNROLL)
# The combine inside the split kernel (`plan(fused_combine=True)`, with the CTA merge; kernel option
# GAAC_FUSED_COMBINE): the last CTA of each (row, kv-head) group to finish merges the group's partials into the output,
# so a call is one kernel. CTAs count themselves done on a per-device int32 buffer that the last one resets
# (`_counters`): launches on one device must not overlap (one stream at a time, as for any shared workspace).
# Measured on the H200 in session 23 (benchmarks/results/warps_probe_fused_s23.json, warps_probe_fused2_s23.json;
# GAAC / twin us, merged with the combine kernel -> fused): faster where the combine kernel's blocks (one per row,
# query head and 32 channels) outnumber the SMs — 64/8 1x64K (256 blocks) 66.6 -> 64.7 / 72.7 -> 70.9 and again
# 66.2 -> 64.3 / 73.0 -> 70.9 (default unmerged 66.5), 4x64K (512) 234.6 -> 232.9 / 247.8 -> 245.5 — and slower where
# a group's rows keep few of the last CTA's threads busy while the combine kernel spreads them (9/3/64 1x64K, 18
# blocks: 21.3 -> 23.3 / 18.3 -> 19.5), no faster at 1x64K / 1x128K / 1x16K (128 / 128 / 128 blocks, merged or not).
# So the default (FUSED_COMBINE = None) fuses where the plan merges and those blocks outnumber the SMs (`_fused_pays`;
# compressed KV and its twin decide alike); GAAC_HF_CUDA_FUSED_COMBINE=1 / 0 forces it on / off (where merged).
FUSED_COMBINE = {"1": True, "0": False}.get(os.environ.get("GAAC_HF_CUDA_FUSED_COMBINE", ""))
# The one-warp kernel's shared-memory layout (ring buffer and per-warp bytes) and, for compressed KV, the slot size as
# compile-time constants (`plan(const_layout=True)`, kernel defines GAAC_BUF_BYTES / GAAC_WARP_BYTES /
# GAAC_SLOT_BYTES): the offsets fold into the shared-memory loads and the copies' sizes into immediates (the sm_90a
# build of the 1x64K plan: 2,992 SASS instructions against 3,096, the same registers; the same bits). A plan then
# serves slots of its own size only (the launcher refuses others). Measured on the H200 in session 23
# (benchmarks/results/warps_probe_const_s23.json, GAAC / twin us, read at launch -> compiled in): 1x64K 60.9 -> 60.6 /
# 69.7 -> 69.5, 64/8 1x64K 65.1 -> 63.3 / 72.0 -> 70.5, 4x64K 230.5 -> 226.4 / 250.9 -> 250.9, 1x16K 24.7 -> 24.3 /
# 24.7 -> 24.5, 9/3/64 1x64K 21.6 -> 20.8 / 18.5 -> 18.4, 1x128K 111.9 -> 111.8 / 130.2 -> 129.8; bit-identical. On
# by default wherever the plan knows the slot size (plain KV always); GAAC_HF_CUDA_CONST_LAYOUT=0 turns it off.
CONST_LAYOUT = os.environ.get("GAAC_HF_CUDA_CONST_LAYOUT", "1") != "0"
# Kernel defines for every plan of the process (benchmarks: a prepared kernel option inside the captured step, whose
# caches plan by themselves), e.g. GAAC_HF_CUDA_DEFINES="GAAC_STAGED_O=0,GAAC_HDR=64"; compressed KV and its twin
# alike, so the bits still match. Each must be NAME=VALUE with a GAAC_ name.
PROCESS_DEFINES = tuple(d.strip() for d in os.environ.get("GAAC_HF_CUDA_DEFINES", "").split(",") if d.strip())
# CTA size of the one-warp kernel at one tile per head where `plan` is given none: SPLIT_WARPS warps in one CTA per SM
# (the same splits as 3 CTAs of 4 warps, and the same bits), where shared memory holds such a CTA; else 4 warps, 3 CTAs
# per SM. The warp schedulers favour an SM's older CTAs (session 15: the first of three finishes 26-29% sooner): one
# CTA per SM has no older CTA, and its warps finish together. Measured in session 17 on the H200 (benchmarks/results/balance_probe_s17.json, format 3):
# 1x64K 68.7 -> 63.7 us, 4x64K 258.7 -> 233.8, 1x16K 27.4 -> 27.1, 9/3/64 1x64K 25.3 -> 24.4.
SPLIT_WARPS = 12
STATIC_SMEM = 1024  # the split kernel's static shared memory (cuobjdump -res-usage: SHARED:1024), beside the dynamic
RING_HEADER = 128  # bytes before a warp's ring; it and every tile buffer a multiple of 128, so each bulk copy's
# shared-memory destination is 128-byte aligned (64 bytes off cost a quarter of the copies' rate, session 25)
ESCAPE_SLACK = 16  # buffer bytes past a slot: the prepass reads a lane's escape bytes as a 12-byte window and clamps
# reads to the buffer, so a window that starts near a full escape area must not reach the buffer's end


class _Params(ctypes.Structure):  # mirrors `struct Params` in the kernel source
    _fields_ = ([(n, ctypes.c_void_p) for n in ("q", "slots", "raw", "table", "kv_k", "kv_v", "base3", "base4",
                                                 "kv_len", "mask", "part_o", "part_ml", "out", "trace", "spare")]
                + [(n, ctypes.c_longlong) for n in ("slot_bytes", "table_sb", "kv_sb", "kv_sh", "kv_ss", "mask_sb")]
                + [(n, ctypes.c_int) for n in ("batch", "heads", "rep", "nsplit", "spare1", "buf_bytes", "warp_bytes",
                                               "planes_off", "tags_off", "esc_off")]
                + [("qk_scale", ctypes.c_float), ("counters", ctypes.c_void_p)])


@functools.lru_cache(maxsize=1)
def _source() -> str:
    with open(_SOURCE_FILE) as f:
        return f.read()


_kernels: dict = {}


def available(device: torch.device | str | int | None = None) -> bool:
    """The CUDA kernel can run on `device`: a Hopper GPU (sm_90), NVRTC and the driver found,
    and not switched off with `GAAC_HF_CUDA_KERNEL=0`."""
    if os.environ.get("GAAC_HF_CUDA_KERNEL", "1") == "0" or not torch.cuda.is_available():
        return False
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if dev.type != "cuda":
        return False
    return torch.cuda.get_device_capability(dev)[0] == 9 and nvrtc.available()


@dataclass(frozen=True)
class DecodePlan:
    """Launch decisions for one (batch, kv-heads, group size, head dim, storage) shape."""

    batch: int
    kv_heads: int
    rep: int
    head_dim: int
    plain: bool
    nsplit: int
    warps: int
    stages: int
    buf_bytes: int
    warp_bytes: int
    options: tuple
    combine_warps: int = COMBINE_WARPS
    pdl: bool = False  # programmatic dependent launch (`plan(pdl=True)`)
    cta_merge: bool = False  # `plan(cta_merge=True)`: one partial per CTA and (row, kv-head)
    fused_combine: bool = False  # `plan(fused_combine=True)`: no combine kernel
    slot_bytes: int = 0  # `plan(const_layout=True)`, compressed KV: the slot size compiled in (0: read at launch)

    @property
    def items(self) -> int:
        return self.batch * self.kv_heads * self.nsplit

    @property
    def parts(self) -> int:
        """Partial results the split kernel writes: one per split, or with `cta_merge` at most nsplit // warps + 2
        per (row, kv-head) (the CTAs a group's consecutive splits can span; the kernel's cta_parts_cap)."""
        if self.cta_merge:
            return self.batch * self.kv_heads * (self.nsplit // self.warps + 2)
        return self.items

    @property
    def grid(self) -> int:
        return -(-self.items // self.warps)

    @property
    def smem(self) -> int:
        return self.warps * self.warp_bytes

    def kernels(self, device):
        """(split kernel, combine kernel) of this plan on `device`, compiled once (host cost per call: a dict lookup)."""
        index = torch.device(device).index
        key = (self.options, torch.cuda.current_device() if index is None else index)
        pair = _kernels.get(key)
        if pair is None:
            src = _source()
            pair = (nvrtc.get_kernel(src, list(self.options), "gaac_decode_split", device),
                    nvrtc.get_kernel(src, list(self.options), "gaac_combine", device))
            _kernels[key] = pair
        return pair


def plan(batch: int, kv_heads: int, rep: int, head_dim: int, max_tokens: int, device, *, slot_bytes: int = 0,
         plain: bool = False, nsplit: int | None = None, warps: int | None = None, stages: int | None = None,
         min_ctas: int | None = None, skip: int = 0, trace: bool = False, format_version: int = 1,
         swizzle: bool | None = None, v_words: int | None = None, dense_slots: bool | None = None,
         defines: tuple[str, ...] = (),
         buf_bytes: int | None = None,
         combine_warps: int | None = None, pdl: bool | None = None,
         cta_merge: bool | None = None, fused_combine: bool | None = None,
         const_layout: bool | None = None) -> DecodePlan:
    """Plan the kernel for contexts up to `max_tokens` (the split count assumes that length; shorter contexts
    spread over the same splits). `slot_bytes`: the calibration's slot size (compressed KV). `skip`: benchmark
    variants that leave out the tensor-core math (1) or the reconstruction (2); their output is not attention.
    `trace` (benchmarks): the kernels write globaltimer stamps into a `trace` tensor (see `trace_size`).
    `format_version` 1: slots of format version 1 (docs/format.md); 3: format version 2 as stored, in fragment order
    (what `GAACCache` writes on Hopper; head_dim 64/128, slots staged as stored; the even windows as given: the
    kernel halves them; raw groups' code bits 3..6 from an overlay the prepass scatters in fragment order, added with
    the bases). The plane-order prototype of version 2 (the kernel's format 2) and the other raw-group patches were
    removed in session 14 (slower: benchmarks/results/attention_cuda.md sessions 12-13). `swizzle` (plain KV): stage
    BF16 rows with an XOR swizzle of their 16-byte chunks, so the
    fragment loads are free of shared-memory bank conflicts (the bits do not change). The one-warp kernel over plain
    KV completes K and V of a ring stage on their own barriers and re-issues each with the unit `stages` ahead as soon
    as its tile is read, so K copies are in flight while V is consumed (same bits; measured faster for the twin only:
    1x64K 86.5 -> 77.7 us, compressed KV 94.3 -> 97.9, benchmarks/results/attention_cuda.md, session 7).
    `v_words` (compressed KV): V words rebuilt per vector load in the output tile, head_dim / 32 (default) or 2
    (fewer registers). `dense_slots` (compressed KV): stage each slot as stored, by one bulk copy, instead of its
    sign+mantissa rows padded against bank conflicts by 16-byte copies per lane (fewer copy instructions, 2-way
    conflicts; same bits; prepared in session 8, not yet timed). `warps`: warps (splits) per CTA; default
    SPLIT_WARPS in one CTA per SM at one tile per
    head where shared memory holds it, else 4 (3 CTAs per SM at one tile per head, 1 at head_dim 256). `swizzle`
    default: TWIN_SWIZZLE for plain KV at head_dim <= 128, else off.
    `defines` (benchmarks):
    more `NAME=VALUE` compile-time options of the kernel source, e.g. ("GAAC_STAGED_O=0",); they key the kernel cache
    like every option.
    `buf_bytes` (benchmarks, one-warp kernel, slots staged as stored): a ring stage's tile buffer, at least the slot;
    below a BF16 tile's bytes only for KV without raw tiles (the caller's check: a raw tile would overrun it).
    `combine_warps` (benchmarks): warps per block of the combine kernel (default 16; warp w merges partials w,
    w + combine_warps, ... then the warps merge in order, so the bits depend on it: plan compressed KV and its twin
    alike). At 82 registers two 16-warp blocks do not fit an SM's register file: one block per SM.
    `pdl` (None: `PDL`): programmatic dependent launch of both kernels (see `PDL`; the same bits).
    `cta_merge` (None: `CTA_MERGE`'s rule): the splits of each CTA merged per
    (row, kv-head) in shared memory before they leave (see `CTA_MERGE`; the bits depend on it: plan the twin alike).
    `fused_combine` (None: `FUSED_COMBINE`'s rule where the plan merges per CTA): the last CTA of each group writes
    the output, no combine kernel (see `FUSED_COMBINE`; needs `cta_merge`; the bits depend on it).
    `const_layout` (None: `CONST_LAYOUT` where the slot size is known; the one-warp kernel): the ring layout and the
    slot size compiled in (see `CONST_LAYOUT`; the same bits; compressed KV needs `slot_bytes`)."""
    pdl = PDL if pdl is None else bool(pdl)
    if combine_warps is not None and not 1 <= combine_warps <= 16:
        raise ValueError(f"combine_warps takes 1..16 warps per combine block (more would spill), not {combine_warps}")
    if not 1 <= rep <= MAX_GROUP_HEADS:
        raise ValueError(f"the CUDA decode kernel packs at most {MAX_GROUP_HEADS} query heads per kv-head, got {rep}")
    if swizzle is None:  # the twin's default at one tile per head
        swizzle = SWIZZLE or (TWIN_SWIZZLE and plain and head_dim <= 128)
    if format_version not in (1, 3):
        raise ValueError(f"slot format {format_version}: the kernel reads format 1 (version 1) and 3 (version 2 in "
                         "fragment order)")
    if format_version == 3:
        if plain or head_dim not in (64, 128):
            raise ValueError("format 3 (the fragment-order prototype) is compressed KV at head_dim 64 or 128")
        dense_slots = True
    defines = PROCESS_DEFINES + tuple(defines)  # (the process's first: a plan's own define comes later and wins)
    for d in defines:
        if not re.fullmatch(r"GAAC_[A-Z0-9_]+=[0-9A-Za-z_]+", d):
            raise ValueError(f"kernel define {d!r}: expected NAME=VALUE with a GAAC_ name (GAAC_HF_CUDA_DEFINES or "
                             "`defines`)")
    extra = tuple(f"-D{d}" for d in defines)
    if stages is None:
        stages = 2
    if dense_slots is None:
        dense_slots = DENSE_SLOTS
    dense_slots = bool(dense_slots and not plain)  # a compressed-KV option, like swizzle for plain KV
    if head_dim not in (64, 128, 256):
        raise ValueError(f"the CUDA decode kernel supports head_dim 64, 128 and 256, not {head_dim}")
    channels = min(head_dim, 128)
    tiles = head_dim // channels
    buf = _stage_buffer(channels, slot_bytes, plain, dense_slots)
    if buf_bytes is not None:
        if plain or not dense_slots or buf_bytes < slot_bytes + ESCAPE_SLACK or buf_bytes % 128:
            raise ValueError(f"buf_bytes {buf_bytes}: compressed KV staged as stored, a multiple of 128 bytes that "
                             f"holds a {slot_bytes}-byte slot and {ESCAPE_SLACK} bytes past it")
        buf = buf_bytes
    scratch = 0 if plain else _scratch(channels, format_version)
    # stage barriers and slot bits before the ring: the kernel's HDR (a define may override it, for the probes)
    header = _define_value(extra, "GAAC_HDR", RING_HEADER)
    warp_bytes = -(-(header + stages * 2 * tiles * buf + scratch) // 128) * 128
    if v_words is None:
        v_words = channels // 32
    if v_words not in (channels // 32, 2):
        raise ValueError(f"v_words is {channels // 32} or 2 at head_dim {head_dim}, not {v_words}")
    if warps is None:
        fits = tiles == 1 and SPLIT_WARPS * warp_bytes + STATIC_SMEM <= _smem_optin(device)
        warps = SPLIT_WARPS if fits else 4
    if warps * warp_bytes + STATIC_SMEM > _smem_optin(device):
        raise ValueError(f"{warps} warps of {warp_bytes} bytes of shared memory each do not fit in one CTA "
                         f"({_smem_optin(device)} bytes with the kernel's {STATIC_SMEM} static ones)")
    if min_ctas is None:  # register cap: 12 warps per SM (3 CTAs of 4 warps: what shared memory allows at head_dim 128)
        min_ctas = 1 if tiles == 2 else max(1, 12 // warps)
    options = (f"-DGAAC_C={channels}", f"-DGAAC_TILES={tiles}",
               f"-DGAAC_PLAIN={int(plain)}", f"-DGAAC_STAGES={stages}", f"-DGAAC_WARPS={warps}",
               f"-DGAAC_MIN_CTAS={min_ctas}", f"-DGAAC_FORMAT={format_version}",
               f"-DGAAC_SWIZZLE={int(swizzle and plain)}", f"-DVT_WORDS={v_words}",
               f"-DGAAC_DENSE_SLOT={int(dense_slots)}") + extra
    if trace:
        options += ("-DGAAC_TRACE=1",)
    if skip:  # benchmark-only variants of the leave-one-stage-out breakdown (wrong results by design)
        options += (f"-DGAAC_SKIP={skip}",)
    if nsplit is None:
        nsplit = _default_nsplit(batch, kv_heads, max_tokens, device, tiles)
    options, cw = _combine_option(options, combine_warps)
    merge = _cta_merge(cta_merge, stages * 2 * tiles * buf, head_dim,
                       _merge_pays(batch, kv_heads * rep, head_dim, nsplit, cw, device))
    if fused_combine and not merge:
        raise ValueError("fused_combine merges the CTAs' partials: it needs cta_merge")
    if fused_combine is None:
        fused_combine = (_fused_pays(batch, kv_heads * rep, head_dim, device) if FUSED_COMBINE is None
                         else FUSED_COMBINE)
    fused = bool(merge and fused_combine)
    if (fused and torch.device(device).type == "cuda" and torch.cuda.is_available()
            and not torch.cuda.is_current_stream_capturing()):
        _counters(batch * kv_heads, device)  # made with the plan, so a first launch inside a graph capture finds them
    if merge:
        options += ("-DGAAC_CTA_MERGE=1",) + (("-DGAAC_FUSED_COMBINE=1",) if fused else ())
    if const_layout and not plain and slot_bytes <= 0:
        raise ValueError("const_layout compiles the slot size in: plan compressed KV with its slot_bytes")
    # (the process default applies where the plan knows the slot size)
    const = (CONST_LAYOUT and (plain or slot_bytes > 0)) if const_layout is None else bool(const_layout)
    if const:
        options += (f"-DGAAC_BUF_BYTES={buf}", f"-DGAAC_WARP_BYTES={warp_bytes}")
        options += () if plain else (f"-DGAAC_SLOT_BYTES={slot_bytes}",)
    return _with_pdl(DecodePlan(batch, kv_heads, rep, head_dim, plain, nsplit, warps, stages, buf, warp_bytes,
                                options, combine_warps=cw, cta_merge=merge, fused_combine=fused,
                                slot_bytes=slot_bytes if const and not plain else 0), pdl)


def _merge_pays(batch: int, q_heads: int, head_dim: int, nsplit: int, combine_warps: int, device) -> bool:
    """`CTA_MERGE`'s rule: the unmerged combine would take more than one round of loads per warp, or more blocks (one
    per row, query head and 32 channels) than the GPU has SMs (one 16-warp block fills an SM's registers)."""
    return nsplit > combine_warps * COMBINE_UNROLL or batch * q_heads * (head_dim // 32) > _sm_count(device)


def _fused_pays(batch: int, q_heads: int, head_dim: int, device) -> bool:
    """`FUSED_COMBINE`'s rule (where the plan merges per CTA): the combine kernel would launch more blocks (one per
    row, query head and 32 channels) than the GPU has SMs."""
    return batch * q_heads * (head_dim // 32) > _sm_count(device)


def _cta_merge(asked: bool | None, ring_bytes: int, head_dim: int, pays: bool) -> bool:
    """Whether a plan merges its CTAs' splits: asked, or the process default (`CTA_MERGE`; None: where it pays). The
    kernel stages a warp's output rows and statistics in its drained ring (MAX_GROUP_HEADS x head_dim fp32, 16 floats
    and the fused combine's flags)."""
    if asked is None:
        merge = bool(pays if CTA_MERGE is None else CTA_MERGE)
    else:
        merge = bool(asked)
    if merge and ring_bytes < 4 * (MAX_GROUP_HEADS * head_dim + 32):
        raise ValueError(f"cta_merge stages a warp's partial in its ring: {ring_bytes} bytes are too few")
    return merge


def _smem_optin(device) -> int:
    """Shared memory one CTA may take on `device` (232,448 bytes on Hopper, also assumed for plans made on the CPU)."""
    if torch.device(device).type != "cuda":
        return 232448
    props = torch.cuda.get_device_properties(torch.device(device))
    return int(getattr(props, "shared_memory_per_block_optin", 232448))


def _with_pdl(p: DecodePlan, pdl: bool) -> DecodePlan:
    """`plan(pdl=True)`: the kernels built with their griddepcontrol instructions, launched with the attribute (no
    option at all without it, so default builds keep their cache keys and code)."""
    return dataclasses.replace(p, pdl=True, options=p.options + ("-DGAAC_PDL=1",)) if pdl else p


def _sm_count(device) -> int:
    """SMs of `device`; 132 (an H100 / H200) where it is not a CUDA device (plans made on a CPU machine)."""
    dev = torch.device(device)
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 132


def _combine_option(options: tuple, combine_warps: int | None) -> tuple[tuple, int]:
    """`plan(combine_warps=...)`: the kernel option (none at the default, so default builds keep their cache keys)."""
    if combine_warps is None or combine_warps == COMBINE_WARPS:
        return options, COMBINE_WARPS
    return options + (f"-DGAAC_COMBINE_WARPS={combine_warps}",), combine_warps


_counter_buffers: dict = {}  # device -> the counters of fused-combine launches; every buffer ever made stays alive
# (a captured graph keeps the pointer it was captured with)


def _counters(n: int, device: torch.device) -> torch.Tensor:
    """At least `n` int32 zeros on `device` for `FUSED_COMBINE` launches, made once (and grown, never inside a graph
    capture: `plan` makes them outside one; else launch a plan of the largest batch x kv-heads once before
    capturing). The kernel leaves them zero."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    bufs = _counter_buffers.setdefault(device, [])
    if not bufs or bufs[-1].numel() < n:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"a fused-combine decode plan needs {n} counters on {device} and its first launch is "
                               "inside a CUDA graph capture: launch it once before capturing")
        bufs.append(torch.zeros(max(n, 1024), dtype=torch.int32, device=device))
    return bufs[-1]


def _default_nsplit(batch, kv_heads, max_tokens, device, tiles=1) -> int:
    """Splits per (row, kv-head): a function of the shape alone, never of the variant's occupancy (compressed KV and
    its plain twin must split alike to give the same bits); the splits that fit in one wave of warps (a few more
    would run as a second wave: twice the time)."""
    units = max(1, -(-max_tokens // BLOCK))
    sms = _sm_count(device)
    per_sm = SPLITS_PER_SM if tiles == 1 else SPLITS_PER_SM // 3  # two tiles per stage: one CTA fits
    want = max(1, sms * per_sm // (batch * kv_heads))
    if tiles == 1 and want >= SPLIT_MULTIPLE:
        want -= want % SPLIT_MULTIPLE
    return max(1, min(want, math.ceil(units / MIN_UNITS_PER_SPLIT)))


def _scratch(channels: int, format_version: int) -> int:
    """Per-consumer scratch for one slot: per group its base, planes 3..7 and raw mask (7 bytes); format 3 holds the
    base, plane 3, code bits 3..6 as a 4-bit-per-element overlay and the V tiles' split plane-3 bytes (8 in all;
    their doubled bases overlay base and plane 3): the kernel's SCRATCH_GROUPS."""
    per_group = 7 if format_version != 3 else 8
    return per_group * 2 * channels


def _define_value(extra: tuple[str, ...], name: str, default: int) -> int:
    """The value the kernel sees for define `name` among `-DNAME=VALUE` options (the last one wins, as in nvcc and
    NVRTC), or `default`."""
    return next((int(x.split("=", 1)[1]) for x in reversed(extra) if x.startswith(f"-D{name}=")), default)


def _stage_buffer(channels: int, slot_bytes: int, plain: bool, dense_slots: bool) -> int:
    """Bytes of one tile buffer in a ring stage: a BF16 tile, or a slot (its sign+mantissa rows padded by 16 bytes
    each unless staged as stored) and `ESCAPE_SLACK`, whichever is larger, in whole 128-byte lines (the bulk copies'
    destinations stay 128-byte aligned)."""
    raw_bytes = 2 * BLOCK * channels
    if plain:
        return raw_bytes
    return max(raw_bytes, -(-(slot_bytes + (0 if dense_slots else 16 * 16) + ESCAPE_SLACK) // 128) * 128)


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _rows_ok(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and all(s * 2 % 16 == 0 for s in t.stride()[:-1])


def trace_size(p: DecodePlan) -> int:
    """Length of the int64 `trace` tensor a `plan(..., trace=True)` launch writes: per split 3 globaltimer stamps (ns:
    entry, first unit in shared memory, partial written) and its SM, then one stamp per combine block (entry)."""
    return 4 * p.items + p.batch * p.kv_heads * p.rep * (p.head_dim // 32)


def _run(p: DecodePlan, query, kv_len, mask, scale, fill, combine_too: bool = True,
         trace: torch.Tensor | None = None) -> torch.Tensor:
    b, hq, d = query.shape
    if (b, hq, d) != (p.batch, p.kv_heads * p.rep, p.head_dim):
        raise ValueError(f"query of shape {tuple(query.shape)} does not match the plan "
                         f"(batch {p.batch}, {p.kv_heads}x{p.rep} heads, head_dim {p.head_dim})")
    if query.dtype != torch.bfloat16:
        raise TypeError(f"the CUDA decode kernel takes BF16 queries, not {query.dtype}")
    if kv_len.dtype != torch.int32 or kv_len.shape != (b,) or kv_len.device != query.device:
        raise ValueError("kv_len must be an int32 tensor [batch] on the query's device")
    query = query.contiguous()
    dev = query.device
    part_o = torch.empty(p.parts * p.rep * d, dtype=torch.float32, device=dev)
    part_ml = torch.empty(p.parts * p.rep * 2, dtype=torch.float32, device=dev)
    out = torch.empty(b, hq, d, dtype=torch.bfloat16, device=dev)
    prm = _Params()
    prm.q, prm.kv_len, prm.part_o, prm.part_ml, prm.out = (query.data_ptr(), kv_len.data_ptr(), part_o.data_ptr(),
                                                           part_ml.data_ptr(), out.data_ptr())
    if mask is not None:
        if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != b or mask.stride(-1) != 1:
            raise ValueError("mask must be bool [batch, tokens] with contiguous tokens")
        prm.mask, prm.mask_sb = mask.view(torch.uint8).data_ptr(), mask.stride(0)
    prm.batch, prm.heads, prm.rep, prm.nsplit = b, p.kv_heads, p.rep, p.nsplit
    prm.buf_bytes, prm.warp_bytes = p.buf_bytes, p.warp_bytes
    prm.qk_scale = scale * LOG2E
    if "-DGAAC_TRACE=1" in p.options:
        if trace is None or trace.dtype != torch.int64 or trace.numel() < trace_size(p) or trace.device != dev:
            raise ValueError(f"a traced plan needs an int64 trace tensor of {trace_size(p)} elements on {dev}")
        prm.trace = trace.data_ptr()
    if p.fused_combine:
        prm.counters = _counters(p.batch * p.kv_heads, dev).data_ptr()
    keep = fill(prm)  # tensors the launch reads must outlive it
    split_kernel, combine = p.kernels(dev)
    # the launches go to the kernels' context: switch devices only when another one is current
    with torch.cuda.device(dev) if dev.index != torch.cuda.current_device() else contextlib.nullcontext():
        split_kernel.launch(p.grid, p.warps * 32, p.smem, prm, pdl=p.pdl)
        if combine_too and not p.fused_combine:  # a block per (row, query head, 32 channels)
            combine.launch(b * hq * (d // 32), 32 * p.combine_warps, 0, prm, pdl=p.pdl)
    del keep
    return out


def decode_attention(query: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, table: torch.Tensor,
                     tail_k: torch.Tensor, tail_v: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor,
                     kv_len: torch.Tensor, mask: torch.Tensor | None, scale: float, layout,
                     plan_: DecodePlan | None = None, combine: bool = True,
                     trace: torch.Tensor | None = None) -> torch.Tensor:
    """Single-query attention over GAAC-compressed KV; returns BF16 `[B, H_q, D]`.

    query `[B, H_q, D]` BF16; slot_pool uint8 `[N, slot_bytes]`; raw_pool BF16 `[R, 16, C]`; table int32
    `[B, NB_cap, 2, H_kv, tiles]` (>= 0 slot, -1 - i raw tile i); tail_k/v BF16 `[B, H_kv, T_cap, D]` holding tokens
    `kv_len % 16` of the unfinished block in rows 0..; base3/base4 uint8 `[2, H_kv, D]`; kv_len int32 `[B]` (finalized
    blocks = kv_len // 16, read on the device); mask bool `[B, S]` (True = attend) or None; layout: the tile's slot
    layout (`gaac_hf.format.TileLayout`: `slot_bytes`, `planes_offset`, `tags_offset`, `escape_offset`).
    `combine=False` (benchmarks) runs the split kernel alone; `trace` (benchmarks, with a `plan(..., trace=True)`):
    see `trace_size`.
    """
    b, hq, d = query.shape
    h = tail_k.shape[1]
    channels = min(d, 128)
    if plan_ is None:
        plan_ = plan(b, h, hq // h, d, table.shape[1] * BLOCK + BLOCK, query.device, slot_bytes=layout.slot_bytes)
    if plan_.plain:
        raise ValueError("this plan is for plain KV")
    if plan_.slot_bytes and plan_.slot_bytes != layout.slot_bytes:
        raise ValueError(f"this plan has {plan_.slot_bytes}-byte slots compiled in (const_layout), the pool's are "
                         f"{layout.slot_bytes}")
    if slot_pool.dtype != torch.uint8 or slot_pool.shape[-1] != layout.slot_bytes or not slot_pool.is_contiguous():
        raise ValueError(f"slot_pool must be contiguous uint8 [N, {layout.slot_bytes}]")
    if slot_pool.data_ptr() % 16:  # the bulk copies' global addresses
        raise ValueError("slot_pool must start at a 16-byte aligned address (a view at an offset that is not a "
                         "multiple of 16 bytes: copy it)")
    if raw_pool.dtype != torch.bfloat16 or raw_pool.shape[1:] != (BLOCK, channels) or not raw_pool.is_contiguous():
        raise ValueError(f"raw_pool must be contiguous BF16 [R, 16, {channels}]")
    tiles = d // channels
    if table.dtype != torch.int32 or table.shape[2:] != (2, h, tiles) or table.stride()[1:] != (2 * h * tiles, h * tiles,
                                                                                               tiles, 1):
        raise ValueError(f"table must be int32 [B, n, 2, {h}, {tiles}] with contiguous blocks")
    if tail_k.stride() != tail_v.stride() or not (_rows_ok(tail_k) and _rows_ok(tail_v)):
        tail_k, tail_v = tail_k.contiguous(), tail_v.contiguous()
    base3, base4 = base3.contiguous(), base4.contiguous()
    if slot_pool.shape[0] == 0:  # a pointer the kernel never dereferences
        slot_pool = torch.zeros(1, layout.slot_bytes, dtype=torch.uint8, device=query.device)

    def fill(prm):
        prm.slots, prm.raw, prm.table = slot_pool.data_ptr(), raw_pool.data_ptr(), table.data_ptr()
        prm.kv_k, prm.kv_v, prm.base3, prm.base4 = tail_k.data_ptr(), tail_v.data_ptr(), base3.data_ptr(), base4.data_ptr()
        prm.slot_bytes, prm.table_sb = layout.slot_bytes, table.stride(0)
        prm.kv_sb, prm.kv_sh, prm.kv_ss = tail_k.stride(0), tail_k.stride(1), tail_k.stride(2)
        prm.planes_off, prm.tags_off, prm.esc_off = layout.planes_offset, layout.tags_offset, layout.escape_offset
        return (slot_pool, raw_pool, table, tail_k, tail_v, base3, base4)

    return _run(plan_, query, kv_len, mask, scale, fill, combine, trace)


def plain_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_len: torch.Tensor,
                           mask: torch.Tensor | None, scale: float, plan_: DecodePlan | None = None,
                           trace: torch.Tensor | None = None) -> torch.Tensor:
    """The same kernel over plain BF16 K/V `[B, H_kv, S, D]` (rows `kv_len` long): the bit-exact twin."""
    b, hq, d = query.shape
    h = key.shape[1]
    if plan_ is None:
        plan_ = plan(b, h, hq // h, d, key.shape[2], query.device, plain=True)
    if not plan_.plain:
        raise ValueError("this plan is for compressed KV")
    if key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16:
        raise TypeError(f"plain KV must be BF16, not {key.dtype}/{value.dtype}")
    if key.stride() != value.stride() or not (_rows_ok(key) and _rows_ok(value)):
        key, value = key.contiguous(), value.contiguous()

    def fill(prm):
        prm.kv_k, prm.kv_v = key.data_ptr(), value.data_ptr()
        prm.kv_sb, prm.kv_sh, prm.kv_ss = key.stride(0), key.stride(1), key.stride(2)
        return (key, value)

    return _run(plan_, query, kv_len, mask, scale, fill, trace=trace)
