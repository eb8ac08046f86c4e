"""The escape-capacity study (`benchmarks/escape_capacity_split.py`) on escapes whose answers are known."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from escape_capacity_split import study, tile_escapes  # noqa: E402


def test_finer_capacities_pay_only_where_k_and_v_differ():
    # K tiles need 16 escape bytes, V tiles 48 (128 channels: slots of 2880 + E bytes, raw tiles 4096, entries 4)
    esc = torch.stack([torch.full((2, 100), 16), torch.full((2, 100), 48)])
    r = study(esc, 128)
    assert r["joint"] == {"capacity": 48, "bytes_per_tile": 2928 + 4}
    assert r["k_v"]["capacity"] == [16, 48] and r["k_v"]["bytes_per_tile"] == (2896 + 2928) / 2 + 4
    assert r["k_v_head"]["bytes_per_tile"] == r["k_v"]["bytes_per_tile"] == r["exact"]["bytes_per_tile"]
    assert r["k_v"]["saved_vs_joint"] == round(1 - 2916 / 2932, 5) and r["raw_tile_bytes"] == 4100
    same = study(torch.full((2, 2, 100), 20), 128)  # alike everywhere: nothing to gain but the rounding
    assert same["joint"]["capacity"] == 32 and same["k_v"]["saved_vs_joint"] == 0
    assert same["exact"]["bytes_per_tile"] == 2880 + 32 + 4


def test_tile_escapes_counts_every_tile():
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(1, 2, 64, 128, generator=gen) * 3).bfloat16()
    v = (torch.randn(1, 2, 64, 128, generator=gen) / 5).bfloat16()
    esc = tile_escapes(k, v)
    assert esc.shape == (2, 2, 4) and bool((esc >= 0).all())
    # an outlier far outside the windows makes its group raw: 5 more escape bytes than without it (tokens 0-7)
    k2 = k.clone()
    k2[0, 1, 3, 5] = 2.0 ** 60
    assert int(tile_escapes(k2, v)[0, 1, 0]) > int(esc[0, 1, 0])
