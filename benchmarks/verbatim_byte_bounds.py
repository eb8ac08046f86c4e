"""Could the verbatim byte shrink? Bits a per-channel code would need for the sign and mantissa of real KV.

GAAC keeps 8 of every BF16 value's 16 bits as they are (`s<<7 | m`, docs/format.md) and codes only the exponent;
`exponent_code_bounds.py` showed the exponent code within 7.6% of an ideal per-channel entropy coder. Issue 12's
speed targets ask for fewer bytes per token or a faster copy pipeline, so this measures the other half: per (layer,
K|V, kv-head, channel) stream, fitted on the first half of the tokens and measured on the second (held out), bits
per element of

- `sign_static`: the sign from a per-channel frequency (an ideal entropy coder of the sign alone);
- `sign_previous_token`: the sign given the previous token's sign in the channel (per-channel table of the pair);
- `mantissa_bit_b` (b = 6 the top mantissa bit, 5, 4): each mantissa bit from a per-channel frequency;

and the share of groups of 8 (the format's groups: 8 tokens of one channel) whose 8 signs are equal, with the bits
per element that a group mode storing one sign for such a group would save at most (7 sign bits per group, nothing
for tags, alignment or a kernel's cost).

    python benchmarks/verbatim_byte_bounds.py --real-kv .bench/real_kv_2k.safetensors \\
        --out benchmarks/results/verbatim_byte_bounds.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.capture_real_kv import study_args  # noqa: E402
from gaac_hf.format import GROUP_SIZE  # noqa: E402

EPS = 1e-4  # floor of a fitted probability (a value the fit never saw still costs bits, not infinity)


def cross_entropy(p1: torch.Tensor, x: torch.Tensor) -> float:
    """Mean bits of coding the 0/1 values `x` with probability `p1` of a 1 (broadcast)."""
    p1 = p1.clamp(EPS, 1 - EPS)
    return float(-(x * torch.log2(p1) + (1 - x) * torch.log2(1 - p1)).mean())


def bit_planes(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 `[..., T, D]` -> (sign, mantissa) as float tensors of 0/1 sign and 0..127 mantissa."""
    bits = kv.contiguous().view(torch.int16).int() & 0xFFFF
    return ((bits >> 15) & 1).float(), (bits & 0x7F)


def study(kv: torch.Tensor) -> dict:
    """`kv` `[L, 2, H, T, D]` BF16: per K|V, held-out bits per element of each model, and the one-sign groups."""
    t = kv.shape[-2] // 2 // GROUP_SIZE * GROUP_SIZE
    out = {"tokens_fitted": t, "tokens_measured": t}
    for i, name in enumerate(("K", "V")):
        sign, man = bit_planes(kv[:, i])  # [L, H, T, D]
        cal_s, test_s = sign[..., :t, :], sign[..., t:2 * t, :]
        row = {"sign_static": cross_entropy(cal_s.mean(-2, keepdim=True), test_s)}
        # sign given the previous token's sign: per-channel P(1 | previous 0) and P(1 | previous 1)
        prev_c, cur_c = cal_s[..., :-1, :], cal_s[..., 1:, :]
        p_given = [((cur_c * (prev_c == v)).sum(-2, keepdim=True) + 0.5)
                   / ((prev_c == v).sum(-2, keepdim=True) + 1.0) for v in (0, 1)]
        prev_t, cur_t = test_s[..., :-1, :], test_s[..., 1:, :]
        row["sign_previous_token"] = cross_entropy(torch.where(prev_t == 1, p_given[1], p_given[0]), cur_t)
        for b in (6, 5, 4):
            mb = ((man >> b) & 1).float()
            row[f"mantissa_bit_{b}"] = cross_entropy(mb[..., :t, :].mean(-2, keepdim=True), mb[..., t:2 * t, :])
        groups = test_s.reshape(*test_s.shape[:-2], -1, GROUP_SIZE, test_s.shape[-1]).sum(-2)
        one_sign = float(((groups == 0) | (groups == GROUP_SIZE)).float().mean())
        row["one_sign_group_share"] = one_sign
        row["one_sign_mode_saves_bits_per_element"] = one_sign * (GROUP_SIZE - 1) / GROUP_SIZE
        out[name] = row
    # over K and V together, against GAAC's ~11.4 bits per element (exponent_code_bounds.json)
    out["one_sign_mode_saves_bits_per_element_kv"] = (out["K"]["one_sign_mode_saves_bits_per_element"]
                                                      + out["V"]["one_sign_mode_saves_bits_per_element"]) / 2
    return out


def main():
    args, kv, res = study_args(__doc__, "benchmarks/results/verbatim_byte_bounds.json")
    res.update(study(kv))
    print(f"{res['source'].get('model', '?')} KV {list(kv.shape)}, fitted on {res['tokens_fitted']} tokens, measured on the "
          f"next {res['tokens_measured']} (bits per element; verbatim: 1 sign + 7 mantissa bits)")
    cols = ("sign_static", "sign_previous_token", "mantissa_bit_6", "mantissa_bit_5", "mantissa_bit_4",
            "one_sign_group_share", "one_sign_mode_saves_bits_per_element")
    print("| | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for name in ("K", "V"):
        print(f"| {name} | " + " | ".join(f"{res[name][c]:.4f}" for c in cols) + " |")
    print(f"one-sign group mode, K and V together: at most {res['one_sign_mode_saves_bits_per_element_kv']:.3f} "
          "bits per element")
    res["command"] = " ".join(["python", "benchmarks/verbatim_byte_bounds.py", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
