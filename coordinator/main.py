"""``expertmesh coordinator --model DIR``: the public Generation/Admin API over the model.

With ``--gpu-server``/``--cpu-server`` the routed experts run on those expert servers; without
any, every expert runs in this process. Prints ``coordinator listening on HOST:PORT`` once the
port is bound (health turns SERVING when the expert servers are ready); SIGINT or SIGTERM stops
it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Coroutine

from coordinator.cluster_config import ClusterConfig
from coordinator.coordinator_config import CoordinatorConfig, parse_size
from coordinator.requests import InputLimits
from expertmesh import cores

DEFAULT_PORT = 50051


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 = a free port (printed)")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="serve the OpenAI-compatible HTTP API, /health and /metrics on this port (0 = a free one)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="device of attention, router and KV cache (cpu, cuda)")
    g = p.add_argument_group("scheduling and KV cache")
    g.add_argument("--page-size", type=int, default=16, help="tokens per KV cache page")
    g.add_argument("--kv-memory", default="256MiB", help="KV cache budget, e.g. 512MiB, 4GiB")
    g.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per forward step")
    g.add_argument("--max-running-requests", type=int, default=64)
    g.add_argument(
        "--max-context", type=int, default=None, help="default: the model's, capped by the KV cache"
    )
    g.add_argument("--default-max-new-tokens", type=int, default=64)
    g.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--max-message-mb", type=int, default=64)
    g.add_argument(
        "--connect-timeout", type=float, default=10.0, help="seconds per expert-server connect attempt"
    )
    ClusterConfig.add_arguments(p)
    InputLimits.add_arguments(p)


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    return CoordinatorConfig(
        model_dir=args.model,
        dtype=args.dtype,
        device=args.device,
        host=args.host,
        port=args.port,
        page_size=args.page_size,
        kv_memory_bytes=parse_size(args.kv_memory),
        max_batch_tokens=args.max_batch_tokens,
        max_running=args.max_running_requests,
        max_context=args.max_context,
        default_max_new_tokens=args.default_max_new_tokens,
        max_message_mb=args.max_message_mb,
        connect_timeout_s=args.connect_timeout,
        cluster=ClusterConfig.from_args(args),
        http_port=args.http_port,
        input_limits=InputLimits.from_args(args),
    )


async def serve(config: CoordinatorConfig) -> int:
    from coordinator.server import create_server

    server = create_server(config)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    if port == 0:
        print(f"error: could not bind {config.host}:{config.port}", file=sys.stderr)
        return 1
    await server.start()
    print(f"coordinator listening on {config.host}:{port}", flush=True)
    if server.http is not None:
        print(
            f"OpenAI-compatible HTTP API and /metrics on http://{config.host}:{server.http.port}", flush=True
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    logging.getLogger("expertmesh.coordinator").info("shutting down")
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
