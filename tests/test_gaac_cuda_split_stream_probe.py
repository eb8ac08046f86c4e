"""(GAAC kernel design probes) benchmarks/cuda_split_stream_probe.py: its variants fit in shared memory and its
kernel source compiles for sm_90a (nvcc from `nvidia-cuda-nvcc`); it runs on the H200 only."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import cuda_split_stream_probe as probe  # noqa: E402


def test_variants_fit_and_options_are_checked():
    assert probe.VARIANTS and all(probe.smem_per_cta(u, s, w) <= 227 * 1024 for u, s, _, w in probe.VARIANTS)
    assert {u for u, *_ in probe.VARIANTS} == {4096, 8192, 16384, 32768}
    with pytest.raises(ValueError, match="multiple of 512"):
        probe.options(1000, 2, False, 4)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (CUDA 12.8+)")
@pytest.mark.parametrize("variant", [(4096, 2, False, 4), (16384, 3, True, 1)])
def test_probe_kernel_compiles_for_sm90a(variant, tmp_path):
    src = tmp_path / "probe.cu"
    src.write_text(probe.SOURCE)
    subprocess.run(["nvcc", "-cubin", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", *probe.options(*variant),
                    "-x", "cu", str(src), "-o", str(tmp_path / "p.cubin")], check=True, capture_output=True)
    assert (tmp_path / "p.cubin").stat().st_size > 0
