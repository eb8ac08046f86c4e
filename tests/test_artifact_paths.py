"""Shipped artifacts are found from any directory; a path-like artifact argument that does not exist fails at once,
naming the path; repr and model cards say what they are."""

import time
from pathlib import Path

import pytest

from dgap_hf import DGAPLogitsProcessor, DGAPModel, shipped_dgap_artifact
from gaac_hf import GAACCache, GAACCalibration, shipped_calibration
from hf_common.artifacts import check_artifact_path, is_path_like


@pytest.mark.parametrize("name, path_like", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", False), ("gpt2", False), ("org/repo.v2", False),
    ("./calib", True), ("../calib", True), ("/abs/calib", True), ("~/calib", True), ("a/b/c", True),
    ("calib/", True), (Path("calib"), True), ("hub_configs/gaac-SmolLM2-135M-Instruct", True),
])
def test_path_like(name, path_like):
    assert is_path_like(name) is path_like


def test_shipped_artifacts_are_found_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert (shipped_calibration() / "windows.safetensors").is_file()
    assert (shipped_dgap_artifact() / "model.safetensors").is_file()
    GAACCalibration.from_pretrained(shipped_calibration())


@pytest.mark.parametrize("load", [
    lambda p: GAACCalibration.from_pretrained(p),
    lambda p: GAACCache.from_pretrained(p, config=None),
    lambda p: DGAPLogitsProcessor.from_pretrained(p, "K2V2"),
    lambda p: DGAPModel.from_pretrained(p),
])
@pytest.mark.parametrize("missing", ["./no-such-calibration", "results/2026/calib", "hub_configs/typo-artifact"])
def test_missing_folder_fails_at_once_naming_it(tmp_path, monkeypatch, load, missing):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # no help from offline mode: the check itself is fast
    t = time.time()
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        load(missing)
    assert time.time() - t < 2.0


def test_the_readme_relative_path_outside_the_checkout_points_to_the_shipped_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="shipped copy") as error:
        GAACCalibration.from_pretrained("hub_configs/gaac-SmolLM2-135M-Instruct")
    assert str(shipped_calibration()) in str(error.value)


def test_existing_folders_and_repo_ids_pass_through(tmp_path):
    assert check_artifact_path(tmp_path, "x") == str(tmp_path)
    assert check_artifact_path("org/repo", "x") == "org/repo"  # left to the Hub


def test_repr_of_a_calibration_says_what_it_is():
    text = repr(GAACCalibration.from_pretrained(shipped_calibration()))
    for part in ("HuggingFaceTB/SmolLM2-135M-Instruct", "layers=30 of 30", "kv_heads=3", "head_dim=64",
                 "slot_bytes=1472", "escape_capacity=32"):
        assert part in text


@pytest.mark.parametrize("load", [lambda: GAACCalibration.from_pretrained(shipped_calibration()),
                                  lambda: DGAPModel.from_pretrained(shipped_dgap_artifact())])
def test_model_cards_have_no_placeholders(load):
    artifact = load()
    plain = str(artifact.generate_model_card())
    assert "<repo>" not in plain and "https://github.com/)" not in plain and "folder_or_repo_id" in plain
    named = str(artifact.generate_model_card(repo_id="org/artifact"))
    assert 'from_pretrained("org/artifact"' in named


@pytest.mark.parametrize("folder", [shipped_calibration(), shipped_dgap_artifact()])
def test_shipped_cards_have_no_placeholders(folder):
    card = (Path(folder) / "README.md").read_text()
    assert "<repo>" not in card and "https://github.com/)" not in card


def test_readme_defines_the_user_facing_words():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    words = readme[readme.index("## Words"):readme.index("## Use it")]
    for term in ("block", "tile", "group", "mode", "window", "slot", "escape capacity E", "raw tile", "tail",
                 "block table", "KbVc", "K_b", "tau"):
        assert f"- **{term}**" in words, term
