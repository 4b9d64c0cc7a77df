"""``expertmesh coordinator --model DIR``: the public Generation/Admin API over the model.

With ``--gpu-server``/``--cpu-server`` the routed experts run on those expert servers; without
any, every expert runs in this process. Prints ``coordinator listening on HOST:PORT`` once the
port is bound (health turns SERVING when the expert servers are ready); SIGINT or SIGTERM drains
it (coordinator/serving/drain.py) and stops it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine

from coordinator.config import DTYPES, CoordinatorConfig, InputLimits, parse_size
from coordinator.eplb.plan import EplbConfig
from coordinator.experts.cluster_config import ClusterConfig
from coordinator.model import compile_ahead
from expertmesh import auth, cores
from expertmesh.errors import BindError
from expertmesh.tls import TLSConfig

C = CoordinatorConfig  # NOTE: the defaults live in the config dataclass, read here once
DEFAULT_PORT = C.port


def _micro_batches(v: str) -> int | None:  # the range is checked with the other settings
    if v == "auto":
        return None
    try:
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a count, got {v!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default=C.host, help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = a free port (printed)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API, /health and /metrics on this port (0 = a free one)",
    )
    p.add_argument("--dtype", default=C.dtype, choices=list(DTYPES), help="dtype of weights and activations")
    p.add_argument("--device", default=C.device, help="device of attention, router and KV cache (cpu, cuda)")
    p.add_argument(
        compile_ahead.FLAG,
        action="store_true",
        help="on CUDA with every expert in process, compile the decode step's kernels in this process "
        "after the weights load, not in a helper process that starts with it (the default)",
    )
    g = p.add_argument_group("scheduling and KV cache")
    g.add_argument("--page-size", type=int, default=C.page_size, help="tokens per KV cache page")
    g.add_argument(
        "--kv-memory", default=f"{C.kv_memory_bytes >> 20}MiB", help="KV cache budget, e.g. 512MiB, 4GiB"
    )
    g.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="do not keep full KV pages for later requests with the same prompt prefix (they are "
        "reused by default; unused ones are evicted when pages run short)",
    )
    g.add_argument("--max-batch-tokens", type=int, default=C.max_batch_tokens, help="tokens per forward step")
    g.add_argument("--max-running-requests", type=int, default=C.max_running)
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=C.max_queued_requests,
        help="requests waiting for admission; beyond it RESOURCE_EXHAUSTED (HTTP 429)",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=int,
        default=C.max_queued_tokens,
        help="prompt tokens of the queued requests",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take (queued + generating) when the client's deadline is later or absent",
    )
    g.add_argument(
        "--max-context", type=int, default=C.max_context, help="default: the model's, capped by the KV cache"
    )
    g.add_argument("--default-max-new-tokens", type=int, default=C.default_max_new_tokens)
    g.add_argument(
        "--micro-batches",
        type=_micro_batches,
        default=C.micro_batches,
        metavar="N|auto",
        help="split a decode step of 2+ sequences into up to N micro-batches, one's attention overlapping "
        "another's remote experts: inside the linked decode graph over a TCP relay that takes them, "
        "else eagerly when the step cannot link (1 = off; default auto: 2 inside linked steps of 4-16 "
        "sequences, where they paid in the measured runs, never eagerly)",
    )
    g.add_argument(
        "--no-step-overlap",
        dest="step_overlap",
        action="store_false",
        help="read each decode step's tokens back before the next step is launched (default: where "
        "decode graphs are captured, the next step is queued on the device first, fed the samples there, "
        "and the host's work per token runs while it computes)",
    )
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--max-message-mb", type=int, default=C.max_message_mb)
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=C.connect_timeout_s,
        help="seconds per expert-server connect attempt",
    )
    p.add_argument(
        "--admin-token",
        default=None,
        help=f"secret every Admin call must carry (or env {auth.ADMIN_TOKEN_ENV}); "
        "without one, Admin answers loopback peers only",
    )
    f = p.add_argument_group("faults and shutdown")
    f.add_argument(
        "--drain-timeout",
        type=float,
        default=C.drain_timeout_s,
        help="on SIGTERM: refuse new requests (UNAVAILABLE / HTTP 503), finish running ones for at "
        "most this many seconds, then cancel the rest and exit 0",
    )
    f.add_argument(
        "--degraded-replace-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="when an expert server stays down this long and some experts have no live replica, "
        "re-place every expert over the remaining servers (EPLB) from the checkpoint (default: off)",
    )
    ClusterConfig.add_arguments(p)
    TLSConfig.add_arguments(p, "coordinator")
    InputLimits.add_arguments(p)
    EplbConfig.add_arguments(p)

    lo = p.add_argument_group("MoE LoRA")
    lo.add_argument(
        "--lora-dir", action="append", default=[], help="root under which adapters may be loaded (repeatable)"
    )
    lo.add_argument("--max-loras", type=int, default=4, help="adapters loaded at once")


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(
        model_dir=args.model,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=args.port,
        page_size=args.page_size,
        kv_memory_bytes=parse_size(args.kv_memory),
        prefix_cache=args.prefix_cache,
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        max_queued_tokens=args.max_queued_tokens,
        request_timeout_s=args.request_timeout,
        max_context=args.max_context,
        default_max_new_tokens=args.default_max_new_tokens,
        max_message_mb=args.max_message_mb,
        connect_timeout_s=args.connect_timeout,
        cluster=ClusterConfig.from_args(args),
        http_port=args.http_port,
        eplb=EplbConfig.from_args(args),
        lora_dirs=tuple(args.lora_dir),
        max_loras=args.max_loras,
        micro_batches=args.micro_batches,
        step_overlap=args.step_overlap,
        admin_token=args.admin_token or auth.token_from_env(auth.ADMIN_TOKEN_ENV),
        input_limits=InputLimits.from_args(args),
        tls=TLSConfig.from_args(args),
        drain_timeout_s=args.drain_timeout,
        degraded_replace_after_s=args.degraded_replace_after,
    )


async def serve(config: CoordinatorConfig) -> int:
    from coordinator.serving.drain import drain
    from coordinator.serving.server import create_server

    server = create_server(config)
    port = server.add_port(f"{config.host}:{config.port}")  # TLS with --tls-cert
    await server.start()
    print(f"coordinator listening on {config.host}:{port}", flush=True)
    if server.http is not None:
        scheme = "https" if config.tls is not None and config.tls.server_enabled else "http"
        print(
            f"OpenAI-compatible HTTP API and /metrics on {scheme}://{config.host}:{server.http.port}",
            flush=True,
        )
    if not config.admin_token and auth.binds_beyond_loopback(config.host):
        logging.getLogger("expertmesh.coordinator").warning(
            "listening on %s without an admin token: Admin answers loopback peers only "
            "(set --admin-token or %s to manage it remotely)",
            config.host,
            auth.ADMIN_TOKEN_ENV,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log = logging.getLogger("expertmesh.coordinator")
    log.info("draining (at most %gs): new requests are refused", config.drain_timeout_s)
    left = await drain(server, config.drain_timeout_s)
    if left:
        log.warning("drain timeout: cancelling %d unfinished requests", left)
        # NOTE: before the gRPC server's own grace period, which would let them run on
        await asyncio.to_thread(server.scheduler.stop)
    log.info("shutting down")
    await server.stop(5.0)
    return 0


def _run_loop(main: Coroutine[object, object, int]) -> int:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.threads:
        cores.set_torch_threads(args.threads)  # intra- and inter-op pools
    try:
        return _run_loop(serve(config_from_args(args)))
    except ValueError as e:  # bad flags, checkpoint or config: ConfigError, CheckpointError, ...
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BindError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        compile_ahead.stop()  # NOTE: a start that failed before waiting for it
