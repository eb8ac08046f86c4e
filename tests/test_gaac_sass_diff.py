"""`benchmarks/sass_diff.py`: the default plans' SASS compared between two kernel sources (nvcc, no GPU)."""

import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import sass_diff  # noqa: E402


def _has_cuobjdump() -> bool:
    try:
        return os.path.isfile(sass_diff.cuobjdump())
    except RuntimeError:
        return False


@pytest.mark.skipif(shutil.which("nvcc") is None or not _has_cuobjdump(), reason="needs nvcc and cuobjdump")
def test_same_source_same_sass_and_an_option_shows(tmp_path):
    plans = sass_diff.default_plans(sass_diff.SHAPES[-1:])  # 9/3/64: the smallest builds
    assert [label for label, _ in plans] == ["9/3/64 1x64K gaac", "9/3/64 1x64K twin"]
    assert "-DGAAC_FORMAT=3" in plans[0][1] and "-DGAAC_PLAIN=1" in plans[1][1]
    src = Path(sass_diff._SOURCE_FILE)
    copy = tmp_path / "copy.cu"
    copy.write_text(src.read_text() + "\n// a comment changes no instruction\n")
    rows = sass_diff.compare(copy, src, plans[:1], workdir=tmp_path)
    assert rows[0]["same"] and rows[0]["base"]["instructions"] > 1000 and rows[0]["base"]["local_bytes"] == 0
    changed = sass_diff.compare(copy, src, plans[:1], ("GAAC_FAST_ISSUE=0",), workdir=tmp_path)
    assert not changed[0]["same"] and changed[0]["new"]["md5"] != changed[0]["base"]["md5"]
    assert changed[0]["base"] == rows[0]["base"]  # the base side built once, the same
