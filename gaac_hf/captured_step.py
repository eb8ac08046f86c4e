"""A decode step over a static cache replayed as one CUDA graph with no Python per call: `CapturedStep`.

`torch.compile(mode="reduce-overhead")` replays the step as a CUDA graph too, but every call still runs Dynamo's
guard check, the bytecode that gathers the graph's inputs (for a 32-layer Llama about 300, the parameters first),
AOTAutograd's wrappers and the CUDA-graph tree's checks of those inputs: about 1.1 ms of host time per step on the
H200 (13-18% of a 64K step, `benchmarks/results/generate_h200_s15_v2_baselines.json`), the GPU idle meanwhile.
`CapturedStep` records one step (compiled by inductor without CUDA graphs, or eager) into a `torch.cuda.CUDAGraph`
once per input signature, with the step's tensor inputs (input ids, positions, a fixed-length mask) in static
buffers; each later call copies the new inputs in and replays (`gaac_hf.graph_replay.GraphReplayer`). It is what
serving engines do with a static KV cache.

    step = CapturedStep(model, cache)            # cache: GAACStaticCache, PlainStaticCache or StaticCache, prefilled
    out = step(input_ids=tok, position_ids=pos)  # the model's forward arguments (the cache is the step's own)
    next_tok = out.logits[:, -1].argmax(-1)      # out is overwritten by the next call: clone what you keep

What a replay does not re-run is Python, so everything that changes between steps must live in device tensors with
fixed addresses (a static cache's decode step: lengths, tail, pools, block table) and every call must take the same
Python path (one token per row, the same batch, the same keyword arguments). Before each call the step runs the
cache's amortized pool check (`cache.between_steps`, as `generate` triggers it: it raises on a full cache or dropped
tiles and grows a raw pool short of headroom), and the replayer compares the addresses of the cache's buffers (a raw
pool that grew is a new tensor: the step is recorded again). A new input signature records a new graph (up to
`max_graphs`). On a CPU, or with `capture=False`, calls run the step directly (nothing to record).
"""

from __future__ import annotations

import torch

from hf_common.model_config import cache_kwarg

from .compile_settings import compile_kwargs
from .graph_replay import GraphReplayer, record_cuda_graph


def cache_buffers(cache) -> tuple[torch.Tensor, ...]:
    """The device tensors a decode step over `cache` reads and writes: `cache.buffers()` where the cache has it
    (`GAACStaticCache`, `PlainStaticCache`), else the tensors its layers hold (transformers' `StaticCache`)."""
    if hasattr(cache, "buffers"):
        return tuple(cache.buffers())
    return tuple(t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))


class CapturedStep:
    """`CapturedStep(model, cache)`: one decode step of `model` over the prefilled static `cache`, recorded as a CUDA
    graph at its `warmup + 1`-th call and replayed after (see the module docstring).

    `compile`: True compiles the step with inductor (`gaac_hf.compile_kwargs(cudagraphs=False)`: no CUDA-graph trees,
    no guards on the model's modules), a dict gives `torch.compile`'s keyword arguments, False runs the eager
    forward. `warmup`: calls run directly before a recording, for new inputs and after the buffers moved (they
    compile the step and let the libraries set up their workspaces; each is a real decode step). `max_graphs`: input
    signatures recorded before a new one is an error (a mask that grows with the context would record a graph per
    step: pad it to `max_cache_len`). `capture`: None records on CUDA only; False never. `recorder`: how a step is
    recorded (`record_cuda_graph`'s contract; another one lets the tests follow the bookkeeping on the CPU)."""

    def __init__(self, model, cache, *, compile: bool | dict = True, warmup: int = 2, max_graphs: int = 4,
                 capture: bool | None = None, recorder=record_cuda_graph):
        self.model, self.cache = model, cache
        self.cache_name = cache_kwarg(model)
        if compile is True:
            compile = compile_kwargs(cudagraphs=False)
        elif compile and compile.get("options"):  # torch.compile pops guard_filter_fn from its options: copy them
            compile = {**compile, "options": dict(compile["options"])}
        self.forward = torch.compile(model.forward, **compile) if compile else model.forward
        self.capture = capture
        self.replayer = GraphReplayer(self._step, fixed=lambda: cache_buffers(cache), warmup=warmup,
                                      max_graphs=max_graphs, recorder=recorder)

    @property
    def graphs(self) -> dict:
        """The recorded graphs, by input signature."""
        return self.replayer.graphs

    def reset(self) -> None:
        """Drop the recorded graphs (the next calls run directly, then record again)."""
        self.replayer.reset()

    def _step(self, names: tuple, *values):
        return self.forward(**{self.cache_name: self.cache}, **dict(zip(names, values)))

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

    def _capturing(self, device: torch.device) -> bool:
        if self.capture is None:
            return device.type == "cuda"
        if self.capture and device.type != "cuda" and self.replayer.recorder is record_cuda_graph:
            raise ValueError(f"CUDA graphs need CUDA tensors; the step's inputs are on {device}")
        return self.capture

    def __call__(self, **kwargs):
        kwargs = self._inputs(kwargs)
        between = getattr(self.cache, "between_steps", None)
        if between is not None:
            between(int(kwargs["input_ids"].shape[1]))  # pool check and growth, every few calls (as generate)
        names = tuple(sorted(kwargs))
        values = [kwargs[n] for n in names]
        if not self._capturing(kwargs["input_ids"].device):
            return self._step(names, *values)
        return self.replayer(names, *values)
