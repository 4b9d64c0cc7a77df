"""Where the in-process member ``local`` comes from: the coordinator's flags and placement
files (no process started)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from coordinator.experts.cluster import ExpertCluster
from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
from expertmesh.config import ModelConfig


def _config(*argv: str) -> ClusterConfig:
    p = argparse.ArgumentParser()
    ClusterConfig.add_arguments(p)
    return ClusterConfig.from_args(p.parse_args(list(argv)))


def test_num_gpu_experts_without_a_gpu_server_puts_them_in_process():
    c = _config("--cpu-server", "h:1", "--num-gpu-experts", "3")
    assert [(s.name, s.in_process) for s in c.servers] == [("local", True), ("cpu0", False)]
    assert c.has_local and c.gpu == [ServerSpec.local()]


@pytest.mark.parametrize(
    "argv",
    [
        ("--cpu-server", "h:1"),  # no split asked for: every expert on the CPU server
        ("--cpu-server", "h:1", "--num-gpu-experts", "0"),
        ("--gpu-server", "g:1", "--cpu-server", "h:1", "--num-gpu-experts", "3"),  # the GPU server's
        ("--gpu-server", "g:1", "--num-gpu-experts", "3"),
    ],
)
def test_no_local_member_otherwise(argv):
    assert not _config(*argv).has_local


def test_a_placement_file_naming_local(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"servers": ["local", "cpu0"], "layers": {"*": {"local": [0], "cpu0": [1]}}}))
    assert _config("--cpu-server", "h:1", "--placement", str(f)).has_local
    f.write_text(json.dumps({"layers": {"*": {"gpu0": [0], "cpu0": [1]}}}))
    assert not _config("--gpu-server", "g:1", "--cpu-server", "h:1", "--placement", str(f)).has_local


def test_the_name_local_is_reserved():
    with pytest.raises(ValueError, match="in-process"):
        ServerSpec("local", "h:1", "gpu")
    with pytest.raises(ValueError, match="in-process"):
        ServerSpec("gpu0", "h:1", "gpu", in_process=True)


def test_a_cluster_with_local_needs_the_checkpoint(tmp_path):
    from tests.hf_models import make_checkpoint

    make_checkpoint("qwen3_moe", tmp_path)
    cfg = ModelConfig.from_dir(tmp_path)
    c = ClusterConfig((ServerSpec.local(), ServerSpec("cpu0", "127.0.0.1:1", "cpu")), num_gpu_experts=2)
    with pytest.raises(ValueError, match="checkpoint"):
        ExpertCluster(cfg, c, torch.device("cpu"))
