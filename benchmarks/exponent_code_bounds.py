"""How far is GAAC's exponent code from the best a per-channel exponent code could do? Bits per element on real KV.

Issue 12's speed targets at 1x128K ask the kernel to stream its bytes at ~97% of cuDNN's rate unless the slots get
smaller (`benchmarks/results/attention_cuda.md`, "Where it stands"). The escape capacity is already where it pays
(`escape_capacity_split.py`); this asks the same of the exponent code itself. The sign and mantissa (8 of every 16
bits) are stored verbatim and stay; only the 8-bit exponent is coded. Windows and models are fitted on the first half
of each (layer, K|V, kv-head, channel) stream and measured on the second half (held out), bits per element:

- `gaac`: the format as it is (docs/format.md: 2 tag bits per group of 8, 3-bit codes, one escape byte per 4-bit
  group, five per raw group; format version 2's even windows), the codec's bits without the slot capacity;
- `gaac_group_windows`: the same code with the windows chosen for whole groups (the 3-bit window holding the most
  groups of 8, then the 4-bit one holding the most of the rest) instead of for values, as the calibration does;
- `gaac_2bit_mode`: the format as it is plus a fourth, 2-bit mode (the tag pattern the format leaves invalid) with
  its own per-channel window of 4 exponents (the one holding the most whole groups);
- `static_entropy`: a per-channel table of exponent frequencies (an ideal entropy coder, Huffman / ANS, one table per
  channel; an exponent the table never saw costs an escape and 8 bits) — a bound of every code that codes each
  exponent on its own with per-channel statistics, whatever its decoding speed;
- `context_entropy`: the same given the previous token's exponent in the channel (counts per (previous, exponent),
  backed off to the channel's table): what a sequential context model could reach.

For the fixed-width codes it also gives the resident bytes per tile with the escape capacity chosen as the caches
choose it (`resident_bytes`), at the model's head_dim and in heads twice as wide (the kernel benchmarks' 128).

    python benchmarks/exponent_code_bounds.py --real-kv .bench/real_kv_2k.safetensors \\
        --out benchmarks/results/exponent_code_bounds.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.capture_real_kv import study_args  # noqa: E402
from gaac_hf.calibrate import exponent_histogram, exponents, windows_from_histogram  # noqa: E402
from gaac_hf.format import ALIGN, BLOCK_TABLE_ENTRY_BYTES, GROUP_SIZE, TileLayout, tile_split  # noqa: E402

VERBATIM_BITS = 8  # sign + 7 mantissa bits, stored as they are
TAG_BITS = 2  # per group
ESCAPE_BITS = {"4bit": 8, "raw": 40}  # escape-area bits per group beyond the 3 code planes
BACKOFF = 2.0  # pseudo-counts of the channel's table in a context's distribution


def _streams(e: torch.Tensor) -> torch.Tensor:
    """Exponents `[L, 2, H, T, D]` -> `[streams, D, T]` (one stream per (layer, K|V, kv-head), a row per channel)."""
    return e.flatten(0, 2).transpose(1, 2)


def group_extent(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Min and max exponent of every group of 8 consecutive tokens of one channel: `[L, 2, H, T, D]` ->
    `[L, 2, H, T // 8, D]` each."""
    g = e[..., : e.shape[-2] // GROUP_SIZE * GROUP_SIZE, :].reshape(*e.shape[:-2], -1, GROUP_SIZE, e.shape[-1])
    return g.amin(-2), g.amax(-2)


def fixed_width_bits(lo: torch.Tensor, hi: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor,
                     base2: torch.Tensor | None = None) -> tuple[float, dict]:
    """Exponent bits per element of groups with extents `lo`, `hi` `[..., groups, D]` under windows `[..., D]`, and
    the share of groups in each mode. `base2`: a 2-bit mode tried before the 3-bit one."""
    counts = torch.bincount(group_modes(lo, hi, base3, base4, base2).reshape(-1), minlength=4).tolist()
    share = {name: counts[i] / lo.numel() for i, name in enumerate(("2bit", "3bit", "4bit", "raw"))}
    per_group = (TAG_BITS + 3 * GROUP_SIZE
                 - share["2bit"] * GROUP_SIZE + share["4bit"] * ESCAPE_BITS["4bit"] + share["raw"] * ESCAPE_BITS["raw"])
    return per_group / GROUP_SIZE, share


def group_window(lo: torch.Tensor, hi: torch.Tensor, width: int, align: int = 1,
                 skip: torch.Tensor | None = None) -> torch.Tensor:
    """Per channel, the base b (a multiple of `align`) of the window `[b, b + width)` that holds the most whole groups
    (lowest on ties), groups where `skip` is True not counted: extents `[..., groups, D]` -> `[..., D]`. A group fits
    the windows whose base lies in `[hi - width + 1, lo]`."""
    first = (hi - width + 1).clamp(min=0)
    ok = first <= lo if skip is None else (first <= lo) & ~skip
    diff = torch.zeros(*lo.shape[:-2], lo.shape[-1], 258, dtype=torch.int64)
    ones = ok.transpose(-1, -2).long()
    diff.scatter_add_(-1, first.transpose(-1, -2).long(), ones)
    diff.scatter_add_(-1, (lo + 1).transpose(-1, -2).long(), -ones)
    fits = diff.cumsum(-1)[..., :256 - width + 1]
    fits = torch.where(torch.arange(fits.shape[-1]) % align == 0, fits, -1)
    return fits.argmax(-1).to(torch.uint8)  # (argmax: the first maximum)


def group_modes(lo: torch.Tensor, hi: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor,
                base2: torch.Tensor | None = None) -> torch.Tensor:
    """Mode of every group (0: 2-bit, 1: 3-bit, 2: 4-bit, 3: raw; the first whose window holds the group):
    extents `[..., groups, D]`, windows `[..., D]` -> `[..., groups, D]`."""
    def inside(base, width):
        b = base.unsqueeze(-2).to(torch.int32)
        return (lo >= b) & (hi < b + width)

    mode = torch.full(lo.shape, 3, dtype=torch.int64)
    for m, base, width in ((2, base4, 16), (1, base3, 8), (0, base2, 4)):
        if base is not None:
            mode = torch.where(inside(base, width), m, mode)
    return mode


def widen(modes: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Group modes `[L, 2, H, groups, D]` regrouped into heads of `head_dim` channels (a multiple of D), channels of
    consecutive (layer, K|V, head) streams side by side, as the kernel benchmarks tile SmolLM2's KV into wider heads:
    `[streams, groups, head_dim]` (streams left over are dropped)."""
    m = modes.flatten(0, -3)  # [S, groups, D]
    k = head_dim // m.shape[-1]
    s = m.shape[0] // k * k
    return m[:s].reshape(s // k, k, *m.shape[1:]).permute(0, 2, 1, 3).reshape(s // k, m.shape[1], head_dim)


def resident_bytes(modes: torch.Tensor, with_2bit: bool) -> dict:
    """Mean resident bytes per tile (slot or raw tile, and its table entry), the escape capacity chosen as the caches
    choose it (the multiple of 16 that minimizes them), for group modes `[..., groups, D]` (groups of 8 tokens).

    As the format is (`with_2bit=False`): a slot holds the verbatim bytes, 3 code planes and the tags (22.5 C bytes)
    and escapes of 1 byte per 4-bit group and 5 per raw group. With the 2-bit mode, a slot holds 2 code planes
    (20.5 C bytes) and the escape area a group's higher planes: 1 byte per 3-bit group, 2 per 4-bit, 6 per raw."""
    d = modes.shape[-1]
    n, c = tile_split(d)
    g = modes.shape[-2] // 2 * 2  # two groups (16 tokens) per block
    per_group = torch.tensor([0, 1, 2, 6] if with_2bit else [0, 0, 1, 5])
    esc = per_group[modes[..., :g, :]]  # [..., groups, D]
    esc = esc.reshape(*esc.shape[:-2], g // 2, 2, n, c).sum((-3, -1))  # [..., blocks, tiles]
    fixed = TileLayout(c, 0).fixed_bytes - (2 * c if with_2bit else 0)  # (2C groups: a plane is 2C / 8 * 8 bytes)
    raw = TileLayout(c, 0).raw_bytes
    esc = esc.reshape(-1).double()
    best = None
    for cap in range(0, int(esc.max()) + ALIGN + 1, ALIGN):
        cost = torch.where(esc <= cap, float(fixed + cap), float(raw)).mean().item() + BLOCK_TABLE_ENTRY_BYTES
        if best is None or cost < best[1]:
            best = (cap, cost)
    return {"capacity": best[0], "bytes_per_tile": best[1], "raw_tile_share": (esc > best[0]).double().mean().item()}


def _table(counts: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Code length in bits of symbols `x` under frequency counts `counts` (same leading shape, 256 symbols; an unseen
    symbol costs an escape, one count's worth, and 8 bits)."""
    total = counts.sum(-1, keepdim=True) + 1
    n = torch.gather(counts, -1, x)
    seen = n > 0
    p = torch.where(seen, n, torch.ones_like(n)) / total
    return -torch.log2(p) + torch.where(seen, 0.0, 8.0)


def static_entropy_bits(chan: torch.Tensor, test: torch.Tensor) -> float:
    """Bits per element on `test` (exponents `[L, 2, H, T, D]`) of the per-channel tables `chan` `[S, D, 256]` (the
    fitted exponents' counts per stream and channel)."""
    return _table(chan.double(), _streams(test).long()).mean().item()


def context_entropy_bits(chan: torch.Tensor, cal: torch.Tensor, test: torch.Tensor) -> float:
    """Bits per element on `test` of a per-channel model of the exponent given the previous token's, fitted on `cal`
    (backed off to the channel's table `chan`, `cal`'s counts `[S, D, 256]`, by `BACKOFF` pseudo-counts; an exponent
    unseen by the table: escape + 8 bits). The first token of `test` is coded by the channel's table."""
    sc, st = _streams(cal).long(), _streams(test).long()
    chan = chan.double()
    pair = torch.zeros(*sc.shape[:2], 256 * 256, dtype=torch.float64)
    pair.scatter_add_(-1, sc[..., :-1] * 256 + sc[..., 1:], torch.ones_like(sc[..., 1:], dtype=torch.float64))
    pair = pair.view(*sc.shape[:2], 256, 256)
    prev, cur = st[..., :-1], st[..., 1:]
    n_pc = torch.gather(pair.flatten(2), -1, prev * 256 + cur)
    n_p = torch.gather(pair.sum(-1), -1, prev)
    total = chan.sum(-1, keepdim=True) + 1
    p_chan = torch.gather(chan, -1, cur) / total
    unseen = p_chan == 0
    p_chan = torch.where(unseen, 1 / total, p_chan)
    p = (n_pc + BACKOFF * p_chan) / (n_p + BACKOFF)
    bits = -torch.log2(p) + torch.where(unseen, 8.0, 0.0)
    first = _table(chan, st[..., :1])
    return (bits.sum() + first.sum()).item() / st.numel()


def study(kv: torch.Tensor, held_out: bool = True) -> dict:
    """Fit on the first half of the tokens of `kv` `[L, 2, H, T, D]` BF16, measure on the second half (`held_out`),
    or fit and measure on all of them (as the kernel benchmarks calibrate on the KV they time)."""
    if held_out:
        t = kv.shape[-2] // 2 // GROUP_SIZE * GROUP_SIZE
        cal_kv, test_kv = kv[..., :t, :], kv[..., t:2 * t, :]
    else:
        t = kv.shape[-2] // GROUP_SIZE * GROUP_SIZE
        cal_kv = test_kv = kv[..., :t, :]
    cal, test = exponents(cal_kv).long(), exponents(test_kv).long()
    hist = exponent_histogram(cal_kv)  # [L, 2, H, D, 256]
    base3, base4 = windows_from_histogram(hist, 2)
    lo_c, hi_c = group_extent(cal)
    # the windows chosen for whole groups instead of values (format version 2's even bases): the 3-bit window holding
    # the most groups, then the 4-bit one holding the most of the others
    g3 = group_window(lo_c, hi_c, 8, 2)
    g4 = group_window(lo_c, hi_c, 16, 2, skip=(lo_c >= g3.unsqueeze(-2)) & (hi_c < g3.unsqueeze(-2).int() + 8))
    base2 = group_window(lo_c, hi_c, 4)
    lo, hi = group_extent(test)

    def fixed_width(b3, b4, b2=None) -> dict:
        bits, share = fixed_width_bits(lo, hi, b3, b4, b2)
        modes = group_modes(lo, hi, b3, b4, b2)
        # at the model's head_dim, and in heads twice as wide (the kernel benchmarks' 128)
        resident = {d: resident_bytes(widen(modes, d), b2 is not None) for d in (kv.shape[-1], 2 * kv.shape[-1])}
        return {"exponent_bits": bits, "modes": share, "resident_by_head_dim": resident}

    rows = {"gaac": fixed_width(base3, base4), "gaac_group_windows": fixed_width(g3, g4),
            "gaac_2bit_mode": fixed_width(base3, base4, base2),
            "static_entropy": {"exponent_bits": static_entropy_bits(hist.flatten(0, 2), test)},
            "context_entropy": {"exponent_bits": context_entropy_bits(hist.flatten(0, 2), cal, test)}}
    ref = rows["gaac"]
    for r in rows.values():
        r["bits_per_element"] = VERBATIM_BITS + r["exponent_bits"]
        r["bytes_vs_gaac"] = r["bits_per_element"] / (VERBATIM_BITS + ref["exponent_bits"])
        for d, x in r.get("resident_by_head_dim", {}).items():
            x["vs_gaac"] = x["bytes_per_tile"] / ref["resident_by_head_dim"][d]["bytes_per_tile"]
    return {"held_out": held_out, "tokens_fitted": t, "tokens_measured": t, "rows": rows}


def main():
    args, kv, res = study_args(__doc__, "benchmarks/results/exponent_code_bounds.json")
    res["studies"] = [study(kv, True), study(kv, False)]
    print(f"{res['source'].get('model', '?')} KV {list(kv.shape)}")
    print("| fitted on → measured on | code | exponent bits / element | bits / element | bytes vs GAAC | "
          "modes (2/3/4-bit/raw %) | resident B/tile (E, raw tiles) at head_dim 64; 128 |")
    print("|---|---|---|---|---|---|---|")
    for st in res["studies"]:
        where = (f"first {st['tokens_fitted']} → next {st['tokens_measured']} tokens" if st["held_out"] else
                 f"all {st['tokens_fitted']} tokens")
        for name, r in st["rows"].items():
            modes = " / ".join(f"{100 * r['modes'][m]:.2f}" for m in ("2bit", "3bit", "4bit", "raw")) \
                if "modes" in r else ""
            by_dim = r.get("resident_by_head_dim", {}).values()
            resident = "; ".join(f"{x['bytes_per_tile']:.1f} ({x['capacity']}, {100 * x['raw_tile_share']:.2f}%, "
                                 f"{100 * (x['vs_gaac'] - 1):+.2f}%)" for x in by_dim)
            print(f"| {where} | {name} | {r['exponent_bits']:.3f} | {r['bits_per_element']:.3f} | "
                  f"{r['bytes_vs_gaac']:.4f} | {modes} | {resident} |")
    res["command"] = " ".join(["python", "benchmarks/exponent_code_bounds.py", *sys.argv[1:]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
