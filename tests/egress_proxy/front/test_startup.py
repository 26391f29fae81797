"""What both front ends load before anything listens (egress_proxy/front/startup.py): bad test routing is a
StartupError naming the entry, and a taken address is named in the operating system's words."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

from egress_proxy.front.startup import StartupError, bind_error, gate, parse_connect_to, parse_resolve


def test_routing_entries_are_normalized_or_refused_by_name():
    assert parse_resolve(["API.Acme-Test.dev=127.0.0.1,::1"]) == {"api.acme-test.dev": ("127.0.0.1", "::1")}
    assert parse_connect_to(["api.acme-test.dev:443:127.0.0.1:8443"]) == {("api.acme-test.dev", 443): ("127.0.0.1", 8443)}
    for bad, parse in (("a=not-an-ip", parse_resolve), ("=1.2.3.4", parse_resolve), ("a:443:name:1", parse_connect_to), ("a:0:1.2.3.4:1", parse_connect_to)):
        with pytest.raises(StartupError) as refused:
            parse([bad])
        assert f"`{bad}`" in refused.value.message


def test_a_taken_address_is_named_in_the_systems_words():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        assert bind_error(held.getsockname()) == "address already in use"


def test_a_front_end_whose_head_limits_admit_more_than_the_proof_assumed_does_not_start(tmp_path):
    """The proof's capacity figures count the heads its assumed limits admit (docs/budget.md): a front end started
    with a larger --max-head-bytes, --max-headers or --max-request-line would carry more than the report says, so the
    gate refuses it, naming the flag and both values; the assumed values themselves (or less) start."""
    from tests.proxy_harness import build_artifact, proof_for, proof_signing_key

    artifact = build_artifact()
    (tmp_path / "a.json").write_text(artifact.model_dump_json())
    (tmp_path / "p.json").write_text(proof_for(artifact))
    assumed = json.loads((tmp_path / "p.json").read_text())["capacity"]["limits"]
    assert assumed == {"max_head_bytes": 65536, "max_headers": 100, "max_request_line": 8192}

    def config(**limits):
        settings = dict(artifact=str(tmp_path / "a.json"), proof=str(tmp_path / "p.json"), allow_unproven=False,
                        trust_proofs=str(proof_signing_key()[1]), allow_unsigned_proofs=False, require_within=None,
                        max_head_bytes=65536, max_headers=100)
        return SimpleNamespace(**{**settings, **limits})

    assert gate(config(max_request_line=8192)).assumed == tuple(sorted(assumed.items()))
    assert gate(config(max_request_line=4096)).artifact.digest == artifact.digest
    for flag, limits in (("--max-head-bytes", {"max_head_bytes": 65537}), ("--max-headers", {"max_headers": 101}),
                         ("--max-request-line", {"max_request_line": 1 << 20})):
        cfg = config(**{"max_request_line": 8192, **limits})
        with pytest.raises(StartupError) as err:
            gate(cfg)
        assert flag in err.value.message and "assumed" in err.value.message and err.value.help.startswith(f"pass {flag} ")
