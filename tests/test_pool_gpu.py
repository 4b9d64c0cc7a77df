"""Two coordinators on a GPU sharing one GPU expert server on it (CUDA IPC fast path), with and
without the server's cross-coordinator batching: concurrent streams through both give HF's
greedy tokens (float32: the GPU server's Triton path computes exact fp32).

Runs on the device machine (``python -m pytest -m gpu tests/test_pool_gpu.py``).
"""

from __future__ import annotations

import pytest

from tests import lora_utils
from tests.cluster_utils import start_server
from tests.fault_utils import Job, wait_health
from tests.serving_utils import hf_greedy
from tests.test_pool import NEW_TOKENS, PROMPTS, Coordinator, both

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("pool-gpu")
    hf = lora_utils.make_model("qwen2_moe", root / "model")
    return root / "model", [hf_greedy(hf, list(p), NEW_TOKENS)[0] for p in PROMPTS]


@pytest.mark.parametrize("combine", [False, True], ids=["one-by-one", "combined"])
def test_two_gpu_coordinators_share_one_gpu_expert_server(model, combine):
    mdir, want = model
    extra = ["--combine-streams"] if combine else []
    server = start_server("gpu", mdir, 0, "--device", "cuda", *extra)
    coords: list[Coordinator] = []
    try:
        flags = ["--gpu-server", server.address, "--device", "cuda", "--placement-lease", "2"]
        flags += ["--page-size", "4", "--kv-memory", "8MiB"]
        coords = [Coordinator("127.0.0.1", mdir, *flags) for _ in range(2)]
        for c in coords:
            wait_health(c.addr, "SERVING", timeout=120)
        jobs = [[Job(p, NEW_TOKENS)] * 3 for p in PROMPTS]
        assert both(coords, jobs) == [[[w] * 3 for w in want]] * 2
        assert len({c.placement().generation for c in coords}) == 1
        print("transports:", [c.transports() for c in coords])
    finally:
        for c in coords:
            c.stop()
        server.stop()
