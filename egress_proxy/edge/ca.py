"""The proxy's CA: the certificate clients trust for CONNECT interception, created once per configuration dir."""

from __future__ import annotations

from pathlib import Path

from mitmproxy import certs

from egress_proxy.edge.startup import StartupError

CA_NAME = "mitmproxy"
CA_CERTIFICATE = "mitmproxy-ca-cert.pem"  # what clients trust; the key (`mitmproxy-ca.pem`) stays in the directory


def ca_certificate(confdir: str | Path) -> Path:
    """`<confdir>/mitmproxy-ca-cert.pem`, with the CA (key kept private in the same directory) created on first use."""
    root = Path(confdir).expanduser()
    if root.exists() and not root.is_dir():
        raise StartupError(f"--confdir `{root}` is not a directory", "pass a directory (it is created if missing)")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        certs.CertStore.from_store(root, CA_NAME, 2048)
    except (OSError, ValueError) as exc:
        raise StartupError(f"cannot create the CA in `{root}`: {exc.__class__.__name__}") from None
    return root / CA_CERTIFICATE
