"""``expertmesh demo-model OUT_DIR``."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", help="directory to write config.json, model.safetensors, tokenizer.json into")


def run(args: argparse.Namespace) -> int:
    from expertmesh.demo import write_demo_model

    out = write_demo_model(args.out_dir)
    print(f"demo model written to {out}")
    return 0
