"""``expertmesh generate --addr HOST:PORT (--prompt TEXT | --input-ids 1,2,3) [options]``.

Streams the completion's text to stdout (token ids when the model has no tokenizer) and a
one-line summary to stderr; with ``--json`` prints one JSON object instead:
``{"token_ids": [...], "text": "...", "finish_reason": "...", "usage": {...}, "logprobs": [...]}``
(``logprobs`` only with ``--logprobs``). gRPC errors exit non-zero with the status and message.
"""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from expertmesh import connect
from expertmesh.client import Client
from expertmesh.tls import TLSConfig


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    connect.add_arguments(p, admin=False)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (needs the model's tokenizer)")
    src.add_argument("--input-ids", type=_ids, help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=None, help="server default: 64")
    p.add_argument("--temperature", type=float, default=None, help="0 (default) = greedy")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", action="store_true", help="return each token's log-probability")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole request")
    p.add_argument("--lora", default="", help="LoRA adapter name (see `expertmesh lora list`); default: base")


def run(args: argparse.Namespace) -> int:
    kw = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        lora=args.lora,
    )
    try:
        with Client(args.addr, timeout=args.timeout, tls=TLSConfig.from_args(args)) as client:
            if args.json:
                out = client.generate(args.prompt, args.input_ids, **kw)
                obj: dict[str, object] = {
                    "token_ids": out.token_ids,
                    "text": out.text,
                    "finish_reason": out.finish_reason,
                    "usage": {
                        "prompt_tokens": out.usage.prompt_tokens,
                        "completion_tokens": out.usage.completion_tokens,
                        "cached_tokens": out.usage.cached_tokens,
                    },
                }
                if args.logprobs:
                    obj["logprobs"] = out.logprobs
                print(json.dumps(obj))
                return 0
            return _stream(client, args, kw)
    except grpc.RpcError as e:
        print(f"error: {connect.describe_error(e, args)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stream(client: Client, args: argparse.Namespace, kw: dict) -> int:
    ids: list[int] = []
    logprobs: list[float] = []
    any_text = False
    last = None
    for chunk in client.stream(args.prompt, args.input_ids, **kw):
        ids += chunk.token_ids
        logprobs += chunk.logprobs
        if chunk.text:
            any_text = True
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        last = chunk
    if not any_text and ids:  # no tokenizer on the server: show the ids
        sys.stdout.write(" ".join(map(str, ids)))
    sys.stdout.write("\n")
    assert last is not None and last.usage is not None
    summary = (
        f"[finish_reason={last.finish_reason} prompt_tokens={last.usage.prompt_tokens} "
        f"completion_tokens={last.usage.completion_tokens}]"
    )
    if args.logprobs:
        summary += " logprobs=" + ",".join(f"{x:.4f}" for x in logprobs)
    print(summary, file=sys.stderr)
    return 0
