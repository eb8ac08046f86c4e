"""One rank of a tensor-parallel generate (run by torchrun from tests/test_gaac_tensor_parallel.py): GAACCache vs
DynamicCache on a model loaded with tp_plan="auto"; writes this rank's verdict as JSON."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import GAACCalibration
from gaac_hf.testing import generate_both, same_generation


def main(model_dir, calibration_dir, out_dir, attn):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, tp_plan="auto",
                                                 attn_implementation=attn).eval()
    rank = int(os.environ["RANK"])
    out, ref, cache = generate_both(model, GAACCalibration.from_pretrained(calibration_dir), batch=2, prompt=75,
                                    pad=9, new_tokens=24, device=model.device)
    layer = cache.layers[cache.gaac_layers[0]]
    verdict = {
        "rank": rank,
        "lossless": same_generation(out, ref),
        "local_kv_heads": layer.num_kv_heads,
        "slots": cache.stats()["slots"],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdict, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
    # tear the process group down while the interpreter is alive: left to interpreter exit, gloo's worker threads can
    # abort the process ("terminate called without an active exception", pytorch/pytorch#190489)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
