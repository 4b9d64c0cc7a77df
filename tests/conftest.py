from __future__ import annotations

import os

import pytest
import torch

from tests.leaks import pytest_sessionfinish  # noqa: F401 (hook: no process outlives the session)

# NOTE: must be set before any Triton kernel is defined. Without a GPU the kernels run in
# Triton's interpreter; on a GPU they compile (unless TRITON_INTERPRET is set explicitly).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    """`gpu` tests (a CUDA GPU, or the AVX-512/AMX paths of a GPU host's CPU) run only where CUDA
    is present; `gpu2` tests need two GPUs of one host. Elsewhere
    they are skipped with the reason."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (DEVELOPERS.md: running on a GPU machine)")
    one_gpu = pytest.mark.skip(reason="needs two GPUs of one host")
    for item in items:
        if "gpu" in item.keywords and gpus == 0:
            item.add_marker(no_gpu)
        elif "gpu2" in item.keywords and gpus < 2:
            item.add_marker(one_gpu)
