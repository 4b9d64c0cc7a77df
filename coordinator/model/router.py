"""Routing: router logits -> (top-k logical expert ids, routing weights), per the model's rule.

Pure functions of tensors, no module state. Shapes: T tokens, E experts, K top-k, G groups.

The rules, in the order each model applies them (all in float32):

* ``greedy``: the top-k scores (Qwen2/3-MoE, OLMoE, Mixtral, DeepSeek-V2).
* ``group_limited_greedy`` (DeepSeek-V2): a group's rank is its best score; experts outside the
  ``topk_group`` best groups score 0; top-k of what remains, weights are those scores.
* ``noaux_tc`` (DeepSeek-V3): the choice adds ``e_score_correction_bias`` to the scores; a
  group's rank is the sum of its two best choice scores; experts outside the kept groups are
  excluded (-inf, since biased choice scores may be negative); top-k of the choice, but the
  weights are the *uncorrected* scores of the chosen experts.

Then: renormalise the K weights when ``norm_topk_prob``, multiply by
``routed_scaling_factor``, and round to the model dtype when the model does (``round_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertmesh.config import ModelConfig

# Models whose own implementation casts the routing weights to the activation dtype before
# the experts use them (Mixtral and DeepSeek keep them in float32).
_ROUNDS_WEIGHTS = frozenset({"qwen2_moe", "qwen3_moe", "olmoe"})


@dataclass(frozen=True)
class RouterSpec:
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    # Round the weights to the logits' dtype, so low-precision results round as the model's
    # own implementation does.
    round_weights: bool = True

    def __post_init__(self) -> None:
        assert self.scoring in ("softmax", "sigmoid"), self.scoring
        assert self.topk_method in ("greedy", "group_limited_greedy", "noaux_tc"), self.topk_method
        assert 0 < self.topk_group <= self.n_group, f"{self.topk_group=} {self.n_group=}"

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> RouterSpec:
        return cls(
            top_k=cfg.top_k,
            scoring=cfg.scoring,
            norm_topk_prob=cfg.norm_topk_prob,
            routed_scaling_factor=cfg.routed_scaling_factor,
            topk_method=cfg.topk_method,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            round_weights=cfg.model_type in _ROUNDS_WEIGHTS,
        )


def route(
    logits: torch.Tensor,  # [T, E]
    spec: RouterSpec,
    correction_bias: torch.Tensor | None = None,  # [E], noaux_tc only (None = zeros)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``topk_ids [T, K]`` (int64) and ``topk_weights [T, K]`` (float32, rounded to the
    logits' dtype first when ``spec.round_weights``)."""
    if logits.is_cuda and spec.topk_method == "greedy" and spec.scoring == "softmax":
        from coordinator.model.kernels.fused_ops import softmax_topk

        return softmax_topk(
            logits.contiguous(),
            spec.top_k,
            spec.norm_topk_prob,
            spec.routed_scaling_factor,
            spec.round_weights,
        )
    scores = logits.float().softmax(-1) if spec.scoring == "softmax" else logits.float().sigmoid()  # [T, E]
    if spec.topk_method == "greedy":
        weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    elif spec.topk_method == "group_limited_greedy":
        group_best = _grouped(scores, spec).max(dim=-1).values  # [T, G]
        kept = _keep_groups(scores, group_best, spec, fill=0.0)
        weights, ids = torch.topk(kept, spec.top_k, dim=-1, sorted=False)
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()[None, :]
        group_top2 = _grouped(choice, spec).topk(2, dim=-1).values.sum(-1)  # [T, G]
        kept = _keep_groups(choice, group_top2, spec, fill=float("-inf"))
        ids = torch.topk(kept, spec.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)  # NOTE: the bias steers the choice, never the weights
    if spec.norm_topk_prob:
        denom = weights.sum(-1, keepdim=True)
        # sigmoid scores are not a distribution: the guard is DeepSeek-V3's, softmax models have none
        weights = weights / (denom + 1e-20) if spec.scoring == "sigmoid" else weights / denom
    if spec.routed_scaling_factor != 1.0:  # (a product by 1.0 changes nothing but costs an op)
        weights = weights * spec.routed_scaling_factor
    if spec.round_weights:
        weights = weights.to(logits.dtype).float()
    return ids, weights


def _grouped(x: torch.Tensor, spec: RouterSpec) -> torch.Tensor:  # [T, E] -> [T, G, E/G]
    t, e = x.shape
    assert e % spec.n_group == 0, f"{e=} {spec.n_group=}"
    return x.view(t, spec.n_group, e // spec.n_group)


def _keep_groups(x: torch.Tensor, group_score: torch.Tensor, spec: RouterSpec, fill: float) -> torch.Tensor:
    """``x [T, E]`` with every expert outside the ``topk_group`` best groups set to ``fill``."""
    top_groups = torch.topk(group_score, spec.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
    keep = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, top_groups, True)  # [T, G]
    keep = keep[:, :, None].expand(-1, -1, x.shape[1] // spec.n_group).reshape(x.shape)  # [T, E]
    return x.masked_fill(~keep, fill)
