"""Launch the CUDA decode kernel at 1 x 64K (Llama-3.1-8B heads, real-statistics KV, format version 2 as the caches
store it on Hopper: the kernel's format 3; the plan's defaults) a few times, for ncu:

    ncu --clock-control none -k regex:gaac_decode_split -c 1 --section ... python benchmarks/device/profile_cuda_kernel.py [skip|plain]

The argument: a GAAC_SKIP breakdown variant (0: the full kernel) or `plain` (the bit-exact twin over the BF16 KV).
"""

import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, "benchmarks")
from attention import real_kv  # noqa: E402
from format_v2_probe import compress_v2  # noqa: E402

import gaac_cuda  # noqa: E402

arg = sys.argv[1] if len(sys.argv) > 1 else "0"
plain = arg == "plain"
skip = 0 if plain else int(arg)
dev = torch.device("cuda")
pool = load_file(".bench/real_kv_2k.safetensors")["kv"]
k, v = real_kv(pool, 1, 8, 65536, 128, torch.Generator().manual_seed(0))
k, v = k.to(dev), v.to(dev)
packed, layout, info = compress_v2(k, v)
q = torch.randn(1, 32, 128, device=dev).to(torch.bfloat16)
kv_len = torch.full((1,), 65536, dtype=torch.int32, device=dev)
p = (gaac_cuda.plan(1, 8, 4, 128, 65536, dev, plain=True) if plain else
     gaac_cuda.plan(1, 8, 4, 128, 65536, dev, slot_bytes=layout.slot_bytes, format_version=3, skip=skip))
for _ in range(3):
    if plain:
        gaac_cuda.plain_decode_attention(q, k, v, kv_len, None, 128 ** -0.5, p)
    else:
        gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, 128 ** -0.5, layout, p)
torch.cuda.synchronize()
print("ok", info)
