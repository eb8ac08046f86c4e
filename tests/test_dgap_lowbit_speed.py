"""benchmarks/lowbit_speed.py end to end at a tiny context (what issue 14's decode-time table runs at 2K)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("lowbit_speed", ROOT / "benchmarks" / "lowbit_speed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lowbit_speed_times_each_cache_and_writes_json(bench, tmp_path, sample_corpus):
    out = tmp_path / "speed.json"
    text = tmp_path / "text.txt"  # real text on any machine (the default, the Debian reference, may be absent)
    text.write_text(sample_corpus.text)
    bench.main(["--context", "48", "--steps", "2", "--threads", "1", "--caches", "K2V2 default",
                "--out", str(out), "--text", str(text)])
    res = json.loads(out.read_text())
    assert set(res["rows"]) == {"DynamicCache", "K2V2 default"}
    for row in res["rows"].values():
        assert row["steps"] == 2 and 0 < row["min_ms"] <= row["ms_per_step"]
    assert res["context"] == 48 and "--caches" in res["command"]


def test_lowbit_speed_rejects_unknown_caches(bench, tmp_path, sample_corpus):
    text = tmp_path / "text.txt"
    text.write_text(sample_corpus.text)
    with pytest.raises(SystemExit, match="unknown caches"):
        bench.main(["--context", "48", "--caches", "K3V3 default", "--out", str(tmp_path / "x.json"), "--text",
                    str(text)])
