"""Prints the [project] dependencies of a pyproject.toml, one a line, leaving out the ones named.

    python requirements-from-pyproject.py pyproject.toml [NAME ...]

Used by docker/Dockerfile to install the dependencies in a layer of their own (rebuilt only when
pyproject.toml changes) and to leave out what an image cannot use (triton in a CPU-only image).
"""

from __future__ import annotations

import re
import sys

import tomllib


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(req: str) -> str:
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
    assert match, f"unparsable requirement {req!r}"
    return normalise(match.group(1))


def main(argv: list[str]) -> int:
    path, omit = argv[0], {normalise(n) for n in argv[1:]}
    with open(path, "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    unknown = omit - {requirement_name(d) for d in deps}
    if unknown:
        print(f"error: OMIT_DEPS names {sorted(unknown)}, which {path} does not list", file=sys.stderr)
        return 1
    for dep in deps:
        if requirement_name(dep) not in omit:
            print(dep)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
