"""(GAAC kernel profiling) benchmarks/ncu_source_summary.py on a small source-page CSV in ncu's layout."""

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from ncu_source_summary import read, summarize  # noqa: E402


def test_counts_per_opcode_and_unit_and_ranks_stalls(tmp_path):
    cols = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
            "stall_short_sb"]
    lines = [["0x10", "      LOP3.LUT R1, R2, R3, R4, 0xe4, !PT", "5", "400", "0", "5"],
             ["0x20", "@!P0  LOP3.LUT R1, R2, R3, R4, 0xe4, !PT", "1", "200", "0", "1"],
             ["0x30", "@!PT  LDS RZ, [RZ]", "0", "100", "0", "0"],
             ["0x40", "      @!P1 BRA 0x10", "14", "100", "14", "0"]]
    path = tmp_path / "source.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "gaac_decode_split"])
        w.writerow(cols)
        w.writerows(lines)
    s = summarize(read(str(path)), units=100, top=2)
    assert s["warp_instructions"] == 800 and s["per_unit"] == 8.0
    ops = {o["op"]: o for o in s["opcodes"]}
    assert ops["LOP3"]["per_unit"] == 6.0 and ops["LDS"]["per_unit"] == 1.0  # predicates stripped
    assert s["predicated_off_per_unit"] == 1.0
    assert s["hot"][0]["address"] == "0x40" and s["hot"][0]["reasons"] == {"long_sb": 14}
    assert abs(s["hot"][0]["stall_share"] - 0.7) < 1e-9
