"""The end-to-end benchmarks of issue 15 at tiny scale on the CPU (what the lead runs on the H200 at full scale):
`benchmarks/equal_memory.py` (largest batch per cache in one KV budget, compiled decode at that batch) and
`benchmarks/smollm2_e2e.py` (the real model with every cache, lossless checks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import equal_memory  # noqa: E402
import smollm2_e2e  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = ["--steps", "2", "--warmup", "1"]


def real_text() -> str:
    """The Debian Reference (the benchmark's default text) or, without the package, a licence text."""
    from gaac_hf.corpus import DEBIAN_REFERENCE, LICENCE_TEXTS

    found = [p for p in (*DEBIAN_REFERENCE, *LICENCE_TEXTS) if Path(p).is_file()]
    if not found:
        pytest.skip("no Debian text on this machine (packages debian-reference-en, base-files)")
    return found[0]


@pytest.fixture(scope="module")
def equal_memory_tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("equal_memory") / "equal_memory.json"
    return equal_memory.main(["--tiny", *STEPS, "--out", str(out)]), out


def test_equal_memory_batches_are_measured_against_the_budget(equal_memory_tiny):
    res, out = equal_memory_tiny
    b = res["batches"]
    budget = res["budget_bytes"]
    assert b["bf16_batch"] == int(budget // b["bf16_bytes_per_sequence"]) == 2  # a budget of 2.6 BF16 sequences
    alloc = {int(k): v for k, v in b["gaac_allocated_bytes_by_batch"].items()}
    g = b["gaac_batch"]
    assert alloc[g] <= budget < alloc[g + 1]  # the largest batch that fits, by what the cache allocates
    assert g >= b["bf16_batch"] + 1 and res["summary"]["extra_sequences"] == g - b["bf16_batch"]
    # GAAC allocates more than its live tiles take (a slot for every tile), less than BF16
    assert 1 < b["gaac_allocated_over_resident"] < b["bf16_bytes_per_sequence"] * g / alloc[g]
    assert json.loads(out.read_text())["batches"] == b


def test_equal_memory_decodes_each_cache_at_its_batch(equal_memory_tiny):
    res, _ = equal_memory_tiny
    v = res["variants"]
    static, twin, gaac = (v["compiled StaticCache + sdpa"], v["compiled PlainStaticCache + gaac (twin)"],
                          v["compiled GAACStaticCache + gaac"])
    assert static["batch"] == twin["batch"] == res["batches"]["bf16_batch"]
    assert gaac["batch"] == res["batches"]["gaac_batch"]
    assert static["allocated_bytes"] == twin["allocated_bytes"] == 2 * res["batches"]["bf16_bytes_per_sequence"]
    assert gaac["within_budget"] and gaac["allocated_bytes"] <= res["budget_bytes"]
    assert 0 < gaac["resident_bytes"] < gaac["allocated_bytes"] and 0 < gaac["saving"] < 1
    for row in (static, twin, gaac):
        assert row["step_ms"] > 0 and row["tokens_per_s"] == pytest.approx(row["batch"] / row["step_ms"] * 1e3,
                                                                             rel=1e-3)
    assert res["summary"]["tokens_equal_twin_on_shared_rows"] is True
    assert res["compile"]["backend"] == "aot_eager" and res["torch"] and res["transformers"]
    assert "--tiny" in res["command"]


def test_equal_memory_refuses_a_budget_below_one_sequence(tmp_path):
    with pytest.raises(ValueError, match="holds no sequence"):
        equal_memory.main(["--tiny", *STEPS, "--budget-gb", "1e-6", "--out", str(tmp_path / "x.json")])


def test_equal_memory_awq_is_skipped_clearly_without_gptqmodel(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gptqmodel", None)  # import gptqmodel -> ImportError
    out = tmp_path / "awq.json"
    res = equal_memory.main(["--tiny", "--awq", "--out", str(out)])
    assert res["awq"].startswith("skipped: --awq needs gptqmodel") and "variants" not in res
    assert json.loads(out.read_text())["awq"] == res["awq"]


def test_equal_memory_runs_awq_weights(equal_memory_tiny, tmp_path, monkeypatch):
    pytest.importorskip("gptqmodel", reason="AWQ checkpoints load through gptqmodel: pip install 'gaac-hf[awq]'")
    monkeypatch.setenv("GPTQMODEL_CPU_WORKERS", "1")
    res = equal_memory.main(["--tiny", "--awq", "--awq-dir", str(tmp_path / "awq"), "--awq-group-size", "64",
                             *STEPS, "--out", str(tmp_path / "awq.json")])
    assert res["awq"]["kernels"] and res["awq"]["loaded_dtype"] == "torch.bfloat16"
    assert res["param_bytes"] < 0.5 * equal_memory_tiny[0]["param_bytes"]  # 4-bit packed decoder weights
    assert res["variants"]["compiled GAACStaticCache + gaac"]["batch"] == res["batches"]["gaac_batch"] == 3
    assert res["summary"]["tokens_equal_twin_on_shared_rows"] is True


def test_smollm2_e2e_is_lossless_and_smaller(tmp_path):
    out = tmp_path / "smollm2.json"
    res = smollm2_e2e.main(["--tiny", "--contexts", "64", *STEPS, "--text", real_text(), "--out", str(out)])
    row = res["contexts"]["64"]
    assert set(row["lossless"]) == {"eager GAACCache + gaac vs eager DynamicCache + gaac",
                                    "eager GAACStaticCache + gaac vs eager PlainStaticCache + gaac"}
    assert all(v == {"tokens": True, "logit_bits": True} for v in row["lossless"].values())
    for label, (_, _, compiled) in smollm2_e2e.VARIANTS.items():
        if compiled:
            assert "skipped" in row[label]  # CPU without --backend
        else:
            assert row[label]["step_ms"] > 0
    dyn = row["eager DynamicCache + sdpa"]["resident_kv_bytes"]
    assert dyn == 30 * 2 * 3 * 64 * 64 * 2  # SmolLM2: 30 layers, 3 KV heads of dim 64, BF16, 64 tokens
    for label in ("eager GAACCache + gaac", "eager GAACStaticCache + gaac"):
        assert 0 < row[label]["resident_kv_bytes"] < dyn
    assert row["eager StaticCache + sdpa"]["allocated_kv_bytes"] == dyn  # built with max_cache_len = context
    assert json.loads(out.read_text())["contexts"]["64"]["lossless"] == row["lossless"]
    assert res["text"].startswith("files:") and res["device"] == "cpu"


def test_smollm2_e2e_names_a_missing_text(tmp_path):
    with pytest.raises(FileNotFoundError, match="no/such/text"):
        smollm2_e2e.main(["--tiny", "--text", "/no/such/text.gz", "--out", str(tmp_path / "x.json")])


def test_compiled_host_probe_runs_small(tmp_path):
    """benchmarks/compiled_host.py (the host cost outside a compiled step's graph) at 2 layers, in its own process
    (it replaces the gaac:: ops' CPU kernels with stubs for the whole process): it ran, counted the graph inputs
    (the compressed cache's stacks are more tensors than the twin's) and split each step into inside / outside."""
    import subprocess

    out = tmp_path / "host.json"
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "compiled_host.py"
    subprocess.run([sys.executable, str(script), "--layers", "2", "--steps", "4", "--rounds", "1", "--variants", "gaac",
                    "twin", "--out", str(out)], check=True, capture_output=True, timeout=600)
    rows = json.loads(out.read_text())["variants"]
    gaac, twin = rows["compiled GAACStaticCache"], rows["compiled twin (plain BF16, same ops)"]
    assert gaac["graph_inputs"] > twin["graph_inputs"] > gaac["graph_inputs"] - 16
    for row in (gaac, twin):
        assert row["static_inputs"] == row["graph_inputs"] - 2  # all but the token and its position
        assert 0 < row["outside_graph_ms"] < row["step_ms"] and row["guards_executed"] > 0
