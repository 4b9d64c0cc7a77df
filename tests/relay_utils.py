"""Shared by the relay's tests: a pair of relays over loopback and Python stand-ins for the
server's compute and the coordinator's graph (tests/test_relay.py, tests/test_relay_gpu.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import numpy as np
import torch

from expertmesh.transport import link
from expertmesh.transport import relay as rl
from expertmesh.transport.delay_proxy import DelayProxy

R, H, K, DT = 8, 64, 4, torch.bfloat16


def areas() -> tuple[torch.Tensor, torch.Tensor]:
    _, req, ans = rl.host_areas(R, H, K, DT)
    return req, ans


def expected(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What the stand-in server computes: [T, H] from x [T, H], ids/w [T, K] (uses all three)."""
    return (2 * x.float() + (ids.float() * w).sum(1, keepdim=True)).to(DT)


def spin(flag: np.ndarray, want: int, timeout_s: float = 10.0) -> bool:
    end = time.monotonic() + timeout_s
    while flag[0] != want:
        if time.monotonic() > end:
            return False
        time.sleep(0)  # NOTE: releases the GIL for the other Python side of the test
    return True


class Compute:
    """The server's compute, told each step as the control plane would tell it; answers
    ``expected`` for each layer's request in its request area."""

    def __init__(self, relay: rl.Relay) -> None:
        self.req, self.ans = relay.req, relay.ans
        self.flag, self.ans_flag = self.req.flag.numpy(), self.ans.flag.numpy()
        self.status = self.ans.status.numpy()
        self.errors: list[str] = []

    def run_step(self, step: int, rows: int, layers: int) -> threading.Thread:
        def body() -> None:
            for i in range(layers):
                want = step * link.STEP_SPAN + i + 1
                if not spin(self.flag, want):
                    self.errors.append(f"step {step} layer {i}: no request")
                    return
                self.ans.out[:rows] = expected(self.req.x[:rows], self.req.ids[:rows], self.req.w[:rows])
                self.status[0] = 0
                self.ans_flag[0] = want

        t = threading.Thread(target=body, daemon=True)
        t.start()
        return t


class Graph:
    """The coordinator's graph: writes each layer's request, then its flag; waits for the answer."""

    def __init__(self, relay: rl.Relay, seed: int = 0) -> None:
        self.relay, self.req, self.ans = relay, relay.req, relay.ans
        self.flag, self.ans_flag = self.req.flag.numpy(), self.ans.flag.numpy()
        self.gen = torch.Generator().manual_seed(seed)

    def layer(self, step: int, i: int, rows: int, real: int | None = None) -> tuple[torch.Tensor, int, float]:
        """(out [rows, H], status, seconds from the request flag to the answer flag)."""
        want = step * link.STEP_SPAN + i + 1
        x = torch.randn(rows, H, generator=self.gen).to(DT)
        ids = torch.randint(0, 16, (rows, K), generator=self.gen, dtype=torch.int32)
        ids[real if real is not None else rows :] = -1  # padding rows of a bucket
        w = torch.rand(rows, K, generator=self.gen)
        self.req.x[:rows], self.req.ids[:rows], self.req.w[:rows] = x, ids, w
        self.expect = expected(x, ids, w)
        t0 = time.perf_counter()
        self.flag[0] = want
        assert spin(self.ans_flag, want), f"no answer to step {step} layer {i}"
        return self.ans.out[:rows].clone(), int(self.ans.status), time.perf_counter() - t0


def connect(port: int, listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    c = socket.create_connection(("127.0.0.1", port), timeout=5)
    s, _ = listener.accept()
    return c, s


@contextlib.contextmanager
def pair(
    cfg: rl.RelayConfig | None = None,
    delay_us: float | None = None,
    co_cfg: rl.RelayConfig | None = None,
    co_areas: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> Iterator[tuple]:
    """Both relays connected over loopback (through the delay proxy when ``delay_us``);
    ``co_areas``: the coordinator's (request, answer), else fresh ones."""
    cfg = cfg or rl.RelayConfig(timeout_s=5.0)
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(rl.Relay.server(*areas(), R, H, K, DT, cfg))
        co = stack.enter_context(rl.Relay.coordinator(*(co_areas or areas()), R, H, K, DT, co_cfg or cfg))
        listener = stack.enter_context(socket.create_server(("127.0.0.1", 0)))
        port = listener.getsockname()[1]
        if delay_us is not None:
            port = stack.enter_context(DelayProxy(("127.0.0.1", port), delay_us=delay_us)).port
        c, s = connect(port, listener)
        assert srv.attach(s) and co.attach(c)
        yield co, srv, listener
