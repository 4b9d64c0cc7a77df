"""Which processes ``expertmesh up`` starts on this machine, and where the experts go.

With a GPU the coordinator runs on it, in the checkpoint's dtype, and holds as many experts as
its free memory allows in its own process (the cluster member ``local``): every expert when
they fit (no expert server at all: the fastest topology), else experts ``0..N-1`` in process
and the rest on a CPU expert server (KTransformers' hybrid). ``--num-gpu-experts`` overrides
the estimate. Without a GPU (or with ``--coordinator-device cpu``) it is the three-process
cluster: a GPU expert server (on the CPU there), a CPU expert server and a CPU coordinator.

The estimate is from the checkpoint alone (config and file sizes) and the GPU's free memory:
routed experts take ``layers x experts x 3 x H x I x itemsize``; everything else the checkpoint
holds minus its experts; then the KV cache budget, and a reserve for the CUDA context,
activations, the decode graphs and the kernels' workspaces.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from expertmesh.config import ModelConfig

GIB = 1 << 30
RESERVE_BYTES = 4 * GIB  # CUDA context, activations, graph pools, Triton workspaces
RESERVE_FRACTION = 0.05  # of the free memory, on top (fragmentation)
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Topology:
    coordinator_device: str  # "cuda" | "cpu" (or what --coordinator-device named)
    dtype: str  # of the coordinator (and the expert servers)
    num_local: int  # experts per MoE layer in the coordinator's process (0: none)
    gpu_server: bool  # a separate GPU expert server process (the three-process cluster)
    cpu_server: bool
    num_gpu_experts: int  # the split the coordinator is given (its own or the GPU server's)
    why: str  # one line for the operator

    def describe(self) -> str:
        if self.gpu_server:
            where = f"experts 0..{self.num_gpu_experts - 1} on a GPU expert server, the rest on a CPU expert server"
        elif not self.cpu_server:
            where = "every expert in the coordinator's process"
        elif self.num_local:
            where = (
                f"experts 0..{self.num_local - 1} of each layer in the coordinator's process ('local'), "
                "the rest on a CPU expert server"
            )
        else:
            where = "every expert on a CPU expert server"
        return f"coordinator on {self.coordinator_device} ({self.dtype}); {where}: {self.why}"


def checkpoint_dtype(model: Path) -> str:
    """The float dtype config.json names (``torch_dtype``, or ``dtype`` in newer files);
    bfloat16 when it names none or something else (FP8 checkpoints compute in bf16)."""
    try:
        raw = json.loads((model / "config.json").read_text())
    except (OSError, ValueError):
        return "bfloat16"
    name = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16").removeprefix("torch.")
    return name if name in ITEMSIZE else "bfloat16"


def expert_bytes(cfg: ModelConfig, dtype: str) -> int:
    """One routed expert's weights (gate, up, down) at ``dtype``."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * ITEMSIZE[dtype]


def other_bytes(cfg: ModelConfig, model: Path, dtype: str, stored: str) -> int:
    """Everything but the routed experts, at ``dtype``: the checkpoint's bytes less its experts
    (as stored), rescaled from the stored dtype."""
    total = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    experts = len(cfg.moe_layer_ids) * cfg.num_experts * expert_bytes(cfg, stored)
    return max(0, total - experts) * ITEMSIZE[dtype] // ITEMSIZE[stored]


def experts_that_fit(cfg: ModelConfig, model: Path, dtype: str, free_bytes: int, kv_bytes: int) -> int:
    """How many experts per MoE layer the coordinator's GPU holds beside the rest of the model."""
    room = free_bytes * (1 - RESERVE_FRACTION) - RESERVE_BYTES - kv_bytes
    room -= other_bytes(cfg, model, dtype, checkpoint_dtype(model))
    per_expert = expert_bytes(cfg, dtype) * max(1, len(cfg.moe_layer_ids))
    return int(max(0, min(cfg.num_experts, room // per_expert)))


def choose(
    cfg: ModelConfig,
    model: Path,
    gpu_free_bytes: int | None,  # None: no GPU for the coordinator
    dtype: str | None,  # --dtype (None: the checkpoint's on a GPU, float32 on the CPU)
    num_gpu_experts: int | None,  # --num-gpu-experts
    coordinator_device: str | None,  # --coordinator-device (None: cuda when there is a GPU)
    kv_bytes: int,
) -> Topology:
    e = cfg.num_experts
    if num_gpu_experts is not None and not 0 <= num_gpu_experts <= e:
        raise ValueError(f"--num-gpu-experts {num_gpu_experts} outside [0, {e}]")
    on_gpu = gpu_free_bytes is not None and (coordinator_device or "cuda").startswith("cuda")
    if not on_gpu:
        n = e // 2 if num_gpu_experts is None else num_gpu_experts
        why = "no GPU" if gpu_free_bytes is None else f"--coordinator-device {coordinator_device}"
        return Topology(coordinator_device or "cpu", dtype or "float32", 0, True, True, n, why)
    assert gpu_free_bytes is not None
    dtype = dtype or checkpoint_dtype(model)
    fit = experts_that_fit(cfg, model, dtype, gpu_free_bytes, kv_bytes)
    dev = coordinator_device or "cuda"
    free = f"{gpu_free_bytes / GIB:.0f} GiB free on the GPU"
    if num_gpu_experts is not None:
        n, why = num_gpu_experts, f"--num-gpu-experts {num_gpu_experts} ({fit} would fit: {free})"
    elif fit >= e:
        n, why = e, f"all {e} experts per layer fit ({free})"
    else:
        n, why = fit, f"{fit} of {e} experts per layer fit ({free})"
    return Topology(dev, dtype, n, False, n < e, n, why)


# ---------------------------------------------------------------------- expertmesh up's inputs

DEFAULT_KV_BYTES = 256 << 20  # the coordinator's default --kv-memory


def parse_size(text: str) -> int:
    """``512MiB``, ``4GiB``, ``1.5G`` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.I)
    if not m:
        raise ValueError(f"--kv-memory {text!r}: expected e.g. 512MiB or 4GiB")
    return int(float(m.group(1)) * (1 << (10 * " KMGT".index(m.group(2).upper() or " "))))


def gpu_free_bytes() -> int | None:
    """Free memory of the first visible GPU, asked of a short-lived child (a CUDA context in
    the launcher would hold GPU memory for as long as the cluster runs); None without one."""
    code = "import torch; print(torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else -1)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        free = int(out.stdout.strip().splitlines()[-1])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
    return free if free >= 0 else None


def from_args(args: argparse.Namespace, model: Path, gpu_free: int | None) -> Topology:
    """:func:`choose` for ``expertmesh up``'s flags (``--dtype``, ``--num-gpu-experts``,
    ``--coordinator-device``, ``--kv-memory``)."""
    kv = parse_size(args.kv_memory) if args.kv_memory else DEFAULT_KV_BYTES
    cfg = ModelConfig.from_dir(model)
    return choose(cfg, model, gpu_free, args.dtype, args.num_gpu_experts, args.coordinator_device, kv)


def hybrid_threads(n: int, cpu_server: bool) -> dict[str, int]:
    """torch threads of a CUDA coordinator and its CPU expert server out of ``n``: the
    coordinator launches kernels (a few threads), the CPU server computes experts (the rest)."""
    if not cpu_server:
        return {"coordinator": max(1, n), "cpu-server": 0}
    cpu = max(1, n - 4) if n > 8 else max(1, n // 2)
    return {"coordinator": max(1, n - cpu), "cpu-server": cpu}
