"""Model parity against HF transformers: logits through prefill and decode, greedy tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from coordinator.model.engine import Engine
from tests.hf_models import ARCHS, make_checkpoint

DECODE_STEPS = 8


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def hf_greedy(hf, prompt: torch.Tensor, steps: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy decode with its own KV cache; returns tokens and each step's logits [steps, V]."""
    out = hf(prompt[None], use_cache=True)
    past, logits = out.past_key_values, [out.logits[0, -1]]
    toks = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = hf(torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1])
        toks.append(int(out.logits[0, -1].argmax()))
    return toks, torch.stack(logits)


def assert_greedy_matches_hf(eng: Engine, hf, prompt: torch.Tensor, steps: int = DECODE_STEPS) -> None:
    """Prefill logits of every prompt position, then ``steps`` greedy tokens and their logits,
    from ``eng`` against HF (float32: relative error below 1e-4, tokens equal)."""
    sid = eng.new_seq()
    full = eng.step([(sid, prompt.tolist())], all_logits=True)[0].cpu()  # (HF runs on the CPU)
    with torch.no_grad():
        assert rel_err(full, hf(prompt[None]).logits[0]) < 1e-4
        ref_toks, ref_logits = hf_greedy(hf, prompt, steps)
    toks, logits = [int(full[-1].argmax())], [full[-1]]
    for _ in range(steps - 1):
        out = eng.step([(sid, [toks[-1]])])[0].cpu()
        logits.append(out)
        toks.append(int(out.argmax()))
    assert toks == ref_toks
    assert rel_err(torch.stack(logits), ref_logits) < 1e-4


@pytest.mark.parametrize("original_format", [True, False], ids=["per_expert", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_float32_parity(arch, original_format, tmp_path):
    hf = make_checkpoint(arch, tmp_path, original_format=original_format)
    eng = Engine.from_checkpoint(str(tmp_path), dtype=torch.float32, page_size=4)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 5)]
    seqs = [eng.new_seq() for _ in prompts]
    # full-sequence prefill logits, both prompts in one batch
    full = eng.step([(s, p.tolist()) for s, p in zip(seqs, prompts)], all_logits=True)
    with torch.no_grad():
        for p, got in zip(prompts, full):
            assert rel_err(got, hf(p[None]).logits[0]) < 1e-4
        refs = [hf_greedy(hf, p, DECODE_STEPS) for p in prompts]
    toks = [[int(f[-1].argmax())] for f in full]
    step_logits: list[list[torch.Tensor]] = [[f[-1]] for f in full]
    for _ in range(DECODE_STEPS - 1):
        outs = eng.step([(s, [t[-1]]) for s, t in zip(seqs, toks)])
        for i, o in enumerate(outs):
            step_logits[i].append(o)
            toks[i].append(int(o.argmax()))
    for (ref_toks, ref_logits), got_toks, got_logits in zip(refs, toks, step_logits):
        assert got_toks == ref_toks
        assert rel_err(torch.stack(got_logits), ref_logits) < 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_argmax(arch, tmp_path):
    make_checkpoint(arch, tmp_path)
    # eager attention and experts are HF's reference maths; its bf16 SDPA and grouped_mm paths
    # on the CPU round differently (argmax then agrees on only ~85-95% of positions)
    hf = AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    eng = Engine.from_checkpoint(str(tmp_path), dtype=torch.bfloat16, page_size=8)
    ids = torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(1))
    got = eng.step([(eng.new_seq(), ids.tolist())], all_logits=True)[0]
    with torch.no_grad():
        ref = hf(ids[None]).logits[0].float()
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.99, f"{arch}: argmax agrees on {agree:.2%} of positions"


def test_chunked_prefill_equals_one_shot(tmp_path):
    """Prefill split over steps (as the scheduler does) gives the same logits as one shot."""
    make_checkpoint("qwen3_moe", tmp_path)
    eng = Engine.from_checkpoint(str(tmp_path), page_size=4)
    ids = list(range(3, 40))
    a, b = eng.new_seq(), eng.new_seq()
    one = eng.step([(a, ids)])[0]
    eng.step([(b, ids[:10])])
    eng.step([(b, ids[10:25])])
    chunked = eng.step([(b, ids[25:])])[0]
    assert rel_err(chunked, one) < 1e-5


def test_deepseek_v3_skips_mtp_layers(tmp_path):
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer after the last decoder layer
    (model.layers.{num_layers}.*); HF does not build it and the loader must not trip on it."""
    from safetensors.torch import load_file, save_file

    hf = make_checkpoint("deepseek_v3", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    n = hf.config.num_hidden_layers
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"model.layers.{n}.shared_head.norm.weight"] = torch.ones(64)
    save_file(tensors, file, metadata={"format": "pt"})
    eng = Engine.from_checkpoint(str(tmp_path), page_size=4)
    ids = list(range(3, 20))
    got = eng.step([(eng.new_seq(), ids)])[0]
    with torch.no_grad():
        assert rel_err(got, hf(torch.tensor([ids])).logits[0, -1]) < 1e-4
