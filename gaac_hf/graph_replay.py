"""Run a step once per input signature as a recorded CUDA graph and replay it: the bookkeeping that `CapturedStep` and
the `graph_replay_backend` of `torch.compile` share.

`GraphReplayer(fn, static=...)(*args)` runs `fn(*args)` directly for `warmup` calls of each input signature (shapes,
dtypes, devices of the tensors, values of the rest), then records it once with the inputs outside `static` cloned
into buffers of its own; later calls copy those inputs in and replay. Inputs in `static` (parameters, cache buffers)
are read in place: their addresses, and those of the tensors `fixed()` returns, are compared on every call, and a
change drops the graphs (recorded again after `warmup` more direct calls). A replay returns the recorded output,
overwritten by the next call. No Python of `fn` runs in a replay: whatever changes between calls must be in tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def record_cuda_graph(fn: Callable, pool):
    """Record `fn()` into a `torch.cuda.CUDAGraph` (in memory `pool`, shared with the caller's other graphs; None: a new
    one). Returns `(replay, output, pool)`: `replay()` runs the recorded kernels, which overwrite `output` in place.
    Recording runs none of them."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph.replay, out, graph.pool()


def _pointers_equal() -> Callable | None:
    return getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)  # CUDA builds (what CUDA-graph trees use)


class GraphReplayer:
    """See the module docstring. `max_graphs`: signatures recorded before a new one is an error; `recorder`: how a
    call is recorded (`record_cuda_graph`'s contract)."""

    def __init__(self, fn: Callable, *, static: Sequence[int] = (), fixed: Callable | None = None, warmup: int = 2,
                 max_graphs: int = 4, recorder: Callable = record_cuda_graph, clone_outputs: bool = False):
        if warmup < 1:
            raise ValueError(f"warmup must be at least 1 (the first call may compile), not {warmup}")
        self.fn, self.static, self.fixed = fn, sorted(set(static)), fixed
        self.clone_outputs = clone_outputs
        self.mutates_copied_input = False  # found in a direct call: then every call runs directly
        self.warmup, self.max_graphs, self.recorder = warmup, max_graphs, recorder
        self.graphs: dict = {}  # signature -> (replay, recorded inputs, output)
        self.recordings = 0  # graphs recorded since construction (a moved buffer or a new signature records again)
        self._warm: dict = {}  # signature -> direct calls since the last reset
        self._pointers: list[int | None] | None = None  # static inputs' addresses by input index
        self._fixed_pointers: tuple | None = None
        self._side = None
        self._copied: list[int] | None = None  # indices of the inputs outside `static`
        self.pool = None

    def reset(self) -> None:
        """Drop the recorded graphs (the next calls run directly, then record again)."""
        self.graphs.clear()
        self._warm.clear()
        self._pointers = self._fixed_pointers = None
        self.pool = None

    def signature(self, args: Sequence) -> tuple:
        """The inputs' signature: of the inputs outside `static` (a static input does not move or change shape
        without a new compile behind it)."""
        if self._copied is None or len(self._copied) + len(self.static) != len(args):
            static = set(self.static)
            self._copied = [i for i in range(len(args)) if i not in static]
        key = [len(args)]
        for i in self._copied:
            a = args[i]
            if isinstance(a, torch.Tensor):
                key.append((tuple(a.shape), a.stride(), a.dtype, a.device))
            else:
                try:
                    hash(a)
                except TypeError:
                    raise ValueError(f"a replayed step takes tensors and hashable constants; argument {i} is a "
                                     f"{type(a).__name__}") from None
                key.append(a)
        return tuple(key)

    def _moved(self, args: Sequence) -> bool:
        """Whether a static input or a `fixed()` tensor is not where the graphs read it (first call: True)."""
        fixed = tuple(t.data_ptr() for t in self.fixed()) if self.fixed is not None else ()
        if self._pointers is None or fixed != self._fixed_pointers:
            moved = True
        elif not self.static:
            moved = False
        elif len(self._pointers) != len(args):
            moved = True
        else:
            same = _pointers_equal()
            if same is not None:  # (tensors, pointers by input index with None elsewhere, indices to compare)
                moved = not same(list(args), self._pointers, self.static)
            else:
                moved = any(args[i].data_ptr() != self._pointers[i] for i in self.static)
        if moved:
            self.reset()
            static = set(self.static)
            self._pointers = [a.data_ptr() if i in static else None for i, a in enumerate(args)]
            self._fixed_pointers = fixed
        return moved

    def direct(self, *args):
        """`fn(*args)` as it is, not recorded (on CUDA on a side stream, as `torch.cuda.graph`'s docs ask of warm-up
        runs, ordered with the current stream both ways). A call that writes an input outside `static` (its version
        counter moves) could not be replayed (the replay would write the recorded copy): every call then runs
        directly."""
        copied = [args[i] for i in self._copied or () if isinstance(args[i], torch.Tensor)]
        versions = [t._version for t in copied]
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None or device.type != "cuda" or self.recorder is not record_cuda_graph:
            out = self.fn(*args)
        else:
            if self._side is None:
                self._side = torch.cuda.Stream(device)
            self._side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(self._side):
                out = self.fn(*args)
            torch.cuda.current_stream(device).wait_stream(self._side)
        if [t._version for t in copied] != versions:
            self.mutates_copied_input = True
        return out

    def _record(self, key: tuple, args: Sequence):
        if len(self.graphs) >= self.max_graphs:
            raise RuntimeError(f"{len(self.graphs)} input signatures recorded already (max_graphs={self.max_graphs}); "
                               "a replayed step needs inputs of fixed shapes (pad a growing attention mask to the "
                               "cache's max_cache_len)")
        copied = set(self._copied)
        recorded = [a.clone() if i in copied and isinstance(a, torch.Tensor) else a for i, a in enumerate(args)]
        replay, out, self.pool = self.recorder(lambda: self.fn(*recorded), self.pool)  # runs no kernel
        self.graphs[key] = (replay, recorded, out)
        self.recordings += 1
        return self.graphs[key]

    def __call__(self, *args):
        if self.mutates_copied_input:
            return self.fn(*args)
        self._moved(args)
        key = self.signature(args)
        entry = self.graphs.get(key)
        if entry is None:  # new signature or moved buffers: direct calls first (a compiler may run: not recording)
            self._warm[key] = self._warm.get(key, 0) + 1
            if self._warm[key] <= self.warmup:
                return self.direct(*args)
            entry = self._record(key, args)
        replay, recorded, out = entry
        for i in self._copied:
            a = args[i]
            if isinstance(a, torch.Tensor):
                recorded[i].copy_(a)
        replay()
        if self.clone_outputs:
            return [o.clone() if isinstance(o, torch.Tensor) else o for o in out]
        return out


def graph_replay_backend(gm: torch.fx.GraphModule, example_inputs: list, *, warmup: int = 2,
                         recorder: Callable = record_cuda_graph, compiler: Callable | None = None):
    """A `torch.compile` backend: inductor without CUDA-graph trees (or `compiler`, another backend), its compiled graph
    run through a `GraphReplayer` on CUDA: parameters and inputs marked static (a static cache's buffers) read in
    place, the others (input ids, positions) copied in, the outputs cloned (a caller may keep them across calls, as
    `generate` keeps hidden states). What `mode="reduce-overhead"` does, without the graph trees' per-call
    bookkeeping. A graph that writes an input not marked static (e.g. a cache whose buffers are not) is never
    replayed: its calls run directly. On the CPU the compiled graph runs as it is (unless `recorder` is another than
    CUDA graphs: the tests')."""
    if compiler is None:
        from torch._inductor.compile_fx import compile_fx as compiler
    compiled = compiler(gm, example_inputs)
    if recorder is record_cuda_graph and not any(isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        return compiled
    static = [i for i, x in enumerate(example_inputs) if isinstance(x, torch.Tensor) and (
        isinstance(x, torch.nn.Parameter) or getattr(x, "_dynamo_static_input_type", None) is not None)]
    return GraphReplayer(compiled, static=static, warmup=warmup, recorder=recorder, clone_outputs=True)
