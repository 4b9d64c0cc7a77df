"""From measured load and the live placement to the next placement, with its predicted effect.

Pure functions (no gRPC, no threads): the EPLB manager calls :func:`plan_rebalance` off the
serving thread and pushes the result. A plan is *skipped* when the live placement is already
within ``skip_threshold`` of the plan's predicted slowest-server time (summed over layers).

Shapes: L MoE layers, E logical experts, P physical slots, S servers.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass

import torch

from coordinator.eplb.hetero import rebalance_heterogeneous, server_times, slot_shares
from coordinator.eplb.moves import (
    align_servers,
    rebalance_few_moves,
    server_classes,
    weights_moved,
    with_replica_slots,
)
from expertmesh import placement as pl

TIME_MODELS = ("affine", "proportional")


@dataclass(frozen=True)
class EplbConfig:
    interval_steps: int = 0  # 0 = no periodic rebalance
    window_steps: int = 256  # load window the plan balances
    redundant_slots: int = 0  # extra slots per server for replicas
    skip_threshold: float = 0.05  # skip unless the slowest server gets this much faster
    move_threshold: float = 0.05  # keep an expert in place unless that costs more than this
    # expert weights one rebalance may load (0: no cap): the layers that gain most per weight
    # moved go first, the rest wait for the next rebalance, so each commit's pause stays short;
    # a plan that adds replica slots adds them beside the live ones, plus the capped moves
    max_moves: int = 0
    # the same cap in MiB of expert weights (0: none), on by default: uncapped, the first plan
    # with replica slots re-placed most experts of every layer (13 GB at 24 layers of
    # Qwen3-30B-A3B) and rebalances stalled decode steps 3.1-4.7x their median against 2.0-2.2x
    # under a ~1 GiB cap (2x H200, benchmarks/RESULTS.md); the lower of the two caps holds
    max_move_mb: int = 1024
    # how a server's layer is priced: "affine", a fixed part plus a time per token, both fitted
    # from the servers' compute times (coordinator/eplb/time_model.py), or "proportional",
    # tokens over measured tokens per ms, whose plans swung between two placements at full size
    time_model: str = "affine"

    def __post_init__(self) -> None:
        if self.interval_steps < 0:
            raise ValueError(f"--eplb-interval-steps must be >= 0, got {self.interval_steps}")
        if self.window_steps < 1:
            raise ValueError(f"--eplb-window-steps must be >= 1, got {self.window_steps}")
        if self.redundant_slots < 0:
            raise ValueError(f"--eplb-redundant-slots must be >= 0, got {self.redundant_slots}")
        if self.max_moves < 0:
            raise ValueError(f"--eplb-max-moves must be >= 0, got {self.max_moves}")
        if self.max_move_mb < 0:
            raise ValueError(f"--eplb-max-move-mb must be >= 0, got {self.max_move_mb}")
        if self.time_model not in TIME_MODELS:
            raise ValueError(
                f"--eplb-time-model must be one of {', '.join(TIME_MODELS)}, got {self.time_model!r}"
            )
        for name in ("skip_threshold", "move_threshold"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        g = p.add_argument_group("EPLB (periodic expert re-placement)")
        g.add_argument("--eplb-interval-steps", type=int, default=0, help="rebalance every N steps (0 = off)")
        g.add_argument(
            "--eplb-window-steps", type=int, default=256, help="balance the load of the last W steps"
        )
        g.add_argument(
            "--eplb-redundant-slots", type=int, default=0, help="extra slots per server for replicas"
        )
        g.add_argument(
            "--eplb-skip-threshold",
            type=float,
            default=0.05,
            help="skip a rebalance unless it makes the slowest server this much faster (fraction)",
        )
        g.add_argument(
            "--eplb-move-threshold",
            type=float,
            default=0.05,
            help="keep a layer's experts in place unless moving them gains more than this (fraction)",
        )
        g.add_argument(
            "--eplb-max-moves",
            type=int,
            default=0,
            help="load at most N expert weights per rebalance, the layers that gain most per weight "
            "first (0 = no cap; a plan that adds replica slots adds them beside the live ones "
            "and loads them beside the cap)",
        )
        g.add_argument(
            "--eplb-max-move-mb",
            type=int,
            default=1024,
            help="the same cap in MiB of expert weights (default 1024; 0 = none; with both, the lower holds)",
        )
        g.add_argument(
            "--eplb-time-model",
            choices=TIME_MODELS,
            default="affine",
            help="how a plan prices a server's layer: affine (a fixed part plus a time per token, "
            "fitted from the servers' compute times; default) or proportional (tokens over "
            "measured tokens per ms)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EplbConfig:
        return cls(
            interval_steps=args.eplb_interval_steps,
            window_steps=args.eplb_window_steps,
            redundant_slots=args.eplb_redundant_slots,
            skip_threshold=args.eplb_skip_threshold,
            move_threshold=args.eplb_move_threshold,
            max_moves=args.eplb_max_moves,
            max_move_mb=args.eplb_max_move_mb,
            time_model=args.eplb_time_model,
        )

    def move_cap(self, expert_bytes: int) -> int:
        """Expert weights one rebalance may load, from both caps (0: no cap; at least one)."""
        caps = [self.max_moves] if self.max_moves else []
        if self.max_move_mb:
            caps.append(max(1, (self.max_move_mb << 20) // max(expert_bytes, 1)))
        return min(caps, default=0)


@dataclass(frozen=True)
class RebalancePlan:
    placement: pl.Placement | None  # None when skipped
    skipped: bool
    reason: str
    token_balance_before: float  # mean over layers of max/mean tokens per server
    token_balance_after: float
    time_before: float  # slowest-server time summed over layers (relative units)
    time_after: float
    weights_moved: int
    bytes_moved: int
    compute_ms: float
    layers_kept: int
    layers_searched: int
    layers_scratch: int
    servers: str = ""  # how each server's layer was priced (the manager's time model), for the log

    def summary(self) -> str:
        head = "skip" if self.skipped else "plan"
        return (
            f"{head}: {self.reason}; token max/mean {self.token_balance_before:.3f} -> "
            f"{self.token_balance_after:.3f}, slowest-server time {self.time_before:.4g} -> "
            f"{self.time_after:.4g}, {self.weights_moved} expert weights ({self.bytes_moved / 2**20:.1f} MiB) "
            f"to load, layers kept/searched/scratch {self.layers_kept}/{self.layers_searched}/"
            f"{self.layers_scratch}, computed in {self.compute_ms:.1f} ms"
            + (f"; {self.servers}" if self.servers else "")
        )


def placement_tensors(p: pl.Placement, moe_layers: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``phy2log [L, P]`` and ``owner [L, P]``; None when layers have different slot counts."""
    sizes = {len(p.layers[layer].phy2log) for layer in moe_layers}
    if len(sizes) != 1:
        return None
    phy2log = torch.tensor([p.layers[layer].phy2log for layer in moe_layers], dtype=torch.long)
    owner = torch.tensor([p.layers[layer].owner for layer in moe_layers], dtype=torch.long)
    return phy2log, owner


def to_placement(
    generation: int,
    servers: tuple[str, ...],
    num_experts: int,
    moe_layers: list[int],
    phy2log: torch.Tensor,  # [L, P]
    owner: torch.Tensor,  # [L, P]
    live: pl.Placement | None = None,
) -> pl.Placement:
    """Each server's experts in slot order: ascending, or with ``live`` (over the same servers)
    as :func:`stable_slots` lays them out."""
    old = [live.server_slots(i) for i in range(len(servers))] if live is not None else None
    per_layer: dict[int, dict[str, list[int]]] = {}
    for row, layer in enumerate(moe_layers):
        lists: dict[str, list[int]] = {name: [] for name in servers}
        for e, s in zip(phy2log[row].tolist(), owner[row].tolist()):
            lists[servers[s]].append(e)
        per_layer[layer] = {
            name: stable_slots(old[i].get(layer, []), v) if old is not None else sorted(v)
            for i, (name, v) in enumerate(lists.items())
        }
    return pl.from_server_lists(generation, servers, num_experts, per_layer)


def stable_slots(live: list[int], experts: list[int]) -> list[int]:
    """``experts`` (one server's, one layer) in slot order, keeping each expert the server
    already holds in its ``live`` slot where that slot still exists; the others fill the free
    slots in ascending order. An expert server rewrites only the slots whose expert changes: in
    ascending order, one new expert would shift every slot after it, and the commit, which
    pauses serving, would copy them all."""
    want = Counter(experts)
    out: list[int | None] = [None] * len(experts)
    for slot, e in enumerate(live[: len(experts)]):
        if want[e] > 0:
            out[slot] = e
            want[e] -= 1
    rest = iter(sorted(want.elements()))
    return [e if e is not None else next(rest) for e in out]


def layer_metrics(
    weight: torch.Tensor,
    p: pl.Placement,
    moe_layers: list[int],
    speed: torch.Tensor,
    base: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # token max/mean [L], slowest time [L]
    bal, slow = [], []
    for row, layer in enumerate(moe_layers):
        lp = p.layers[layer]
        phy2log = torch.tensor([lp.phy2log])
        owner = torch.tensor([lp.owner])
        tokens = torch.zeros(1, speed.numel(), dtype=torch.float64).scatter_add_(
            1, owner, slot_shares(weight[row : row + 1], phy2log)
        )
        bal.append(float(tokens.max() / tokens.mean().clamp(min=1e-12)))
        slow.append(float(server_times(weight[row : row + 1], phy2log, owner, speed, base).max()))
    return torch.tensor(bal), torch.tensor(slow)


def _from_scratch(
    weight: torch.Tensor,
    tensors: tuple[torch.Tensor, torch.Tensor] | None,
    capacity: torch.Tensor,
    speed: torch.Tensor,
    num_replicas: int,
    e: int,
    base: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A new placement of ``num_replicas`` slots per layer, its servers' slots aligned with the
    live ones where servers are alike (so fewer experts change server); ``how`` all 2."""
    phy2log, owner, _ = rebalance_heterogeneous(weight, capacity, speed, num_replicas, base=base)
    how = torch.full((weight.shape[0],), 2, dtype=torch.int8)
    if tensors is not None:
        owner = align_servers(
            tensors[0], tensors[1], phy2log, owner, server_classes(capacity, speed, base), e
        )
    return phy2log, owner, how


def plan_rebalance(
    weight: torch.Tensor,  # [L, E] tokens per logical expert in the window
    live: pl.Placement,
    moe_layers: list[int],
    capacity: torch.Tensor,  # [S] slots per layer each server accepts
    speed: torch.Tensor,  # [S] tokens per unit time
    cfg: EplbConfig,
    expert_bytes: int,
    force: bool = False,  # plan even when the live placement is balanced enough
    base: torch.Tensor | None = None,  # [S] fixed time per layer (in the units of weight / speed)
) -> RebalancePlan:
    t0 = time.perf_counter()
    servers, e = live.servers, live.num_experts
    s = len(servers)
    num_replicas = min(e + cfg.redundant_slots * s, int(capacity.sum()))
    if num_replicas < e:
        raise ValueError(
            f"the servers hold {int(capacity.sum())} slots per layer in all, fewer than {e} experts"
        )
    weight = weight.double().cpu()
    tensors = placement_tensors(live, moe_layers)
    cap = cfg.move_cap(expert_bytes)
    if tensors is not None and tensors[0].shape[1] == num_replicas:
        mp = rebalance_few_moves(
            weight, *tensors, capacity, speed, threshold=cfg.move_threshold, max_moves=cap, base=base
        )
        phy2log, owner, how = mp.phy2log, mp.owner, mp.how
    else:  # more or fewer slots (the first plan with replicas), or layers of mixed sizes
        phy2log, owner, how = _from_scratch(weight, tensors, capacity, speed, num_replicas, e, base)
        if (
            tensors is not None
            and tensors[0].shape[1] < num_replicas
            and cap
            and int(weights_moved(*tensors, phy2log, owner, s, e).sum()) > cap
        ):
            # NOTE: a from-scratch plan past the cap: the replicas go beside the live slots,
            # then the capped moves are planned from there. One within the cap stays: on the
            # 2-core VM at real widths the replicas-first plan, uncapped, left the balancing
            # to the next plans, which moved as much in all and, with the default one-layer
            # staging, rebuilt growing layers inside their commits
            grown = with_replica_slots(weight, *tensors, capacity, speed, num_replicas, base)
            if grown is not None and grown[0].shape[1] == num_replicas:
                mp = rebalance_few_moves(
                    weight, *grown, capacity, speed, threshold=cfg.move_threshold, max_moves=cap, base=base
                )
                phy2log, owner, how = mp.phy2log, mp.owner, mp.how
    moved_layers = (
        weights_moved(tensors[0], tensors[1], phy2log, owner, s, e)
        if tensors is not None
        else torch.full((len(moe_layers),), num_replicas)
    )
    new = to_placement(live.generation + 1, servers, e, moe_layers, phy2log, owner, live)
    bal_before, t_before = layer_metrics(weight, live, moe_layers, speed, base)
    bal_after, t_after = layer_metrics(weight, new, moe_layers, speed, base)
    gain = 1.0 - float(t_after.sum()) / max(float(t_before.sum()), 1e-12)
    moved = int(moved_layers.sum())
    skipped = not force and (gain < cfg.skip_threshold or moved == 0)
    if moved == 0:
        reason = "no expert would move"
    elif skipped:
        reason = f"balanced: predicted gain {gain:.1%} < {cfg.skip_threshold:.1%}"
    else:
        reason = f"predicted gain {gain:.1%}"
    hows = torch.bincount(how.long(), minlength=3).tolist()
    return RebalancePlan(
        placement=None if skipped else new,
        skipped=skipped,
        reason=reason,
        token_balance_before=float(bal_before.mean()),
        token_balance_after=float(bal_after.mean()),
        time_before=float(t_before.sum()),
        time_after=float(t_after.sum()),
        weights_moved=moved,
        bytes_moved=moved * expert_bytes,
        compute_ms=(time.perf_counter() - t0) * 1e3,
        layers_kept=hows[0],
        layers_searched=hows[1],
        layers_scratch=hows[2],
    )
