"""The shipped demo model: copied as is, served by our engine like HF serves it, and trained.

"Trained" is checked by what a new user sees (greedy output made of the corpus's words, a stop
at ``<|eos|>``) and by expert loads shaped like a real model's, with random weights of the same
shape as the control that must fail the same check.
"""

from __future__ import annotations

import filecmp
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from coordinator.model.engine import Engine
from expertmesh.config import ModelConfig
from expertmesh.demo import OPTIONAL_FILES, REQUIRED_FILES, WEIGHTS_DIR, DemoModelMissing, write_demo_model

CORPUS = Path(WEIGHTS_DIR).with_name("corpus.txt")
EOS_ID = 1


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="module")
def engine(demo_dir) -> Engine:
    return Engine.from_checkpoint(str(demo_dir), dtype=torch.float32, page_size=16)


@pytest.fixture(scope="module")
def tok(demo_dir) -> Tokenizer:
    return Tokenizer.from_file(str(demo_dir / "tokenizer.json"))


def greedy(eng: Engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy continuations of ``prompts``, decoded together, each up to its ``<|eos|>``."""
    seqs = [eng.new_seq() for _ in prompts]
    outs: list[list[int]] = [[] for _ in prompts]
    logits = eng.step(list(zip(seqs, prompts)))
    live = list(range(len(prompts)))
    for _ in range(max_new):
        for i, lg in zip(live, logits):
            outs[i].append(int(lg.argmax()))
        live = [i for i in live if outs[i][-1] != EOS_ID]
        if not live:
            break
        logits = eng.step([(seqs[i], outs[i][-1:]) for i in live])
    for s in seqs:
        eng.free(s)
    return outs


def expert_loads(eng: Engine, docs: list[list[int]]) -> torch.Tensor:
    """Tokens routed to each expert of each layer over ``docs``: ``[layers, E]``."""
    cfg = eng.config
    loads = torch.zeros(cfg.num_layers, cfg.num_experts, dtype=torch.long)

    def hook(layer: int, topk_ids: torch.Tensor) -> None:  # topk_ids [T, K]
        loads[layer] += torch.bincount(topk_ids.flatten(), minlength=cfg.num_experts)

    eng.model.attach(eng.dispatcher, hook)
    try:
        for i in range(0, len(docs), 16):
            seqs = [eng.new_seq() for _ in docs[i : i + 16]]
            eng.step(list(zip(seqs, docs[i : i + 16])))
            for s in seqs:
                eng.free(s)
    finally:
        eng.model.attach(eng.dispatcher, None)
    return loads


def corpus_sample(tok: Tokenizer, n: int = 60) -> list[list[int]]:
    docs = CORPUS.read_text().split("\n\n")
    return [tok.encode(d).ids + [EOS_ID] for d in docs[:: len(docs) // n][:n]]


def test_write_is_a_faithful_copy(demo_dir, tmp_path):
    again = write_demo_model(tmp_path / "a" / "b")
    for name in REQUIRED_FILES + OPTIONAL_FILES:
        assert filecmp.cmp(demo_dir / name, WEIGHTS_DIR / name, shallow=False), name
        assert filecmp.cmp(again / name, demo_dir / name, shallow=False), name
    cfg = ModelConfig.from_dir(demo_dir)
    assert cfg.model_type == "qwen3_moe" and all(cfg.moe_layers), cfg
    assert cfg.eos_token_ids == (EOS_ID,), cfg.eos_token_ids
    with safe_open(str(demo_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # HF's per-expert on-disk layout
    assert "model.layers.0.mlp.experts.15.gate_proj.weight" in names
    assert not any("gate_up_proj" in n for n in names)
    size = sum((demo_dir / n).stat().st_size for n in REQUIRED_FILES)
    assert size < 8 * 2**20, f"{size=} bytes: the shipped model should stay a few MB"


def test_missing_weights_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr("expertmesh.demo.WEIGHTS_DIR", tmp_path / "nowhere")
    with pytest.raises(DemoModelMissing, match="model.safetensors"):
        write_demo_model(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_engine_logits_equal_hf(demo_dir, engine, tok):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        demo_dir, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ids = tok.encode("Once upon a time, there was a brave fox named Kai. He loved to fly a kite.").ids
    got = engine.step([(engine.new_seq(), ids)], all_logits=True)[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert rel_err(got, ref) < 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_greedy_output_is_corpus_text(engine, tok):
    vocab = set(words(CORPUS.read_text()))
    prompts = ["Once upon a time", "A cow", "The sky is", "Tom went to the shop."]
    outs = greedy(engine, [tok.encode(p).ids for p in prompts], max_new=200)
    for prompt, out in zip(prompts, outs):
        assert out[-1] == EOS_ID, f"{prompt!r}: no <|eos|> in {len(out)} tokens"
        got = words(tok.decode(out))
        known = sum(w in vocab for w in got) / len(got)
        assert len(got) >= 5 and known >= 0.8, f"{prompt!r} -> {tok.decode(out)!r}: {known:.0%} known words"


def coldest_quarter_share(loads: torch.Tensor) -> torch.Tensor:
    """Per layer, the share of routed tokens that the coldest quarter of the experts gets: ``[layers]``
    (0.25 when the load is even)."""
    coldest = loads.sort(-1).values[:, : loads.shape[-1] // 4]
    return coldest.sum(-1) / loads.sum(-1)


# Measured on the shipped model over corpus_sample: the coldest quarter gets 0.3-2.9% of the
# tokens in every layer and the hottest expert 20-26% (uniform: 6.25%); random weights of the
# same shape leave 9-15% to the coldest quarter in their most even layer.
COLD_SHARE_MAX = 0.05


def test_expert_load_is_skewed_like_a_trained_model(engine, tok):
    loads = expert_loads(engine, corpus_sample(tok))  # [layers, E]
    share = loads / loads.sum(-1, keepdim=True)
    assert (share.max(-1).values > 3 / loads.shape[-1]).all(), share.max(-1).values
    assert (coldest_quarter_share(loads) < COLD_SHARE_MAX).all(), coldest_quarter_share(loads)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_weights_fail_the_skew_check(demo_dir, tok, tmp_path, seed):
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.from_pretrained(demo_dir)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    loads = expert_loads(Engine.from_checkpoint(str(tmp_path)), corpus_sample(tok))
    assert not (coldest_quarter_share(loads) < COLD_SHARE_MAX).all(), coldest_quarter_share(loads)


def test_writing_needs_neither_torch_nor_transformers(tmp_path):
    code = (
        "import sys; from expertmesh.demo import write_demo_model; "
        f"write_demo_model({str(tmp_path)!r}); "
        "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])
    assert (tmp_path / "model.safetensors").is_file()
