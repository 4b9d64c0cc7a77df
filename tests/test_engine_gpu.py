"""The in-process CUDA engine (paged-attention kernel, fused MoE kernels, decode CUDA graphs)
against the plain-torch CPU engine on the same checkpoint, in float32."""

from __future__ import annotations

import pytest
import torch

from coordinator.model.engine import Engine
from tests.hf_models import make_checkpoint


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2"])
def test_cuda_engine_matches_cpu(arch, tmp_path):
    make_checkpoint(arch, tmp_path)
    cpu = Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, page_size=4)
    gpu = Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, device="cuda", page_size=4)
    assert gpu.graphs is not None
    prompts = [[(7 * i + j) % 96 for j in range(n)] for i, n in enumerate((11, 5, 9))]
    ids = {e: [e.new_seq() for _ in prompts] for e in (cpu, gpu)}
    steps = {e: e.step([(s, p) for s, p in zip(ids[e], prompts)], all_logits=True) for e in (cpu, gpu)}
    for a, b in zip(steps[gpu], steps[cpu]):
        assert rel_err(a.cpu(), b) < 2e-3
    toks = [int(x[-1].argmax()) for x in steps[cpu]]
    for _ in range(6):  # decode through the graphs: batch 3 replays bucket 4 (one padding row)
        out = {e: e.step([(s, [t]) for s, t in zip(ids[e], toks)]) for e in (cpu, gpu)}
        for a, b in zip(out[gpu], out[cpu]):
            assert rel_err(a.cpu(), b) < 2e-3
        toks = [int(x.argmax()) for x in out[cpu]]
    # a sequence that leaves frees its pages; the others keep decoding at batch 2
    for e in (cpu, gpu):
        e.free(ids[e][1])
    out = {e: e.step([(ids[e][i], [toks[i]]) for i in (0, 2)]) for e in (cpu, gpu)}
    for a, b in zip(out[gpu], out[cpu]):
        assert rel_err(a.cpu(), b) < 2e-3


@pytest.mark.gpu
def test_load_hook_sees_graph_steps(tmp_path):
    """The expert-load hook (EPLB's recorder) counts the same routing with and without graphs:
    graph steps report each MoE layer's ids after the replay, padding rows left out."""
    from coordinator.model.dispatch import LocalDispatcher
    from coordinator.model.kv_cache import KVCacheSpec
    from coordinator.model.loader import load_model
    from expertmesh.checkpoint import CheckpointReader

    make_checkpoint("qwen3_moe", tmp_path)
    reader = CheckpointReader(str(tmp_path))
    counts = {}

    def engine(device: str, graphs: bool) -> Engine:
        dev = torch.device(device)
        c = counts.setdefault((device, graphs), torch.zeros(4, 8, dtype=torch.long, device=dev))

        def hook(layer: int, ids: torch.Tensor) -> None:
            c[layer].index_add_(0, ids.flatten().long(), torch.ones_like(ids.flatten().long()))

        model = load_model(reader, torch.float32, dev)
        disp = LocalDispatcher(reader, torch.float32, dev)
        return Engine(model, disp, KVCacheSpec(64, 4), torch.float32, dev, load_hook=hook, cuda_graphs=graphs)

    for device, graphs in (("cpu", False), ("cuda", True)):
        eng = engine(device, graphs)
        assert (eng.graphs is not None) == graphs
        seqs = [eng.new_seq() for _ in range(3)]
        out = eng.step([(s, [(5 * i + j) % 96 for j in range(7)]) for i, s in enumerate(seqs)])
        toks = [int(x.argmax()) for x in out]
        for _ in range(4):  # batch 3 -> bucket 4: one padding row per step, never counted
            toks = [int(x.argmax()) for x in eng.step([(s, [t]) for s, t in zip(seqs, toks)])]
    cpu, gpu = counts[("cpu", False)], counts[("cuda", True)].cpu()
    assert cpu.sum() > 0 and torch.equal(cpu, gpu), (cpu, gpu)

    # the serving engine's wiring: the recorder's per-layer hook for eager steps, its one call
    # per replay for graph steps
    from coordinator.experts.load_recorder import LoadRecorder

    dev = torch.device("cuda")
    moe = reader.config.moe_layer_ids  # layer 1 is dense (mlp_only_layers)
    rec = LoadRecorder(moe, 8, 64, device=dev)
    eng = Engine(
        load_model(reader, torch.float32, dev),
        LocalDispatcher(reader, torch.float32, dev),
        KVCacheSpec(64, 4),
        torch.float32,
        dev,
        load_hook=rec.record,
        step_load=rec.record_step,
    )
    assert eng.graphs is not None and eng.graphs.step_load is not None
    seqs = [eng.new_seq() for _ in range(3)]
    out = eng.step([(s, [(5 * i + j) % 96 for j in range(7)]) for i, s in enumerate(seqs)])
    toks = [int(x.argmax()) for x in out]
    for _ in range(4):
        toks = [int(x.argmax()) for x in eng.step([(s, [t]) for s, t in zip(seqs, toks)])]
    snap = rec.snapshot()
    assert snap.steps == 5 and torch.equal(snap.totals, cpu[list(moe)]), (snap.totals, cpu)


@pytest.mark.gpu
def test_experts_load_while_the_graphs_compile(tmp_path, monkeypatch):
    """A dispatcher whose experts load in the background (the CUDA coordinator's): the decode
    graphs' compile warm-up runs while reads are still under way, capture waits for them, and
    every step equals that of a dispatcher that loaded first, bit for bit; the warm-up's steps
    count no expert load."""
    import functools
    import time

    from coordinator.model.dispatch import LocalDispatcher
    from coordinator.model.kv_cache import KVCacheSpec
    from coordinator.model.loader import load_model
    from expertmesh.checkpoint import CheckpointReader

    make_checkpoint("qwen3_moe", tmp_path)
    dev = torch.device("cuda")
    runs = {}
    overlapped: list[bool] = []  # per early call: were experts still being read
    loading: dict[str, LocalDispatcher] = {}

    def slow(real, *a, **kw):
        time.sleep(0.2)  # reads still under way when the warm-up starts
        return real(*a, **kw)

    def seen(real, *a, **kw):  # the backend's calls: which ran early, while reads ran
        d = loading["disp"]
        if d.load is not None and d.load.allowed_early:
            overlapped.append(d.load.running)
        return real(*a, **kw)

    for background in (False, True):
        reader = CheckpointReader(str(tmp_path))
        if background:
            monkeypatch.setattr(reader, "expert_into", functools.partial(slow, reader.expert_into))
        counts = torch.zeros(4, 8, dtype=torch.long, device=dev)

        def hook(layer: int, ids: torch.Tensor, c=counts) -> None:
            c[layer].index_add_(0, ids.flatten().long(), torch.ones_like(ids.flatten().long()))

        model = load_model(reader, torch.float32, dev)
        disp = LocalDispatcher(reader, torch.float32, dev, background=background)
        loading["disp"] = disp
        disp.backend.forward = functools.partial(seen, disp.backend.forward)  # type: ignore[method-assign]
        eng = Engine(model, disp, KVCacheSpec(64, 4), torch.float32, dev, load_hook=hook)
        assert eng.graphs is not None and disp.load is None
        seqs = [eng.new_seq() for _ in range(3)]
        outs = [eng.step([(s, [(5 * i + j) % 96 for j in range(7)]) for i, s in enumerate(seqs)])]
        for _ in range(4):
            toks = [int(x.argmax()) for x in outs[-1]]
            outs.append(eng.step([(s, [t]) for s, t in zip(seqs, toks)]))
        runs[background] = ([torch.stack(o).cpu() for o in outs], counts.cpu())
    assert any(overlapped), "the warm-up never ran while experts were being read"
    for a, b in zip(runs[True][0], runs[False][0], strict=True):
        assert torch.equal(a, b)
    assert torch.equal(runs[True][1], runs[False][1]) and runs[True][1].sum() > 0


@pytest.mark.gpu
def test_queued_decode_steps_match_hf(tmp_path):
    """The scheduler's decode steps queued one ahead on the captured graphs (fed the samples on
    the device): greedy tokens of three requests of different lengths equal HF's, every page
    comes back, and a request whose prompt is the first one's whole text finds the pages the
    queued steps filled in the prefix index (their tokens learned a step late) and decodes as HF."""
    from tests.serving_utils import hf_greedy
    from tests.test_step_overlap import OUT, PROMPTS, Counting, next_turn, run_all, scheduler

    hf = make_checkpoint("qwen3_moe", tmp_path, seed=3)
    refs = [hf_greedy(hf, p, n)[0] for p, n in zip(PROMPTS, OUT)]
    s = scheduler(tmp_path, overlap=True, device="cuda")
    assert s.engine.graphs is not None and s.engine.launches(3)
    n = Counting(s.engine)
    s.start()
    try:
        got = run_all(s, PROMPTS, OUT)
        assert got == refs, (got, refs)
        assert n.fed > 0, (n.launches, n.fed)
        # a prompt none of the above shares a page with: its pages enter the index as they fill
        fresh = [2, 10, 6, 12, 1]
        first, text, toks, last = next_turn(s, fresh)
        assert first == hf_greedy(hf, fresh, 11)[0], first
    finally:
        s.stop()
    assert last.cached_tokens >= 12, last
    assert toks == hf_greedy(hf, text, 6)[0], toks
    assert s.engine.pages.num_free == s.engine.pages.num_pages, (
        s.engine.pages.num_free,
        s.engine.pages.num_pages,
    )
