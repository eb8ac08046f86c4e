"""How often the warp-specialized kernel (`plan(ws=...)`, a benchmark-only path since session 17) gives other bits
than the one-warp kernel on the same splits: session 20 saw `test_warp_specialized_compressed_equals_plain_twin`
fail once in four runs (plain KV, ws 4 / 8 stages, 5 splits, b2h2r4 lengths 1000 / 999 with a padding mask).
This probe runs that shape (on its own random KV, format version 2 as the caches store it, no mask).
Repeats each (kind, ws, stages, pdl) many times and counts launches whose bits differ from the one-warp result.
The cause: the producer's bulk copies into a stage were not fenced (fence.proxy.async) against the consumer's reads of
its previous unit; fixed in session 20 (ws_race_probe_s20_before.json and ws_race_probe_focus_s20.json: before
the fix; ws_race_probe_s20_fixed.json: after, every configuration 200 of 200 equal; both on the test's case, with an
earlier version of this script that borrowed the test's builders). This version, on its own KV:
ws_race_probe_s20_final.json, every configuration 100 of 100 equal.

    python benchmarks/device/ws_race_probe.py --reps 200 --out $OUT/ws_race_probe.json
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.format_v2_probe import compress_v2  # noqa: E402
from gaac_cuda import decode_attention, plain_decode_attention, plan  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--reps", type=int, default=200)
ap.add_argument("--out", default="ws_race_probe.json")
ap.add_argument("--focus", action="store_true", help="only the failing configuration (plain, ws 4 / 8 stages, 5 "
                "splits); session 20 ran it with and without a proxy fence per unit in the producer (108 of 1,000 "
                "launches wrong without, none with: the fence is now unconditional)")
args = ap.parse_args()
# the test's shape (2 rows, 2 kv heads of 4 query heads, head_dim 128, ~1,000 tokens: 62 blocks and a tail), on
# random KV with a few large channels (so some groups are 4-bit or raw)
gen = torch.Generator().manual_seed(0)
b, h, nrep, d, s = 2, 2, 4, 128, 1000
k, v = (torch.randn(b, h, s, d, generator=gen) * torch.exp2(torch.randint(-3, 4, (d,), generator=gen).float())
        for _ in range(2))
k, v = k.to(torch.bfloat16).cuda(), v.to(torch.bfloat16).cuda()
q = torch.randn(b, h * nrep, d, generator=gen).to(torch.bfloat16).cuda()
kv_len = torch.full((b,), s, dtype=torch.int32, device="cuda")
packed, layout, _ = compress_v2(k, v)
scale = d ** -0.5


def bits(x):
    return x.view(torch.int16)


rows = []
configs = [(5, True, 4, 8, True)] if args.focus else [
    (nsplit, plain, ws, stages, pdl) for nsplit in (5, 1) for plain in (True, False)
    for ws, stages in ((4, 8), (6, 12), (2, 2), (3, 9)) for pdl in (True, False)]
wants = {}
for nsplit, plain, ws, stages, pdl in configs:
    if nsplit not in wants:
        one = plan(b, h, nrep, d, s, "cuda", slot_bytes=layout.slot_bytes, nsplit=nsplit, format_version=3, ws=0)
        wants[nsplit] = bits(decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale, layout, one))
    want = wants[nsplit]
    kw = dict(nsplit=nsplit, ws=ws, stages=stages, pdl=pdl)
    if plain:
        p = plan(b, h, nrep, d, s, "cuda", plain=True, **kw)
        run = lambda: plain_decode_attention(q, k, v, kv_len, None, scale, p)  # noqa: E731
    else:
        p = plan(b, h, nrep, d, s, "cuda", slot_bytes=layout.slot_bytes, format_version=3, **kw)
        run = lambda: decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale,  # noqa: E731
                                       layout, p)
    bad, where = 0, set()
    for _ in range(args.reps):
        diff = bits(run()) != want
        if diff.any():
            bad += 1
            where.update(tuple(int(i) for i in ix[:2]) for ix in diff.nonzero()[:64].tolist())
    row = {"nsplit": nsplit, "plain": plain, "ws": ws, "stages": stages, "pdl": pdl, "bad": bad, "reps": args.reps,
           "rows_heads": sorted(where)[:16]}
    rows.append(row)
    print(row, flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(args.out, "w"),
          indent=1)
