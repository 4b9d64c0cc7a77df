"""DeepSeek EPLB's interface: hierarchical and global rebalancing for equal devices.

Hierarchical (``num_groups % num_nodes == 0``): expert groups are packed onto nodes (equal
group count per node) so each group stays on one node, experts are replicated within each node,
then the node's physical experts are packed onto its GPUs. Global: replicate over the whole
cluster, then pack onto all GPUs. Packing is :func:`greedy_pack` followed by :func:`refine`,
so each policy balances at least as well as DeepSeek's greedy alone.

Shapes: L layers, E logical experts, P physical slots, G groups, N nodes, D GPUs,
R max replicas of one expert.
"""

from __future__ import annotations

import torch

from coordinator.eplb.packing import greedy_pack, rank_in_pack, refine
from coordinator.eplb.replicate import replicate_experts


def balanced_packing(
    weight: torch.Tensor, num_packs: int, refine_rounds: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packs ``weight [B, N]`` into ``num_packs`` packs of exactly N/num_packs items each.
    Returns ``pack_index [B, N]`` and ``rank_in_pack [B, N]``."""
    b, n = weight.shape
    assert n % num_packs == 0, f"{n=} items do not split evenly over {num_packs=}"
    cap = torch.full((num_packs,), n // num_packs, dtype=torch.long)
    pack = greedy_pack(weight, cap)
    if n // num_packs > 1 and refine_rounds:
        pack, _ = refine(weight, pack, cap, max_rounds=refine_rounds)
    return pack, rank_in_pack(pack, num_packs)


def _inverse(perm: torch.Tensor) -> torch.Tensor:  # [B, n] permutation -> its inverse
    return torch.empty_like(perm).scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm))


def rebalance_hierarchical(
    weight: torch.Tensor,  # [L, E]
    num_phy: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    refine_rounds: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # phy2log [L, P], rank [L, P], logcnt [L, E]
    layers, e = weight.shape
    assert e % num_groups == 0 and num_groups % num_nodes == 0, f"{e=} {num_groups=} {num_nodes=}"
    assert num_gpus % num_nodes == 0 and num_phy % num_gpus == 0, f"{num_gpus=} {num_nodes=} {num_phy=}"
    group_size, gpus_per_node = e // num_groups, num_gpus // num_nodes
    phy_per_node = num_phy // num_nodes

    # 1. groups -> nodes; mlog = expert ids renumbered node by node
    group_w = weight.double().unflatten(-1, (num_groups, group_size)).sum(-1)  # [L, G]
    # NOTE: no local search at this level: a better node split can still pack worse onto GPUs,
    # and the policy must never balance worse than the plain greedy
    g_pack, g_rank = balanced_packing(group_w, num_nodes, refine_rounds=0)  # [L, G]
    log2mlog = (
        ((g_pack * (num_groups // num_nodes) + g_rank) * group_size).unsqueeze(-1) + torch.arange(group_size)
    ).flatten(-2)  # [L, E]
    mlog2log = _inverse(log2mlog)
    # 2. replicate within each node: rows = (layer, node)
    tokens_mlog = weight.double().gather(-1, mlog2log).view(-1, e // num_nodes)  # [L*N, E/N]
    phy2mlog, phyrank, mlogcnt = replicate_experts(tokens_mlog, phy_per_node)
    # 3. the node's physical experts -> its GPUs, weighing each by its share of the load
    tokens_phy = tokens_mlog.gather(-1, phy2mlog) / mlogcnt.gather(-1, phy2mlog)  # [L*N, P/N]
    p_pack, p_rank = balanced_packing(tokens_phy, gpus_per_node, refine_rounds)
    phy2pphy = p_pack * (phy_per_node // gpus_per_node) + p_rank  # [L*N, P/N]
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = phy2mlog.gather(-1, pphy2phy)  # [L*N, P/N]
    node_base = (torch.arange(num_nodes) * (e // num_nodes)).view(1, -1, 1)
    pphy2mlog = (pphy2mlog.view(layers, num_nodes, -1) + node_base).flatten(-2)  # [L, P]
    pphy2log = mlog2log.gather(-1, pphy2mlog)
    pphyrank = phyrank.gather(-1, pphy2phy).view(layers, -1)
    logcnt = mlogcnt.view(layers, -1).gather(-1, log2mlog)
    return pphy2log, pphyrank, logcnt


def build_log2phy(phy2log: torch.Tensor, rank: torch.Tensor, num_experts: int, width: int) -> torch.Tensor:
    """``log2phy [L, E, width]``: physical slots of each logical expert by replica rank, -1 padded."""
    layers, p = phy2log.shape
    out = torch.full((layers, num_experts, width), -1, dtype=torch.long)
    flat = out.view(layers, -1)
    flat.scatter_(1, phy2log * width + rank, torch.arange(p).expand(layers, p))
    return out


def rebalance_experts(
    weight: torch.Tensor,  # [L, E] load statistics
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    refine_rounds: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek's entry point. Returns ``phy2log [L, P]`` (slot ``p`` lives on GPU
    ``p // (P / num_gpus)``), ``log2phy [L, E, R]`` (-1 padded) and ``logcnt [L, E]``.
    Uses the hierarchical policy when groups divide evenly over nodes, else the global one."""
    layers, e = weight.shape
    weight = weight.double().cpu()
    if num_groups % num_nodes == 0:
        phy2log, rank, logcnt = rebalance_hierarchical(
            weight, num_replicas, num_groups, num_nodes, num_gpus, refine_rounds
        )
    else:
        phy2log, rank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus, refine_rounds)
    width = num_replicas - e + 1
    return phy2log, build_log2phy(phy2log, rank, e, width), logcnt
