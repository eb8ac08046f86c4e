"""Diagnose a GAACCache-vs-DynamicCache mismatch under sdpa with left padding (tests/test_gaac_gpu_generate.py).

Runs the four generate cases of that test, reruns the DynamicCache reference to see whether it is deterministic, and
checks the CUDA decode kernel against the torch reference decode on every layer's pools.

    PYTHONPATH=$PWD python3 benchmarks/device/diag_gpu_generate.py
"""
import torch

import gaac_hf  # noqa: F401
from gaac_hf.codec import decode_tiles
from gaac_hf.testing import generate_both, gqa_model_and_calibration, same_generation


def diff(a, b):
    tok = (a.sequences != b.sequences).sum().item()
    steps = [i for i, (x, y) in enumerate(zip(a.scores, b.scores))
             if not torch.equal(x.view(torch.int32), y.view(torch.int32))]
    rows = [(i, (a.scores[i] != b.scores[i]).any(-1).nonzero().flatten().tolist()) for i in steps[:3]]
    return f"tokens differ {tok}, score steps differ {len(steps)} first {rows}"


model, calibration = gqa_model_and_calibration("cuda")
for attn in ("sdpa", "gaac"):
    model.set_attn_implementation(attn)
    for pad in (0, 37):
        out, ref, cache = generate_both(model, calibration, batch=2, prompt=301, pad=pad, new_tokens=40, device="cuda")
        print(attn, pad, "same", same_generation(out, ref), diff(out, ref), flush=True)
        if attn == "sdpa" and pad:
            _, ref2, _ = generate_both(model, calibration, batch=2, prompt=301, pad=pad, new_tokens=40, device="cuda")
            print("DynamicCache twice same:", same_generation(ref, ref2), diff(ref, ref2))
            for li in cache.gaac_layers:
                layer = cache.layers[li]
                t, sp, rp = layer._table, layer._slot_pool, layer._raw_pool
                got = layer.decode_table(t, sp, rp)
                c = layer.channels
                full = torch.empty(*t.shape, 16, c, dtype=torch.bfloat16, device=t.device)
                ins = t >= 0
                lead = (*t.shape, c)
                full[ins] = decode_tiles(sp[t[ins].long()], layer._base3.expand(lead)[ins],
                                         layer._base4.expand(lead)[ins], c)
                full[~ins] = rp[(-1 - t[~ins]).long()]
                from gaac_hf.codec import merge_head
                b, n, _, h, tt = t.shape
                want = merge_head(full.permute(0, 2, 3, 1, 4, 5, 6)).reshape(b, 2, h, n * 16, layer.head_dim)
                bad = (got.view(torch.int16) != want.view(torch.int16))
                print("layer", li, "decode mismatches", bad.sum().item(), "of", bad.numel(), "raw tiles",
                      (~ins).sum().item(), "nan in kv", torch.isnan(want.float()).sum().item(), flush=True)
                if bad.any():
                    idx = bad.nonzero()[:5].tolist()
                    print("  at", idx, [(got[tuple(i)].item(), want[tuple(i)].item()) for i in idx])
