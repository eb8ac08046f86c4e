"""The slot layout as the kernels take it: from the caller, never restated here.

The bitstream is defined once, in `gaac_hf.format` (`TileLayout`); this package does not import it (gaac_hf calls
triton_ops, not the reverse). A launcher takes any object with the `TileLayout` attributes it reads: `channels`,
`slot_bytes`, `escape_capacity`, `planes_offset`, `tags_offset`, `escape_offset` (the convention of
`gaac_cuda.decode_attention`). The offsets reach the kernels as compile-time constants.
"""


def slot_constants(layout, channels: int, slot_bytes: int | None = None) -> dict:
    """`PLANES`, `TAGS`, `ESC` (byte offsets of a slot's code planes, mode tags and escape area) of `layout`, checked
    against the tile's `channels` and, when given, the slot pool's row size `slot_bytes`."""
    if layout.channels != channels:
        raise ValueError(f"the slot layout is for {layout.channels}-channel tiles, the tensors have {channels}")
    if slot_bytes is not None and slot_bytes != layout.slot_bytes:
        raise ValueError(f"slot pool rows are {slot_bytes} bytes, the slot layout says {layout.slot_bytes}")
    offsets = (layout.planes_offset, layout.tags_offset, layout.escape_offset)
    if any(o % 4 for o in offsets):  # the kernels read these sections as int32 words
        raise ValueError(f"slot section offsets {offsets} must be multiples of 4 bytes")
    return dict(PLANES=layout.planes_offset, TAGS=layout.tags_offset, ESC=layout.escape_offset)
