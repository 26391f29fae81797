"""The proxy's CA: the certificate clients trust for interception (the edge's CONNECT and the lane's tunnels), created
once per configuration directory.

Written in mitmproxy's own layout (`mitmproxy-ca.pem`: key and certificate; `mitmproxy-ca-cert.pem`: what clients
trust), so the edge's mitmproxy and the lane's leaf signer (`egress_proxy.lane.certs`) share one CA, and with
`cryptography` alone, so the lane's process never imports mitmproxy.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from egress_proxy.front.startup import StartupError

CA_NAME = "mitmproxy"
CA_KEY_AND_CERTIFICATE = "mitmproxy-ca.pem"  # the key: never leaves the directory (mode 0600)
CA_CERTIFICATE = "mitmproxy-ca-cert.pem"  # what clients trust
CA_LIFETIME = datetime.timedelta(days=10 * 365)
BACKDATE = datetime.timedelta(days=2)  # clients with a slow clock still accept it (mitmproxy's own margin)


def _create(root: Path) -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME), x509.NameAttribute(NameOID.ORGANIZATION_NAME, CA_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().serial_number(x509.random_serial_number()).subject_name(name).issuer_name(name)
        .not_valid_before(now - BACKDATE).not_valid_after(now - BACKDATE + CA_LIFETIME).public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False),
                       critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    pem = cert.public_bytes(serialization.Encoding.PEM)
    secret = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption())
    staged = root / f".{CA_KEY_AND_CERTIFICATE}.{os.getpid()}"
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secret + pem)
    public = root / f".{CA_CERTIFICATE}.{os.getpid()}"
    public.write_bytes(pem)
    public.replace(root / CA_CERTIFICATE)
    os.replace(staged, root / CA_KEY_AND_CERTIFICATE)  # last: its presence says the CA is whole


def ca_certificate(confdir: str | Path) -> Path:
    """`<confdir>/mitmproxy-ca-cert.pem`, with the CA (key kept private in the same directory) created on first use."""
    root = Path(confdir).expanduser()
    if root.exists() and not root.is_dir():
        raise StartupError(f"--confdir `{root}` is not a directory", "pass a directory (it is created if missing)")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not (root / CA_KEY_AND_CERTIFICATE).exists():
            _create(root)
        elif not (root / CA_CERTIFICATE).exists():
            cert = x509.load_pem_x509_certificates((root / CA_KEY_AND_CERTIFICATE).read_bytes())[0]
            (root / CA_CERTIFICATE).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot create the CA in `{root}`: {exc.__class__.__name__}") from None
    return root / CA_CERTIFICATE
