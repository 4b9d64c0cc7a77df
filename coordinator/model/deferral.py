"""Deferred CPU experts (``--cpu-defer-experts N``, KTransformers-style; changes results).

What is computed, exactly. For each token of an MoE layer ``l``, among its top-k (token, k) pairs
whose chosen physical slot lives on a CPU expert server, the ``N`` with the lowest routing
weight (ties: the lower k first) are *deferred*: they go to their CPU server after the layer's
other pairs, and the layer's MLP output holds only the other pairs (plus the shared expert).
The deferred pairs' weighted partial sum ``D_l [T, H]`` is added to the residual stream at the
end of the *next* decoder layer ``l + 1``, together with that layer's own MLP output:

    x_{l+2} = h_{l+1} + mlp_{l+1}(norm(h_{l+1})) + D_l,   h_{l+1} = x_{l+1} + attn_{l+1}(...)

so layer ``l + 1``'s attention and MoE never see ``D_l``; layer ``l + 2`` does. ``D`` of the
last layer is added to the residual stream before the final norm (nothing is lost). A dense
layer in between still counts as "the next layer". Pairs on GPU servers are never deferred, nor
any pair of a step that runs wholly on the GPU server (``--gpu-prefill-token-threshold``).
Deferral applies to every step, prefill and decode, eager or replayed from the piecewise decode
graphs of a CUDA coordinator (coordinator/model/remote_graphs.py adds ``D_l`` to layer ``l + 1``'s
routed output between two segments; a model with a dense layer between two MoE layers decodes
eagerly instead).

Why it helps: an expert server computes its requests in arrival order, so while the coordinator
runs layer ``l + 1``'s attention and router, the CPU server is still busy with ``D_l`` instead of
idling; ``D_l`` is awaited only after layer ``l + 1``'s own experts were sent.

``N = 0`` (the default) changes nothing: no pair is held back and the model adds nothing.

Shapes: T tokens, K top-k, H hidden.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from coordinator.model.dispatch import Dispatcher, Pending


def defer_mask(
    weights: torch.Tensor,  # [T, K] routing weights
    on_cpu: torch.Tensor,  # [T, K] bool: the pair's chosen slot lives on a CPU server
    n: int,
) -> torch.Tensor | None:  # [T, K] bool, or None when no pair is deferred
    """Each token's ``n`` lowest-weight CPU pairs (ties: lower k first)."""
    if n <= 0 or not bool(on_cpu.any()):
        return None
    key = torch.where(on_cpu, weights.float(), torch.inf)  # [T, K] GPU pairs sort last
    order = torch.sort(key, dim=1, stable=True).indices[:, :n]  # [T, min(n, K)]
    held = torch.zeros_like(on_cpu)
    held.scatter_(1, order, True)
    return held & on_cpu


class _Held(Pending):
    """A deferred sum; ``awaited`` once its wait began (a failed wait frees its own answers)."""

    def __init__(self, wait: Callable[[], torch.Tensor], abandon: Callable[[], None]) -> None:
        super().__init__(self._run)
        self._inner, self.abandon, self.awaited = wait, abandon, False

    def _run(self) -> torch.Tensor:  # [T, H]
        self.awaited = True
        return self._inner()


class DeferredSums:
    """The dispatcher side: deferred partial sums handed from ``submit`` to the model loop.

    ``put`` stores a layer's deferred sum (its wait, and a callback that frees its answers if it
    is never awaited); the model takes it right after that layer (:meth:`take`). A step that
    fails part-way leaves sums un-awaited: :meth:`reset` (at the next step's start) frees their
    answers, so nothing of an old step is ever added to a new one.
    """

    def __init__(self, n: int) -> None:
        assert n > 0, f"{n=}"
        self.n = n
        self._next: Pending | None = None
        self._open: list[_Held] = []

    def put(self, wait: Callable[[], torch.Tensor], abandon: Callable[[], None]) -> None:
        held = _Held(wait, abandon)
        self._next = held
        self._open.append(held)

    def take(self) -> Pending | None:
        p, self._next = self._next, None
        return p

    def reset(self) -> None:
        for held in self._open:
            if not held.awaited:
                held.abandon()
        self._open.clear()
        self._next = None


class Carry:
    """The model side: the previous MoE layer's deferred sum, not yet in the residual stream.

    ``after_layer(y)`` adds the sum of the layer before the one just run to ``y`` (the residual
    stream, or on the fused CUDA path the layer's not-yet-added MLP output) and picks up the
    just-run layer's own; ``finish(y)`` adds the last one before the final norm. With no
    deferral both return ``y`` itself (bit-identical to a model without this hook).
    """

    def __init__(self, dispatcher: Dispatcher | None) -> None:
        self.dispatcher = dispatcher
        self._prev: Pending | None = None

    def after_layer(self, y: torch.Tensor) -> torch.Tensor:  # [T, H]
        if self.dispatcher is None:
            return y
        prev, self._prev = self._prev, self.dispatcher.take_deferred()
        return y if prev is None else y + prev.wait()

    def finish(self, y: torch.Tensor) -> torch.Tensor:  # [T, H]
        prev, self._prev = self._prev, None
        return y if prev is None else y + prev.wait()
