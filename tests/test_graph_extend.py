"""Short prefills and cached-prefix extends replayed from the decode CUDA graphs: the static
buffers a replay reads hold what an eager step's ``ForwardBatch.build`` makes (CPU), and the
engine's logits equal the eager engine's (GPU)."""

from __future__ import annotations

import types

import pytest
import torch

from coordinator.model.batch import ForwardBatch
from coordinator.model.cuda_graphs import DecodeGraphs
from coordinator.model.engine import Engine
from tests.hf_models import make_checkpoint
from tests.test_engine_gpu import rel_err

PAGE = 4
SCRATCH = 999


def graphs_on_cpu(bm: int, width: int) -> DecodeGraphs:
    """The buffers of a DecodeGraphs without capturing anything (capture needs CUDA)."""
    g = DecodeGraphs.__new__(DecodeGraphs)
    g.buckets, g.width = tuple(1 << i for i in range(bm.bit_length())), width  # 1, 2, 4 .. bm
    g.cache = types.SimpleNamespace(page_size=PAGE, scratch_row=SCRATCH)  # type: ignore[assignment]
    g.meta = torch.zeros(4, bm, dtype=torch.long)
    g.meta[3] = torch.arange(bm)
    g.table = torch.zeros(bm, width, dtype=torch.int32)
    g.token_seq = torch.arange(bm, dtype=torch.int32)
    g._identity, g._seq_identity = torch.arange(bm, dtype=torch.int32), True
    g._pad(0, bm)
    return g


@pytest.mark.parametrize(
    "seqs",
    [
        [([5], 7, [3, 9]), ([6], 0, [4]), ([8], 3, [1])],  # decodes
        [
            ([5, 6, 7, 8, 9, 10], 11, [2, 5, 6, 7, 1]),
            ([4], 2, [8]),
            ([1, 2, 3], 0, [0]),
        ],  # extend + decode + prefill
        [(list(range(20, 33)), 0, [6, 2, 9, 4])],  # one short prefill over page boundaries
    ],
)
def test_graph_buffers_hold_the_eager_batch(seqs):
    t = sum(len(toks) for toks, _, _ in seqs)
    g = graphs_on_cpu(32, 8)
    bucket = g.bucket(t)
    assert bucket is not None
    g._fill_tokens(seqs, bucket)
    ref = ForwardBatch.build(seqs, PAGE, torch.device("cpu"))
    b = len(seqs)
    assert g.meta[0, :t].tolist() == ref.input_ids.tolist()
    assert g.meta[1, :t].tolist() == ref.positions.tolist()
    assert g.meta[2, :t].tolist() == ref.write_index.tolist()
    assert g.meta[3, :b].tolist() == ref.logits_index.tolist()
    assert g.token_seq[:t].tolist() == ref.token_seq.tolist()
    w = ref.page_table.shape[1]
    assert torch.equal(g.table[:b, :w], ref.page_table)
    # padding rows see no keys and write to the scratch row
    assert g.meta[1, t:bucket].eq(-1).all() and g.meta[2, t:bucket].eq(SCRATCH).all()


def test_a_decode_after_an_extend_gets_the_identity_sequence_map_back():
    g = graphs_on_cpu(16, 8)
    g._fill_tokens([([1, 2, 3], 4, [0, 1]), ([7], 2, [2])], 4)  # token rows 0-2: seq 0, row 3: seq 1
    assert g.token_seq[:4].tolist() == [0, 0, 0, 1]
    decodes = [([5], 7, [3, 9]), ([6], 0, [4]), ([8], 3, [1])]
    g._fill_tokens(decodes, 4)
    ref = ForwardBatch.build(decodes, PAGE, torch.device("cpu"))
    assert g.token_seq[:3].tolist() == ref.token_seq.tolist() == [0, 1, 2]
    assert g.meta[3, :3].tolist() == ref.logits_index.tolist()


def test_a_step_past_the_largest_bucket_is_refused():
    g = graphs_on_cpu(8, 4)
    assert g.bucket(9) is None
    with pytest.raises(AssertionError, match="largest bucket"):
        g.run_tokens([(list(range(9)), 0, [0, 1, 2])])


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_short_steps_replay_graphs_with_the_eager_logits(arch, tmp_path):
    """float32: prompts prefilled together, then a step mixing an extend of a cached sequence
    with decodes, then decodes, every one through a graph, against an engine without graphs."""
    make_checkpoint(arch, tmp_path)
    eager = Engine.from_checkpoint(
        str(tmp_path), dtype=torch.float32, device="cuda", page_size=PAGE, cuda_graphs=False
    )
    graph = Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, device="cuda", page_size=PAGE)
    assert eager.graphs is None and graph.graphs is not None and graph.graphs.extends
    replays: list[int] = []
    run_tokens = graph.graphs.run_tokens

    def counted(seqs):
        replays.append(sum(len(t) for t, _, _ in seqs))
        return run_tokens(seqs)

    graph.graphs.run_tokens = counted  # type: ignore[method-assign]
    prompts = [[(7 * i + j) % 96 for j in range(n)] for i, n in enumerate((11, 5, 9))]
    ids = {e: [e.new_seq() for _ in prompts] for e in (eager, graph)}
    steps = [
        list(enumerate(prompts)),  # 25 tokens: bucket 32
        [(0, [3, 1, 4, 1, 5, 9]), (1, [2]), (2, [6])],  # an extend beside two decodes
        [(0, [7]), (1, [8]), (2, [9])],
        [(2, list(range(40, 70)))],  # 30 more tokens of one sequence
    ]
    for step in steps:
        out = {e: e.step([(ids[e][i], toks) for i, toks in step]) for e in (eager, graph)}
        for a, b in zip(out[graph], out[eager]):
            assert rel_err(a.cpu(), b.cpu()) < 2e-3
    assert replays == [25, 8, 3, 30]
