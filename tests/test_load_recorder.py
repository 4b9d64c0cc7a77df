"""Load recorder: windowed and total counts against plain Python counting."""

from __future__ import annotations

import random

import torch

from coordinator.experts.load_recorder import LoadRecorder


def test_window_and_totals_match_python_counts():
    rng = random.Random(0)
    layers, experts, window = [1, 3, 4], 6, 3
    rec = LoadRecorder(layers, experts, window, num_servers=2)
    history = []  # per step: {layer: [ids]}
    for _ in range(7):
        step = {}
        for layer in layers:  # every step runs the MoE layers in order
            t = rng.randint(1, 5)
            ids = torch.tensor([rng.sample(range(experts), 2) for _ in range(t)])  # [T, K]
            rec.record(layer, ids)
            step[layer] = ids.flatten().tolist()
        history.append(step)
        snap = rec.snapshot()
        recent = history[-window:]
        for row, layer in enumerate(layers):
            want_w = [sum(s[layer].count(e) for s in recent) for e in range(experts)]
            want_t = [sum(s[layer].count(e) for s in history) for e in range(experts)]
            assert snap.window[row].tolist() == want_w
            assert snap.totals[row].tolist() == want_t
        assert snap.steps == len(history) and snap.window_steps == min(len(history), window)


def test_server_time_window_and_speed():
    rec = LoadRecorder([0, 1], 4, window_steps=2, num_servers=2)
    assert rec.snapshot().server_speed() is None
    for step in range(3):
        for layer in (0, 1):
            rec.record(layer, torch.tensor([[0, 1]]))
            rec.record_server_time(0, layer, compute_ms=1.0 + step, tokens=10)
            rec.record_server_time(1, layer, compute_ms=4.0, tokens=10)
    rec.record_server_time(0, 7, 1.0, 1)  # not an MoE layer: ignored
    snap = rec.snapshot()
    # window = steps 1 and 2: server 0 took 2 + 3 ms per layer for 20 tokens
    assert snap.server_ms[0].tolist() == [5.0, 5.0] and snap.server_tokens[0].tolist() == [20.0, 20.0]
    speed = snap.server_speed()
    assert speed is not None and torch.allclose(speed, torch.tensor([40 / 10, 40 / 16], dtype=torch.float64))


def test_a_server_without_answers_in_the_window_keeps_its_speed_since_start():
    """EPLB may leave a server without load: its speed is then its speed since start, not
    unknown (an unknown speed used to make every server count as equally fast)."""
    rec = LoadRecorder([0], 4, window_steps=2, num_servers=3)
    for step in range(4):
        rec.record(0, torch.tensor([[0, 1]]))
        rec.record_server_time(0, 0, compute_ms=1.0, tokens=8)
        if step == 0:  # then no more answers from server 1: its step leaves the window
            rec.record_server_time(1, 0, compute_ms=4.0, tokens=8)
    speed = rec.snapshot().server_speed()
    assert speed is not None and speed[:2].tolist() == [8.0, 2.0] and bool(speed[2].isnan())


def test_ids_on_another_dtype_are_counted():
    rec = LoadRecorder([0], 3, window_steps=1)
    rec.record(0, torch.tensor([[2, 2], [1, 0]], dtype=torch.int32))
    assert rec.snapshot().window.tolist() == [[1, 1, 2]]


def test_a_server_that_joined_later_gets_its_time_recorded():
    rec = LoadRecorder([0], 4, window_steps=2, num_servers=1)
    rec.record(0, torch.tensor([[0, 1]]))
    rec.record_server_time(0, 0, compute_ms=2.0, tokens=4)
    rec.record_server_time(2, 0, compute_ms=1.0, tokens=4)  # server 2 joined at run time
    snap = rec.snapshot()
    assert snap.server_ms[:, 0].tolist() == [2.0, 0.0, 1.0]
    assert snap.server_tokens[:, 0].tolist() == [4.0, 0.0, 4.0]


def test_a_whole_step_at_once_counts_as_its_layers_one_by_one():
    """record_step (the decode graphs' one call per replay, padding rows sliced off) gives the
    window and totals that record() per layer gives, steps of both kinds mixed."""
    rng = random.Random(1)
    layers, experts, window = [0, 2, 5, 7], 9, 3
    one, whole = LoadRecorder(layers, experts, window), LoadRecorder(layers, experts, window)
    for step in range(8):
        bucket, b = 4, rng.randint(1, 4)
        ids = torch.tensor(
            [[rng.sample(range(experts), 3) for _ in range(bucket)] for _ in layers], dtype=torch.int32
        )  # [L, bucket, K]: rows >= b are padding
        for i, layer in enumerate(layers):
            one.record(layer, ids[i, :b])
        if step % 3 == 2:  # a step of the eager path on both
            for i, layer in enumerate(layers):
                whole.record(layer, ids[i, :b])
        else:
            whole.record_step(ids[:, :b])
        a, c = one.snapshot(), whole.snapshot()
        assert torch.equal(a.window, c.window) and torch.equal(a.totals, c.totals), step
        assert a.steps == c.steps == step + 1
    assert one.snapshot().totals.sum() > 0
