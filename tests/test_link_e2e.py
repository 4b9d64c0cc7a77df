"""The device link seen from the coordinator (expertmesh/transport/link.py,
coordinator/model/remote_graphs.py): when a linked decode step is offered and used, and what a
failed one does.

CPU: EXPERTMESH_LINK's modes, when a connection offers a link, and that a refused link step
leaves the fast-path channel alive. GPU (`gpu`, one GPU, EXPERTMESH_LINK=force on both sides):
a real cluster decodes the in-process engine's greedy tokens with the steps actually linked; a
step whose server reports an error bit is never used (it runs again without the link; with
no replica it fails with a clear error) and the cluster links again once the server is back;
a server killed mid-decode fails its requests with a clear error. `gpu2`: the same between two
GPUs with the default mode (no force)."""

from __future__ import annotations

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from coordinator.experts.cluster_config import ClusterConfig, ServerSpec, link_mode_from_env
from coordinator.experts.expert_conn import ServerConnection
from expertmesh.transport import descriptor as dsc
from expertmesh.transport import segment
from expertmesh.transport.client import ShmClient
from tests.test_remote_graphs import decode as _decode


@pytest.mark.parametrize(
    ("value", "mode"), [(None, "auto"), ("1", "auto"), ("auto", "auto"), ("0", "off"), ("force", "force")]
)
def test_link_mode_from_the_environment(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("EXPERTMESH_LINK", raising=False)
    else:
        monkeypatch.setenv("EXPERTMESH_LINK", value)
    assert link_mode_from_env() == mode
    assert ClusterConfig((ServerSpec("g", "127.0.0.1:1", "gpu"),)).device_link == mode


def test_a_bad_link_mode_is_refused(monkeypatch):
    monkeypatch.setenv("EXPERTMESH_LINK", "sometimes")
    with pytest.raises(ValueError, match="EXPERTMESH_LINK"):
        ClusterConfig((ServerSpec("g", "127.0.0.1:1", "gpu"),))


@pytest.mark.parametrize(
    ("mode", "plan", "sync", "shaped", "offered", "why"),
    [
        ("auto", "cuda_ipc", "local", True, True, ""),  # two GPUs with peer access
        ("auto", "cuda_ipc", "host", True, False, "shares this GPU"),  # one GPU: time-slicing
        ("force", "cuda_ipc", "host", True, True, ""),
        ("off", "cuda_ipc", "local", True, False, "EXPERTMESH_LINK=0"),
        ("auto", "shm", "host", True, False, "not cuda_ipc"),
        ("auto", "tcp", "host", True, True, ""),  # a host link, relayed (transport/tcp_relay.py)
        ("off", "tcp", "host", True, False, "EXPERTMESH_LINK=0"),
        ("auto", "cuda_ipc", "local", False, False, "remote dispatcher"),  # a CPU coordinator
    ],
)
def test_when_a_connection_offers_the_link(mode, plan, sync, shaped, offered, why):
    spec = ServerSpec("g", "127.0.0.1:1", "gpu")
    conn = ServerConnection(spec, ClusterConfig((spec,), device_link=mode))
    try:
        conn.plan, conn.dtype = plan, torch.bfloat16
        conn.link_shape = (64, 2048, 8) if shaped else None
        offer = conn._link_offer(sync)
        assert (offer == (64, 2048, 8, torch.bfloat16)) if offered else offer is None
        assert why in conn.link_note and (offered or conn.link_note)
    finally:
        conn.close()


def test_a_refused_link_step_keeps_the_channel():
    """A LinkStep refused by the server (code != 0) is an answer, not a channel failure; a
    launched one answers code 0; an error answer to an ordinary request still ends it."""
    assert segment.available(), "no writable /dev/shm: the shared-memory fast path cannot be tested"
    client = ShmClient("shm", 1 << 16, torch.device("cpu"), spin_us=0)
    req_fd, resp_fd = segment.open_fifos(client.name)
    seen: list[dsc.LinkStep] = []

    def server() -> None:  # answers two link steps: refused, then launched; then one error
        for code in (9, 0):
            step = dsc.LinkStep.parse(os.read(req_fd, dsc.SIZE))
            seen.append(step)
            os.write(
                resp_fd, dsc.Response(step.seq, code, 0.0, "no graph for this bucket" if code else "").pack()
            )
        os.write(resp_fd, dsc.Response(77, 13, 0.0, "broken").pack())

    t = threading.Thread(target=server, daemon=True)
    t.start()
    try:
        r = client.link_step(dsc.LinkStep(5, 1, 3, 4, 2, 1000), time.monotonic() + 10)
        assert r.code == 9 and "bucket" in r.message and not client.dead
        r = client.link_step(dsc.LinkStep(6, 2, 4, 4, 2, 1000), time.monotonic() + 10)
        assert r.code == 0 and not client.dead
        assert [(s.seq, s.step, s.rows, s.bucket, s.generation) for s in seen] == [
            (5, 1, 3, 4, 2),
            (6, 2, 4, 4, 2),
        ]
        t.join(10)
        client._inflight.add(77)
        with pytest.raises(Exception, match="broken"):
            client.wait(77, time.monotonic() + 10)
        assert client.dead
    finally:
        client.close()
        os.close(req_fd)
        os.close(resp_fd)


def test_the_slot_table_follows_the_placement(tmp_path):
    """RemoteDispatcher's GPU slot table (here on the CPU): with every expert of every MoE
    layer once on one server it holds each logical expert's local slot (what the server's step
    graph indexes), and the step may link to that server; a placement split across two servers,
    or that server down, links nothing."""
    from coordinator.experts.remote import RemoteDispatcher
    from tests.test_cluster_state import MODEL, FakeServer, make

    model = SimpleNamespace(**vars(MODEL), top_k=2)
    spec = {"servers": ["gpu0"], "layers": {"0": {"gpu0": [3, 1, 0, 2]}, "1": {"gpu0": [2, 0, 3, 1]}}}
    (tmp_path / "p.json").write_text(json.dumps(spec))
    c, _ = make(FakeServer(), placement_file=str(tmp_path / "p.json"))  # every expert once on gpu0
    d = RemoteDispatcher(model, c.config, torch.float32, "cpu", expert_cluster=c)  # type: ignore[arg-type]
    try:
        d.connect(5)
        d.begin_step(1)
        assert d._link_server == 0
        tables = c.tables.placement.tables
        for i, layer in enumerate(model.moe_layer_ids):
            lt = tables[layer]
            want = lt.local_slot[lt.log2phy[:, 0]].to(torch.int32)  # [E]
            assert torch.equal(d.link_table[i], want), (layer, d.link_table[i], want)
        assert d.link_table.tolist() == [[2, 1, 3, 0], [1, 3, 0, 2]]  # expert e -> its slot
        c.members[0].conn.die()
        d.begin_step(1)
        assert d._link_server is None and d.link_plan(1) is None
    finally:
        d.close()
    c, _ = make(FakeServer(), FakeServer())  # experts split over gpu0 and cpu0
    d = RemoteDispatcher(model, c.config, torch.float32, "cpu", expert_cluster=c)  # type: ignore[arg-type]
    try:
        d.connect(5)
        d.begin_step(1)
        assert d._link_server is None and d.link_plan(1) is None
    finally:
        d.close()


def test_a_failed_link_step_marks_the_server_down():
    """What the dispatcher does when a LinkStep goes unanswered (the connection raised) or a
    linked step came back with error bits: the server is marked down with a message that says
    why, its stream reset, the re-run counted."""
    from coordinator.experts.expert_conn import ExpertServerError
    from coordinator.experts.remote import RemoteDispatcher
    from expertmesh import errors
    from expertmesh.transport import link
    from tests.test_cluster_state import MODEL, FakeServer, make

    c, _ = make(FakeServer())
    d = RemoteDispatcher(
        SimpleNamespace(**vars(MODEL), top_k=2), c.config, torch.float32, "cpu", expert_cluster=c
    )  # type: ignore[arg-type]
    resets: list[str] = []

    def hung(*args):
        raise ExpertServerError.of(errors.DeadlineExceeded("gpu0 did not answer a device-link step"))

    conn = SimpleNamespace(
        describe_self=lambda: "expert server gpu0", reset=resets.append, send_link_step=hung
    )
    try:
        d.connect(5)
        d.begin_step(1)
        why = d.launch_link_step(0, conn, 1, 1, 1)  # type: ignore[arg-type]
        assert isinstance(why, str) and "did not answer" in why and c.down() == {0}
        c.ensure_ready(10)  # the maintenance thread brings it back
        assert c.down() == frozenset()
        # sent, and the answer read after the coordinator launched its side: a refusal marks
        # nothing down, a hung server is marked down when its answer is read
        conn.send_link_step = lambda *a: lambda: "refused (9): stale generation"
        answer = d.launch_link_step(0, conn, 2, 1, 1)  # type: ignore[arg-type]
        assert callable(answer) and answer() == "refused (9): stale generation" and c.down() == frozenset()
        conn.send_link_step = lambda *a: hung
        answer = d.launch_link_step(0, conn, 3, 1, 1)  # type: ignore[arg-type]
        assert callable(answer) and "did not answer" in answer() and c.down() == {0}
        c.ensure_ready(10)
        d.link_failed(0, conn, link.ERR_TIMEOUT | link.ERR_BAD_SLOT)  # type: ignore[arg-type]
        assert d.link_reruns == 1 and c.down() == {0}
        assert len(resets) == 1 and "no answer within 2s" in resets[0] and "slot ids" in resets[0], resets
        info = next(i for i in c.server_infos() if i["name"] == "gpu0")
        assert "device-link step failed" in str(info), info
    finally:
        d.close()


# ---------------------------------------------------------------------------- on a GPU


def _linked_cluster(tmp_path, monkeypatch, arch: str, server_device: str, mode: str, timeout_s: float):
    from tests.cluster_utils import start_server
    from tests.hf_models import make_checkpoint
    from tests.test_cluster import engine_for

    make_checkpoint(arch, tmp_path)
    if mode == "auto":
        monkeypatch.delenv("EXPERTMESH_LINK", raising=False)
    else:
        monkeypatch.setenv("EXPERTMESH_LINK", mode)  # the server reads it too (WorkerConfig.link)
    srv = start_server("gpu", tmp_path, 0, "--device", server_device, timeout=300)
    spec = ServerSpec("gpu0", srv.address, "gpu")
    eng, d = engine_for(tmp_path, ClusterConfig((spec,), transport="auto", timeout_s=timeout_s), "cuda:0")
    return srv, eng, d


def _check_linked_decode(tmp_path, eng, d) -> None:
    from coordinator.model.engine import Engine
    from tests.test_parity import rel_err

    ref = Engine.from_checkpoint(str(tmp_path), device="cuda:0", num_pages=64, page_size=4)
    for batch in (1, 3):  # 3 pads the bucket of 4 (slot id -1 rows)
        before = d.linked_steps
        got = _decode(eng, batch, 6)
        why = [getattr(c, "link_pause", "") for c in d.conns]  # why a step ran without the link
        assert d.linked_steps - before == 5, (batch, d.linked_steps - before, why)  # every decode step
        want = _decode(ref, batch, 6)
        assert torch.equal(got.argmax(-1), want.argmax(-1)), batch
        assert rel_err(got, want) < 1e-4, batch
    assert d.link_reruns == 0


def _linked_decode(tmp_path, monkeypatch, arch: str, server_device: str, mode: str) -> None:
    """A cluster whose link comes up (``mode``), decoding as in process over it."""
    srv, eng, d = _linked_cluster(tmp_path, monkeypatch, arch, server_device, mode, 60)
    try:
        assert d.conns[0].link() is not None, d.conns[0].link_note
        _check_linked_decode(tmp_path, eng, d)
    finally:
        d.close()
        srv.stop()


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])  # qwen2_moe: a shared expert overlaps
def test_linked_decode_on_one_gpu_matches_in_process(tmp_path, monkeypatch, arch):
    _linked_decode(tmp_path, monkeypatch, arch, "cuda:0", "force")


@pytest.mark.gpu
@pytest.mark.slow
def test_an_error_bit_is_never_sampled_and_a_killed_server_fails_clearly(tmp_path, monkeypatch):
    """A linked step whose server saw bad slot ids (ERR_BAD_SLOT) is thrown away: the server is
    marked down and the step runs again without the link, which either completes with the right
    logits (the cluster brought the server back in time) or fails with a clear UNAVAILABLE
    error, never wrong logits; once the server is back steps link again. Then the server is
    killed between two decode steps: the request fails with a clear error, as on the piecewise
    path, and nothing hangs much past the expert timeout."""
    from coordinator.experts.expert_conn import ExpertServerError
    from coordinator.model.engine import Engine
    from tests.test_parity import rel_err

    srv, eng, d = _linked_cluster(tmp_path, monkeypatch, "qwen3_moe", "cuda:0", "force", 20)
    ref = Engine.from_checkpoint(str(tmp_path), device="cuda:0", num_pages=64, page_size=4)
    try:
        _decode(eng, 1, 3)
        assert d.linked_steps == 2 and d.link_reruns == 0
        d.link_table[0].fill_(1 << 20)  # every slot id of the first MoE layer outside the server's slots
        seq, rseq = eng.new_seq(), ref.new_seq()
        eng.step([(seq, [1, 2, 3])])  # prefill: never linked
        want = ref.step([(rseq, [1, 2, 3])])
        want = ref.step([(rseq, [4])])[0].cpu()
        try:
            got = eng.step([(seq, [4])])[0].cpu()
        except ExpertServerError as e:  # the re-run found no live server
            assert "gpu0" in str(e), e
            got = None
        assert d.link_reruns == 1 and d.linked_steps == 2
        deadline = time.monotonic() + 60  # the cluster reconnects; the table is refreshed with it
        while got is None and time.monotonic() < deadline:
            try:
                got = eng.step([(seq, [4])])[0].cpu()
            except ExpertServerError:
                time.sleep(0.5)
        assert got is not None, "the server did not come back"
        assert rel_err(got, want) < 1e-4
        linked = d.linked_steps
        got = eng.step([(seq, [5])])[0].cpu()
        assert rel_err(got, ref.step([(rseq, [5])])[0].cpu()) < 1e-4
        assert d.linked_steps == linked + 1, "no step linked after the server came back"
        srv.proc.kill()
        srv.proc.wait(30)
        t0 = time.monotonic()
        with pytest.raises(ExpertServerError) as e:
            for t in range(6, 10):
                eng.step([(seq, [t])])
        assert time.monotonic() - t0 < 20 + 15, "a dead server held the step past its timeout"
        assert "gpu0" in str(e.value), e.value
    finally:
        d.close()
        srv.stop()


@pytest.mark.gpu2
@pytest.mark.slow
def test_linked_decode_between_two_gpus(tmp_path, monkeypatch):
    """Server on cuda:1, coordinator on cuda:0, EXPERTMESH_LINK unset: the link comes up by
    itself (peer access) and the decode equals in process."""
    if not torch.cuda.can_device_access_peer(0, 1):
        pytest.skip("cuda:0 has no peer access to cuda:1: no device link")
    _linked_decode(tmp_path, monkeypatch, "qwen3_moe", "cuda:1", "auto")


def test_the_hybrid_slot_tables_split_between_local_and_one_server(tmp_path):
    """A placement that splits every MoE layer's experts between the in-process member and one
    CPU server links to that server, with two tables (here on the CPU): the server's slot of
    each expert it holds (-1 for the local ones) and the local slot of the others."""
    spec = {
        "servers": ["local", "cpu0"],
        "layers": {"0": {"local": [2, 0], "cpu0": [1, 3]}, "1": {"local": [3], "cpu0": [0, 2, 1]}},
    }
    _hybrid_tables(tmp_path, spec, [[1, -1, 0, -1], [-1, -1, -1, 0]], [[-1, 0, -1, 1], [0, 2, 1, -1]])


def test_a_replicated_expert_links_to_its_local_copy(tmp_path):
    """Replicas across ``local`` and the CPU server: the linked step computes a replicated expert
    on its local copy (the GPU), the others on the server."""
    spec = {
        "servers": ["local", "cpu0"],
        "layers": {"*": {"local": [1, 2], "cpu0": [0, 1, 2, 3]}},
    }
    _hybrid_tables(tmp_path, spec, [[-1, 0, 1, -1]] * 2, [[0, -1, -1, 3]] * 2)


def _hybrid_tables(tmp_path, spec: dict, local_table: list, server_table: list) -> None:
    from coordinator.experts.cluster import ExpertCluster
    from coordinator.experts.cluster_config import ClusterConfig, ServerSpec
    from coordinator.experts.remote import RemoteDispatcher
    from expertmesh.transport import negotiate
    from tests.test_cluster_state import MODEL, FakeConn, FakeServer

    model = SimpleNamespace(**vars(MODEL), top_k=2)
    (tmp_path / "p.json").write_text(json.dumps(spec))
    specs = (ServerSpec.local(), ServerSpec("cpu0", "fake:2", "cpu"))
    servers = {"local": FakeServer(), "cpu0": FakeServer()}
    config = ClusterConfig(specs, num_gpu_experts=2, timeout_s=2.0, placement_file=str(tmp_path / "p.json"))
    c = ExpertCluster(
        MODEL,  # type: ignore[arg-type]
        config,
        "cpu",
        connect=lambda s: FakeConn(s, servers[s.name]),
        local_side=negotiate.Side("host"),
    )
    d = RemoteDispatcher(model, c.config, torch.float32, "cpu", expert_cluster=c)  # type: ignore[arg-type]
    try:
        d.connect(5)
        d.begin_step(1)
        assert d._link_server == 1 and d.link_local() is c.members[0].conn
        # e.g. layer 0 of the split: local slots 0 (expert 2), 1 (expert 0); cpu0 slots 0 (1), 1 (3)
        assert d.link_local_table.tolist() == local_table
        assert d.link_table.tolist() == server_table
    finally:
        d.close()
