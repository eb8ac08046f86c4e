"""A random-weight AWQ-GEMM 4-bit checkpoint of any causal-LM config, written without a download or a quantizer.

Every `nn.Linear` of the decoder (all but the output embedding, which transformers' AWQ integration leaves in
16 bit) gets random N(0, std) weights, quantized round-to-nearest per group of `group_size` input channels with an
asymmetric 4-bit grid (scale, zero point), and stored in the AWQ GEMM layout that transformers' AWQ integration
(backend gptqmodel) loads:

- `qweight`: int32 [in_features, out_features / 8]; `qzeros`: int32 [in_features / group_size, out_features / 8];
  8 nibbles per int32, nibble i holding output column `AWQ_PACK_ORDER[i]` of its group of 8 columns;
- `scales`: FP16 [in_features / group_size, out_features];
- weight[out, in] = (q[in, out] - zero[in // group_size, out]) * scale[in // group_size, out].

Used by `tests/test_gaac_awq.py` (tiny Llama, CPU) and `benchmarks/awq_h200.py` (Llama-3.1-8B architecture, on the GPU).
"""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

BITS = 4
AWQ_PACK_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # the interleave of the AWQ GEMM kernels
_SHIFTS = torch.arange(8, dtype=torch.int64) * BITS


def quantize_rtn(weight: torch.Tensor, group_size: int):
    """Round-to-nearest asymmetric 4-bit quantization of a [out, in] weight, grouped along `in`.

    Returns `(q [in, out], zeros [in // group_size, out], scales [in // group_size, out] FP16)`, integers in 0..15.
    """
    w = weight.float().t()
    n_in, n_out = w.shape
    if n_in % group_size or n_out % 8:
        raise ValueError(f"AWQ GEMM needs in_features % group_size == 0 and out_features % 8 == 0; got a "
                         f"[{n_out}, {n_in}] weight and group_size {group_size}")
    g = w.reshape(n_in // group_size, group_size, n_out)
    lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
    scales = ((hi - lo) / (2 ** BITS - 1)).clamp(min=1e-6).half()
    s = scales.float()
    zeros = (-lo / s).round().clamp(0, 2 ** BITS - 1)
    q = (g / s[:, None] + zeros[:, None]).round().clamp(0, 2 ** BITS - 1)
    return q.reshape(n_in, n_out).int(), zeros.int(), scales


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """Pack int values 0..15 [rows, cols] into int32 [rows, cols / 8] in the AWQ nibble order."""
    rows, cols = values.shape
    nibbles = values.reshape(rows, cols // 8, 8)[..., AWQ_PACK_ORDER].long()
    word = (nibbles << _SHIFTS.to(values.device)).sum(-1)
    return torch.where(word >= 2 ** 31, word - 2 ** 32, word).int()  # two's complement: bit 31 is nibble 7's top bit


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """The inverse of `pack_awq`: int32 [rows, cols / 8] -> int values 0..15 [rows, cols]."""
    rows = words.shape[0]
    nibbles = (words.long()[..., None] >> _SHIFTS.to(words.device)) & (2 ** BITS - 1)
    columns = nibbles[..., torch.argsort(torch.tensor(AWQ_PACK_ORDER))]
    return columns.reshape(rows, -1).int()


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                   group_size: int) -> torch.Tensor:
    """The FP32 [out, in] weight that an AWQ-GEMM triple stands for."""
    q, z = unpack_awq(qweight).float(), unpack_awq(qzeros).float()
    n_in, n_out = q.shape
    w = (q.reshape(n_in // group_size, group_size, n_out) - z[:, None]) * scales.float()[:, None]
    return w.reshape(n_in, n_out).t()


def quantization_config(group_size: int) -> dict:
    """The `quantization_config` entry of config.json for an AWQ GEMM checkpoint."""
    return {"quant_method": "awq", "bits": BITS, "group_size": group_size, "zero_point": True, "version": "gemm"}


def write_awq_checkpoint(config, path: str, *, group_size: int = 128, device: str | torch.device = "cpu",
                         seed: int = 0, std: float = 0.02) -> str:
    """Write a random-weight AWQ-GEMM checkpoint of `config` (a transformers model config) to folder `path`.

    Norm weights are 1, every other tensor N(0, std); weights are drawn and quantized on `device`, one tensor at a
    time, so the full-precision model never exists in memory.
    """
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    output = skeleton.get_output_embeddings()
    linears = {name for name, m in skeleton.named_modules() if isinstance(m, nn.Linear) and m is not output}
    tied = set(getattr(skeleton, "_tied_weights_keys", None) or ()) if config.tie_word_embeddings else set()
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, p in skeleton.state_dict().items():
        if name in tied:
            continue
        module, leaf = name.rsplit(".", 1)
        if "norm" in module.split(".")[-1]:
            tensors[name] = torch.ones(p.shape, dtype=torch.bfloat16)
            continue
        w = torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0, std, generator=gen)
        if module in linears and leaf == "weight":
            q, zeros, scales = quantize_rtn(w, group_size)
            tensors[f"{module}.qweight"] = pack_awq(q).cpu()
            tensors[f"{module}.qzeros"] = pack_awq(zeros).cpu()
            tensors[f"{module}.scales"] = scales.cpu()
        else:
            tensors[name] = w.to(torch.bfloat16).cpu()
    del skeleton
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = copy.deepcopy(config)
    config.quantization_config = quantization_config(group_size)
    config.save_pretrained(path)
    return path
