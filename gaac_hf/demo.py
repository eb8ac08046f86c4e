"""The main job on the embedded default model: real KV through the GAAC codec, checked bit for bit."""

from __future__ import annotations

import time

import torch


def run_demo(args) -> None:
    from .calibrate import complete_blocks, tile_bases
    from .calibration import GAACCalibration
    from .capture import capture_kv
    from .cli import shipped_calibration
    from .codec import decode_tiles, encode_tiles
    from .corpus import sample_text, token_prompts
    from .default_model import load_default_model
    from .format import BLOCK_TABLE_ENTRY_BYTES, TileLayout

    t0 = time.time()
    model, tokenizer = load_default_model()
    calibration = GAACCalibration.from_pretrained(str(args.calibration or shipped_calibration()))
    calibration.check_model(model.config)
    cfg = calibration.config
    print(f"model {model.config.name_or_path}: {cfg.num_hidden_layers} layers, {cfg.num_kv_heads} KV heads, "
          f"head_dim {cfg.head_dim}; calibration: {cfg.corpus_tokens} tokens of {cfg.corpus}")

    text = sample_text()
    prompt = token_prompts(tokenizer, text.text, args.prompt_tokens, 1)[0]
    kv = capture_kv(model, prompt)  # [L, 2, H, T, D], as DynamicCache stores it
    print(f"captured the KV cache of a {prompt.numel()}-token prompt ({text.description})")

    tiles = complete_blocks(kv)  # [L, 2, H, blocks, tiles, 16, C]
    b3, b4 = tile_bases(calibration.base3).unsqueeze(3), tile_bases(calibration.base4).unsqueeze(3)
    enc = encode_tiles(tiles, b3, b4, cfg.escape_capacity)
    decoded = decode_tiles(enc.slots, b3, b4, cfg.tile_channels)
    exact = torch.where(enc.fits[..., None, None], decoded.view(torch.int16), tiles.view(torch.int16))
    assert torch.equal(exact, tiles.view(torch.int16)), "GAAC round trip is not bit-exact"
    lossless = torch.equal(decoded.view(torch.int16)[enc.fits], tiles.view(torch.int16)[enc.fits])

    layout = TileLayout(cfg.tile_channels, cfg.escape_capacity)
    n_tiles = enc.fits.numel()
    n_slot = int(enc.fits.sum())
    bf16_bytes = n_tiles * layout.raw_bytes
    gaac_bytes = n_slot * layout.slot_bytes + (n_tiles - n_slot) * layout.raw_bytes + n_tiles * BLOCK_TABLE_ENTRY_BYTES
    modes = torch.bincount(enc.modes.reshape(-1).long(), minlength=3).double()
    modes = modes / modes.sum()
    print(f"lossless check: {n_slot} of {n_tiles} tiles in slots, every bit of every value identical: {lossless}")
    print(f"groups: 3-bit {100 * modes[0]:.2f}%, 4-bit {100 * modes[1]:.2f}%, raw {100 * modes[2]:.2f}%")
    print(f"KV of finalized blocks: BF16 {bf16_bytes / 2**20:.2f} MiB -> GAAC {gaac_bytes / 2**20:.2f} MiB "
          f"({8 * gaac_bytes / (n_tiles * layout.elements):.3f} bit/element, "
          f"{100 * (1 - gaac_bytes / bf16_bytes):.1f}% saved, ratio {bf16_bytes / gaac_bytes:.3f}x)")
    print(f"done in {time.time() - t0:.0f} s")
