"""Compile CUDA C++ at first use with NVRTC and launch it on torch's current stream, through ctypes.

No CUDA toolkit is needed: NVRTC comes with torch's CUDA wheels (`nvidia-cuda-nvrtc`), the driver with the GPU.
Binaries are cached on disk by (source hash, options, GPU arch, NVRTC version) under `~/.cache/gaac_hf/cubin`
(`GAAC_HF_CACHE` moves the root). Where that folder cannot be written (a read-only home, a container) the binary is
kept in memory only, with one warning; a cached binary the driver refuses (a damaged file) is compiled again and
replaced. Nothing here runs at import: a machine without a GPU or NVRTC imports fine and `available()` says False.
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import site
import tempfile
import threading
import warnings

import torch

_lock = threading.Lock()
_libs: dict = {}
_modules: dict = {}

CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
CU_FUNC_ATTRIBUTE_NUM_REGS = 4
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute (cuda.h): an id, padding to 8 bytes, a 64-byte value union (8-byte aligned)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint64 * 8)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuda.h)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def programmatic_launch_config(grid: int, threads: int, smem: int, stream: int) -> _LaunchConfig:
    """A 1-D launch's CUlaunchConfig with programmatic stream serialization allowed (the kernel may start before the
    one before it on the stream completes; it waits for it with griddepcontrol.wait). The attribute array is kept
    alive on the config (`_attrs`)."""
    attr = (_LaunchAttribute * 1)()
    attr[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr[0].value[0] = 1  # programmaticStreamSerializationAllowed (an int at the union's start; little endian)
    cfg = _LaunchConfig(grid, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(stream),
                        ctypes.cast(attr, ctypes.POINTER(_LaunchAttribute)), 1)
    cfg._attrs = attr
    return cfg


class NVRTCError(RuntimeError):
    pass


def _candidate_nvrtc() -> list[str]:
    dirs = []
    roots = list(site.getsitepackages()) + [site.getusersitepackages(), os.path.dirname(os.path.dirname(torch.__file__))]
    for root in roots:
        dirs += sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib")))
        dirs += sorted(glob.glob(os.path.join(root, "nvidia", "cuda_nvrtc", "lib")))
    dirs.append(os.path.join(os.path.dirname(torch.__file__), "lib"))
    files = []
    for d in dirs:
        files += [f for f in sorted(glob.glob(os.path.join(d, "libnvrtc.so*"))) if "builtins" not in f and ".alt." not in f]
    return files + ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]


def _load(name: str):
    with _lock:
        if name in _libs:
            return _libs[name]
        lib = None
        if name == "nvrtc":
            for path in _candidate_nvrtc():
                try:
                    # NVRTC dlopens its builtins library by name: load it from the same folder first
                    for builtins in sorted(glob.glob(os.path.join(os.path.dirname(path), "libnvrtc-builtins.so*"))):
                        if ".alt." not in builtins:
                            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                    lib = ctypes.CDLL(path)
                    break
                except OSError:
                    continue
        else:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError:
                lib = None
        _libs[name] = lib
        return lib


def nvrtc_version() -> tuple[int, int] | None:
    lib = _load("nvrtc")
    if lib is None:
        return None
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return None
    return major.value, minor.value


def available() -> bool:
    """NVRTC and the CUDA driver can be loaded (says nothing about the GPU's architecture)."""
    return torch.cuda.is_available() and _load("nvrtc") is not None and _load("cuda") is not None


def _check_cu(status: int, what: str) -> None:
    if status != 0:
        lib = _load("cuda")
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(status, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver call {what} failed: {status} {msg.value.decode() if msg.value else ''}")


def cache_path(source: str, opts: list[str], version) -> str:
    """Where the cubin of `source` compiled with the full NVRTC `opts` by NVRTC `version` is cached."""
    key = hashlib.sha256("\0".join([source, *opts, str(version)]).encode()).hexdigest()[:24]
    root = os.environ.get("GAAC_HF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "gaac_hf")
    return os.path.join(root, "cubin", f"{key}.cubin")


_unwritable: set = set()  # cache folders already warned about


def store(path: str, data: bytes) -> bool:
    """Write `data` to `path` atomically (a unique temporary file in the same folder, then a rename, so concurrent
    writers of one key, processes or threads, never leave a mixed file). A folder that cannot be written is warned
    about once and skipped: the caller keeps the binary in memory. True if stored."""
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            os.fchmod(fd, 0o644)  # (mkstemp's 0600 would hide the binary from other users of a shared cache)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return True
    except OSError as e:
        if folder not in _unwritable:
            _unwritable.add(folder)
            warnings.warn(f"gaac_cuda: cannot cache compiled kernels in {folder} ({e}); they are compiled once per "
                          "process instead. Set GAAC_HF_CACHE to a writable folder to keep them.", stacklevel=3)
        return False


def compile_cubin(source: str, options: list[str], arch: str, refresh: bool = False) -> bytes:
    """NVRTC-compile `source` for `arch` (e.g. "sm_90a"); cached on disk (`refresh`: compile again and replace the
    cached binary, e.g. one the driver refused)."""
    lib = _load("nvrtc")
    if lib is None:
        raise NVRTCError("NVRTC (libnvrtc) was not found; install torch's CUDA build (it depends on nvidia-cuda-nvrtc)")
    version = nvrtc_version()
    opts = [f"--gpu-architecture={arch}", "-std=c++17", "--device-as-default-execution-space"] + list(options)
    path = cache_path(source, opts, version)
    if not refresh and os.path.isfile(path):
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError:  # unreadable (another user's file, say): compile it here
            pass
    prog = ctypes.c_void_p()
    status = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"gaac.cu", 0, None, None)
    if status != 0:
        raise NVRTCError(f"nvrtcCreateProgram failed ({status})")
    try:
        argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), argv)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if status != 0:
            raise NVRTCError(f"NVRTC compile failed ({status}) with {opts}:\n{log.value.decode(errors='replace')}")
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        if lib.nvrtcGetCUBIN(prog, cubin) != 0:
            raise NVRTCError("nvrtcGetCUBIN failed")
        data = cubin.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    store(path, data)
    return data


class Kernel:
    """A loaded kernel function of one module, on one device (CUDA context)."""

    def __init__(self, cubin: bytes, name: str, device: torch.device):
        cu = _load("cuda")
        with torch.cuda.device(device):
            torch.cuda.current_stream(device)  # make sure the primary context is current
            self._module = ctypes.c_void_p()
            _check_cu(cu.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData")
            self._fn = ctypes.c_void_p()
            _check_cu(cu.cuModuleGetFunction(ctypes.byref(self._fn), self._module, name.encode()),
                      "cuModuleGetFunction")
        self.name, self.device = name, device
        self._smem_limit = 0
        self._configs: dict = {}  # launch configs of programmatic launches, by (grid, threads, smem, stream)

    def attribute(self, attr: int) -> int:
        v = ctypes.c_int()
        _check_cu(_load("cuda").cuFuncGetAttribute(ctypes.byref(v), attr, self._fn), "cuFuncGetAttribute")
        return v.value

    @property
    def registers(self) -> int:
        return self.attribute(CU_FUNC_ATTRIBUTE_NUM_REGS)

    @property
    def local_bytes(self) -> int:
        return self.attribute(CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)

    def _allow_smem(self, smem: int) -> None:
        if smem > 48 * 1024 and smem > self._smem_limit:
            _check_cu(_load("cuda").cuFuncSetAttribute(self._fn, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
                      "cuFuncSetAttribute(max dynamic shared memory)")
            self._smem_limit = smem

    def blocks_per_sm(self, threads: int, smem: int) -> int:
        self._allow_smem(smem)
        n = ctypes.c_int()
        _check_cu(_load("cuda").cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self._fn, threads,
                                                                            ctypes.c_size_t(smem)), "occupancy")
        return n.value

    def launch(self, grid: int, threads: int, smem: int, params: ctypes.Structure, pdl: bool = False) -> None:
        """Launch on torch's current stream of the kernel's device (captured by CUDA graphs like any launch);
        `pdl`: as a programmatic dependent launch (`programmatic_launch_config`)."""
        self._allow_smem(smem)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        args = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(params), ctypes.c_void_p))
        cu = _load("cuda")
        if pdl:
            key = (grid, threads, smem, stream)
            cfg = self._configs.get(key)
            if cfg is None:
                if len(self._configs) > 256:
                    self._configs.clear()
                cfg = self._configs[key] = programmatic_launch_config(grid, threads, smem, stream)
            _check_cu(cu.cuLaunchKernelEx(ctypes.byref(cfg), self._fn, args, None), f"cuLaunchKernelEx({self.name})")
            return
        _check_cu(cu.cuLaunchKernel(self._fn, grid, 1, 1, threads, 1, 1, smem, ctypes.c_void_p(stream), args, None),
                  f"cuLaunchKernel({self.name})")


def get_kernel(source: str, options: list[str], name: str, device: torch.device) -> Kernel:
    """The kernel `name` of `source` compiled with `options` for `device`'s architecture (cached)."""
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (hashlib.sha256(source.encode()).hexdigest(), tuple(options), name, index)
    kernel = _modules.get(key)
    if kernel is None:
        major, minor = torch.cuda.get_device_capability(index)
        arch = f"sm_{major}{minor}" + ("a" if major == 9 else "")
        try:
            kernel = Kernel(compile_cubin(source, options, arch), name, torch.device("cuda", index))
        except RuntimeError as e:  # a cached binary the driver refuses (damaged on disk): compile it again once
            if "cuModuleLoadData" not in str(e):
                raise
            kernel = Kernel(compile_cubin(source, options, arch, refresh=True), name, torch.device("cuda", index))
        _modules[key] = kernel
    return kernel
