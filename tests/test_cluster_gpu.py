"""The three-process cluster with the GPU expert server on a real GPU (Triton kernels), bf16:
argmax equal to HF transformers' (eager) on >= 99% of positions. Runs on the device machine."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from coordinator.engine import Engine
from coordinator.kv_cache import KVCacheSpec
from coordinator.loader import load_model
from coordinator.remote import ClusterConfig, RemoteDispatcher, ServerSpec
from expertmesh.checkpoint import CheckpointReader
from tests.cluster_utils import start_server
from tests.hf_models import make_checkpoint
from tests.test_cluster import CLUSTER_ARCHS

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.mark.parametrize("arch", CLUSTER_ARCHS)
def test_gpu_cluster_bf16_argmax(arch, tmp_path):
    make_checkpoint(arch, tmp_path)
    gpu = start_server("gpu", tmp_path, 0, "--device", "cuda", "--dtype", "bfloat16")
    cpu = start_server("cpu", tmp_path, 0, "--dtype", "bfloat16")
    try:
        reader = CheckpointReader(tmp_path)
        ne = reader.config.num_experts
        servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
        d = RemoteDispatcher(
            reader.config, ClusterConfig(servers, num_gpu_experts=ne // 2), torch.bfloat16, "cuda"
        )
        d.connect(120)
        assert d.server_infos()[0]["device"].startswith("cuda")
        model = load_model(reader, torch.bfloat16, torch.device("cuda"))
        eng = Engine(model, d, KVCacheSpec(64, 16), torch.bfloat16, torch.device("cuda"))
        ids = torch.randint(0, 96, (64,), generator=torch.Generator().manual_seed(1))
        got = eng.step([(eng.new_seq(), ids.tolist())], all_logits=True)[0].cpu()
        hf = AutoModelForCausalLM.from_pretrained(
            tmp_path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
        ).eval()
        with torch.no_grad():
            ref = hf(ids[None]).logits[0].float()
        agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
        assert agree >= 0.99, f"{arch}: argmax agrees on {agree:.2%} of positions"
        d.close()
    finally:
        gpu.stop()
        cpu.stop()
