"""How the compressed kernel's copies are issued, now that they set its time at 1x64K (issue 12, session 18).

Session 18 measured (`format_v2_probe_s18_breakdown.json`, `slot_order_probe_s18.json`, `ncu_s18_quick_*.txt.gz`):
at 1x64K the 12-warp default takes 62.4 us and its loads-only build 61.3 (reconstruction and math hidden); Nsight
Compute puts its DRAM read rate at 65% of peak (loads only: 70%) against the plain twin's 81% (3.92 TB/s), with the
same splits and ring. Where they differ is how a tile is staged: a slot by one `cp.async.bulk` of ~2.9 KB issued by
one lane, a BF16 row block by 16-byte `cp.async` from every lane. Variants (compile-time options of the kernel, the
same bits): slots by 16-byte `cp.async` per lane (`GAAC_SLOT_CPASYNC`); an L2 evict_first hint on every KV copy
(`GAAC_EVICT_FIRST`); an L2 prefetch of the tile 2 or 6 units past each issued one (`GAAC_L2_AHEAD`, the ring stays 2
deep); each with its loads-only build (`skip=3`: wrong results by design, marked "BITS DIFFER" in the table). Also
the twin with the evict_first hint. JSON and a table:

    python benchmarks/copy_path_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes 1,2,0 --out $OUT/cp.json
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.balance_probe import run_probe  # noqa: E402
from benchmarks.format_v2_probe import probe_args  # noqa: E402

COPY_OPTIONS = {  # label: the kernel's compile-time options
    "gaac": (),
    "gaac_slot_cpasync": ("GAAC_SLOT_CPASYNC=1",),
    "gaac_evict_first": ("GAAC_EVICT_FIRST=1",),
    "gaac_l2_ahead_2": ("GAAC_L2_AHEAD=2",),
    "gaac_l2_ahead_6": ("GAAC_L2_AHEAD=6",),
    "gaac_cpasync_evict_first": ("GAAC_SLOT_CPASYNC=1", "GAAC_EVICT_FIRST=1"),
    "gaac_cpasync_l2_ahead_2": ("GAAC_SLOT_CPASYNC=1", "GAAC_L2_AHEAD=2"),
}
GAAC_VARIANTS = {label + suffix: {"balance": (), "defines": defines, **extra} for label, defines in COPY_OPTIONS.items()
                 for suffix, extra in (("", {}), ("_loads_only", {"skip": 3}))}
TWIN_VARIANTS = {
    "twin": {"balance": ()},
    "twin_evict_first": {"balance": (), "defines": ("GAAC_EVICT_FIRST=1",)},
}


def main():
    args = probe_args(__doc__, "1,2,0", "benchmarks/results/copy_path_probe.json")
    # COPY_SKIP (a regular expression): variants left out, e.g. one that faults (a fault ends the CUDA context, and
    # every later variant of the process with it)
    skip = re.compile(os.environ.get("COPY_SKIP", "^$"))
    keep = lambda d: {k: v for k, v in d.items() if k == "twin" or not skip.search(k)}  # noqa: E731
    run_probe(args, keep(GAAC_VARIANTS), keep(TWIN_VARIANTS), ("gaac", "gaac_loads_only"), "copy_path_probe.py")


if __name__ == "__main__":
    main()
