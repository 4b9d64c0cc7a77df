"""The ``local`` member on a real GPU: the coordinator on CUDA computes its share of the experts
in process (the GPU server's Triton backend, graphed at decode sizes) beside a CPU expert
server subprocess.

* float32, every architecture (tiny random models), experts split and replicated across the
  two: prefill logits and greedy decode (the decode steps run the piecewise CUDA graphs) equal
  HF transformers' (relative error < 1e-4), tokens identical.
* bfloat16, the trained demo model: argmax equal to HF's (on the same GPU) on >= 99% of 512
  positions of corpus text.

Runs on the device machine (``python -m pytest -m gpu tests/test_local_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM

from coordinator.experts.cluster_config import ClusterConfig
from coordinator.experts.local import LocalConnection
from expertmesh.checkpoint import CheckpointReader
from expertmesh.demo import WEIGHTS_DIR, write_demo_model
from tests.cluster_utils import ROOT, start_server
from tests.hf_models import ARCHS, make_checkpoint
from tests.test_local_member import local_engine, replicas_file, servers
from tests.test_parity import assert_greedy_matches_hf

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("which", ["split", "replicas_rr"])
@pytest.mark.parametrize("arch", ARCHS)
def test_local_gpu_float32_matches_hf(arch, which, tmp_path):
    hf = make_checkpoint(arch, tmp_path)
    cpu = start_server("cpu", tmp_path)
    ne = CheckpointReader(tmp_path).config.num_experts
    if which == "split":
        cluster = ClusterConfig(servers(cpu), num_gpu_experts=ne // 2)
    else:
        cluster = ClusterConfig(
            servers(cpu), placement_file=replicas_file(tmp_path, ne), replica_policy="round_robin"
        )
    eng, d = local_engine(tmp_path, cluster, "cuda")
    try:
        local = d.conns[0]
        assert isinstance(local, LocalConnection) and local.worker.slots.device.type == "cuda"
        assert local.worker.backend.name == "triton"
        prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(3))
        assert_greedy_matches_hf(eng, hf, prompt)
        assert local.worker.stats.tokens > 0
    finally:
        d.close()
        cpu.stop()


def test_local_gpu_bf16_demo_model(tmp_path):
    path = write_demo_model(tmp_path / "demo")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    corpus = (WEIGHTS_DIR.parent / "corpus.txt").read_text()
    ids = tok.encode(corpus[5000:9000]).ids[:512]
    cpu = start_server("cpu", path, 0, "--dtype", "bfloat16")
    ne = CheckpointReader(path).config.num_experts
    eng, d = local_engine(
        path, ClusterConfig(servers(cpu), num_gpu_experts=ne // 2), "cuda", torch.bfloat16, pages=160
    )
    try:
        got = eng.step([(eng.new_seq(), ids)], all_logits=True)[0].cpu()
        hf = (
            AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
            )
            .cuda()
            .eval()
        )
        with torch.no_grad():
            ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        print(f"demo model bf16: local + CPU server vs HF (same GPU) argmax agreement {agree:.2%}")
        assert agree >= 0.99, f"argmax agrees on {agree:.2%} of positions"
    finally:
        d.close()
        cpu.stop()


@pytest.mark.parametrize("extra", [[], ["--num-gpu-experts", "4"]], ids=["defaults", "hybrid"])
def test_up_on_a_gpu_serves_from_the_coordinator(extra):
    """``expertmesh up`` on a GPU machine: coordinator on CUDA in the checkpoint's dtype, every
    expert in process by default; with --num-gpu-experts, 'local' plus a CPU expert server."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "expertmesh.cli",
        "up",
        "--demo",
        "--prompt",
        "the cat",
        "--max-new-tokens",
        "4",
    ]
    out = subprocess.run(
        [*cmd, "--http-port", "-1", *extra], capture_output=True, text=True, timeout=600, cwd=str(ROOT)
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stderr.splitlines() if ln.startswith("expertmesh up:"))
    assert "coordinator on cuda" in line, line
    if extra:
        assert "experts 0..3 of each layer in the coordinator's process" in line, line
    else:
        assert "every expert in the coordinator's process" in line, line
    banner, _, text = out.stdout.partition("\n")  # "expertmesh is serving on HOST:PORT", then the text
    assert banner.startswith("expertmesh is serving on "), out.stdout
    assert text.startswith("the cat") and len(text.split()) > 2, out.stdout
