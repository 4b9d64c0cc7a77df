"""Accuracy cost of ``--cpu-defer-experts N`` on the shipped demo model (coordinator/model/deferral.py).

A GPU expert server (``--device cpu`` unless told) and a CPU expert server over the demo
checkpoint, ``--num-gpu-experts G`` for each G given; teacher-forced over held-out documents
(corpus seed the model was not trained on): mean KL(p_N=0 || p_N) of the next-token
distributions and the fraction of positions whose greedy token agrees, against N = 0 on the
same placement (which equals the in-process model). Float32 throughout.

    python benchmarks/cpu_defer_accuracy.py --docs 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from coordinator.experts.remote import ClusterConfig, ServerSpec  # noqa: E402
from expertmesh.demo import corpus, write_demo_model  # noqa: E402
from expertmesh.demo.tokenizer import encode_document  # noqa: E402
from tests.cluster_utils import start_server  # noqa: E402
from tests.test_cluster import engine_for  # noqa: E402


def logits_for(path: Path, servers, gpu_experts: int, n: int, docs: list[list[int]]) -> torch.Tensor:
    eng, d = engine_for(path, ClusterConfig(servers, num_gpu_experts=gpu_experts, cpu_defer_experts=n))
    try:
        out = []
        for ids in docs:
            sid = eng.new_seq()
            out.append(eng.step([(sid, ids)], all_logits=True)[0].float())  # [n, V]
            eng.free(sid)
        return torch.cat(out)  # [N, V]
    finally:
        d.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234, help="corpus seed (0 = the training documents)")
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--gpu-experts", default="8,4,0", help="--num-gpu-experts values (demo: 16 experts)")
    p.add_argument("--defer", default="1,2", help="N values (demo: top-2)")
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_demo_model(Path(tmp) / "model")
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        docs = [encode_document(tok, d)[: args.max_len] for d in corpus.generate(args.docs, seed=args.seed)]
        gpu, cpu = start_server("gpu", path), start_server("cpu", path)
        servers = (ServerSpec("gpu0", gpu.address, "gpu"), ServerSpec("cpu0", cpu.address, "cpu"))
        try:
            for g in [int(s) for s in args.gpu_experts.split(",")]:
                lp = logits_for(path, servers, g, 0, docs).log_softmax(-1)  # [N, V]
                for n in [int(s) for s in args.defer.split(",")]:
                    lq = logits_for(path, servers, g, n, docs).log_softmax(-1)
                    kl = F.kl_div(lq, lp, log_target=True, reduction="batchmean").item()
                    agree = (lp.argmax(-1) == lq.argmax(-1)).float().mean().item()
                    row = dict(gpu_experts=g, defer=n, kl_mean=kl, greedy_agree=agree, positions=lp.shape[0])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        finally:
            gpu.stop()
            cpu.stop()
    print(f"\n# demo model (16 experts, top-2, 4 layers), {args.docs} held-out docs, seed {args.seed}")
    print(
        "| --num-gpu-experts | --cpu-defer-experts | KL(N=0 || N) nats/token | greedy agreement | positions |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['gpu_experts']} | {r['defer']} | {r['kl_mean']:.2e} | {r['greedy_agree']:.2%} | {r['positions']} |"
        )


if __name__ == "__main__":
    main()
