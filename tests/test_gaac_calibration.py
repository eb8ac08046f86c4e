"""Window and slot-capacity calibration, and the GAACCalibration artifact."""

import json
import shutil
from unittest import mock

import pytest
import torch
from hf_common.testing import tiny_llama_config

from gaac_hf.calibrate import (
    best_window,
    calibrate,
    choose_escape_capacity,
    exponent_histogram,
    resident_bytes_per_tile,
)
from gaac_hf.calibration import (
    CalibrationMismatchError,
    CorruptArtifactError,
    GAACCalibration,
)
from gaac_hf.codec import split_fields


def test_best_window_matches_brute_force():
    gen = torch.Generator().manual_seed(0)
    hist = torch.randint(0, 50, (7, 256), generator=gen) * (torch.rand(7, 256, generator=gen) < 0.3)
    for width in (8, 16):
        base = best_window(hist, width)
        for row in range(7):
            sums = torch.tensor([hist[row, b:b + width].sum() for b in range(257 - width)])
            assert sums[int(base[row])] == sums.max()
            assert int(base[row]) == int(torch.nonzero(sums == sums.max())[0])  # lowest base on ties


def test_exponent_histogram_counts_per_channel():
    kv = torch.randn(2, 2, 3, 40, 64).to(torch.bfloat16)
    hist = exponent_histogram(kv)
    assert hist.shape == (2, 2, 3, 64, 256)
    e = split_fields(kv)[0]
    assert torch.equal(hist[1, 0, 2, 5], torch.bincount(e[1, 0, 2, :, 5], minlength=256))


def test_escape_capacity_minimizes_resident_bytes():
    gen = torch.Generator().manual_seed(3)
    escapes = torch.poisson(torch.full((5000,), 14.0), generator=gen).to(torch.int32)
    escapes[:20] = 300  # a few heavy tiles
    best = choose_escape_capacity(escapes, 64)
    assert best % 16 == 0
    costs = {c: resident_bytes_per_tile(escapes, 64, c).item() for c in range(0, 400, 16)}
    assert costs[best] == min(costs.values())


@pytest.fixture(scope="module")
def tiny_calibration(tiny_llama, sample_corpus):

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (256,), generator=gen) for _ in range(3)]
    return calibrate(tiny_llama, prompts, "random ids")


def test_calibrate_records_the_model(tiny_calibration):
    cfg = tiny_calibration.config
    assert (cfg.num_hidden_layers, cfg.layers, cfg.num_kv_heads, cfg.head_dim) == (2, [0, 1], 2, 64)
    assert cfg.corpus_tokens == 768 and cfg.prompt_tokens == 256
    assert cfg.escape_capacity % 16 == 0
    assert tiny_calibration.base3.shape == (2, 2, 2, 64)
    assert cfg.measured["calibration corpus"]["codec_ratio"] > 1.0


def test_artifact_round_trip(tmp_path, tiny_calibration, tiny_llama):
    tiny_calibration.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "config.json", "windows.safetensors"]
    loaded = GAACCalibration.from_pretrained(str(tmp_path))
    assert torch.equal(loaded.base3, tiny_calibration.base3)
    assert torch.equal(loaded.base4, tiny_calibration.base4)
    assert loaded.config == tiny_calibration.config
    loaded.check_model(tiny_llama.config)
    card = (tmp_path / "README.md").read_text()
    assert "gaac-hf" in card and "escape capacity" in card


@pytest.mark.parametrize("change, message", [
    (dict(num_key_value_heads=1), "KV heads"),
    (dict(num_hidden_layers=3), "layers"),
    (dict(head_dim=128), "head_dim"),
])
def test_calibration_for_another_model_is_rejected(tiny_calibration, change, message):
    with pytest.raises(CalibrationMismatchError, match=message):
        tiny_calibration.check_model(tiny_llama_config(**change))


def test_corrupt_artifacts_give_clear_errors(tmp_path, tiny_calibration):
    good = tmp_path / "good"
    tiny_calibration.save_pretrained(good)

    def variant(name, edit):
        d = tmp_path / name
        shutil.copytree(good, d)
        edit(d)
        return str(d)

    def truncate(d):
        p = d / "windows.safetensors"
        p.write_bytes(p.read_bytes()[:100])

    def bad_json(d):
        (d / "config.json").write_text("{not json")

    def version(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["format_version"] = 99
        (d / "config.json").write_text(json.dumps(cfg))

    def missing_field(d):
        cfg = json.loads((d / "config.json").read_text())
        del cfg["head_dim"]
        (d / "config.json").write_text(json.dumps(cfg))

    def wrong_shape(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg["num_kv_heads"] = 5
        (d / "config.json").write_text(json.dumps(cfg))

    def flip_bits(d):
        p = d / "windows.safetensors"
        data = bytearray(p.read_bytes())
        data[-40:] = b"\xff" * 40  # windows past exponent 255
        p.write_bytes(bytes(data))

    def no_windows(d):
        (d / "windows.safetensors").unlink()

    cases = {"truncate": (truncate, "windows.safetensors"), "bad_json": (bad_json, "not valid JSON"),
             "version": (version, "format version 99"), "missing": (missing_field, "head_dim"),
             "shape": (wrong_shape, "shape"), "bits": (flip_bits, "past exponent 255"),
             "no_windows": (no_windows, "no windows.safetensors")}
    for name, (edit, message) in cases.items():
        with pytest.raises(CorruptArtifactError, match=message):
            GAACCalibration.from_pretrained(variant(name, edit))


def test_even_windows_for_format_2():
    """windows_from_histogram(hist, 2): the best window among those that start at even exponents."""
    from gaac_hf.calibrate import windows_from_histogram

    gen = torch.Generator().manual_seed(1)
    hist = torch.randint(0, 50, (5, 256), generator=gen) * (torch.rand(5, 256, generator=gen) < 0.3)
    b3, b4 = windows_from_histogram(hist, 2)
    for base, width in ((b3, 8), (b4, 16)):
        assert not bool((base & 1).any())
        for row in range(5):
            sums = torch.tensor([hist[row, b:b + width].sum() if b % 2 == 0 else -1 for b in range(257 - width)])
            assert int(base[row]) == int(torch.nonzero(sums == sums.max())[0])


def test_a_format_2_calibration_converts_saves_and_serves_the_caches(tmp_path, tiny_calibration, tiny_llama):
    from gaac_hf import GAACCache, GAACStaticCache

    v2 = tiny_calibration.convert(2)
    assert v2.config.format_version == 2 and not bool(((v2.base3 | v2.base4) & 1).any())
    assert bool((v2.base3 <= tiny_calibration.base3).all()) and bool((tiny_calibration.base3 - v2.base3 <= 1).all())
    assert "converted" in v2.config.measured
    v2.save_pretrained(tmp_path / "v2")
    loaded = GAACCalibration.from_pretrained(str(tmp_path / "v2"))
    assert loaded.config.format_version == 2 and torch.equal(loaded.base4, v2.base4)
    for make in (lambda c, **kw: GAACCache(tiny_llama.config, c, **kw),
                 lambda c, **kw: GAACStaticCache(tiny_llama.config, 64, c, **kw)):
        make(loaded)
        make(loaded, format_version=2)
        make(tiny_calibration, format_version=1)
        with pytest.raises(ValueError,
                           match=r"format-version-2 calibration.*this one is version 1.*--format-version 2"):
            make(tiny_calibration, format_version=2)  # version-1 windows are not silently moved
        with pytest.raises(ValueError, match="format version 1 or 2"):
            make(loaded, format_version=3)
    back = loaded.convert(1)
    assert back.config.format_version == 1 and torch.equal(back.base3, v2.base3)
    GAACCache(tiny_llama.config, back)  # even windows are valid version-1 windows
    with pytest.raises(ValueError, match="format version 7"):
        tiny_calibration.convert(7)
    # a version-2 artifact whose windows start at odd exponents is corrupt
    odd = GAACCalibration(back.config, back.base3 | 1, back.base4)
    odd.save_pretrained(tmp_path / "odd")
    cfg = json.loads((tmp_path / "odd" / "config.json").read_text())
    (tmp_path / "odd" / "config.json").write_text(json.dumps({**cfg, "format_version": 2}))
    with pytest.raises(CorruptArtifactError, match="odd exponents"):
        GAACCalibration.from_pretrained(str(tmp_path / "odd"))


def test_hub_round_trip_without_network(tmp_path, tiny_calibration):
    """push_to_hub uploads the saved folder; from_pretrained(repo_id) reads it through hf_hub_download."""
    uploaded = tmp_path / "hub"

    def fake_upload_folder(self, *, repo_id, folder_path, **kw):
        shutil.copytree(folder_path, uploaded / repo_id)
        return "commit-url"

    with mock.patch("huggingface_hub.HfApi.create_repo", return_value=mock.Mock(repo_id="org/calib")), \
            mock.patch("huggingface_hub.HfApi.upload_folder", fake_upload_folder):
        tiny_calibration.push_to_hub("org/calib")
    files = sorted(p.name for p in (uploaded / "org/calib").iterdir())
    assert files == ["README.md", "config.json", "windows.safetensors"]

    def fake_download(repo_id, filename, **kw):
        return str(uploaded / repo_id / filename)

    with mock.patch("huggingface_hub.hub_mixin.hf_hub_download", fake_download), \
            mock.patch("gaac_hf.calibration.hf_hub_download", fake_download):
        loaded = GAACCalibration.from_pretrained("org/calib")
    assert torch.equal(loaded.base4, tiny_calibration.base4)


def test_cli_calibrate_on_local_text(tmp_path, tiny_llama, sample_corpus):
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models, pre_tokenizers

    from gaac_hf.cli import main

    model_dir = tmp_path / "model"
    tiny_llama.save_pretrained(model_dir)
    vocab = {chr(i): i for i in range(256)}
    tok = Tokenizer(models.WordLevel(vocab={**vocab, "[UNK]": 300}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(model_dir)
    text = tmp_path / "a.txt"
    text.write_text(sample_corpus.text[:4000])
    out = tmp_path / "calib"
    main(["calibrate", str(model_dir), "--text", str(text), "--out", str(out), "--prompt-tokens", "512",
          "--max-prompts", "2", "--heldout-text", str(text), "--format-version", "2"])
    loaded = GAACCalibration.from_pretrained(str(out))
    assert loaded.config.corpus_tokens == 1024
    assert loaded.config.format_version == 2 and not bool(((loaded.base3 | loaded.base4) & 1).any())
    assert any(k.startswith("held-out") for k in loaded.config.measured)
