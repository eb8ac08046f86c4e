"""The lossless check shared by the GPU, multi-GPU and tensor-parallel tests and the benchmarks that rerun them:
a GQA test model calibrated on its own KV, DynamicCache vs GAACCache generations, bit-identical comparison."""

import torch
from transformers import DynamicCache

from .cache import GAACCache
from .model_layers import cache_kwarg


def gqa_model_and_calibration(device, format_version: int = 1):
    """A 3-layer BF16 Llama (8 query / 2 KV heads, head_dim 128) on `device`, GAAC-calibrated on its own KV (a
    calibration of `format_version`: 2 has even windows, which the caches store as format version 2 on Hopper)."""
    from transformers import AutoModelForCausalLM

    from hf_common.testing import tiny_llama_config

    from .calibrate import calibrate

    torch.manual_seed(0)
    cfg = tiny_llama_config(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                            hidden_size=256)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device).eval()
    gen = torch.Generator().manual_seed(1)
    calibration = calibrate(model, [torch.randint(0, 512, (1024,), generator=gen)], "random ids",
                            format_version=format_version)
    return model, calibration


def generate_both(model, calibration, batch: int, prompt: int, pad: int, new_tokens: int, device, seed: int = 2):
    """Greedy-generate a left-padded random batch with DynamicCache and with GAACCache; return
    `(gaac_out, dynamic_out, cache)` (outputs with `.sequences` and `.scores`)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=gen).to(device)
    mask = torch.ones_like(ids)
    mask[-1, :pad] = 0
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              output_scores=True, return_dict_in_generate=True)
    name = cache_kwarg(model)
    ref = model.generate(ids, **kw, **{name: DynamicCache(config=model.config)})
    cache = GAACCache(model.config, calibration)
    out = model.generate(ids, **kw, **{name: cache})
    return out, ref, cache


def same_generation(a, b) -> bool:
    """Identical tokens and identical bits of every step's scores."""
    return torch.equal(a.sequences, b.sequences) and len(a.scores) == len(b.scores) and all(
        torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a.scores, b.scores))


class KeepingRecorder:
    """`gaac_hf.graph_replay.record_cuda_graph`'s contract on the CPU, for tests of the replay bookkeeping: recording
    keeps the function and runs nothing; a replay runs it and copies its outputs into the output object handed out at
    recording, overwritten in place as a graph's would be: a list of tensors (`outputs="list"`: a compiled graph's) or
    a model output's logits (`"model"`)."""

    def __init__(self, outputs: str = "model"):
        if outputs not in ("model", "list"):
            raise ValueError(f"outputs is 'model' or 'list', not {outputs!r}")
        self.outputs = outputs
        self.recorded = self.replays = 0

    def __deepcopy__(self, memo):  # generate deep-copies its compile config (and a backend partial holding this)
        return self

    def __call__(self, fn, pool):
        import types

        self.recorded += 1
        out = types.SimpleNamespace(logits=None) if self.outputs == "model" else []

        def replay():
            self.replays += 1
            res = fn()
            if self.outputs == "model":
                if out.logits is None:
                    out.logits = res.logits.clone()
                else:
                    out.logits.copy_(res.logits)
            elif not out:
                out.extend(t.clone() if isinstance(t, torch.Tensor) else t for t in res)
            else:
                for o, t in zip(out, res):
                    if isinstance(t, torch.Tensor):
                        o.copy_(t)

        return replay, out, pool
