"""The ``expertmesh`` command. Each subcommand lives in the module that owns it; this file only
wires argparse to them (imports are lazy so ``expertmesh --help`` stays fast)."""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = (
    "Serve Mixture-of-Experts LLMs with the routed experts on GPU and CPU expert servers. "
    "Start with `expertmesh up --demo`; `expertmesh COMMAND --help` shows a command's flags."
)

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo-model": ("expertmesh.demo.cli", "write the tiny demo checkpoint to a directory"),
    "up": ("expertmesh.launcher", "start coordinator + GPU and CPU expert servers locally"),
    "coordinator": ("coordinator.main", "run the coordinator (attention, routing, scheduler, public API)"),
    "gpu-server": ("gpu_server.main", "run a GPU expert server"),
    "cpu-server": ("cpu_expert_server.main", "run a CPU expert server"),
    "generate": ("expertmesh.client_cli", "send one generation request to a coordinator"),
    "lora": ("expertmesh.lora.cli", "hot-load, unload or list MoE LoRA adapters on a coordinator"),
    "health": ("expertmesh.health", "exit 0 iff a server's grpc.health.v1 status is SERVING"),
    "status": ("expertmesh.status_cli", "operator view: servers, placement, KV use, throughput, hot experts"),
    "load": ("expertmesh.load_cli", "a coordinator's expert load: hot experts and per-server balance"),
    "placement": ("expertmesh.placement_cli", "show / set the expert placement, or run EPLB now"),
}

# a command's work that starts before its module (and torch) is imported: the CUDA
# coordinator's kernels compile in a helper process meanwhile (coordinator/model/compile_ahead.py)
EARLY: dict[str, str] = {"coordinator": "coordinator.model.compile_ahead"}


class _Formatter(argparse.HelpFormatter):
    """Shows a flag's default after its help unless the help says it already (or there is
    nothing to show: no default, a switch, a positional)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        d = action.default
        if (
            not action.option_strings
            or d is None
            or d is argparse.SUPPRESS
            or isinstance(d, bool)
            or d in ([], ())
            or "default" in text
        ):
            return action.help
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(prog="expertmesh", description=DESCRIPTION)
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    if chosen in EARLY:
        importlib.import_module(EARLY[chosen]).start(argv[1:])
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, formatter_class=_Formatter)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = ap.parse_args(argv)
    from expertmesh.auth import TokenFileError
    from expertmesh.tls import TLSError

    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).run(args) or 0)
    except (TLSError, TokenFileError) as e:  # unreadable TLS files or token file: say which, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
