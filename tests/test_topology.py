"""``expertmesh up``'s choice of processes (expertmesh/topology.py) and the commands it builds
for a GPU coordinator, on a checkpoint written by HF transformers (no process started)."""

from __future__ import annotations

import argparse
import json

import pytest

from expertmesh import launcher, topology
from expertmesh.config import ModelConfig
from tests.hf_models import make_checkpoint

GIB = 1 << 30


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("topo")
    make_checkpoint("qwen3_moe", path)  # float32 on disk
    return path, ModelConfig.from_dir(path)


def test_checkpoint_dtype_is_read_from_config_json(ckpt, tmp_path):
    path, _ = ckpt
    raw = json.loads((path / "config.json").read_text())
    assert topology.checkpoint_dtype(path) == str(raw.get("dtype") or raw.get("torch_dtype"))
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float8_e4m3fn"}))
    assert topology.checkpoint_dtype(tmp_path) == "bfloat16"


def test_other_bytes_is_the_checkpoint_less_its_experts(ckpt):
    path, cfg = ckpt
    from safetensors import safe_open

    want = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if ".experts." not in name:
                    want += st.get_tensor(name).nbytes
    got = topology.other_bytes(cfg, path, "float32", "float32")
    assert want <= got <= want + 64 << 10  # the files' headers on top
    assert topology.other_bytes(cfg, path, "bfloat16", "float32") == got // 2


def test_choose_without_a_gpu_keeps_the_three_process_cluster(ckpt):
    path, cfg = ckpt
    t = topology.choose(cfg, path, None, None, None, None, 256 << 20)
    assert (t.gpu_server, t.cpu_server, t.coordinator_device, t.dtype) == (True, True, "cpu", "float32")
    assert t.num_gpu_experts == cfg.num_experts // 2
    # a GPU, but the coordinator asked on the CPU: the same
    t = topology.choose(cfg, path, 80 * GIB, None, 3, "cpu", 256 << 20)
    assert t.gpu_server and t.num_gpu_experts == 3


def test_choose_on_a_gpu_puts_what_fits_in_process(ckpt):
    path, cfg = ckpt
    kv = 256 << 20
    big = topology.choose(cfg, path, 80 * GIB, None, None, None, kv)
    assert (big.gpu_server, big.cpu_server, big.num_local, big.coordinator_device) == (
        False,
        False,
        cfg.num_experts,
        "cuda",
    )
    assert big.dtype == topology.checkpoint_dtype(path)
    # room for exactly 3 experts per layer beside the rest of the model
    per_expert = topology.expert_bytes(cfg, "float32") * len(cfg.moe_layer_ids)
    rest = topology.other_bytes(cfg, path, "float32", "float32")
    need = topology.RESERVE_BYTES + kv + rest + 3 * per_expert + per_expert // 2
    free = int(need / (1 - topology.RESERVE_FRACTION)) + 1
    t = topology.choose(cfg, path, free, "float32", None, None, kv)
    assert (t.gpu_server, t.cpu_server, t.num_local) == (False, True, 3)
    assert "0..2" in t.describe() and "CPU expert server" in t.describe()
    # --num-gpu-experts wins over the estimate
    t = topology.choose(cfg, path, 80 * GIB, None, 2, None, kv)
    assert (t.cpu_server, t.num_local) == (True, 2)
    with pytest.raises(ValueError, match="outside"):
        topology.choose(cfg, path, 80 * GIB, None, cfg.num_experts + 1, None, kv)


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launcher.add_arguments(p)
    return p.parse_args(list(argv))


def test_build_hybrid_commands(ckpt):
    path, cfg = ckpt
    t = topology.Topology("cuda", "bfloat16", 3, False, True, 3, "test")
    servers, coord = launcher.build_hybrid(_args("--threads", "5", "--kv-memory", "1GiB"), path, t)
    assert [c.name for c in servers] == ["cpu-server"]
    cpu = servers[0].cmd
    assert cpu[cpu.index("--dtype") + 1] == "bfloat16" and cpu[cpu.index("--threads") + 1] == "5"
    assert coord[coord.index("--device") + 1] == "cuda"
    assert coord[coord.index("--num-gpu-experts") + 1] == "3"
    assert coord[coord.index("--kv-memory") + 1] == "1GiB"
    assert "--gpu-server" not in coord
    alone = topology.Topology("cuda", "bfloat16", cfg.num_experts, False, False, cfg.num_experts, "test")
    servers, coord = launcher.build_hybrid(_args(), path, alone)
    assert servers == [] and "--num-gpu-experts" not in coord


def test_hybrid_threads_leave_the_cpu_server_most_cores():
    assert topology.hybrid_threads(32, True) == {"coordinator": 4, "cpu-server": 28}
    assert topology.hybrid_threads(4, True) == {"coordinator": 2, "cpu-server": 2}
    assert topology.hybrid_threads(16, False)["coordinator"] == 16


def test_kv_memory_sizes():
    assert topology.parse_size("512MiB") == 512 << 20
    assert topology.parse_size("4GiB") == 4 << 30
    with pytest.raises(ValueError):
        topology.parse_size("lots")


def test_up_passes_the_flags_it_takes_on_to_the_coordinator(tmp_path):
    got = launcher.coordinator_flags(
        _args("--eplb-interval-steps", "50", "--no-prefix-cache", "--lora-dir", str(tmp_path))
    )
    assert got == ["--lora-dir", str(tmp_path.resolve()), "--eplb-interval-steps", "50", "--no-prefix-cache"]
    assert launcher.coordinator_flags(_args()) == []
