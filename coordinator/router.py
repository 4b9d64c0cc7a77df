"""Routing: router logits -> (top-k logical expert ids, routing weights), per the model's rule.

Pure functions of tensors, no module state. Shapes: T tokens, E experts, K top-k, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from expertmesh.config import ModelConfig


@dataclass(frozen=True)
class RouterSpec:
    top_k: int
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"  # "greedy" | "group_limited_greedy" | "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    # Round the weights to the model dtype (Qwen2/3-MoE, OLMoE do; Mixtral keeps float32), so
    # low-precision results round as the model's own implementation does.
    round_weights: bool = True

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
            round_weights=cfg.model_type != "mixtral",
        )


def route(
    logits: torch.Tensor,  # [T, E]
    spec: RouterSpec,
    correction_bias: torch.Tensor | None = None,  # [E]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns ``topk_ids [T, K]`` (int64) and ``topk_weights [T, K]`` (float32, rounded to the
    logits' dtype first when ``spec.round_weights``)."""
    scores = logits.float().softmax(-1) if spec.scoring == "softmax" else logits.float().sigmoid()  # [T, E]
    if spec.topk_method == "greedy":
        weights, ids = torch.topk(scores, spec.top_k, dim=-1)
    else:
        choice = scores if correction_bias is None else scores + correction_bias.float()[None, :]
        masked = _group_limit(choice, spec)
        _, ids = torch.topk(masked, spec.top_k, dim=-1, sorted=False)
        weights = scores.gather(1, ids)  # weights come from the uncorrected scores
    if spec.norm_topk_prob and spec.top_k > 1:
        denom = weights.sum(-1, keepdim=True)
        weights = weights / (denom + 1e-20) if spec.scoring == "sigmoid" else weights / denom
    weights = weights * spec.routed_scaling_factor
    if spec.round_weights:
        weights = weights.to(logits.dtype).float()
    return ids, weights


def _group_limit(choice: torch.Tensor, spec: RouterSpec) -> torch.Tensor:
    """Zero the experts outside the ``topk_group`` best of ``n_group`` groups."""
    t, e = choice.shape
    grouped = choice.view(t, spec.n_group, e // spec.n_group)  # [T, G, E/G]
    if spec.topk_method == "noaux_tc":
        group_score = grouped.topk(2, dim=-1)[0].sum(-1)  # [T, G]
    else:
        group_score = grouped.max(dim=-1).values  # [T, G]
    top_groups = torch.topk(group_score, spec.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    keep = torch.zeros_like(group_score).scatter_(1, top_groups, 1.0)  # [T, G]
    keep = keep[:, :, None].expand(t, spec.n_group, e // spec.n_group).reshape(t, e)
    return choice.masked_fill(keep == 0, 0.0)
