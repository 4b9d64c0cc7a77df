"""Who may call the control plane: shared-secret tokens and loopback-only peers (pure: strings
in, a typed error or nothing out; the servicers read the metadata and the peer).

- Expert servers started with a cluster token (``--cluster-token`` / ``EXPERTMESH_CLUSTER_TOKEN``)
  refuse ``ApplyPlacement``, ``LoadAdapter`` and ``UnloadAdapter`` without it; the coordinator
  sends it with every such call.
- The coordinator's ``Admin`` service with an admin token (``--admin-token`` /
  ``EXPERTMESH_ADMIN_TOKEN``) needs it on every call; without one it answers loopback and
  unix-socket peers only.

Both tokens travel as gRPC metadata ``authorization: Bearer TOKEN``. Each can also be read from
a file named by ``<VARIABLE>_FILE`` (e.g. ``EXPERTMESH_CLUSTER_TOKEN_FILE``, the way container
secrets are handed over): neither then shows in ``ps`` or ``docker inspect``.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from expertmesh.errors import PermissionDenied, Unauthenticated

HEADER = "authorization"
CLUSTER_TOKEN_ENV = "EXPERTMESH_CLUSTER_TOKEN"
ADMIN_TOKEN_ENV = "EXPERTMESH_ADMIN_TOKEN"


class TokenFileError(ValueError):
    pass


def token_from_env(name: str) -> str | None:
    """``$NAME``, else the first line of the file ``$NAME_FILE`` names, else None (empty = None)."""
    value = os.environ.get(name)
    if value:
        return value
    path = os.environ.get(f"{name}_FILE")
    if not path:
        return None
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise TokenFileError(f"{name}_FILE={path}: cannot read the token: {e.strerror}") from None
    return lines[0].strip() if lines and lines[0].strip() else None


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata that carries ``token`` (none without one)."""
    return ((HEADER, f"Bearer {token}"),) if token else ()


def check_token(expected: str | None, received: Iterable[tuple[str, str | bytes]] | None, what: str) -> None:
    """Raises Unauthenticated unless ``received`` metadata carries ``expected`` (no token set:
    anything passes)."""
    if not expected:
        return
    for key, value in received or ():
        if key.lower() == HEADER:
            v = value.decode(errors="replace") if isinstance(value, bytes) else value
            # NOTE: constant-time comparison: a token is a secret
            if hmac.compare_digest(v.encode(), f"Bearer {expected}".encode()):
                return
    raise Unauthenticated(f"{what} needs the token: metadata '{HEADER}: Bearer <token>' missing or wrong")


def is_local_peer(peer: str) -> bool:
    """``context.peer()`` strings: ``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:/path``."""
    if peer.startswith(("unix:", "unix-abstract:")):
        return True
    if peer.startswith("ipv4:"):
        return peer[5:].rsplit(":", 1)[0].startswith("127.")
    if peer.startswith("ipv6:"):
        host = peer[5:].rsplit(":", 1)[0].strip("[]")
        return host == "::1" or host.startswith("::ffff:127.")
    return False


def is_loopback_host(host: str) -> bool:
    """An HTTP peer's address (``127.0.0.1``, ``::1``, ``::ffff:127.0.0.1``); names are not."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def check_local(peer: str, what: str) -> None:
    if not is_local_peer(peer):
        raise PermissionDenied(
            f"{what} answers only loopback peers when no admin token is set (this peer: {peer}); "
            "start the coordinator with --admin-token or EXPERTMESH_ADMIN_TOKEN"
        )


def binds_beyond_loopback(host: str) -> bool:
    return host not in ("127.0.0.1", "localhost", "::1", "[::1]") and not host.startswith("127.")
