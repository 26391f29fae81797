"""The lane's leaf certificates: one per host it terminates TLS for, signed by the proxy CA the sandbox trusts.

The hosts are exactly the served profiles' allowlist hosts (`envoy.hosts_needing_certificates`), so the
certificates are written once per configuration, not minted per connection. Each names its one host (subject
alternative name, no wildcard); all share one P-256 key, kept 0600 in the lane's 0700 run directory.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from egress_proxy.errors import EgressError
from egress_proxy.lane.envoy import LEAF_KEY

VALIDITY = datetime.timedelta(days=365)


class CertificateError(EgressError):
    """The proxy CA cannot be read or used."""


def load_ca(path: Path) -> tuple[x509.Certificate, object]:
    """The CA certificate and key from one PEM file (mitmproxy's `mitmproxy-ca.pem` holds both)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CertificateError(f"cannot read the proxy CA `{path}`: {exc.strerror}") from None
    try:
        key = serialization.load_pem_private_key(data, password=None)
        cert = x509.load_pem_x509_certificate(data)
    except ValueError:
        raise CertificateError(f"`{path}` does not hold a PEM certificate and its private key") from None
    return cert, key


def write_leaves(ca_path: Path, hosts: Iterable[str], out_dir: Path, *, now: datetime.datetime | None = None) -> list[Path]:
    """Write `<host>.pem` (leaf + CA) for every host, and the shared key; the files written."""
    ca_cert, ca_key = load_ca(ca_path)
    out_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_path = out_dir / LEAF_KEY
    if key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    else:
        key = ec.generate_private_key(ec.SECP256R1())
        fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    now = now or datetime.datetime.now(datetime.timezone.utc)
    ca_pem = ca_cert.public_bytes(serialization.Encoding.PEM)
    written = [key_path]
    for host in hosts:
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())  # type: ignore[union-attr]
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(min(now + VALIDITY, ca_cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(host)]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        path = out_dir / f"{host}.pem"
        tmp = out_dir / f".{host}.pem.tmp"
        tmp.write_bytes(cert.public_bytes(serialization.Encoding.PEM) + ca_pem)
        tmp.replace(path)
        written.append(path)
    return written
