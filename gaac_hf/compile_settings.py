"""torch.compile settings for a graph-captured decode step (`GAACStaticCache`, or any static cache).

A compiled decode step replayed as one CUDA graph still runs Dynamo's guard check on the host before every call, and
for a transformers model most of those guards are the model's own (one per module and parameter: about 2,500 of 3,100
for a 32-layer Llama). `torch.compiler.skip_guard_on_all_nn_modules_unsafe` drops them; the cache's guards (its
tensors' shapes, dtypes and devices) stay. It is "unsafe" in torch's sense: changing a module's attributes or
replacing its parameters after the first call does not recompile, which a generation loop does not do.

torch accepts a guard filter only through `options` and refuses `mode` and `options` together, so these settings
spell `mode="reduce-overhead"` as its option (`triton.cudagraphs`, which is all that mode sets for inductor).

    step = torch.compile(model.forward, **gaac_hf.compile_kwargs())
    out = model.generate(**inputs, past_key_values=cache, compile_config=gaac_hf.compile_config())

torch.compile pops `guard_filter_fn` from the `options` dict it is given: call `compile_kwargs()` once per compile
(a dict reused for a second `torch.compile` compiles that one with every module guard). `generate` deep-copies its
compile config, so a `compile_config()` can be reused.
"""

from __future__ import annotations

import torch


def _guard_filter():
    fn = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    if fn is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.compiler.skip_guard_on_all_nn_modules_unsafe "
                           "(torch >= 2.7 has it); pass skip_module_guards=False")
    return fn


GRAPHS = ("trees", "replay")


def compile_options(*, cudagraphs: bool = True, skip_module_guards: bool = True, backend="inductor") -> dict:
    """The `options` dict of `torch.compile` for a decode step: CUDA graphs (inductor's graph trees; another backend,
    such as the replay backend, records its own) and, with `skip_module_guards`, no guards on the model's modules and
    parameters."""
    options = {}
    if cudagraphs and backend == "inductor":
        options["triton.cudagraphs"] = True
    if skip_module_guards:
        options["guard_filter_fn"] = _guard_filter()
    return options


def compile_kwargs(*, fullgraph: bool = True, backend: str = "inductor", cudagraphs: bool = True,
                   skip_module_guards: bool = True, graphs: str = "trees") -> dict:
    """Keyword arguments of `torch.compile(model.forward, **compile_kwargs())`: the same compiled step as
    `mode="reduce-overhead", fullgraph=True`, with the model's module guards skipped unless told otherwise.
    `graphs="replay"` (inductor, CUDA graphs on): the CUDA graph recorded and replayed by
    `gaac_hf.graph_replay.graph_replay_backend` instead of inductor's graph trees (less host work per call)."""
    if graphs not in GRAPHS:
        raise ValueError(f"graphs is one of {GRAPHS}, not {graphs!r}")
    if graphs == "replay" and cudagraphs and backend == "inductor":
        from .graph_replay import graph_replay_backend

        backend = graph_replay_backend
    options = compile_options(cudagraphs=cudagraphs, skip_module_guards=skip_module_guards, backend=backend)
    kw = {"fullgraph": fullgraph, "backend": backend}
    if options:
        kw["options"] = options
    return kw


def compile_config(*, fullgraph: bool = True, backend: str = "inductor", cudagraphs: bool = True,
                   skip_module_guards: bool = True, graphs: str = "trees", **changes):
    """A transformers `CompileConfig` with the same settings, for `model.generate(..., compile_config=...)`
    (`generate` compiles the decode step itself when the cache is compileable)."""
    from transformers import CompileConfig

    kw = compile_kwargs(fullgraph=fullgraph, backend=backend, cudagraphs=cudagraphs,
                        skip_module_guards=skip_module_guards, graphs=graphs)
    return CompileConfig(fullgraph=kw["fullgraph"], backend=kw["backend"], mode=None, options=kw.get("options"),
                         **changes)


def describe(kwargs: dict) -> dict:
    """`compile_kwargs` as JSON-friendly values (a guard filter by its name), for benchmark records."""
    out = dict(kwargs)
    if callable(out.get("backend")):
        out["backend"] = getattr(out["backend"], "__name__", str(out["backend"]))
    if "options" in out:
        out["options"] = {k: getattr(v, "__name__", v) for k, v in out["options"].items()}
    return out
