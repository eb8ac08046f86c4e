"""DGAPLogitsProcessor: masking semantics, beam log-probs, generate shapes, Hub round trips, mismatch errors."""

import json
import shutil
from types import SimpleNamespace
from unittest import mock

import pytest
import torch
from hf_common.testing import tiny_llama_config
from huggingface_hub import HfApi
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

from gaac_hf.model_layers import cache_kwarg
from dgap_hf import DGAPArtifactError, DGAPLogitsProcessor, DGAPMismatchError, DGAPModel, LowBitCache
from dgap_hf.features import PHI_NAMES, runtime_features
from dgap_hf.precision import UnknownPrecisionError


pytestmark = pytest.mark.usefixtures("one_thread")


VOCAB = 256
NAME = "test-org/tiny-llama"


def make_model(vocab=VOCAB, k_b=8, tau=0.5, precisions=("K2V2",), corrector_arch="mlp", seed=0):
    specs = {p: {"k_b": k_b, "tau": tau, "detector": {"arch": "linear"},
                 "corrector": {"window": k_b, "arch": corrector_arch, "hidden": 32, "layers": 1}}
             for p in precisions}
    base = {"name": NAME, "vocab_size": vocab, "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "num_hidden_layers": 2}
    m = DGAPModel(specs, base, quantizer={"group_size": 32}, training={"data": "unit test"},
                  results={"K2V2": {"tau": tau}})
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for c in m.correctors.values():  # a corrector that really changes the window (trained ones start at zero)
            for p in c.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def set_detector(model, precision="K2V2", bias=0.0, weights=None):
    det = model.detectors[precision]
    with torch.no_grad():
        det.net.weight.zero_()
        det.net.bias.fill_(bias)
        for name, w in (weights or {}).items():
            det.net.weight[0, PHI_NAMES.index(name)] = w


def scores_batch(n=5, vocab=VOCAB, seed=0):
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_below_tau_bit_identical_above_tau_only_top_kb_changes():
    model = make_model()
    scores = scores_batch()
    ids = torch.zeros(5, 3, dtype=torch.long)
    set_detector(model, bias=-10.0)  # r ~ 0 < tau everywhere
    proc = DGAPLogitsProcessor(model, "K2V2")
    out = proc(ids, scores.clone())
    assert torch.equal(out, scores)
    set_detector(model, bias=10.0)  # r ~ 1 > tau everywhere
    out, risk, corrected = proc.restore(scores.clone())
    assert corrected.all() and (risk > 0.99).all()
    phi, xi, vals, idx = runtime_features(scores, 8)
    window = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, idx, True)
    assert torch.equal(out[~window], scores[~window])  # outside the top-K_b slice: untouched
    delta = model.correctors["K2V2"](xi, phi)
    # the corrected slice, merged back: the fused features equal features.py within float32 rounding ...
    torch.testing.assert_close(out.gather(-1, idx), vals + delta, rtol=1e-5, atol=1e-5)
    ref, _, _ = proc.reference_restore(scores.clone())
    assert torch.equal(ref.gather(-1, idx), vals + delta)  # ... and the reference step is features.py exactly
    assert (delta.abs() > 1e-3).all()
    assert proc.stats()["rows"] == 5 and proc.stats()["corrected"] == 0  # restore() does not count
    proc(ids, scores)
    assert proc.stats()["rows"] == 10 and proc.stats()["corrected"] == 5 and proc.stats()["correction_rate"] == 0.5
    proc.reset_stats()
    assert proc.stats()["rows"] == 0


def test_mixed_rows_and_dtypes():
    model = make_model()
    # risk > 0.5 exactly when the top-1 probability exceeds 0.5
    set_detector(model, bias=-20.0, weights={"p1": 40.0})
    scores = scores_batch(6, seed=1)
    scores[[0, 3, 4], 7] += 20.0  # peaked rows
    proc = DGAPLogitsProcessor(model, "K2V2", tau=0.5)
    out, risk, corrected = proc.restore(scores)
    assert corrected.tolist() == [True, False, False, True, True, False]
    assert torch.equal(out[~corrected], scores[~corrected])
    changed = (out != scores)
    assert (changed.sum(-1)[corrected] <= 8).all() and (changed.sum(-1)[corrected] > 0).all()
    # BF16 scores: same semantics, output stays BF16
    out16, _, c16 = proc.restore(scores.bfloat16())
    assert out16.dtype == torch.bfloat16 and torch.equal(out16[~c16], scores.bfloat16()[~c16])


def test_beam_log_probs_are_renormalized():
    model = make_model()
    logp = torch.log_softmax(scores_batch(4, seed=2), -1)
    set_detector(model, bias=10.0)
    proc = DGAPLogitsProcessor(model, "K2V2")
    out, _, corrected = proc.restore(logp)
    assert corrected.all()
    assert torch.allclose(torch.logsumexp(out, -1), torch.zeros(4), atol=1e-5)
    _, _, _, idx = runtime_features(logp, 8)
    window = torch.zeros_like(logp, dtype=torch.bool).scatter(-1, idx, True)
    shift = (out - logp).masked_fill(window, float("nan"))  # outside the window: one constant per row
    assert torch.allclose(shift.nanmean(-1, keepdim=True).expand_as(logp)[~window], (out - logp)[~window], atol=1e-5)
    set_detector(model, bias=-10.0)
    assert torch.equal(proc(None, logp), logp)
    # raw (unnormalized) logits are not renormalized
    set_detector(model, bias=10.0)
    raw = scores_batch(4, seed=3) + 5
    out, _, _ = proc.restore(raw)
    window = torch.zeros_like(raw, dtype=torch.bool).scatter(-1, raw.topk(8).indices, True)
    assert torch.equal(out[~window], raw[~window])


class Recorder(LogitsProcessor):
    def __init__(self, inner):
        self.inner, self.shapes, self.lse = inner, [], []

    def __call__(self, input_ids, scores):
        self.shapes.append(tuple(scores.shape))
        self.lse.append(torch.logsumexp(scores, -1))
        return self.inner(input_ids, scores)


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64, initializer_range=0.2)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None
    return m


def test_generate_batch_and_beam_shapes(llama):
    model = make_model()
    set_detector(model, bias=10.0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    rec = Recorder(DGAPLogitsProcessor(model, "K2V2"))
    out = llama.generate(ids, logits_processor=LogitsProcessorList([rec]), max_new_tokens=4, do_sample=False,
                         pad_token_id=0, **{cache_kwarg(llama): LowBitCache(llama.config, "K2V2", group_size=32, residual_length=0)})
    assert out.shape == (2, 16) and rec.shapes == [(2, VOCAB)] * 4
    rec = Recorder(DGAPLogitsProcessor(model, "K2V2"))
    out = llama.generate(ids, logits_processor=LogitsProcessorList([rec]), max_new_tokens=4, num_beams=3,
                         num_return_sequences=2, do_sample=False, pad_token_id=0,
                         **{cache_kwarg(llama): LowBitCache(llama.config, "K2V2", group_size=32, residual_length=0)})
    assert out.shape == (4, 16) and rec.shapes == [(6, VOCAB)] * 4
    assert all(torch.allclose(lse, torch.zeros(6), atol=1e-4) for lse in rec.lse)  # beam search: log-probs in
    assert rec.inner.stats()["corrected"] == 24
    # sampling with a batch also works (processor before temperature / top-k)
    out = llama.generate(ids, logits_processor=[DGAPLogitsProcessor(model, "K2V2")], max_new_tokens=3,
                         do_sample=True, top_k=20, temperature=0.7, pad_token_id=0)
    assert out.shape == (2, 15)


def test_save_pretrained_from_pretrained_round_trip(tmp_path):
    model = make_model(precisions=("K2V2", "K1V1"), corrector_arch="transformer")
    set_detector(model, "K1V1", bias=3.0)
    proc = DGAPLogitsProcessor(model, "K1V1")
    proc.save_pretrained(tmp_path / "art")
    files = sorted(p.name for p in (tmp_path / "art").iterdir())
    assert files == ["README.md", "config.json", "model.safetensors"]
    cfg = json.loads((tmp_path / "art" / "config.json").read_text())
    assert cfg["precisions"]["K1V1"]["tau"] == 0.5 and cfg["precisions"]["K1V1"]["k_b"] == 8
    assert cfg["base_model"]["name"] == NAME and cfg["base_model"]["vocab_size"] == VOCAB
    assert cfg["feature_spec"]["phi"] == list(PHI_NAMES) and cfg["quantizer"] == {"group_size": 32}
    assert cfg["training"] == {"data": "unit test"} and "K2V2" in cfg["results"]
    card = (tmp_path / "art" / "README.md").read_text()
    assert NAME in card and "| K1V1 | 8 | 0.500 |" in card
    back = DGAPLogitsProcessor.from_pretrained(str(tmp_path / "art"), precision="k1v1")
    assert back.precision == "K1V1" and back.tau == 0.5 and back.k_b == 8
    scores = scores_batch(3, seed=4)
    assert torch.equal(back(None, scores.clone()), proc(None, scores.clone()))
    other = DGAPLogitsProcessor.from_pretrained(str(tmp_path / "art"), precision="K2V2", tau=0.9)
    assert other.tau == 0.9
    # missing or mismatched weights are clear errors
    shutil.copytree(tmp_path / "art", tmp_path / "broken")
    (tmp_path / "broken" / "model.safetensors").unlink()
    with pytest.raises(DGAPArtifactError, match="model.safetensors"):
        DGAPLogitsProcessor.from_pretrained(str(tmp_path / "broken"))
    cfg["precisions"]["K2V2"]["corrector"]["hidden"] = 16
    (tmp_path / "art" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DGAPArtifactError, match="do not match"):
        DGAPLogitsProcessor.from_pretrained(str(tmp_path / "art"))


def test_push_to_hub_mocked(tmp_path):
    model = make_model()
    uploaded = tmp_path / "hub"

    def fake_upload(self, *, repo_id, folder_path, **kw):
        shutil.copytree(folder_path, uploaded)
        return f"https://hub/{repo_id}/commit/1"

    with mock.patch.object(HfApi, "create_repo", return_value=SimpleNamespace(repo_id="me/dgap-tiny")) as create, \
            mock.patch.object(HfApi, "upload_folder", autospec=True, side_effect=fake_upload) as upload:
        url = DGAPLogitsProcessor(model, "K2V2").push_to_hub("me/dgap-tiny", token="x")
    assert url == "https://hub/me/dgap-tiny/commit/1"
    assert create.call_args.kwargs["repo_id"] == "me/dgap-tiny"
    assert upload.call_args.kwargs["repo_id"] == "me/dgap-tiny"
    assert sorted(p.name for p in uploaded.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert 'from_pretrained("me/dgap-tiny"' in (uploaded / "README.md").read_text()
    back = DGAPLogitsProcessor.from_pretrained(str(uploaded), "K2V2")
    for a, b in zip(back.model.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)


def test_clear_errors_on_mismatched_artifacts(tmp_path):
    model = make_model(vocab=128)
    proc = DGAPLogitsProcessor(model, "K2V2")
    with pytest.raises(DGAPMismatchError, match="128"):
        proc(None, scores_batch(2, vocab=VOCAB))
    cfg = tiny_llama_config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2)
    cfg.architectures = ["LlamaForCausalLM"]
    with pytest.raises(DGAPMismatchError, match="vocabulary"):
        proc.check_model(cfg)
    good = tiny_llama_config(vocab_size=128, hidden_size=64, num_hidden_layers=2)
    good._name_or_path = "/models/cache/tiny-llama"  # a local copy of the same model: accepted
    proc.check_model(good)
    good._name_or_path = "someone/other-model"  # same architecture and shapes under another name: a warning only
    with pytest.warns(UserWarning, match="other-model"):
        proc.check_model(good)
    good._name_or_path = ""
    good.hidden_size = 96
    with pytest.raises(DGAPMismatchError, match="hidden_size"):
        DGAPLogitsProcessor(model, "K2V2", model_config=good)
    # precisions
    with pytest.raises(UnknownPrecisionError, match="K3V3"):
        DGAPLogitsProcessor(model, "K3V3")
    with pytest.raises(UnknownPrecisionError, match=r"\['K2V2'\]"):
        DGAPLogitsProcessor(model, "K1V1")
    model.save_pretrained(tmp_path / "a")
    with pytest.raises(UnknownPrecisionError):
        DGAPLogitsProcessor.from_pretrained(str(tmp_path / "a"), precision="K4V4")
    with pytest.raises(ValueError, match="window"):
        DGAPLogitsProcessor(model, "K2V2", k_b=16)
    # an artifact made with other features
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())
    cfg["feature_spec"]["version"] = 99
    (tmp_path / "a" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DGAPArtifactError, match="features"):
        DGAPLogitsProcessor.from_pretrained(str(tmp_path / "a"))
    (tmp_path / "a" / "config.json").write_text("{not json")
    with pytest.raises(DGAPArtifactError, match="JSON"):
        DGAPLogitsProcessor.from_pretrained(str(tmp_path / "a"))
