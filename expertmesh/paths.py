"""Path confinement: a path named by a client (an RPC or HTTP request) is used only when it lies
under one of the directories the operator gave at start (pure: strings in, a resolved Path or
:class:`PathNotAllowed` out).

Both sides are resolved first (``..`` and every symlink followed, relative paths taken from the
server's working directory), so neither ``root/../etc`` nor a symlink inside a root that points
out of it gets through. No roots: nothing is allowed (the safe default).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


class PathNotAllowed(PermissionError):
    pass


def resolve_roots(roots: Iterable[str | Path]) -> tuple[Path, ...]:
    return tuple(Path(r).resolve() for r in roots)


def is_under(path: Path, roots: Iterable[Path]) -> bool:
    """``path`` and ``roots`` already resolved."""
    return any(path == r or r in path.parents for r in roots)


def confine(path: str | Path, roots: tuple[Path, ...], what: str, flag: str) -> Path:
    """The resolved ``path`` if it lies under a (resolved) root, else PathNotAllowed naming
    ``flag`` (the command-line option that sets the roots)."""
    if not str(path):
        raise PathNotAllowed(f"{what}: an empty path")
    try:
        resolved = Path(path).resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop, a name too long
        raise PathNotAllowed(f"{what} {str(path)!r}: cannot resolve: {e}") from None
    if not is_under(resolved, roots):
        shown = ", ".join(str(r) for r in roots) or f"none given ({flag})"
        raise PathNotAllowed(f"{what} {str(path)!r} is not under a {flag} root ({shown})")
    return resolved
