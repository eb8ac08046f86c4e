"""The default model's BF16 cache is written so that no reader sees half a model: concurrent first uses, a cache
that cannot be written, a save that fails (`gaac_hf.default_model.save_into_cache`, with a stand-in save)."""

import os

import pytest

from gaac_hf.default_model import _complete, save_into_cache


def _save(folder):
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")


def test_saved_into_place_with_nothing_left_over(tmp_path):
    target = tmp_path / "cache" / "model-bf16"
    assert save_into_cache(target, _save) == target and _complete(target)
    assert os.listdir(tmp_path / "cache") == ["model-bf16"]
    assert target.stat().st_mode & 0o777 == 0o755  # readable by the other users of a shared cache


def test_a_race_lost_to_another_process_keeps_the_winner(tmp_path):
    target = tmp_path / "model-bf16"

    def save_while_another_process_finishes(folder):
        _save(folder)
        target.mkdir()
        (target / "config.json").write_text('{"winner": 1}')
        (target / "model.safetensors").write_bytes(b"winner")

    assert save_into_cache(target, save_while_another_process_finishes) == target
    assert (target / "config.json").read_text() == '{"winner": 1}'
    assert os.listdir(tmp_path) == ["model-bf16"]  # the loser's folder is gone


def test_a_failed_save_raises_and_leaves_nothing(tmp_path):
    target = tmp_path / "model-bf16"

    def failing(folder):
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_into_cache(target, failing)
    assert os.listdir(tmp_path) == []


def test_any_failure_of_the_save_leaves_nothing(tmp_path):
    def interrupted(folder):
        _save(folder)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        save_into_cache(tmp_path / "model-bf16", interrupted)
    assert os.listdir(tmp_path) == []


def test_an_unwritable_cache_converts_into_a_temporary_folder(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    target = blocker / "cache" / "model-bf16"  # mkdir fails here even for root
    with pytest.warns(UserWarning, match="cannot write the model cache.*GAAC_HF_CACHE"):
        got = save_into_cache(target, _save)
    assert got != target and _complete(got) and not target.exists()
