"""Every expert held once: a real expert server (a subprocess) through a load, a push equal to
the live placement, a rebalance that changes a quarter of every layer's slots (rotations and
experts read from the checkpoint), layers that shrink and grow back inside their allocations,
and an aborted change stays within its experts' bytes plus one layer plus 5% (peak RSS of the
CPU server from /proc; torch's peak CUDA bytes of the GPU server), and answers every layer as
plain torch does with the weights the checkpoint holds.
Describe and /metrics (parsed with prometheus_client) report the same expert bytes.

Sizes: 6 layers of 24 slots of 1024 x 384 bf16 experts, ~340 MB resident (CI runs it in
seconds); the bound is relative to those bytes, measured from the server's own baseline."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from benchmarks.bench_memory import Server, proc_kib, reset_peak_rss, write_checkpoint
from expertmesh.experts import torch_moe
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.worker_api import ExpertRequest

HID, INTER, EXPERTS, LAYERS, SLOTS, TOP_K, T = 1024, 384, 32, 6, 24, 4, 5
DTYPE = torch.bfloat16


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("experts"), HID, INTER, EXPERTS, LAYERS, DTYPE)


def weights(model: Path, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert of ``layer`` as stored: w13 [E, 2I, H], w2 [E, H, I] (float32)."""
    t = load_file(str(model / f"experts-{layer:03d}.safetensors"))
    p = f"model.layers.{layer}.mlp.experts"
    w13 = torch.stack(
        [torch.cat([t[f"{p}.{e}.gate_proj.weight"], t[f"{p}.{e}.up_proj.weight"]]) for e in range(EXPERTS)]
    )
    w2 = torch.stack([t[f"{p}.{e}.down_proj.weight"] for e in range(EXPERTS)])
    return w13.float(), w2.float()


def placements() -> list[dict[int, list[int]]]:
    """First placement (experts 0..23 in order, as loaded), the same again, then per layer a
    quarter of the slots changed: three rotated, three given experts 24.. not held before; then
    every other layer shrinks by three slots (the allocation keeps them as spare slots) and
    grows back (into them)."""
    first = {layer: list(range(SLOTS)) for layer in range(LAYERS)}
    moved = {}
    for layer in range(LAYERS):
        s = list(range(SLOTS))
        a, b, c = (layer + 1) % SLOTS, (layer + 9) % SLOTS, (layer + 17) % SLOTS
        s[a], s[b], s[c] = s[b], s[c], s[a]
        for k, slot in enumerate(((layer + 4) % SLOTS, (layer + 12) % SLOTS, (layer + 20) % SLOTS)):
            s[slot] = SLOTS + (layer + k) % (EXPERTS - SLOTS)
        moved[layer] = s
    assert all(sum(x != y for x, y in zip(first[la], moved[la])) == SLOTS // 4 for la in first)
    shrunk = {layer: s[: SLOTS - 3] if layer % 2 == 0 else s for layer, s in moved.items()}
    return [first, first, moved, shrunk, moved]


def check_outputs(srv: Server, model: Path, gen: int, table: dict[int, list[int]], refs: dict) -> None:
    """Every layer answers as plain torch does on the experts its table says it holds."""
    g = torch.Generator().manual_seed(gen)
    for layer in range(LAYERS):
        if layer not in refs:
            refs[layer] = weights(model, layer)
        w13, w2 = refs[layer]
        held = table[layer]
        slot_ids = torch.stack(
            [torch.randperm(len(held), generator=g)[:TOP_K] for _ in range(T)]
        ).int()  # [T, K]
        routing = torch.rand(T, TOP_K, generator=g)
        x = torch.randn(T, HID, generator=g).to(DTYPE)
        out = srv.forward(ExpertRequest(1, gen, layer, x, slot_ids, routing), DTYPE).float()
        experts = torch.tensor(held)[slot_ids.long()]  # [T, K] logical expert of each pick
        ref = torch_moe(x.float(), w13, w2, experts, routing)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                return s.value
    raise AssertionError(f"{name} not in /metrics")


def run(kind: str, model: Path, *extra: str) -> None:
    srv = Server(
        kind,
        model,
        "--experts",
        "none",
        "--capacity",
        str(SLOTS),
        "--dtype",
        "bfloat16",
        "--metrics-port",
        "0",
        *extra,
        timeout=120,
    )
    try:
        srv.wait_serving(120)
        metrics_line = next(ln for ln in srv.lines if "/metrics" in ln)
        url = metrics_line.split()[-1]
        zeros = ExpertRequest(
            1,
            0,
            0,
            torch.zeros(T, HID, dtype=DTYPE),
            torch.full((T, TOP_K), -1, dtype=torch.int32),
            torch.rand(T, TOP_K),
        )
        srv.forward(zeros, DTYPE)  # the request path's own buffers, before the baseline
        pid = srv.proc.pid
        base_info = srv.describe()
        reset_peak_rss(pid)
        base_rss = proc_kib(pid, "VmRSS") * 1024
        refs: dict = {}
        tables = placements()
        slot = 3 * INTER * HID * DTYPE.itemsize
        for gen, table in enumerate(tables, 1):
            srv.push(gen, table)
            check_outputs(srv, model, gen, table, refs)
            # the allocations stay whole while layers shrink: their spare slots count as resident
            assert srv.describe().weight_bytes == LAYERS * SLOTS * slot
        last = len(tables)
        srv.apply(pb.ApplyPlacementRequest.PREPARE, last + 1, tables[0])  # a change, then abort
        srv.apply(pb.ApplyPlacementRequest.ABORT, last + 1)
        check_outputs(srv, model, last, tables[-1], refs)
        info = srv.describe()
        experts, layer = LAYERS * SLOTS * slot, SLOTS * slot
        bound = experts + layer + experts // 20
        assert info.generation == last and info.weight_bytes == experts, (info.weight_bytes, experts)
        assert experts <= info.peak_weight_bytes <= experts + layer, info.peak_weight_bytes
        assert metric(url, "expertmesh_worker_expert_bytes") == experts
        assert metric(url, "expertmesh_worker_expert_peak_bytes") == info.peak_weight_bytes
        if kind == "cpu":
            peak = proc_kib(pid, "VmHWM") * 1024 - base_rss
            assert peak <= bound, (
                f"peak RSS +{peak / 1e6:.0f} MB > {bound / 1e6:.0f} MB ({experts / 1e6:.0f} MB of experts)"
            )
            assert metric(url, "expertmesh_worker_process_peak_resident_bytes") >= base_rss + experts
        else:
            peak = info.device_peak_allocated_bytes - base_info.device_allocated_bytes
            assert peak <= bound, (
                f"peak CUDA +{peak / 1e6:.0f} MB > {bound / 1e6:.0f} MB ({experts / 1e6:.0f} MB of experts)"
            )
            assert info.device_allocated_bytes - base_info.device_allocated_bytes <= experts + experts // 20
    finally:
        srv.stop()
    assert srv.proc.poll() is not None


def test_cpu_server_holds_every_expert_once(model):
    run("cpu", model)


@pytest.mark.gpu
def test_gpu_server_holds_every_expert_once(model):
    # NOTE: eager kernels: the bound is about weights, CUDA graphs add their own memory pool
    run("gpu", model, "--device", "cuda", "--no-cuda-graphs")
