"""(GAAC kernel profiling) benchmarks/ncu_source_summary.py on a small source-page CSV in ncu's layout."""

import csv
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from ncu_source_summary import by_call_site, read, sass_lines, summarize  # noqa: E402


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


LISTING = """
//--------------------- .text.k   --------------------------
.text.k:
	//## File "k.cu", line 3
        /*0000*/                   LOP3.LUT R1, R2, R3, R4, 0xe4, !PT ;
        /*0010*/               @!P0 LOP3.LUT R1, R2, R3, R4, 0xe4, !PT ;
	//## File "k.cu", line 5
        /*0020*/                   NOP ;
        /*0030*/                   LDS RZ, [RZ] ;
	//## File "k.cu", line 7
        /*0040*/                   BRA 0x10 ;
//--------------------- .text.other   --------------------------
.text.other:
        /*0000*/                   EXIT ;
"""


def test_call_sites_align_the_local_listing_to_ncu_rows():
    """ncu's SASS (NVRTC) and a local -lineinfo build differ slightly: the rows are aligned by opcode, counts go to
    the listing's source lines, and what does not align (the NOP here) is left out and reported."""
    lines = sass_lines(LISTING, "k")
    assert lines == [("LOP3", 3), ("LOP3", 3), ("NOP", 5), ("LDS", 5), ("BRA", 7)]
    rows = [{"Source": "      LOP3.LUT R1, R2, R3, R4, 0xe4, !PT", "Instructions Executed": "400"},
            {"Source": "@!P0  LOP3.LUT R1, R2, R3, R4, 0xe4, !PT", "Instructions Executed": "200"},
            {"Source": "@!PT  LDS RZ, [RZ]", "Instructions Executed": "100"},
            {"Source": "      @!P1 BRA 0x10", "Instructions Executed": "100"},
            {"Source": "      IMAD R1, R2, R3, RZ", "Instructions Executed": "200"}]
    src = ["", "", "x = a & b;", "", "y = s[0];", "", "goto top;"]
    got = by_call_site(rows, lines, src, units=100)
    per = {c["line"]: c["per_unit"] for c in got["lines"]}
    assert per == {3: 6.0, 5: 1.0, 7: 1.0}
    assert got["aligned_share"] == round(800 / 1000, 4)
    assert got["lines"][0]["source"] == "x = a & b;"


def test_call_sites_carry_their_stall_samples():
    """Per call site, its share of the stall samples (where the warps spend their time, not what they execute) and
    its main stall reasons; samples of unaligned rows are left out of every site but counted in the total."""
    lines = sass_lines(LISTING, "k")
    row = {"Warp Stall Sampling (All Samples)": "0", "stall_wait": "0", "stall_short_sb": "0"}
    rows = [row | {"Source": "      LOP3.LUT R1, R2, R3, R4, 0xe4, !PT", "Instructions Executed": "400",
                   "Warp Stall Sampling (All Samples)": "10", "stall_wait": "10"},
            row | {"Source": "@!PT  LDS RZ, [RZ]", "Instructions Executed": "100",
                   "Warp Stall Sampling (All Samples)": "30", "stall_short_sb": "25", "stall_wait": "5"},
            row | {"Source": "      IMAD R1, R2, R3, RZ", "Instructions Executed": "100",
                   "Warp Stall Sampling (All Samples)": "10", "stall_wait": "10"}]
    got = by_call_site(rows, lines, [], units=100)
    site = {c["line"]: c for c in got["lines"]}
    assert site[3]["stall_share"] == 0.2 and site[3]["reasons"] == {"wait": 10}
    assert site[5]["stall_share"] == 0.6 and site[5]["reasons"]["short_sb"] == 25
    assert got["aligned_sample_share"] == 0.8
