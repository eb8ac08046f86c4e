"""How fast can the decode kernel's copy pipeline stream at all, by chunk size, copy kind, ring depth and placement?
(issue 12, session 19)

Session 18-19 measured the compressed kernel's loads-only build at 1x64K at 60.6 us (193 MB: 3.2 TB/s; marginal rate
over 1x64K -> 4x64K 3.56 TB/s) against the plain twin's 4.2 TB/s marginal (268 MB), with the same splits, warps and
2-deep rings; staging the slots by per-lane cp.async or prefetching into L2 made it slower
(`copy_path_probe_s19.json`). This probe takes the attention out: `benchmarks/device/stream_probe.cu` moves units of
the 1x64K shape (8 KV heads x 4096 blocks, a unit = K and V of one head's block) through each warp's shared-memory
ring and reads one word of each, one CTA per SM, consecutive units per warp (a head's blocks, as the kernel's splits
take them). Variants: the twin's BF16 rows (2 x 4 KB per unit, sequential per head) by cp.async or bulk copy; 2,944-
byte slots in the caches' pool order (block, K/V, head) or head-major, by bulk copy or cp.async; K and V slots
adjacent and copied as one 5,888-byte chunk; two units per copy; 3-deep rings; 8 / 12 / 16 warps. Reported: us
(graph replays, rotating over 4 copies of the data so nothing stays in L2) and TB/s of bytes moved.

Session 25 added the decode kernel's own placements: `*_ksmem` stages the K and V slots 4,096 bytes apart in an
18,560-byte ring per warp (the 1x64K plan's shared memory), and `pool_real*` takes each unit's slots where the
benchmark's compressed 1x64K cache (real-statistics KV, `--real-kv`) puts them, through its block table. `--trace`
also times each variant with globaltimer stamps per warp (entry, first unit landed, done), as the kernel's traced
builds do (`probe_runner.finish_by_rank`).

    python benchmarks/stream_probe.py --out benchmarks/results/stream_probe.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.attention import bench_graph  # noqa: E402
from gaac_cuda.nvrtc import get_kernel  # noqa: E402

SOURCE = Path(__file__).resolve().parent / "device" / "stream_probe.cu"
HEADS, BLOCKS, SLOT, ROW_TILE = 8, 4096, 2944, 4096  # 1x64K at head_dim 128; format-3 slot with 64 escape bytes
BUFFERS = 4


class Params(ctypes.Structure):
    _fields_ = [("src", ctypes.c_void_p), ("offs", ctypes.c_void_p), ("sink", ctypes.c_void_p),
                ("per_warp", ctypes.c_int), ("units", ctypes.c_int), ("chunk", ctypes.c_uint),
                ("stage_bytes", ctypes.c_uint), ("chunk_gap", ctypes.c_uint), ("warp_bytes", ctypes.c_uint),
                ("trace", ctypes.c_void_p), ("ring_off", ctypes.c_uint)]


def offsets(layout: str, table: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
    """Byte offsets `[units, chunks]` of each unit's chunks, the chunk size and the span of bytes the layout uses.
    Units are (head, block) in head-major order, so a warp's run of units is a run of one head's blocks. `table`:
    the real layout's block table `[blocks, 2, heads]` (slot indices; raw tiles, < 0, read slot 0 instead)."""
    h = torch.arange(HEADS).repeat_interleave(BLOCKS)
    blk = torch.arange(BLOCKS).repeat(HEADS)
    if layout == "real":
        if table is None:
            raise ValueError("the real layout needs --real-kv (the compressed cache's block table)")
        ent = table.clamp(min=0).long()
        return torch.stack([ent[blk, 0, h], ent[blk, 1, h]], 1) * SLOT, SLOT, (int(ent.max()) + 1) * SLOT
    if layout == "rows":  # the twin: K [H, S, D] and V [H, S, D] BF16, a unit's K rows at (h, blk)
        k = (h * BLOCKS + blk) * ROW_TILE
        return torch.stack([k, k + HEADS * BLOCKS * ROW_TILE], 1), ROW_TILE, 2 * HEADS * BLOCKS * ROW_TILE
    if layout == "pool":  # the caches' slot order: (block, K/V, head)
        k = (blk * 2 * HEADS + h) * SLOT
        return torch.stack([k, k + HEADS * SLOT], 1), SLOT, 2 * HEADS * BLOCKS * SLOT
    if layout == "head_major":  # slots (head, block, K/V): a head's K and V slots adjacent, its blocks in a row
        k = ((h * BLOCKS + blk) * 2) * SLOT
        return torch.stack([k, k + SLOT], 1), SLOT, 2 * HEADS * BLOCKS * SLOT
    if layout == "kv_one":  # head-major, K and V of a unit as one chunk
        return ((h * BLOCKS + blk) * 2 * SLOT)[:, None], 2 * SLOT, 2 * HEADS * BLOCKS * SLOT
    if layout == "two_units":  # head-major, two consecutive units (K, V, K, V) as one chunk
        u = (h * BLOCKS + blk)[::2]
        return (u * 2 * SLOT)[:, None], 4 * SLOT, 2 * HEADS * BLOCKS * SLOT
    raise ValueError(layout)


VARIANTS = {  # label: (layout, cp.async per lane, ring stages, warps per CTA[, cycles of work per unit])
    "rows_cpasync": ("rows", 1, 2, 12),  # the twin's copies
    "rows_bulk": ("rows", 0, 2, 12),
    "rows_cpasync_s3_w8": ("rows", 1, 3, 8),
    "pool_bulk": ("pool", 0, 2, 12),  # the compressed kernel's copies (loads only)
    "pool_cpasync": ("pool", 1, 2, 12),
    "pool_bulk_s3": ("pool", 0, 3, 12),
    "pool_bulk_w16": ("pool", 0, 2, 16),
    "head_major_bulk": ("head_major", 0, 2, 12),
    "kv_one_bulk": ("kv_one", 0, 2, 12),
    "kv_one_bulk_s3": ("kv_one", 0, 3, 12),
    "kv_one_bulk_w16": ("kv_one", 0, 2, 16),
    "two_units_bulk_w8": ("two_units", 0, 2, 8),
    # each warp busy for DELAY cycles per unit once it arrived (the decode kernel spends ~1,700-2,100 per unit at
    # 1x64K): does a third ring stage keep the copies streaming meanwhile?
    "pool_bulk_d1000": ("pool", 0, 2, 12, 1000),
    "pool_bulk_d2000": ("pool", 0, 2, 12, 2000),
    "pool_bulk_d3000": ("pool", 0, 2, 12, 3000),
    "pool_bulk_s3_d1000": ("pool", 0, 3, 12, 1000),
    "pool_bulk_s3_d2000": ("pool", 0, 3, 12, 2000),
    "pool_bulk_s3_d3000": ("pool", 0, 3, 12, 3000),
    "rows_cpasync_d2000": ("rows", 1, 2, 12, 2000),
    "rows_cpasync_s3_w8_d2000": ("rows", 1, 3, 8, 2000),
    "pool_bulk_s3_w8_d2000": ("pool", 0, 3, 8, 2000),
    # session 25: the decode kernel's placements (shared memory as the 1x64K plan lays it out; the real block table)
    "pool_bulk_ksmem": ("pool", 0, 2, 12),
    "pool_real": ("real", 0, 2, 12),
    "pool_real_ksmem": ("real", 0, 2, 12),
    "pool_real_ksmem_hdr64": ("real", 0, 2, 12),  # the kernel's ring after its 64-byte header: not 128-byte aligned
    # every slot 64 bytes off a 128-byte line in global memory (head_dim 64's 1,472 / 1,488-byte slots: every other)
    "pool_real_ksmem_src64": ("real", 0, 2, 12),
    # those slots read as the 128-byte lines around them: from the line start to the slot's end (3,008 bytes), or to
    # the end of its last line (3,072): aligned copies of a few bytes more
    "pool_real_ksmem_src64_head": ("real", 0, 2, 12),
    "pool_real_ksmem_src64_lines": ("real", 0, 2, 12),
}
KERNEL_SMEM = {"chunk_gap": 4096, "warp_bytes": 18560}  # the 1x64K plan's ring: K at 0, V at 4,096; 18,560 B a warp


def real_table(path: str, dev: torch.device) -> torch.Tensor:
    """The block table `[blocks, K/V, heads]` of the 1x64K shape compressed as the benchmarks compress it."""
    from benchmarks.attention import real_kv
    from benchmarks.format_v2_probe import compress_v2
    from safetensors.torch import load_file
    k, v = (t.to(dev) for t in real_kv(load_file(path)["kv"], 1, HEADS, BLOCKS * 16, 128,
                                      torch.Generator().manual_seed(0)))
    packed, layout, _ = compress_v2(k, v)
    if layout.slot_bytes != SLOT:
        raise ValueError(f"the real slots are {layout.slot_bytes} bytes, the probe assumes {SLOT}")
    return packed[2][0, :, :, :, 0].cpu()  # [B, n, 2, H, T] -> [n, 2, H]


def phases(tr: torch.Tensor, per_warp: int) -> dict:
    """µs after the first warp's entry: first unit landed and done (p50, max over the working warps), the streaming
    pace per unit."""
    st = tr.view(-1, 3).cpu().double()
    live = st[:, 2] > 0
    t0 = st[live, 0].min()
    ready, done = (st[live, 1] - t0) / 1e3, (st[live, 2] - t0) / 1e3
    r = lambda x, f: round(float(x.quantile(f)), 2)  # noqa: E731
    return {"first_ready_p50_us": r(ready, 0.5), "first_ready_max_us": r(ready, 1.0), "done_p50_us": r(done, 0.5),
            "done_p90_us": r(done, 0.9), "done_max_us": r(done, 1.0),
            "stream_us_per_unit_p50": round(float((done - ready).median()) / max(per_warp - 1, 1), 3)}


def geometry(label: str, table: torch.Tensor | None = None) -> dict:
    """A variant's copies and shared memory: byte offsets `[units, chunks]`, chunk bytes, the span of source bytes,
    the bytes between a stage's chunks, per warp and before its ring, and the CTA's shared memory."""
    layout, _, stages, warps, *_ = VARIANTS[label]
    offs, chunk, span = offsets(layout, table)
    if label.endswith("_src64"):
        offs, span = offs + 64, span + 64
    elif "_src64_" in label:  # the line-aligned copies of the slots at +64: from the line start
        chunk = chunk + 64 if label.endswith("_head") else chunk + 128
        span += 128
    ksmem = "_ksmem" in label
    gap = KERNEL_SMEM["chunk_gap"] if ksmem else chunk
    stage = -(-offs.shape[1] * gap // 128) * 128
    warp_bytes = KERNEL_SMEM["warp_bytes"] if ksmem else stages * stage
    return {"offs": offs, "chunk": chunk, "span": span, "gap": gap, "stage": stage, "warp_bytes": warp_bytes,
            "ring_off": 64 if label.endswith("_hdr64") else 0, "smem": warps * warp_bytes + warps * stages * 8}


def phase_cells(ph: dict | None) -> str:
    """Table cells of a traced run's phases (`phases` here, or the kernel's `finish_by_rank` phases with its done
    times merged in): first unit ready p50 / max, per-unit pace, done p50 / max."""
    if not ph:
        return " | | "
    return (f"{ph['first_ready_p50_us']} / {ph['first_ready_max_us']} | {ph['stream_us_per_unit_p50']} | "
            f"{ph['done_p50_us']} / {ph['done_max_us']}")


def run(label: str, dev: torch.device, src: torch.Tensor | None, sms: int, table=None, trace=False,
        srcs: list | None = None) -> dict:
    """Time (and with `trace`, stamp) one variant over BUFFERS copies of `src` one after the other, or over the
    separate tensors `srcs` (each laid out as `table` says: the compressed cache's own slot pools)."""
    layout, cpasync, stages, warps, *delay = VARIANTS[label]
    delay = delay[0] if delay else 0
    geo = geometry(label, table)
    offs, chunk, span, gap, stage = geo["offs"], geo["chunk"], geo["span"], geo["gap"], geo["stage"]
    warp_bytes, ring_off, smem = geo["warp_bytes"], geo["ring_off"], geo["smem"]
    units, chunks = offs.shape
    kernel = get_kernel(SOURCE.read_text(), [f"-DCHUNKS={chunks}", f"-DSTAGES={stages}", f"-DCPASYNC={cpasync}",
                                             f"-DDELAY={delay}"],
                        "stream_probe", dev)
    per_warp = -(-units // (sms * warps))
    stride = -(-span // 4096) * 4096
    if srcs is None:
        offs_d = [(offs + i * stride).to(dev) for i in range(BUFFERS)]
        ptrs = [src.data_ptr()] * BUFFERS
    else:
        offs_d, ptrs = [offs.to(dev)] * len(srcs), [x.data_ptr() for x in srcs]
    sink = torch.zeros(sms * warps * 32, dtype=torch.int32, device=dev)
    prms = [Params(ptr, o.data_ptr(), sink.data_ptr(), per_warp, units, chunk, stage, gap, warp_bytes, None, ring_off)
            for ptr, o in zip(ptrs, offs_d)]

    def launch(i):
        kernel.launch(sms, warps * 32, smem, prms[i])

    launch(0)
    torch.cuda.synchronize()
    us = bench_graph(launch, len(prms))
    moved = units * chunks * chunk
    out = {"us": round(us, 2), "tb_per_s": round(moved / us / 1e6, 3), "bytes": moved, "chunk": chunk,
           "chunks_per_unit": chunks, "units_per_warp": per_warp, "stages": stages, "warps": warps,
           "cp_async": bool(cpasync), "delay_cycles": delay, "smem": smem, "registers": kernel.registers}
    if trace:  # stamps of the third of three back-to-back launches (each on its own buffer)
        tr = torch.zeros(sms * warps * 3, dtype=torch.int64, device=dev)
        traced = [Params(ptr, o.data_ptr(), sink.data_ptr(), per_warp, units, chunk, stage, gap, warp_bytes,
                         tr.data_ptr(), ring_off) for ptr, o in zip(ptrs, offs_d)]
        for i in range(3):
            kernel.launch(sms, warps * 32, smem, traced[i % len(traced)])
        torch.cuda.synchronize()
        out["phases"] = phases(tr, per_warp)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="benchmarks/results/stream_probe.json")
    ap.add_argument("--real-kv", default=None, help="captured KV (benchmarks/capture_real_kv.py): the real layout")
    ap.add_argument("--trace", action="store_true", help="also globaltimer stamps per warp (phases)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    table = real_table(args.real_kv, dev) if args.real_kv else None
    span = max(offsets(v[0], table)[2] for v in VARIANTS.values() if v[0] != "real" or table is not None)
    src = torch.randint(0, 255, (BUFFERS * (-(-span // 4096) * 4096),), dtype=torch.uint8, device=dev)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": sms, "rows": {},
           "command": "python " + " ".join(sys.argv)}
    for label in args.variants.split(","):
        t0 = time.time()
        try:
            res["rows"][label] = run(label, dev, src, sms, table, args.trace)
        except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
            res["rows"][label] = {"error": f"{type(e).__name__}: {e}"[:400]}
        print(f"{label:<22} {res['rows'][label]} ({time.time() - t0:.0f}s)", flush=True)
    print("\n| variant | chunk B x per unit | stages x warps | work cycles | us | TB/s | first ready p50 / max | "
          "us per unit | done p50 / max |\n|---|---|---|---|---|---|---|---|---|")
    for label, r in res["rows"].items():
        if "us" in r:
            print(f"| {label} | {r['chunk']} x {r['chunks_per_unit']} | {r['stages']} x {r['warps']} | "
                  f"{r['delay_cycles']} | {r['us']} | {r['tb_per_s']} | {phase_cells(r.get('phases'))} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
