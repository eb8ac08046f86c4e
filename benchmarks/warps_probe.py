"""CTA shapes of the one-warp kernel and programmatic dependent launch, after session 17's first probe.

`benchmarks/balance_probe.py` (session 17, `benchmarks/results/balance_probe_s17.json`) found that one CTA of 12 warps
per SM beats three CTAs of 4 (1x64K 68.7 -> 63.7 us, 4x64K 258.7 -> 233.8: its warps finish together, where the
three CTAs finished by launch rank) and that programmatic dependent launch saves about a microsecond per call; both
became `gaac_cuda.plan`'s defaults. This probe times the new default (12 warps + PDL) against session 16's (4 warps,
no PDL) and each change alone, a deeper ring in fewer warps (8 warps of 3 stages at two thirds of the splits), the
combine block size under the new defaults, and the same CTA shape for the plain twin (session 17 also timed the
warp-specialized twin, removed in session 28). Bits of every compressed variant against the twin
planned alike. JSON and a table:

    python benchmarks/warps_probe.py --real-kv .bench/real_kv_2k.safetensors --out $OUT/warps_probe.json
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.probe_runner import run_probe  # noqa: E402
from benchmarks.format_v2_probe import probe_args  # noqa: E402


def twelfths(n: int) -> int:
    """The largest multiple of 12 splits not above the shape's count (whole 12-consumer CTAs)."""
    return max(12, n - n % 12)


def two_thirds(n: int) -> int:
    """Splits for 8 warps per SM where the default fills 12."""
    return max(1, n * 2 // 3)


def four_thirds(n: int) -> int:
    """Splits for 16 warps per SM where the default fills 12."""
    return max(1, n * 4 // 3)


GAAC_VARIANTS = {  # label: plan options of the compressed kernel (one-warp, format 3; no weighted splits)
    "gaac": {},  # the defaults: 12 warps in one CTA per SM, PDL
    "gaac_s16": {"warps": 4, "pdl": False},  # session 16's defaults
    "gaac_12_warps_no_pdl": {"warps": 12, "pdl": False},
    "gaac_4_warps_pdl": {"warps": 4, "pdl": True},
    "gaac_combine_4": {"combine_warps": 4},
    "gaac_combine_8": {"combine_warps": 8},
    "gaac_8_warps_3_stages": {"warps": 8, "stages": 3, "min_ctas": 1, "nsplit": two_thirds},
}
TWIN_VARIANTS = {  # label: plan options of the plain twin
    "twin": {},  # the default: 12 warps in one CTA per SM, swizzled rows, PDL
    "twin_s16": {"pdl": False},
    "twin_12_warps": {"warps": 12},
    "twin_12_warps_swizzle": {"warps": 12, "swizzle": True},
    "twin_combine_4": {"combine_warps": 4},
    "twin_12_warps_combine_4": {"warps": 12, "combine_warps": 4},
    "twin_12_warps_twelfths": {"warps": 12, "nsplit": twelfths},
}
TRACED = ("gaac", "gaac_8_warps_3_stages")


def halves(n: int) -> int:
    return max(1, n // 2)


# The next set (`--set next`, written in session 17, not yet run): fewer, longer splits where the per-split fixed
# cost (query and bases loaded, partials written and merged) is a large part (1x16K: ~5 units per split; 9/3/64),
# in 6-warp CTAs so the halved splits still fill every SM once; the new defaults beside them.
NEXT_GAAC = {
    "gaac": {},
    "gaac_half_splits_6_warps": {"warps": 6, "min_ctas": 2, "nsplit": halves},
    "gaac_half_splits_12_warps": {"nsplit": halves},  # half the SMs: the bound for comparison
}
NEXT_TWIN = {
    "twin": {},
    "twin_half_splits_6_warps": {"warps": 6, "min_ctas": 2, "nsplit": halves},
}

# Session 19 (`--set stages`): a third ring stage at the default 12 warps. benchmarks/stream_probe.py shows the copy
# pipeline alone streams the 1x64K slots at 4.2 TB/s in 2 stages, but a warp busy ~2,000 cycles per unit leaves only
# one unit in flight while it works; at head_dim 128 three stages of today's tile buffers do not fit in 12 warps, at
# 64 they do.
STAGES_GAAC = {
    "gaac": {},
    "gaac_12_warps_3_stages": {"stages": 3},
}
STAGES_TWIN = {
    "twin": {},
    "twin_12_warps_3_stages": {"warps": 12, "stages": 3},
}

# Session 19's `--set warps16` / `--set slot_ring` (14-16 warps per CTA with ring buffers sized for a slot; raw tiles
# and the tail read from global memory) ran in session 20 and were slower at every shape but 9/3/64
# (benchmarks/results/warps_probe_{warps16,slot_ring}_s20.json); the sets and the kernel option were removed.

# Session 20 (`--set issue`): the copy issue of the common unit (K and V both slots) by lane 0 alone, two bulk copies
# and plain arrivals (the default, GAAC_FAST_ISSUE), against the general path that handles every kind of tile
# (~130 warp instructions per unit with the next unit's table entries, ncu_s20_source.csv.gz). The same bits.
ISSUE_GAAC = {
    "gaac": {},
    "gaac_general_issue": {"defines": ("GAAC_FAST_ISSUE=0",)},
}
ISSUE_TWIN = {"twin": {}}

# Session 21 (`--set prepass`): what the per-slot prepass (tags -> per-group bases and plane-3 bytes in scratch, ~154
# warp instructions per unit) and the tag scan (~36) cost in time, as bounds for a slot format whose lanes own the
# groups their fragments read (groups of 8 channels of one token: no transposition through scratch). Wrong bits by
# design (`skip`); loads + math and loads alone beside them at the instruction-bound shapes.
PREPASS_GAAC = {
    "gaac": {},
    "gaac_no_prepass": {"skip": 16},
    "gaac_no_prepass_no_scan": {"skip": 48},
    "gaac_loads_math": {"skip": 2},
    "gaac_loads_only": {"skip": 3},
}

# Session 21 (`--set staged_o`): the one-warp kernel's partial outputs (rep x D fp32 per split) staged in shared
# memory and written as 16-byte stores (GAAC_STAGED_O, the new default) against session 20's 4-byte stores from the
# fragments, each warp store touching 32 sectors. 64/8 1x64K's loads-only build was 8.7 us slower than 32/8's at the
# same bytes (`warps_probe_prepass_64q_s21.json`): twice the partials. The same bits.
STAGED_O_GAAC = {
    "gaac": {},
    "gaac_direct_o": {"defines": ("GAAC_STAGED_O=0",)},
    "gaac_loads_only": {"skip": 3},
}
STAGED_O_TWIN = {
    "twin": {},
    "twin_direct_o": {"defines": ("GAAC_STAGED_O=0",)},
}

# Session 21 (`--set combine`): at 64/8 the combine's 256 blocks of 16 warps did not all start at once (first to last
# block start 2.8 us apart, `split_phases_s21.json`); fewer warps per block at both rep 4 and rep 8. The bits depend
# on the block size: each variant is checked against the twin planned alike.
COMBINE_GAAC = {
    "gaac": {},
    "gaac_combine_8": {"combine_warps": 8},
    "gaac_combine_4": {"combine_warps": 4},
}
COMBINE_TWIN = {
    "twin": {},
    "twin_combine_8": {"combine_warps": 8},
    "twin_combine_4": {"combine_warps": 4},
}

# Session 21's `--set combine_lean` ran in session 22 (`warps_probe_combine_lean_s22.json`): the combine's loads from
# running pointers became the only combine code; two blocks per SM (a 64-register cap) were slower and went.

# Session 21 (`--set prepass2`, ran in session 22: `warps_probe_prepass2_s22.json`): session 21's no-prepass bounds read uninitialized scratch,
# whose garbage scores took other softmax branches (slower at 1x64K, so they bounded nothing there). GAAC_SKIP bit 6
# runs the prepass on a split's first unit only: later units read its plausible (wrong) bases, and the softmax stays
# on its usual path. With bit 5 the tag scan goes too.
PREPASS2_GAAC = {
    "gaac": {},
    "gaac_prepass_first_unit": {"skip": 64},
    "gaac_prepass_first_unit_no_scan": {"skip": 96},
    "gaac_loads_only": {"skip": 3},
}

# Session 22 (`--set cta_merge`): the one-warp kernel's splits merged per CTA and (row, kv-head) in shared memory
# before they leave (plan(cta_merge=True)): one partial per CTA and group (about nsplit / 12 + 1 per group instead of
# nsplit), so the partial bytes written and the combine's loads shrink about 12-fold; the combine then merges a
# handful of partials per block (also with 4 warps per block). The bits change with the merge order: each variant is
# checked against the twin planned alike. Also the combine's loads from running pointers (now the only combine code,
# `--set combine_lean` of session 21: 0.3-0.7 us less at five shapes, the same bits).
CTA_MERGE_GAAC = {
    "gaac": {},
    "gaac_cta_merge": {"cta_merge": True, "fused_combine": False},
    "gaac_cta_merge_cw4": {"cta_merge": True, "combine_warps": 4, "fused_combine": False},
}
CTA_MERGE_TWIN = {
    "twin": {},
    "twin_cta_merge": {"cta_merge": True, "fused_combine": False},
    "twin_cta_merge_cw4": {"cta_merge": True, "combine_warps": 4, "fused_combine": False},
}

# Session 22 (`--set merge_rule`): the plan's default merges where the unmerged combine takes more than one round of
# loads or more blocks than SMs (`gaac_cuda.decode_attention.CTA_MERGE`); against the same plans without the merge.
MERGE_RULE_GAAC = {
    "gaac": {},
    "gaac_no_merge": {"cta_merge": False},
}
MERGE_RULE_TWIN = {
    "twin": {},
    "twin_no_merge": {"cta_merge": False},
}

# Session 22 (`--set mask`): in the captured step every layer passes a padding mask (all ones at batch 1), and the
# kernel read its bytes in the softmax, a global load per unit on the critical path; now they are loaded with the
# unit's copies. The same bits as without a mask (the old placement, GAAC_MASK_LATE=1, was slower and was removed in
# session 28).
MASK_GAAC = {
    "gaac": {},
    "gaac_mask": {"mask": True},
}
MASK_TWIN = {
    "twin": {},
    "twin_mask": {"mask": True},
}

# Prepared in session 22, run in session 23 (`--set fused`): the combine inside the split kernel
# (plan(fused_combine=True), with the CTA merge): the last CTA of each group merges the group's partials into the
# output, no combine kernel and no kernel boundary before the output. Against the default and the CTA merge alone;
# checked against the twin planned alike.
FUSED_GAAC = {
    "gaac": {},
    "gaac_cta_merge": {"cta_merge": True, "fused_combine": False},
    "gaac_fused": {"cta_merge": True, "fused_combine": True},
}
FUSED_TWIN = {
    "twin": {},
    "twin_cta_merge": {"cta_merge": True, "fused_combine": False},
    "twin_fused": {"cta_merge": True, "fused_combine": True},
}

# Session 23 also ran `--set fused2` (16 / 24 partials per round of the fused combine's loads, and sets of threads
# each over a share of the partials): slower, removed with their kernel options (git history: commit f2e92a0).
# Session 23 (`--set const`): the ring layout and the slot size compiled in (plan(const_layout=True)): the same bits
# (checked against the default twin), fewer instructions for offsets and copy sizes.
CONST_GAAC = {
    "gaac": {},
    "gaac_const": {"const_layout": True},
}
CONST_TWIN = {
    "twin": {},
    "twin_const": {"const_layout": True},
}

# Session 24 (`--set entries`, prepared): the split's table entries held by the lanes in chunks of 32 units and read by
# shuffles (kernel define GAAC_LANE_ENTRIES=1; the same bits), instead of one global load per unit one issue ahead and
# an L1 prefetch 8 units ahead (sm_90a, 1x64K plan: 2,800 SASS instructions against 2,992, 168 registers, no spill).
ENTRIES_GAAC = {
    "gaac": {},
    "gaac_lane_entries": {"defines": ("GAAC_LANE_ENTRIES=1",)},
    "gaac_loads_only": {"skip": 3},
    "gaac_lane_entries_loads_only": {"skip": 3, "defines": ("GAAC_LANE_ENTRIES=1",)},
}
# The loads-only build stripped to its copies (session 24's `frame` set; session 25's `frame2` and frame_probe.py):
# no tile code, one word of each tile read (GAAC_SKIP bit 7), no softmax and rescale (bit 8), the table entries from
# the lanes.
BARE = {"skip": 3 | 128 | 256, "defines": ("GAAC_LANE_ENTRIES=1",)}
# Session 24 (`--set frame`, prepared): the loads-only build stripped towards the bare copy pipeline
# (benchmarks/stream_probe.py, ~2.0 us per unit at 1x64K), each variant traced (per-unit pace, spread, combine): no
# tile code at all, one word per tile read (GAAC_SKIP bit 7), then no softmax and rescale either (bit 8), then the
# table entries from the lanes too. Wrong results by design ("BITS DIFFER"); sm_90a SASS 1,312 / 1,104 / 904
# instructions against the default's 2,992.
FRAME_GAAC = {
    "gaac": {},
    "gaac_loads_only": {"skip": 3},
    "gaac_no_tiles": {"skip": 3 | 128},
    "gaac_no_tiles_no_softmax": {"skip": 3 | 128 | 256},
    "gaac_bare_lane_entries": {**BARE},
}

# Session 24 (`--set w16`, prepared): at head_dim 64 (the SmolLM2 shape 9/3/64, shape 3) a 16-warp CTA per SM fits
# (9.3 KB of ring and scratch per warp) and the sm_90a build holds at the 128-register cap without spills (134 at 12
# warps): four warps per scheduler where the instruction stream sets the time; splits for 16 warps, the twin alike.
W16_GAAC = {
    "gaac": {},
    "gaac_16_warps": {"warps": 16, "nsplit": four_thirds},
}
W16_TWIN = {"twin": {}, "twin_16_warps": {"warps": 16, "nsplit": four_thirds}}


# Session 25 (`--set frame2`): session 24's frame set found the stripped build (no tiles, no softmax, lane entries)
# at 58.4 us against the bare copy pipeline's 45.9 (stream_probe.py), with its median warp done at 45.6 us and its
# last at 58.9. The split kernel alone (no combine launched: "combine": False) of the default and of the stripped
# build, and the latter without programmatic dependent launch, traced; stream_probe.py --trace beside it.
FRAME2_GAAC = {
    "gaac": {},
    "gaac_split_only": {"combine": False},
    "gaac_bare": {**BARE},
    "gaac_bare_split_only": {**BARE, "combine": False},
    "gaac_bare_split_only_no_pdl": {**BARE, "combine": False, "pdl": False},
}

# Session 25 (`--set hdr`): the compressed kernel's ring after a 64-byte header is 64 bytes off a 128-byte line, so
# every bulk copy lands on a misaligned shared-memory destination (the twin's header is 128); the stream probe with
# the same offset (stream_probe.py pool_real_ksmem_hdr64) beside it in frame_probe.py. The same bits.
HDR_GAAC = {  # (run in session 25 before the aligned header became the default, as gaac / gaac_hdr128)
    "gaac": {},
    "gaac_hdr64": {"defines": ("GAAC_HDR=64",)},
}

# Session 25 (`--set lines`, ran once, then removed with its kernel option): each slot's copy from the 128-byte line
# that holds its first byte (GAAC_SRC_LINES), against the copies from the slot's own address (64 bytes off a line for
# every other slot at head_dim 64, 32 / 64 / 96 at escape capacities that are not multiples of 128 bytes): slower at
# five of six shapes (benchmarks/results/warps_probe_lines_s25.json).

# Prepared in session 25 (`--set rering`, not yet run): the ring and CTA shapes that earlier sessions measured while
# every bulk copy landed 64 bytes off a 128-byte line (the copies then ran a quarter slower, so the loads hid the
# instruction stream and deeper rings or more warps could not show): a third ring stage in 8 warps at two thirds of
# the splits (session 17), 12 warps of 3 stages and 16 warps at head_dim 64 (sessions 19 and 24; do not fit at 128:
# their rows say so), the table entries from the lanes (session 24), halved splits in 6-warp CTAs (1x16K). Each
# against the twin planned alike.
RERING_GAAC = {
    "gaac": {},
    "gaac_8_warps_3_stages": {"warps": 8, "stages": 3, "min_ctas": 1, "nsplit": two_thirds},
    "gaac_12_warps_3_stages": {"stages": 3},
    "gaac_16_warps": {"warps": 16, "nsplit": four_thirds},
    "gaac_lane_entries": {"defines": ("GAAC_LANE_ENTRIES=1",)},
    "gaac_half_splits_6_warps": {"warps": 6, "min_ctas": 2, "nsplit": halves},
}

# Session 25's `--set slot_ring` (ring buffers the size of a slot, 3 stages, in 11 warps at head_dim 128 and 12 / 16
# at 64; raw tiles and the tail read from global memory by the tile code) ran in session 26
# (`warps_probe_slot_ring_s26.json`): bit-identical and slower at every head_dim-128 shape (1x64K 63.3 against 58.2
# us; the two-stage kernel at 11 warps 61.9), equal at 9/3/64. Session 26's `--set s26` (`warps_probe_s26.json`):
# the tile code's base adds by IMAD on the FMA pipe, the running max moved only past a threshold of 8 (log2 units),
# both together, and the 2-stage slot ring in 16 warps (128 registers): within +-1% but +1.6% at 4x64K, and the
# 16-warp ring 8-12% slower. The kernel options (GAAC_SLOT_RING, GAAC_IMAD_ADD, GAAC_LAZY_MAX), plan(slot_ring) and
# the sets were removed.

# Session 26 (`--set bounds`): session 22's prepass bounds again on the aligned ring (then a split's first unit's
# prepass alone was *slower* at 1x64K, 63.3 against 61.7 us, under the misaligned copies), beside the loads-only and
# stripped builds and a build without the softmax (wrong bits by design, except the default).
BOUNDS_GAAC = {
    "gaac": {},
    "gaac_prepass_first_unit": {"skip": 64},
    "gaac_prepass_first_unit_no_scan": {"skip": 96},
    "gaac_no_softmax": {"skip": 256},
    "gaac_loads_only": {"skip": 3},
    "gaac_stripped": {"skip": 384},
    # session 32: no tags, scan, prepass, tile code or softmax (bits 1, 7, 8) - the kernel's copies, table entries,
    # ring waits, start and combine alone: what it would take if decoding cost nothing (session 25 timed this build's
    # split kernel alone at 1x64K only, 46.9 us; now every shape, combine included)
    "gaac_zero_decode": {"skip": 2 | 128 | 256},
}


# Session 29 (`--set ov`, run on the H200: warps_probe_ov_s29a/b/c.json): of the options prepared in sessions 26-27,
# the raw groups' overlay per owner lane (GAAC_OV_UNIFORM) was 1-3% faster at 1x64K, 64/8, 4x64K and 1x16K and
# became the default; the scan's predicated adds (GAAC_SCAN_PRED), the table entries by a running pointer
# (GAAC_ENTRY_PTR), the query loaded after the first copies (GAAC_LATE_Q), the scan by ballots (GAAC_SCAN_BALLOT), the
# V prepass beside the K prepass (GAAC_KV_PREPASS) and strided splits (GAAC_STRIDED) were no faster in the geometric
# mean (0.971-0.998 of the default; STRIDED 4% faster at 9/3/64 but 6% slower at 4x64K) and were removed. The set
# (its variants' defines) is in git history (commit 9ac4bdc).


# Session 30 (`--set tail`, run once on the H200, warps_probe_tail_s30.json; kernel option GAAC_TAIL and plan(tail=T)
# removed after it, commit 2a71a29 has them): each split's last T units a chunk with its own partial, claimed by
# whichever warp of the (row, kv-head) group was free. Bit-identical to the twin (20 GPU tests) and slower at every
# shape (1x64K 57.7 -> 61.3-61.7 us, 1x128K 105.1 -> 111.2-112.5, 1x16K 23.6 -> 25.6-26.1; the chunks run by their own
# splits 60.0 / 107.2 / 25.0): the claim loop made each unit 7.5% slower (2.41 -> 2.59 us) while the finish spread it
# targets shrank only from 3.8 to 3.0 us (1x64K) and 6.6 to 5.1 (1x128K).

# Session 30 (`--set l2pf`, run once on the H200, warps_probe_l2pf_s30.json; kernel option GAAC_L2_PF removed after
# it, commit e937023 has it): the units d ahead of the one entering the ring prefetched into L2 by one bulk prefetch
# per slot, so more bytes per warp were in flight from HBM than the two-stage ring holds. Slower at every shape and
# every distance, the loads-only build too (1x64K: 57.6 -> 63.8 / 66.1 / 77.2 / 88.1 us at d = 1 / 2 / 3 / 5; loads
# only 55.1 -> 64.9 at d = 2), as session 19 had found on the misaligned ring.

# Session 30 (`--set evict`, run twice: warps_probe_evict_s30a/b.json): the common unit's slot copies with an L2
# evict-first policy (GAAC_EVICT_FIRST; session 19 measured a hint slower on the misaligned ring): 3% faster at 1x16K
# and 9/3/64, within +-1% elsewhere, and the default since (GAAC_EVICT_FIRST=0 is the build without it; the set's
# "gaac" column was that build when it ran).
EVICT_GAAC = {
    "gaac": {},
    "gaac_no_evict_first": {"defines": ("GAAC_EVICT_FIRST=0",)},
    "gaac_loads_only": {"skip": 3},
    "gaac_loads_only_no_evict_first": {"skip": 3, "defines": ("GAAC_EVICT_FIRST=0",)},
}

SETS = {  # --set: (compressed variants, twin variants, the variants also run with globaltimer stamps)
    "s17": (GAAC_VARIANTS, TWIN_VARIANTS, TRACED),
    "next": (NEXT_GAAC, NEXT_TWIN, ("gaac_half_splits_6_warps",)),
    "stages": (STAGES_GAAC, STAGES_TWIN, ("gaac", "gaac_12_warps_3_stages")),
    "issue": (ISSUE_GAAC, ISSUE_TWIN, ("gaac", "gaac_general_issue")),
    "prepass": (PREPASS_GAAC, ISSUE_TWIN, ()),
    "staged_o": (STAGED_O_GAAC, STAGED_O_TWIN, ()),
    "combine": (COMBINE_GAAC, COMBINE_TWIN, ()),
    "prepass2": (PREPASS2_GAAC, ISSUE_TWIN, ()),
    "cta_merge": (CTA_MERGE_GAAC, CTA_MERGE_TWIN, ("gaac", "gaac_cta_merge")),
    "merge_rule": (MERGE_RULE_GAAC, MERGE_RULE_TWIN, ()),
    "mask": (MASK_GAAC, MASK_TWIN, ()),
    "fused": (FUSED_GAAC, FUSED_TWIN, ("gaac_fused",)),
    "const": (CONST_GAAC, CONST_TWIN, ()),
    "entries": (ENTRIES_GAAC, ISSUE_TWIN, ()),
    "frame": (FRAME_GAAC, ISSUE_TWIN, tuple(FRAME_GAAC)),
    "w16": (W16_GAAC, W16_TWIN, ("gaac", "gaac_16_warps")),
    "rering": (RERING_GAAC, ISSUE_TWIN, ("gaac", "gaac_8_warps_3_stages")),
    "hdr": (HDR_GAAC, ISSUE_TWIN, ("gaac", "gaac_hdr64")),
    "bounds": (BOUNDS_GAAC, ISSUE_TWIN, ("gaac_prepass_first_unit_no_scan", "gaac_stripped", "gaac_zero_decode")),
    "frame2": (FRAME2_GAAC, ISSUE_TWIN, ("gaac_split_only", "gaac_bare_split_only", "gaac_bare_split_only_no_pdl")),
    "evict": (EVICT_GAAC, ISSUE_TWIN, ()),
}


def main():
    args = probe_args(__doc__, "1,0,2,3", "benchmarks/results/warps_probe.json", sets=tuple(SETS))
    run_probe(args, *SETS[args.set], "warps_probe.py")


if __name__ == "__main__":
    main()
