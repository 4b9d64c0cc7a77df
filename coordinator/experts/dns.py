"""Expert servers named by a DNS name that resolves to several addresses (``--gpu-server
dns:///NAME:PORT``, e.g. a Kubernetes headless Service): parsing and resolution.

Pure but for the resolver, which is passed in (``socket.getaddrinfo`` by default, a table in
tests), so the code that runs is the one a cluster runs. The cluster re-resolves the names
periodically (coordinator/experts/membership.py, ``--dns-refresh-s``: servers join and leave as
the answers change); ClusterConfig.resolved (coordinator/experts/cluster_config.py) turns each
name into one server per address at start.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("expertmesh.cluster")

PREFIX = "dns:///"
# (host, port) -> the addresses it resolves to now ("IP:PORT", "[IPv6]:PORT"); raises OSError
Resolver = Callable[[str, int], Sequence[str]]


@dataclass(frozen=True)
class DnsName:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{PREFIX}{self.host}:{self.port}"


def parse(address: str) -> DnsName | None:
    """``dns:///NAME:PORT`` -> DnsName; any other address -> None (a plain HOST:PORT).
    Raises ValueError for a malformed ``dns:`` address (no port, an authority, ...)."""
    if not address.startswith("dns:"):
        return None
    if not address.startswith(PREFIX):
        raise ValueError(
            f"{address!r}: expected dns:///NAME:PORT (a DNS server in the authority is not supported)"
        )
    host, sep, port = address[len(PREFIX) :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: expected dns:///NAME:PORT with a port in 1..65535")
    if "/" in host or host.startswith("["):
        raise ValueError(f"{address!r}: expected a DNS name, not {host!r}")
    return DnsName(host, int(port))


def join(ip: str, port: int) -> str:
    """An address gRPC accepts: IPv6 in brackets."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


def getaddrinfo(host: str, port: int) -> list[str]:
    """The system resolver (what the pod's /etc/resolv.conf and /etc/hosts say)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [join(str(sockaddr[0]), port) for _family, _type, _proto, _name, sockaddr in infos]


def resolver_for(hosts_file: str | None) -> Resolver:
    """getaddrinfo, or, with ``hosts_file`` (``--dns-hosts-file``), that file first: lines
    ``IP NAME...`` as in /etc/hosts, read at every lookup so that editing it changes the answers
    (machines without DNS records for their expert servers; the tests' loopback clusters)."""
    if hosts_file is None:
        return getaddrinfo
    path = Path(hosts_file)

    def lookup(host: str, port: int) -> list[str]:
        ips = [
            fields[0]
            for line in path.read_text().splitlines()
            if (fields := line.split("#", 1)[0].split()) and host in fields[1:]
        ]
        return [join(ip, port) for ip in ips] if ips else getaddrinfo(host, port)

    return lookup


def resolve(name: DnsName, resolver: Resolver = getaddrinfo) -> tuple[str, ...]:
    """The name's addresses, sorted and without repeats (the order gives servers their names,
    so it must not depend on the DNS server's rotation)."""
    return tuple(sorted(set(resolver(name.host, name.port))))


def wait_resolved(name: DnsName, resolver: Resolver, wait_s: float) -> tuple[str, ...]:
    """:func:`resolve`, retried for ``wait_s`` while it finds nothing (the servers may not have
    addresses yet), then ValueError."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            addresses = resolve(name, resolver)
            why = "no address"
        except OSError as e:
            addresses, why = (), str(e)
        if addresses:
            return addresses
        if time.monotonic() >= deadline:
            raise ValueError(f"{name} resolves to no address after {wait_s:g}s ({why})")
        log.info("%s: %s yet, retrying", name, why)
        time.sleep(1.0)
