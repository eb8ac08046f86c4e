"""Launch the CUDA decode kernel on the slot-format prototypes at 1 x 64K (Llama-3.1-8B heads, real-statistics KV),
for ncu:

    ncu --clock-control none -k regex:gaac_decode_split -c 1 --section ... \
        python benchmarks/device/profile_format_probe.py FORMAT   # 1 or 3 (format version 2 in fragment order)
"""

import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, ".")
import gaac_cuda  # noqa: E402
from benchmarks.attention import compress, real_kv  # noqa: E402
from benchmarks.format_v2_probe import compress_v2  # noqa: E402
from gaac_hf.format import TileLayout  # noqa: E402

fmt = int(sys.argv[1]) if len(sys.argv) > 1 else 3
dev = torch.device("cuda")
pool = load_file(".bench/real_kv_2k.safetensors")["kv"]
k, v = real_kv(pool, 1, 8, 65536, 128, torch.Generator().manual_seed(0))
k, v = k.to(dev), v.to(dev)
if fmt == 1:
    packed, info = compress(k, v)
    layout = TileLayout(128, info["escape_capacity"])
else:
    packed, layout, info = compress_v2(k, v)
q = torch.randn(1, 32, 128, device=dev).to(torch.bfloat16)
kv_len = torch.full((1,), 65536, dtype=torch.int32, device=dev)
p = gaac_cuda.plan(1, 8, 4, 128, 65536, dev, slot_bytes=layout.slot_bytes, format_version=fmt)
for _ in range(3):
    gaac_cuda.decode_attention(q, *packed[:5], packed[5], packed[6], kv_len, None, 128 ** -0.5, layout, p)
torch.cuda.synchronize()
print("ok", fmt, info)
