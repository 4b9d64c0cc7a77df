"""The device link end to end in ONE process on one GPU: what a linked decode step costs when
the two sides do not time-slice (the "expert server on its own GPU" case without a second GPU).

The coordinator's real engine (coordinator/model/remote_graphs.py: the linked whole-step graphs, the
slot table, the LinkStep/replay/error-read step) runs on the default stream; the expert
server's real step graphs (gpu_server/link_graphs.py ``LinkGraphs``) run on a second stream of
the same process, launched where the coordinator sends its LinkStep. One context: the two
sides' kernels run concurrently (each spinning wait holds one SM), as on two GPUs. What two
GPUs add is the NVLink latency of each flag and payload read (a few us per layer); what one
GPU adds is that both sides share its SMs and HBM.

Reported per batch, as benchmarks/bench_e2e.py does (fixed + per-layer split from depths 1 and
4, tokens/s at 48 layers): the in-process engine (every expert in the coordinator's graph) and
the linked pair; the linked pair's greedy tokens against in process.

    python3 benchmarks/bench_link_e2e.py [--new 32] [--batches 1 16 64]

Shapes: R rows (largest bucket), H hidden, K top-k, E experts.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import QWEN3_30B, TINY, em_decode_ms, write_checkpoint  # noqa: E402

from coordinator.model.cuda_graphs import BUCKETS  # noqa: E402
from coordinator.model.dispatch import LocalDispatcher  # noqa: E402
from coordinator.model.engine import Engine  # noqa: E402
from coordinator.model.kv_cache import KVCacheSpec  # noqa: E402
from coordinator.model.loader import load_model  # noqa: E402
from expertmesh.checkpoint import CheckpointReader  # noqa: E402
from expertmesh.transport import link  # noqa: E402
from expertmesh.transport.client import LinkAreas  # noqa: E402


class InProcessLink(LocalDispatcher):
    """A remote dispatcher's link half, with the server's step graphs in this process: prefill
    (never linked) computes every expert here; decode steps go over the link."""

    graph_mode = "piecewise"

    def __init__(self, reader: CheckpointReader, dtype: torch.dtype, dev: torch.device) -> None:
        from gpu_server.backend import make_backend
        from gpu_server.link_graphs import LinkGraphs

        super().__init__(reader, dtype, dev)
        cfg = reader.config
        r, h, k = BUCKETS[-1], cfg.hidden_size, cfg.top_k
        area = link.new_area(link.request_bytes(r, h, k, dtype), dev)
        self.server = LinkGraphs(make_backend(str(dev)), area, r, h, k, dtype, BUCKETS)
        self.lnk = LinkAreas(r, h, k, dtype, link.RequestViews.of(area, r, h, k, dtype), area)
        self.lnk.ans = self.server.ans
        link.warm_up(dev)
        # every expert on "the server" in slot order: slot = logical id
        ids = cfg.moe_layer_ids
        self.link_table = torch.arange(cfg.num_experts, dtype=torch.int32, device=dev).repeat(len(ids), 1)
        self.weights = [self.slots[layer] for layer in ids]
        self.stream = torch.cuda.Stream(dev)
        self.cluster = SimpleNamespace(timeout_s=10.0)
        self.conn = SimpleNamespace(spec=SimpleNamespace(name="in-process server"))
        self.linked_steps = self.link_reruns = 0

    def take_deferred(self):
        return None

    def stage(self, layer, x) -> None:
        pass

    def link_plan(self, bucket: int):
        return (0, self.conn, self.lnk) if bucket <= self.lnk.rows else None

    def launch_link_step(self, server, conn, step: int, rows: int, bucket: int):
        # NOTE: the server's host work (LinkGraphs.launch) stays on the step's critical path,
        # as the LinkStep's answer does across processes
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            report = self.server.launch(1, self.weights, bucket, step, rows, 10_000)
        if report is not None and report.errors:
            raise RuntimeError(f"server step {report.step}: error bits {report.errors}")
        return lambda: ""  # launched: the answer the dispatcher's caller reads

    def link_failed(self, server, conn, bits: int) -> None:
        raise RuntimeError(f"linked step failed: error bits {bits}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", type=int, nargs=2, default=[1, 4])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--tiny", action="store_true", help="small widths (smoke test)")
    ap.add_argument("--work", default="/tmp/bench_link_e2e")
    args = ap.parse_args()
    widths = TINY if args.tiny else QWEN3_30B
    dtype, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    vocab = widths["vocab_size"]
    pages = max(args.batches) * -(-(args.prompt + args.new + 3 + 1) // 16) + 8
    res: dict[str, dict[int, dict[int, float]]] = {"in process": {}, "linked, one process": {}}
    tokens: dict[tuple[str, int, int], list[int]] = {}
    for depth in args.depths:
        ck = Path(args.work) / f"L{depth}"
        hf = write_checkpoint(ck, widths, depth, dtype, "cuda")
        del hf
        gc.collect()
        reader = CheckpointReader(str(ck))
        for mode in res:
            model = load_model(reader, dtype, dev)
            d = (
                InProcessLink(reader, dtype, dev)
                if mode.startswith("linked")
                else LocalDispatcher(reader, dtype, dev)
            )
            eng = Engine(model, d, KVCacheSpec(pages, 16), dtype, dev)
            res[mode][depth] = {}
            for b in args.batches:
                res[mode][depth][b], tokens[(mode, depth, b)], _ = em_decode_ms(
                    eng, b, args.prompt, args.new, vocab
                )
            extra = ""
            if isinstance(d, InProcessLink):
                extra = f" linked steps {d.linked_steps}, pool {eng.graphs.link_pool_bytes / 2**20:.0f} MiB"  # type: ignore[union-attr]
                assert d.linked_steps > 0, "no step linked"
            print(mode, depth, res[mode][depth], extra, flush=True)
            del eng, d, model
            gc.collect()
            torch.cuda.empty_cache()
    l1, l2 = args.depths
    real = widths["real_depth"]
    print(
        f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.new} decode steps, prompt {args.prompt}"
    )
    print(f"| mode | batch | per-layer ms | fixed ms | tok/s at {real} layers | greedy tokens = in process |")
    print("|---|---|---|---|---|---|")
    for mode, r in res.items():
        for b in args.batches:
            per = (r[l2][b] - r[l1][b]) / (l2 - l1)
            fixed = r[l1][b] - l1 * per
            ref, mine = tokens[("in process", l2, b)], tokens[(mode, l2, b)]
            same = sum(x == y for x, y in zip(ref, mine)) / len(ref)
            print(
                f"| {mode} | {b} | {per:.3f} | {fixed:.2f} | {b / ((fixed + real * per) * 1e-3):.0f} | {same:.2f} |"
            )


if __name__ == "__main__":
    main()
