"""Prometheus metrics of an expert server, served on ``--metrics-port`` (``/metrics``).

One :class:`WorkerMetrics` per servicer, with its own ``CollectorRegistry``. Observed as they
happen (hooks in the servicer): compute time per MoE layer, rejected requests by gRPC status
code. Read at scrape time from the servicer's own state: requests, tokens, slots in use and
capacity per layer, the live placement generation, resident LoRA adapters.
"""

from __future__ import annotations

from collections.abc import Iterator
from threading import Thread
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from expertmesh.errors import BindError, ExpertMeshError
from expertmesh.transport.tcp_relay import RelayTally

# gRPC status codes by number (the worker core is gRPC-free: its errors carry the number)
_CODE_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
    "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED",
)  # fmt: skip
# per-layer compute: 50 us .. 5 s
_COMPUTE_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 0.5, 1, 5)


class WorkerMetrics:
    def __init__(self, servicer: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.compute_seconds = Histogram(
            "expertmesh_worker_layer_compute_seconds",
            "Expert compute time of one Forward request, by MoE layer",
            ["layer"],
            buckets=_COMPUTE_BUCKETS,
            registry=self.registry,
        )
        self.rejected = Counter(
            "expertmesh_worker_rejected_requests",
            "Forward requests refused, by gRPC status code",
            ["code"],
            registry=self.registry,
        )
        for code in ("INVALID_ARGUMENT", "FAILED_PRECONDITION", "UNAVAILABLE"):
            self.rejected.labels(code)  # exported at 0 from the start
        self.data_dropped = Counter(
            "expertmesh_worker_data_connections_dropped",
            "TCP data-path connections dropped for a malformed or truncated frame, a bad preamble "
            "or a failed TLS handshake, by reason",
            ["reason"],
            registry=self.registry,
        )
        for reason in ("malformed", "truncated", "preamble", "tls"):
            self.data_dropped.labels(reason)
        self.resident_adapters = 0  # set by the LoRA code once it exists
        self.relays = RelayTally()  # the relayed links' counters (expertmesh/transport/tcp_relay.py)
        self.registry.register(_WorkerState(servicer, self))
        self._children: dict[int, Any] = {}

    def compute(self, layer: int, seconds: float) -> None:
        child = self._children.get(layer)
        if child is None:
            child = self._children[layer] = self.compute_seconds.labels(str(layer))
        child.observe(seconds)

    def reject(self, err: ExpertMeshError | None) -> None:
        """A refused request, labelled with its gRPC status code (None: a fast-path channel
        failure the worker only counts, ``UNKNOWN``)."""
        code = (
            _CODE_NAMES[err.status] if err is not None and 0 <= err.status < len(_CODE_NAMES) else "UNKNOWN"
        )
        self.rejected.labels(code).inc()

    def dropped(self, reason: str) -> None:
        self.data_dropped.labels(reason).inc()


class _WorkerState(Collector):
    def __init__(self, servicer: Any, metrics: WorkerMetrics) -> None:
        self.servicer, self.metrics = servicer, metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.servicer
        st = s.stats
        yield CounterMetricFamily(
            "expertmesh_worker_requests", "Forward requests computed", value=st.requests
        )
        yield CounterMetricFamily("expertmesh_worker_tokens", "Token rows computed", value=st.tokens)
        yield CounterMetricFamily(
            "expertmesh_worker_link_steps", "Decode steps answered over a host link", value=st.link_steps
        )
        yield CounterMetricFamily(
            "expertmesh_worker_link_layers", "MoE layers answered over a host link", value=st.link_layers
        )
        yield CounterMetricFamily(
            "expertmesh_worker_link_kernel_seconds",
            "Host-link layers: the kernel thread's time in its kernels (routing copy included)",
            value=st.link_kernel_seconds,
        )
        yield CounterMetricFamily(
            "expertmesh_worker_link_wait_seconds",
            "Host-link layers: the kernel thread's time spinning for the coordinator's next layer",
            value=st.link_wait_seconds,
        )
        routed = CounterMetricFamily(
            "expertmesh_worker_routed_tokens",
            "(token, k) pairs computed, by MoE layer",
            labels=["layer"],
        )
        for layer, counts in sorted(s.tokens_per_slot.items()):
            routed.add_metric([str(layer)], float(counts.sum()))
        yield routed
        live = s.slots.live
        used = GaugeMetricFamily(
            "expertmesh_worker_slots_used", "Expert slots holding weights", labels=["layer"]
        )
        for layer, ls in sorted(live.layers.items()):
            used.add_metric([str(layer)], len(ls.experts))
        yield used
        yield GaugeMetricFamily(
            "expertmesh_worker_slot_capacity", "Expert slots per layer", value=s.slots.capacity
        )
        yield GaugeMetricFamily(
            "expertmesh_worker_placement_generation", "Live placement generation", value=live.generation
        )
        yield from _memory(s.slots)
        relay = CounterMetricFamily(
            "expertmesh_worker_relay_events",
            "Relayed links over the TCP data path: layers carried, connections attached, closed by "
            "the peer or dropped, malformed frames, timeouts, aborted waits",
            labels=["kind"],
        )
        for kind, n in self.metrics.relays.totals().items():
            relay.add_metric([kind], n)
        yield relay
        combiner = getattr(s, "combiner", None)
        if combiner is not None:  # --combine-streams (expertmesh/worker/combine.py)
            yield from _combine(combiner.stats)
        yield GaugeMetricFamily(
            "expertmesh_worker_resident_adapters",
            "LoRA adapters resident",
            value=self.metrics.resident_adapters,
        )


def _combine(st: Any) -> Iterator[Metric]:
    """Cross-coordinator batching: calls that combined several streams' requests, and the
    requests held for another stream's request of their layer (met: it came in time)."""
    yield CounterMetricFamily(
        "expertmesh_worker_combined_calls",
        "Layer computations that combined the requests of several streams",
        value=st.batches,
    )
    yield CounterMetricFamily(
        "expertmesh_worker_combined_requests", "Requests computed in combined calls", value=st.combined
    )
    held = CounterMetricFamily(
        "expertmesh_worker_combine_waits",
        "Requests held for other streams' request of their layer, by outcome",
        labels=["outcome"],
    )
    held.add_metric(["met"], st.met)
    held.add_metric(["timed_out"], st.waits - st.met)
    yield held
    yield CounterMetricFamily(
        "expertmesh_worker_combine_wait_seconds",
        "Time requests were held for other streams' request of their layer",
        value=st.wait_seconds,
    )


def _memory(slots: Any) -> Iterator[Metric]:
    """Expert bytes (live + staged) and their peak; the process's RSS and, on CUDA, torch's
    bytes on the GPU, now and at their peak (scraped: /proc and the allocator's counters)."""
    from expertmesh.worker import memory  # NOTE: the worker imports this module

    dev_now, dev_peak = memory.device_bytes(slots.device)
    for name, doc, value in (
        ("expert_bytes", "Routed expert weights resident (live placement + staged)", slots.resident_bytes()),
        ("expert_peak_bytes", "Most routed expert bytes held at once since start", slots.peak_bytes),
        ("process_resident_bytes", "Resident set of the server process", memory.process_rss_bytes()),
        (
            "process_peak_resident_bytes",
            "Largest resident set of the process",
            memory.process_peak_rss_bytes(),
        ),
        ("device_allocated_bytes", "Bytes torch has allocated on the server's GPU", dev_now),
        ("device_peak_allocated_bytes", "Most bytes torch had allocated on the server's GPU", dev_peak),
    ):
        yield GaugeMetricFamily(f"expertmesh_worker_{name}", doc, value=value)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> tuple[Any, Thread, int]:
    """Starts prometheus_client's own HTTP server (a thread) for ``registry``; returns
    ``(server, thread, bound port)``; ``server.shutdown()`` stops it."""
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise BindError(f"{host}:{port}", "--metrics-port", e.strerror or "") from None
    return server, thread, int(server.server_port)
