"""Offline evaluation from trace rows equals running the processor on the full logits; document splits; the shipped
artifact; the processor on top of transformers' own `QuantizedCache`."""

import json
from pathlib import Path

import pytest
import torch
from test_dgap_processor import NAME, make_model, set_detector

from dgap_hf import DGAPLogitsProcessor, DGAPMismatchError, DGAPModel
from dgap_hf.evaluation import dgap_delta, evaluate_artifact, quality, reference_quality
from dgap_hf.labels import local_drift
from dgap_hf.synthetic import synthetic_logits
from dgap_hf.traces import TracePairs

pytestmark = pytest.mark.usefixtures("one_thread")

SHIPPED = Path(__file__).resolve().parents[1] / "hub_configs" / "dgap-SmolLM2-135M-Instruct"


def _direct(fp, q, targets):
    """PPL, top-1 agreement and full-vocabulary KL computed from full logits."""
    lp_fp, lq = torch.log_softmax(fp.double(), -1), torch.log_softmax(q.double(), -1)
    return {"ppl": float((-lq.gather(-1, targets[:, None]).mean()).exp()),
            "top1_agreement": float((q.argmax(-1) == fp.argmax(-1)).float().mean()),
            "kl": float((lp_fp.exp() * (lp_fp - lq)).sum(-1).mean())}


@pytest.mark.parametrize("tau", [0.0, 0.5, 1.0])
def test_offline_quality_equals_processor_on_full_logits(tau):
    fp, lb = synthetic_logits(300, 256, seed=3)
    targets = torch.multinomial(torch.softmax(fp, -1), 1, generator=torch.Generator().manual_seed(1))[:, 0]
    tr = TracePairs.from_logits(fp, lb, top_m=16, targets=targets)
    model = make_model(k_b=8, tau=tau)
    set_detector(model, bias=0.0, weights={"entropy": 1.0, "p1": -3.0})  # some rows above tau, some below
    proc = DGAPLogitsProcessor(model, "K2V2")
    corrected, risk, on = proc.restore(lb)
    applied, risk_offline, k = dgap_delta(model, "K2V2", tr)
    assert k == 8
    torch.testing.assert_close(risk_offline, risk)
    got, want = quality(tr, k, applied), _direct(fp, corrected, targets)
    assert got["top1_agreement"] == want["top1_agreement"]
    assert got["ppl"] == pytest.approx(want["ppl"], rel=1e-5)
    assert got["kl"] == pytest.approx(want["kl"], rel=1e-4, abs=1e-6)
    plain = quality(tr, k)
    assert plain["ppl"] == pytest.approx(_direct(fp, lb, targets)["ppl"], rel=1e-5)
    assert reference_quality(tr)["ppl"] == pytest.approx(_direct(fp, fp, targets)["ppl"], rel=1e-5)
    assert got["drift"] == pytest.approx(float(local_drift(tr, k, 0.95, applied).mean()), rel=1e-6)
    if tau == 1.0:  # never corrects: identical to the plain low-bit cache
        assert not bool(on.any()) and got == plain
    else:
        assert bool(on.any()) and got["kl"] != plain["kl"]


def test_quality_needs_targets():
    fp, lb = synthetic_logits(8, 64)
    with pytest.raises(ValueError, match="target"):
        quality(TracePairs.from_logits(fp, lb, top_m=8), 4)


def test_split_by_document_keeps_documents_whole():
    fp, lb = synthetic_logits(400, 64)
    doc = torch.arange(400) // 40  # 10 documents
    tr = TracePairs.from_logits(fp, lb, top_m=8, doc=doc)
    train, val = tr.split(0.25, seed=0)
    assert len(train) + len(val) == 400
    assert not set(train.doc.tolist()) & set(val.doc.tolist())
    assert 80 <= len(val) <= 120


def test_evaluate_artifact_reports_every_precision():
    fp, lb = synthetic_logits(200, 256, seed=5)
    tr = TracePairs.from_logits(fp, lb, top_m=16, targets=fp.argmax(-1))
    model = make_model(k_b=8, tau=0.5)
    res = evaluate_artifact(model, {"K2V2": tr, "K4V4": tr}, taus=[0.0, 1.0])
    assert list(res) == ["K2V2"]  # the artifact has no K4V4 models
    r = res["K2V2"]
    assert r["bf16"]["ppl"] < r["lowbit"]["ppl"]
    assert [s["tau"] for s in r["tau_sweep"]] == [0.0, 1.0]
    assert r["tau_sweep"][1]["correction_rate"] == 0.0
    assert r["tau_sweep"][1]["ppl"] == pytest.approx(r["lowbit"]["ppl"])


# --- the shipped artifact ----------------------------------------------------------------------------------------
def test_shipped_artifact_loads_and_fits_smollm2_only(smollm2):
    model, _ = smollm2
    config = json.loads((SHIPPED / "config.json").read_text())
    assert set(config["precisions"]) == {"K1V1", "K2V2", "K4V4", "K8V8"}
    for p in config["precisions"]:
        proc = DGAPLogitsProcessor.from_pretrained(SHIPPED, p, model_config=model.config)
        assert 2 <= proc.k_b <= 48 and 0.0 < proc.tau <= 1.0
        sources = " ".join(config["training"]["sources"])
        assert "debian-reference" not in sources  # trained on text disjoint from the evaluation text
    other = type(model.config)(**{**model.config.to_dict(), "vocab_size": 1000})
    with pytest.raises(DGAPMismatchError, match="vocabulary"):
        DGAPLogitsProcessor.from_pretrained(SHIPPED, "K2V2", model_config=other)


def test_shipped_artifact_on_real_low_bit_logits(smollm2):
    """K2V2 on real SmolLM2 logits: rows at or below tau are bit-identical, corrected rows change only the window."""
    from dgap_hf import LowBitCache, LowBitConfig
    from gaac_hf.corpus import sample_text
    from gaac_hf.model_layers import cache_kwarg

    model, tok = smollm2
    ids = tok(sample_text().text, return_tensors="pt").input_ids[:, :192]
    cache = LowBitCache(model.config, LowBitConfig.from_artifact(DGAPModel.from_pretrained(SHIPPED), "K2V2"))
    with torch.no_grad():
        model(input_ids=ids[:, :160], use_cache=True, **{cache_kwarg(model): cache})
        logits = model(input_ids=ids[:, 160:], use_cache=True, **{cache_kwarg(model): cache}).logits[0].float()
    proc = DGAPLogitsProcessor.from_pretrained(SHIPPED, "K2V2", model_config=model.config, tau=0.0)
    out, risk, on = proc.restore(logits)
    assert bool(on.all())
    win = logits.topk(proc.k_b, -1).indices
    outside = torch.ones_like(logits, dtype=torch.bool).scatter(-1, win, False)
    assert torch.equal(out[outside], logits[outside])
    shipped = DGAPLogitsProcessor.from_pretrained(SHIPPED, "K2V2", model_config=model.config)
    out2, risk2, on2 = shipped.restore(logits)
    assert torch.equal(out2[~on2], logits[~on2])


# --- transformers' own QuantizedCache ---------------------------------------------------------------------------
def test_processor_on_top_of_transformers_quantized_cache():
    pytest.importorskip("optimum.quanto")
    from hf_common.testing import tiny_llama_config
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList, QuantizedCache

    cfg = tiny_llama_config(vocab_size=256, hidden_size=64, intermediate_size=128, head_dim=16)
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_config(cfg).eval()
    llama.config.name_or_path = NAME
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))

    class Record(LogitsProcessor):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores):
            self.seen.append(scores.clone())
            return scores

    def run(tau):
        cache = QuantizedCache(backend="quanto", config=cfg, nbits=2, q_group_size=16, residual_length=8)
        dgap_model = make_model(k_b=8, tau=tau)
        set_detector(dgap_model, bias=0.0, weights={"entropy": 1.0})
        before, after = Record(), Record()
        dgap = DGAPLogitsProcessor(dgap_model, "K2V2", model_config=llama.config)
        out = llama.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=12,
                             do_sample=False, logits_processor=LogitsProcessorList([before, dgap, after]),
                             pad_token_id=0)
        return out, before.seen, after.seen, dgap.stats()

    out_off, b_off, a_off, st_off = run(tau=1.0)
    assert st_off["corrected"] == 0
    assert all(torch.equal(x, y) for x, y in zip(b_off, a_off))  # never corrects: scores untouched
    out_on, b_on, a_on, st_on = run(tau=0.0)
    assert st_on["corrected"] == st_on["rows"] == 2 * 12
    for x, y in zip(b_on, a_on):
        win = x.topk(8, -1).indices
        outside = torch.ones_like(x, dtype=torch.bool).scatter(-1, win, False)
        assert torch.equal(x[outside], y[outside]) and not torch.equal(x, y)
    assert torch.equal(out_off[:, :24], out_on[:, :24])
