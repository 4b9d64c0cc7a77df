"""Prometheus metrics of the coordinator, served at ``/metrics`` of its HTTP server.

One :class:`CoordinatorMetrics` per coordinator, with its own ``CollectorRegistry`` (no global
registry: several coordinators in one process, as in the tests, keep separate numbers).

Two kinds of numbers:

- observed as things happen, through small hooks: request outcomes and latencies (the
  scheduler wraps each request's sink with :meth:`CoordinatorMetrics.track`), tokens per step
  (:meth:`CoordinatorMetrics.step`), each step's wall time, labelled by whether a placement
  move overlapped it (:meth:`CoordinatorMetrics.step_time`), per-server layer round trips (the
  remote dispatcher calls :meth:`CoordinatorMetrics.round_trip`), rebalance and LoRA events (:meth:`rebalance`,
  :meth:`lora_event`, for the EPLB and LoRA managers);
- read at scrape time from state the coordinator keeps anyway (:class:`_StateCollector`):
  running / waiting requests, KV pages (prefix-cached ones too), preemptions, the expert-load recorder's per-(layer,
  expert) token counts, the expert servers' state and transport, the placement generation.

Names follow Prometheus' conventions: ``expertmesh_`` prefix, base units (``_seconds``),
counters end in ``_total``.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.serving.outputs import DeadlineExceeded, Output, Sink

# request latencies: 5 ms .. 5 min
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# per output token and per layer round trip: 100 us .. 5 s
_FAST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5)
_STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# per step: 1 ms .. 32 s in quarter octaves (a bucket spans 19%): fine enough to compare the
# steps during a placement move with the median step
_STEP_SECONDS_BUCKETS = tuple(round(2 ** (i / 4) / 1000, 6) for i in range(61))
# steps overlapping a placement push (prepare through commit) and the others
PLACEMENT_PHASES = ("steady", "moving")
# a step whose sequences each computed one token, or one that carried prompt tokens (a prefill
# or an extend, beside decodes or not): their times differ by orders of magnitude
STEP_KINDS = ("decode", "prefill")

# a decode step this many times the recent median (and at least SLOW_STEP_MIN_S) is logged with
# where it waited, at most once per SLOW_STEP_LOG_S: a metric says that steps were slow, the log
# line says which expert server they waited on
SLOW_STEP_FACTOR = 4.0
SLOW_STEP_MIN_S = 0.05
SLOW_STEP_LOG_S = 1.0
_RECENT_DECODES = 256  # decode steps the median is taken over (at least 32 before any log)

log = logging.getLogger("expertmesh.coordinator")

# request outcomes counted by expertmesh_requests_total{status}
# ("deadline": its deadline passed; "rejected": refused by a full queue, never started)
STATUSES = ("stop", "length", "cancelled", "error", "invalid", "deadline", "rejected")


class CoordinatorMetrics:
    """The coordinator's metrics. ``coord`` is the CoordinatorServer (read at scrape time)."""

    def __init__(self, coord: Any) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("expertmesh_requests", "Finished requests by outcome", ["status"], registry=r)
        for s in STATUSES:
            self.requests.labels(s)  # exported at 0 from the start
        self.prompt_tokens = Counter(
            "expertmesh_prompt_tokens", "Prompt tokens of submitted requests", registry=r
        )
        self.prompt_tokens_cached = Counter(
            "expertmesh_prompt_tokens_cached",
            "Prompt tokens whose KV pages came from the prefix cache (counted at admission)",
            registry=r,
        )
        self.prompt_tokens_computed = Counter(
            "expertmesh_prompt_tokens_computed",
            "Prompt tokens not found in the prefix cache, computed (counted at admission)",
            registry=r,
        )
        self.generation_tokens = Counter(
            "expertmesh_generation_tokens", "Tokens generated (counted as they are)", registry=r
        )
        self.ttft = Histogram(
            "expertmesh_time_to_first_token_seconds",
            "From submission to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "expertmesh_time_per_output_token_seconds",
            "Mean time per generated token after the first, per request",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "expertmesh_e2e_request_latency_seconds",
            "From submission to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            "expertmesh_step_tokens",
            "Tokens per forward step (decodes + prefill chunks)",
            buckets=_STEP_TOKEN_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "expertmesh_step_seconds",
            "Wall time of each forward step: the calls run between steps just before it "
            "(placement commits, reconnections), scheduling, the forward and sampling; "
            'placement="moving" when a placement push (prepare through commit) overlapped it; '
            'kind="decode" when every sequence computed one token, else "prefill"',
            ["placement", "kind"],
            buckets=_STEP_SECONDS_BUCKETS,
            registry=r,
        )
        self.step_seconds_max = Gauge(
            "expertmesh_step_seconds_max",
            "The longest step since the coordinator started (as expertmesh_step_seconds)",
            ["placement", "kind"],
            registry=r,
        )
        keys = [(p, k) for p in PLACEMENT_PHASES for k in STEP_KINDS]
        self._step_children = {key: self.step_seconds.labels(*key) for key in keys}
        self._step_max_children = {key: self.step_seconds_max.labels(*key) for key in keys}
        self._step_max = dict.fromkeys(keys, 0.0)
        self.layer_round_trip = Histogram(
            "expertmesh_expert_layer_round_trip_seconds",
            "Per expert server: from sending one MoE layer's tokens to holding its answer "
            "(overlaps the coordinator's own shared-expert compute)",
            ["server"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.rebalances = Counter(
            "expertmesh_rebalances",
            "EPLB runs by result (rebalanced, skipped, failed, dry-run, placement-set)",
            ["result"],
            registry=r,
        )
        self.lora_events = Counter(
            "expertmesh_lora_events",
            "LoRA adapter events (load, load_failed, unload)",
            ["event"],
            registry=r,
        )
        r.register(_StateCollector(coord))
        self._round_trip_children: dict[str, Any] = {}
        # plain running totals for Admin/ListServers (`expertmesh status`): prompt tokens are
        # added by the submitting thread (the event loop), the rest on the scheduler thread
        self.started = time.monotonic()
        self.finished = self.prompt_total = self.generated_total = self.prompt_cached_total = 0
        self.round_trips: dict[str, list[float]] = {}  # server -> [count, seconds]
        # this step's layer round trips per server: [layers, seconds, longest] (scheduler thread)
        self._step_trips: dict[str, list[float]] = {}
        self._recent: deque[float] = deque(maxlen=_RECENT_DECODES)  # recent decode steps, seconds
        self._median = 0.0  # of _recent, recomputed every 32 decode steps
        self._decodes = 0
        self._slow_logged = 0.0
        # the two hooks that observe the hot path
        coord.scheduler.metrics = self
        self._eplb = coord.eplb
        coord.lora.on_event = self.lora_event
        if coord.eplb is not None:
            coord.eplb.on_outcome = self.rebalance
        if hasattr(coord.dispatcher, "on_round_trip"):
            coord.dispatcher.on_round_trip = self.round_trip

    # ------------------------------------------------------------ hooks

    def track(self, sink: Sink, prompt_tokens: int) -> Sink:
        """Wraps a request's sink (called on the scheduler thread) to time the request."""
        t0 = time.monotonic()
        first: list[float] = []
        self.prompt_tokens.inc(prompt_tokens)
        self.prompt_total += prompt_tokens

        def observed(out: Output) -> None:
            if out.token_ids:
                self.generation_tokens.inc(len(out.token_ids))
                self.generated_total += len(out.token_ids)
                if not first:
                    first.append(time.monotonic())
                    self.ttft.observe(first[0] - t0)
            if out.finish_reason is not None:
                now = time.monotonic()
                self.requests.labels(_outcome(out)).inc()
                self.finished += 1
                self.e2e.observe(now - t0)
                if first and out.completion_tokens > 1:
                    self.tpot.observe((now - first[0]) / (out.completion_tokens - 1))
            sink(out)

        return observed

    def prompt_cache(self, cached: int, computed: int) -> None:
        """A request was admitted the first time with ``cached`` of its prompt tokens in the
        prefix cache (scheduler thread)."""
        self.prompt_tokens_cached.inc(cached)
        self.prompt_tokens_computed.inc(computed)
        self.prompt_cached_total += cached

    def invalid(self) -> None:
        """A request refused before it reached the scheduler (bad parameters)."""
        self.requests.labels("invalid").inc()

    def rejected(self) -> None:
        """A request refused by a full admission queue (RESOURCE_EXHAUSTED / HTTP 429)."""
        self.requests.labels("rejected").inc()

    def step(self, num_tokens: int) -> None:
        self.step_tokens.observe(num_tokens)

    def step_time(self, t0: float, decode: bool) -> None:
        """A step that began at ``t0`` (``time.perf_counter()``) just ended (scheduler thread);
        ``decode``: every sequence in it computed one token."""
        seconds = time.perf_counter() - t0
        phase = "moving" if self._eplb is not None and self._eplb.pushed_since(t0) else "steady"
        key = (phase, "decode" if decode else "prefill")
        self._step_children[key].observe(seconds)
        if seconds > self._step_max[key]:
            self._step_max[key] = seconds
            self._step_max_children[key].set(seconds)
        if decode:
            self._slow_step(seconds, phase)
        self._step_trips.clear()

    def _slow_step(self, seconds: float, phase: str) -> None:
        """Logs a decode step far above the recent median, with its expert round trips."""
        recent = self._recent
        recent.append(seconds)
        self._decodes += 1
        if self._decodes % 32 == 0 or not self._median:
            self._median = statistics.median(recent)
        slow = len(recent) >= 32 and seconds > max(SLOW_STEP_FACTOR * self._median, SLOW_STEP_MIN_S)
        now = time.monotonic()
        if not slow or now - self._slow_logged < SLOW_STEP_LOG_S:
            return
        self._slow_logged = now
        trips = "; ".join(
            f"{name} {t * 1e3:.1f} ms over {int(n)} layers (longest {top * 1e3:.1f})"
            for name, (n, t, top) in sorted(self._step_trips.items(), key=lambda kv: -kv[1][1])
        )
        log.warning(
            "slow decode step: %.1f ms, %.1fx the median of the last %d (%s); expert round trips: %s",
            seconds * 1e3, seconds / self._median, len(recent),
            "during a placement move" if phase == "moving" else "no placement move",
            trips or "none (a linked step, or no expert server)",
        )  # fmt: skip

    def round_trip(self, server: str, seconds: float) -> None:
        child = self._round_trip_children.get(server)
        if child is None:
            child = self._round_trip_children[server] = self.layer_round_trip.labels(server)
        child.observe(seconds)
        acc = self.round_trips.setdefault(server, [0, 0.0])
        acc[0] += 1
        acc[1] += seconds
        step = self._step_trips.setdefault(server, [0, 0.0, 0.0])
        step[0] += 1
        step[1] += seconds
        step[2] = max(step[2], seconds)

    def rebalance(self, result: str) -> None:
        """For the EPLB manager: an outcome's kind (``rebalanced``, ``skipped``, ``failed``, ...)."""
        self.rebalances.labels(result).inc()

    def lora_event(self, event: str) -> None:
        """For the LoRA service: ``load``, ``load_failed`` or ``unload``."""
        self.lora_events.labels(event).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector(Collector):
    """Numbers read from the coordinator's own state at scrape time."""

    def __init__(self, coord: Any) -> None:
        self.coord = coord

    def describe(self) -> list[Metric]:
        return []  # names are only known at collect time (servers, layers)

    def collect(self) -> Iterator[Metric]:
        c = self.coord
        st = c.scheduler.stats()
        yield _gauge("expertmesh_requests_running", "Requests holding KV pages", st["running"])
        yield _gauge("expertmesh_requests_waiting", "Requests queued for admission", st["waiting"])
        yield _gauge(
            "expertmesh_requests_queued",
            "Submitted requests not yet admitted, counted against --max-queued-requests",
            st["queued"],
        )
        used = st["total_pages"] - st["free_pages"]
        yield _gauge("expertmesh_kv_pages_used", "KV cache pages held by requests", used)
        yield _gauge("expertmesh_kv_pages_free", "KV cache pages free", st["free_pages"])
        yield _gauge("expertmesh_kv_pages_total", "KV cache pages", st["total_pages"])
        yield _gauge(
            "expertmesh_prefix_cache_pages",
            "KV pages in the prefix cache (held by requests, or kept and counted as free)",
            st["cached_pages"],
        )
        yield _counter("expertmesh_preemptions", "Requests preempted for KV pages", st["preemptions"])
        yield _counter("expertmesh_steps", "Forward steps run", st["steps"])
        yield _counter(
            "expertmesh_queued_decode_steps",
            "Decode steps launched behind the running one, fed its samples on the device (CUDA)",
            st["queued_steps"],
        )
        yield _counter(
            "expertmesh_queued_decode_step_failures",
            "Queued decode steps read back failed (a linked step's error), run again with the step fed by them",
            st["queued_failures"],
        )
        tokens = CounterMetricFamily(
            "expertmesh_expert_tokens",
            "(token, k) pairs routed to each logical expert of each MoE layer",
            labels=["layer", "expert"],
        )
        snap = c.load.snapshot()
        for layer, counts in zip(snap.moe_layers, snap.totals.tolist()):
            for e, n in enumerate(counts):
                tokens.add_metric([str(layer), str(e)], n)
        yield tokens
        ready = GaugeMetricFamily(
            "expertmesh_expert_server_ready",
            "1 when the expert server is connected and ready",
            labels=["server"],
        )
        transport = GaugeMetricFamily(
            "expertmesh_expert_server_transport",
            "1 for the data path in use to each expert server (grpc, shm, cuda_ipc)",
            labels=["server", "transport"],
        )
        slots = GaugeMetricFamily(
            "expertmesh_expert_server_slots_used",
            "Max over layers of the slots the placement gives it",
            labels=["server"],
        )
        relay = CounterMetricFamily(
            "expertmesh_expert_server_relay_events",
            "Relayed links over the TCP data path to each expert server: steps and layers carried, "
            "connections attached, closed by the peer or dropped, malformed frames, timeouts, aborted waits",
            labels=["server", "kind"],
        )
        for info in _server_infos(c):
            ready.add_metric([info["name"]], 1.0 if info["state"] == "ready" else 0.0)
            transport.add_metric([info["name"], info["transport"] or "none"], 1.0)
            slots.add_metric([info["name"]], info["slots_used"])
            for kind, n in info.get("relay", {}).items():
                relay.add_metric([info["name"], kind], n)
        yield ready
        yield transport
        yield slots
        yield relay
        yield _gauge(
            "expertmesh_placement_generation", "Generation of the live expert placement", _generation(c)
        )
        d: Any = getattr(c, "dispatcher", None)
        if hasattr(d, "linked_steps"):
            yield _counter(
                "expertmesh_linked_decode_steps",
                "Decode steps run as one graph over a device or host link (no host work per layer)",
                d.linked_steps,
            )
            yield _counter(
                "expertmesh_linked_micro_batched_steps",
                "Linked decode steps split into micro-batches inside their graph (--micro-batches)",
                getattr(d, "linked_micro_steps", 0),
            )
            yield _counter(
                "expertmesh_link_reruns",
                "Linked decode steps that failed on the link and ran again without it",
                d.link_reruns,
            )


def _server_infos(coord: Any) -> list[dict]:
    return coord.cluster.server_infos() if coord.cluster is not None else []


def _generation(coord: Any) -> int:
    return int(coord.cluster.placement.generation) if coord.cluster is not None else 0


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _outcome(out: Output) -> str:
    return "deadline" if isinstance(out.error, DeadlineExceeded) else str(out.finish_reason)
