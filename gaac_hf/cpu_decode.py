"""The CPU decoders: table entries / slots -> BF16 tiles, bit-identical to `codec.decode_tiles` (the oracle).

* `expand_into` (what the caches call): table entries `[B, n, 2, H, T]` -> tiles written straight into a strided
  output, e.g. the `[2, B, H, S, D]` buffer whose halves the cache hands out as K and V (no permute, no concatenation
  afterwards). It runs the C kernel `cpu_decode.c` (one pass per tile, vectorized by the compiler, OpenMP over
  tiles), built with the system C compiler on first use and cached under `~/.cache/gaac_hf/cpu_kernel/` (built for
  the process alone where that folder cannot be written); where no compiler works (or `GAAC_HF_CPU_KERNEL=0`) it
  falls back, silently, to the torch decoder below, bit-identical.
* `decode_slots`: the torch decoder, written to run: it works on bytes (uint8 arithmetic wraps mod 256 exactly as
  the format's exponent code does) and unpacks the bit planes eight elements at a time with a 256-entry table that
  spreads the bits of a byte over the byte lanes of an int64 (SWAR). The escape area is read only when some tile
  has 4-bit or raw groups. It trusts its input: slots come from the cache's own encoder (the oracle checks mode tags
  for corruption; the C kernel refuses corrupt slots too, with a `ValueError`).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from .format import BLOCK_TOKENS, CODE_PLANES_IN_STREAM, TileLayout

# byte v -> int64 whose byte lane i is bit i of v; and for a pair of bytes (lo | hi << 8): lane i holds bit i of lo
# in bit 0 and bit i of hi in bit 1 (planes 0 and 1 of a group in one lookup)
_SPREAD = torch.tensor([sum(((v >> i) & 1) << (8 * i) for i in range(8)) for v in range(256)], dtype=torch.int64)
_SPREAD2 = (_SPREAD[torch.arange(65536) & 0xFF] | (_SPREAD[torch.arange(65536) >> 8] << 1)).contiguous()


def _spread(b: torch.Tensor) -> torch.Tensor:
    return _SPREAD.index_select(0, b.reshape(-1).long()).reshape(b.shape)


def decode_slots(slots: torch.Tensor, base3: torch.Tensor, base4: torch.Tensor, channels: int) -> torch.Tensor:
    """Slots uint8 `[N, slot_bytes]` with per-tile bases uint8 `[N, C]` -> BF16 tiles `[N, 16, C]`."""
    n = slots.shape[0]
    layout = TileLayout(channels, slots.shape[-1] - TileLayout(channels, 0).fixed_bytes)
    c, g = channels, layout.groups
    if slots.device != _SPREAD.device:
        raise ValueError("decode_slots is the CPU decoder")
    planes = slots[:, layout.planes_offset:layout.tags_offset].reshape(n, CODE_PLANES_IN_STREAM, g)
    tags = slots[:, layout.tags_offset:layout.tags_end].reshape(n, 2, layout.tag_plane_bytes)
    mode_bits = _spread(tags).view(torch.uint8).reshape(n, 2, g)  # [N, 2 (wide, raw), G] of 0/1
    wide, raw = mode_bits[:, 0], mode_bits[:, 1]
    pair = planes[:, 0].to(torch.int32) | (planes[:, 1].to(torch.int32) << 8)
    code = _SPREAD2.index_select(0, pair.reshape(-1)).reshape(n, g) | (_spread(planes[:, 2]) << 2)  # 8 lanes
    if bool(wide.any()):  # 4-bit or raw groups: their escape bytes (planes 3..7), packed in group order
        weights = wide.to(torch.int32) + 4 * raw.to(torch.int32)
        offsets = (torch.cumsum(weights, -1) - weights).long()
        # a slot's escapes fit its capacity, so offset + 4 stays inside the area padded by 5
        area = torch.nn.functional.pad(slots[:, layout.escape_offset:], (0, 5))
        code |= _spread(torch.gather(area, 1, offsets) * wide) << 3
        rows = raw.any(-1).nonzero().reshape(-1)  # raw groups are rare: only their tiles
        if rows.numel():
            r, at, sub = raw[rows], offsets[rows], area[rows]
            extra = torch.zeros_like(code[rows])
            for j in range(1, 5):
                extra |= _spread(torch.gather(sub, 1, at + j) * r) << (3 + j)
            code.index_copy_(0, rows, code[rows] | extra)
    b3 = base3.expand(n, c).repeat(1, 2)
    b4 = base4.expand(n, c).repeat(1, 2)
    base = torch.where(raw.bool(), 0, torch.where(wide.bool(), b4, b3)).to(torch.uint8)
    # (code + base) mod 256 per element (uint8 wraps), then group order (g = h * C + c, lane i = token 8h + i)
    # -> token-major [N, 16, C]
    exp = (code.view(torch.uint8).reshape(n, g, 8) + base[:, :, None]).reshape(n, 2, c, 8).transpose(2, 3)
    exp = exp.reshape(n, BLOCK_TOKENS, c).to(torch.int16)
    # sign+mantissa byte, sign-extended: bit 15 = sign, bits 0-6 = mantissa after the mask
    sm = slots[:, :layout.planes_offset].view(torch.int8).reshape(n, BLOCK_TOKENS, c).to(torch.int16)
    return ((sm & -0x7F81) | (exp << 7)).view(torch.bfloat16)  # -0x7F81 = 0x807F as int16


# --- the C kernel ------------------------------------------------------------------------------------------------
KERNEL_SOURCE = Path(__file__).with_name("cpu_decode.c")
KERNEL_ENV = "GAAC_HF_CPU_KERNEL"  # "0": always the torch decoder
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
_ERRORS = {1: "a block-table entry points outside its pool", 2: "corrupt GAAC slot: a mode tag has the raw bit "
           "without the wide bit", 3: "corrupt GAAC slot: its mode tags need more escape bytes than the slot holds"}
_ARGS = ("p", "i", "i", "i", "i", "i", "i", "p", "i", "i", "i", "p", "i", "p", "p", "i", "p", "i", "i", "i", "i",
         "i", "i", "i")


def _machine_key() -> str:
    """What the compiled kernel depends on besides its source and flags: `-march=native` means this CPU."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return f"{platform.machine()} {platform.system()} {flags}"


def build_kernel(compiler: str | None = None) -> Path:
    """Compile `cpu_decode.c` (cached by source, flags, compiler and CPU); raises if it cannot."""
    cc = compiler or os.environ.get("CC") or "gcc"
    if shutil.which(cc) is None:
        raise FileNotFoundError(f"no C compiler {cc!r}")
    source = KERNEL_SOURCE.read_text()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256("\0".join([source, *CFLAGS, version, _machine_key()]).encode()).hexdigest()[:24]
    from .default_model import cache_dir

    path = cache_dir() / "cpu_kernel" / f"cpu_decode-{key}.so"
    if path.is_file():
        return path
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        build_dir = tempfile.TemporaryDirectory(dir=path.parent)
    except OSError:  # a cache that cannot be written (read-only home): build for this process only
        folder = Path(tempfile.mkdtemp(prefix="gaac_hf_cpu_kernel-"))
        atexit.register(shutil.rmtree, folder, True)
        path = folder / path.name
        build_dir = tempfile.TemporaryDirectory(dir=folder)
    with build_dir as tmp:
        out = Path(tmp) / path.name
        subprocess.run([cc, *CFLAGS, str(KERNEL_SOURCE), "-o", str(out)], capture_output=True, check=True,
                       timeout=300)
        os.replace(out, path)  # atomic: a concurrent build of the same key writes the same file
    return path


@functools.lru_cache(maxsize=None)
def kernel():
    """The C kernel's `gaac_expand`, or None where it cannot be built or loaded (then the torch decoder runs)."""
    if os.environ.get(KERNEL_ENV, "1") == "0":
        return None
    try:
        fn = ctypes.CDLL(str(build_kernel())).gaac_expand
    except (OSError, subprocess.SubprocessError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p if a == "p" else ctypes.c_int64 for a in _ARGS]
    fn.restype = ctypes.c_int
    return fn


@functools.lru_cache(maxsize=None)
def _slot_offsets(channels: int, slot_bytes: int) -> tuple[int, int]:
    """`(slot_bytes, escape_offset)` of a pool's slots (checked against the format), once per shape."""
    layout = TileLayout.of_slot_bytes(channels, slot_bytes)
    return layout.slot_bytes, layout.escape_offset


def _expand_torch(table, slot_pool, raw_pool, base3, base4, out) -> None:
    """`expand_into` through `decode_slots`: every entry decoded as a slot (raw entries, a small share, read slot 0
    and are overwritten after)."""
    channels = raw_pool.shape[-1]
    p = base3.shape[0]
    flat = table.reshape(-1)
    n = flat.numel() // max(p, 1)
    idx = flat.clamp(min=0).long()
    slots = slot_pool.index_select(0, idx) if slot_pool.shape[0] else \
        torch.zeros(idx.numel(), slot_pool.shape[1], dtype=torch.uint8)
    b3 = base3.unsqueeze(0).expand(n, p, channels).reshape(-1, channels)
    b4 = base4.unsqueeze(0).expand(n, p, channels).reshape(-1, channels)
    tiles = decode_slots(slots, b3, b4, channels)
    raw = (flat < 0).nonzero().reshape(-1)
    if raw.numel():
        tiles.index_copy_(0, raw, raw_pool.index_select(0, -1 - flat[raw].long()))
    out.copy_(tiles.reshape(out.shape))


def expand_into(table: torch.Tensor, slot_pool: torch.Tensor, raw_pool: torch.Tensor, base3: torch.Tensor,
                base4: torch.Tensor, out: torch.Tensor) -> None:
    """Decode table entries int32 `[B, n, A, H, T]` (slot >= 0, else -1 - raw index) with bases uint8
    `[A * H * T, C]` into `out`, a BF16 view `[B, n, A, H, T, 16, C]` with unit channel stride (any other strides:
    the caller's layout). Slots uint8 `[n_slots, slot_bytes]`, raw tiles BF16 `[n_raw, 16, C]`, all on the CPU."""
    b, n, a, h, t = table.shape
    c = raw_pool.shape[-1]
    if out.shape != (b, n, a, h, t, 16, c) or out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"out must be a BF16 [B, n, A, H, T, 16, {c}] view with unit channel stride; got "
                         f"{out.dtype} {tuple(out.shape)} strides {out.stride()}")
    if base3.shape != (a * h * t, c) or base4.shape != base3.shape:
        raise ValueError(f"bases must be [{a * h * t}, {c}]; got {tuple(base3.shape)} / {tuple(base4.shape)}")
    if out.numel() == 0:
        return
    fn = kernel() if not (table.is_cuda or out.is_cuda) else None
    if fn is None:
        _expand_torch(table, slot_pool, raw_pool, base3, base4, out)
        return
    p = a * h * t
    packed = all(st == want for st, want, size in zip(table.stride()[1:], (p, h * t, t, 1), table.shape[1:])
                 if size > 1)
    if table.dtype != torch.int32 or not packed:
        table = table.to(torch.int32).contiguous()
    slot_pool, raw_pool, base3, base4 = (x.contiguous() for x in (slot_pool, raw_pool, base3, base4))
    if slot_pool.dtype != torch.uint8 or base3.dtype != torch.uint8 or base4.dtype != torch.uint8 \
            or raw_pool.dtype != torch.bfloat16:
        raise TypeError(f"slots and bases must be uint8 and raw tiles BF16; got {slot_pool.dtype}, {base3.dtype}, "
                        f"{base4.dtype}, {raw_pool.dtype}")
    slot_bytes, escape_offset = _slot_offsets(c, slot_pool.shape[-1])
    s = out.stride()
    status = fn(table.data_ptr(), b, n, a, h, t, table.stride(0), slot_pool.data_ptr(), slot_pool.shape[0],
                slot_bytes, escape_offset, raw_pool.data_ptr(), raw_pool.shape[0], base3.data_ptr(),
                base4.data_ptr(), c, out.data_ptr(), s[0], s[1], s[2], s[3], s[4], s[5], torch.get_num_threads())
    if status:
        raise ValueError(_ERRORS.get(status, f"the CPU decoder failed ({status})"))
