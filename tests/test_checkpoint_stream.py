"""Streaming reads: positional reads straight into a slot (any stored layout, dtype
conversion, the CPU backend's interleaved rows) give the same weights as safetensors' own
loader, and the slot table built that way equals the one built through pack; the
coordinator's weights read in pieces over threads likewise."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from benchmarks.bench_memory import write_checkpoint
from coordinator.model.loader import _slots, load_model
from cpu_expert_server.backend import CpuExpertBackend
from expertmesh import checkpoint, safetensors_io
from expertmesh.checkpoint import CheckpointReader
from expertmesh.progress import LoadProgress
from expertmesh.worker.server import slot_views
from expertmesh.worker.slots import SlotTable, plain_views
from tests.hf_models import make_checkpoint

H, INTER, E, L = 128, 64, 6, 2


def stored(path, layer: int, e: int, fused: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """gate, up, down of one expert as safetensors' own loader reads them."""
    t = load_file(str(path / f"experts-{layer:03d}.safetensors"))
    p = f"model.layers.{layer}.mlp.experts"
    if fused:
        gu = t[f"{p}.gate_up_proj"][e]
        return gu[:INTER], gu[INTER:], t[f"{p}.down_proj"][e]
    return tuple(t[f"{p}.{e}.{n}_proj.weight"] for n in ("gate", "up", "down"))  # type: ignore[return-value]


@pytest.mark.parametrize("fused", [False, True], ids=["per_expert", "fused"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_expert_into_reads_what_safetensors_reads(tmp_path, fused, out_dtype, monkeypatch):
    path = write_checkpoint(tmp_path, H, INTER, E, L, torch.bfloat16, fused=fused)
    reader = CheckpointReader(path)
    reader.progress = LoadProgress("test", 0)
    monkeypatch.setattr(safetensors_io, "_IOV_MAX", 3)  # several preadv calls per blocked tensor
    for layer, e in ((0, 0), (1, 5)):
        gate, up, down = stored(path, layer, e, fused)
        w13 = torch.full((2 * INTER, H), float("nan"), dtype=out_dtype)
        w2 = torch.full((H, INTER), float("nan"), dtype=out_dtype)
        reader.expert_into(layer, e, *plain_views(w13, w2))
        assert torch.equal(w13, torch.cat([gate, up]).to(out_dtype)) and torch.equal(w2, down.to(out_dtype))
        # the same weights into gate/up rows interleaved in blocks of 16 (the CPU bf16 layout)
        blocks = torch.full((INTER // 16, 2, 16, H), float("nan"), dtype=out_dtype)
        down_t = torch.empty(H, INTER, dtype=out_dtype)
        reader.expert_into(layer, e, blocks[:, 0], blocks[:, 1], down_t)
        assert torch.equal(blocks[:, 0].reshape(INTER, H), gate.to(out_dtype))
        assert torch.equal(blocks[:, 1].reshape(INTER, H), up.to(out_dtype))
    assert reader.progress.bytes == 4 * 3 * INTER * H * 2  # bf16 bytes read, counted once each


def test_runs_of_a_blocked_view():
    t = torch.empty(4, 2, 16, 128, dtype=torch.bfloat16)
    runs = safetensors_io._runs(t[:, 0])
    assert runs is not None and len(runs) == 4 and all(n == 16 * 128 * 2 for _, n in runs)
    assert [p - t.data_ptr() for p, _ in runs] == [k * 2 * 16 * 128 * 2 for k in range(4)]
    assert safetensors_io._runs(t) == [(t.data_ptr(), t.nbytes)]
    assert safetensors_io._runs(t[..., :3]) is None  # 6-byte runs: staged instead


@pytest.mark.parametrize("wdtype", ["bfloat16", "int8", "int4"])
def test_slot_table_streamed_equals_read_then_packed(tmp_path, wdtype):
    """Read straight into the slots (bf16), or quantised straight into them from a reader
    thread's reused buffers (int8/int4), against read, pack and copy; then a change that
    reads experts again (staged and in place) the same way."""
    path = write_checkpoint(tmp_path, H, INTER, E, L, torch.bfloat16)
    tables, packed = [], []
    for direct in (True, False):
        b = CpuExpertBackend(threads=1, weight_dtype=wdtype)
        real = b.pack_weights

        def pack(w13, w2, real=real, direct=direct):  # counts the experts that went through pack
            packed.append((direct, w13.shape[0]))
            return real(w13, w2)

        t = SlotTable(
            CheckpointReader(path), torch.bfloat16, torch.device("cpu"), E, pack,
            views=slot_views(b) if direct else None, read_packed=b.read_packed if direct else None,
        )  # fmt: skip
        t.preload([5, 0, 3])
        t.prepare(1, {0: [4, 5, 1], 1: [2, 0, 3, 1]})
        t.commit(1)
        tables.append(t)
    assert [n for d, n in packed if d and n > 0] == []  # no expert of the direct table was packed
    assert sum(n for d, n in packed if not d) > 0
    if wdtype == "bfloat16":
        assert slot_views(CpuExpertBackend(threads=1)) is not None
    for layer in (0, 1):
        a, b = tables[0].live.layers[layer], tables[1].live.layers[layer]
        assert a.experts == b.experts and len(a.experts) in (3, 4)
        n = len(a.experts)
        assert torch.equal(a.w13[:n], b.w13[:n]) and torch.equal(a.w2[:n], b.w2[:n])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_coordinator_weights_read_in_pieces_over_threads(tmp_path, monkeypatch, dtype):
    """The coordinator's loader splits big tensors into pieces read on several threads (odd
    piece sizes here, so pieces end inside rows); every parameter, merged projections' rows
    included, holds what safetensors' own loader reads, and progress counts each tensor once."""
    make_checkpoint("qwen3_moe", tmp_path, max_shard_size="40KB")
    monkeypatch.setattr(safetensors_io, "PIECE_BYTES", 1000)
    monkeypatch.setattr(checkpoint, "read_threads", lambda: 3)
    pieces = []
    real = safetensors_io.TensorFile.pieces
    monkeypatch.setattr(
        safetensors_io.TensorFile, "pieces", lambda *a, **k: pieces.append(real(*a, **k)) or pieces[-1]
    )
    reader = CheckpointReader(tmp_path)
    model = load_model(reader, dtype, "cpu")
    assert max(len(p) for p in pieces) > 10  # the embedding: 96 x 64 float32 in 1000-byte pieces
    stored_tensors = {}
    for shard in tmp_path.glob("*.safetensors"):
        stored_tensors.update(load_file(str(shard)))
    params = dict(model.named_parameters())
    slots = _slots(model)
    checked = 0
    for name, t in stored_tensors.items():
        if ".experts." in name:
            continue
        pname, rows, _ = slots[name]
        got = params[pname].data if rows is None else params[pname].data[rows]
        assert torch.equal(got, t.to(dtype)), name
        checked += 1
    assert checked == len(reader.non_expert_names())


def test_a_failed_piece_fails_the_load(tmp_path, monkeypatch):
    """A read that fails on one reader thread fails the whole load with its error, after the
    other threads stop (no piece is read once the failure is seen, beyond those under way)."""
    make_checkpoint("qwen3_moe", tmp_path)
    monkeypatch.setattr(safetensors_io, "PIECE_BYTES", 1000)
    monkeypatch.setattr(checkpoint, "read_threads", lambda: 2)
    real, calls = safetensors_io.TensorFile._read_at, []

    def flaky(self, offset, dtype, out):
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(f"{self.path}: short read at byte {offset}")
        return real(self, offset, dtype, out)

    monkeypatch.setattr(safetensors_io.TensorFile, "_read_at", flaky)
    with pytest.raises(OSError, match="short read"):
        load_model(CheckpointReader(tmp_path), torch.float32, "cpu")
    assert 5 <= len(calls) <= 6  # the failure, and at most the other thread's piece under way


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_coordinator_weights_onto_a_gpu_in_pieces(tmp_path, monkeypatch, dtype):
    """Pieces read into pinned staging on several threads and copied to the GPU on each
    thread's stream land as the plain CPU read does (a bf16 model converts on the way)."""
    make_checkpoint("qwen3_moe", tmp_path, max_shard_size="40KB")
    ref = dict(load_model(CheckpointReader(tmp_path), dtype, "cpu").named_parameters())
    monkeypatch.setattr(safetensors_io, "PIECE_BYTES", 1000)
    monkeypatch.setattr(checkpoint, "read_threads", lambda: 4)
    got = load_model(CheckpointReader(tmp_path), dtype, "cuda")
    torch.cuda.synchronize()
    for name, p in got.named_parameters():
        assert p.device.type == "cuda" and torch.equal(p.cpu(), ref[name]), name


def test_a_load_reads_on_every_cpu_and_a_change_beside_requests_on_few(tmp_path, monkeypatch):
    """A preload, or the first placement of a table holding nothing, is a load (nothing is
    served yet) and reads on a pool of every CPU; a change to a table that holds experts reads
    on the table's few threads. The weights are the same either way."""
    path = write_checkpoint(tmp_path, H, INTER, E, L, torch.bfloat16)
    wide = []
    real = SlotTable._load_pool
    monkeypatch.setattr(SlotTable, "_load_pool", lambda self: wide.append(1) or real(self))

    def table() -> SlotTable:
        return SlotTable(CheckpointReader(path), torch.bfloat16, torch.device("cpu"), E, views=plain_views)

    a, b = table(), table()
    a.preload([0, 1, 2])
    assert wide == [1]
    b.prepare(1, {layer: [0, 1, 2] for layer in range(L)})
    b.commit(1)
    assert wide == [1, 1]
    b.prepare(2, {layer: [3, 1, 2] for layer in range(L)})  # a change beside requests
    b.commit(2)
    assert wide == [1, 1]
    for layer in range(L):
        assert torch.equal(a.live.layers[layer].w13[1:], b.live.layers[layer].w13[1:])
        gate, up, down = stored(path, layer, 3, False)
        assert torch.equal(b.live.layers[layer].w13[0], torch.cat([gate, up]))


def test_reader_threads_run_on_one_thread_and_leave_the_others_theirs():
    """A checkpoint reader's torch ops use one thread; threads started afterwards (a server's
    compute threads, the coordinator's scheduler) keep the process's configured count."""
    import threading

    from expertmesh.safetensors_io import _omp_set_num_threads, reader_pool

    # the pinned torch wheel (constraints.txt) brings its own libgomp under torch/lib
    assert _omp_set_num_threads() is not None, "torch's OpenMP runtime not found: readers would leak"
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with reader_pool(2) as pool:
            assert set(pool.map(lambda _: torch.get_num_threads(), range(4))) == {1}
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert later == [2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(saved)


def test_a_quantising_load_keeps_to_a_few_reader_threads(tmp_path, monkeypatch):
    """Start-up reads use every CPU for plain rows, at most MAX_QUANTISE_THREADS for rows a
    backend quantises (its per-block torch calls contend for the GIL)."""
    from expertmesh.worker import slots as sl

    path = write_checkpoint(tmp_path, H, INTER, E, L, torch.bfloat16)
    monkeypatch.setattr(sl, "read_threads", lambda limit: limit)  # as on a host with many CPUs
    plain = SlotTable(CheckpointReader(path), torch.bfloat16, torch.device("cpu"), E, views=plain_views)
    packed = SlotTable(
        CheckpointReader(path),
        torch.bfloat16,
        torch.device("cpu"),
        E,
        pack=lambda w13, w2: (w13.to(torch.uint8), w2.to(torch.uint8)),  # a quantised layout
    )
    with plain._load_pool() as a, packed._load_pool() as b:
        assert a._max_workers == sl.MAX_PRELOAD_THREADS
        assert b._max_workers == sl.MAX_QUANTISE_THREADS


def test_background_readers_yield_to_compute_threads():
    """Reads beside requests run at a lower CPU priority than the process's other threads."""
    import os
    import threading

    from expertmesh.safetensors_io import BACKGROUND_NICE, reader_pool

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def nested() -> int:
        with reader_pool(1, background=True) as inner:
            return inner.submit(nice).result()

    mine = nice()
    with reader_pool(1, background=True) as pool:
        assert pool.submit(nice).result() == min(19, mine + BACKGROUND_NICE)
        # a background pool whose threads a background thread starts: the offset counts once
        assert pool.submit(nested).result() == min(19, mine + BACKGROUND_NICE)
    with reader_pool(1) as pool:
        assert pool.submit(nice).result() == mine
    assert nice() == mine  # the caller's own thread is untouched
