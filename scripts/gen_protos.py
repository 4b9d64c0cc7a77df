"""Regenerates expertmesh/v1/*_pb2*.py(i) from protos/; ``--check`` fails if they are stale.

python scripts/gen_protos.py          # write
python scripts/gen_protos.py --check  # CI: compare with a fresh generation
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTOS = ROOT / "protos"
PACKAGE = Path("expertmesh") / "v1"


def generate(out: Path) -> list[Path]:
    files = sorted(str(p.relative_to(PROTOS)) for p in (PROTOS / PACKAGE).glob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTOS}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / PACKAGE).glob("*_pb2*.py*"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    check = ap.parse_args().check
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
        target = ROOT / PACKAGE
        stale = [
            f.name
            for f in fresh
            if not (target / f.name).exists() or not filecmp.cmp(f, target / f.name, False)
        ]
        extra = {p.name for p in target.glob("*_pb2*.py*")} - {f.name for f in fresh}
        if check:
            if stale or extra:
                print(
                    f"generated protos are stale: {sorted(stale) + sorted(extra)}; run python scripts/gen_protos.py"
                )
                return 1
            print("generated protos are current")
            return 0
        target.mkdir(parents=True, exist_ok=True)
        for f in fresh:
            shutil.copy(f, target / f.name)
        for name in extra:
            (target / name).unlink()
        (target / "__init__.py").touch()
        print(f"wrote {len(fresh)} files to {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
