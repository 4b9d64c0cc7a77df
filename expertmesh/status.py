"""The gRPC edge of :mod:`expertmesh.errors`: typed errors <-> ``grpc.StatusCode``.

Imported only by the servicers and the coordinator's connection (and the fast path's
coordinator-side channel, which reports its failures like the gRPC stream it rides on).
"""

from __future__ import annotations

import grpc

from expertmesh import errors

_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def code_of(status: int) -> grpc.StatusCode:
    return _BY_VALUE.get(status, grpc.StatusCode.UNKNOWN)


def grpc_code(err: errors.ExpertMeshError) -> grpc.StatusCode:
    return code_of(err.status)


def status_of(code: grpc.StatusCode) -> int:
    return int(code.value[0])


def from_rpc_error(e: grpc.RpcError) -> errors.ExpertMeshError:
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else str(e)
    return errors.from_status(status_of(code), details or code.name)
