"""The independent statements (`proofs/spec/`): they import nothing of egress_proxy, and read the RFCs' own examples right."""

from __future__ import annotations

import ast
import ipaddress
from pathlib import Path

import pytest
import z3

from catalog import load_catalog
from proofs.spec import requests as spec_requests
from proofs.spec.addresses import AddressSpec, carried
from tests.egress_proxy.builders import worker

SPEC_DIR = Path(__file__).resolve().parents[2] / "proofs" / "spec"
TABLE = load_catalog("2026.11").special_purpose


def test_the_statements_share_no_code_with_the_implementation():
    for path in SPEC_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert not (node.module or "").startswith(("egress_proxy", "compiler.constants", "compiler.normalize")), path
            elif isinstance(node, ast.Import):
                assert not any(a.name.startswith("egress_proxy") for a in node.names), path


def _carries(addr: str, nat64=()) -> set[str]:
    ctx = z3.Context()
    x = z3.BitVecVal(int(ipaddress.IPv6Address(addr)), 128, ctx)
    out = set()
    for matches, v4, _ in carried(x, nat64):
        if matches is True or z3.is_true(z3.simplify(matches)):
            out.add(str(ipaddress.IPv4Address(z3.simplify(v4).as_long())))
    return out


@pytest.mark.parametrize(
    ("addr", "prefix"),
    [  # RFC 6052 section 2.4, 192.0.2.33 under each prefix length
        ("2001:db8:c000:221::", "2001:db8::/32"),
        ("2001:db8:1c0:2:21::", "2001:db8:100::/40"),
        ("2001:db8:122:c000:2:2100::", "2001:db8:122::/48"),
        ("2001:db8:122:3c0:0:221::", "2001:db8:122:300::/56"),
        ("2001:db8:122:344:c0:2:2100:0", "2001:db8:122:344::/64"),
        ("2001:db8:122:344::192.0.2.33", "2001:db8:122:344::/96"),
    ],
)
def test_rfc6052_examples(addr, prefix):
    assert "192.0.2.33" in _carries(addr, (prefix,))


def test_other_rfc_examples():
    assert _carries("64:ff9b::192.0.2.33") >= {"192.0.2.33"}  # RFC 6052 2.4, well-known prefix
    assert _carries("::ffff:192.0.2.128") >= {"192.0.2.128"}  # RFC 4291 2.5.5.2
    assert _carries("2002:c000:22a::1") >= {"192.0.2.42"}  # RFC 3056: 2002:V4ADDR::/48
    # RFC 4380 section 4: client 192.0.2.45 is carried inverted (3fff:fdd2)
    assert _carries("2001:0:4136:e378:8000:63bf:3fff:fdd2") >= {"192.0.2.45"}
    for marker in ("0:5efe", "100:5efe", "200:5efe", "300:5efe"):  # RFC 5214 6.1: u and g free
        assert _carries(f"2001:db8::{marker}:c000:22a") >= {"192.0.2.42"}
    assert "192.0.2.42" not in _carries("2001:db8::400:5efe:c000:22a")


def test_public_and_denied_read_the_table_and_the_settings():
    ctx = z3.Context()
    spec = AddressSpec(ctx, TABLE, worker(deny_cidrs=("8.8.8.0/24",), ipv6=False))

    def ask(term_fn, addr: str) -> bool:
        ip = ipaddress.ip_address(addr)
        return z3.is_true(z3.simplify(term_fn(z3.BoolVal(ip.version == 6, ctx), z3.BitVecVal(int(ip), 128, ctx))))

    assert ask(spec.public, "8.8.8.8") and not ask(spec.public, "100.64.0.1") and not ask(spec.public, "::ffff:10.0.0.1")
    assert ask(spec.public, "::ffff:8.8.8.8")  # a handle form: only what it carries is judged
    assert not ask(spec.public, "fd00::1") and not ask(spec.public, "2002:a00:1::1")
    assert ask(spec.denied, "8.8.8.8") and not ask(spec.denied, "8.8.4.4") and ask(spec.denied, "2600::1")  # ipv6 = false


def test_header_denylist_is_the_spec_list():
    assert spec_requests.denied_text("X-Forwarded-Host", None) and spec_requests.denied_text("X-Api-Key", "x-api-key")
    assert not spec_requests.denied_text("accept", "authorization")
    # every name SPEC 2.1 lists is in the implementation's denylist too (the implementation may deny more)
    from compiler.constants import header_is_denylisted

    assert all(header_is_denylisted(n) for n in spec_requests.DENYLIST)


def test_every_name_the_implementation_denylists_is_in_the_statement():
    """The code's denylist may not be wider than the statement: a name the statement lacks could be dropped from the
    code and still "prove" (issue 20: `x-http-method`). Each name and prefix of the code is denied by the statement."""
    from compiler.constants import HEADER_DENYLIST, HEADER_DENYLIST_PREFIXES

    missing = sorted(n for n in HEADER_DENYLIST if not spec_requests.denied_text(n, None))
    assert not missing, f"compiler.constants denylists {missing}; proofs/spec/requests.py must state them too"
    assert set(HEADER_DENYLIST_PREFIXES) <= set(spec_requests.DENYLIST_PREFIXES)


def test_the_headers_a_kind_writes_at_the_edge_are_stated_as_the_code_has_them():
    """SigV4's signing headers: the statement's transcription and the code's data name the same headers, both ways."""
    from compiler.constants import CREDENTIAL_KINDS, EDGE_HEADERS

    assert spec_requests.EDGE_WRITTEN == EDGE_HEADERS and set(EDGE_HEADERS) <= set(CREDENTIAL_KINDS)
    assert spec_requests.denied_text("X-Amz-Date", None, "aws_sigv4") and not spec_requests.denied_text("X-Amz-Date", None)
