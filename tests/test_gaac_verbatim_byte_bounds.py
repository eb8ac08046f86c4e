"""The sign / mantissa study (`benchmarks/verbatim_byte_bounds.py`) on KV whose answers are known."""

import math
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from capture_real_kv import load_real_kv, study_args  # noqa: E402
from verbatim_byte_bounds import cross_entropy, study  # noqa: E402


def _kv(sign: torch.Tensor, mantissa: torch.Tensor) -> torch.Tensor:
    """BF16 values of exponent 127 with the given 0/1 signs and 7-bit mantissas (same shape)."""
    bits = (sign.long() << 15) | (127 << 7) | mantissa.long()
    return (bits - 65536 * (bits >= 32768)).to(torch.int16).view(torch.bfloat16)


def test_constant_k_signs_cost_nothing_and_random_v_signs_a_bit():
    gen = torch.Generator().manual_seed(0)
    shape = (2, 3, 512, 16)  # [L, H, T, D] of K, and of V
    k_sign = torch.randint(0, 2, (2, 3, 1, 16), generator=gen).expand(shape)  # one sign per channel
    v_sign = torch.randint(0, 2, shape, generator=gen)
    man = torch.randint(0, 128, (2, *shape), generator=gen)
    r = study(torch.stack([_kv(k_sign, man[0]), _kv(v_sign, man[1])], 1))
    assert r["tokens_fitted"] == r["tokens_measured"] == 256
    assert r["K"]["sign_static"] < 0.01 and r["K"]["sign_previous_token"] < 0.01
    assert r["K"]["one_sign_group_share"] == 1 and r["K"]["one_sign_mode_saves_bits_per_element"] == 7 / 8
    assert abs(r["V"]["sign_static"] - 1) < 0.02 and abs(r["V"]["sign_previous_token"] - 1) < 0.03
    assert abs(r["V"]["one_sign_group_share"] - 2 / 256) < 0.01  # 8 fair coins agree with probability 2^-7
    for kv in ("K", "V"):
        for b in (6, 5, 4):
            assert abs(r[kv][f"mantissa_bit_{b}"] - 1) < 0.02  # uniform mantissas: incompressible
    assert r["one_sign_mode_saves_bits_per_element_kv"] == (7 / 8 + r["V"]["one_sign_mode_saves_bits_per_element"]) / 2


def test_alternating_signs_are_free_given_the_previous_token():
    t = torch.arange(512)
    sign = (t % 2).view(1, 1, 512, 1).expand(1, 1, 512, 8)
    man = torch.zeros(1, 1, 512, 8, dtype=torch.long)
    r = study(torch.stack([_kv(sign, man), _kv(sign, man)], 1))
    assert abs(r["K"]["sign_static"] - 1) < 1e-3  # half ones
    assert r["K"]["sign_previous_token"] < 0.05  # ... but always the other sign
    assert r["K"]["one_sign_group_share"] == 0
    assert r["K"]["mantissa_bit_6"] < 0.01  # zero mantissas: a fitted zero costs almost nothing


def test_cross_entropy_of_a_fair_coin_and_a_sure_thing():
    x = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert abs(cross_entropy(torch.tensor(0.5), x) - 1) < 1e-9
    assert cross_entropy(torch.tensor(1.0), torch.ones(4)) < 1e-3  # clamped, so finite
    assert math.isfinite(cross_entropy(torch.tensor(1.0), x))


def test_load_real_kv_returns_the_tensor_and_metadata(tmp_path):
    kv = torch.randn(2, 2, 1, 16, 8).to(torch.bfloat16)
    save_file({"kv": kv}, tmp_path / "kv.safetensors", metadata={"model": "m", "tokens": "16"})
    got, meta = load_real_kv(str(tmp_path / "kv.safetensors"))
    assert torch.equal(got.view(torch.int16), kv.view(torch.int16)) and meta == {"model": "m", "tokens": "16"}


def test_study_args_parse_load_and_head_the_json(tmp_path):
    kv = torch.randn(1, 2, 1, 16, 8).to(torch.bfloat16)
    save_file({"kv": kv}, tmp_path / "kv.safetensors", metadata={"model": "m"})
    args, got, res = study_args("A study.\nMore.", "default.json", ["--real-kv", str(tmp_path / "kv.safetensors")])
    assert args.out == "default.json" and torch.equal(got.view(torch.int16), kv.view(torch.int16))
    assert res["source"] == {"model": "m"} and res["shape"] == [1, 2, 1, 16, 8] and res["torch"] == torch.__version__
