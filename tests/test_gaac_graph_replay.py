"""gaac_hf.graph_replay.GraphReplayer: the bookkeeping around recorded CUDA graphs, followed on the CPU with a recorder
that keeps the function (`gaac_hf.testing.KeepingRecorder`): what is run directly, recorded, copied, replayed, and
when a recording is dropped or refused. (Real CUDA graphs: tests/test_gaac_captured_step.py, marked gpu.)"""

import pytest
import torch

from gaac_hf.graph_replay import GraphReplayer
from gaac_hf.testing import KeepingRecorder


def _replayer(fn, **kw):
    recorder = KeepingRecorder(outputs="list")
    return GraphReplayer(fn, recorder=recorder, **kw), recorder


def test_direct_then_recorded_then_replayed_with_the_inputs_copied_in():
    """Two direct calls, one recording (which runs nothing), then replays that read the new inputs through the
    recorded copies and the static input in place; outputs are the recorded ones, overwritten, unless cloned."""
    w = torch.tensor([2.0, 3.0])
    calls = []

    def fn(weight, x):
        calls.append(x.clone())
        return [weight * x]

    rep, rec = _replayer(fn, static=[0], warmup=2)
    outs = [rep(w, torch.full((2,), float(i))) for i in range(5)]
    assert rec.recorded == 1 and rec.replays == 3 and len(calls) == 5
    assert [o[0].tolist() for o in outs[:2]] == [[0.0, 0.0], [2.0, 3.0]]
    assert outs[2] is outs[4] and outs[4][0].tolist() == [8.0, 12.0]  # overwritten by the last replay
    w.mul_(10)  # a static input is read in place: a change of values (not of address) shows in the next replay
    assert rep(w, torch.ones(2))[0].tolist() == [20.0, 30.0]
    cloning, _ = _replayer(fn, static=[0], warmup=1, clone_outputs=True)
    kept = [cloning(w, torch.full((2,), float(i))) for i in range(3)]
    assert [k[0].tolist() for k in kept] == [[0.0, 0.0], [20.0, 30.0], [40.0, 60.0]]


def test_a_moved_static_input_or_fixed_tensor_records_again():
    buf = {"t": torch.zeros(3)}
    rep, rec = _replayer(lambda w, x: [w + x + buf["t"]], static=[0], fixed=lambda: (buf["t"],), warmup=1)
    w = torch.ones(3)
    for _ in range(3):
        rep(w, torch.ones(3))
    assert rec.recorded == 1
    # the static input moved (twice, both copies kept alive: a freed copy's address may be handed out again, as
    # the CUDA build's CPU allocator did on the H200 in session 21): each drop is followed by a direct call
    w1, w2 = w.clone(), w.clone()
    rep(w1, torch.ones(3))
    rep(w2, torch.ones(3))
    assert rec.recorded == 1 and rep.graphs == {}
    buf["t"] = torch.ones(3)  # a fixed tensor moved
    out = [rep(w, torch.ones(3)) for _ in range(3)]
    assert rec.recorded == 2 and out[-1][0].tolist() == [3.0, 3.0, 3.0]
    assert rep.recordings == 2  # counted across the drops (what benchmarks report per timed run)


def test_a_call_that_writes_a_copied_input_is_never_replayed():
    """A replay would write the recorded copy, not the caller's tensor: such a step stays direct; its writes land."""
    def fn(x):
        x.add_(1)
        return [x * 2]

    rep, rec = _replayer(fn, warmup=1)
    x = torch.zeros(2)
    for _ in range(4):
        rep(x)
    assert rep.mutates_copied_input and rec.recorded == 0 and x.tolist() == [4.0, 4.0]


def test_signatures_and_their_limit():
    rep, rec = _replayer(lambda x, flag: [x * (2 if flag else 1)], warmup=1, max_graphs=2)
    for shape in ((2,), (3,)):
        for _ in range(2):
            rep(torch.ones(shape), True)
    assert rec.recorded == 2 and len(rep.graphs) == 2
    rep(torch.ones(2), False)  # a new constant: a new signature, direct first
    with pytest.raises(RuntimeError, match="max_graphs=2"):
        rep(torch.ones(2), False)
    with pytest.raises(ValueError, match="hashable"):
        rep.signature([torch.ones(1), [1]])
    with pytest.raises(ValueError, match="warmup"):
        GraphReplayer(lambda: None, warmup=0)


def test_the_address_check_through_torchs_helper(monkeypatch):
    """On CUDA builds the static addresses are compared by torch's C++ helper (what CUDA-graph trees use: pointers
    listed by input index, None elsewhere); here a Python stand-in with those semantics takes its place."""
    from gaac_hf import graph_replay

    calls = []

    def helper(tensors, pointers, indices):
        assert len(pointers) == len(tensors) and all(pointers[i] is not None for i in indices)
        calls.append(tuple(indices))
        return all(tensors[i].data_ptr() == pointers[i] for i in indices)

    monkeypatch.setattr(graph_replay, "_pointers_equal", lambda: helper)
    rep, rec = _replayer(lambda x, w, y: [x + w + y], static=[1], warmup=1)
    w = torch.ones(2)
    for _ in range(3):
        rep(torch.zeros(2), w, torch.zeros(2))
    assert rec.recorded == 1 and rec.replays == 2 and calls == [(1,), (1,)]
    rep(torch.zeros(2), w.clone(), torch.zeros(2))  # moved: dropped, direct again
    assert rep.graphs == {}
