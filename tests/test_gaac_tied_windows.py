"""benchmarks/tied_windows.py's window variants (format-v2 measurements): aligned and tied windows."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from tied_windows import aligned_window, variants  # noqa: E402


def test_aligned_window_starts_at_a_multiple_and_covers_the_most():
    hist = torch.zeros(3, 256, dtype=torch.int64)
    hist[0, 118:126] = 10  # best free window 118; aligned: [120, 128) covers 6 of 8 bins, [112, 120) only 2
    hist[1, 40:48] = 5  # already aligned
    hist[2, 7] = 100  # one bin: the aligned window [0, 8) holds it
    got = aligned_window(hist, 8, 8)
    assert got.tolist() == [120, 40, 0]


def test_variants_tie_the_4bit_window_to_the_3bit_one():
    hist = torch.zeros(2, 256, dtype=torch.int64)
    hist[0, 118:126] = 10
    hist[1, 2:10] = 3  # near zero: tied windows clamp at 0
    v = variants(hist)
    b3, b4 = v["tied_4bit_window_b3-4"]
    assert b3.tolist() == [118, 2] and b4.tolist() == [114, 0]
    b3, b4 = v["aligned_3bit_tied_b3-8"]
    assert b3.tolist() == [120, 0] and b4.tolist() == [112, 0]
    assert set(v) >= {"format_1_free_windows", "tied_4bit_window_b3-8", "tied_4bit_window_b3"}
