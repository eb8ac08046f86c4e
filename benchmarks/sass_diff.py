"""Does a kernel change leave the default builds' machine code alone? SASS of every default plan, against a git revision.

Each session's kernel options are off by default, and removals must not touch what runs: the claim is "the SASS of
the default builds is byte-identical". This builds, with nvcc for sm_90a (`pip install nvidia-cuda-nvcc`; no GPU
needed), the split and combine kernels of the plans `gaac_cuda.plan` makes by default at the benchmark shapes — the
compressed kernel (format 3, the caches' Hopper format, at a typical slot size) and its plain twin — from the working
tree's `decode_attention.cu` and from the same file at `--base`, and compares their disassembly (addresses and
headers dropped). `--defines` adds kernel defines to the working tree's side only (what an option changes).

    python benchmarks/sass_diff.py --base HEAD~3 --out benchmarks/results/sass_diff.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import gaac_cuda  # noqa: E402
from gaac_cuda.decode_attention import _SOURCE_FILE  # noqa: E402

SHAPES = (  # (label, query heads, kv heads, head_dim, batch, context, slot bytes of format 3)
    ("32/8/128 1x64K", 32, 8, 128, 1, 65536, 2944), ("32/8/128 1x128K", 32, 8, 128, 1, 131072, 2944),
    ("64/8/128 1x64K", 64, 8, 128, 1, 65536, 2944), ("32/8/128 4x64K", 32, 8, 128, 4, 65536, 2944),
    ("32/8/128 1x16K", 32, 8, 128, 1, 16384, 2944), ("9/3/64 1x64K", 9, 3, 64, 1, 65536, 1472))


def cuobjdump() -> str:
    """Triton's bundled cuobjdump, else one on PATH."""
    try:
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        if os.path.isfile(path):
            return path
    except ImportError:
        pass
    found = shutil.which("cuobjdump")
    if found is None:
        raise RuntimeError("needs cuobjdump (Triton's package carries one)")
    return found


def build(source: Path, options: tuple[str, ...], workdir: Path) -> dict:
    """nvcc -cubin for sm_90a: the SASS text (addresses, encodings and headers dropped), its md5, instruction count
    and the split kernel's registers / spill bytes."""
    key = hashlib.md5("\0".join([str(source), *options]).encode()).hexdigest()[:12]
    cubin = workdir / f"{key}.cubin"
    subprocess.run(["nvcc", "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", *options, "-x", "cu",
                    str(source), "-o", str(cubin)], check=True, capture_output=True)
    dump = subprocess.run([cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    instr = [re.sub(r"/\*[0-9a-f]{4,}\*/", "", line).split(";")[0].strip()
             for line in dump.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line)]
    usage = subprocess.run([cuobjdump(), "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
    split = usage.split("gaac_decode_split")[1] if "gaac_decode_split" in usage else usage
    reg = re.search(r"REG:(\d+)", split)
    local = re.search(r"LOCAL:(\d+)", split)
    text = "\n".join(instr)
    return {"md5": hashlib.md5(text.encode()).hexdigest(), "instructions": len(instr),
            "registers": int(reg.group(1)) if reg else None, "local_bytes": int(local.group(1)) if local else None}


def default_plans(shapes=SHAPES) -> list[tuple[str, tuple[str, ...]]]:
    """(label, kernel options) of the default compressed and twin plans at each shape (planned as on an H200)."""
    out = []
    for label, hq, hkv, d, b, s, slot in shapes:
        gaac = gaac_cuda.plan(b, hkv, hq // hkv, d, s, "cpu", slot_bytes=slot, format_version=3)
        twin = gaac_cuda.plan(b, hkv, hq // hkv, d, s, "cpu", plain=True)
        out += [(f"{label} gaac", gaac.options), (f"{label} twin", twin.options)]
    return out


def compare(base: Path, new: Path, plans, defines: tuple[str, ...] = (), workdir: Path | None = None) -> list[dict]:
    """Per plan: both builds and whether their SASS is the same (each distinct option set built once per side)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="sass_diff_"))
    cache: dict = {}
    rows = []
    extra = tuple(f"-D{d}" for d in defines)
    for label, options in plans:
        sides = {}
        for side, src, opts in (("base", base, tuple(options)), ("new", new, tuple(options) + extra)):
            if (src, opts) not in cache:
                cache[(src, opts)] = build(src, opts, workdir)
            sides[side] = cache[(src, opts)]
        rows.append({"plan": label, "same": sides["base"]["md5"] == sides["new"]["md5"], **sides,
                     "options": list(options)})
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", default="HEAD", help="git revision of the kernel source to compare against")
    p.add_argument("--defines", default="", help="NAME=VALUE,... added to the working tree's builds")
    p.add_argument("--out", default="")
    args = p.parse_args()
    root = Path(__file__).resolve().parent.parent
    rel = Path(_SOURCE_FILE).resolve().relative_to(root)
    workdir = Path(tempfile.mkdtemp(prefix="sass_diff_"))
    base = workdir / "base.cu"
    base.write_text(subprocess.run(["git", "show", f"{args.base}:{rel}"], cwd=root, check=True, capture_output=True,
                                   text=True).stdout)
    defines = tuple(d for d in args.defines.split(",") if d)
    rows = compare(base, Path(_SOURCE_FILE), default_plans(), defines, workdir)
    print(f"| plan | SASS vs {args.base} | instructions (base / new) | registers (base / new) |")
    print("|---|---|---|---|")
    for r in rows:
        b, n = r["base"], r["new"]
        print(f"| {r['plan']} | {'same' if r['same'] else 'DIFFERENT'} | {b['instructions']} / {n['instructions']} | "
              f"{b['registers']} / {n['registers']} |")
    if args.out:
        res = {"base": args.base, "defines": list(defines), "rows": rows,
               "nvcc": subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip()
               .splitlines()[-1],
               "command": " ".join(["python", "benchmarks/sass_diff.py", *sys.argv[1:]])}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    sys.exit(0 if all(r["same"] for r in rows) or defines else 1)


if __name__ == "__main__":
    main()
