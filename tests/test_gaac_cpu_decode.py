"""The fast CPU decoder (gaac_hf/cpu_decode.py) against the reference decoder, bit for bit."""

import pytest
import torch
from gaac_triton_cases import realistic_kv

from gaac_hf.codec import decode_tiles, encode_tiles
from gaac_hf.cpu_decode import decode_slots


@pytest.mark.parametrize("d, kind, capacity", [(64, "mixed", 32), (64, "mixed", 16), (128, "mixed", 16),
                                               (128, "mixed", 64), (64, "raw", 1280), (64, "4bit", 256),
                                               (128, "raw", 2560)])
def test_decode_slots_equals_reference(d, kind, capacity):
    gen = torch.Generator().manual_seed(d + capacity)
    k, _, b3, b4 = realistic_kv(1, 3, 16 * 37, d, gen, kind)
    tiles = k.reshape(3, 37, 16, d)
    bases3 = b3[0][:, None, :].expand(3, 37, d).reshape(-1, d)
    bases4 = b4[0][:, None, :].expand(3, 37, d).reshape(-1, d)
    enc = encode_tiles(tiles.reshape(-1, 16, d), bases3, bases4, capacity)
    fits = enc.fits
    assert fits.any()
    got = decode_slots(enc.slots[fits], bases3[fits], bases4[fits], d)
    ref = decode_tiles(enc.slots[fits], bases3[fits], bases4[fits], d)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(got.view(torch.int16), tiles.reshape(-1, 16, d)[fits].view(torch.int16))


def test_decode_slots_of_nothing():
    out = decode_slots(torch.zeros(0, 1472, dtype=torch.uint8), torch.zeros(0, 64, dtype=torch.uint8),
                       torch.zeros(0, 64, dtype=torch.uint8), 64)
    assert out.shape == (0, 16, 64) and out.dtype == torch.bfloat16
