"""GAACCache under transformers tensor parallelism (tp_plan="auto", 2 ranks under torchrun): each rank compresses
its own KV-head shard with its slice of the calibration, and generation equals DynamicCache bit for bit.
Runs on the CPU with a gloo process group (and on 2 GPUs with NCCL when they are there)."""

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from hf_common.testing import tiny_llama_config
from transformers import AutoModelForCausalLM

from gaac_hf.calibrate import calibrate

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("tp")
    cfg = tiny_llama_config(num_attention_heads=4, num_key_value_heads=2, head_dim=64, hidden_size=256)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(root / "model")
    gen = torch.Generator().manual_seed(1)
    calibrate(model, [torch.randint(0, 512, (256,), generator=gen)], "random ids").save_pretrained(root / "calib")
    return root


@pytest.mark.parametrize("attn", ["sdpa", "gaac"])
def test_tensor_parallel_generation_is_lossless(artifacts, attn, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    with socket.socket() as sock:  # a free port, so that concurrent runs do not meet in one rendezvous
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
           os.path.join(HERE, "gaac_tp_worker.py"), str(artifacts / "model"), str(artifacts / "calib"), str(tmp_path),
           attn]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    verdicts = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for v in verdicts:
        assert v["lossless"], v
        assert v["local_kv_heads"] == 1  # each rank holds one of the two KV heads
        assert v["slots"] > 0
