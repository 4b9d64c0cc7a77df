"""Typed errors of the expert path, free of gRPC.

Library code (worker core, slot table, transports, the coordinator's cluster) raises these; only
the gRPC edges (the servicers and the coordinator's connection, through
:mod:`expertmesh.status`) turn them into gRPC status codes, by class, never by reading the
message. ``status`` uses the gRPC / google.rpc.Code numbering so that the shared-memory
descriptor can carry it as a plain integer.
"""

from __future__ import annotations

from typing import ClassVar

# google.rpc.Code numbers (the same values grpc.StatusCode carries)
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED = 0, 1, 2, 3, 4
PERMISSION_DENIED, FAILED_PRECONDITION, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 7, 9, 12, 13, 14
UNAUTHENTICATED = 16


class ExpertMeshError(Exception):
    """Base class: ``message`` says what went wrong, in words a user can act on."""

    status: ClassVar[int] = UNKNOWN

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(ExpertMeshError):
    """Bad shapes, dtypes, ids, layers, adapter slots: the caller's fault, nothing to retry."""

    status = INVALID_ARGUMENT


class StaleGeneration(ExpertMeshError):
    """A request or placement phase names a placement generation that is not (or no longer)
    the one it must be."""

    status = FAILED_PRECONDITION


class Incompatible(ExpertMeshError):
    """Coordinator and server cannot work together as configured (another model, too few
    slots, a required fast path that is impossible)."""

    status = FAILED_PRECONDITION


class Unavailable(ExpertMeshError):
    """A server is down, draining, not ready, or its channel died."""

    status = UNAVAILABLE


class DeadlineExceeded(ExpertMeshError):
    status = DEADLINE_EXCEEDED


class Cancelled(ExpertMeshError):
    status = CANCELLED


class Unimplemented(ExpertMeshError):
    status = UNIMPLEMENTED


class Unauthenticated(ExpertMeshError):
    """A control call without the right token."""

    status = UNAUTHENTICATED


class PermissionDenied(ExpertMeshError):
    """A caller this service does not answer (e.g. Admin from a non-loopback peer, no token set)."""

    status = PERMISSION_DENIED


class Internal(ExpertMeshError):
    """A bug or a corrupted answer: never the caller's fault."""

    status = INTERNAL


class BindError(OSError):
    """A port this process cannot listen on; the message names the address and the flag that
    chose it (entry points print it as one line, no traceback)."""

    def __init__(self, address: str, flag: str, why: str = "") -> None:
        because = f" ({why})" if why else ""
        super().__init__(
            f"cannot listen on {address}{because}: the port is in use or the address is not this "
            f"host's; choose another with {flag} (0 = a free port)"
        )


_BY_STATUS: dict[int, type[ExpertMeshError]] = {
    InvalidRequest.status: InvalidRequest,
    FAILED_PRECONDITION: StaleGeneration,
    Unavailable.status: Unavailable,
    DeadlineExceeded.status: DeadlineExceeded,
    Cancelled.status: Cancelled,
    Unimplemented.status: Unimplemented,
    Internal.status: Internal,
    Unauthenticated.status: Unauthenticated,
    PermissionDenied.status: PermissionDenied,
}


def from_status(status: int, message: str) -> ExpertMeshError:
    """The typed error for a status number that crossed a process boundary (UNKNOWN -> base)."""
    cls = _BY_STATUS.get(status)
    if cls is None:
        err = ExpertMeshError(message)
        err.status = status  # type: ignore[misc]  # keep the peer's number (e.g. RESOURCE_EXHAUSTED)
        return err
    return cls(message)
