"""Optional TLS on every gRPC hop: one frozen :class:`TLSConfig` (three PEM files) and the gRPC
credentials, ports and channels made from it.

- A server with ``--tls-cert`` and ``--tls-key`` serves TLS only (a plaintext client fails its
  handshake); with ``--tls-ca`` as well, an expert server also REQUIRES a client certificate
  signed by that CA (mutual TLS: only the coordinator, holding such a certificate, gets in).
  The coordinator's public port never requires one (its clients are users: the admin token
  guards its Admin service).
- A client with ``--tls-ca`` verifies the server's certificate against that CA (without it:
  the system's roots); with ``--tls-cert``/``--tls-key`` it presents its own certificate
  (the coordinator does towards the expert servers). ``--tls-server-name`` checks the server's
  certificate against that name instead of the host in the address (certificates issued for a
  DNS name, servers reached by IP).

Every flag has an environment variable (``EXPERTMESH_TLS_CERT``, ``..._KEY``, ``..._CA``,
``..._SERVER_NAME``); the flag wins.

The shared-memory and CUDA IPC fast paths (same host only) are set up by a handshake that
travels inside the Forward stream, i.e. over the TLS channel when TLS is on; the tensors they
carry then never leave the host's memory (the coordinator creates its ``/dev/shm`` segments mode
0600: only processes of its own user can open them), so TLS leaves them on. The TCP data path
(expertmesh/transport/tcp.py) crosses the network: with TLS configured its port serves TLS with
the same certificate (client certificates required with a CA), and the coordinator wraps its
connection with its own ``--tls-*`` settings.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from expertmesh.errors import BindError

ENV = {"cert": "EXPERTMESH_TLS_CERT", "key": "EXPERTMESH_TLS_KEY", "ca": "EXPERTMESH_TLS_CA",
       "server_name": "EXPERTMESH_TLS_SERVER_NAME"}  # fmt: skip


class TLSError(ValueError):
    pass


@dataclass(frozen=True)
class TLSConfig:
    cert: str | None = None  # PEM certificate chain (this side's identity)
    key: str | None = None  # PEM private key of ``cert``
    ca: str | None = None  # PEM CA bundle: verifies the peer (server: requires client certificates)
    server_name: str | None = None  # client side: expected name in the server's certificate

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise TLSError("--tls-cert and --tls-key go together (one was given without the other)")
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-ca", self.ca)):
            if path and not Path(path).is_file():
                raise TLSError(f"{flag} {path}: no such file")

    @property
    def server_enabled(self) -> bool:
        """A server serves TLS when it has a certificate and key."""
        return bool(self.cert)

    @property
    def client_enabled(self) -> bool:
        """A client talks TLS when given anything TLS (a CA to trust, or its own certificate)."""
        return bool(self.cert or self.ca or self.server_name)

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    def server_credentials(self, require_client_cert: bool) -> grpc.ServerCredentials:
        """``require_client_cert`` (expert servers) takes effect only with a CA to check against."""
        key, cert, ca = self._read(self.key), self._read(self.cert), self._read(self.ca)
        assert key is not None and cert is not None, "server_credentials without --tls-cert/--tls-key"
        return grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=ca, require_client_auth=bool(require_client_cert and ca)
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca),
            private_key=self._read(self.key),
            certificate_chain=self._read(self.cert),
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TLSConfig:
        def pick(name: str) -> str | None:
            return getattr(args, f"tls_{name}", None) or os.environ.get(ENV[name]) or None

        return cls(pick("cert"), pick("key"), pick("ca"), pick("server_name"))

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser, role: str) -> None:
        """``role``: "expert-server" | "coordinator" | "client" (only the help texts differ)."""
        g = p.add_argument_group("TLS (see the Security section of the README)")
        mine = {
            "expert-server": "serve TLS only, with this certificate",
            "coordinator": "serve TLS only, with this certificate; also presented to the expert servers",
            "client": "client certificate to present (mutual TLS)",
        }[role]
        ca = {
            "expert-server": "require client certificates signed by this CA (mutual TLS)",
            "coordinator": "CA that signed the expert servers' certificates (verify them)",
            "client": "CA that signed the server's certificate (default: the system's roots)",
        }[role]
        g.add_argument("--tls-cert", default=None, metavar="PEM", help=f"{mine} (env {ENV['cert']})")
        g.add_argument(
            "--tls-key", default=None, metavar="PEM", help=f"private key of --tls-cert (env {ENV['key']})"
        )
        g.add_argument("--tls-ca", default=None, metavar="PEM", help=f"{ca} (env {ENV['ca']})")
        if role != "expert-server":
            g.add_argument(
                "--tls-server-name",
                default=None,
                metavar="NAME",
                help=f"name the server's certificate must carry, if not the address's host (env {ENV['server_name']})",
            )


def add_port(
    server: Any, address: str, tls: TLSConfig | None, require_client_cert: bool = False, flag: str = "--port"
) -> int:
    """Binds ``address`` on a grpc (sync or aio) server, TLS when ``tls`` has a certificate.
    Returns the port; raises :class:`BindError` (naming ``flag``) when it cannot bind."""
    try:
        if tls is not None and tls.server_enabled:
            port = int(server.add_secure_port(address, tls.server_credentials(require_client_cert)))
        else:
            port = int(server.add_insecure_port(address))
    except RuntimeError:  # NOTE: grpcio raises "Failed to bind" where older versions returned 0
        port = 0
    if port == 0:
        raise BindError(address, flag)
    return port


def channel(address: str, tls: TLSConfig | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if tls is not None and tls.client_enabled:
        return grpc.secure_channel(address, tls.channel_credentials(), [*options, *tls.channel_options()])
    return grpc.insecure_channel(address, options=list(options))


def aio_channel(
    address: str, tls: TLSConfig | None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.aio.Channel:
    if tls is not None and tls.client_enabled:
        return grpc.aio.secure_channel(address, tls.channel_credentials(), [*options, *tls.channel_options()])
    return grpc.aio.insecure_channel(address, options=list(options))


# what a plaintext client sees of a TLS server: it closes the connection at the first bytes
_PLAINTEXT_AT_TLS = "Socket closed"


def plaintext_hint(code: grpc.StatusCode, details: str, tls: TLSConfig | None) -> str:
    """A hint to add to an error that looks like a plaintext client meeting a TLS server ("")."""
    if code != grpc.StatusCode.UNAVAILABLE or (tls is not None and tls.client_enabled):
        return ""
    if _PLAINTEXT_AT_TLS not in details:
        return ""
    return " (if the server uses TLS, pass --tls-ca CA.pem; in Python, tls=TLSConfig(ca=...))"
