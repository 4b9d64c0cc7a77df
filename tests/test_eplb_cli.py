"""Formatting of ``expertmesh load`` and ``expertmesh placement`` output (no server needed)."""

from __future__ import annotations

import json

from expertmesh.load_cli import format_load
from expertmesh.placement_cli import format_outcome, placement_json
from expertmesh.v1 import admin_pb2


def test_load_shows_hot_experts_and_server_balance():
    load = admin_pb2.ExpertLoad(
        window_steps=4,
        steps=10,
        layers=[admin_pb2.LayerLoad(layer=1, tokens=[9, 9, 9, 9], window_tokens=[6, 1, 1, 0])],
        servers=[
            admin_pb2.ServerLoad(name="cpu0", window_tokens=[7.0], compute_ms=2.0, computed_tokens=10),
            admin_pb2.ServerLoad(name="cpu1", window_tokens=[1.0]),
        ],
    )
    text = format_load(load, top=2)
    assert "last 4 of 10 steps" in text
    assert "0 (75%), 1 (12%)" in text  # the hottest two of layer 1
    assert "1.750" in text  # max/mean of 7 | 1
    assert "cpu0: 10 tokens in 2.0 ms" in text and "cpu1:" not in text  # no measurement


def test_placement_show_and_outcome():
    info = admin_pb2.PlacementInfo(
        generation=3,
        servers=["a", "b"],
        layers=[
            admin_pb2.LayerPlacement(
                layer=0, phy2log=[2, 0, 1, 0], owner=[0, 0, 1, 1], local_slot=[1, 0, 0, 1]
            )
        ],
    )
    assert placement_json(info) == {"servers": ["a", "b"], "layers": {"0": {"a": [0, 2], "b": [1, 0]}}}
    out = admin_pb2.RebalanceOutcome(
        outcome="dry-run",
        trigger="admin",
        reason="predicted gain 40.0%",
        generation=3,
        token_balance_before=1.5,
        token_balance_after=1.01,
        placement_json=json.dumps({"servers": ["a", "b"], "layers": {"0": {"a": [0], "b": [1, 0]}}}),
    )
    text = format_outcome(out)
    assert text.startswith("dry-run (admin): predicted gain 40.0%")
    assert "1.500 -> 1.010" in text and "layer 0: a=[0]  b=[1, 0]" in text
