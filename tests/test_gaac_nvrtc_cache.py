"""gaac_cuda.nvrtc's on-disk kernel cache, on the CPU: a stand-in for libnvrtc that "compiles" a source to bytes
derived from it, so the cache's behaviour (one compile per key, writes that never leave a mixed file, a folder that
cannot be written, a damaged binary compiled again) is checked without a GPU; the real NVRTC runs in the GPU tests."""

import ctypes
import hashlib
import os
import threading

import pytest
import torch

from gaac_cuda import nvrtc


class FakeNVRTC:
    """The libnvrtc calls compile_cubin makes, with ctypes arguments as ctypes passes them to a Python callable."""

    def __init__(self, delay: float = 0.0):
        self.compiles = 0
        self.delay = delay
        self._lock = threading.Lock()
        self._programs: dict = {}

    def nvrtcVersion(self, major, minor):
        major._obj.value, minor._obj.value = 13, 0
        return 0

    def nvrtcCreateProgram(self, prog, source, name, n_headers, headers, include_names):
        with self._lock:
            handle = len(self._programs) + 1
            self._programs[handle] = source
        prog._obj.value = handle
        return 0

    def nvrtcCompileProgram(self, prog, n, argv):
        with self._lock:
            self.compiles += 1
        if self.delay:
            threading.Event().wait(self.delay)
        return 0

    def nvrtcGetProgramLogSize(self, prog, size):
        size._obj.value = 1
        return 0

    def nvrtcGetProgramLog(self, prog, log):
        return 0

    def _cubin(self, prog) -> bytes:  # 4 KB that depend on the source: a torn write would show
        return hashlib.sha256(self._programs[prog.value]).digest() * 128

    def nvrtcGetCUBINSize(self, prog, size):
        size._obj.value = len(self._cubin(prog))
        return 0

    def nvrtcGetCUBIN(self, prog, buf):
        data = self._cubin(prog)
        ctypes.memmove(buf, data, len(data))
        return 0

    def nvrtcDestroyProgram(self, prog):
        return 0


@pytest.fixture
def fake(monkeypatch, tmp_path):
    lib = FakeNVRTC()
    monkeypatch.setattr(nvrtc, "_load", lambda name: lib if name == "nvrtc" else None)
    monkeypatch.setenv("GAAC_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(nvrtc, "_unwritable", set())
    return lib


def _opts(arch="sm_90a", extra=()):
    return [f"--gpu-architecture={arch}", "-std=c++17", "--device-as-default-execution-space", *extra]


def test_compiled_once_per_key_then_read_from_disk(fake, tmp_path):
    a = nvrtc.compile_cubin("kernel A", ["-DX=1"], "sm_90a")
    path = nvrtc.cache_path("kernel A", _opts(extra=("-DX=1",)), (13, 0))
    assert os.path.isfile(path) and open(path, "rb").read() == a and path.startswith(str(tmp_path / "cache"))
    assert nvrtc.compile_cubin("kernel A", ["-DX=1"], "sm_90a") == a and fake.compiles == 1
    # another source, option or architecture is another key
    b = nvrtc.compile_cubin("kernel B", ["-DX=1"], "sm_90a")
    nvrtc.compile_cubin("kernel A", ["-DX=2"], "sm_90a")
    nvrtc.compile_cubin("kernel A", ["-DX=1"], "sm_100a")
    assert b != a and fake.compiles == 4
    assert len(os.listdir(os.path.dirname(path))) == 4  # and no temporary file is left behind


def test_cached_binaries_are_readable_by_other_users(fake):
    nvrtc.compile_cubin("kernel A", [], "sm_90a")
    path = nvrtc.cache_path("kernel A", _opts(), (13, 0))
    assert os.stat(path).st_mode & 0o777 == 0o644


def test_an_unreadable_cached_binary_is_compiled_instead(fake, monkeypatch):
    good = nvrtc.compile_cubin("kernel A", [], "sm_90a")
    real_open = open

    def deny(path, mode="r", *a, **k):
        if str(path).endswith(".cubin") and "r" in mode:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", deny)
    assert nvrtc.compile_cubin("kernel A", [], "sm_90a") == good and fake.compiles == 2


def test_a_damaged_binary_is_compiled_again_on_refresh(fake):
    good = nvrtc.compile_cubin("kernel A", [], "sm_90a")
    path = nvrtc.cache_path("kernel A", _opts(), (13, 0))
    with open(path, "wb") as f:
        f.write(b"\0" * 10)  # what get_kernel's driver load would refuse
    assert nvrtc.compile_cubin("kernel A", [], "sm_90a") == b"\0" * 10  # read as cached ...
    assert nvrtc.compile_cubin("kernel A", [], "sm_90a", refresh=True) == good  # ... until refreshed
    assert open(path, "rb").read() == good and fake.compiles == 2


def test_an_unwritable_cache_warns_once_and_still_compiles(fake, tmp_path, monkeypatch):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("GAAC_HF_CACHE", str(blocker / "cache"))  # mkdir fails even for root
    with pytest.warns(UserWarning, match="cannot cache compiled kernels.*GAAC_HF_CACHE"):
        a = nvrtc.compile_cubin("kernel A", [], "sm_90a")
    assert a == hashlib.sha256(b"kernel A").digest() * 128
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second miss compiles again, silently
        assert nvrtc.compile_cubin("kernel A", [], "sm_90a") == a
    assert fake.compiles == 2


def test_concurrent_compiles_of_one_key_leave_one_whole_file(fake, tmp_path):
    fake.delay = 0.05  # every thread compiles before any has stored
    out = [None] * 6
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, nvrtc.compile_cubin("kernel A", [], "sm_90a")))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = nvrtc.cache_path("kernel A", _opts(), (13, 0))
    assert len(set(out)) == 1 and open(path, "rb").read() == out[0]
    assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_missing_nvrtc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(nvrtc, "_load", lambda name: None)
    with pytest.raises(nvrtc.NVRTCError, match="NVRTC .* was not found"):
        nvrtc.compile_cubin("kernel A", [], "sm_90a")
    assert not nvrtc.available()


@pytest.mark.skipif(not torch.cuda.is_available() or not nvrtc.available(), reason="needs a GPU and NVRTC")
def test_a_damaged_cached_cubin_is_rebuilt_by_get_kernel(tmp_path, monkeypatch):
    """On the GPU: a cached binary the driver refuses is compiled again and replaced, not an error."""
    monkeypatch.setenv("GAAC_HF_CACHE", str(tmp_path))
    src = 'extern "C" __global__ void add_one(float* x) { x[threadIdx.x] += 1.f; }'
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
    good = nvrtc.compile_cubin(src, [], arch)
    path = nvrtc.cache_path(src, _opts(arch), nvrtc.nvrtc_version())
    with open(path, "wb") as f:
        f.write(b"\x7fELF damaged")
    monkeypatch.setattr(nvrtc, "_modules", {})
    kernel = nvrtc.get_kernel(src, [], "add_one", torch.device("cuda"))
    assert open(path, "rb").read() == good and kernel.registers > 0
