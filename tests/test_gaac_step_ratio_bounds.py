"""`benchmarks/step_ratio_bounds.py`: issue 13's step-ratio target against its bounds, on a profile whose answers are
known."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from step_ratio_bounds import bounds, probe_bytes, split_ms  # noqa: E402


def _variant(step_ms, split_ms_per_step, matmul_ms):
    return {"pipelined_ms": step_ms, "gpu_kernels": {
        "by_kind_ms": {"matmul": matmul_ms, "attention": split_ms_per_step},
        "top": [["nvjet_gemv", matmul_ms, 64.0], ["gaac_decode_split", split_ms_per_step, 2.0]]}}


def _generate():
    # 2 layers; the twin: 6 ms of rest + 2 x 1 ms of split kernels; GAAC: 2 x 0.5 ms and 0.1 ms more elsewhere
    return {"device": "test card", "param_bytes": int(4.3e9), "contexts": {
        "65536": {"captured GAACStaticCache (CapturedStep)": _variant(7.1, 1.0, 5.0),
                  "captured twin (CapturedStep)": _variant(8.0, 2.0, 5.0),
                  "captured_pipelined_speedup_vs_twin": 8.0 / 7.1}}}


def test_the_step_split_into_kernel_rest_and_extra():
    assert split_ms(_generate()["contexts"]["65536"]["captured twin (CapturedStep)"]) == (2.0, 2.0)
    (r,) = bounds(_generate(), {65536: int(2.15e8)}, {65536: 400.0}, hbm_tb_per_s=4.3)
    assert r["layers"] == 2 and r["rest_ms"] == pytest.approx(6.0) and r["gaac_extra_ms"] == pytest.approx(0.1)
    assert (r["gaac_split_us"], r["twin_split_us"]) == (pytest.approx(500.0), pytest.approx(1000.0))
    # 1.10x: GAAC's step at 8 / 1.1 ms, so its two split kernels get 8 / 1.1 - 6 - 0.1 ms
    assert r["needed_split_us"] == pytest.approx((8.0 / 1.1 - 6.1) / 2 * 1e3)
    assert r["needed_tb_per_s"] == pytest.approx(2.15e8 / r["needed_split_us"] / 1e6)
    assert r["needed_split_us_no_extra"] == pytest.approx((8.0 / 1.1 - 6.0) / 2 * 1e3)
    assert r["needed_tb_per_s_no_extra"] < r["needed_tb_per_s"]
    # the zero-decode build at 400 us a layer: 8 / (6 + 0.1 + 0.8)
    assert r["ratio_zero_decode"] == pytest.approx(8.0 / 6.9)
    # matrix products at the HBM rate: 4.3 GB at 4.3 TB/s = 1 ms instead of 5, both steps alike
    assert r["matmul_at_hbm_rate_ms"] == pytest.approx(1.0)
    assert r["ratio_zero_decode_matmul_at_hbm_rate"] == pytest.approx(4.0 / 2.9)
    # copies at the HBM rate, no frame: 215 MB at 4.3 TB/s = 50 us a layer
    assert r["copies_at_hbm_rate_us"] == pytest.approx(50.0)
    assert r["ratio_copies_at_hbm_rate"] == pytest.approx(8.0 / 6.2)


def test_missing_pieces_are_left_out_and_bad_input_is_named():
    (r,) = bounds(_generate(), {}, {}, hbm_tb_per_s=4.3)
    assert "needed_tb_per_s" not in r and "ratio_zero_decode" not in r and "needed_split_us" in r
    gen = _generate()
    gen["contexts"]["65536"]["captured twin (CapturedStep)"]["gpu_kernels"]["top"].pop()
    with pytest.raises(ValueError, match="gaac_decode_split"):
        bounds(gen, {}, {}, hbm_tb_per_s=4.3)
    assert probe_bytes({"rows": [{"shape": "32/8/128 1x65536", "bytes": 7}, {"shape": "32/8/128 4x65536", "bytes": 9},
                                 {"shape": "64/8/128 1x65536", "bytes": 8}]}) == {65536: 7}


def test_the_script_prints_and_writes(tmp_path):
    src, out = tmp_path / "gen.json", tmp_path / "bounds.json"
    src.write_text(json.dumps(_generate()))
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_ratio_bounds.py"), str(src),
                          "--zero-decode", "65536=400", "--out", str(out)], capture_output=True, text=True, check=True)
    assert "| 65536 | 1.127× | 1.1 | 500.0 / 1000.0 |" in run.stdout
    res = json.loads(out.read_text())
    assert res["device"] == "test card" and res["rows"][0]["zero_decode_us"] == 400.0
    assert "step_ratio_bounds.py" in res["command"]
