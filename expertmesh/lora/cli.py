"""``expertmesh lora {load NAME PATH | unload NAME | list} --addr HOST:PORT``: hot-load, unload
and list MoE LoRA adapters on a running coordinator (``expertmesh.v1.Admin``).

``load`` prints the adapter's slot, rank and targets; ``list`` one line per adapter (``--json``:
one JSON object). gRPC errors exit 1 with the status and message (PERMISSION_DENIED for a path
outside the coordinator's --lora-dir roots, NOT_FOUND for an unknown name, INVALID_ARGUMENT for
an adapter that does not fit the model, UNAVAILABLE when a server refused the push).
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from expertmesh import connect
from expertmesh.v1 import admin_pb2, admin_pb2_grpc


def add_arguments(p: argparse.ArgumentParser) -> None:
    # the options go after the verb (``lora load NAME PATH --addr A``): every verb takes them
    common = argparse.ArgumentParser(add_help=False)
    connect.add_arguments(common, admin=True)
    common.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the coordinator")
    common.add_argument("--json", action="store_true", help="print JSON instead of text")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    load = verbs.add_parser(
        "load", parents=[common], help="validate an adapter and push it to every expert server"
    )
    load.add_argument("name", help="the name GenerateRequest.lora / --lora selects it by")
    load.add_argument("path", help="adapter directory (adapter_config.json + adapter_model.safetensors)")
    unload = verbs.add_parser(
        "unload", parents=[common], help="remove an adapter from the coordinator and every server"
    )
    unload.add_argument("name")
    verbs.add_parser("list", parents=[common], help="list the loaded adapters")


def _info(i: admin_pb2.LoRAInfo) -> dict:
    return {
        "name": i.name,
        "path": i.path,
        "adapter_slot": i.adapter_slot,
        "max_rank": i.max_rank,
        "expert_layers": list(i.expert_layers),
        "modules": list(i.modules),
    }


def _line(i: admin_pb2.LoRAInfo) -> str:
    return (
        f"{i.name}\tslot={i.adapter_slot}\trank<={i.max_rank}\texpert_layers={len(i.expert_layers)}\t"
        f"modules={len(i.modules)}\t{i.path}"
    )


def run(args: argparse.Namespace) -> int:
    try:
        with connect.open_channel(args) as channel:
            stub = admin_pb2_grpc.AdminStub(channel)
            if args.verb == "load":
                info = stub.LoadLoRA(
                    admin_pb2.LoadLoRARequest(name=args.name, path=args.path), timeout=args.timeout
                )
                print(json.dumps(_info(info)) if args.json else f"loaded {_line(info)}")
            elif args.verb == "unload":
                stub.UnloadLoRA(admin_pb2.UnloadLoRARequest(name=args.name), timeout=args.timeout)
                print(json.dumps({"unloaded": args.name}) if args.json else f"unloaded {args.name}")
            else:
                listed = stub.ListLoRA(admin_pb2.ListLoRARequest(), timeout=args.timeout)
                if args.json:
                    print(
                        json.dumps(
                            {"max_loras": listed.max_loras, "adapters": [_info(i) for i in listed.adapters]}
                        )
                    )
                else:
                    for i in listed.adapters:
                        print(_line(i))
                    print(
                        f"[{len(listed.adapters)} of {listed.max_loras} adapter slots used]", file=sys.stderr
                    )
    except grpc.RpcError as e:
        print(f"error: {connect.describe_error(e, args)}", file=sys.stderr)
        return 1
    return 0
