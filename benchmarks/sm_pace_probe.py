"""Is the last-warp spread of the split kernel a property of the SMs? (issue 12, session 24)

At 1x64K every split streams 21 units, yet the last warp finishes ~4 µs after the median one, and the spread grows
with the units per split (1x16K: ~2 µs), so it is a pace, not a start (`split_phases_s24.json`). If some SMs stream
slower in every launch, splits weighted by the pace of the SM that runs them would end together; if the slow SMs
change from launch to launch, no static weighting can help. This replays the default compressed kernel with
globaltimer stamps `--reps` times and reports, per launch, each SM's streaming pace (µs per unit, median over its
warps, first unit to partial written) and finish, then how well one launch's per-SM pace predicts another's
(Pearson correlation over SMs, mean over launch pairs), the spread of the per-SM pace averaged over launches
(p50 / p90 / max over SMs), and the overlap of the slowest tenth of SMs between launches (chance: ~0.1).

    python benchmarks/sm_pace_probe.py --real-kv .bench/real_kv_2k.safetensors --shapes 1,4 --out $OUT/sm_pace.json
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import gaac_cuda  # noqa: E402
from benchmarks.attention import capture_graph  # noqa: E402
from benchmarks.format_v2_probe import compress_v2, probe_args, probe_shapes, save_probe  # noqa: E402

REPS = 8


def per_sm(tr: torch.Tensor, items: int, units: float) -> dict[int, tuple[float, float]]:
    """{smid: (µs per unit, finish µs after the launch's first entry)}, medians over the SM's live warps."""
    st = tr[: 4 * items].view(items, 4).cpu().double()
    live = (st[:, 1] > -1e17) & (st[:, 2] > -1e17)
    t0 = st[live, 0].min()
    pace = (st[:, 2] - st[:, 1]) / 1e3 / max(units - 1, 1)
    done = (st[:, 2] - t0) / 1e3
    sm = st[:, 3].long()
    out = {}
    for s in sm[live].unique().tolist():
        on = live & (sm == s)
        out[int(s)] = (float(pace[on].median()), float(done[on].median()))
    return out


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()).clamp_min(1e-12))


def main():
    args = probe_args(__doc__, "1,4", "benchmarks/results/sm_pace.json")
    dev = torch.device("cuda")
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "reps": REPS, "rows": []}
    for (hq, hkv, d, b, s), k, v, q, scale, kv_len in probe_shapes(args, dev):
        t_start = time.time()
        packed, layout, info = compress_v2(k, v)
        pt = gaac_cuda.plan(b, hkv, hq // hkv, d, s, dev, slot_bytes=layout.slot_bytes, format_version=3,
                            trace=True)
        tr = torch.full((gaac_cuda.trace_size(pt),), -(2 ** 62), dtype=torch.int64, device=dev)

        g = capture_graph(lambda: gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, scale,
                                                              layout, pt, trace=tr))
        units = -(-s // 16) / pt.nsplit
        launches = []
        for _ in range(REPS):
            g.replay()  # the launch before the stamped one, so each stamped launch follows one as in the probes
            tr.fill_(-(2 ** 62))
            g.replay()
            torch.cuda.synchronize()
            launches.append(per_sm(tr, pt.items, units))
        sms = sorted(set.intersection(*(set(x) for x in launches)))
        pace = torch.tensor([[x[s][0] for s in sms] for x in launches])  # [reps, SMs]
        done = torch.tensor([[x[s][1] for s in sms] for x in launches])
        pairs = list(itertools.combinations(range(REPS), 2))
        tenth = max(1, len(sms) // 10)
        slow = [set(torch.topk(pace[r], tenth).indices.tolist()) for r in range(REPS)]
        mean_pace = pace.mean(0)
        q = lambda x, f: round(float(x.quantile(f)), 3)  # noqa: E731
        row = {"shape": f"{hq}/{hkv}/{d} {b}x{s}", "nsplit": pt.nsplit, "units_per_split": round(units, 2),
               "sms": len(sms),
               "pace_corr_between_launches": round(sum(pearson(pace[i], pace[j]) for i, j in pairs) / len(pairs), 3),
               "done_corr_between_launches": round(sum(pearson(done[i], done[j]) for i, j in pairs) / len(pairs), 3),
               "slowest_tenth_overlap": round(sum(len(slow[i] & slow[j]) for i, j in pairs) / len(pairs) / tenth, 3),
               "mean_pace_us_per_unit": {"p50": q(mean_pace, 0.5), "p90": q(mean_pace, 0.9),
                                         "max": round(float(mean_pace.max()), 3),
                                         "min": round(float(mean_pace.min()), 3)},
               "done_us_per_launch": [{"p50": q(done[r], 0.5), "max": round(float(done[r].max()), 2)}
                                      for r in range(REPS)],
               "mean_pace_by_sm": {int(s): round(float(p), 3) for s, p in zip(sms, mean_pace)}}
        res["rows"].append(row)
        print({kk: vv for kk, vv in row.items() if kk != "mean_pace_by_sm"}, f"({time.time() - t_start:.0f}s)",
              flush=True)
        packed = k = v = None
        torch.cuda.empty_cache()
    save_probe(res, args, "sm_pace_probe.py")


if __name__ == "__main__":
    main()
