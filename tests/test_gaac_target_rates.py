"""`benchmarks/target_rates.py`: issue 12's targets as read rates, on a probe result whose answers are known."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from target_rates import TARGETS, parse_shape, rates  # noqa: E402


def _probe():
    bf16 = 1 * 8 * 65536 * 128 * 4  # 268 MB of BF16 K and V at 1x64K
    return {"gpu": "test card", "rows": [
        {"shape": "32/8/128 1x65536", "bytes": bf16 // 2, "cudnn_us": 67.5,
         "gaac": {"us": 60.0}, "gaac_loads_only": {"us": 40.0}, "twin": {"us": 70.0}},
        {"shape": "9/3/64 1x65536", "bytes": 1000, "cudnn_us": 19.0, "gaac": {"us": 20.0}}]}


def test_a_target_becomes_a_time_and_a_rate():
    assert parse_shape("32/8/128 4x65536") == (32, 8, 128, 4, 65536) and TARGETS[(32, 8, 128, 4, 65536)] == 1.30
    (r,) = rates(_probe())  # the shape without a target is left out
    assert r["target_us"] == pytest.approx(67.5 / 1.35) and r["bytes_ratio"] == 2
    assert r["needed_tb_per_s"] == pytest.approx(r["gaac_bytes"] / 50.0 / 1e6)
    # half the bytes in 1/1.35 of the time: 0.675 of cuDNN's rate
    assert r["needed_vs_cudnn_rate"] == pytest.approx(1.35 / 2)
    assert r["builds_us"] == {"gaac": 60.0, "gaac_loads_only": 40.0}  # the twin is not a GAAC build
    assert r["builds_meeting_target"] == ["gaac_loads_only"]
    assert "decode_budget_us" not in r  # no zero-decode build in this run


def test_the_decode_budget_from_the_zero_decode_build():
    probe = _probe()
    probe["rows"][0]["gaac_zero_decode"] = {"us": 52.0}
    (r,) = rates(probe)
    # the target (50 us) is below what the kernel takes with nothing decoded: no budget left
    assert r["decode_budget_us"] == pytest.approx(50.0 - 52.0) and r["decode_cost_us"] == pytest.approx(8.0)
    assert "gaac_zero_decode" not in r["builds_meeting_target"]


def test_the_script_prints_and_writes(tmp_path):
    src, out = tmp_path / "probe.json", tmp_path / "rates.json"
    src.write_text(json.dumps(_probe()))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "target_rates.py"), str(src), "--out", str(out)],
                         capture_output=True, text=True, check=True)
    assert "| 32/8/128 1x65536 | 1.35× | 50.0 |" in run.stdout and "gaac_loads_only" in run.stdout
    assert run.stdout.rstrip().endswith("| gaac_loads_only | — |")
    res = json.loads(out.read_text())
    assert res["gpu"] == "test card" and len(res["rows"]) == 1 and "target_rates.py" in res["command"]
