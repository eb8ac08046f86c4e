"""The main job on the embedded default model: generate with GAACCache, check it against DynamicCache bit for bit,
and show the memory saved."""

from __future__ import annotations

import time

import torch


def run_demo(args) -> None:
    from transformers import DynamicCache

    from .cache import GAACCache
    from .calibration import shipped_calibration
    from .corpus import sample_text
    from .default_model import load_default_model
    from .model_layers import cache_kwarg

    torch.manual_seed(0)
    t0 = time.time()
    model, tokenizer = load_default_model()
    calibration = str(args.calibration or shipped_calibration())
    text = sample_text().text
    words = " ".join(text.split()[: args.prompt_words])
    messages = [{"role": "user", "content": f"Here is a licence text:\n\n{words}\n\nSummarize it in two sentences."}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    n_prompt = inputs["input_ids"].shape[1]
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, output_scores=True, return_dict_in_generate=True)
    name = cache_kwarg(model)

    t = time.time()
    ref = model.generate(**inputs, **kw, **{name: DynamicCache(config=model.config)})
    t_ref = time.time() - t
    cache = GAACCache.from_pretrained(calibration, config=model.config)  # validates the calibration first
    t = time.time()
    out = model.generate(**inputs, **kw, **{name: cache})
    t_gaac = time.time() - t

    same_tokens = torch.equal(out.sequences, ref.sequences)
    same_scores = len(out.scores) == len(ref.scores) and all(
        torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(out.scores, ref.scores))
    reply = tokenizer.decode(out.sequences[0, n_prompt:], skip_special_tokens=True)
    stats = cache.stats()
    b = stats["bytes"]
    print(f"model: {model.config.name_or_path} (BF16 from the 4-bit GGUF), calibration: {calibration}")
    n_new = out.sequences.shape[1] - n_prompt
    print(f"prompt: {n_prompt} tokens; generated {n_new} tokens on this CPU: DynamicCache {t_ref:.1f} s "
          f"({1e3 * t_ref / n_new:.0f} ms/token), GAACCache {t_gaac:.1f} s ({1e3 * t_gaac / n_new:.0f} ms/token, "
          f"{t_gaac / t_ref:.2f}x)")
    print(f"reply: {reply.strip()}")
    print(f"lossless check vs DynamicCache: tokens identical: {same_tokens}; "
          f"every logit bit identical: {same_scores}")
    alloc = stats["allocated_bytes"]["total"]
    print(f"KV cache at {stats['layers'][0]['tokens']} tokens: DynamicCache {stats['bf16_bytes'] / 2**20:.2f} MiB, "
          f"GAACCache {alloc / 2**20:.2f} MiB allocated: {100 * (1 - alloc / stats['bf16_bytes']):.1f}% saved "
          f"(live tiles {b['total'] / 2**20:.2f} MiB: slots {b['slots'] / 2**20:.2f}, raw {b['raw'] / 2**20:.2f}, "
          f"tail {b['tail'] / 2**20:.2f}, block table {b['block_table'] / 2**20:.3f}; "
          f"{100 * stats['saving']:.1f}% saved, ratio {stats['ratio']:.3f}x)")
    shares = stats["mode_shares"]
    print(f"groups: 3-bit {100 * shares['3-bit']:.2f}%, 4-bit {100 * shares['4-bit']:.2f}%, "
          f"raw {100 * shares['raw']:.2f}%; {stats['raw_tiles']} raw tiles of {stats['raw_tiles'] + stats['slots']}")
    print(f"done in {time.time() - t0:.0f} s")
    if not (same_tokens and same_scores):
        raise SystemExit("GAACCache output differs from DynamicCache: lossless contract broken")
