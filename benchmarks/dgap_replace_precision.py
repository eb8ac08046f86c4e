"""Replace some precisions of a DGAP artifact by those of another artifact trained on new traces.

Issue 14, session 11: the K2V2 default quantizer changed, so K2V2 was re-collected and retrained alone (the other
precisions' quantizers did not change); this splices the retrained K2V2 detector, corrector, K_b, tau, quantizer spec
and results into the shipped artifact. Both artifacts must share the feature spec and label parameters; the training
record keeps the base's and adds the retrained precisions' under `training["retrained"]`.

    python benchmarks/dgap_replace_precision.py --base hub_configs/dgap-SmolLM2-135M-Instruct --source /tmp/dgap-s11 \\
        --precisions K2V2 --out /tmp/dgap-merged
"""

import argparse
import copy

from dgap_hf import DGAPModel


def replace_precisions(base: DGAPModel, source: DGAPModel, precisions: list[str]) -> DGAPModel:
    for name in ("feature_spec", "label_params"):
        if getattr(base, name) != getattr(source, name):
            raise SystemExit(f"the artifacts differ in {name}: {getattr(base, name)} vs {getattr(source, name)}")
    missing = [p for p in precisions if p not in source.precisions]
    if missing:
        raise SystemExit(f"the source artifact has no {missing} (it has {sorted(source.precisions)})")
    cfg = copy.deepcopy(base.config_dict())
    for p in precisions:
        cfg["precisions"][p] = source.precisions[p]
        cfg["quantizer"][p] = source.quantizer[p]
        cfg["results"][p] = source.results[p]
    cfg["training"] = {**base.training_info, "retrained": {**base.training_info.get("retrained", {}),
                                                          **{p: source.training_info for p in precisions}}}
    merged = DGAPModel(**cfg)
    for p in merged.precisions:
        src = source if p in precisions else base
        merged.detectors[p].load_state_dict(src.detectors[p].state_dict())
        merged.correctors[p].load_state_dict(src.correctors[p].state_dict())
    return merged.eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--source", required=True)
    ap.add_argument("--precisions", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    merged = replace_precisions(DGAPModel.from_pretrained(args.base), DGAPModel.from_pretrained(args.source),
                                args.precisions)
    merged.save_pretrained(args.out)
    print(f"{args.out}: {sorted(merged.precisions)}; replaced {args.precisions} from {args.source}")


if __name__ == "__main__":
    main()
