"""Accuracy cost of int8/int4 CPU experts on the shipped demo model, against unquantised experts.

Held-out text: documents from the demo corpus generator with a seed the model was not trained
on (training used seed 0). Teacher-forced over every position: mean KL(p_bf16 || p_quant) of the
next-token distributions and the fraction of positions whose greedy (argmax) token agrees.
Attention and everything else stay float32; only the routed experts change. Every expert call
goes through the C decode kernel (the path decode steps take), once with integer dot products
(activations quantised to int8 per token and group: "int8"/"int4") and once with fp32 dot
products on the same quantised weights ("+exact": only the weights' rounding).

    python benchmarks/cpu_quant_accuracy.py --docs 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from coordinator.model.dispatch import LocalDispatcher
from coordinator.model.engine import Engine
from cpu_expert_server.backend import CpuExpertBackend
from expertmesh.checkpoint import CheckpointReader
from expertmesh.demo import corpus, write_demo_model
from expertmesh.demo.tokenizer import encode_document


def logits_for(
    model_dir: str, weight_dtype: str, docs: list[list[int]], qact: bool = True, group: int | None = None
) -> list[torch.Tensor]:
    reader = CheckpointReader(model_dir)
    backend = CpuExpertBackend(weight_dtype=weight_dtype, qact=qact, group=group)
    backend.gemv_max_tokens = 10**9  # every call through the decode kernel, as decode steps go
    dispatcher = LocalDispatcher(reader, torch.float32, torch.device("cpu"), backend)
    # the worker packs at load; the in-process dispatcher does not, so pack its slots here
    dispatcher.slots = {layer: backend.pack_weights(*w) for layer, w in dispatcher.slots.items()}
    engine = Engine.from_checkpoint(model_dir, dtype=torch.float32, dispatcher=dispatcher)
    out = []
    for ids in docs:
        sid = engine.new_seq()
        out.append(engine.step([(sid, ids)], all_logits=True)[0].float())  # [n, V]
        engine.free(sid)
    return out


def engine_widths(model_dir: str) -> tuple[int, int]:
    reader = CheckpointReader(model_dir)
    _, (w13, w2) = next(iter(LocalDispatcher(reader, torch.float32, torch.device("cpu")).slots.items()))
    return w13.shape[2], w2.shape[2]


def dot_kinds(model_dir: str) -> dict[str, str]:
    h, i = engine_widths(model_dir)
    out = {}
    for wd in ("int8", "int4"):
        b = CpuExpertBackend(weight_dtype=wd)
        b.pack_weights(torch.zeros(1, 2 * i, h), torch.zeros(1, h, i))
        out[wd] = b.dot_kind()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234, help="corpus seed (0 = the training documents)")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--int4-group", type=int, default=None, help="int4 group size (default: the backend's)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(write_demo_model(Path(tmp) / "model"))
        tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
        docs = [encode_document(tok, d)[: args.max_len] for d in corpus.generate(args.docs, seed=args.seed)]
        base = logits_for(model_dir, "bfloat16", docs)
        rows = {}
        for wd, qact in (("int8", True), ("int8", False), ("int4", True), ("int4", False)):
            quant = logits_for(model_dir, wd, docs, qact, args.int4_group if wd == "int4" else None)
            if not qact:
                wd += "+exact"
            lp, lq = torch.cat(base).log_softmax(-1), torch.cat(quant).log_softmax(-1)  # [N, V]
            kl = F.kl_div(lq, lp, log_target=True, reduction="batchmean").item()
            agree = (lp.argmax(-1) == lq.argmax(-1)).float().mean().item()
            rows[wd] = {"kl_mean": kl, "greedy_agree": agree, "positions": lp.shape[0]}
            print(
                f"{wd}: KL(bf16||{wd}) = {kl:.2e} nats/token, greedy agreement {agree:.2%} over {lp.shape[0]} positions"
            )
        print(json.dumps(rows))
        print(
            f"demo model expert widths (H, I) = {engine_widths(model_dir)}; kernel dots: {dot_kinds(model_dir)}"
        )


if __name__ == "__main__":
    main()
