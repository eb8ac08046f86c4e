"""GAAC and DGAP identify a model the same way: architecture and shapes decide, a different name only warns."""

import warnings

import pytest
from transformers import AutoConfig

from dgap_hf import DGAPLogitsProcessor, DGAPMismatchError, shipped_dgap_artifact
from gaac_hf import CalibrationMismatchError, GAACCalibration, shipped_calibration
from gaac_hf.default_model import DEFAULT_MODEL_ID, default_model_path
from hf_common.model_config import identity_mismatches, model_identity


@pytest.fixture(scope="module")
def artifacts():
    return (GAACCalibration.from_pretrained(shipped_calibration()),
            DGAPLogitsProcessor.from_pretrained(shipped_dgap_artifact(), "K2V2"))


def bf16_folder_config():
    """The embedded model's config as loaded from its cached BF16 folder: named by the folder's path."""
    config = AutoConfig.from_pretrained(default_model_path())
    assert str(config.name_or_path).endswith("SmolLM2-135M-Instruct-bf16")
    return config


def test_the_embedded_model_from_its_bf16_folder_fits_both(artifacts):
    calibration, dgap = artifacts
    config = bf16_folder_config()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a local folder's name is not compared: not even a warning
        calibration.check_model(config)
        dgap.check_model(config)
        DGAPLogitsProcessor.from_pretrained(shipped_dgap_artifact(), "K2V2", model_config=config)


def test_another_name_with_the_same_shapes_only_warns(artifacts):
    calibration, dgap = artifacts
    config = bf16_folder_config()
    config._name_or_path = "someone/SmolLM2-fine-tune"
    for check in (calibration.check_model, dgap.check_model):
        with pytest.warns(UserWarning, match="someone/SmolLM2-fine-tune"):
            check(config)
    config._name_or_path = DEFAULT_MODEL_ID
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        calibration.check_model(config)
        dgap.check_model(config)


@pytest.mark.parametrize("change, message", [
    (dict(num_hidden_layers=31), "layers 31 (the artifact expects 30)"),
    (dict(architectures=["MistralForCausalLM"]), "architecture MistralForCausalLM (the artifact expects LlamaForCausalLM)"),
])
def test_both_reject_other_shapes_with_the_same_words(artifacts, change, message):
    calibration, dgap = artifacts
    config = bf16_folder_config()
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(CalibrationMismatchError) as gaac_error:
        calibration.check_model(config)
    with pytest.raises(DGAPMismatchError) as dgap_error:
        dgap.check_model(config)
    assert message in str(gaac_error.value) and message in str(dgap_error.value)


@pytest.mark.parametrize("change, message", [
    (dict(num_key_value_heads=1), "KV heads 1"),
    (dict(head_dim=32), "head_dim 32"),
    (dict(vocab_size=32000), "vocabulary size 32000"),
    (dict(num_attention_heads=18, num_key_value_heads=3, head_dim=64), "attention heads 18"),
])
def test_identity_mismatches_names_each_field(change, message):
    config = bf16_folder_config()
    expected = model_identity(config)
    for key, value in change.items():
        setattr(config, key, value)
    problems = identity_mismatches(expected, config)
    assert any(message in p for p in problems), problems
    assert identity_mismatches(expected, bf16_folder_config()) == []


def test_fields_an_artifact_did_not_record_are_not_compared():
    config = bf16_folder_config()
    assert identity_mismatches({"num_hidden_layers": 30}, config) == []
    assert identity_mismatches({}, config) == []


def test_a_multimodal_model_answers_to_either_of_its_architecture_names():
    from transformers import Gemma3Config

    config = Gemma3Config()
    config.architectures = ["Gemma3ForConditionalGeneration"]
    config.text_config.architectures = ["Gemma3ForCausalLM"]
    for name in ("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"):
        assert identity_mismatches({"architecture": name}, config) == []
    assert identity_mismatches({"architecture": "LlamaForCausalLM"}, config) != []
