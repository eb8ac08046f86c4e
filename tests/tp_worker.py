"""One rank of a tensor-parallel generate (run by torchrun from tests/test_tensor_parallel.py): GAACCache vs
DynamicCache on a model loaded with tp_plan="auto"; writes this rank's verdict as JSON."""

import json
import os
import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import gaac_hf  # noqa: F401  (registers "gaac")
from gaac_hf import GAACCache, GAACCalibration
from gaac_hf.demo import cache_kwarg


def main(model_dir, calibration_dir, out_dir, attn):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, tp_plan="auto",
                                                 attn_implementation=attn).eval()
    rank = int(os.environ["RANK"])
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (2, 75), generator=gen).to(model.device)
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    kw = dict(attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False, output_scores=True,
              return_dict_in_generate=True)
    name = cache_kwarg(model)
    ref = model.generate(ids, **kw, **{name: DynamicCache(config=model.config)})
    cache = GAACCache(model.config, GAACCalibration.from_pretrained(calibration_dir))
    out = model.generate(ids, **kw, **{name: cache})
    layer = cache.layers[cache.gaac_layers[0]]
    verdict = {
        "rank": rank,
        "tokens_equal": torch.equal(out.sequences, ref.sequences),
        "scores_equal": all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                            for a, b in zip(out.scores, ref.scores)),
        "local_kv_heads": layer.num_kv_heads,
        "slots": cache.stats()["slots"],
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(verdict, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
