"""Expert load recorder: per (MoE layer, logical expert) token counts over the last W forward
steps and since start, plus per-server compute time per layer from the servers' replies.

Counts stay on the model's device in a ring buffer ``[W, L, E]``; recording a layer is one
``index_add_`` (no host sync: ``bincount`` would sync on CUDA to size its output). A new step
begins when the first MoE layer is recorded: every forward step runs the MoE layers in order.
The host reads the counts only when asked (:meth:`snapshot`).

Shapes: W window steps, L MoE layers, E logical experts, S servers.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoadSnapshot:
    moe_layers: tuple[int, ...]
    window_steps: int  # steps covered by ``window`` (<= W)
    steps: int  # steps recorded since start
    window: torch.Tensor  # [L, E] int64 tokens in the last ``window_steps`` steps
    totals: torch.Tensor  # [L, E] int64 tokens since start
    server_ms: torch.Tensor  # [S, L] float64 compute ms per layer over the window
    server_tokens: torch.Tensor  # [S, L] float64 tokens they computed over the window
    # [S] float64 each server's compute ms and tokens since start (its speed when the window
    # has none of its answers: a server that EPLB left without load stays as fast as it was)
    server_ms_total: torch.Tensor
    server_tokens_total: torch.Tensor
    # [W, S, L] float64 the same per step of the window (zeros: no answer), what the planner's
    # time model is fitted on (coordinator/eplb/time_model.py)
    server_ms_steps: torch.Tensor | None = None
    server_tokens_steps: torch.Tensor | None = None

    def server_speed(self) -> torch.Tensor | None:  # [S] tokens per ms, NaN unknown; None: none known
        """Each server's tokens per ms of its own compute time over the window, else since
        start; NaN for a server never measured, None when no server was."""
        ms, tok = self.server_ms.sum(1), self.server_tokens.sum(1)
        speed, since_start = _speed(ms, tok), _speed(self.server_ms_total, self.server_tokens_total)
        speed = torch.where(speed.isnan(), since_start, speed)  # NOTE: both grow with the servers
        if bool(speed.isnan().all()):
            return None
        return speed


def _speed(ms: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:  # [S] tokens per ms, NaN: none
    return torch.where((ms > 0) & (tokens > 0), tokens / ms.clamp(min=1e-12), float("nan"))


class LoadRecorder:
    def __init__(
        self,
        moe_layers: list[int],
        num_experts: int,
        window_steps: int,
        num_servers: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        assert window_steps >= 1, f"{window_steps=}"
        self.moe_layers = tuple(moe_layers)
        self.row = {layer: i for i, layer in enumerate(moe_layers)}
        self.num_experts, self.window_steps = num_experts, window_steps
        self.device = torch.device(device)
        shape = (window_steps, len(moe_layers), num_experts)
        self.ring = torch.zeros(shape, dtype=torch.long, device=self.device)  # [W, L, E]
        self.retired = torch.zeros(shape[1:], dtype=torch.long, device=self.device)  # [L, E]
        self._ones = torch.ones(1, dtype=torch.long, device=self.device)
        # [L, 1, 1] the flat offset of each layer's row in a ring slot (record_step)
        self._base = (torch.arange(len(moe_layers), device=self.device) * num_experts).view(-1, 1, 1)
        self.server_ms = torch.zeros(window_steps, num_servers, len(moe_layers), dtype=torch.float64)
        self.server_tokens = torch.zeros_like(self.server_ms)  # [W, S, L]
        self.server_ms_total = torch.zeros(num_servers, dtype=torch.float64)  # [S] since start
        self.server_tokens_total = torch.zeros_like(self.server_ms_total)
        self.steps = 0
        self.cursor = 0
        # NOTE: record() runs on the serving thread only; the lock orders a step change
        # against readers (snapshot) and reply threads (record_server_time).
        self._lock = threading.Lock()

    def _advance(self) -> None:
        with self._lock:
            self.steps += 1
            self.cursor = (self.steps - 1) % self.window_steps
            if self.steps > self.window_steps:  # the slot's old step leaves the window
                self.retired += self.ring[self.cursor]
                self.ring[self.cursor].zero_()
                self.server_ms[self.cursor].zero_()
                self.server_tokens[self.cursor].zero_()

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:  # topk_ids [T, K]
        """The load hook of :class:`MoEBlock`: adds this layer's routed tokens."""
        row = self.row[layer]
        if row == 0:
            self._advance()
        ids = topk_ids.reshape(-1).to(device=self.device, dtype=torch.long)
        self.ring[self.cursor, row].index_add_(0, ids, self._ones_for(ids.numel()))

    def record_step(self, ids: torch.Tensor) -> None:  # ids [L, T, K]
        """Every MoE layer's routed tokens of one step at once (the layers in order): what the
        decode graphs call after a replay. Why: L calls of :meth:`record` cost ~10 us of host
        time each, serial with the next step where a replay ends in a host read (the linked
        step: ~0.5 ms a token at 48 layers); this is one ``index_add_`` into the step's slot."""
        assert ids.dim() == 3 and ids.shape[0] == len(self.moe_layers), f"{tuple(ids.shape)=}"
        self._advance()
        flat = (ids.to(device=self.device, dtype=torch.long) + self._base).reshape(-1)
        self.ring[self.cursor].view(-1).index_add_(0, flat, self._ones_for(flat.numel()))

    def _ones_for(self, n: int) -> torch.Tensor:  # [n] int64 ones (grown, kept)
        if self._ones.numel() < n:
            self._ones = torch.ones(max(n, 2 * self._ones.numel()), dtype=torch.long, device=self.device)
        return self._ones[:n]

    def record_server_time(self, server: int, layer: int, compute_ms: float, tokens: int) -> None:
        """A server's reply for one layer: its compute time and the tokens it computed."""
        row = self.row.get(layer)
        if row is None or server < 0:
            return
        with self._lock:
            if server >= self.server_ms.shape[1]:  # a server that joined at run time
                grow = server + 1 - self.server_ms.shape[1]
                pad = torch.zeros(self.window_steps, grow, len(self.moe_layers), dtype=torch.float64)
                self.server_ms = torch.cat([self.server_ms, pad], 1)
                self.server_tokens = torch.cat([self.server_tokens, pad], 1)
                more = torch.zeros(grow, dtype=torch.float64)
                self.server_ms_total = torch.cat([self.server_ms_total, more])
                self.server_tokens_total = torch.cat([self.server_tokens_total, more])
            self.server_ms[self.cursor, server, row] += compute_ms
            self.server_tokens[self.cursor, server, row] += tokens
            self.server_ms_total[server] += compute_ms
            self.server_tokens_total[server] += tokens

    def snapshot(self) -> LoadSnapshot:
        """Copies the counts to the host (the one sync point)."""
        with self._lock:
            window = self.ring.sum(0)
            totals = (self.retired + window).cpu()
            return LoadSnapshot(
                self.moe_layers,
                min(self.steps, self.window_steps),
                self.steps,
                window.cpu(),
                totals,
                self.server_ms.sum(0),
                self.server_tokens.sum(0),
                self.server_ms_total.clone(),
                self.server_tokens_total.clone(),
                self.server_ms.clone(),
                self.server_tokens.clone(),
            )
