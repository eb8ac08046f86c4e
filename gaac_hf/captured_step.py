"""A decode step over a static cache replayed as one CUDA graph with no Python per call: `CapturedStep`.

`torch.compile(mode="reduce-overhead")` replays the step as a CUDA graph too, but every call still runs Dynamo's
guard check, the bytecode that gathers the graph's inputs (for a 32-layer Llama about 300, the parameters first),
AOTAutograd's wrappers and the CUDA-graph tree's checks of those inputs: about 1.1 ms of host time per step on the
H200 (13-18% of a 64K step, `benchmarks/results/generate_h200_s15_v2_baselines.json`), the GPU idle meanwhile.
`CapturedStep` records one step (compiled by inductor without CUDA graphs, or eager) into a `torch.cuda.CUDAGraph`
once per input shape, with the step's tensor inputs (input ids, positions, a fixed-length mask) in static buffers;
each later call copies the new inputs in and replays. It is what serving engines do with a static KV cache.

    step = CapturedStep(model, cache)            # cache: GAACStaticCache, PlainStaticCache or StaticCache, prefilled
    out = step(input_ids=tok, position_ids=pos)  # the model's forward arguments (the cache is the step's own)
    next_tok = out.logits[:, -1].argmax(-1)      # out is overwritten by the next call: clone what you keep

What a replay does not re-run is Python, so everything that changes between steps must live in device tensors with
fixed addresses (a static cache's decode step: lengths, tail, pools, block table) and every call must take the same
Python path (one token per row, the same batch, the same keyword arguments). The step checks, before each replay:
the cache's amortized pool check (`cache.between_steps`, as `generate` triggers it: it raises on a full cache or
dropped tiles and grows a raw pool short of headroom), and the addresses of the cache's buffers (a raw pool that
grew is a new tensor: the graphs are recorded again). A new input shape records a new graph (up to `max_graphs`).
On a CPU, or with `capture=False`, calls run the step directly (nothing to record).
"""

from __future__ import annotations

import torch

from hf_common.model_config import cache_kwarg

from .compile_settings import compile_kwargs


def cache_buffers(cache) -> tuple[torch.Tensor, ...]:
    """The device tensors a decode step over `cache` reads and writes: `cache.buffers()` where the cache has it
    (`GAACStaticCache`, `PlainStaticCache`), else the tensors its layers hold (transformers' `StaticCache`)."""
    if hasattr(cache, "buffers"):
        return tuple(cache.buffers())
    return tuple(t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))


def record_cuda_graph(fn, pool):
    """Record `fn()` into a `torch.cuda.CUDAGraph` (in memory `pool`, shared with the step's other graphs; None: a new
    one). Returns `(replay, output, pool)`: `replay()` runs the recorded kernels, which overwrite `output` in place.
    Recording runs none of them."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out, graph.pool()


class CapturedStep:
    """`CapturedStep(model, cache)`: one decode step of `model` over the prefilled static `cache`, recorded as a CUDA
    graph at its `warmup + 1`-th call and replayed after (see the module docstring).

    `compile`: True compiles the step with inductor (`gaac_hf.compile_kwargs(cudagraphs=False)`: no CUDA-graph trees,
    no guards on the model's modules), a dict gives `torch.compile`'s keyword arguments, False runs the eager
    forward. `warmup`: calls run directly before a recording, for new inputs and after the buffers moved (they
    compile the step and let the libraries set up their workspaces; each is a real decode step). `max_graphs`: input
    shapes recorded before a new one is an error (a mask that grows with the context would record a graph per step:
    pad it to `max_cache_len`). `capture`: None records on CUDA only; False never. `recorder`: how a step is
    recorded (`record_cuda_graph`'s contract; another one lets the tests follow the bookkeeping on the CPU)."""

    def __init__(self, model, cache, *, compile: bool | dict = True, warmup: int = 2, max_graphs: int = 4,
                 capture: bool | None = None, recorder=record_cuda_graph):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (the first call compiles the step), not {warmup}")
        self.model, self.cache = model, cache
        self.cache_name = cache_kwarg(model)
        if compile is True:
            compile = compile_kwargs(cudagraphs=False)
        self.forward = torch.compile(model.forward, **compile) if compile else model.forward
        self.warmup, self.max_graphs = warmup, max_graphs
        self.capture = capture
        self.recorder = recorder
        self.graphs: dict = {}  # input key -> (replay, static inputs, output)
        self._warm: dict = {}  # input key -> direct steps run for it since the buffers last moved
        self._side = None
        self.pool = None
        self._addresses = None

    # --- inputs ---------------------------------------------------------------------------------------------------
    def _inputs(self, kwargs: dict) -> dict:
        cache = kwargs.pop(self.cache_name, self.cache)
        if cache is not self.cache:
            raise ValueError(f"this CapturedStep replays steps over the cache it was built with; got another "
                             f"{type(cache).__name__} as {self.cache_name}")
        if kwargs.get("use_cache") is False:
            raise ValueError("a captured decode step writes the cache: use_cache=False is not supported")
        ids = kwargs.get("input_ids")
        if ids is None or ids.dim() != 2 or ids.shape[1] != 1:
            raise ValueError("a captured decode step takes input_ids of shape [batch, 1] (one token per row; run the "
                             f"prefill with the model itself), got {None if ids is None else tuple(ids.shape)}")
        kwargs["use_cache"] = True
        return kwargs

    @staticmethod
    def _key(kwargs: dict) -> tuple:
        key = []
        for name, v in sorted(kwargs.items()):
            if isinstance(v, torch.Tensor):
                key.append((name, tuple(v.shape), v.dtype, v.device))
            else:
                try:
                    hash(v)
                except TypeError:
                    raise ValueError(f"a captured decode step takes tensors and hashable constants, not {name}="
                                     f"{type(v).__name__}") from None
                key.append((name, v))
        return tuple(key)

    def _call(self, kwargs: dict):
        return self.forward(**{self.cache_name: self.cache}, **kwargs)

    # --- recording ------------------------------------------------------------------------------------------------
    def _capturing(self, device: torch.device) -> bool:
        if self.capture is None:
            return device.type == "cuda"
        if self.capture and device.type != "cuda" and self.recorder is record_cuda_graph:
            raise ValueError(f"CUDA graphs need CUDA tensors; the step's inputs are on {device}")
        return self.capture

    def _record(self, key: tuple, kwargs: dict):
        if len(self.graphs) >= self.max_graphs:
            raise RuntimeError(f"{len(self.graphs)} input shapes recorded already (max_graphs={self.max_graphs}); a "
                               "captured step needs inputs of a fixed shape (pad a growing attention mask to the "
                               "cache's max_cache_len)")
        static = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        replay, out, self.pool = self.recorder(lambda: self._call(static), self.pool)  # runs no kernel
        self.graphs[key] = (replay, static, out)
        return self.graphs[key]

    def reset(self) -> None:
        """Drop the recorded graphs (the next call records again)."""
        self.graphs.clear()
        self._warm.clear()
        self.pool = None
        self._addresses = None

    # --- a step ---------------------------------------------------------------------------------------------------
    def _direct(self, kwargs: dict, device: torch.device):
        """A step run as it is, not recorded: on a side stream (as `torch.cuda.graph`'s docs ask of warm-up runs)."""
        if device.type != "cuda":
            return self._call(kwargs)
        if self._side is None:
            self._side = torch.cuda.Stream(device)
        self._side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._side):
            out = self._call(kwargs)
        torch.cuda.current_stream(device).wait_stream(self._side)
        return out

    def __call__(self, **kwargs):
        kwargs = self._inputs(kwargs)
        between = getattr(self.cache, "between_steps", None)
        if between is not None:
            between(int(kwargs["input_ids"].shape[1]))  # pool check and growth, every few calls (as generate)
        device = kwargs["input_ids"].device
        if not self._capturing(device):
            return self._call(kwargs)
        addresses = tuple(t.data_ptr() for t in cache_buffers(self.cache))
        if addresses != self._addresses:  # a buffer moved (a raw pool grew): the graphs read the old ones
            self.reset()
            self._addresses = addresses
        key = self._key(kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            # new inputs or buffers: `warmup` direct steps first (Dynamo compiles for them: not while recording)
            self._warm[key] = self._warm.get(key, 0) + 1
            if self._warm[key] <= self.warmup:
                return self._direct(kwargs, device)
            entry = self._record(key, kwargs)
        replay, static, out = entry
        for name, v in kwargs.items():
            if isinstance(v, torch.Tensor):
                static[name].copy_(v)
        replay()
        return out
