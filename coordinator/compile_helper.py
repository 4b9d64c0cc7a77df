"""The kernel compile helper's process: ``python -m coordinator.compile_helper ARGS`` with a CUDA
coordinator's own arguments (started by coordinator/model/compile_ahead.py, which says why and
how the coordinator uses it). It builds the coordinator's model cut after its first MoE layer
(and its first dense layer, where it has them) with zero weights and zero experts, on the same
device in the same dtype, and a KV cache of as many pages modulo 16 as the coordinator's, runs
every decode bucket's step once in the order of the coordinator's warm-up, and prints each bucket
on its standard output once that bucket's kernels are in Triton's on-disk cache.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from coordinator.main import add_arguments, config_from_args
from coordinator.model.compile_ahead import cut_pages
from coordinator.model.cuda_graphs import DecodeGraphs
from coordinator.model.dispatch import LocalDispatcher
from coordinator.model.kv_cache import KVCache, KVCacheSpec
from coordinator.model.loader import materialize
from coordinator.model.models import build_model
from expertmesh.checkpoint import CheckpointReader
from expertmesh.config import ModelConfig, cut_layers

# what the helper may hold on the GPU beyond its model and cache: its CUDA context, cuBLAS's
# workspace, the warm-up's activations
OVERHEAD_BYTES = 2 << 30


def main(argv: list[str]) -> int:
    t0 = time.monotonic()
    p = argparse.ArgumentParser(prog="coordinator.compile_helper")
    add_arguments(p)
    config = config_from_args(p.parse_args(argv))
    if config.remote or not config.device.startswith("cuda"):
        return 0
    reader = CheckpointReader(config.model_dir)
    full = reader.config
    cfg = cut_layers(full)
    dtype, device = config.torch_dtype, torch.device(config.device)
    spec = KVCacheSpec.from_budget(full, config.kv_memory_bytes, config.page_size, dtype)
    small = KVCacheSpec(cut_pages(spec.num_pages), spec.page_size)
    # the coordinator's weights and KV cache (allocated while this runs) and this process's
    # own, checked against what the device has free now
    theirs = (
        _param_bytes(build_model(full, dtype))
        + _expert_bytes(full, dtype)
        + spec.num_pages * KVCacheSpec.bytes_per_page(full, spec.page_size, dtype)
    )
    model = build_model(cfg, dtype)  # on the meta device until materialised below
    mine = (
        _param_bytes(model)
        + _expert_bytes(cfg, dtype)
        + small.num_pages * KVCacheSpec.bytes_per_page(cfg, small.page_size, dtype)
        + OVERHEAD_BYTES
    )
    free, _ = torch.cuda.mem_get_info(device)
    if free < theirs + mine:
        print(
            f"kernel compile helper: skipped ({free / 2**30:.1f} GiB free on {device}, the coordinator's "
            f"weights and this helper need {(theirs + mine) / 2**30:.1f})",
            file=sys.stderr,
            flush=True,
        )
        return 0
    materialize(model, device)
    with torch.no_grad():
        for t in model.parameters():
            t.zero_()
    model.eval()
    model.attach(LocalDispatcher.zeros(cfg, dtype, device))
    cache = KVCache(cfg, small, dtype, device)
    t1 = last = time.monotonic()
    took: list[str] = []

    def warmed(bucket: int) -> None:
        nonlocal last
        print(bucket, flush=True)  # NOTE: the line the coordinator's warm-up of this bucket waits for
        now = time.monotonic()
        took.append(f"{bucket}: {now - last:.1f}")
        last = now

    DecodeGraphs(model, cache, small.num_pages, None, capture=False, warmed=warmed)
    print(
        f"kernel compile helper: the decode buckets' kernels ready in {time.monotonic() - t0:.1f} s "
        f"({cfg.num_layers} of {full.num_layers} layers, zero weights; set-up {t1 - t0:.1f} s, "
        f"then s per bucket {', '.join(took)})",
        file=sys.stderr,
        flush=True,
    )
    return 0


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.parameters())


def _expert_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    per = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts
    return per * len(cfg.moe_layer_ids) * dtype.itemsize


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001  # NOTE: the coordinator compiles itself; say why
        print(f"kernel compile helper failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
