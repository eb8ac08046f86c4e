"""DGAP on held-out decoding traces of SmolLM2-135M-Instruct: the shipped artifact, the tau sweep, the
linear / MLP / transformer ablation and an oracle ceiling.

Inputs are the trace folders `dgap-hf collect` writes (`benchmarks/device/dgap_traces_h200.sh` made them on an H200:
train = Debian Policy, GNU Coding Standards, GNU maintainers' guide, Developer's Reference; val = Debian FAQ, FHS;
eval = Debian Reference, held out). Every number is exact for teacher-forced decoding with the processor in the loop
(`dgap_hf.evaluation`). The oracle replaces the low-bit logits of the top-K_b window by the FP logits of the same
tokens: the best any logits-only corrector of that window can do.

    python benchmarks/dgap_eval.py --traces .cache/dgap/traces --artifact hub_configs/dgap-SmolLM2-135M-Instruct \
        --out benchmarks/results/dgap_eval.json
"""

import argparse
import json
import time
from pathlib import Path

import torch

from dgap_hf.cli import load_trace_folder
from dgap_hf.evaluation import applied_at, evaluate_artifact, gap_closed, predict_rows, quality
from dgap_hf.models import DGAPModel
from dgap_hf.train import TrainConfig, train_dgap

METRICS = ("ppl", "top1_agreement", "kl", "drift")


def oracle(tr, k):
    """Window logits replaced by the FP logits (shifted so the window keeps its low-bit mass): the ceiling."""
    zf, zl = tr.lb_z_fp[:, :k], tr.lb_z[:, :k]
    shift = torch.logsumexp(zl, -1, keepdim=True) - torch.logsumexp(zf, -1, keepdim=True)
    return quality(tr, k, zf + shift - zl)


def fmt(q):
    return {m: q[m] for m in METRICS if m in q} | {m: q[m] for m in ("correction_rate", "fp_top1_outside_window")
                                                   if m in q}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default=".cache/dgap/traces")
    ap.add_argument("--artifact", default="hub_configs/dgap-SmolLM2-135M-Instruct")
    ap.add_argument("--ablation", default="linear,mlp,transformer")
    ap.add_argument("--ablation-precisions", default="K1V1,K2V2")
    ap.add_argument("--transformer-epochs", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/dgap_eval.json")
    ap.add_argument("--plot", default="benchmarks/results/dgap_tau_sweep.png")
    ap.add_argument("--replot", action="store_true", help="only redraw the plot from --out")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.out).read_text())["shipped"], args.plot)
        return
    torch.manual_seed(0)
    root = Path(args.traces)
    train, val, held = (load_trace_folder(root / s)[0] for s in ("train", "val", "eval"))
    model = DGAPModel.from_pretrained(args.artifact)
    taus = [round(0.05 * i, 2) for i in range(20)] + [0.99]
    t0 = time.time()
    shipped = evaluate_artifact(model, held, taus)
    for p, r in shipped.items():
        r["oracle"] = fmt(oracle(held[p], r["k_b"]))
        r["oracle_ppl_gap_closed"] = gap_closed(r["bf16"]["ppl"], r["lowbit"]["ppl"], r["oracle"]["ppl"])
    ablation = {}
    label = {k: model.label_params[k] for k in ("alpha", "rho_k", "rho_c", "eps")}
    for arch in args.ablation.split(","):
        extra = {"epochs": args.transformer_epochs} if arch == "transformer" else {}
        cfg = TrainConfig(detector_arch="mlp", corrector_arch=arch, **label, **extra)
        precisions = args.ablation_precisions.split(",")
        t = time.time()
        m = train_dgap({p: train[p] for p in precisions}, cfg, val_traces={p: val[p] for p in precisions})
        secs = time.time() - t
        for p in precisions:
            risk, delta, k = predict_rows(m, p, held[p])
            q = quality(held[p], k, applied_at(risk, delta, m.precisions[p]["tau"]))
            ablation.setdefault(p, {})[arch] = {"k_b": k, "tau": m.precisions[p]["tau"],
                                                "correction_rate": float((risk > m.precisions[p]["tau"]).float()
                                                                         .mean()),
                                                "train_seconds": secs, **fmt(q),
                                                "validation": m.results[p]["validation"]}
            # the corrector alone, forced on every row (tau = 0): does it restore anything?
            ablation[p][arch]["forced_on_all_rows"] = fmt(quality(held[p], k, delta))
    rows = {p: len(tr) for p, tr in held.items()}
    out = {"artifact": args.artifact, "traces": str(root), "held_out_rows": rows,
           "label_params": model.label_params, "shipped": shipped, "ablation": ablation,
           "seconds": time.time() - t0, "torch": torch.__version__}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    lines = ["| cache | K_b | tau | PPL | top-1 vs BF16 | KL(BF16 ‖ ·) | local drift | corrected | FP top-1 outside window |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p, r in shipped.items():
        lines.append(f"| BF16 | | | {r['bf16']['ppl']:.3f} | 100% | 0 | 0 | | |")
        for name, q in ((p, r["lowbit"]), (p + " + DGAP", r["dgap"]), (p + " + oracle window", r["oracle"])):
            lines.append(f"| {name} | {r['k_b']} | {r['tau']:.2f} | {q['ppl']:.3f} | {100 * q['top1_agreement']:.2f}% | "
                         f"{q['kl']:.4f} | {q['drift']:.4f} | {100 * q.get('correction_rate', 0):.1f}% | "
                         f"{100 * q['fp_top1_outside_window']:.2f}% |")
    lines += ["", "Ablation (corrector architecture; PPL / drift with the calibrated tau, and forced on every row):", "",
              "| precision | corrector | tau | corrected | PPL | drift | PPL forced | drift forced |", "|---|---|---|---|---|---|---|---|"]
    for p, archs in ablation.items():
        for arch, a in archs.items():
            f = a["forced_on_all_rows"]
            lines.append(f"| {p} | {arch} | {a['tau']:.2f} | {100 * a['correction_rate']:.1f}% | {a['ppl']:.3f} | "
                         f"{a['drift']:.4f} | {f['ppl']:.3f} | {f['drift']:.4f} |")
    table = "\n".join(lines)
    print(table)
    Path(args.out).with_suffix(".md").write_text(table + "\n")
    if args.plot:
        plot(shipped, args.plot)


def plot(shipped: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for p, r in shipped.items():
        sw = r["tau_sweep"]
        axes[0].plot([s["tau"] for s in sw], [s["drift"] / r["lowbit"]["drift"] for s in sw], label=p)
        axes[1].plot([s["tau"] for s in sw], [s["correction_rate"] for s in sw], label=p)
    axes[0].set(xlabel="tau", ylabel="local drift / drift without DGAP (log)", title="restoration vs tau",
                yscale="log")
    axes[0].axhline(1.0, color="grey", lw=0.5)
    axes[1].set(xlabel="tau", ylabel="correction rate", title="correction frequency vs tau")
    for a in axes:
        a.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
