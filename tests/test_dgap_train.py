"""DGAP training: losses (Eq. 10, 14-18), tau calibration, synthetic end-to-end run, trace-to-artifact pipeline."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from hf_common.testing import tiny_llama_config
from transformers import AutoModelForCausalLM

from gaac_hf.model_layers import cache_kwarg
from dgap_hf import DGAPLogitsProcessor, LowBitCache, TrainConfig, collect_traces, train_dgap
from dgap_hf.synthetic import synthetic_logits, synthetic_traces
from dgap_hf.train import calibrate_tau, corrector_loss, detector_loss, window_kl


pytestmark = pytest.mark.usefixtures("one_thread")


def test_detector_loss_is_bce():
    logits = torch.tensor([2.0, -1.0, 0.5])
    y = torch.tensor([1.0, 0.0, 0.0])
    r = torch.sigmoid(logits)
    manual = -(y * r.log() + (1 - y) * (1 - r).log()).mean()
    assert detector_loss(logits, y).item() == pytest.approx(manual.item(), rel=1e-6)


def test_corrector_loss_terms():
    z_fp = torch.tensor([[3.0, 2.0, 0.0], [1.0, 0.5, 0.2]])
    z_hat = torch.tensor([[2.0, 2.5, 0.0], [1.0, 0.5, 0.2]])
    p_fp = torch.softmax(z_fp, -1) * 0.9  # FP full-vocabulary probabilities of the window
    y = torch.tensor([1.0, 0.0])
    # the exact restoration (up to a common offset) has zero KL; the rank term stays (softplus > 0) but is lower
    exact = corrector_loss(z_hat, z_fp - z_hat + 1.0, z_fp, p_fp, y, temperature=2.0)
    none = corrector_loss(z_hat, torch.zeros_like(z_hat), z_fp, p_fp, y, temperature=2.0)
    assert exact["dist"].item() == pytest.approx(0.0, abs=1e-6)
    assert none["dist"] > 0.01 and none["rank"] > exact["rank"] and none["reg"] == 0
    # by hand for row 0 (rows with y = 0 do not count)
    q_fp, q = F.softmax(z_fp[0] / 2, -1), F.softmax(z_hat[0] / 2, -1)
    assert none["dist"].item() == pytest.approx((q_fp * (q_fp / q).log()).sum().item(), rel=1e-5)
    w = lambda i, j: (p_fp[0, i] - p_fp[0, j]).item()  # noqa: E731
    sp = lambda i, j: math.log1p(math.exp(-(z_hat[0, i] - z_hat[0, j]).item()))  # noqa: E731
    rank = w(0, 1) * sp(0, 1) + w(0, 2) * sp(0, 2) + w(1, 2) * sp(1, 2)
    assert none["rank"].item() == pytest.approx(rank, rel=1e-5)
    delta = torch.full_like(z_hat, 0.5, requires_grad=True)
    out = corrector_loss(z_hat, delta, z_fp, p_fp, y, lambda_rank=0.3, lambda_reg=0.1)
    assert out["reg"].item() == pytest.approx(0.75)
    assert out["total"].item() == pytest.approx((out["dist"] + 0.3 * out["rank"] + 0.1 * out["reg"]).item())
    out["total"].backward()
    assert delta.grad[1].abs().sum() == 0 and delta.grad[0].abs().sum() > 0


def test_tau_rule_picks_fewest_corrections_near_best_gain():
    # rows with high risk gain from correction, rows with low risk lose
    risk = torch.tensor([0.95, 0.9, 0.8, 0.7, 0.5, 0.3, 0.2, 0.1])
    gain = torch.tensor([0.3, 0.3, 0.2, 0.01, -0.1, -0.1, -0.2, -0.2])
    tau, table = calibrate_tau(risk, gain, grid=[0.15, 0.25, 0.4, 0.6, 0.75, 0.85], tolerance=0.05)
    # best total gain at tau = 0.6 (0.81); tau = 0.75 keeps 0.8 >= 0.95 * 0.81 with one correction fewer
    assert tau == 0.75
    rates = {r["tau"]: r["correction_rate"] for r in table}
    assert rates[0.75] == 3 / 8 and rates[1.0] == 0.0
    tau, _ = calibrate_tau(risk, -gain.abs(), grid=[0.2, 0.5])
    assert tau == 1.0  # correcting never helps: never correct


def test_synthetic_end_to_end_training_lowers_kl_on_held_out_rows():
    train_traces = synthetic_traces(3000, 256, top_m=32, seed=0)
    cfg = TrainConfig(epochs=10, batch_size=256, detector_hidden=64, corrector_hidden=128, rho_k=0.85,
                      k_max=16)
    model = train_dgap({"K1V1": train_traces}, cfg)
    res = model.results["K1V1"]
    val = res["validation"]
    assert 2 <= res["k_b"] <= 16 and 0.0 < res["tau"] < 1.0
    assert val["detector_auc"] > 0.7
    assert val["window_kl_after"] < 0.85 * val["window_kl_before"]
    assert val["drift_after"] < val["drift_before"]
    # the runtime path on fresh held-out rows (another seed, full logits)
    fp, lb = synthetic_logits(1000, 256, seed=123)
    proc = DGAPLogitsProcessor(model, "K1V1")
    out, risk, corrected = proc.restore(lb)
    assert 0.05 < corrected.float().mean() < 1.0
    assert torch.equal(out[~corrected], lb[~corrected])
    k = proc.k_b
    idx = lb.topk(k).indices
    kl_before = window_kl(fp.gather(-1, idx), lb.gather(-1, idx)).mean()
    kl_after = window_kl(fp.gather(-1, idx), out.gather(-1, idx)).mean()
    assert kl_after < 0.9 * kl_before
    full_kl = lambda a, b: (F.softmax(a, -1) * (F.log_softmax(a, -1) - F.log_softmax(b, -1))).sum(-1).mean()  # noqa
    assert full_kl(fp, out) < full_kl(fp, lb)


def test_pipeline_traces_to_artifact_to_generate(tmp_path):
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64, initializer_range=0.2)
    llama = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    llama.generation_config.eos_token_id = None
    ids = torch.randint(0, 256, (4, 56), generator=torch.Generator().manual_seed(0))
    kw = {"group_size": 16, "residual_length": 0}
    traces = collect_traces(llama, ids, ["K2V2", "K4V4"], prefix_len=40, steps=16, top_m=24, cache_kwargs=kw)
    assert len(traces["K2V2"]) == 64 and traces["K2V2"].meta["quantizer"]["group_size"] == 16
    assert traces["K2V2"].meta["base_model_info"]["vocab_size"] == 256
    model = train_dgap(traces, TrainConfig(epochs=2, batch_size=32, detector_hidden=16, corrector_hidden=16,
                                           k_max=12), training_data={"corpus": "random tokens"})
    assert set(model.precisions) == {"K2V2", "K4V4"}
    assert model.training_info["corpus"] == "random tokens" and model.quantizer["K2V2"]["group_size"] == 16
    model.save_pretrained(tmp_path / "art")
    proc = DGAPLogitsProcessor.from_pretrained(str(tmp_path / "art"), "K2V2", model_config=llama.config)
    out = llama.generate(ids[:2, :40], **{cache_kwarg(llama): LowBitCache(llama.config, "K2V2", **kw)}, logits_processor=[proc],
                         max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 44)


@pytest.mark.parametrize("arch", ["linear", "mlp", "transformer"])
def test_architectures_shapes_and_standalone_hub_round_trip(arch, tmp_path):
    from dgap_hf import DGAPCorrector, DGAPDetector
    from dgap_hf.features import runtime_features

    z = torch.randn(5, 200, generator=torch.Generator().manual_seed(0)) * 2
    phi, xi, _, _ = runtime_features(z, 12)
    det = DGAPDetector(arch=arch, hidden=16, layers=1, heads=2).fit_normalization(phi)
    corr = DGAPCorrector(12, arch=arch, hidden=16, layers=1, heads=2).fit_normalization(xi, phi)
    assert det(phi).shape == (5,) and ((det.risk(phi) > 0) & (det.risk(phi) < 1)).all()
    assert torch.equal(corr(xi, phi), torch.zeros(5, 12))  # zero-initialized output: no correction before training
    with torch.no_grad():
        for p in corr.parameters():
            p.add_(0.1)
    assert corr(xi, phi).abs().max() <= corr.max_delta
    if arch == "transformer":
        assert corr(xi[:, :6], phi).shape == (5, 6)  # any window up to its size
    else:
        with pytest.raises(ValueError, match="window"):
            corr(xi[:, :6], phi)
    corr.save_pretrained(tmp_path / "c")
    back = DGAPCorrector.from_pretrained(tmp_path / "c", strict=True)
    assert back.arch == arch and torch.equal(back(xi, phi), corr(xi, phi))


def test_cli_collect_train_info(tmp_path, capsys):
    from dgap_hf.cli import main

    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64, initializer_range=0.2)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "llama")
    main(["collect", "--model", str(tmp_path / "llama"), "--random-tokens", "1000", "--precisions", "K2V2,K1V1",
          "--prefix-len", "32", "40", "--steps", "6", "--sequences", "3", "--batch-size", "2", "--top-m", "16",
          "--group-size", "16", "--residual-length", "0", "--dtype", "float32", "--out", str(tmp_path / "tr")])
    names = sorted(p.name for p in (tmp_path / "tr").iterdir())
    assert names == ["K1V1-p32.safetensors", "K1V1-p40.safetensors", "K2V2-p32.safetensors", "K2V2-p40.safetensors"]
    main(["train", "--traces", str(tmp_path / "tr"), "--out", str(tmp_path / "art"), "--epochs", "1",
          "--detector-hidden", "8", "--corrector-hidden", "8", "--k-max", "8"])
    main(["info", str(tmp_path / "art")])
    out = capsys.readouterr().out
    info = json.loads(out[out.index("{"):])
    assert set(info["precisions"]) == {"K1V1", "K2V2"} and info["base_model"]["vocab_size"] == 256
    art = json.loads((tmp_path / "art" / "config.json").read_text())
    assert art["training"]["rows"] == {"K1V1": 36, "K2V2": 36} and art["training"]["prefix_lens"] == [32, 40]


def test_cli_collect_uses_each_precisions_default_quantizer(tmp_path):
    """Without quantizer options `dgap-hf collect` traces `LowBitConfig.default(precision)` (the measured best, which
    the traces and so the trained artifact record); the options given override only themselves."""
    from dgap_hf import LowBitConfig
    from dgap_hf.cli import build_parser, main, quantizer_overrides
    from dgap_hf.traces import TracePairs

    base = ["collect", "--model", str(tmp_path / "llama"), "--random-tokens", "400", "--prefix-len", "24",
            "--steps", "3", "--sequences", "1", "--top-m", "8", "--dtype", "float32"]
    assert quantizer_overrides(build_parser().parse_args(base + ["--out", "x"])) == {}
    torch.manual_seed(0)
    cfg = tiny_llama_config(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=64)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp_path / "llama")
    main(base + ["--precisions", "K2V2,K1V1", "--out", str(tmp_path / "default")])
    for p in ("K2V2", "K1V1"):
        spec = TracePairs.load(tmp_path / "default" / f"{p}-p24.safetensors").meta["quantizer"]
        assert LowBitConfig.from_spec(spec) == LowBitConfig.default(p, 64)
        assert spec["sink_length"] == 4 and spec["key_group_size"] == 128 and spec["rotation"] == "hadamard"
    main(base + ["--precisions", "K2V2", "--sink-length", "0", "--group-size", "16",
                 "--out", str(tmp_path / "override")])
    spec = TracePairs.load(tmp_path / "override" / "K2V2-p24.safetensors").meta["quantizer"]
    assert LowBitConfig.from_spec(spec) == LowBitConfig.default("K2V2", 64, sink_length=0, key_group_size=16,
                                                                value_group_size=16)
