"""Trains the demo model: a tiny Qwen3-MoE on the shipped corpus, on the CPU, reproducibly.

    python -m expertmesh.demo.train --out expertmesh/demo/weights

Reads ``corpus.txt`` (written by ``python -m expertmesh.demo.corpus``), trains the tokenizer,
trains the model with a fixed seed, a fixed number of steps and 2 threads, and writes an HF
checkpoint directory (config.json, model.safetensors in bfloat16 with per-expert tensors,
generation_config.json, tokenizer.json, tokenizer_config.json).

transformers is a development dependency: only this script imports it, never the runtime.

Shapes: B sequences in a batch, L tokens per sequence, V vocab, E experts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import Any

# NOTE: set before torch starts OpenMP; busy-waiting threads make training several times
# slower on cores shared with other work.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from expertmesh.demo.corpus import DOC_SEPARATOR  # noqa: E402
from expertmesh.demo.tokenizer import BOS, BOS_ID, EOS, EOS_ID, encode_document, train_tokenizer  # noqa: E402

CORPUS = Path(__file__).with_name("corpus.txt")

MODEL: dict[str, Any] = dict(
    model_type="qwen3_moe",
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    intermediate_size=256,  # unused: every layer is an MoE layer
    norm_topk_prob=True,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    # NOTE: HF's balancing loss pools the router logits of all layers, so it evens out only the
    # total use of each expert id; per layer the loads stay skewed (hot and nearly idle experts).
    router_aux_loss_coef=0.01,
)


def read_corpus(path: Path = CORPUS) -> list[str]:
    return [d for d in path.read_text().split(DOC_SEPARATOR) if d.strip()]


def pack(tok, docs: list[str]) -> torch.Tensor:
    """All documents as one id stream ``<|bos|> doc <|eos|> <|bos|> ...``; windows are cut from it."""
    return torch.tensor([i for d in docs for i in encode_document(tok, d)], dtype=torch.long)


def batches(stream: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq] for s in starts.tolist()])  # [B, L]


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def eval_loss(model, stream: torch.Tensor, seq: int) -> float:
    n = (len(stream) - 1) // seq
    x = stream[: n * seq + 1]
    inputs, labels = x[:-1].view(n, seq), x[1:].view(n, seq)
    logits = model(input_ids=inputs, output_router_logits=False).logits
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


def train(args: argparse.Namespace):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    docs = read_corpus()
    tok = train_tokenizer(docs, args.vocab)
    # every 20th document is held out for the validation loss (and the expert-load report)
    train_docs, valid_docs = [d for i, d in enumerate(docs) if i % 20], docs[::20]
    train_ids, valid_ids = pack(tok, train_docs), pack(tok, valid_docs)
    print(
        f"{len(docs)} docs, {len(train_ids)} train / {len(valid_ids)} valid tokens, vocab {tok.get_vocab_size()}"
    )

    cfg = AutoConfig.for_model(**MODEL, vocab_size=tok.get_vocab_size())
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", experts_implementation="eager"
    ).train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        xy = batches(train_ids, args.batch, args.seq, gen)
        # NOTE: HF shifts the labels itself, so labels are the inputs
        out = model(input_ids=xy, labels=xy, output_router_logits=True)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            valid = eval_loss(model.eval(), valid_ids, args.seq)
            model.train()
            print(f"step {step:5d} loss {out.loss.item():.3f} aux {out.aux_loss.item():.3f} "
                  f"valid {valid:.3f} {time.perf_counter() - t0:6.1f}s", flush=True)  # fmt: skip
    elapsed = time.perf_counter() - t0
    model.eval()
    print(f"trained {args.steps} steps in {elapsed:.0f}s; validation loss {valid:.3f}")
    stats = {
        "train_seconds": round(elapsed),
        "train_loss": round(out.loss.item(), 3),
        "valid_loss": round(valid, 3),
    }
    return model, tok, stats


@torch.no_grad()
def expert_loads(model, stream: torch.Tensor, seq: int) -> torch.Tensor:
    """Tokens routed to each expert of each layer over ``stream``: ``[layers, E]``."""
    n = (len(stream) - 1) // seq
    out = model(input_ids=stream[: n * seq].view(n, seq), output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack(
        [torch.bincount(r.topk(k, -1).indices.flatten(), minlength=r.shape[-1]) for r in out.router_logits]
    )


def save(model, tok, out: Path, stats: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.to(torch.bfloat16).save_pretrained(out)  # default: per-expert tensors on disk
    tok.save(str(out / "tokenizer.json"))
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS}
    (out / "tokenizer_config.json").write_text(
        json.dumps({**tok_cfg, "model_max_length": 512}, indent=2) + "\n"
    )
    (out / "training.json").write_text(json.dumps(stats, indent=2) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("weights"))
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--vocab", type=int, default=768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()
    model, tok, stats = train(args)
    loads = expert_loads(model, pack(tok, read_corpus()[::20]), args.seq)  # the held-out documents
    for layer, row in enumerate(loads.tolist()):
        print(f"layer {layer} expert loads {row} max/min {max(row) / max(1, min(row)):.1f}")
    stats |= {k: v for k, v in vars(args).items() if k not in ("out", "log_every")}
    save(model, tok, args.out, stats)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
