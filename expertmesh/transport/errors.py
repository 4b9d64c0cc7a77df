"""Errors of the fast paths, carried as gRPC status codes like those of the plain path."""

from __future__ import annotations

import grpc

_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


class Rejected(Exception):
    """A request refused by the server, or a fast-path channel that failed: ``code`` is a
    grpc.StatusCode, ``message`` says why (the same words the gRPC path would send)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def code_value(code: grpc.StatusCode) -> int:
    return int(code.value[0])


def code_of(value: int) -> grpc.StatusCode:
    return _BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)
