"""Certificates made at test time with ``cryptography`` (a test dependency): a CA and leaf
certificates it signs, for localhost / 127.0.0.1. (No tests here.)"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from expertmesh.tls import TLSConfig


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())  # fast to make, unlike RSA


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )


@dataclass
class CA:
    name: str
    key: ec.EllipticCurvePrivateKey
    cert: x509.Certificate
    path: Path  # the CA certificate (PEM)

    @classmethod
    def make(cls, out: Path, name: str) -> CA:
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(key, hashes.SHA256())
        )
        path = out / f"{name}-ca.pem"
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return cls(name, key, cert, path)

    def issue(self, out: Path, cn: str, server: bool = True, client: bool = True) -> TLSConfig:
        """A leaf for localhost and 127.0.0.1; returns its cert/key (and this CA) as a TLSConfig."""
        key = _key()
        now = datetime.datetime.now(datetime.timezone.utc)
        usages = [
            u
            for u, on in (
                (ExtendedKeyUsageOID.SERVER_AUTH, server),
                (ExtendedKeyUsageOID.CLIENT_AUTH, client),
            )
            if on
        ]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        cert_path, key_path = out / f"{self.name}-{cn}.pem", out / f"{self.name}-{cn}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, key_path)
        return TLSConfig(str(cert_path), str(key_path), str(self.path))
