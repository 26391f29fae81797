"""The proxy's CA: created once, private key kept beside it, a bad directory refused with a message."""

from __future__ import annotations

import stat

import pytest
from cryptography import x509

from egress_proxy.front.ca import ca_certificate
from egress_proxy.front.startup import StartupError


def test_the_ca_is_created_once_and_its_directory_is_private(tmp_path) -> None:
    path = ca_certificate(tmp_path / "conf")
    cert = x509.load_pem_x509_certificate(path.read_bytes())
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert stat.S_IMODE((tmp_path / "conf").stat().st_mode) == 0o700
    assert b"PRIVATE KEY" not in path.read_bytes()  # clients get the certificate, never the key
    assert ca_certificate(tmp_path / "conf").read_bytes() == path.read_bytes()  # not made again


def test_a_file_is_no_confdir(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(StartupError, match="not a directory"):
        ca_certificate(tmp_path / "f")
