"""How the coordinator's end of a fast path reports a failure: :class:`Rejected` wraps the typed
library error (:mod:`expertmesh.errors`) and, because the fast path rides on a gRPC stream and
is part of the coordinator's connection, also says which gRPC status the plain path would have
given. The server's end (transport/server.py) deals in typed errors and status numbers only."""

from __future__ import annotations

from expertmesh import status
from expertmesh.errors import ExpertMeshError, Unavailable


class Rejected(Exception):
    """A request refused by the server, or a fast-path channel that failed: ``error`` is the
    typed error, ``code`` its grpc.StatusCode, ``message`` the words the gRPC path would send."""

    def __init__(self, error: ExpertMeshError) -> None:
        super().__init__(error.message)
        self.error, self.message = error, error.message
        self.code = status.grpc_code(error)


class MalformedAnswer(Unavailable):
    """An expert server's answer that is not the layer's output (a tensor that does not decode,
    a wrong shape or dtype for the rows sent, a corrupted fast-path descriptor): the SERVER
    failed, not the request, so its status is UNAVAILABLE and the coordinator sends the rows to
    a live replica."""
