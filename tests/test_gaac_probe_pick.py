"""(GAAC kernel benchmarks) benchmarks/probe_pick.py: which probed kernel options to keep."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from probe_pick import main, pick, variant_table  # noqa: E402

ROWS = [
    {"shape": "a", "cudnn_us": 66.0, "twin": {"us": 68.0, "same_bits_as_default_twin": True},
     "gaac": {"us": 58.0, "bit_identical_to_twin": True},
     "gaac_fast": {"us": 55.0, "bit_identical_to_twin": True},
     "gaac_wrong": {"us": 50.0, "bit_identical_to_twin": False},
     "gaac_mixed": {"us": 54.0, "bit_identical_to_twin": True},
     "gaac_both": {"us": 53.0, "bit_identical_to_twin": True}},
    {"shape": "b", "cudnn_us": 23.0,
     "gaac": {"us": 24.0, "bit_identical_to_twin": True},
     "gaac_fast": {"us": 23.5, "bit_identical_to_twin": True},
     "gaac_wrong": {"us": 20.0, "bit_identical_to_twin": True},
     "gaac_mixed": {"us": 25.0, "bit_identical_to_twin": True},  # 4% slower here: out, despite its mean
     "gaac_both": {"us": 22.0, "bit_identical_to_twin": True}},
]
DEFINES = {"gaac": (), "gaac_fast": ("GAAC_FAST=1",), "gaac_wrong": ("GAAC_WRONG=1",), "gaac_mixed": ("GAAC_MIXED=1",),
           "gaac_both": ("GAAC_FAST=1", "GAAC_MIXED=1")}


def test_speedups_bits_and_the_pick():
    t = variant_table(ROWS)
    assert "twin" not in t and abs(t["gaac_fast"]["speedup"]["a"] - 58 / 55) < 1e-12
    assert abs(t["gaac"]["vs_cudnn"]["b"] - 23 / 24) < 1e-12
    assert t["gaac_wrong"]["bits"] is False and t["gaac_fast"]["bits"] is True
    assert abs(t["gaac_mixed"]["worst"] - 24 / 25) < 1e-12
    # single options only; bits intact; faster in the mean; no shape more than 2% slower
    assert pick(t, DEFINES) == ["GAAC_FAST=1"]
    assert pick(t, DEFINES, worst=0.9) == ["GAAC_FAST=1", "GAAC_MIXED=1"]


def test_cli_prints_the_defines_line(tmp_path, capsys, monkeypatch):
    import warps_probe

    monkeypatch.setitem(warps_probe.SETS, "toy", ({k: {"defines": v} for k, v in DEFINES.items()}, {}, ()))
    path = tmp_path / "probe.json"
    path.write_text(json.dumps({"rows": ROWS}))
    main([str(path), "--set", "toy"])
    out = capsys.readouterr().out
    assert "DEFINES=GAAC_FAST=1" in out and "DIFFER" in out
