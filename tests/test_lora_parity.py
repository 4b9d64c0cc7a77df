"""MoE LoRA parity against PEFT (float32, CPU, in process) and mixed-adapter batches.

For every architecture: a tiny random model (expert widths 2I != H), a random PEFT adapter with
non-zero B on attention, shared experts, dense MLPs and the routed experts (PEFT's fused
``target_parameters`` form, and the same adapter rewritten as per-expert linears with separate
gate/up A matrices), rank/alpha patterns or rsLoRA. The engine's logits through prefill and
greedy decode must match the PEFT model's.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.lora import enable_lora
from coordinator.model.engine import Engine
from tests import lora_utils
from tests.hf_models import ARCHS
from tests.test_parity import hf_greedy, rel_err

DECODE_STEPS = 3


def _sizes(cfg) -> tuple[int, int]:
    """(experts, expert intermediate size) of an HF config."""
    e_num = (
        getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or cfg.n_routed_experts
    )
    if cfg.model_type in ("mixtral", "olmoe"):
        return e_num, cfg.intermediate_size
    return e_num, cfg.moe_intermediate_size


def _check_against_peft(pm, eng, name: str) -> None:
    """Engine with adapter ``name`` vs the PEFT model: prefill logits (adapter and base rows in one
    batch) and greedy decode."""
    prompt = torch.randint(0, 96, (7,), generator=torch.Generator().manual_seed(3))
    base_seq, seq = eng.new_seq(), eng.new_seq()
    full_base, full = eng.step(
        [(base_seq, prompt.tolist()), (seq, prompt.tolist())], all_logits=True, adapters=[None, name]
    )
    with torch.no_grad():
        ref = pm(prompt[None]).logits[0]
        with pm.disable_adapter():
            ref_base = pm(prompt[None]).logits[0]
        assert rel_err(ref, ref_base) > 1e-2, (
            "the adapter barely changes the logits: the test would prove nothing"
        )
        assert rel_err(full, ref) < 1e-4
        assert rel_err(full_base, ref_base) < 1e-4
        ref_toks, ref_logits = hf_greedy(pm, prompt, DECODE_STEPS)
    toks, logits = [int(full[-1].argmax())], [full[-1]]
    for _ in range(DECODE_STEPS - 1):
        (o,) = eng.step([(seq, [toks[-1]])], adapters=[name])
        logits.append(o)
        toks.append(int(o.argmax()))
    assert toks == ref_toks
    assert rel_err(torch.stack(logits), ref_logits) < 1e-4
    eng.free(base_seq)
    eng.free(seq)


# deepseek_v2_grouped differs from deepseek_v2 only in routing, which LoRA does not touch
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "deepseek_v2_grouped"])
def test_lora_parity_with_peft(arch, tmp_path):
    """Both expert forms on one model: the fused target_parameters adapter first, then (gate_up B
    made block-diagonal in the PEFT model) the same adapter as per-expert linears."""
    rslora = arch in ("olmoe", "deepseek_v3")  # the others exercise rank/alpha patterns
    hf = lora_utils.make_model(arch, tmp_path / "model")
    pm = lora_utils.wrap(hf, rslora=rslora, seed=1)
    eng = Engine.from_checkpoint(str(tmp_path / "model"), dtype=torch.float32, page_size=4)
    mgr = enable_lora(eng, max_loras=2)
    mgr.load("fused", str(lora_utils.save(pm, tmp_path / "fused")))
    _check_against_peft(pm, eng, "fused")
    e_num, inter = _sizes(hf.config)
    lora_utils.split_gate_up(pm, e_num, inter)
    split = lora_utils.save(pm, tmp_path / "split")
    per_expert = lora_utils.to_per_expert(
        split, tmp_path / "per_expert", e_num, hf.config.hidden_size, inter, mixtral=arch == "mixtral"
    )
    mgr.load("per_expert", str(per_expert))
    _check_against_peft(pm, eng, "per_expert")


def _variant(src, dst, seed: int):
    """A copy of adapter ``src`` with every tensor redrawn (same names, shapes, config)."""
    import shutil

    from safetensors.torch import load_file, save_file

    dst.mkdir()
    shutil.copy(src / "adapter_config.json", dst / "adapter_config.json")
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(src / "adapter_model.safetensors")
    save_file(
        {k: torch.randn(v.shape, generator=g) * v.std() for k, v in tensors.items()},
        dst / "adapter_model.safetensors",
    )
    return dst


def test_mixed_batch_equals_alone(tmp_path):
    """Base + 3 adapters in one batch: each sequence's tokens and logits as when run alone."""
    hf = lora_utils.make_model("qwen2_moe", tmp_path / "model")
    first = lora_utils.save(lora_utils.wrap(hf, seed=10), tmp_path / "ad0")
    paths = [first, _variant(first, tmp_path / "ad1", 11), _variant(first, tmp_path / "ad2", 12)]
    eng = Engine.from_checkpoint(str(tmp_path / "model"), dtype=torch.float32, page_size=4)
    mgr = enable_lora(eng, max_loras=4)
    for i, p in enumerate(paths):
        mgr.load(f"a{i}", str(p))
    names: list[str | None] = [None, "a0", "a1", "a2"]
    assert mgr.slot_of == {"a0": 0, "a1": 1, "a2": 2}
    prompts = [
        torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 5, 9, 6)
    ]

    def run(group: list[int]) -> dict[int, tuple[list[int], torch.Tensor]]:
        seqs = {i: eng.new_seq() for i in group}
        outs = eng.step([(seqs[i], prompts[i]) for i in group], adapters=[names[i] for i in group])
        toks = {i: [int(o.argmax())] for i, o in zip(group, outs)}
        logits = {i: [o] for i, o in zip(group, outs)}
        for _ in range(3):
            outs = eng.step([(seqs[i], [toks[i][-1]]) for i in group], adapters=[names[i] for i in group])
            for i, o in zip(group, outs):
                toks[i].append(int(o.argmax()))
                logits[i].append(o)
        for s in seqs.values():
            eng.free(s)
        return {i: (toks[i], torch.stack(logits[i])) for i in group}

    mixed = run([0, 1, 2, 3])
    alone = {i: run([i])[i] for i in range(4)}
    for i in range(4):
        assert mixed[i][0] == alone[i][0], f"sequence {i} ({names[i]}): tokens differ in the mixed batch"
        assert rel_err(mixed[i][1], alone[i][1]) < 1e-5
    # and the adapters really act, each differently: otherwise "identical" would prove nothing
    for i, j in ((1, 0), (2, 0), (3, 0), (1, 2), (2, 3)):
        assert rel_err(alone[i][1][0], alone[j][1][0]) > 1e-2, f"sequences {i} and {j} barely differ"
