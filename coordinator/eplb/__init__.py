"""EPLB: expert-parallel load balancing. The algorithms are pure tensor functions (no gRPC, no
state), exported here:

- :func:`rebalance_experts`: DeepSeek's interface and policies (hierarchical, global) for
  equal devices; greedy packing plus a local search that never balances worse.
- :func:`rebalance_heterogeneous`: servers with their own slot capacity and measured speed;
  the objective is the slowest server's time per layer.
- :func:`rebalance_few_moves`: start from the live placement; move weights only where that
  beats keeping them by more than a threshold; reports weights moved.

Around them: ``plan.py`` (the EPLB config and placement tensors), ``manager.py`` (the periodic
rebalance loop over a windowed load snapshot), ``target.py`` (the manager's view of the expert
cluster: live placement, capacities, the two-phase push), ``degraded.py`` (re-placement when
a server stays down), ``drain.py`` (a leaving server's experts re-placed on the rest before it
goes) and ``grow.py`` (a server that joined gets copies of hot experts first, nothing moved).

May import: ``expertmesh``, ``coordinator.model`` and ``coordinator.experts``; the algorithms
import nothing of the coordinator.
"""

from coordinator.eplb.hetero import rebalance_heterogeneous, server_times
from coordinator.eplb.moves import MovePlan, rebalance_few_moves, weights_moved
from coordinator.eplb.packing import greedy_pack, refine
from coordinator.eplb.policy import balanced_packing, rebalance_experts, rebalance_hierarchical
from coordinator.eplb.replicate import replica_counts, replicate_experts

__all__ = [
    "MovePlan",
    "balanced_packing",
    "greedy_pack",
    "rebalance_experts",
    "rebalance_few_moves",
    "rebalance_heterogeneous",
    "rebalance_hierarchical",
    "refine",
    "replica_counts",
    "replicate_experts",
    "server_times",
    "weights_moved",
]
