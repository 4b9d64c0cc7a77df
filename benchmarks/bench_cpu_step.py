"""The CPU forward step's own cost: an in-process engine (every expert in the coordinator), one
torch thread, CPU time of ``Engine.step`` (``time.thread_time``, so other work on the host counts
little), the fastest of ``--repeat`` rounds.

Two steps, as a cached chat replay runs them: a decode step of ``--batch`` sequences that hold
about ``--past`` cached tokens each (the mean of ``--decodes`` steps), and an extend step of one
sequence's ``--extend`` new tokens over ``--past`` cached ones. Prompts are random token ids
(seeded); the demo model unless ``--model``.

    python benchmarks/bench_cpu_step.py                      # demo model, 4 x ~300 cached
    python benchmarks/bench_cpu_step.py --profile            # plus where a decode step's time goes

Shapes: none (token counts only).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from coordinator.model.engine import Engine  # noqa: E402
from expertmesh.demo import WEIGHTS_DIR  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(WEIGHTS_DIR), help="HF checkpoint directory")
    ap.add_argument("--batch", type=int, default=4, help="sequences of the decode step")
    ap.add_argument("--past", type=int, default=300, help="cached tokens per sequence (about)")
    ap.add_argument("--extend", type=int, default=48, help="new tokens of the extend step")
    ap.add_argument("--decodes", type=int, default=20, help="decode steps per round")
    ap.add_argument("--repeat", type=int, default=12, help="rounds; the fastest is kept")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true", help="cProfile one round of decode steps")
    args = ap.parse_args()
    if min(args.batch, args.past, args.extend, args.decodes, args.repeat, args.threads) < 1:
        raise SystemExit("every count must be at least 1")
    torch.set_num_threads(args.threads)
    need = args.batch * (-(-(args.past + args.batch * 8 + args.decodes + args.extend) // 16) + 2)
    eng = Engine.from_checkpoint(args.model, num_pages=need, page_size=16, prefix_cache=False)
    vocab = eng.config.vocab_size
    rng = random.Random(0)

    def fill() -> list[int]:  # the sequences, each with about --past tokens cached
        seqs = []
        for b in range(args.batch):
            sid = eng.new_seq()
            eng.step([(sid, [rng.randrange(vocab) for _ in range(args.past + 8 * b)])])
            seqs.append(sid)
        return seqs

    def decode(seqs: list[int]) -> None:
        for _ in range(args.decodes):
            eng.step([(s, [rng.randrange(vocab)]) for s in seqs])

    best_decode = best_extend = float("inf")
    for _ in range(args.repeat):
        seqs = fill()
        t0 = time.thread_time()
        decode(seqs)
        best_decode = min(best_decode, (time.thread_time() - t0) / args.decodes)
        t0 = time.thread_time()
        eng.step([(seqs[0], [rng.randrange(vocab) for _ in range(args.extend)])])
        best_extend = min(best_extend, time.thread_time() - t0)
        for s in seqs:
            eng.free(s)
    print(
        f"{eng.config.model_type}, {eng.config.num_layers} layers, H {eng.config.hidden_size}, "
        f"{args.threads} thread(s), best of {args.repeat}: decode step of {args.batch} x ~{args.past} "
        f"cached {best_decode * 1e3:.2f} ms; extend of {args.extend} over ~{args.past} "
        f"{best_extend * 1e3:.2f} ms (CPU time)"
    )
    if args.profile:
        seqs = fill()
        prof = cProfile.Profile()
        prof.enable()
        decode(seqs)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
