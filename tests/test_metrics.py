"""Prometheus metrics scraped with prometheus_client's text parser from a live coordinator
(HTTP ``/metrics``) and from a live expert server (``--metrics-port``), checked to move with
the requests that ran: routed-token counters sum to tokens x top-k x MoE layers on both."""

from __future__ import annotations

import socket
import time

import grpc
import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from coordinator.experts.remote import ClusterConfig, ServerSpec
from coordinator.serving.server import CoordinatorConfig
from expertmesh.client import Client
from expertmesh.config import ModelConfig
from expertmesh.demo import write_demo_model
from expertmesh.health import check
from expertmesh.v1 import expert_worker_pb2 as pb
from expertmesh.v1 import expert_worker_pb2_grpc as pb_grpc
from tests.cluster_utils import start_server
from tests.serving_utils import ServerThread, one_thread  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of a /metrics page, by prometheus_client's parser."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(m: dict, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in m.items() if n == name and match.items() <= dict(labels).items())


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    path = write_demo_model(root / "demo-model")
    (root / "adapters").mkdir()
    mport = free_port()
    srv = start_server("cpu", path, 0, "--metrics-port", str(mport))
    for _ in range(300):
        if check(srv.address) == "SERVING":
            break
        time.sleep(0.1)
    cfg = CoordinatorConfig(
        model_dir=str(path),
        port=0,
        http_port=0,
        cluster=ClusterConfig((ServerSpec("cpu0", srv.address, "cpu"),), timeout_s=20.0, transport="grpc"),
        lora_dirs=(str(root / "adapters"),),
    )
    try:
        with ServerThread(cfg) as coord:
            deadline = time.monotonic() + 60
            while not coord.server.experts_ready and time.monotonic() < deadline:
                time.sleep(0.1)
            assert coord.server.experts_ready
            yield path, coord, f"http://127.0.0.1:{coord.server.http.port}/metrics", srv, mport
    finally:
        srv.stop()


def test_counters_move_with_requests(cluster):
    path, coord, url, srv, mport = cluster
    wurl = f"http://127.0.0.1:{mport}/metrics"
    cfg = ModelConfig.from_dir(path)
    k, layers = cfg.top_k, len(cfg.moe_layer_ids)
    c0, w0 = scrape(url), scrape(wurl)
    with Client(coord.addr) as c:
        outs = [
            c.generate(p, max_new_tokens=n, ignore_eos=True)
            for p, n in (("Once upon a time", 9), ("A cat", 5))
        ]
    c1, w1 = scrape(url), scrape(wurl)

    def d(m0, m1, name, **kw):
        return total(m1, name, **kw) - total(m0, name, **kw)

    # every token the model computed: the prompt, and each generated token but the last
    computed = sum(o.usage.prompt_tokens + o.usage.completion_tokens - 1 for o in outs)
    assert d(c0, c1, "expertmesh_step_tokens_sum") == computed
    assert d(c0, c1, "expertmesh_requests_total", status="length") == 2
    assert d(c0, c1, "expertmesh_generation_tokens_total") == 14
    assert d(c0, c1, "expertmesh_time_to_first_token_seconds_count") == 2
    assert d(c0, c1, "expertmesh_e2e_request_latency_seconds_count") == 2
    # routed (token, k) pairs: tokens x top-k x MoE layers, on the coordinator and on the server
    assert d(c0, c1, "expertmesh_expert_tokens_total") == computed * k * layers
    for layer in cfg.moe_layer_ids:
        assert d(c0, c1, "expertmesh_expert_tokens_total", layer=str(layer)) == computed * k
        assert d(w0, w1, "expertmesh_worker_routed_tokens_total", layer=str(layer)) == computed * k
    steps = d(c0, c1, "expertmesh_steps_total")
    assert steps == d(c0, c1, "expertmesh_step_tokens_count") and steps >= 9
    # one round trip per MoE layer per step to the one server, and as many compute timings there
    assert d(c0, c1, "expertmesh_expert_layer_round_trip_seconds_count", server="cpu0") == steps * layers
    assert d(w0, w1, "expertmesh_worker_layer_compute_seconds_count") == steps * layers
    assert d(w0, w1, "expertmesh_worker_requests_total") == steps * layers
    # state gauges
    assert total(c1, "expertmesh_expert_server_ready", server="cpu0") == 1
    assert total(c1, "expertmesh_expert_server_transport", server="cpu0", transport="grpc") == 1
    assert total(c1, "expertmesh_kv_pages_used") == 0 and total(c1, "expertmesh_kv_pages_free") > 0
    assert total(c1, "expertmesh_placement_generation") >= 1
    assert total(c1, "expertmesh_placement_generation") == total(w1, "expertmesh_worker_placement_generation")
    assert total(w1, "expertmesh_worker_slots_used", layer="0") == cfg.num_experts
    # a CPU coordinator never links a decode step (the link is a CUDA graph's)
    assert total(c1, "expertmesh_linked_decode_steps_total") == 0
    assert ("expertmesh_link_reruns_total", ()) in c1
    assert total(c1, "expertmesh_linked_micro_batched_steps_total") == 0
    # nor queues a step behind another (no decode graphs to launch them on)
    assert total(c1, "expertmesh_queued_decode_steps_total") == 0
    assert total(c1, "expertmesh_queued_decode_step_failures_total") == 0


def test_rejected_requests_counted_by_code(cluster):
    _, _, _, srv, mport = cluster
    wurl = f"http://127.0.0.1:{mport}/metrics"
    before = total(scrape(wurl), "expertmesh_worker_rejected_requests_total", code="INVALID_ARGUMENT")
    with grpc.insecure_channel(srv.address) as ch:
        stub = pb_grpc.ExpertWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Forward(iter([pb.ForwardRequest(seq=1, layer=999)]), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    after = total(scrape(wurl), "expertmesh_worker_rejected_requests_total", code="INVALID_ARGUMENT")
    assert after == before + 1


def test_status_view(cluster, capsys):
    from expertmesh import status_cli as status
    from expertmesh.cli import main
    from expertmesh.v1 import admin_pb2_grpc

    path, coord, _, _, _ = cluster
    with grpc.insecure_channel(coord.addr) as ch:
        stub = admin_pb2_grpc.AdminStub(ch)
        a = status.read(stub, 10)
        with Client(coord.addr) as c:
            out = c.generate("Once upon a time", max_new_tokens=6, ignore_eos=True)
            # a prompt over a page long, twice: the second reuses its whole pages (experts remote)
            long = "Once upon a time there was a little fox who lived in the woods near the river"
            first, again = (c.generate(long, max_new_tokens=4, ignore_eos=True) for _ in range(2))
        b = status.read(stub, 10)
    n, page = first.usage.prompt_tokens, coord.server.scheduler.engine.page_size
    assert n > page and again.token_ids == first.token_ids
    assert (first.usage.cached_tokens, again.usage.cached_tokens) == (0, (n - 1) // page * page)
    s = status.summarize(a, b, top=3)
    assert s["throughput"]["generation_tokens_per_s"] > 0 and s["placement_generation"] >= 1
    assert s["requests"]["running"] == 0 and s["kv"]["pages_used"] == 0 and s["kv"]["pages_total"] > 0
    assert s["kv"]["pages_cached"] >= (n - 1) // page and s["throughput"]["prompt_tokens_cached_per_s"] > 0
    (srv,) = s["servers"]
    assert (srv["name"], srv["state"], srv["transport"]) == ("cpu0", "ready", "grpc")
    # a CPU coordinator never links a decode step, and says so
    assert srv["link"] == "-" and srv["link_note"]
    assert s["throughput"]["linked_steps_per_s"] == 0
    assert srv["slots_used"] == srv["slot_capacity"] == ModelConfig.from_dir(path).num_experts
    assert srv["layer_round_trip_ms"] is not None and srv["layer_round_trip_ms"] > 0
    # the hottest experts are the largest counts of Admin/GetExpertLoad
    for layer, top in s["hottest_experts"].items():
        counts = b["load"][layer]
        assert [e for e, _ in top] == sorted(range(len(counts)), key=lambda e: -counts[e])[:3]
    assert out.usage.completion_tokens == 6
    assert main(["status", "--addr", coord.addr, "--interval", "0.1"]) == 0
    text = capsys.readouterr().out
    assert "cpu0" in text and "placement generation" in text and "layer   0:" in text
    assert "pages in the prefix cache" in text and "LINK" in text and "linked)" in text


def test_grafana_dashboard_uses_exported_metrics(cluster):
    """Every metric docker/grafana-dashboard.json queries is one the servers export once they
    served a request."""
    import json
    import re
    from pathlib import Path

    _, coord, url, _, mport = cluster
    with Client(coord.addr) as c:  # labelled histograms have samples once something was observed
        c.generate("A cat", max_new_tokens=2)
    names = {n for n, _ in scrape(url)} | {n for n, _ in scrape(f"http://127.0.0.1:{mport}/metrics")}
    dash = json.loads(
        (Path(__file__).resolve().parent.parent / "docker" / "grafana-dashboard.json").read_text()
    )
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bexpertmesh_\w+", e)}
    assert len(used) >= 15 and used <= names, sorted(used - names)


def _demo_adapter(model_dir, out):
    """A PEFT adapter (attention q/v) for the demo model, saved to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    get_peft_model(hf, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])).save_pretrained(
        out
    )
    return out


def test_every_documented_metric_gets_a_sample(cluster):
    """Every metric the README's tables and the Grafana dashboard name has a sample once the
    action that produces it ran: requests, an EPLB rebalance and dry run, LoRA load, a failed
    load and an unload."""
    import json
    import re
    from pathlib import Path

    from expertmesh.cli import main

    path, coord, url, _, mport = cluster
    root = Path(__file__).resolve().parent.parent
    dash = json.loads((root / "docker" / "grafana-dashboard.json").read_text())
    exprs = " ".join(t["expr"] for p in dash["panels"] for t in p["targets"])
    named = set(re.findall(r"\bexpertmesh_\w*[a-z]\b", (root / "README.md").read_text() + exprs))
    assert {"expertmesh_rebalances_total", "expertmesh_lora_events_total"} <= named
    adapter = _demo_adapter(path, path.parent / "adapters" / "demo")
    with Client(coord.addr) as c:
        c.generate("A cat", max_new_tokens=3)
    addr = ["--addr", coord.addr]
    assert main(["placement", "rebalance", "--dry-run", *addr]) == 0
    assert main(["placement", "rebalance", *addr]) == 0
    assert main(["lora", "load", "demo", str(adapter), *addr]) == 0
    assert main(["lora", "load", "nope", str(path.parent / "adapters" / "nope"), *addr]) != 0
    assert main(["lora", "unload", "demo", *addr]) == 0
    samples = {n for n, _ in scrape(url)} | {n for n, _ in scrape(f"http://127.0.0.1:{mport}/metrics")}
    missing = {n for n in named if not {n, f"{n}_bucket", f"{n}_total"} & samples}
    assert not missing, sorted(missing)
    m = scrape(url)
    assert total(m, "expertmesh_rebalances_total", result="rebalanced") == 1
    assert total(m, "expertmesh_rebalances_total", result="dry-run") == 1
    for event in ("load", "load_failed", "unload"):
        assert total(m, "expertmesh_lora_events_total", event=event) == 1, event
