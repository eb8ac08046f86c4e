"""Where the compressed kernel's time goes within a split (issue 12, session 19): globaltimer stamps per split
(entry, first unit in shared memory, partial written) and per combine block, for the default kernel and its
loads-only build (`skip=3`: no reconstruction, no tensor-core math; wrong results by design, "BITS DIFFER"), beside
the twin and cuDNN. Per variant, `finish.phases`: the first unit's latency, the streaming part (done - first unit)
and its time per unit, and when the combine kernel starts; times are µs after the first split's entry.

Session 19 at 1x64K (`split_phases_s19.json`): first unit ready 4.35 µs (p50; max 6.9), streaming 50.9 µs (2.59 µs
per unit; loads only 2.33), done 55.3 (p50) / 58.9 (max), combine from 59.65, next call's entry at 62.2; the copy
pipeline alone moves the same slots in 46.2 µs (`stream_probe_s19.json`).

(The copy options this script measured first in session 19, `copy_path_probe_s19.json`: slots by 16-byte cp.async
per lane 70.4 µs, L2 prefetch of the unit 2 / 6 ahead 69.8 / 93.5 µs, against 62.2 by one bulk copy per slot; an L2
evict_first hint faulted on the H200 (illegal instruction). They were removed from the kernel; git history has them.)

    python benchmarks/split_phases_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes 1,0 --out $OUT/ph.json
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.probe_runner import run_probe  # noqa: E402
from benchmarks.format_v2_probe import probe_args  # noqa: E402

GAAC_VARIANTS = {"gaac": {}, "gaac_loads_only": {"skip": 3}}
TWIN_VARIANTS = {"twin": {}}


def main():
    args = probe_args(__doc__, "1,0", "benchmarks/results/split_phases.json")
    run_probe(args, GAAC_VARIANTS, TWIN_VARIANTS, tuple(GAAC_VARIANTS), "split_phases_probe.py")


if __name__ == "__main__":
    main()
