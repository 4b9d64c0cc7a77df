"""The EPLB manager: periodic and on-demand rebalancing, off the serving thread.

After each forward step the serving thread calls :meth:`EplbManager.on_step` (a counter). Every
``interval_steps`` steps it starts a rebalance on the manager's own thread:

1. snapshot the load window (the recorder's one host sync) and plan (:func:`plan_rebalance`);
   skip when the cluster is already balanced;
2. push it (the target's two-phase broadcast): PREPARE on every server (they stage the weights
   beside the live set while serving goes on); on any failure ABORT everywhere and the old
   placement stays live; else COMMIT and switch the coordinator's placement *between two
   steps* (``between_steps``), so no step mixes generations.

Every outcome (rebalanced, skipped, failed) is logged and counted; :meth:`status` reports the
counters and the last outcomes for ``Admin``.

A server that joined the pool and holds no slot yet (the target's ``joining``) makes the next
rebalance, periodic or asked for, a *grow* plan instead: copies of the hottest experts added on
it, nothing moved (coordinator/eplb/grow.py); the one after plans the whole pool again.

Expert servers shared by several coordinators: only the one holding the placement role
rebalances (the others skip, or fail an operator's request naming the holder), and it plans
with the servers' counts of every coordinator's tokens (the target's ``pool_window``) instead
of its own recorder's window.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from coordinator.eplb.grow import plan_grow
from coordinator.eplb.plan import EplbConfig, RebalancePlan, plan_rebalance
from coordinator.eplb.time_model import fit_server_times
from coordinator.experts.load_recorder import LoadRecorder, LoadSnapshot
from expertmesh import placement as pl

log = logging.getLogger("expertmesh.eplb")


class PlacementTarget(Protocol):
    """What the manager pushes placements through (the coordinator's expert cluster)."""

    # the failures prepare/commit/abort raise (typed by the cluster); anything else is a bug
    errors: tuple[type[Exception], ...]

    def live_placement(self) -> pl.Placement: ...

    def slot_capacity(self) -> torch.Tensor: ...  # [S] slots per layer each server accepts

    def default_speed(self) -> torch.Tensor: ...  # [S] tokens per unit time before measurements

    def push(
        self, placement: pl.Placement, between_steps: Callable[[Callable[[], object]], Future]
    ) -> list[str]:
        """Prepare on all servers (raise, after aborting, on any failure), then commit and
        switch through ``between_steps``; returns the servers whose commit failed (they get
        the new placement when they reconnect)."""
        ...


class RebalanceError(RuntimeError):
    pass


@dataclass
class Outcome:
    kind: str  # "rebalanced" | "skipped" | "failed" | "dry-run" | "placement-set"
    at: float  # time.time()
    trigger: str  # "periodic" | "admin" | "set-placement"
    plan: RebalancePlan | None
    generation: int  # live generation afterwards
    prepare_ms: float = 0.0
    commit_ms: float = 0.0
    error: str = ""
    window_tokens: int = 0  # routed (token, expert) pairs of the load the plan used
    load_source: str = ""  # "servers" (every coordinator's tokens) | "coordinator" (its own)

    def line(self) -> str:
        parts = [f"{self.kind} ({self.trigger}), live generation {self.generation}"]
        if self.plan is not None:
            parts.append(self.plan.summary())
        if self.kind in ("rebalanced", "placement-set"):
            parts.append(f"prepare {self.prepare_ms:.0f} ms, commit {self.commit_ms:.1f} ms")
        if self.error:
            parts.append(f"error: {self.error}")
        return "; ".join(parts)


@dataclass
class Counters:
    rebalanced: int = 0
    skipped: int = 0
    failed: int = 0
    dry_runs: int = 0
    placements_set: int = 0
    history: deque[Outcome] = field(default_factory=lambda: deque(maxlen=16))


class EplbManager:
    def __init__(
        self,
        cfg: EplbConfig,
        recorder: LoadRecorder,
        target: PlacementTarget,
        expert_bytes: int,
        between_steps: Callable[[Callable[[], object]], Future],
        commit_timeout_s: float = 60.0,
    ) -> None:
        self.cfg, self.recorder, self.target = cfg, recorder, target
        self.expert_bytes, self.between_steps = expert_bytes, between_steps
        self.commit_timeout_s = commit_timeout_s
        self.counters = Counters()
        # told each outcome's kind (the coordinator's metrics count them)
        self.on_outcome: Callable[[str], None] = lambda kind: None
        self._steps = 0
        self._busy = threading.Lock()  # one rebalance at a time
        self._thread: threading.Thread | None = None
        self._last_window: tuple[int, str] = (0, "")  # what the last plan() used
        # [S] each server's last fitted time per layer (speed, base); NaN where never fitted: a
        # server left without load this window keeps the times it had
        self._fitted: tuple[torch.Tensor, torch.Tensor] | None = None
        # perf_counter() start and end of the last push (end 0.0 while it runs), one tuple so
        # that the serving thread reads a consistent pair
        self._push_span = (0.0, 0.0)

    # ------------------------------------------------------------ triggers

    def on_step(self) -> None:
        """Serving thread, after each forward step: starts a periodic rebalance when due."""
        self._steps += 1
        n = self.cfg.interval_steps
        if not n or self._steps % n:
            return
        if not self._busy.acquire(blocking=False):
            return  # the previous one is still running; the next interval tries again
        self._thread = threading.Thread(target=self._periodic, name="eplb-rebalance", daemon=True)
        self._thread.start()

    def _periodic(self) -> None:
        try:
            self._run("periodic", dry_run=False, force=False)
        finally:
            self._busy.release()

    def rebalance(self, dry_run: bool = False, timeout_s: float = 120.0) -> Outcome:
        """One rebalance now (Admin); waits for a running one to finish first. A dry run only
        plans. An explicit request is never skipped for being balanced already."""
        if not self._busy.acquire(timeout=timeout_s):
            raise RebalanceError(f"another rebalance is still running after {timeout_s:g}s")
        try:
            return self._run("admin", dry_run=dry_run, force=True)
        finally:
            self._busy.release()

    def pushed_since(self, t0: float) -> bool:
        """Whether a placement push (prepare through commit) ran at some time after ``t0``
        (``time.perf_counter()``): the step metrics tell the steps that overlap a move."""
        started, ended = self._push_span
        return started > ended or ended >= t0

    def wait_idle(self, timeout_s: float = 120.0) -> None:
        t = self._thread
        if t is not None:
            t.join(timeout_s)

    # ------------------------------------------------------------ one rebalance

    def plan(self, force: bool) -> RebalancePlan:
        snap = self.recorder.snapshot()
        live = self.target.live_placement()
        capacity = self.target.slot_capacity()  # [S]
        speed, base = self.server_times(snap)
        measured = snap.server_speed() is not None
        servers = (
            priced(live.servers, speed, base) if measured else "server layer times not measured yet (equal)"
        )
        if base is not None:  # NOTE: the window sums its steps' tokens: a fixed time counts once a step
            base = base * max(snap.window_steps, 1)
        pool_window = getattr(self.target, "pool_window", None)  # NOTE: test targets lack it
        shared = pool_window(list(snap.moe_layers)) if pool_window is not None else None
        window = shared if shared is not None else snap.window  # [L, E]
        self._last_window = (int(window.sum()), "servers" if shared is not None else "coordinator")
        joining: list[int] = getattr(self.target, "joining", list)()  # NOTE: test targets lack it
        if joining:
            plan = plan_grow(
                window, live, list(snap.moe_layers), joining, capacity, speed, self.expert_bytes, base
            )
        else:
            plan = plan_rebalance(
                window.double(),
                live,
                list(snap.moe_layers),
                capacity,
                speed,
                self.cfg,
                self.expert_bytes,
                force=force,
                base=base,
            )
        return replace(plan, servers=servers)

    def server_times(self, snap: LoadSnapshot) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[S]`` tokens per ms and ``[S]`` fixed ms per layer (None: the proportional model)
        that the plan prices each server's layer with (coordinator/eplb/time_model.py)."""
        default = self.target.default_speed()
        ms, tokens = snap.server_ms_steps, snap.server_tokens_steps
        if self.cfg.time_model == "proportional" or ms is None or tokens is None:
            return fit_speed(snap.server_speed(), default), None
        fit = fit_server_times(ms, tokens)
        speed, base = fit.speed, fit.base
        if self._fitted is not None:
            old_speed, old_base = self._fitted
            n = min(old_speed.numel(), speed.numel())
            speed[:n] = torch.where(speed[:n].isnan(), old_speed[:n], speed[:n])
            base[:n] = torch.where(base[:n].isnan(), old_base[:n], base[:n])
        self._fitted = (speed.clone(), base.clone())
        if bool(speed.isnan().all()):
            return fit_speed(snap.server_speed(), default), None
        # a server never fitted counts as the mean fitted one (speed and base are NaN together)
        return fit_speed(speed, default), fit_speed(base, torch.zeros_like(default, dtype=torch.float64))

    def _follower(self) -> str:
        """Why this coordinator may not push ("" when it may): another holds the placement role."""
        holds = getattr(self.target, "holds_role", None)
        if holds is None or holds():
            return ""
        holder = getattr(self.target, "role_holder", lambda: "")()
        return f"coordinator {holder or '(none yet)'} holds the placement role of the shared expert servers"

    def _run(self, trigger: str, dry_run: bool, force: bool) -> Outcome:
        live_gen = self.target.live_placement().generation
        follower = self._follower()
        if follower and not dry_run:
            kind = "skipped" if trigger == "periodic" else "failed"
            return self._record(Outcome(kind, time.time(), trigger, None, live_gen, error=follower))
        try:
            plan = self.plan(force)
        except (ValueError, RuntimeError) as e:
            return self._record(Outcome("failed", time.time(), trigger, None, live_gen, error=f"plan: {e}"))
        tokens, source = self._last_window
        if dry_run:
            return self._record(
                Outcome(
                    "dry-run", time.time(), trigger, plan, live_gen, window_tokens=tokens, load_source=source
                )
            )
        if plan.skipped or plan.placement is None:
            return self._record(
                Outcome(
                    "skipped", time.time(), trigger, plan, live_gen, window_tokens=tokens, load_source=source
                )
            )
        out = self._push(plan.placement, trigger, plan)
        out.window_tokens, out.load_source = tokens, source
        return out

    def set_placement(self, new: pl.Placement, timeout_s: float = 120.0) -> Outcome:
        """Pushes an operator's placement (Admin/SetPlacement) as the next generation."""
        if not self._busy.acquire(timeout=timeout_s):
            raise RebalanceError(f"a rebalance is still running after {timeout_s:g}s")
        try:
            live = self.target.live_placement()
            follower = self._follower()
            if follower:
                return self._record(
                    Outcome("failed", time.time(), "set-placement", None, live.generation, error=follower)
                )
            return self._push(new.with_generation(live.generation + 1), "set-placement", None)
        finally:
            self._busy.release()

    def _push(self, new: pl.Placement, trigger: str, plan: RebalancePlan | None) -> Outcome:
        errors: tuple[type[Exception], ...] = (*self.target.errors, TimeoutError)
        t0 = time.perf_counter()
        marks: dict[str, float] = {}

        def timed_between_steps(fn: Callable[[], object]) -> Future:
            marks["prepared"] = time.perf_counter()

            def switch() -> object:
                t = time.perf_counter()
                try:
                    return fn()
                finally:
                    marks["commit_ms"] = (time.perf_counter() - t) * 1e3

            return self.between_steps(switch)

        self._push_span = (t0, 0.0)
        try:
            late = self.target.push(new, timed_between_steps)
        except errors as e:
            gen = self.target.live_placement().generation
            stage = "commit" if "prepared" in marks else "prepare"
            return self._record(Outcome("failed", time.time(), trigger, plan, gen, error=f"{stage}: {e}"))
        finally:
            self._push_span = (t0, time.perf_counter())
        prepare_ms = (marks.get("prepared", time.perf_counter()) - t0) * 1e3
        mark = getattr(self.target, "mark_pushed", None)
        if mark is not None:  # the next shared load window starts at this placement
            mark(list(self.recorder.moe_layers))
        kind = "rebalanced" if plan is not None else "placement-set"
        out = Outcome(
            kind, time.time(), trigger, plan, new.generation, prepare_ms, marks.get("commit_ms", 0.0)
        )
        if late:
            out.error = (
                f"commit failed on {', '.join(late)}; they get generation {new.generation} on reconnect"
            )
        return self._record(out)

    def _record(self, out: Outcome) -> Outcome:
        c = self.counters
        if out.kind == "rebalanced":
            c.rebalanced += 1
        elif out.kind == "skipped":
            c.skipped += 1
        elif out.kind == "failed":
            c.failed += 1
        elif out.kind == "placement-set":
            c.placements_set += 1
        else:
            c.dry_runs += 1
        c.history.append(out)
        self.on_outcome(out.kind)
        (log.warning if out.kind == "failed" else log.info)("EPLB %s", out.line())
        return out


def priced(names: tuple[str, ...], speed: torch.Tensor, base: torch.Tensor | None) -> str:
    """Each server's layer as the plan priced it: ``gpu0 0.210 ms + 1.00 us/token, ...``."""
    parts = []
    for name, rate, fixed in zip(
        names, speed.tolist(), base.tolist() if base is not None else [0.0] * len(names)
    ):
        parts.append(f"{name} {fixed:.3f} ms + {1e3 / rate:.2f} us/token")
    return "server layer times " + ", ".join(parts)


def fit_speed(measured: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:  # [S]
    """The measured speeds ``[S0]`` (tokens per ms, positive, NaN for a server never measured;
    None before any server answered) over the ``S`` servers of ``default`` (``S >= S0``): a
    server never measured, or joined since the recorder was sized, counts as fast as the mean
    measured one; with none measured, ``default``. The fitted fixed times per layer are spread
    over the servers the same way."""
    if measured is None or bool(measured.isnan().all()):
        return default
    s = default.numel()
    mean = float(measured[~measured.isnan()].mean())
    out = torch.full((s,), mean, dtype=measured.dtype)
    n = min(s, measured.numel())
    out[:n] = torch.where(measured[:n].isnan(), mean, measured[:n])
    return out
