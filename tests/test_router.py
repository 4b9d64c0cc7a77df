"""The routing rules against small hand-worked examples (scores chosen, logits derived from them)."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.model.router import RouterSpec, route
from expertmesh.config import ConfigError, ModelConfig


def softmax_logits(probs: list[float]) -> torch.Tensor:  # [1, E], softmax gives back probs
    return torch.tensor([probs]).log()


def sigmoid_logits(scores: list[float]) -> torch.Tensor:  # [1, E], sigmoid gives back scores
    return torch.tensor([scores]).logit()


def by_id(ids: torch.Tensor, weights: torch.Tensor) -> tuple[list[int], list[float]]:
    """Row 0 of the routing, sorted by expert id (grouped rules return top-k unsorted)."""
    order = ids[0].argsort()
    return ids[0][order].tolist(), weights[0][order].tolist()


V3 = dict(scoring="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, round_weights=False)


def test_greedy_scales_by_routed_scaling_factor():
    spec = RouterSpec(top_k=2, routed_scaling_factor=16.0, round_weights=False)
    ids, w = by_id(*route(softmax_logits([0.5, 0.3, 0.2]), spec))
    assert ids == [0, 1]
    assert w == pytest.approx([0.5 * 16, 0.3 * 16], rel=1e-6)  # DeepSeek-V2: scaled, not renormalised


def test_group_limited_greedy_excludes_a_strong_expert_in_a_losing_group():
    # groups (0,1) (2,3) (4,5), ranked by their best expert: 0.30 > 0.25 > 0.10, keep one.
    # Expert 2 (0.25) beats expert 1 (0.01) but its group lost.
    probs = [0.30, 0.01, 0.25, 0.24, 0.10, 0.10]
    spec = RouterSpec(
        top_k=2, topk_method="group_limited_greedy", n_group=3, topk_group=1, round_weights=False
    )
    ids, w = by_id(*route(softmax_logits(probs), spec))
    assert ids == [0, 1]
    assert w == pytest.approx([0.30, 0.01], rel=1e-5)
    greedy_ids, _ = by_id(*route(softmax_logits(probs), RouterSpec(top_k=2)))
    assert greedy_ids == [0, 2]


def test_noaux_tc_ranks_groups_by_their_two_best_and_renormalises_then_scales():
    # group 0: 0.95 + 0.10 = 1.05; group 1: 0.60 + 0.55 = 1.15 -> group 1 wins, and expert 0,
    # the best of all, is out (a best-expert ranking would have kept group 0)
    scores = [0.95, 0.10, 0.10, 0.10, 0.60, 0.55, 0.10, 0.10]
    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, **V3)
    ids, w = by_id(*route(sigmoid_logits(scores), spec, torch.zeros(8)))
    assert ids == [4, 5]
    assert w == pytest.approx([0.60 / 1.15 * 2.5, 0.55 / 1.15 * 2.5], rel=1e-5)


def test_correction_bias_changes_the_choice_but_not_the_weights():
    scores = [0.9, 0.8, 0.7, 0.6]
    spec = RouterSpec(top_k=2, routed_scaling_factor=2.5, **V3)
    ids, _ = by_id(*route(sigmoid_logits(scores), spec, torch.zeros(4)))
    assert ids == [0, 1]
    # choice scores 0.9, 0.8, 0.95, 0.6: expert 2 displaces expert 1, but weighs its own 0.7
    ids, w = by_id(*route(sigmoid_logits(scores), spec, torch.tensor([0.0, 0.0, 0.25, 0.0])))
    assert ids == [0, 2]
    assert w == pytest.approx([0.9 / 1.6 * 2.5, 0.7 / 1.6 * 2.5], rel=1e-5)


def test_noaux_tc_never_picks_an_excluded_group_over_negative_choice_scores():
    # bias -1 makes every choice score negative; group 0 (-1.1) beats group 1 (-1.5), and
    # its experts must win over group 1's even though 0 > -0.5 (excluded means -inf, not 0)
    scores = [0.5, 0.4, 0.3, 0.2]
    spec = RouterSpec(top_k=2, n_group=2, topk_group=1, **V3)
    ids, w = by_id(*route(sigmoid_logits(scores), spec, torch.full((4,), -1.0)))
    assert ids == [0, 1]
    assert w == pytest.approx([0.5 / 0.9, 0.4 / 0.9], rel=1e-5)


def test_norm_topk_prob_with_one_expert_gives_weight_one():
    spec = RouterSpec(top_k=1, norm_topk_prob=True)
    _, w = route(softmax_logits([0.2, 0.7, 0.1]), spec)
    assert w.tolist() == [[1.0]]


def test_round_weights_rounds_to_the_logits_dtype():
    logits = torch.tensor([[0.3, -1.1, 0.7, 0.05]], dtype=torch.bfloat16)
    _, rounded = route(logits, RouterSpec(top_k=2, norm_topk_prob=True))
    _, kept = route(logits, RouterSpec(top_k=2, norm_topk_prob=True, round_weights=False))
    assert rounded.dtype == kept.dtype == torch.float32
    assert torch.equal(rounded, kept.to(torch.bfloat16).float())
    assert not torch.equal(rounded, kept)


# ---------------------------------------------------------------- DeepSeek config -> rule

DEEPSEEK = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)


def spec_of(model_type: str, **fields) -> RouterSpec:
    return RouterSpec.from_config(ModelConfig.from_dict({"model_type": model_type, **DEEPSEEK, **fields}))


def test_deepseek_v3_rule_and_hf_defaults():
    spec = spec_of("deepseek_v3", n_group=4, topk_group=2)
    assert (spec.scoring, spec.topk_method, spec.norm_topk_prob) == ("sigmoid", "noaux_tc", True)
    assert spec.routed_scaling_factor == 2.5 and not spec.round_weights
    cfg = ModelConfig.from_dict({"model_type": "deepseek_v3", **DEEPSEEK, "n_group": 4, "topk_group": 2})
    assert cfg.correction_bias and cfg.q_lora_rank == 1536 and cfg.rope_interleave
    assert cfg.moe_layers == (False, False, False)  # HF's default first_k_dense_replace is 3


def test_deepseek_v2_rule_and_hf_defaults():
    spec = spec_of("deepseek_v2", q_lora_rank=None)
    assert (spec.scoring, spec.topk_method, spec.norm_topk_prob) == ("softmax", "greedy", False)
    assert spec.routed_scaling_factor == 1.0 and not spec.round_weights
    grouped = spec_of("deepseek_v2", topk_method="group_limited_greedy", n_group=4, topk_group=2)
    assert (grouped.n_group, grouped.topk_group) == (4, 2)


@pytest.mark.parametrize(
    "model_type, fields, field",
    [
        ("deepseek_v2", dict(norm_topk_prob=True), "norm_topk_prob"),
        ("deepseek_v2", dict(scoring_func="sigmoid"), "scoring_func"),
        ("deepseek_v2", dict(topk_method="noaux_tc"), "topk_method"),
        ("deepseek_v3", dict(topk_method="greedy"), "topk_method"),
        # the kept groups (1 of 4, 2 experts each) cannot hold the top-3
        ("deepseek_v3", dict(n_group=4, topk_group=1, num_experts_per_tok=3), "topk_group"),
        ("deepseek_v3", dict(moe_layer_freq=2), "moe_layer_freq"),
        ("deepseek_v3", dict(num_key_value_heads=2), "num_key_value_heads"),
        # yarn is implemented (tests/test_rope_scaling.py); dynamic is not
        ("deepseek_v3", dict(rope_scaling={"type": "dynamic", "factor": 4}), "rope_type"),
    ],
)
def test_deepseek_rules_hf_does_not_implement_are_refused(model_type, fields, field):
    with pytest.raises(ConfigError, match=field):
        spec_of(model_type, **fields)


def test_weights_stay_finite_for_tiny_sigmoid_scores():
    spec = RouterSpec(top_k=2, **V3)
    _, w = route(torch.full((1, 4), -200.0), spec, torch.zeros(4))  # sigmoid underflows to ~0
    assert all(math.isfinite(x) for x in w[0].tolist())
